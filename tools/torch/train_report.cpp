#include "train_report.hpp"

#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <numeric>

#include "tidal/common/stats.hpp"
#include "tidal/common/units.hpp"
#include "tidal/plan/plan.hpp"
#include "tidal/plan/timeline.hpp"
#include "tidal/torch/build_info.hpp"
#include "tidal/trace/io.hpp"

namespace tidal::cli {
namespace {

// The run's totals, read once the steps are done.
struct RunTotals {
  torch_layer::SessionStats st;
  std::uint64_t offload_peak = 0;
  double tokens_per_second = 0;
  // Plan mode measures its peak over the steps its final plan ran; where re-plans took every
  // executed step there is no such step, and the peak is not measured (not 0 B).
  bool peak_measured = true;
};

constexpr const char* kPeakNotMeasured =
    "not measured (no step ran under the final plan: each executed step was followed by a "
    "re-plan; run more --steps)";

RunTotals run_totals(const models::TrainerOptions& options, const torch_layer::SessionOptions& so,
                     torch_layer::Session& session, const torch_layer::MemoryMeter& meter,
                     const StepRecord& rec) {
  RunTotals t;
  const double total = std::accumulate(rec.seconds.begin(), rec.seconds.end(), 0.0);
  const auto mem = meter.stats();
  // Plan mode: the peak of the steps run by the final plan (the session measures each step,
  // and makes the plan again for less memory when a step went over the budget).
  t.offload_peak =
      so.mode == torch_layer::OffloadMode::kPlan ? session.stats().executed_peak : mem.peak_bytes;
  const double tokens_per_step = static_cast<double>(options.batch * options.seq);
  t.tokens_per_second = tokens_per_step * static_cast<double>(rec.seconds.size()) / total;
  t.st = session.stats();
  t.peak_measured = so.mode != torch_layer::OffloadMode::kPlan || t.st.steps_measured > 0;
  return t;
}

// The offloading lines of the results: what moved and what failed.
void print_offload_results(const TrainArgs& args, const IoTotals& io) {
  std::fprintf(stderr,
               "offload %s: %s written, %s read, %llu misses, %.3f s stalled, %llu failed "
               "writes\n",
               args.offload.c_str(), format_bytes(static_cast<double>(io.bytes_written)).c_str(),
               format_bytes(static_cast<double>(io.bytes_read)).c_str(),
               static_cast<unsigned long long>(io.misses), io.stall,
               static_cast<unsigned long long>(io.failures));
  if (io.failures > 0) {
    // Degraded, not wrong: a tensor whose write failed stayed in memory.
    std::fprintf(stderr,
                 "DEGRADED: %llu write(s) failed (%llu for want of space: raise "
                 "--store-capacity or free disk space); those tensors stayed in memory and the "
                 "losses are unaffected. Last: %s\n",
                 static_cast<unsigned long long>(io.failures),
                 static_cast<unsigned long long>(io.full), io.write_error.c_str());
  }
}

// Plan mode's lines of the results: the tiers, the budget and the plan.
void print_plan_results(const torch_layer::SessionOptions& so, const RunTotals& t,
                        const IoTotals& io) {
  const torch_layer::SessionStats& st = t.st;
  std::fprintf(stderr,
               "tiers: SSD %s written (plan: %s), host %s written (plan: %s) of a %s pool; "
               "stalls: SSD reads %.3f s, host reads %.3f s, writes (budget) %.3f s\n",
               format_bytes(static_cast<double>(io.bytes_written)).c_str(),
               format_bytes(static_cast<double>(io.planned_to_ssd)).c_str(),
               format_bytes(static_cast<double>(io.bytes_to_host)).c_str(),
               format_bytes(static_cast<double>(io.planned_to_host)).c_str(),
               format_bytes(static_cast<double>(so.host_memory)).c_str(), io.stall - io.host_stall,
               io.host_stall, io.write_stall);
  std::fprintf(
      stderr,
      "budget %s (of a profiled peak of %s; %s of it untouched by any step), %s over "
      "the %lld step(s) of the current plan (%lld earlier step(s) over it; %d re-plan(s) "
      "for memory, %d on op times from executed steps); step boundary %s%s; %s\n",
      format_bytes(static_cast<double>(st.memory_budget)).c_str(),
      format_bytes(static_cast<double>(st.profiled_peak)).c_str(),
      format_bytes(static_cast<double>(st.untouched_bytes)).c_str(),
      !t.peak_measured   ? "not measured"
      : st.within_budget ? "kept"
                         : "EXCEEDED",
      static_cast<long long>(st.steps_measured), static_cast<long long>(st.steps_over_budget),
      st.tightenings, st.retimings,
      st.between_steps.empty() ? "not chosen yet" : st.between_steps.c_str(),
      so.between_steps == torch_layer::BetweenSteps::kAuto ? " (the planner's choice)" : "",
      st.plan_summary.c_str());
  if (!st.within_budget && !st.budget_reason.empty()) {
    std::fprintf(stderr, "why: %s\n", st.budget_reason.c_str());
  }
}

void print_results(const TrainArgs& args, const torch_layer::SessionOptions& so,
                   const StepRecord& rec, const RunTotals& t) {
  std::fprintf(stderr, "final loss %.4f, %.0f tokens/s, peak tensor memory %s\n", rec.losses.back(),
               t.tokens_per_second,
               t.peak_measured ? format_bytes(static_cast<double>(t.offload_peak)).c_str()
                               : kPeakNotMeasured);
  if (so.mode != torch_layer::OffloadMode::kNone) print_offload_results(args, rec.io);
  if (so.mode == torch_layer::OffloadMode::kPlan) print_plan_results(so, t, rec.io);
  if (!t.st.notice.empty()) std::fprintf(stderr, "note: %s\n", t.st.notice.c_str());
}

// Every degraded path of the store, with how often and the first reason: said on stderr
// (but for the failed writes the DEGRADED line told already) and returned as
// {path: {count, reason}} for the JSON.
nlohmann::json report_store_degraded(const io::StoreStats& ss, const IoTotals& io) {
  nlohmann::json store_degraded = nlohmann::json::object();
  const std::pair<const char*, const io::DegradedPath*> paths[] = {
      {"store_full", &ss.store_full},
      {"write_failed", &ss.write_failed},
      {"read_failed", &ss.read_failed},
      {"read_corrupt", &ss.read_corrupt},
      {"backend_fallback", &ss.backend_fallback}};
  for (const auto& [name, path] : paths) {
    if (path->count == 0) continue;
    store_degraded[name] = {{"count", path->count}, {"reason", path->reason}};
    const bool said = path == &ss.store_full || path == &ss.write_failed;  // the DEGRADED line
    if (said && io.failures > 0) continue;
    std::fprintf(stderr, "store DEGRADED: %s x%llu: %s\n", name,
                 static_cast<unsigned long long>(path->count), path->reason.c_str());
  }
  return store_degraded;
}

// The I/O totals in the JSON of every mode.
void add_io_json(nlohmann::json& j, const IoTotals& io) {
  j["bytes_written"] = io.bytes_written;
  j["bytes_read"] = io.bytes_read;
  j["stall_seconds"] = io.stall;
  j["misses"] = io.misses;
  j["write_failures"] = io.failures;
  j["store_full_writes"] = io.full;
  j["write_error"] = io.write_error;
}

// Plan mode's fields of the JSON: the budget, the plan, the tiers.
void add_plan_json(nlohmann::json& j, const torch_layer::SessionOptions& so, const RunTotals& t,
                   const IoTotals& io) {
  const torch_layer::SessionStats& st = t.st;
  j["memory_budget"] = st.memory_budget;
  j["profiled_peak_bytes"] = st.profiled_peak;
  j["plan_summary"] = st.plan_summary;
  j["planned_step_seconds"] = st.planned_step_seconds;
  j["strict_meter"] = so.strict_meter.value_or(false);
  j["defaults"] = st.defaults;
  j["between_steps"] = st.between_steps;
  j["replans"] = st.replans;
  j["budget_replans"] = st.tightenings;
  j["retimings"] = st.retimings;
  j["planned_ahead"] = st.planned_ahead;
  j["within_budget"] = t.peak_measured ? nlohmann::json(st.within_budget) : nlohmann::json(nullptr);
  j["steps_measured"] = st.steps_measured;
  j["steps_over_budget"] = st.steps_over_budget;
  // Ops the device's allocator refused past the wall and that ran again once tensors were
  // written out (the strict meter on a GPU): each one is a step that would have crashed.
  j["out_of_memory_retries"] = st.out_of_memory_retries;
  j["untouched_bytes"] = st.untouched_bytes;
  j["budget_reason"] = st.budget_reason;
  j["step_shapes"] = st.shapes;
  j["host_memory"] = so.host_memory;
  j["bytes_to_host"] = io.bytes_to_host;
  j["bytes_from_host"] = io.bytes_from_host;
  j["bytes_staged"] = io.bytes_staged;
  j["planned_bytes_to_ssd"] = io.planned_to_ssd;
  j["planned_bytes_to_host"] = io.planned_to_host;
  j["ssd_stall_seconds"] = io.stall - io.host_stall;
  j["host_stall_seconds"] = io.host_stall;
  j["write_stall_seconds"] = io.write_stall;
}

nlohmann::json run_json(const RunContext& run, const StepRecord& rec, const RunTotals& t) {
  const models::TrainerOptions& options = run.options;
  nlohmann::json j;
  j["model"] = options.config.name;
  j["parameters"] = options.config.parameter_count();
  j["device"] = options.device.str();
  j["blas"] = options.device.is_cuda() ? std::string("cuBLAS") : torch_layer::blas_library();
  j["batch"] = options.batch;
  j["seq"] = options.seq;
  j["seed"] = options.seed;
  j["first_step"] = run.first_step;  // losses[0] is step first_step + 1
  j["checkpoints_written"] = rec.checkpoints_written;
  j["losses"] = rec.losses;
  j["step_seconds"] = rec.seconds;
  j["peak_bytes"] = t.peak_measured ? nlohmann::json(t.offload_peak) : nlohmann::json(nullptr);
  if (!t.peak_measured) j["peak_not_measured"] = kPeakNotMeasured;
  j["step_peak_bytes"] = rec.step_peaks;
  j["tokens_per_second"] = t.tokens_per_second;
  j["offload_mode"] = run.args.offload;
  j["recompute"] = run.args.recompute;
  j["optimizer_schedule"] = schedule_name(options);
  j["optimizer_step"] = options.adamw.on_host ? "host" : "device";
  j["clip_grad_norm"] = options.clip_grad_norm;
  j["micro_batches"] = options.micro_batches;
  j["micro_batch_order"] = plan::to_string(options.micro_batch_order);
  add_io_json(j, rec.io);
  j["offload_step_seconds_median"] = median(rec.offload_seconds);
  j["steps_offloaded"] = rec.offload_seconds.size();  // the steps the byte and stall totals cover
  j["all_steps_median_seconds"] = median(rec.seconds);
  if (run.so.mode == torch_layer::OffloadMode::kPlan) add_plan_json(j, run.so, t, rec.io);
  return j;
}

// The files asked for, after the results are out: one that cannot be written (its directory
// removed during the run, the disk full) is a warning naming it, never a lost result.
void write_outputs(const TrainArgs& args, torch_layer::Session& session) {
  const auto write_output = [](const char* flag, const std::string& path, const auto& write) {
    try {
      write();
      return true;
    } catch (const std::exception& e) {
      std::fprintf(stderr,
                   "tidal train: warning: %s '%s' was not written: %s (the results above are "
                   "complete; training succeeded)\n",
                   flag, path.c_str(), e.what());
      return false;
    }
  };
  if (!args.save_trace.empty() && session.trace()) {
    write_output("--save-trace", args.save_trace,
                 [&] { trace::write_trace(*session.trace(), args.save_trace); });
  }
  if (!args.save_plan.empty() && session.plan()) {
    write_output("--save-plan", args.save_plan,
                 [&] { plan::write_plan(*session.plan(), args.save_plan); });
  }
  for (const auto& path : args.timeline) {
    if (write_output("--timeline", path, [&] { session.write_timeline(path); })) {
      std::fprintf(stderr, "timeline of the last %lld step(s) written to %s\n",
                   static_cast<long long>(args.timeline_steps), path.c_str());
    }
  }
}

// After the steps: the results on stderr, the JSON line on stdout, then the files.
}  // namespace

void report_run(const RunContext& run, torch_layer::Session& session,
                const torch_layer::MemoryMeter& meter, const StepRecord& rec) {
  const TrainArgs& args = run.args;
  const torch_layer::SessionOptions& so = run.so;
  const RunTotals t = run_totals(run.options, so, session, meter, rec);
  print_results(args, so, rec, t);
  const plan::TimeReport report = session.time_report();
  const bool time_report = so.mode != torch_layer::OffloadMode::kNone && args.timeline_steps > 0;
  if (time_report) std::fputs(plan::format_report(report).c_str(), stderr);
  nlohmann::json store_degraded = nlohmann::json::object();
  std::string io_backend;
  if (session.store()) {
    const auto ss = session.store()->stats();
    io_backend = ss.backend;
    store_degraded = report_store_degraded(ss, rec.io);
  }
  if (args.json) {
    nlohmann::json j = run_json(run, rec, t);
    if (!io_backend.empty()) j["io_backend"] = io_backend;
    j["store_degraded"] = store_degraded;  // {path: {count, reason}} for each that happened
    if (time_report) j["time_report"] = nlohmann::json::parse(plan::time_report_json(report));
    std::cout << j.dump() << std::endl;
  }
  write_outputs(args, session);
}

}  // namespace tidal::cli
