// `tidal train`: trains a reference model, optionally offloading tensors to SSDs, and reports
// losses, step times, peak memory and what moved.
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>

#include "commands.hpp"
#include "hardware_flags.hpp"
#include "interrupt_report.hpp"
#include "model_options.hpp"
#include "output_paths.hpp"
#include "progress.hpp"
#include "store_flags.hpp"
#include "tidal/common/env.hpp"
#include "tidal/common/error.hpp"
#include "tidal/common/stats.hpp"
#include "tidal/common/text.hpp"
#include "tidal/common/units.hpp"
#include "tidal/models/trainer.hpp"
#include "tidal/torch/checkpoint.hpp"
#include "tidal/torch/executor.hpp"
#include "tidal/torch/memory.hpp"
#include "tidal/torch/session.hpp"
#include "tidal/trace/io.hpp"

namespace tidal::cli {
namespace {

struct TrainArgs {
  ModelArgs model;
  bool json = false;
  std::vector<std::string> timeline;  // files: Chrome trace, or SVG for a name ending in .svg
  std::int64_t timeline_steps = 2;    // signed: -1 is refused, not read as 2^64 - 1
  bool recompute = false;
  std::string offload = "none";
  std::string mem_budget;  // empty: the device's default (SessionOptions::memory_budget)
  std::string dirs;
  bool dirs_given = false;  // --dir on the command line (an empty one is an error, not a default)
  std::string capacity = "0";
  std::string min_offload = "1MiB";
  int warmup_steps = 1;
  int profile_steps = 2;
  std::string ssd;  // planner's SSD figures, e.g. "1x2.0/1.5GB/s"
  std::string save_trace;
  std::string save_plan;
  std::string between_steps;  // empty: auto (given outside plan mode: refused)
  bool strict_budget = false;
  bool strict_meter = false;
  std::string host_mem;    // empty: the machine's default (SessionOptions::host_memory)
  std::string checkpoint;  // directory checkpoints are written to
  int checkpoint_every = 0;
  std::string resume;    // directory to resume from
  int kill_at_step = 0;  // testing: SIGKILL in the middle of this step (1-based)
};

constexpr const char* kCheckpointFile = "checkpoint.pt";

// Testing a crash: kills the process (SIGKILL, no clean-up) in the backward pass of one step,
// when activations and planned migrations are in flight.
class KillAtStep final : public torch_layer::StepObserver {
 public:
  explicit KillAtStep(std::int64_t step) : step_(step) {}
  void begin_step(std::int64_t step, const std::vector<torch::Tensor>&) override { now_ = step; }
  void begin_phase(trace::Phase phase) override {
    if (phase == trace::Phase::kBackward && now_ + 1 == step_) std::raise(SIGKILL);
  }

