// tidal::Session: the one object a training loop needs. Call begin_step()/end_step() around each
// step; the session offloads tensors to the SSD store in the chosen mode and reports what it did.
// The smallest correct use needs nothing else: parameters, gradients and optimizer state are
// found in the trace (tensors made before a step that outlive it), lazily created state (Adam's
// first step) included, and the memory meter is the session's own unless one is given.
//
//   tidal::torch_layer::SessionOptions opt;
//   opt.mode = tidal::torch_layer::OffloadMode::kPlan;
//   opt.store.dirs = {"/mnt/nvme0"};
//   tidal::torch_layer::Session session(opt);   // before the model: the meter sees every tensor
//   for (...) { session.begin_step(); ...forward, backward, step...; session.end_step(); }
//
// What a loop may do, and what tidal does for each case: docs/runtime.md.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tidal/io/store.hpp"
#include "tidal/plan/hardware.hpp"
#include "tidal/plan/plan.hpp"
#include "tidal/plan/preflight.hpp"
#include "tidal/plan/timeline.hpp"
#include "tidal/torch/activations.hpp"
#include "tidal/torch/executor_options.hpp"
#include "tidal/torch/step.hpp"
#include "tidal/trace/trace.hpp"

namespace tidal::torch_layer {

enum class OffloadMode : std::uint8_t {
  kNone,         ///< nothing moves (the reference)
  kActivations,  ///< saved activations through autograd hooks (SSDTrain/TBA)
  kPlan,         ///< profile, plan, execute: every tensor class (TERAIO)
};
const char* to_string(OffloadMode m);
/// "none", "activations", "plan"; throws tidal::InvalidArgument otherwise.
OffloadMode offload_mode_from_string(const std::string& s);

enum class SessionState : std::uint8_t {
  kOff,        ///< mode none
  kWarmup,     ///< plan mode: steps before profiling
  kProfiling,  ///< plan mode: steps recorded for the first plan
  kExecuting,  ///< activation mode, or plan mode with a plan
};
const char* to_string(SessionState s);

/// Plan mode: where the tensors a step touched are between steps.
enum class BetweenSteps : std::uint8_t {
  /// In memory: after end_step() every tensor the step's ops used that is still alive is
  /// resident, so any code (torch::save, data_ptr loops, evaluation) may read it. The plan keeps
  /// memory for that at the step's end; tensors still leave memory during the step.
  kResident,
  /// Possibly on the SSD: more memory saved (optimizer state can stay out across the step
  /// boundary), but only ATen ops on the session's thread bring them back by themselves; code
  /// that reads raw bytes (torch::save, data_ptr) must call Session::make_resident() first.
  kOffloaded,
  /// The planner's choice (the CLI's and Python's default): resident where a plan meets the
  /// budget so, offloaded where only that meets it (a model whose state is larger than the
  /// budget). Chosen once, at the first plan; stats().between_steps says which, and a notice
  /// says what it means for code between steps.
  kAuto,
};

/// SessionOptions::host_memory: the machine's default.
inline constexpr std::uint64_t kHostMemoryAuto = ~std::uint64_t{0};
/// SessionOptions::budget_fraction's default on the CPU.
inline constexpr double kCpuBudgetFraction = 0.5;

struct SessionOptions {
  OffloadMode mode = OffloadMode::kNone;
  io::StoreOptions store;  ///< directories, capacity, backend (not opened in kNone)
  /// Activation mode. The warm-up steps and one more run without offloading, and the last one's
  /// peak is the reference;
  /// when an offloaded step does not peak lower than it, the session stops
  /// offloading and says why in stats().notice (unless activations.adaptive is false).
  ActivationOptions activations;
  ExecutorOptions executor;
  /// Steps run without offloading before profiling (plan mode) or before the reference step
  /// (activation mode): lazily made state (Adam's) gets created.
  int warmup_steps = 1;
  /// Plan mode: steps profiled before planning (op times are their medians).
  int profile_steps = 2;
  /// Plan mode on a CPU device: every this many executed steps of a step shape (twice as many
  /// after each retiming, up to 16 times as many), their op times (medians) replace the trace's
  /// where its compute time differs by more than a tenth, and the shape is planned again on them
  /// (stats().retimings). 0: the profile's op times stand.
  int retime_steps = 4;
  /// Plan mode: the tensor memory the process may hold during a step, in bytes, as the meter
  /// counts it (all of it: what a GPU's out-of-memory check would see). 0: from budget_fraction.
  /// Neither given (both 0): the device's default. On a CUDA device that is what tensors can
  /// hold there, measured when the session starts (the device's memory less the CUDA context,
  /// library workspaces and the allocator's idle cache: default_device_budget); on the CPU,
  /// which has no memory of its own to stand for, a fraction of kCpuBudgetFraction.
  std::uint64_t memory_budget = 0;
  /// Plan mode, when memory_budget is 0: the share of the memory the steps themselves use. The
  /// budget is untouched + fraction x (profiled peak - untouched), where "untouched" is memory
  /// held when a step starts that no op of the step uses (a dataset in memory, say): offloading
  /// cannot lower it, so it is not scaled. Both figures are in stats(). 0: the device's default
  /// (above).
  double budget_fraction = 0;
  /// Plan mode: when no plan can meet the budget, throw tidal::InvalidArgument from the
  /// end_step() that would have started it (true), or run with the smallest peak a plan can
  /// reach and say why in stats() (false, the default: a training loop is never stopped for it).
  bool strict_budget = false;
  /// Plan mode: the strict meter (set_cpu_memory_cap) at the budget from the first
  /// executed step on, with the executor as its reclaimer. An allocation that would cross the
  /// budget writes out tensors the running op does not read, and when none is left is refused
  /// with c10::OutOfMemoryError, as a GPU with that much memory would refuse it. When no plan
  /// meets the budget and strict_budget is off, the session runs at the least peak a plan
  /// reaches (stats().budget_reason says so) and the wall stands there. Tests and benchmarks
  /// run with it on. On a CUDA device it sets the caching allocator's memory fraction at the
  /// budget (it counts the memory the allocator reserved), and an op refused memory there is
  /// run again after the executor writes tensors out, so that a model larger than the budget
  /// trains from step 0 with a budget in bytes. Without CUDA in torch, a notice says the wall
  /// is not there. Unset: on for a CUDA device (its memory is a wall anyway; with it a model
  /// larger than the device trains from step 0), off on the CPU (tests turn it on to be as
  /// strict as a GPU).
  std::optional<bool> strict_meter;
  /// The strict meter on the CPU raised the way a GPU raises it: the cap refuses at once, and
  /// the residency guard writes tensors out and runs the refused op again (rather than a
  /// reclaimer freeing memory inside the allocation). Tests the GPU's path where there is no GPU.
  bool wall_by_retry = false;
  /// How messages name the budget to the user: the options here, or a front-end's flag (the
  /// CLI sets "--mem-budget").
  std::string budget_option = "SessionOptions::memory_budget or budget_fraction";
  /// kResident here, for a C++ loop may read raw bytes between steps (torch::save) where no
  /// hook can bring them back; the CLI and Python, which make their own raw readers (state_dict,
  /// checkpoints) bring tensors back first, default to kAuto.
  BetweenSteps between_steps = BetweenSteps::kResident;
  /// How messages name the kOffloaded choice to the user (a budget a resident step boundary
  /// cannot meet suggests it); the CLI sets "--between-steps offloaded".
  std::string between_steps_option = "SessionOptions::between_steps = BetweenSteps::kOffloaded";
  /// Plan and activation modes: host memory offloaded tensors may use, in bytes (0: none, SSD
  /// only). Activation mode writes saved tensors there first and to the SSD store where it is
  /// full. The planner sends a tensor there where the SSD channel has no room for its migration
  /// in time;
  /// the executor copies it into a host pool of this size (page-locked on a GPU machine). On a
  /// CPU-only machine the pool is ordinary memory outside the meter: it stands for a GPU's host
  /// memory, and is reported apart (stats().bytes_to_host). kHostMemoryAuto (the default): on a
  /// CUDA device what the process may still take less a reserve (default_host_tier: available
  /// memory or the cgroup's room, a quarter kept, at least 2 GiB); on the CPU 0.
  std::uint64_t host_memory = kHostMemoryAuto;
  /// Plan mode: the hardware model for the planner (device memory is set from the budget).
  std::string hardware = "cpu-here";
  plan::HardwareOverrides hardware_overrides;
  /// The memory meter: its peak since the last reset, the bytes held now, and a reset. Unset:
  /// the session makes a MemoryMeter for `device` (on CPU it installs tidal's tracking
  /// allocator, which sees the tensors created after that: make the Session first).
  std::function<std::uint64_t()> peak_bytes;
  std::function<std::uint64_t()> current_bytes;
  std::function<void()> reset_peak;
  c10::Device device = c10::Device(c10::kCPU);
  /// The timeline (plan::Timeline): what ran in the last `timeline_steps` steps (ops, each
  /// transfer on its channel, stalls, memory against the budget), or in the steps listed in
  /// `timeline_chosen_steps`. 0 with no chosen steps: none is kept, and time_report() has
  /// nothing to go on. Plan and activation modes.
  std::size_t timeline_steps = 2;
  std::vector<std::int64_t> timeline_chosen_steps;
  /// Written there (Chrome trace; an SVG for a name ending in .svg) when the session closes or
  /// is destroyed. Empty: only on request (write_timeline).
  std::string timeline_path;
  std::string model_name;  ///< labels for the trace
  std::int64_t batch = 0;
  std::int64_t seq = 0;
};

/// What the session did in the last step, and overall.
struct SessionStats {
  OffloadMode mode = OffloadMode::kNone;
  SessionState state = SessionState::kOff;
  std::uint64_t bytes_written = 0;    ///< last step, to the SSD store
  std::uint64_t bytes_read = 0;       ///< last step, from the SSD store
  std::uint64_t bytes_to_host = 0;    ///< last step, plan mode: to the host pool
  std::uint64_t bytes_from_host = 0;  ///< last step, plan mode: from the host pool
  /// Last step, plan mode: read from the SSD store into the host pool ahead of their prefetch
  /// (the plan's stages); counted in bytes_read too.
  std::uint64_t bytes_staged = 0;
  double host_stall_seconds = 0;  ///< last step: the part of stall_seconds on host reads
  /// Plan mode: what the plan of the last step's shape moves per step (the planner's figures,
  /// to compare with the executed ones above).
  std::uint64_t planned_bytes_to_ssd = 0;
  std::uint64_t planned_bytes_to_host = 0;
  /// Plan mode: the step time the plan predicts (the profiled op times plus the stalls it
  /// accepts), for the shape the last step ran; 0 before a plan.
  double planned_step_seconds = 0;
  /// Plan mode: "resident" or "offloaded" once known (with kAuto: the planner's choice, from
  /// the first plan on), else empty.
  std::string between_steps;
  double stall_seconds = 0;             ///< last step: time computation waited for reads
  double write_stall_seconds = 0;       ///< last step, plan mode: time ops waited for writes to
                                        ///< free memory rather than cross the budget
  std::uint64_t misses = 0;             ///< last step: reads not prefetched in time
  std::uint64_t write_failures = 0;     ///< last step: writes that failed (tensors kept in memory)
  std::uint64_t store_full_writes = 0;  ///< last step: of those, refused for want of space
  std::string write_error;              ///< last step: the store's message for a failed write
  std::uint64_t step_peak = 0;          ///< last step: the meter's peak between begin and end
  std::uint64_t memory_budget = 0;      ///< plan mode, once known: whole-process bytes
  std::uint64_t untouched_bytes = 0;    ///< plan mode: memory no step touches (not offloadable)
  std::uint64_t profiled_peak = 0;      ///< plan mode: peak measured while profiling
  /// Plan mode: every executed step had its peak at or under the budget (steps_over_budget is
  /// 0), and at least one step ran a plan to its end (steps_measured counts those of the
  /// current plans).
  bool within_budget = false;
  std::int64_t steps_measured = 0;     ///< plan mode: steps of the current plans, measured
  std::int64_t steps_over_budget = 0;  ///< plan mode: executed steps over the budget, all plans
  std::int64_t steps_aborted = 0;      ///< steps ended by abort_step (not learnt from)
  /// Ops refused memory under the wall and run again after tensors were written out, since the
  /// session was made (the device's wall on a GPU, SessionOptions::wall_by_retry on the CPU).
  std::uint64_t out_of_memory_retries = 0;
  std::string budget_reason;  ///< plan mode: why the budget is not met, when it is not
  int shapes = 0;             ///< plan mode: distinct step shapes with a plan
  int shape = -1;             ///< plan mode: the shape the last step ran (-1: none)
  int replans = 0;            ///< plans made after the first (new step shapes, tighter plans)
  int tightenings = 0;  ///< plan mode: re-plans for a smaller capacity after a step over budget
  /// Plan mode on a CPU device: re-plans on op times measured in executed steps, where they
  /// differed from the profiled ones by more than a tenth (a process's warm-up, a busier core).
  int retimings = 0;
  /// Plan mode: the first plan came before step 0 from traces of the loop made without
  /// running it (Session::plan_ahead), rather than from profiled steps.
  bool planned_ahead = false;
  std::uint64_t executed_peak = 0;  ///< plan mode: the highest peak of the current plans' steps
  std::string plan_summary;         ///< plan mode: one line from the planner
  /// Plan mode: what the session chose where an option was left to the machine (the budget,
  /// the wall, the host tier), with the figures it read; empty when every one was given.
  std::string defaults;
  std::string notice;  ///< something the user should know, said once (or empty)
};

/// Owns the store, the offloader or the tracer + executor, and switches between them.
/// Call everything from the thread that runs the training loop. Not copyable.
class Session final : public StepObserver {
 public:
  /// Opens the store (not in kNone). Throws tidal::InvalidArgument for bad options.
  explicit Session(SessionOptions options);
  ~Session() override;  // not copyable: it owns its Impl alone

