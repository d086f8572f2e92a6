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

void run_plan(const PlanArgs& a) {
  stop_on_interrupt("plan");
  const LoadedSource src = load_trace_source(a.src);
  const plan::Hardware& hw = src.hw;
  plan::PlannerOptions opt;
  opt.use_host = !a.no_host;
  opt.prefer_host = a.prefer_host;
  opt.stage_via_host = !a.no_stage;
  opt.allow_stalls = !a.no_stalls;
  if (!a.min_bytes.empty()) opt.min_bytes = parse_bytes(a.min_bytes);
  opt.progress = planning_progress();
  // --micro-batch-order auto: both orders planned and simulated, the faster kept, and the bound
  // the lower of the two (no plan on either order beats it).
  std::optional<plan::OrderChoice> choice;
  std::size_t chosen = 0;
  plan::Plan p;
  plan::SimResult sim;
  plan::StallBound bound;
  if (src.choose_order()) {
    std::vector<const trace::Trace*> traces;
    for (const auto& t : src.traces) traces.push_back(&t);
    plan::PolicyOptions po;
    po.planner = opt;
    choice = plan::choose_fastest_order(traces, hw, po, fraction_progress("lower bound"));
    const plan::OrderCandidate& best = choice->best();
    TIDAL_EXPECT_AS(InvalidArgument, best.tidal.plan.has_value(), best.tidal.note);
    chosen = choice->chosen;
    p = *best.tidal.plan;
    sim = best.tidal.sim;
    bound = choice->bound();
  } else {
    std::optional<plan::StallBound> planned;
    p = plan::make_plan(src.traces[0], hw, opt, &planned);
    sim = plan::simulate(src.traces[0], &p, hw);
    bound = planned ? *planned
                    : plan::stall_lower_bound(src.traces[0], hw, fraction_progress("lower bound"));
  }
  const trace::Trace& tr = src.traces[chosen];
  const plan::PlanSummary& s = p.summary;
  const double cap = static_cast<double>(hw.device_memory);
  auto gb = [](std::uint64_t b) { return format_bytes(static_cast<double>(b)); };
  std::printf("plan for %s (batch %lld, seq %lld): %zu ops, %zu tensors\n", tr.model.c_str(),
              static_cast<long long>(tr.batch), static_cast<long long>(tr.seq), tr.ops.size(),
              tr.tensors.size());
  if (const auto it = tr.meta.find("optimizer_schedule"); it != tr.meta.end())
    std::printf("optimizer step: %s\n", it->second.c_str());
  if (choice) {
    std::printf("micro-batch order: auto chose %s (tidal's plan on", choice->best().order.c_str());
    for (std::size_t i = 0; i < choice->candidates.size(); ++i) {
      const plan::OrderCandidate& c = choice->candidates[i];
      std::printf("%s %s: %s, bound %s, planned in %s%s", i > 0 ? ";" : "", c.order.c_str(),
                  format_seconds(c.tidal.sim.iteration_seconds).c_str(),
                  format_seconds(c.bound.iteration_seconds).c_str(),
                  format_seconds(c.tidal.planning_seconds).c_str(),
                  c.tidal.fits ? "" : ", does not fit");
    }
    std::printf(")\n");
  } else if (const auto it = tr.meta.find("micro_batch_order"); it != tr.meta.end()) {
    std::printf("micro-batch order: %s\n", it->second.c_str());
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
              format_seconds(s.planned_stall_seconds).c_str(), p.stalls.size());
  std::printf("  planning time              %s\n", format_seconds(s.planning_seconds).c_str());
  std::printf("  simulated                  iteration %s (compute %s, stall %s), peak %s, %s\n",
              format_seconds(sim.iteration_seconds).c_str(),
              format_seconds(sim.compute_seconds).c_str(),
              format_seconds(sim.stall_seconds).c_str(), gb(sim.peak_bytes).c_str(),
              sim.fits ? "fits" : "DOES NOT FIT");
  std::printf(
      "  lower bound, any plan      stall %s, iteration %s (%.1f%% of ideal at best)%s\n",
      format_seconds(bound.stall_seconds).c_str(), format_seconds(bound.iteration_seconds).c_str(),
      100.0 * sim.compute_seconds / bound.iteration_seconds, choice ? ", on either order" : "");
  if (!a.out.empty()) {
    plan::write_plan(p, a.out);
    std::printf("  wrote %zu actions to %s\n", p.actions.size(), a.out.c_str());
  }
  if (a.json) {
    nlohmann::json j = nlohmann::json::parse(plan::summary_to_json(p.summary));
    j["model"] = tr.model;
    if (const auto it = tr.meta.find("optimizer_schedule"); it != tr.meta.end())
      j["optimizer_schedule"] = it->second;
    if (const auto it = tr.meta.find("micro_batch_order"); it != tr.meta.end())
      j["micro_batch_order"] = it->second;
    if (choice) {
      nlohmann::json orders = nlohmann::json::object();
      for (const auto& c : choice->candidates) {
        orders[c.order] = {{"simulated_iteration_seconds", c.tidal.sim.iteration_seconds},
                           {"simulated_fits", c.tidal.fits},
                           {"planning_seconds", c.tidal.planning_seconds},
                           {"lower_bound_iteration_seconds", c.bound.iteration_seconds}};
      }
      j["micro_batch_orders"] = orders;
    }
    j["actions"] = p.actions.size();
    j["simulated_iteration_seconds"] = sim.iteration_seconds;
    j["simulated_peak_bytes"] = sim.peak_bytes;
    j["simulated_fits"] = sim.fits;
    j["simulated_stall_seconds"] = sim.stall_seconds;
    j["lower_bound_stall_seconds"] = bound.stall_seconds;
    std::printf("%s\n", j.dump().c_str());
  }
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
