// The plan executor, private to the torch layer (the Session makes and drives it; tests include
// it from src/). What it takes and reports is public: tidal/torch/executor_options.hpp.
#pragma once

#include <memory>

#include "tidal/torch/executor_options.hpp"

namespace tidal::torch_layer {

/// Executes plans for profiled traces: one per step shape (add_shape). A step starts with the
/// shape the last step ended with; when its ops leave that shape, the executor moves to another
/// known shape with the same ops so far, or goes on-demand for the rest of the step.
///
/// Threads: construct, begin_step, end_step and destroy on the thread that runs the training
/// step (begin_step switches on the residency guard in that thread's dispatch state); ops may
/// come from autograd's threads. Internal state is behind one mutex. At most one executor per
/// process (the constructor throws otherwise). Destroying it brings every tensor it moved back
/// into memory.
class PlanExecutor final : public OpListener, public StepObserver {
 public:
  /// Throws tidal::InvalidArgument when `plan` was not made for `trace`.
  PlanExecutor(std::shared_ptr<io::TensorStore> store, const trace::Trace& trace,
               const plan::Plan& plan, ExecutorOptions options = {});
  /// Without a plan yet (the warm-up and profiled steps of a session whose budget is a wall
  /// from step 0): every op is served on demand, and memory is made under the budget by writing
  /// out the storages ops read least recently (fit_budget, reclaim, a read that needs room).
  /// The first add_shape() gives it a plan.
  PlanExecutor(std::shared_ptr<io::TensorStore> store, ExecutorOptions options);
  ~PlanExecutor() override;
  PlanExecutor(const PlanExecutor&) = delete;
  PlanExecutor& operator=(const PlanExecutor&) = delete;

  /// Another step shape and its plan; returns its index. Call between steps.
  int add_shape(const trace::Trace& trace, const plan::Plan& plan);
  /// Replaces the plan of shape `index` (a tighter one, or one for another trace of the step:
  /// then the tensors bound to its ids are forgotten). Call between steps.
  void replace_plan(int index, const trace::Trace& trace, const plan::Plan& plan);
  /// Lowers (or raises) ExecutorOptions::min_bytes: the session does so when no plan meets the
  /// budget with the smaller tensors kept in memory. Between steps.
  void set_min_bytes(std::uint64_t bytes);

  /// Tells the executor which storages hold tensors of the trace before a step has shown them
  /// (Tracer::alive_tensors() after the last profiled step). Call between steps.
  void bind_alive(const BoundTensors& tensors);

  void before_op(trace::OpIndex index, const std::string& name,
                 const std::vector<TensorRef>& inputs) override;
  void after_op(trace::OpIndex index, const std::vector<TensorRef>& outputs) override;
  /// Makes `alive` resident (waiting for reads); throws tidal::IoError when one cannot be read.
  void step_end(trace::OpIndex index, const std::vector<TensorRef>& alive) override;

  void begin_step(std::int64_t step, const std::vector<torch::Tensor>& inputs) override;
  /// Retires finished I/O. Throws the first tidal::IoError that stopped an op of the step.
  void end_step(std::int64_t step) override;
  /// Ends a step that raised part-way: its ops served, nothing of it counts as a step of a
  /// known shape (last_step().shape is -1), and the next step is expected to start the shape
  /// the last whole step ran. Tensors stay where they are (abort_step of the session brings
  /// them back where the step boundary is resident).
  void abort_step();

  /// Before a step: when the tensors held now already exceed the budget (the first step after
  /// profiling, which ran without a plan), writes out those used latest until they fit.
  void fit_budget();

  /// The strict meter's reclaimer (set_cpu_memory_reclaimer): writes out resident tensors that
  /// the running op does not read, the one used again latest first, until `bytes` are freed or
  /// none is left; returns the bytes freed. Runs inside an allocation; any thread.
  std::uint64_t reclaim(std::uint64_t bytes);

  /// True until the first add_shape() of an executor made without a plan.
  [[nodiscard]] bool planless() const;
  /// The residency guard's note of the storages an op reads (without a plan: for least
  /// recently used order). recent = false adds storages not yet known as the least recent
  /// (the model's state, before any op has read it). Any thread.
  void note_inputs(c10::ArrayRef<c10::StorageImpl*> storages, bool recent = true);
  /// Seconds ops have waited for this executor's I/O (reads they needed, writes that had to
  /// finish to make room), over all steps: the tracer takes them out of the op times it
  /// records, so that a profile made under the wall times the ops, not the waits.
  [[nodiscard]] double io_wait_seconds() const;
  /// Makes the residency guard record the storages of every running op (at any depth, on any
  /// thread) so that no eviction or reclaim writes one out from under it. On while an executor
  /// without a plan exists; the session turns it on with the strict meter.
  static void track_inputs(bool on);
  /// The wall as a GPU raises it (set_device_memory_wall): the residency guard catches an op's
  /// c10::OutOfMemoryError, has the executor write out tensors the op does not read
  /// (make_room_after_refusal) and runs the op again, up to 16 times, before the error goes to
  /// the caller with the reason. Needs track_inputs. The session turns it on with the strict
  /// meter on a GPU.
  static void retry_out_of_memory(bool on);
  /// Ops the guard ran again after a refusal, over the process.
  [[nodiscard]] static std::uint64_t out_of_memory_retries();
  /// After a refused allocation of `refused` bytes (0: unknown) on try `attempt` (from 0):
  /// writes out enough that it would fit under the budget, and at least the request times
  /// 2^attempt; returns the bytes freed (0: nothing more can move).
  std::uint64_t make_room_after_refusal(std::uint64_t refused, int attempt);
  /// Why the last reclaim freed less than asked.
  [[nodiscard]] std::string last_reclaim_shortfall() const;
  /// The meter's bytes now, and the hard budget (0: none).
  [[nodiscard]] std::uint64_t memory_in_use() const;
  [[nodiscard]] std::uint64_t budget() const;

  /// Changes the hard budget (0: none). Call between steps.
  void set_budget(std::uint64_t bytes);

  /// Makes every moved tensor resident again (also done by the destructor). Throws
  /// tidal::IoError when a tensor cannot be read back.
  void restore_all();

  [[nodiscard]] ExecutorStats last_step() const;

  /// The residency guard's entry point, with the storages one op reads: makes room under the
  /// budget for the reads they need (never by writing out one of them), then makes each
  /// resident, or throws tidal::IoError when its bytes cannot be read back. Any thread.
  void ensure_resident(c10::ArrayRef<c10::StorageImpl*> storages);

  /// Holds `storage` in memory until as many release() calls or the step's end: it is made
  /// resident now (read back, or its write in flight cancelled), and no planned offload or
  /// eviction touches it meanwhile. For a tensor another thread may still write without ops the
  /// executor sees (a gradient bucket under a pending all-reduce). Any thread; throws
  /// tidal::IoError when the tensor cannot be read back.
  void hold(c10::StorageImpl* storage);
  void release(const c10::StorageImpl* storage);

  struct Impl;  ///< opaque

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace tidal::torch_layer