 private:
  std::int64_t step_;
  std::int64_t now_ = -1;
};

// The I/O of a run's offloaded steps, summed from the session's per-step stats.
struct IoTotals {
  std::uint64_t bytes_written = 0, bytes_read = 0, bytes_to_host = 0, bytes_from_host = 0;
  std::uint64_t bytes_staged = 0;
  std::uint64_t planned_to_ssd = 0, planned_to_host = 0, misses = 0, failures = 0, full = 0;
  std::string write_error;  // the last failed write's message
  double stall = 0, host_stall = 0, write_stall = 0;
  void add(const torch_layer::SessionStats& s) {
    bytes_written += s.bytes_written;
    bytes_read += s.bytes_read;
    bytes_to_host += s.bytes_to_host;
    bytes_from_host += s.bytes_from_host;
    bytes_staged += s.bytes_staged;
    planned_to_ssd += s.planned_bytes_to_ssd;
    planned_to_host += s.planned_bytes_to_host;
    misses += s.misses;
    failures += s.write_failures;
    full += s.store_full_writes;
    if (!s.write_error.empty()) write_error = s.write_error;
    stall += s.stall_seconds;
    host_stall += s.host_stall_seconds;
    write_stall += s.write_stall_seconds;
  }
};

// The store's directories and capacity (offloading modes only).
void set_store_options(const TrainArgs& args, torch_layer::SessionOptions& so) {
  if (so.mode == torch_layer::OffloadMode::kNone) return;
  so.store.dirs = args.dirs_given ? parse_dir_flag("--dir", args.dirs) : split_list(args.dirs);
  if (so.store.dirs.empty() && !env().dirs) {
    so.store.dirs = {"/var/tmp/tidal"};  // the default: created if missing
    make_directory(so.store.dirs[0], "the default store directory");
  }
  so.store.capacity = parse_bytes(args.capacity);
}

// Checks the flags of the files the run writes, and that each can be written: a bad path fails
// before the run, not after it. Returns the checkpoint file ("" without --checkpoint).
std::string check_outputs(const TrainArgs& args, torch_layer::OffloadMode mode) {
  const bool plan_mode = mode == torch_layer::OffloadMode::kPlan;
  TIDAL_EXPECT_AS(InvalidArgument, args.warmup_steps >= 0, "--warmup-steps must be 0 or more");
  TIDAL_EXPECT_AS(InvalidArgument, args.profile_steps >= 1, "--profile-steps must be 1 or more");
  TIDAL_EXPECT_AS(InvalidArgument, args.ssd.empty() || plan_mode,
                  "--ssd gives the planner its SSD figures: it is for --offload plan");
  TIDAL_EXPECT_AS(InvalidArgument, args.save_plan.empty() || plan_mode,
                  "--save-plan writes plan mode's plan: it is for --offload plan");
  TIDAL_EXPECT_AS(InvalidArgument, args.checkpoint_every >= 0,
                  "--checkpoint-every must be 0 (at the end only) or more");
  TIDAL_EXPECT_AS(InvalidArgument, args.checkpoint_every == 0 || !args.checkpoint.empty(),
                  "--checkpoint-every needs --checkpoint DIR (where to write them)");
  std::string checkpoint_path;
  if (!args.checkpoint.empty()) {
    make_directory(args.checkpoint, "--checkpoint");
    checkpoint_path = (std::filesystem::path(args.checkpoint) / kCheckpointFile).string();
  }
  TIDAL_EXPECT_AS(InvalidArgument, args.timeline.empty() || mode != torch_layer::OffloadMode::kNone,
                  "--timeline draws what offloading did: it is for --offload plan or activations");
  TIDAL_EXPECT_AS(InvalidArgument, args.timeline_steps >= 0, "--timeline-steps ",
                  args.timeline_steps,
                  " must be 0 (no timeline and no time report) or more (the steps kept)");
  TIDAL_EXPECT_AS(InvalidArgument, args.timeline.empty() || args.timeline_steps > 0,
                  "--timeline needs --timeline-steps of 1 or more (the steps it keeps)");
  std::vector<std::pair<const std::string*, const char*>> to_write = {
      {&args.save_plan, "--save-plan"},
      {&args.save_trace, "--save-trace"},
      {&checkpoint_path, "--checkpoint"}};
  for (const auto& t : args.timeline) to_write.emplace_back(&t, "--timeline");
  for (const auto& [path, flag] : to_write) {
    if (path->empty()) continue;
    const std::string why = why_not_writable(*path);
    TIDAL_EXPECT_AS(InvalidArgument, why.empty(), "cannot write '", *path, "' (", flag, "): ", why,
                    "; check that its directory exists and is writable");
  }
  return checkpoint_path;
}

// Refuses plan mode's flags and --host-mem in the modes that do nothing with them.
void check_mode_flags(const TrainArgs& args, torch_layer::OffloadMode mode) {
  const bool plan_options_given = !args.mem_budget.empty() || args.strict_meter ||
                                  args.strict_budget || !args.between_steps.empty();
  if (mode != torch_layer::OffloadMode::kPlan && plan_options_given) {
    const char* flag = !args.mem_budget.empty()      ? "--mem-budget"
                       : args.strict_meter           ? "--strict-meter"
                       : !args.between_steps.empty() ? "--between-steps"
                                                     : "--strict-budget";
    TIDAL_FAIL_AS(InvalidArgument, flag, " is for --offload plan; --offload ", args.offload,
                  " does nothing with it: leave it out, or use --offload plan");
  }
  TIDAL_EXPECT_AS(InvalidArgument, mode != torch_layer::OffloadMode::kNone || args.host_mem.empty(),
                  "--host-mem is for --offload plan or activations; --offload none does nothing "
                  "with it");
}

// --mem-budget: a percentage of the profiled peak or a size; empty: the device's default, chosen
// by the session and printed with the results.
void set_memory_budget(const TrainArgs& args, torch_layer::SessionOptions& so) {
  if (args.mem_budget.empty()) return;
  if (args.mem_budget.find('%') != std::string::npos) {
    const double fraction = parse_flag("--mem-budget", args.mem_budget, parse_percentage);
    TIDAL_EXPECT_AS(InvalidArgument, fraction > 0 && fraction <= 1, "--mem-budget ",
                    args.mem_budget, " must be a percentage in (0, 100] or a size such as 2GiB");
    so.budget_fraction = fraction;
  } else {
    so.memory_budget = parse_bytes(args.mem_budget);
    TIDAL_EXPECT_AS(InvalidArgument, so.memory_budget > 0, "--mem-budget ", args.mem_budget,
                    " must be more than 0: a size such as 2GiB or a percentage such as 50%");
  }
}

// The session the flags describe, over `meter`. Sets `checkpoint_path` (see check_outputs).
torch_layer::SessionOptions session_options(const TrainArgs& args, const torch::Device& device,
                                            torch_layer::MemoryMeter& meter,
                                            std::string& checkpoint_path) {
  torch_layer::SessionOptions so;
  so.device = device;  // the meter's device, and the planner's (no CPU cost of I/O on a GPU)
  so.mode = torch_layer::offload_mode_from_string(args.offload);
  set_store_options(args, so);
  checkpoint_path = check_outputs(args, so.mode);
  so.activations.min_bytes = parse_bytes(args.min_offload);
  so.executor.min_bytes = parse_bytes(args.min_offload);
  so.warmup_steps = args.warmup_steps;
  so.profile_steps = args.profile_steps;
  check_mode_flags(args, so.mode);
  set_memory_budget(args, so);
  so.budget_option = "--mem-budget";
  so.between_steps_option = "--between-steps offloaded";
  if (!args.ssd.empty()) so.hardware_overrides.ssd = parse_ssd_flag(args.ssd);
  so.peak_bytes = [&meter] { return meter.peak_bytes(); };
  so.current_bytes = [&meter] { return meter.current_bytes(); };
  so.reset_peak = [&meter] { meter.reset_peak(); };
  if (so.mode == torch_layer::OffloadMode::kPlan) {
    // An option of plan mode only: a session of another mode refuses it.
    so.between_steps = args.between_steps == "resident"    ? torch_layer::BetweenSteps::kResident
                       : args.between_steps == "offloaded" ? torch_layer::BetweenSteps::kOffloaded
                                                           : torch_layer::BetweenSteps::kAuto;
  }
  so.strict_budget = args.strict_budget;
  if (args.strict_meter) so.strict_meter = true;
  if (!args.host_mem.empty()) so.host_memory = parse_bytes(args.host_mem);
  so.timeline_steps = static_cast<std::size_t>(args.timeline_steps);
  so.model_name = args.model.model;
  so.batch = args.model.batch;
  so.seq = args.model.seq;
  if (so.mode == torch_layer::OffloadMode::kPlan) {
    TIDAL_EXPECT_AS(InvalidArgument, args.model.steps > args.warmup_steps + args.profile_steps,
                    "--offload plan needs more --steps than --warmup-steps + --profile-steps (",
                    args.warmup_steps + args.profile_steps,
                    "): those steps run without offloading");
  }
  return so;
}

// --resume: loads the checkpoint and checks that steps are left to run. Returns the steps done.
std::int64_t resume_from(models::Trainer& trainer, const TrainArgs& args,
                         torch_layer::OffloadMode mode) {
  if (!args.resume.empty()) {
    trainer.load_checkpoint((std::filesystem::path(args.resume) / kCheckpointFile).string());
  }
  const std::int64_t first_step = trainer.steps_done();
  TIDAL_EXPECT_AS(InvalidArgument, first_step < args.model.steps, "--resume: the checkpoint in '",
                  args.resume, "' is at step ", first_step, " and --steps is ", args.model.steps,
                  ": --steps counts from the start of training, raise it");
  if (mode == torch_layer::OffloadMode::kPlan && first_step > 0) {
    TIDAL_EXPECT_AS(InvalidArgument,
                    args.model.steps - first_step > args.warmup_steps + args.profile_steps,
                    "--offload plan profiles again after --resume: --steps must leave more than "
                    "--warmup-steps + --profile-steps (",
                    args.warmup_steps + args.profile_steps, ") steps after step ", first_step);
  }
  return first_step;
}

// Says the defaults the session chose, checks in plan mode that the model's state fits before
// step 0, and hands the session the trainer's tensors and steps.
void attach_session(torch_layer::Session& session, const torch_layer::SessionOptions& so,
                    models::Trainer& trainer) {
  if (!session.stats().defaults.empty()) {
    std::fprintf(stderr, "defaults: %s\n", session.stats().defaults.c_str());
  }
  if (so.mode == torch_layer::OffloadMode::kPlan) {
    // The model's state before step 0: weights, gradients and AdamW's two moments.
    std::uint64_t weights = 0;
    for (const auto& p : trainer.model()->parameters()) weights += p.nbytes();
    const plan::Preflight check = session.preflight(4 * weights);
    std::fprintf(stderr, "%s\n", check.line.c_str());
    TIDAL_EXPECT_AS(InvalidArgument, check.fits, check.line);
  }
  trainer.register_persistent(session, false);
  trainer.add_observer(&session);
}

void print_run_header(const TrainArgs& args, const models::TrainerOptions& options,
                      torch_layer::Session& session) {
  const auto& c = options.config;
  std::fprintf(stderr,
               "tidal train: %s (%.1fM parameters) batch %lld seq %lld on %s (BLAS %s), offload "
               "%s\n",
               c.name.c_str(), static_cast<double>(c.parameter_count()) / 1e6,
               static_cast<long long>(options.batch), static_cast<long long>(options.seq),
               options.device.str().c_str(),
               options.device.is_cuda() ? "cuBLAS" : torch_layer::blas_library().c_str(),
               args.offload.c_str());
  if (!session.store()) return;
  const auto st = session.store()->stats();
  std::string dirs;
  for (const auto& d : session.store()->options().dirs) dirs += (dirs.empty() ? "" : ",") + d;
  std::fprintf(stderr, "store: %s on %s, backend %s, %s%s\n",
               format_bytes(static_cast<double>(st.capacity)).c_str(), dirs.c_str(),
               st.backend.c_str(), st.buffered ? "BUFFERED (frees no memory)" : "O_DIRECT",
               session.store()->options().checksum
                   ? ""
                   : ", checksums OFF (TIDAL_CHECKSUM=0: a corrupt read would go unnoticed)");
  if (st.backend_fallback.count > 0) {
    std::fprintf(stderr, "store: DEGRADED backend: %s\n", st.backend_fallback.reason.c_str());
  }
}

// What the steps of a run measured.
struct StepRecord {
  std::vector<double> losses;
  std::vector<double> seconds;
  std::vector<double> offload_seconds;  // steps that ran with offloading on
  std::vector<std::uint64_t> step_peaks;
  IoTotals io;  // over the steps that ran with offloading on
  int checkpoints_written = 0;
};

// Runs the steps from `first_step` to --steps, with the progress bar and the checkpoints.
StepRecord run_steps(const TrainArgs& args, const models::TrainerOptions& options,
                     models::Trainer& trainer, torch_layer::Session& session,
                     InterruptReport& interrupt, std::int64_t first_step,
                     const std::string& checkpoint_path) {
  StepRecord rec;
  Progress bar("steps", args.model.steps - first_step, Progress::Style::kBar);
  const double tokens_per_step = static_cast<double>(options.batch * options.seq);
  std::int64_t saved_step = first_step;  // a resumed run's checkpoint is its first saved state
  for (std::int64_t i = first_step; i < args.model.steps; ++i) {
    interrupt.before_step(i + 1, args.model.steps, saved_step, args.checkpoint);
    const bool executing = session.stats().state == torch_layer::SessionState::kExecuting;
    const auto r = trainer.step();
    // Gradients exist now; they stay (zeroed in place) only on the after-backward schedule.
    if (i == first_step) {
      trainer.register_persistent(session, options.optimizer == OptimizerSchedule::kAfterBackward);
    }
    const auto s = session.stats();
    rec.losses.push_back(r.loss);
    rec.seconds.push_back(r.seconds);
    rec.step_peaks.push_back(s.step_peak);
    if (executing) {
      rec.offload_seconds.push_back(r.seconds);
      rec.io.add(s);
    }
    char text[160];
    std::snprintf(text, sizeof(text), "loss %.4f  %.0f tok/s  %s", r.loss,
                  tokens_per_step / r.seconds, torch_layer::to_string(s.state));
    bar.update(i + 1 - first_step, text);
    const bool last = i + 1 == args.model.steps;
    if (!checkpoint_path.empty() &&
        (last || (args.checkpoint_every > 0 && (i + 1) % args.checkpoint_every == 0))) {
      trainer.save_checkpoint(checkpoint_path, &session);
      ++rec.checkpoints_written;
      saved_step = i + 1;
    }
  }
  return rec;
}

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
      "for memory); step boundary %s%s; %s\n",
      format_bytes(static_cast<double>(st.memory_budget)).c_str(),
      format_bytes(static_cast<double>(st.profiled_peak)).c_str(),
      format_bytes(static_cast<double>(st.untouched_bytes)).c_str(),
      !t.peak_measured   ? "not measured"
      : st.within_budget ? "kept"
                         : "EXCEEDED",
      static_cast<long long>(st.steps_measured), static_cast<long long>(st.steps_over_budget),
      st.tightenings, st.between_steps.empty() ? "not chosen yet" : st.between_steps.c_str(),
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
  j["within_budget"] = t.peak_measured ? nlohmann::json(st.within_budget) : nlohmann::json(nullptr);
  j["steps_measured"] = st.steps_measured;
  j["steps_over_budget"] = st.steps_over_budget;
  // Ops the device's allocator refused past the wall and that ran again once tensors were
  // written out (the strict meter on a GPU): each one is a step that would have crashed.
  j["out_of_memory_retries"] = torch_layer::PlanExecutor::out_of_memory_retries();
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

// What the JSON line says besides the store and the time report.
struct RunContext {
  const TrainArgs& args;
  const models::TrainerOptions& options;
  const torch_layer::SessionOptions& so;
  std::int64_t first_step;
};

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

void run_train(const TrainArgs& args) {
  TIDAL_EXPECT_AS(InvalidArgument, args.model.steps >= 1, "--steps must be at least 1");
  auto options = to_trainer_options(args.model);
  torch_layer::MemoryMeter meter(options.device);  // installs the CPU meter before any tensor
  meter.reset_peak();
  std::string checkpoint_path;
  torch_layer::SessionOptions so = session_options(args, options.device, meter, checkpoint_path);

  models::Trainer trainer(options);
  const std::int64_t first_step = resume_from(trainer, args, so.mode);
  KillAtStep killer(args.kill_at_step);
  if (args.kill_at_step > 0) trainer.add_observer(&killer);
  if (args.recompute) {
    trainer.model()->set_block_wrapper(
        [](std::int64_t, const models::BlockFn& block, const torch::Tensor& x) {
          return torch_layer::checkpoint(block, x);
        });
  }
  torch_layer::Session session(so);
  so = session.options();  // with what was left to the machine chosen
  attach_session(session, so, trainer);
  print_run_header(args, options, session);
  if (first_step > 0) {
    std::fprintf(stderr, "resumed from '%s' after step %lld\n", args.resume.c_str(),
                 static_cast<long long>(first_step));
  }
  InterruptReport interrupt;
  const StepRecord rec =
      run_steps(args, options, trainer, session, interrupt, first_step, checkpoint_path);
  trainer.remove_observer(&session);
  report_run({args, options, so, first_step}, session, meter, rec);
}

}  // namespace

void add_train_command(CLI::App& app) {
  auto args = std::make_shared<TrainArgs>();
  auto* cmd = app.add_subcommand("train", "train a reference GPT-2 / Llama model");
  add_model_options(cmd, args->model);
  cmd->add_option("--offload", args->offload,
                  "none, activations (saved tensors to SSD) or plan (profile, plan, execute)")
      ->capture_default_str();
  cmd->add_option("--mem-budget", args->mem_budget,
                  "plan mode: memory to stay under, bytes (2GiB) or a percentage of the peak "
                  "measured while profiling (50%); default: on a GPU what tensors can hold there "
                  "(measured at start), on the CPU 50%");
  cmd->add_option_function<std::string>(
      "--dir",
      [args](const std::string& v) {
        args->dirs = v;
        args->dirs_given = true;
      },
      "store directories, comma-separated, one per SSD (default TIDAL_DIRS, else "
      "/var/tmp/tidal)");
  cmd->add_option("--store-capacity", args->capacity,
                  "bytes the store reserves over its directories (0: 25% of the free space, at "
                  "most 64GiB)")
      ->capture_default_str();
  cmd->add_option("--min-offload", args->min_offload, "tensors smaller than this stay in memory")
      ->capture_default_str();
  cmd->add_option("--warmup-steps", args->warmup_steps, "plan mode: steps before profiling")
      ->capture_default_str();
  cmd->add_option("--profile-steps", args->profile_steps, "plan mode: steps profiled")
      ->capture_default_str();
  cmd->add_option("--ssd", args->ssd, "plan mode: SSD figures for the planner, e.g. 1x2.0/1.5GB/s");
  cmd->add_option("--save-trace", args->save_trace,
                  "plan mode: write the profiled trace here (for tidal simulate --trace)");
  cmd->add_option("--save-plan", args->save_plan, "plan mode: write the plan here");
  cmd->add_flag("--recompute", args->recompute,
                "activation checkpointing: recompute each block in backward instead of keeping "
                "its activations");
  cmd->add_option("--between-steps", args->between_steps,
                  "plan mode: where the step's tensors are between steps: auto (resident where "
                  "a plan meets the budget so, else offloaded), resident (readable by any code) "
                  "or offloaded (more memory saved); default auto")
      ->check(CLI::IsMember({"auto", "resident", "offloaded"}));
  cmd->add_flag("--strict-meter", args->strict_meter,
                "plan mode: the budget is a wall, as a GPU's memory is: an allocation past it "
                "has tensors written out, or fails with out of memory; with a budget in bytes it "
                "stands from step 0 (warm-up and profiling included). On by default on a GPU, "
                "off on the CPU");
  cmd->add_flag("--strict-budget", args->strict_budget,
                "plan mode: stop with an error when no plan can meet the budget (default: run "
                "with the smallest peak a plan reaches and say why)");
  cmd->add_option("--host-mem", args->host_mem,
                  "host memory offloaded tensors may use (e.g. 8GiB; 0: SSD only): the planner "
                  "puts there what the SSDs cannot move in time, activation offloading writes "
                  "there first. Default: on a GPU "
                  "the memory the process may still take less a reserve (a quarter, at least "
                  "2GiB); on the CPU 0");
  cmd->add_option("--checkpoint", args->checkpoint,
                  "write checkpoints (model, optimizer, data position, RNG, step) to this "
                  "directory, atomically: at the end, and every --checkpoint-every steps");
  cmd->add_option("--checkpoint-every", args->checkpoint_every,
                  "steps between checkpoints (0: at the end only)")
      ->capture_default_str();
  cmd->add_option("--resume", args->resume,
                  "continue the run whose --checkpoint directory this is (same model, data and "
                  "optimizer options; --steps is the total)");
  cmd->add_option("--kill-at-step", args->kill_at_step,
                  "testing: the process kills itself (SIGKILL) in this step's backward pass")
      ->group("");  // hidden
  cmd->add_option("--timeline", args->timeline,
                  "write what the offloader did in the last --timeline-steps steps: a Chrome "
                  "trace (open it in ui.perfetto.dev or chrome://tracing), or for a name ending "
                  "in .svg a picture of memory against the budget with the I/O under it; may "
                  "be given more than once");
  cmd->add_option("--timeline-steps", args->timeline_steps,
                  "steps the timeline and the time report keep (0: none, no report)");
  cmd->add_flag("--json", args->json, "print one JSON object with the results as the last line");
  cmd->callback([args] { run_train(*args); });
}

}  // namespace tidal::cli
