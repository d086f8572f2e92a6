// The plan executor (TERAIO's path): moves tensors of any class (activations, parameters,
// gradients, optimizer states) between memory and the SSD store at the op indices of a Plan, by
// swapping their storages' DataPtrs. A wrong plan costs time, never correctness: before every op
// its inputs are made resident (a "miss"), and a tensor touched while its write is in flight
// keeps its memory.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tidal/io/store.hpp"
#include "tidal/plan/plan.hpp"
#include "tidal/torch/step.hpp"
#include "tidal/trace/trace.hpp"

namespace tidal::torch_layer {

/// A tensor of the trace as seen at run time.
struct TensorRef {
  trace::TensorId id = 0;
  c10::StorageImpl* storage = nullptr;
};

/// Receives the top-level ops of a step as the tracer numbers them (Tracer::set_listener).
/// Calls come from the thread running the op, between begin_step and end_step.
class OpListener {
 public:
  virtual ~OpListener() = default;
  /// Op `index` named `name` is about to run and reads `inputs`.
  virtual void before_op(trace::OpIndex index, const std::string& name,
                         const std::vector<TensorRef>& inputs) = 0;
  /// Op `index` returned; `outputs` are the tensors it created or wrote.
  virtual void after_op(trace::OpIndex index, const std::vector<TensorRef>& outputs) = 0;
};

struct ExecutorStats {
  std::uint64_t offloads = 0;        ///< writes started by the plan
  std::uint64_t released = 0;        ///< storages whose memory was released after their write
  std::uint64_t prefetches = 0;      ///< reads started by the plan
  std::uint64_t misses = 0;          ///< reads started because an op needed a tensor at once
  std::uint64_t cancelled = 0;       ///< offloads dropped because an op touched the tensor
  std::uint64_t write_failures = 0;  ///< writes that failed: the tensor stayed in memory
  std::uint64_t unbound = 0;         ///< actions on a tensor not seen at run time (skipped)
  std::uint64_t bytes_written = 0;
  std::uint64_t bytes_read = 0;
  double stall_seconds = 0;  ///< time ops waited for reads (misses and late prefetches)
  bool diverged = false;     ///< the op sequence left the profiled one: on-demand from there
  std::string divergence;    ///< where and how
};

struct ExecutorOptions {
  std::uint64_t min_bytes = 64 * 1024;  ///< storages smaller than this are never moved
};

/// Executes one plan for one profiled trace. Thread-safe (one internal mutex); the safety net
/// is a global RecordFunction callback installed for the executor's lifetime. Destroying it
/// brings every tensor it moved back into memory.
class PlanExecutor final : public OpListener, public StepObserver {
 public:
  PlanExecutor(std::shared_ptr<io::TensorStore> store, const trace::Trace& trace,
               const plan::Plan& plan, ExecutorOptions options = {});
  ~PlanExecutor() override;
  PlanExecutor(const PlanExecutor&) = delete;
  PlanExecutor& operator=(const PlanExecutor&) = delete;

  void before_op(trace::OpIndex index, const std::string& name,
                 const std::vector<TensorRef>& inputs) override;
  void after_op(trace::OpIndex index, const std::vector<TensorRef>& outputs) override;

  void begin_step(std::int64_t step, const std::vector<torch::Tensor>& inputs) override;
  void end_step(std::int64_t step) override;

  /// Makes every moved tensor resident again (also done by the destructor).
  void restore_all();

  [[nodiscard]] ExecutorStats last_step() const;

  /// Internal: the safety net's entry point for any op's input tensor.
  void ensure_resident(c10::StorageImpl* storage);

  struct Impl;  ///< opaque

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace tidal::torch_layer
