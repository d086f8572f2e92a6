// `tidal simulate`: replay a trace (profiled or analytic) under each policy on a hardware model.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "commands.hpp"
#include "memory_plot.hpp"
#include "per_op_table.hpp"
#include "progress.hpp"
#include "tidal/common/error.hpp"
#include "tidal/common/text.hpp"
#include "tidal/common/units.hpp"
#include "tidal/plan/bound.hpp"
#include "tidal/plan/hardware.hpp"
#include "tidal/plan/model_trace.hpp"
#include "tidal/plan/order_choice.hpp"
#include "tidal/plan/policies.hpp"
#include "tidal/plan/profiling_phase.hpp"
#include "tidal/plan/simulator.hpp"
#include "tidal/trace/io.hpp"
#include "trace_report.hpp"
#include "trace_source.hpp"

namespace tidal::plan {

// simulate's JSON: the figures of a simulation and the hardware it ran on.
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(SimResult, iteration_seconds, compute_seconds,
                                   io_compute_seconds, stall_seconds, peak_bytes, capacity_bytes,
                                   fits, ssd_bytes_written, ssd_bytes_read, host_bytes_written,
                                   host_bytes_read, ssd_write_utilisation, ssd_read_utilisation,
                                   host_write_utilisation, host_read_utilisation, ssd_lifetime_days,
                                   misses)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(Hardware, name, device_memory, ssd_count, ssd_write_bw,
                                   ssd_read_bw, host_link_bw, gpu_link_bw, host_memory)

}  // namespace tidal::plan