  /// Optional: names and classes for tensors that live across steps (parameters, gradients,
  /// optimizer state, buffers); the session finds them without it. In activation mode they are
  /// never written as activations. Never throws for a tensor without storage (ignored).
  void register_persistent(const std::vector<torch::Tensor>& tensors, trace::TensorClass cls,
                           const std::string& name_prefix = "");
  void register_persistent(const torch::Tensor& tensor, const std::string& name,
                           trace::TensorClass cls);

  /// A step starts. Plan mode: may start profiling; starts what the plan moves at the step's
  /// start. Throws tidal::Error only for misuse (a step already open).
  void begin_step(std::int64_t step, const std::vector<torch::Tensor>& inputs) override;
  void begin_phase(trace::Phase phase) override;
  void begin_layer(std::int64_t layer) override;
  /// The step's ops have run. Plan mode: may plan (never throws for a budget it cannot meet
  /// unless strict_budget), and makes the step's tensors resident (BetweenSteps::kResident).
  /// Throws tidal::IoError when a tensor cannot be read back (the store's message: EIO, a
  /// checksum mismatch); an op of the step that needed such a tensor threw it already.
  void end_step(std::int64_t step) override;
  /// Ends a step that raised part-way (Python's `with session.step():` calls it when an
  /// exception leaves the block): nothing is learnt from it (no profiled step, new step shape,
  /// re-plan or tightening of the wall; stats().steps_aborted counts it), the tensors it moved
  /// come back where the step boundary is resident, and the next step starts under the same
  /// wall. Does nothing outside a step. Throws tidal::IoError when a tensor cannot be read back.
  void abort_step();
  /// The same, numbering steps 0, 1, 2, ... by themselves.
  void begin_step() { begin_step(next_step_, {}); }
  void end_step() { end_step(step_); }

