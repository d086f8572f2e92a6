// What the plan executor takes and reports, and the seam the tracer reports ops through
// (OpListener). The executor itself is private to the torch layer: the Session runs it
// (src/torch/executor/executor.hpp).
//
// The plan executor (TERAIO's path): moves tensors of any class (activations, parameters,
// gradients, optimizer states) between memory and the SSD store at the op indices of a Plan, by
// swapping their storages' DataPtrs. A wrong plan costs time, never correctness: before every op
// its inputs are made resident (a "miss"), and a tensor touched while its write is in flight
// keeps its memory.
//
// The residency guard. RecordFunction callbacks cannot stop an op (PyTorch logs what they throw
// and runs the op anyway), so the check that an op's inputs are in memory runs in a boxed
// dispatcher fallback on the dispatch key TESTING_ONLY_GenericMode, the one mode key that
// libtorch 1.13 and 2.x both leave free for code outside PyTorch. The key is switched on in the
// thread-local dispatch state of the thread that runs the step (autograd copies that state to
// its worker threads), so the guard sees every op of the step, at any depth, and an I/O error
// or a corrupt read propagates as a tidal::IoError out of the op that needed the tensor. Other
// threads (data loader workers, logging) never pass through it.
#pragma once

#include <torch/torch.h>

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tidal/io/host_pool.hpp"
#include "tidal/io/store.hpp"
#include "tidal/plan/plan.hpp"
#include "tidal/plan/schedule.hpp"
#include "tidal/plan/timeline.hpp"
#include "tidal/torch/step.hpp"
#include "tidal/trace/trace.hpp"

