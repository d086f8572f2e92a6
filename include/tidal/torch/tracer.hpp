// The tracer: records the ATen ops of training iterations and the tensors they read and write,
// into tidal::trace::Trace (the torch-free model that the lifetime analysis and the planner use).
//
// It observes ops through thread-local at::RecordFunction callbacks (scope FUNCTION, with inputs
// and outputs, plus one on autograd nodes, scope BACKWARD_FUNCTION, to label backward ops with
// their phase and layer), installed on the thread that calls start(): only that thread's ops,
// and those of autograd's workers for backward passes it starts (autograd copies the thread-local
// state to them), enter a trace. Data loader workers and other threads never do. Only top-level ops
// are recorded: an op called from inside another op is part of the outer one. Tensors are
// identified by their storage: persistent ones (parameters, gradients, optimizer state) are
// registered by the trainer; per-iteration ones are named by (creating op, output slot). A storage
// created by an op nested in a recorded op and still alive when that op returns (e.g. the
// statistics layer_norm saves for backward) counts as an extra output of the recorded op. Frees are
// seen through weak references to the storages: a per-iteration tensor is "freed after" the last op
// that started before its storage went away.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tidal/torch/executor_options.hpp"
#include "tidal/torch/step.hpp"
#include "tidal/trace/trace.hpp"

namespace tidal::torch_layer {

/// Several profiled iterations folded into one trace.
struct ProfileResult {
  trace::Trace trace;           ///< the last iteration, with per-op median durations
  std::int64_t iterations = 0;  ///< iterations recorded
  bool consistent = true;       ///< every iteration ran the same op sequence
  std::string divergence;       ///< the first difference when !consistent, else empty
};

/// Folds iterations that ran the same ops into one trace: the last, with each op's duration and
/// the host time before the next op (Trace::op_seconds) the medians over them. Throws
/// tidal::Error when `iterations` is empty.
ProfileResult fold_iterations(const std::vector<trace::Trace>& iterations);

/// Records iterations as traces. Drive it as a StepObserver (Trainer::add_observer) or call the
/// same methods by hand around a hand-written step.
///
/// Threads: begin_step/begin_phase/begin_layer/end_step and the registration calls come from the
/// thread that runs the step; ops may arrive from any thread (autograd workers) and are
/// serialised by an internal mutex. At most one Tracer records at a time in a process (start()
/// throws otherwise). Not copyable or movable; stop() (or the destructor) removes the callbacks.
class Tracer : public StepObserver {
 public:
  /// Labels for the traces: model name, batch and sequence length.
  struct Options {
    std::string model;
    std::int64_t batch = 0;
    std::int64_t seq = 0;
    /// Append a zero-length op named kStepEndOp to every iteration whose inputs are all traced
    /// tensors still alive at end_step: the planner then keeps them resident between steps,
    /// and the listener's step_end() makes them so.
    bool step_end_op = false;
    /// The memory meter (all three, or none). With it, while iterations are kept (profiling),
    /// each op's workspace (trace::Op::workspace_bytes) is measured: the meter's peak during
    /// the op beyond the trace's live tensors at it (temporaries, memory no op touches, padding),
    /// so that the trace's memory at every op is the meter's. The tracer then resets the
    /// meter's peak before every op: read the step's peak from step_peak().
    std::function<std::uint64_t()> current_bytes;
    std::function<std::uint64_t()> peak_bytes;
    std::function<void()> reset_peak;
    /// Seconds ops have waited for offloading I/O so far (a session whose budget is a wall
    /// from step 0 moves tensors while it profiles): left out of the op times recorded.
    std::function<double()> io_wait_seconds;
    /// The device the step computes on: the trace holds tensors of its type only (not a CPU
    /// tensor of a GPU step, nor host memory: torch_layer::HostMemoryScope). On a GPU an op
    /// returns once its kernels are queued: while iterations are kept (profiling), the tracer
    /// waits for the device's current stream before and after every op, so that an op's time
    /// is its device time (profiling steps run slower; executed steps are not touched).
    c10::Device device = c10::Device(c10::kCPU);
  };

  explicit Tracer(Options options);
  ~Tracer() override;
  Tracer(const Tracer&) = delete;
  Tracer& operator=(const Tracer&) = delete;

  /// Registers a tensor that lives across iterations, identified by its storage. Registering
  /// the same storage twice keeps the first name. Takes a weak reference only.
  void register_persistent(const torch::Tensor& tensor, const std::string& name,
                           trace::TensorClass cls);

  /// Installs the callbacks on the calling thread; its ops are recorded between begin_step and
  /// end_step from now on. Throws tidal::Error when another Tracer is recording.
  void start();
  /// Removes the callbacks (call it on the thread that called start(); elsewhere the callbacks
  /// stay installed there but record nothing). Idempotent.
  void stop();
  [[nodiscard]] bool started() const;

  void begin_step(std::int64_t step, const std::vector<torch::Tensor>& inputs) override;
  void begin_phase(trace::Phase phase) override;
  void begin_layer(std::int64_t layer) override;
  void end_step(std::int64_t step) override;
  /// Ends a step that raised part-way: what it recorded is dropped (it is no iteration of the
  /// loop), and the next step is traced as if it followed the last whole one.
  void abort_step();

  /// Reports every recorded op, with the trace's tensor ids and their storages, to `listener`
  /// (the plan executor), or to nobody when nullptr. Not owned. Set it between steps.
  void set_listener(OpListener* listener);
  /// Options::io_wait_seconds, from now on (a plan's executor, once it runs): the op times of the
  /// steps recorded after it leave out what ops waited for transfers. Call between steps.
  void set_io_wait_clock(std::function<double()> clock);

  /// Keep each recorded iteration (the default, for profiling) or only check it against the
  /// first and drop it (while executing a plan for many steps).
  void set_keep_iterations(bool keep);
  /// Changes Options::step_end_op for the iterations that start from now on (between steps).
  void set_step_end_op(bool on);

  /// The traced tensors still alive after the last end_step, by trace id (weak references):
  /// what a plan executor made after profiling needs to know before its first step's ops have
  /// shown it each tensor (to write out any of them to keep a budget).
  [[nodiscard]] BoundTensors alive_tensors();

  /// The meter's peak from begin_step to end_step (or to now), with the peaks the tracer reset
  /// while measuring workspaces folded in; 0 without a meter.
  [[nodiscard]] std::uint64_t step_peak() const;

  /// The iterations recorded so far, in order (each one validated).
  [[nodiscard]] const std::vector<trace::Trace>& iterations() const;

  /// The iteration that ended last, kept or not (nullptr before the first). Valid until the
  /// next end_step.
  [[nodiscard]] const trace::Trace* last_iteration() const;

  /// Folds the recorded iterations: the last one, with each op's duration replaced by its median
  /// over the iterations when they are consistent. Throws tidal::Error if none was recorded.
  [[nodiscard]] ProfileResult result() const;

  class Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace tidal::torch_layer