  /// Plan mode: brings every tensor the plan moved back into memory now (for code between
  /// steps that reads raw bytes with BetweenSteps::kOffloaded). Under the strict meter the
  /// wall is lifted until the next begin_step (the state may be larger than the budget).
  /// Throws tidal::IoError.
  void make_resident();

  /// Plan mode: keeps `tensor`'s storage in memory, untouched by the plan, until release() or
  /// the end of the step:
  /// for a tensor that another thread writes without ops the tracer sees (DDP's gradient
  /// bucket while its all-reduce is in flight; tidal.distributed's hook holds it). Calls
  /// nest; any thread; a no-op in other modes and before the plan runs.
  void hold(const torch::Tensor& tensor);
  void release(const torch::Tensor& tensor);

  /// Ends the session before its destruction: every moved tensor comes back into memory, the
  /// strict meter's cap comes off, and the store (its files, its disk reservation) is closed
  /// once nothing else holds it. stats() still answers; begin_step() throws. Between steps;
  /// a second call does nothing.
  void close();

  [[nodiscard]] SessionStats stats() const;
  /// Plan mode, before step 0: whether a model's state of `state_bytes` (parameters, gradients,
  /// optimizer state) fits in the budget, the host tier and the store together, and the least
  /// a step spends moving what the budget leaves out (plan::preflight, at the planner's rates;
  /// on cpu-here the store is measured first). The front-ends refuse to train when it does not
  /// fit.
  [[nodiscard]] plan::Preflight preflight(std::uint64_t state_bytes);
  /// The options in force: those given, with what was left to the machine chosen
  /// (stats().defaults says what and why).
  [[nodiscard]] const SessionOptions& options() const;
  /// Where the time of the kept executed steps went, with the plan's figures beside, and the
  /// sentence saying what limits the run (plan::format_report prints it). steps == 0 when no
  /// timeline is kept or no step was.
  [[nodiscard]] plan::TimeReport time_report() const;
  /// The timeline (null when none is kept).
  [[nodiscard]] std::shared_ptr<const plan::Timeline> timeline() const;
  /// Writes the timeline of the kept steps: a Chrome trace (Perfetto, chrome://tracing), or an
  /// SVG for a path ending in .svg. Throws tidal::InvalidArgument when no timeline is kept,
  /// tidal::Error when the file cannot be written.
  void write_timeline(const std::string& path) const;
  /// Plan mode: the trace and plan in use (nullopt before planning).
  [[nodiscard]] const std::optional<trace::Trace>& trace() const;
  /// The steps recorded while the session profiles (warm-up steps are not), in order; empty in
  /// the other states. A session run on fake tensors (Python's tidal.fake_trace) is read so.
  [[nodiscard]] std::vector<trace::Trace> recorded_iterations() const;
  /// Plans before step 0 from traces of the loop made without running it (Python's
  /// tidal.fake_trace: the step under FakeTensorMode): `first` is step 0's (lazily made state,
  /// such as Adam's, appears in it), `steady` a later step's. Step 0 runs the plan of `first`
  /// and the steps after it the plan of `steady`, with no profiled steps; a step whose ops leave
  /// them is profiled and planned as a new step shape, as after profiling. The traces have no
  /// workspaces: the largest tensor an op touches is set aside for them. Executed steps' op times
  /// replace the traces' (retime_steps). Call in plan mode before the first step; persistent
  /// tensors are matched to the traces' by their registered names. Throws tidal::InvalidArgument
  /// otherwise.
  void plan_ahead(trace::Trace first, trace::Trace steady);
  [[nodiscard]] const std::optional<plan::Plan>& plan() const;
  [[nodiscard]] std::shared_ptr<io::TensorStore> store() const;

  struct Impl;  ///< opaque

 private:
  std::unique_ptr<Impl> impl_;
  std::int64_t step_ = 0;
  std::int64_t next_step_ = 0;
};

}  // namespace tidal::torch_layer
