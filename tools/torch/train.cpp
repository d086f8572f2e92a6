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
#include "tidal/torch/memory.hpp"
#include "tidal/torch/session.hpp"
#include "tidal/trace/io.hpp"
#include "train_args.hpp"
#include "train_report.hpp"

namespace tidal::cli {
namespace {

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
  so.retime_steps = args.retime_steps;
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
    // The model's state before step 0: weights, gradients and AdamW's two moments; with the
    // optimizer step on the host, the weights and a gradient on its way out.
    std::uint64_t weights = 0;
    for (const auto& p : trainer.model()->parameters()) weights += p.nbytes();
    const plan::Preflight check =
        session.preflight((trainer.optimizer().on_host() ? 2 : 4) * weights);
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
               "%s%s\n",
               c.name.c_str(), static_cast<double>(c.parameter_count()) / 1e6,
               static_cast<long long>(options.batch), static_cast<long long>(options.seq),
               options.device.str().c_str(),
               options.device.is_cuda() ? "cuBLAS" : torch_layer::blas_library().c_str(),
               args.offload.c_str(),
               options.adamw.on_host ? ", optimizer step on the host (state in host memory)" : "");
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

// The options plan mode alone reads: its phases, the planner's SSD figures, what it saves, the
// step boundary and the wall.
void add_plan_mode_options(CLI::App* cmd, TrainArgs& a) {
  cmd->add_option("--warmup-steps", a.warmup_steps, "plan mode: steps before profiling")
      ->capture_default_str();
  cmd->add_option("--profile-steps", a.profile_steps, "plan mode: steps profiled")
      ->capture_default_str();
  cmd->add_option("--retime-steps", a.retime_steps,
                  "plan mode on the CPU: every this many executed steps (twice as many after "
                  "each retiming, up to 16 times), their op times replace "
                  "the profile's where the step's compute time differs by more than a tenth, and "
                  "the step is planned again on them (0: the profile's stand)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--ssd", a.ssd, "plan mode: SSD figures for the planner, e.g. 1x2.0/1.5GB/s");
  cmd->add_option("--save-trace", a.save_trace,
                  "plan mode: write the trace of the last plan here (profiled; op times from "
                  "executed steps where it was retimed; for tidal simulate --trace)");
  cmd->add_option("--save-plan", a.save_plan, "plan mode: write the plan here");
  cmd->add_option("--between-steps", a.between_steps,
                  "plan mode: where the step's tensors are between steps: auto (resident where "
                  "a plan meets the budget so, else offloaded), resident (readable by any code) "
                  "or offloaded (more memory saved); default auto")
      ->check(CLI::IsMember({"auto", "resident", "offloaded"}));
  cmd->add_flag("--strict-meter", a.strict_meter,
                "plan mode: the budget is a wall, as a GPU's memory is: an allocation past it "
                "has tensors written out, or fails with out of memory; with a budget in bytes it "
                "stands from step 0 (warm-up and profiling included). On by default on a GPU, "
                "off on the CPU");
  cmd->add_flag("--strict-budget", a.strict_budget,
                "plan mode: stop with an error when no plan can meet the budget (default: run "
                "with the smallest peak a plan reaches and say why)");
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
  cmd->add_flag("--recompute", args->recompute,
                "activation checkpointing: recompute each block in backward instead of keeping "
                "its activations");
  add_plan_mode_options(cmd, *args);
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
