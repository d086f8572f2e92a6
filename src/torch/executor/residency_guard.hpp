// The residency guard's process-wide state (private to the executor's files).
//
// The guard is a dispatcher fallback (TORCH_LIBRARY_IMPL on a spare key): it runs before every op
// of a guarded thread, at any depth, with no pointer to an executor of its own. What it needs to
// know (the executor, whether any storage is away, what to track) lives in one object, owned by
// residency_guard.cpp. All members are safe to use from any thread.
#pragma once

#include <c10/core/StorageImpl.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace tidal::torch_layer {

class PlanExecutor;

struct ResidencyGuardState {
  /// The one executor the guard serves (PlanExecutor's constructor claims it, its destructor
  /// gives it back).
  std::atomic<PlanExecutor*> executor{nullptr};
  /// Storages not plainly resident (being written, offloaded, being read), over all executors:
  /// the guard's fast path is one load.
  std::atomic<int> unsettled{0};
  /// While an executor may be asked to reclaim memory (the strict meter) or runs without a plan,
  /// the guard records the storages of every op running now, at any depth and on any thread:
  /// those are never written out from under it.
  std::atomic<bool> track_inputs{false};
  /// The wall as a GPU raises it (PlanExecutor::retry_out_of_memory): an op refused memory is run
  /// again after the executor has written tensors out.
  std::atomic<bool> retry_oom{false};
  /// Ops retried so, over the process.
  std::atomic<std::uint64_t> oom_retries{0};
  /// While the executor has no plan: the guard also notes what each op reads and makes (LRU
  /// order).
  std::atomic<bool> note_lru{false};
  /// The storages of the ops running now, with how many ops read each (track_inputs).
  std::mutex in_use_mu;
  std::unordered_map<const c10::StorageImpl*, int> in_use;

  /// True while an op running now (on any thread) reads `p`.
  bool in_use_now(const c10::StorageImpl* p) {
    std::lock_guard<std::mutex> lock(in_use_mu);
    return in_use.count(p) != 0;
  }
};

/// The guard's state (defined in residency_guard.cpp).
extern ResidencyGuardState g_guard;

/// Why a reclaim freed nothing, when nothing else says.
inline constexpr const char* kNothingLeftToMove =
    "every tensor left in memory is read by the running op, held, or under min_bytes";

}  // namespace tidal::torch_layer
