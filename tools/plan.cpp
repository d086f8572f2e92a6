// `tidal plan`: make an offloading plan for a trace on a hardware model.
#include <unistd.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <optional>

#include "commands.hpp"
#include "progress.hpp"
#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"
#include "tidal/plan/bound.hpp"
#include "tidal/plan/hardware.hpp"
#include "tidal/plan/model_trace.hpp"
#include "tidal/plan/order_choice.hpp"
#include "tidal/plan/planner.hpp"
#include "tidal/plan/simulator.hpp"
#include "tidal/trace/io.hpp"
#include "trace_report.hpp"
#include "trace_source.hpp"

namespace tidal::cli {
namespace {

struct PlanArgs {
  TraceSource src;
  std::string out;
  std::string min_bytes;
  bool no_host = false;
  bool prefer_host = false;
  bool no_stage = false;
  bool no_stalls = false;
  bool json = false;
};

plan::PlannerOptions planner_options(const PlanArgs& a) {
  plan::PlannerOptions opt;
  opt.use_host = !a.no_host;
  opt.prefer_host = a.prefer_host;
  opt.stage_via_host = !a.no_stage;
  opt.allow_stalls = !a.no_stalls;
  if (!a.min_bytes.empty()) opt.min_bytes = parse_bytes(a.min_bytes);
  opt.progress = planning_progress();
  return opt;
}

// What `tidal plan` made: the plan of traces[chosen], its simulation and the lower bound, and
// with --micro-batch-order auto the choice between the orders.
struct PlanOutcome {
  std::optional<plan::OrderChoice> choice;
  std::size_t chosen = 0;
  plan::Plan plan;
  plan::SimResult sim;
  plan::StallBound bound;
};

// --micro-batch-order auto: both orders planned and simulated, the faster kept, and the bound
// the lower of the two (no plan on either order beats it).
PlanOutcome plan_source(const LoadedSource& src, const plan::PlannerOptions& opt) {
  const plan::Hardware& hw = src.hw;
  PlanOutcome o;
  if (src.choose_order()) {
    plan::PolicyOptions po;
    po.planner = opt;
    o.choice =
        plan::choose_fastest_order(src.trace_pointers(), hw, po, fraction_progress("lower bound"));
    const plan::OrderCandidate& best = o.choice->best();
    TIDAL_EXPECT_AS(InvalidArgument, best.tidal.plan.has_value(), best.tidal.note);
    o.chosen = o.choice->chosen;
    o.plan = *best.tidal.plan;
    o.sim = best.tidal.sim;
    o.bound = o.choice->bound();
  } else {
    std::optional<plan::StallBound> planned;
    o.plan = plan::make_plan(src.traces[0], hw, opt, &planned);
    o.sim = plan::simulate(src.traces[0], &o.plan, hw);
    o.bound = planned
                  ? *planned
                  : plan::stall_lower_bound(src.traces[0], hw, fraction_progress("lower bound"));
  }
  return o;
}

void print_order_choice(const plan::OrderChoice& choice) {
  std::printf("micro-batch order: auto chose %s (tidal's plan on", choice.best().order.c_str());
  for (std::size_t i = 0; i < choice.candidates.size(); ++i) {
    const plan::OrderCandidate& c = choice.candidates[i];
    std::printf("%s %s: %s, bound %s, planned in %s%s", i > 0 ? ";" : "", c.order.c_str(),
                format_seconds(c.tidal.sim.iteration_seconds).c_str(),
                format_seconds(c.bound.iteration_seconds).c_str(),
                format_seconds(c.tidal.planning_seconds).c_str(),
                c.tidal.fits ? "" : ", does not fit");
  }
  std::printf(")\n");
}

void print_plan_summary(const trace::Trace& tr, const plan::Hardware& hw, const PlanOutcome& o) {
  const plan::PlanSummary& s = o.plan.summary;
  const plan::SimResult& sim = o.sim;
  const plan::StallBound& bound = o.bound;
  const double cap = static_cast<double>(hw.device_memory);
  auto gb = [](std::uint64_t b) { return format_bytes(static_cast<double>(b)); };
  std::printf("plan for %s (batch %lld, seq %lld): %zu ops, %zu tensors\n", tr.model.c_str(),
              static_cast<long long>(tr.batch), static_cast<long long>(tr.seq), tr.ops.size(),
              tr.tensors.size());
  print_optimizer_step(tr);
  if (o.choice) {
    print_order_choice(*o.choice);
  } else {
    print_micro_batch_order(tr);
  }
  std::printf("hardware %s: %s\n", hw.name.c_str(), hw.describe().c_str());
  std::printf("  peak with everything kept  %s (%.0f%% of device memory)\n",
              gb(s.peak_before_bytes).c_str(),
              100.0 * static_cast<double>(s.peak_before_bytes) / cap);
  std::printf("  planned peak               %s at op %d (target %s)\n",
              gb(s.peak_after_bytes).c_str(), s.peak_after_op, gb(s.target_bytes).c_str());
  std::printf("  inactive periods           %lld considered\n",
              static_cast<long long>(s.candidates));
  std::printf("  offloads to SSD            %lld, %s per iteration\n",
              static_cast<long long>(s.offloads_ssd), gb(s.bytes_to_ssd).c_str());
  std::printf("  offloads to host memory    %lld, %s per iteration, %s at once\n",
              static_cast<long long>(s.offloads_host), gb(s.bytes_to_host).c_str(),
              gb(s.peak_host_bytes).c_str());
  std::printf("  planned stall              %s over %zu ops\n",
              format_seconds(s.planned_stall_seconds).c_str(), o.plan.stalls.size());
  std::printf("  planning time              %s\n", format_seconds(s.planning_seconds).c_str());
  std::printf("  simulated                  iteration %s (compute %s, stall %s), peak %s, %s\n",
              format_seconds(sim.iteration_seconds).c_str(),
              format_seconds(sim.compute_seconds).c_str(),
              format_seconds(sim.stall_seconds).c_str(), gb(sim.peak_bytes).c_str(),
              sim.fits ? "fits" : "DOES NOT FIT");
  std::printf(
      "  lower bound, any plan      stall %s, iteration %s (%.1f%% of ideal at best)%s\n",
      format_seconds(bound.stall_seconds).c_str(), format_seconds(bound.iteration_seconds).c_str(),
      100.0 * sim.compute_seconds / bound.iteration_seconds, o.choice ? ", on either order" : "");
}

void print_plan_json(const trace::Trace& tr, const PlanOutcome& o) {
  nlohmann::json j = nlohmann::json::parse(plan::summary_to_json(o.plan.summary));
  add_trace_meta(j, tr);
  if (o.choice) {
    nlohmann::json orders = nlohmann::json::object();
    for (const auto& c : o.choice->candidates) {
      orders[c.order] = {{"simulated_iteration_seconds", c.tidal.sim.iteration_seconds},
                         {"simulated_fits", c.tidal.fits},
                         {"planning_seconds", c.tidal.planning_seconds},
                         {"lower_bound_iteration_seconds", c.bound.iteration_seconds}};
    }
    j["micro_batch_orders"] = orders;
  }
  j["actions"] = o.plan.actions.size();
  j["simulated_iteration_seconds"] = o.sim.iteration_seconds;
  j["simulated_peak_bytes"] = o.sim.peak_bytes;
  j["simulated_fits"] = o.sim.fits;
  j["simulated_stall_seconds"] = o.sim.stall_seconds;
  j["lower_bound_stall_seconds"] = o.bound.stall_seconds;
  std::printf("%s\n", j.dump().c_str());
}

void run_plan(const PlanArgs& a) {
  stop_on_interrupt("plan");
  const LoadedSource src = load_trace_source(a.src);
  const PlanOutcome o = plan_source(src, planner_options(a));
  const trace::Trace& tr = src.traces[o.chosen];
  print_plan_summary(tr, src.hw, o);
  if (!a.out.empty()) {
    plan::write_plan(o.plan, a.out);
    std::printf("  wrote %zu actions to %s\n", o.plan.actions.size(), a.out.c_str());
  }
  if (a.json) print_plan_json(tr, o);
}

}  // namespace

void add_plan_command(CLI::App& app) {
  auto args = std::make_shared<PlanArgs>();
  auto* cmd = app.add_subcommand("plan", "Make a lifetime-aware offloading plan for a trace");
  add_trace_source_options(cmd, args->src);
  cmd->add_option("--min-bytes", args->min_bytes, "tensors smaller than this stay, e.g. 1MiB");
  cmd->add_flag("--no-host", args->no_host, "never use host memory as a destination");
  cmd->add_flag("--prefer-host", args->prefer_host,
                "host memory before SSDs where both have the bandwidth (fewer SSD writes)");
  cmd->add_flag("--no-stage", args->no_stage,
                "never bring an SSD tensor back through host memory (the plan executor of "
                "`tidal train` does not stage, so its sessions plan this way)");
  cmd->add_flag("--no-stalls", args->no_stalls,
                "do not accept planned stalls (the plan may then not fit)");
  cmd->add_option("--out", args->out, "write the plan JSON here");
  cmd->add_flag("--json", args->json, "print the summary as one JSON line at the end");
  cmd->callback([args] { run_plan(*args); });
}

}  // namespace tidal::cli
