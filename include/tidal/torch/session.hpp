// tidal::Session: the one object a training loop needs. Call begin_step()/end_step() around each
// step (or register it as a StepObserver with models::Trainer, which also reports phases); the
// session offloads tensors to the SSD store in the chosen mode and reports what it did.
//
//   tidal::torch_layer::SessionOptions opt;
//   opt.mode = tidal::torch_layer::OffloadMode::kActivations;
//   opt.store.dirs = {"/mnt/nvme0"};
//   tidal::torch_layer::Session session(opt);
//   session.register_persistent(model->parameters(), trace::TensorClass::kParameter);
//   for (...) { session.begin_step(); ...forward, backward, step...; session.end_step(); }
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
#include "tidal/torch/activations.hpp"
#include "tidal/torch/executor.hpp"
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

struct SessionOptions {
  OffloadMode mode = OffloadMode::kNone;
  io::StoreOptions store;  ///< directories, capacity, backend (not opened in kNone)
  ActivationOptions activations;
  ExecutorOptions executor;
  /// Plan mode: steps run without offloading before profiling (lazy state gets created).
  int warmup_steps = 1;
  /// Plan mode: steps profiled before planning (op times are their medians).
  int profile_steps = 2;
  /// Plan mode: the memory the plan must stay under, in bytes. 0: a share of the peak measured
  /// while profiling (budget_fraction).
  std::uint64_t memory_budget = 0;
  double budget_fraction = 0.5;
  /// Plan mode: the hardware model for the planner (device memory is set from the budget).
  std::string hardware = "cpu-here";
  plan::HardwareOverrides hardware_overrides;
  /// Plan mode: a function returning the memory meter's peak since the last reset, and a reset;
  /// used to turn a fraction into bytes and to calibrate the planner against real allocations.
  std::function<std::uint64_t()> peak_bytes;
  std::function<void()> reset_peak;
  std::string model_name;  ///< labels for the trace
  std::int64_t batch = 0;
  std::int64_t seq = 0;
};

/// What the session did in the last step, and overall.
struct SessionStats {
  OffloadMode mode = OffloadMode::kNone;
  std::string state;                 ///< "off", "warmup", "profiling", "executing"
  std::uint64_t bytes_written = 0;   ///< last step
  std::uint64_t bytes_read = 0;      ///< last step
  double stall_seconds = 0;          ///< last step: time computation waited for reads
  std::uint64_t misses = 0;          ///< last step: reads not prefetched in time
  std::uint64_t write_failures = 0;  ///< last step
  std::uint64_t memory_budget = 0;   ///< plan mode, once known
  std::uint64_t profiled_peak = 0;   ///< plan mode: peak measured while profiling
  int replans = 0;                   ///< times the op sequence changed and the session re-profiled
  int tightenings = 0;  ///< plan mode: re-plans for a smaller capacity after a step over budget
  std::uint64_t executed_peak = 0;  ///< plan mode: meter peak of the steps run by the current plan
  std::string plan_summary;         ///< plan mode: one line from the planner
};

/// Owns the store, the offloader or the tracer + executor, and switches between them.
/// Call everything from the thread that runs the training loop. Not copyable.
class Session final : public StepObserver {
 public:
  /// Opens the store (not in kNone). Throws tidal::InvalidArgument for bad options.
  explicit Session(SessionOptions options);
  ~Session() override;
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  /// Tensors that live across steps (parameters, gradients, optimizer state, buffers). In plan
  /// mode they are traced by storage and may be offloaded themselves; in activation mode they
  /// are never written as activations. Register gradients once they exist (after a step).
  void register_persistent(const std::vector<torch::Tensor>& tensors, trace::TensorClass cls,
                           const std::string& name_prefix = "");
  void register_persistent(const torch::Tensor& tensor, const std::string& name,
                           trace::TensorClass cls);

  void begin_step(std::int64_t step, const std::vector<torch::Tensor>& inputs) override;
  void begin_phase(trace::Phase phase) override;
  void begin_layer(std::int64_t layer) override;
  void end_step(std::int64_t step) override;
  void begin_step() { begin_step(step_, {}); }
  void end_step() { end_step(step_); }

  [[nodiscard]] SessionStats stats() const;
  /// Plan mode: the trace and plan in use (nullopt before planning).
  [[nodiscard]] const std::optional<trace::Trace>& trace() const;
  [[nodiscard]] const std::optional<plan::Plan>& plan() const;
  [[nodiscard]] std::shared_ptr<io::TensorStore> store() const;

  struct Impl;  ///< opaque

 private:
  std::unique_ptr<Impl> impl_;
  std::int64_t step_ = 0;
};

}  // namespace tidal::torch_layer