namespace tidal::torch_layer {

/// A tensor of the trace as seen at run time.
struct TensorRef {
  trace::TensorId id = 0;
  c10::StorageImpl* storage = nullptr;
};

/// Tensors of a trace by id, with weak references to the storages holding them now.
using BoundTensors =
    std::vector<std::pair<trace::TensorId, c10::weak_intrusive_ptr<c10::StorageImpl>>>;

/// Receives the top-level ops of a step as the tracer numbers them (Tracer::set_listener).
/// before_op/after_op come from inside RecordFunction callbacks, where an exception cannot stop
/// the op: they must not throw. step_end comes from Tracer::end_step and may throw.
class OpListener {
 public:
  virtual ~OpListener() = default;
  /// Op `index` named `name` is about to run and reads `inputs`.
  virtual void before_op(trace::OpIndex index, const std::string& name,
                         const std::vector<TensorRef>& inputs) = 0;
  /// Op `index` returned; `outputs` are the tensors it created or wrote.
  virtual void after_op(trace::OpIndex index, const std::vector<TensorRef>& outputs) = 0;
  /// The step's last op (kStepEndOp), which "uses" every traced tensor still alive: they are
  /// the caller's again once end_step returns.
  virtual void step_end(trace::OpIndex index, const std::vector<TensorRef>& alive) {}
};

/// Name of the zero-length op the tracer appends to every step when tensors must be resident
/// between steps (Tracer::Options::step_end_op): its inputs are every tensor alive at the end.
inline constexpr const char* kStepEndOp = "tidal::step_end";

/// True for the op a torch.compile'd region shows the tracer ("Torch-Compiled Region: 0/0", or
/// AOTAutograd's "CompiledFunction"): its generated kernels bypass ATen's dispatcher.
inline bool is_compiled_region(const std::string& op_name) {
  return op_name.rfind("Torch-Compiled Region", 0) == 0 || op_name == "CompiledFunction";
}

struct ExecutorStats {
  std::uint64_t offloads = 0;        ///< writes started by the plan
  std::uint64_t released = 0;        ///< storages whose memory was released after their write
  std::uint64_t prefetches = 0;      ///< reads started by the plan
  std::uint64_t misses = 0;          ///< reads started because an op needed a tensor at once
  std::uint64_t cancelled = 0;       ///< offloads dropped because an op touched the tensor
  std::uint64_t write_failures = 0;  ///< writes that failed: the tensor stayed in memory
  std::uint64_t store_full = 0;      ///< of write_failures: no space (store or disk full, ENOSPC)
  std::string write_error;           ///< the store's message for the last failed write, or empty
  std::uint64_t unbound = 0;         ///< actions on a tensor not seen at run time (skipped)
  std::uint64_t bytes_written = 0;   ///< to the SSD store
  std::uint64_t bytes_read = 0;      ///< from the SSD store
  std::uint64_t host_offloads = 0;   ///< offloads that went to the host pool
  std::uint64_t host_fallbacks = 0;  ///< host offloads the pool had no room for: to SSD instead
  std::uint64_t bytes_to_host = 0;
  std::uint64_t bytes_from_host = 0;
  /// Stages (plan::ActionKind::kStage): SSD copies read into the host pool, so that their
  /// prefetch reads the pool; those the pool had no room for, or whose read failed (the tensor
  /// stays on the SSD and is read from there), and the bytes staged.
  std::uint64_t stages = 0;
  std::uint64_t stage_skips = 0;
  std::uint64_t stage_failures = 0;
  std::uint64_t bytes_staged = 0;
  double stall_seconds = 0;          ///< time ops waited for reads (misses and late prefetches)
  double host_stall_seconds = 0;     ///< the part of stall_seconds spent on host pool reads
  double write_stall_seconds = 0;    ///< time ops waited for writes to free memory (the budget)
  std::uint64_t budget_waits = 0;    ///< ops that waited for writes so as not to cross the budget
  std::uint64_t deadline_waits = 0;  ///< ops that waited for a write due before them (the plan)
  std::uint64_t forwarded = 0;       ///< prefetches of a tensor whose write was in flight: kept
  /// What the step's schedule moves, per channel (plan::index_of; 0 when the step left its
  /// shape), and the transfers the step started, per channel, counted as they start (as the
  /// simulator counts them; bytes_written and bytes_to_host count writes as they complete, so a
  /// write started near a step's end counts there in the next step).
  std::array<std::uint64_t, plan::kNumChannels> planned_bytes{};
  std::array<std::uint64_t, plan::kNumChannels> issued_bytes{};
  std::uint64_t delayed_prefetches = 0;  ///< prefetches held back until memory allowed them
  /// of those, the ones whose memory the wall refused (retry_out_of_memory), held again
  std::uint64_t refused_prefetches = 0;
  /// Tensors written out at once, outside the plan, because an op would have crossed the
  /// budget with no write left to wait for (the one used again latest first).
  std::uint64_t evictions = 0;
  std::uint64_t evicted_bytes = 0;
  /// The most an op would have taken the meter over the budget without evictions.
  std::uint64_t eviction_overshoot = 0;
  /// Of evicted_bytes, those written out for the strict meter (reclaim), inside an allocation
  /// that the trace did not foresee.
  std::uint64_t reclaimed_bytes = 0;
  int shape = -1;                ///< the step shape (add_shape order) the step ran to its end
  int shape_switches = 0;        ///< times the step left one known shape for another
  bool diverged = false;         ///< the op sequence matched no known shape: on-demand from there
  std::string divergence;        ///< where and how
  std::vector<std::string> ops;  ///< the op names the step ran (for the session's shape cache)
};

struct ExecutorOptions {
  std::uint64_t min_bytes = 64 * 1024;  ///< storages smaller than this are never moved
  /// A hard memory budget in the meter's bytes (0: none). Before an op whose new tensors and
  /// workspace would take the meter over it, the executor waits for the writes in flight
  /// (their memory goes back when they complete), and when none is left writes out tensors the
  /// op does not use (evictions), instead of going over; it holds back prefetches until memory
  /// allows them (in deadline order; an op that needs one reads it at once).
  std::uint64_t budget = 0;
  /// The meter's bytes now; needed with a budget.
  std::function<std::uint64_t()> current_bytes;
  /// The host memory tier: actions whose target is host go there while it has room (the SSD
  /// store otherwise). Null: every action goes to the SSD store.
  std::shared_ptr<io::HostPool> host;
  /// Before each op, wait for the writes the plan wants done by then (their deadlines), as the
  /// simulator does: a tensor is gone when the plan counts it gone, on any disk; the wait is a
  /// write stall. Off: writes are waited for only when the budget needs their memory.
  bool wait_for_deadlines = true;
  /// Called before each op of a step that follows its profile, with where each tensor of the
  /// trace is (by id), in the simulator's terms (SimOptions::record_residency): for tests and
  /// for comparing the two engines. Runs under the executor's lock; must not call into it.
  std::function<void(trace::OpIndex, const std::vector<plan::Residency>&)> on_op_start;
  /// Records what ran (ops, transfers, stalls, memory) when set; the owner opens and closes its
  /// steps (Timeline::begin_step / end_step) around the executor's.
  std::shared_ptr<plan::Timeline> timeline;
};

/// Switches the residency guard on or off in the calling thread's dispatch state (autograd's
/// threads inherit it from the thread that calls backward). The executor does this itself in
/// begin_step; exposed for tests and for code that runs ops on tidal's tensors between steps.
void set_residency_guard(bool on);

/// Whether the executor may move a storage's bytes out and give it new ones later: it has
/// bytes, and they came from its allocator (the DataPtr's deleter is the allocator's). Not
/// movable: memory of someone else (torch.from_numpy, from_blob), and storages whose DataPtr
/// was replaced (the legacy record_function handle keeps a C++ object there, checked by its
/// deleter when the handle is used: moved, it failed "Expected temporary cpp type wrapper").
bool movable_storage(const c10::StorageImpl& storage);

}  // namespace tidal::torch_layer