namespace tidal::cli {
namespace {

struct SimulateArgs {
  TraceSource src;
  std::string policy = "all";
  bool json = false;
  bool prefer_host = false;
  bool no_stage = false;
  std::string optimizer_step = "device";
  std::string svg;
  std::string per_op;
  std::string save_trace;
  std::uint64_t min_bytes = 0;
  std::string min_bytes_text;
  std::string plan_file;
  int profile_steps = 3;
};

// The bound as JSON: its iteration, stall and fraction of `compute`; where no plan fits, those
// are null and "no_fit_op" names the op that needs more than device memory by itself.
nlohmann::json bound_json(const plan::StallBound& b, double compute) {
  if (b.no_fit_op >= 0) {
    return {{"iteration_seconds", nullptr},
            {"stall_seconds", nullptr},
            {"fraction_of_ideal", nullptr},
            {"no_fit_op", b.no_fit_op}};
  }
  return {{"iteration_seconds", b.iteration_seconds},
          {"stall_seconds", b.stall_seconds},
          {"fraction_of_ideal", compute / b.iteration_seconds}};
}

// --plan: the given plan (a training session's, from `tidal train --save-plan`) replayed as the
// plan executor runs it, to set the simulator against what training measured.
void run_given_plan(const SimulateArgs& a, const plan::Hardware& hw, const trace::Trace& tr) {
  const plan::Plan p = plan::read_plan(a.plan_file);
  plan::SimOptions so;
  so.skip_clean_writes = false;  // the executor writes a tensor each time the plan offloads it
  const plan::SimResult r = plan::simulate(tr, &p, hw, so);
  std::printf("%s: %zu ops, %zu migrations from %s\n", tr.model.c_str(), tr.ops.size(),
              p.actions.size(), a.plan_file.c_str());
  std::printf("hardware %s: %s\n", hw.name.c_str(), hw.describe().c_str());
  std::printf(
      "iteration %s (compute %s, I/O compute %s, stall %s), peak %s of %s (%s), SSD %s written "
      "%s read, host %s written %s read, %lld misses\n",
      format_seconds(r.iteration_seconds).c_str(), format_seconds(r.compute_seconds).c_str(),
      format_seconds(r.io_compute_seconds).c_str(), format_seconds(r.stall_seconds).c_str(),
      format_bytes(static_cast<double>(r.peak_bytes)).c_str(),
      format_bytes(static_cast<double>(r.capacity_bytes)).c_str(), r.fits ? "fits" : "DOES NOT FIT",
      format_bytes(static_cast<double>(r.ssd_bytes_written)).c_str(),
      format_bytes(static_cast<double>(r.ssd_bytes_read)).c_str(),
      format_bytes(static_cast<double>(r.host_bytes_written)).c_str(),
      format_bytes(static_cast<double>(r.host_bytes_read)).c_str(),
      static_cast<long long>(r.misses));
  if (a.json) {
    nlohmann::json j = r;
    j["model"] = tr.model;
    j["plan"] = a.plan_file;
    std::printf("%s\n", j.dump().c_str());
  }
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::vector<plan::Policy> policies_of(const std::string& list) {
  if (list == "all") return plan::all_policies();
  std::vector<plan::Policy> policies;
  for (const auto& name : split_list(list)) policies.push_back(plan::policy_from_string(name));
  return policies;
}

plan::PolicyOptions policy_options(const SimulateArgs& a) {
  plan::PolicyOptions opt;
  opt.planner.min_bytes = a.min_bytes;
  opt.planner.prefer_host = a.prefer_host;
  opt.planner.stage_via_host = !a.no_stage;
  opt.optimizer_step = plan::optimizer_placement_from_string(a.optimizer_step);
  opt.planner.progress = planning_progress();
  return opt;
}

// What the policies did on the source: their results in the order asked, the bound, and with
// --micro-batch-order auto the choice between the orders; with the wall time of each stage.
struct Simulation {
  std::vector<plan::PolicyResult> results;
  std::optional<plan::OrderChoice> choice;
  plan::StallBound bound;
  double policies_seconds = 0;
  double bound_seconds = 0;
};

// --micro-batch-order auto: tidal plans and simulates both orders and keeps the faster; the
// other policies run on the sequential order (ZeRO's models are of DeepSpeed's loop, which
// runs micro-batches in turn; ideal is the same on both), and the bound is the lower of the
// two orders' bounds, which no plan on either order beats.
Simulation simulate_policies(const LoadedSource& src, const std::vector<plan::Policy>& policies,
                             const plan::PolicyOptions& opt) {
  const plan::Hardware& hw = src.hw;
  Simulation out;
  const auto tidal_at = std::find(policies.begin(), policies.end(), plan::Policy::kTidal);
  TIDAL_EXPECT_AS(InvalidArgument, !src.choose_order() || tidal_at != policies.end(),
                  "--micro-batch-order auto keeps the order in which tidal's plan is faster: "
                  "give tidal in --policy, or choose the order (sequential or layer-major)");
  const trace::Trace& sequential = src.traces[0];
  auto t0 = std::chrono::steady_clock::now();
  if (src.choose_order()) {
    std::vector<plan::Policy> others(policies.begin(), tidal_at);
    others.insert(others.end(), tidal_at + 1, policies.end());
    out.results = plan::run_policies(others, sequential, hw, opt);
    out.choice =
        plan::choose_fastest_order(src.trace_pointers(), hw, opt, fraction_progress("lower bound"));
    out.results.insert(out.results.begin() + (tidal_at - policies.begin()),
                       out.choice->best().tidal);
    for (const auto& c : out.choice->candidates) out.bound_seconds += c.bound_wall_seconds;
  } else {
    out.results = plan::run_policies(policies, sequential, hw, opt);
  }
  out.policies_seconds = seconds_since(t0) - out.bound_seconds;
  const auto tidal = std::find_if(
      out.results.begin(), out.results.end(),
      [](const plan::PolicyResult& r) { return r.policy == plan::Policy::kTidal && r.bound; });
  if (out.choice) {
    out.bound = out.choice->bound();
  } else if (opt.optimizer_step != plan::OptimizerPlacement::kDevice &&
             tidal != out.results.end()) {
    out.bound = *tidal->bound;  // the bound of the placements considered
  } else {
    t0 = std::chrono::steady_clock::now();
    out.bound = plan::stall_lower_bound(sequential, hw, fraction_progress("lower bound"));
    out.bound_seconds = seconds_since(t0);
  }
  return out;
}

// The peak of the trace with every tensor kept (keep-all's or ideal's), 0 when neither ran.
std::uint64_t keep_all_peak(const std::vector<plan::PolicyResult>& results) {
  std::uint64_t trace_peak = 0;
  for (const auto& r : results) {
    if (r.policy == plan::Policy::kKeepAll || r.policy == plan::Policy::kIdeal) {
      trace_peak = r.sim.peak_bytes;
    }
  }
  return trace_peak;
}

void print_order_choice(const plan::OrderChoice& choice) {
  std::printf("micro-batch order: auto chose %s for tidal (", choice.best().order.c_str());
  for (std::size_t i = 0; i < choice.candidates.size(); ++i) {
    const plan::OrderCandidate& c = choice.candidates[i];
    std::printf("%s%s %s, %s of ideal, bound %s%s", i > 0 ? "; " : "", c.order.c_str(),
                format_seconds(c.tidal.sim.iteration_seconds).c_str(),
                pct(c.tidal.fraction_of_ideal).c_str(),
                c.bound.no_fit_op >= 0 ? "none" : format_seconds(c.bound.iteration_seconds).c_str(),
                c.tidal.fits ? "" : ", does not fit");
  }
  std::printf("); the other policies on the sequential order\n");
}

void print_header(const trace::Trace& tr, const plan::Hardware& hw, const Simulation& sim,
                  std::uint64_t trace_peak) {
  std::printf("%s (batch %lld, seq %lld): %zu ops, %zu tensors, compute %s\n", tr.model.c_str(),
              static_cast<long long>(tr.batch), static_cast<long long>(tr.seq), tr.ops.size(),
              tr.tensors.size(), format_seconds(tr.compute_seconds()).c_str());
  print_optimizer_step(tr);
  if (sim.choice) {
    print_order_choice(*sim.choice);
  } else {
    print_micro_batch_order(tr);
  }
  std::printf("hardware %s: %s\n", hw.name.c_str(), hw.describe().c_str());
  if (trace_peak > 0) {
    std::printf(
        "keep-all peak %s = %s of device memory\n",
        format_bytes(static_cast<double>(trace_peak)).c_str(),
        pct(static_cast<double>(trace_peak) / static_cast<double>(hw.device_memory)).c_str());
  }
}

void print_policy_table(const std::vector<plan::PolicyResult>& results) {
  std::printf("\n%-14s %12s %9s %12s %5s %10s %12s %12s  %s\n", "policy", "iteration", "of ideal",
              "peak memory", "fits", "stall", "SSD written", "host written", "note");
  for (const auto& r : results) {
    std::printf("%-14s %12s %9s %12s %5s %10s %12s %12s  %s\n", plan::to_string(r.policy),
                format_seconds(r.sim.iteration_seconds).c_str(), pct(r.fraction_of_ideal).c_str(),
                format_bytes(static_cast<double>(r.sim.peak_bytes)).c_str(), r.fits ? "yes" : "NO",
                format_seconds(r.sim.stall_seconds).c_str(),
                format_bytes(static_cast<double>(r.sim.ssd_bytes_written)).c_str(),
                format_bytes(static_cast<double>(r.sim.host_bytes_written)).c_str(),
                r.note.c_str());
  }
}

// The lower bound and its windows; `bound_trace` is the trace the bound was found on.
void print_bound(const Simulation& sim, const trace::Trace& bound_trace, double ideal_seconds,
                 const plan::Hardware& hw) {
  const plan::StallBound& bound = sim.bound;
  std::string bound_of = sim.choice ? "either micro-batch order (the " +
                                          sim.choice->candidates[sim.choice->bound_from].order +
                                          " order's)"
                                    : "this trace";
  if (!bound.limit.empty())
    bound_of += " with the optimizer step on the host, set by " + bound.limit;
  if (bound.no_fit_op >= 0) {
    const trace::Op& op = bound_trace.ops[static_cast<std::size_t>(bound.no_fit_op)];
    std::printf(
        "\nno lower bound: no plan fits this trace, as op %d '%s' (%s) uses %s by itself, more "
        "than device memory (%s)\n",
        op.index, op.name.c_str(), trace::to_string(op.phase),
        format_bytes(static_cast<double>(bound.no_fit_bytes)).c_str(),
        format_bytes(static_cast<double>(hw.device_memory)).c_str());
  } else {
    std::printf(
        "\nlower bound for any plan on %s: %s iteration (%s of ideal at best), stall >= "
        "%s\n",
        bound_of.c_str(), format_seconds(bound.iteration_seconds).c_str(),
        pct(ideal_seconds / bound.iteration_seconds).c_str(),
        format_seconds(bound.stall_seconds).c_str());
  }
  for (const auto& w : bound.windows) {
    const auto& first = bound_trace.ops[static_cast<std::size_t>(w.first)];
    const auto& last = bound_trace.ops[static_cast<std::size_t>(w.last)];
    std::printf("  ops %d-%d (%s %s .. %s %s): %s compute, >= %s to read, >= %s to write: %s\n",
                w.first, w.last, trace::to_string(first.phase), first.name.c_str(),
                trace::to_string(last.phase), last.name.c_str(),
                format_seconds(w.compute_seconds).c_str(), format_bytes(w.read_bytes).c_str(),
                format_bytes(w.write_bytes).c_str(), format_seconds(w.stall_seconds).c_str());
  }
}

// Where tidal's plan stalls, by phase, and what it asks of the SSDs and host memory.
void print_tidal_details(const plan::PolicyResult& r, const trace::Trace& tr,
                         const plan::Hardware& hw) {
  double by_phase[4] = {0, 0, 0, 0};
  for (std::size_t k = 0; k < r.sim.stall_per_op.size() && k < tr.ops.size(); ++k)
    by_phase[static_cast<int>(tr.ops[k].phase)] += r.sim.stall_per_op[k];
  std::printf("tidal stall by phase: forward %s, backward %s, optimizer %s, other %s\n",
              format_seconds(by_phase[0]).c_str(), format_seconds(by_phase[1]).c_str(),
              format_seconds(by_phase[2]).c_str(), format_seconds(by_phase[3]).c_str());
  char life[96];
  if (r.sim.ssd_bytes_written == 0) {
    std::snprintf(life, sizeof life, "no SSD writes");
  } else {
    std::snprintf(life, sizeof life, "SSD lifetime %.0f days at %s TBW per SSD",
                  r.sim.ssd_lifetime_days, format_bytes(hw.ssd_tbw).c_str());
  }
  std::printf("\ntidal: planned in %s; SSD write/read utilisation %s/%s, host %s/%s; %s\n",
              format_seconds(r.planning_seconds).c_str(), pct(r.sim.ssd_write_utilisation).c_str(),
              pct(r.sim.ssd_read_utilisation).c_str(), pct(r.sim.host_write_utilisation).c_str(),
              pct(r.sim.host_read_utilisation).c_str(), life);
}

void print_profiling_phase(const plan::ProfilingPhase& phase) {
  std::printf(
      "\nbefore the plan (%d warm-up and profiled steps, on demand under the budget, the "
      "model's state starting on the SSDs): step 0 %s, then %s a step (%s read, %s written); "
      "%s in all, %s more than as many planned steps with the planning; the plan pays that "
      "back after %s planned steps%s%s\n",
      phase.steps, format_seconds(phase.first_step_seconds).c_str(),
      format_seconds(phase.step_seconds).c_str(),
      format_bytes(static_cast<double>(phase.bytes_read)).c_str(),
      format_bytes(static_cast<double>(phase.bytes_written)).c_str(),
      format_seconds(phase.total_seconds).c_str(), format_seconds(phase.extra_seconds).c_str(),
      phase.payback_steps < 0
          ? "no (it is not faster)"
          : std::to_string(static_cast<long long>(std::ceil(phase.payback_steps))).c_str(),
      phase.fits ? "" : "; does not fit: ", phase.note.c_str());
}

// The steps before the plan: warm-up and profiling under the budget, on demand.
struct BeforePlan {
  std::optional<plan::ProfilingPhase> phase;
  double seconds = 0;  // wall time of simulating it
};

BeforePlan simulate_before_plan(const std::vector<plan::PolicyResult>& results,
                                const trace::Trace& tr, const plan::Hardware& hw,
                                int profile_steps) {
  BeforePlan out;
  for (const auto& r : results) {
    if (r.policy != plan::Policy::kTidal || !r.plan || profile_steps <= 0) continue;
    const auto t0 = std::chrono::steady_clock::now();
    out.phase = plan::simulate_profiling_phase(tr, hw, profile_steps, r.sim.iteration_seconds,
                                               r.planning_seconds);
    out.seconds = seconds_since(t0);
    print_profiling_phase(*out.phase);
  }
  return out;
}

// --save-trace, --per-op and --svg.
void write_files(const SimulateArgs& a, const std::vector<plan::PolicyResult>& results,
                 const trace::Trace& tr, const plan::Hardware& hw) {
  if (!a.save_trace.empty()) {
    trace::write_trace(tr, a.save_trace);
    std::printf("trace written to %s\n", a.save_trace.c_str());
  }
  if (!a.per_op.empty()) {
    const auto it = std::find_if(results.begin(), results.end(), [](const plan::PolicyResult& r) {
      return r.policy == plan::Policy::kTidal && r.plan;
    });
    TIDAL_EXPECT_AS(InvalidArgument, it != results.end(),
                    "--per-op writes tidal's plan op by op: give tidal in --policy");
    write_per_op(a.per_op, it->plan_trace ? *it->plan_trace : tr, *it->plan, hw);
    std::printf("tidal's plan op by op written to %s\n", a.per_op.c_str());
  }
  if (!a.svg.empty()) {
    std::ofstream out(a.svg);
    TIDAL_EXPECT(out.good(), "cannot write the plot to '", a.svg, "'");
    std::ostringstream title;
    title << tr.model << " batch " << tr.batch << " seq " << tr.seq << " on " << hw.name;
    out << svg_plot(results, hw.device_memory, title.str());
    std::printf("memory plot written to %s\n", a.svg.c_str());
  }
}

// Both orders' tidal plans and bounds; "lower_bound" of the whole is the lower of the two.
nlohmann::json orders_json(const plan::OrderChoice& choice) {
  nlohmann::json orders = nlohmann::json::object();
  for (const auto& c : choice.candidates) {
    orders[c.order] = {{"iteration_seconds", c.tidal.sim.iteration_seconds},
                       {"fraction_of_ideal", c.tidal.fraction_of_ideal},
                       {"fits", c.tidal.fits},
                       {"planning_seconds", c.tidal.planning_seconds},
                       {"ssd_bytes_written", c.tidal.sim.ssd_bytes_written},
                       {"ssd_bytes_read", c.tidal.sim.ssd_bytes_read},
                       {"lower_bound", bound_json(c.bound, c.tidal.sim.compute_seconds)}};
  }
  return orders;
}

nlohmann::json policies_json(const std::vector<plan::PolicyResult>& results) {
  nlohmann::json ps = nlohmann::json::object();
  for (const auto& r : results) {
    nlohmann::json x = r.sim;
    x["fraction_of_ideal"] = r.fraction_of_ideal;
    x["fits"] = r.fits;  // the policy's verdict: host memory counts too (ZeRO-Offload)
    x["note"] = r.note;
    if (r.policy == plan::Policy::kTidal) {
      x["planning_seconds"] = r.planning_seconds;
      x["optimizer_step"] = plan::to_string(r.optimizer_step);
    }
    ps[plan::to_string(r.policy)] = x;
  }
  return ps;
}

nlohmann::json before_plan_json(const plan::ProfilingPhase& phase) {
  return {{"steps", phase.steps},
          {"fits", phase.fits},
          {"note", phase.note},
          {"first_step_seconds", phase.first_step_seconds},
          {"step_seconds", phase.step_seconds},
          {"bytes_read", phase.bytes_read},
          {"bytes_written", phase.bytes_written},
          {"total_seconds", phase.total_seconds},
          {"planned_step_seconds", phase.planned_step_seconds},
          {"planning_seconds", phase.planning_seconds},
          {"extra_seconds", phase.extra_seconds},
          {"payback_steps", phase.payback_steps}};
}

void print_json(const trace::Trace& tr, const plan::Hardware& hw, const Simulation& sim,
                const BeforePlan& before, std::uint64_t trace_peak) {
  nlohmann::json j;
  add_trace_meta(j, tr);
  if (sim.choice) {
    j["micro_batch_order_requested"] = "auto";
    j["micro_batch_orders"] = orders_json(*sim.choice);
  }
  j["batch"] = tr.batch;
  j["seq"] = tr.seq;
  j["ops"] = tr.ops.size();
  j["hardware"] = hw;
  j["capacity_bytes"] = hw.device_memory;
  j["trace_peak_bytes"] = trace_peak;
  j["compute_seconds"] = tr.compute_seconds();
  j["lower_bound"] = bound_json(sim.bound, tr.compute_seconds());
  if (sim.choice)
    j["lower_bound"]["micro_batch_order"] = sim.choice->candidates[sim.choice->bound_from].order;
  // Wall time of this command's stages on this machine: the policies (planning and
  // simulating), the bound's search, the steps before the plan.
  j["stage_seconds"] = {{"policies", sim.policies_seconds},
                        {"lower_bound", sim.bound_seconds},
                        {"before_plan", before.seconds}};
  j["policies"] = policies_json(sim.results);
  if (before.phase) j["before_plan"] = before_plan_json(*before.phase);
  std::printf("%s\n", j.dump().c_str());
}

void run_simulate(const SimulateArgs& a) {
  stop_on_interrupt("simulate");
  const LoadedSource src = load_trace_source(a.src);
  const plan::Hardware& hw = src.hw;
  if (!a.plan_file.empty()) {
    TIDAL_EXPECT_AS(InvalidArgument, !src.choose_order(),
                    "--plan replays one plan on the trace it was made for: give its micro-batch "
                    "order (--micro-batch-order sequential or layer-major), not auto");
    run_given_plan(a, hw, src.traces[0]);
    return;
  }
  const Simulation sim = simulate_policies(src, policies_of(a.policy), policy_options(a));
  // The trace of tidal's plan, and that of the bound.
  const trace::Trace& tr = sim.choice ? src.traces[sim.choice->chosen] : src.traces[0];
  const trace::Trace& bound_trace = sim.choice ? src.traces[sim.choice->bound_from] : src.traces[0];
  const std::uint64_t trace_peak = keep_all_peak(sim.results);
  print_header(tr, hw, sim, trace_peak);
  print_policy_table(sim.results);
  print_bound(sim, bound_trace, tr.compute_seconds(), hw);
  for (const auto& r : sim.results) {
    if (r.policy == plan::Policy::kTidal && r.plan) {
      print_tidal_details(r, r.plan_trace ? *r.plan_trace : tr, hw);
    }
  }
  const BeforePlan before = simulate_before_plan(sim.results, tr, hw, a.profile_steps);
  write_files(a, sim.results, tr, hw);
  if (a.json) print_json(tr, hw, sim, before, trace_peak);
}

}  // namespace

void add_simulate_command(CLI::App& app) {
  auto args = std::make_shared<SimulateArgs>();
  auto* cmd = app.add_subcommand("simulate",
                                 "Replay a trace under each offloading policy on a hardware model");
  add_trace_source_options(cmd, args->src);
  cmd->add_option("--min-bytes", args->min_bytes_text,
                  "tidal: tensors smaller than this stay in device memory");
  cmd->add_option("--policy", args->policy,
                  "ideal|keep-all|recompute|activations|zero-offload|zero-infinity|tidal, a "
                  "comma-separated list, or all")
      ->capture_default_str();
  cmd->add_flag("--json", args->json, "print one JSON object as the last line");
  cmd->add_option("--profile-steps", args->profile_steps,
                  "steps before tidal's plan (warm-up + profiled), simulated on demand under the "
                  "budget (0: not simulated)")
      ->capture_default_str();
  cmd->add_flag("--prefer-host", args->prefer_host,
                "tidal: host memory before SSDs where both have the bandwidth (fewer SSD writes)");
  cmd->add_flag("--no-stage", args->no_stage,
                "tidal: never bring an SSD tensor back through host memory (as `tidal train` "
                "plans)");
  cmd->add_option("--optimizer-step", args->optimizer_step,
                  "tidal: where the optimizer step runs: device (over the state the plan moves), "
                  "host (fp32 master weights and Adam moments in host memory, 16-bit weights and "
                  "gradients cross the link, the host CPU steps each parameter as its gradient "
                  "comes in) or auto (both planned and simulated, the faster kept)")
      ->check(CLI::IsMember({"device", "host", "auto"}))
      ->capture_default_str();
  cmd->add_option("--svg", args->svg, "write a plot of memory over the iteration");
  cmd->add_option("--save-trace", args->save_trace,
                  "write the trace tidal's plan is for (with --model: the analytic trace) as "
                  "JSON, for --trace later or for other tools");
  cmd->add_option("--per-op", args->per_op,
                  "write tidal's plan op by op as CSV: compute, stall, device bytes, and the "
                  "device-side bytes of each tensor class as the op comes up");
  cmd->add_option("--plan", args->plan_file,
                  "replay this plan (`tidal train --save-plan`) on the trace it was made for, as "
                  "the plan executor runs it, instead of planning each policy")
      ->check(CLI::ExistingFile);
  cmd->callback([args] {
    if (!args->min_bytes_text.empty()) args->min_bytes = parse_bytes(args->min_bytes_text);
    run_simulate(*args);
  });
}

}  // namespace tidal::cli
