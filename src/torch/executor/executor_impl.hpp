// PlanExecutor's state and the steps of a tensor's life under it (private to the executor's
// files): the per-storage residency (slots), the plan's migrations by op, eviction under the
// budget, and the timeline's records of each transfer.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"
#include "tidal/torch/memory.hpp"
#include "torch/device_sync.hpp"
#include "torch/executor/executor.hpp"
#include "torch/executor/residency_guard.hpp"
#include "torch/ivalue_tensors.hpp"
#include "torch/timeline_glue.hpp"

namespace tidal::torch_layer {
using timeline_glue::Clock;
using timeline_glue::since;

struct PlanExecutor::Impl {
  enum class State { kResident, kWriting, kOffloaded, kReading };
  std::string shortfall;  // why the last reclaim freed less than asked, or empty
  struct Slot {
    c10::weak_intrusive_ptr<c10::StorageImpl> weak{c10::intrusive_ptr<c10::StorageImpl>()};
    State state = State::kResident;
    io::Ticket ticket;
    io::Tier* tier = nullptr;  // where its bytes are: the SSD store or the host pool
    std::uint64_t nbytes = 0;
    c10::Device device{c10::kCPU};
    c10::DataPtr incoming;     // memory a read is filling
    bool cancel = false;       // touched (or prefetched) while its write was in flight: keep it
    std::int64_t due = 0;      // a write: the op it must be done before, counted over all steps
    std::exception_ptr error;  // a read that failed; thrown to the next op that needs it
    std::int32_t tensor = -1;  // its id in the trace, when known (for the timeline)
    std::size_t recorded = kNotRecorded;  // the timeline's handle of its transfer in flight
    // A stage in flight: the host pool's ticket the store is reading the tensor into (the slot
    // stays offloaded on the store until it lands; plan::ActionKind::kStage).
    io::Ticket staged;
  };
  static constexpr std::size_t kNotRecorded = timeline_glue::kNotRecorded;
  // One step shape: the ops of a profiled step and its plan's schedule (the one the simulator
  // replays): migrations by issuing op, memory each op allocates, uses of each tensor.
  struct Shape {
    std::vector<std::string> op_names;
    std::vector<std::string> tensor_names;  // by id: the timeline's labels
    plan::Schedule sched;
  };
  // A prefetch held back by the budget, issued when memory allows or when an op needs it.
  struct HeldPrefetch {
    std::int64_t due;  // counted over all steps, as Slot::due
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  };
  std::vector<HeldPrefetch> held;  // sorted by due: the most urgent first
  // Ops of the steps before this one: Migration::due is counted from its step's start, and a
  // write issued at one step's end is due in the next.
  std::int64_t step_base = 0;

  std::shared_ptr<io::TensorStore> store;
  ExecutorOptions opt;

  bool on_host(const Slot& s) const { return opt.host && s.tier == opt.host.get(); }
  std::vector<Shape> shapes;
  int current = 0;                        // shape of the step running
  int last_completed = 0;                 // shape the last step ended with
  std::size_t ops_run = 0;                // ops of this step so far
  std::vector<plan::Migration> deferred;  // migrations issued by the step-end op: next step
  std::int64_t deferred_base = 0;         // step_base of the step that issued them
  std::recursive_mutex mu;  // recursive: restore paths call make_resident under the lock
  std::unordered_map<c10::StorageImpl*, Slot> slots;
  std::unordered_map<const c10::StorageImpl*, int> holds;  // hold() counts
  bool is_held(const c10::StorageImpl* p) const { return holds.count(p) != 0; }
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> bound;  // by tensor id
  ExecutorStats stats;
  ExecutorStats last;
  bool diverged = false;
  std::thread::id guard_thread;
  // The inputs of the op running now (before_op to after_op): never reclaimed from under it.
  std::vector<const c10::StorageImpl*> running_inputs;
  // Without a plan (before the first one): storages ops have read, with when they were last
  // read (a count of notes), for writing out the least recently used first.
  struct Seen {
    c10::weak_intrusive_ptr<c10::StorageImpl> weak{c10::intrusive_ptr<c10::StorageImpl>()};
    std::uint64_t last = 0;
  };
  std::unordered_map<const c10::StorageImpl*, Seen> seen;
  std::uint64_t notes = 0;
  double waited_before = 0;  // I/O waits of the steps before this one (stall + write stall)
  // Of all the waits, those of reclaims on threads other than the loop's (a logging thread's
  // allocation under the strict meter): they are no time the loop's ops waited.
  double waited_elsewhere = 0;
  double waits() const { return waited_before + stats.stall_seconds + stats.write_stall_seconds; }
  bool planless() const { return shapes.empty(); }

  // Any plan for this trace runs (a wrong one costs time, never correctness): compiled leniently.
  static Shape make_shape(const trace::Trace& trace, const plan::Plan& plan);
  const Shape& shape() const { return shapes[static_cast<std::size_t>(current)]; }

  // ---- the timeline (ExecutorOptions::timeline), when one is set ----
  plan::Timeline* tl() const { return opt.timeline.get(); }
  // A tensor's label: its trace name where the slot knows its id, else its size.
  std::string label(const Slot& s) const;
  // The trace id bound to `p` now, or -1 (a scan: only with a timeline).
  std::int32_t id_of(const c10::StorageImpl* p) const;
  void record_start(Slot& s, plan::Direction dir, plan::TransferKind kind, std::int64_t due);
  void record_end(Slot& s, bool failed);
  void record_stall(plan::StallKind kind, plan::Channel channel, std::string tensor,
                    Clock::time_point t0);

  // Where tensor `id` of the current shape is now (for ExecutorOptions::on_op_start).
  plan::Residency residency_of(std::size_t id) const;

  void grow_bound(std::size_t n);

  // True when shapes a and b run the same first n ops.
  static bool same_start(const Shape& a, const Shape& b, std::size_t n) {
    return a.op_names.size() >= n && b.op_names.size() >= n &&
           std::equal(a.op_names.begin(), a.op_names.begin() + static_cast<std::ptrdiff_t>(n),
                      b.op_names.begin());
  }

  // Op `index` named `name` is next: follow it in the current shape, or move to another known
  // shape with the same ops so far, or go on-demand for the rest of the step. Until the step
  // diverges, the ops it ran are the current shape's first ones: no copy of their names is kept.
  void advance(trace::OpIndex index, const std::string& name);

  // The step left every known shape: on demand from here, saying where and how.
  void diverge(std::string why);

  void bind(const std::vector<TensorRef>& refs);

  void settle(Slot& s, State next);

  // Slots whose storage died give their store space back; finished I/O is retired. Never
  // throws: a failed read is kept in its slot for the op that needs the tensor.
  void poll();

  // Gives back a slot's space in its tier, and a stage's in the host pool after its read.
  void release_io(Slot& s);

  // A stage: the store reads an offloaded tensor into the host pool, so that its prefetch reads
  // the pool (the SSDs read early, the faster host link late). Skipped where the pool has no
  // room; the prefetch then reads the store.
  void start_stage(Slot& s, std::int64_t due);

  // Ends a stage whose read is done (or, with `wait`, waits for it): the tensor is in the host
  // pool and its store space goes back. A failed read keeps the store's copy, which the
  // prefetch then reads (and reports, if it fails again).
  void finish_stage(Slot& s, bool wait);

  void finish_write(c10::StorageImpl& impl, Slot& s);

  // `kind` and `due` (the op it is needed by, counted over all steps as Slot::due; -1: none)
  // label it in the timeline.
  void start_read(c10::StorageImpl& impl, Slot& s, io::Priority p, plan::TransferKind kind,
                  std::int64_t due);

  // A planned read ahead of its op. Its memory may be refused where the wall is the device's
  // own (PlanExecutor::retry_out_of_memory: the CUDA allocator's fraction, or the CPU cap
  // refusing at once): this runs in a RecordFunction callback, which must not throw, and the
  // trigger's other actions (the writes that make room) must still run. Then the tensor stays
  // offloaded and false is returned; the caller holds it, and the guard reads it when an op
  // needs it.
  bool start_prefetch(c10::StorageImpl& impl, Slot& s, std::int64_t due);

  // Counts a transfer as it starts, on its channel (the simulator counts them so too).
  void issued(const Slot& s, plan::Direction dir);

  // Waits for the slot's read. On failure the memory it was filling goes back, the tensor stays
  // offloaded (a later access reads it again) and the store's error propagates. `needed`: an op
  // waits for it (a stall in the timeline), not a poll of a read that is done.
  void finish_read(c10::StorageImpl& impl, Slot& s, bool needed);

  // Never leaves the storage without its bytes: either it is resident on return, or this throws.
  void make_resident(c10::StorageImpl* storage);

  // Memory the running or next op will allocate (its outputs and workspace): a prefetch must
  // leave room for it, or the op would cross the budget with nothing left to wait for.
  std::uint64_t reserve = 0;

  std::uint64_t meter_bytes() const { return opt.current_bytes ? opt.current_bytes() : 0; }
  bool over(std::uint64_t more) const {
    return opt.budget != 0 && opt.current_bytes && meter_bytes() + more > opt.budget;
  }

  // Waits for writes in flight, oldest first, until `more` bytes fit under the budget or none is
  // left: their memory goes back as each completes. A write stall, counted as such.
  void wait_for_room(std::uint64_t more);

  // The last resort of the budget: no write in flight is left to wait for, and op `index`
  // would still take memory over it (the plan was made for other timings or other tensors).
  // Tensors of the trace that the op does not use are written out at once, the one used
  // again latest first, until it fits or none is left. A write stall; a later op that needs
  // one reads it back (a miss).
  // `in_use(storage)`: true for the storages op `index` reads (never written out for it).
  template <typename InUseFn>
  void evict_for(std::uint64_t more, trace::OpIndex index, InUseFn in_use) {
    if (!over(more) || (diverged && !planless())) return;
    stats.eviction_overshoot =
        std::max(stats.eviction_overshoot, meter_bytes() + more - opt.budget);
    evict_while([&] { return over(more); }, index, in_use);
  }

  // A storage that may be written out now: big enough, with bytes, resident, not read by an op
  // running now, not held.
  template <typename InUseFn>
  bool evictable(const c10::intrusive_ptr<c10::StorageImpl>& live, InUseFn in_use) const {
    return live && live->nbytes() >= opt.min_bytes && evictable_at_any_size(live, in_use);
  }
  template <typename InUseFn>
  bool evictable_at_any_size(const c10::intrusive_ptr<c10::StorageImpl>& live,
                             InUseFn in_use) const {
    if (!live || !movable_storage(*live)) return false;
    auto it = slots.find(live.get());
    if (it != slots.end() && (it->second.state != State::kResident || it->second.error)) {
      return false;
    }
    if (in_use(live.get()) || is_held(live.get())) return false;
    return !g_guard.track_inputs.load(std::memory_order_acquire) || !g_guard.in_use_now(live.get());
  }

  // The storage ops read least recently (seen: without a plan, or since the step diverged).
  template <typename InUseFn>
  c10::intrusive_ptr<c10::StorageImpl> least_recent(InUseFn in_use) {
    c10::intrusive_ptr<c10::StorageImpl> victim;
    std::uint64_t oldest = std::numeric_limits<std::uint64_t>::max();
    for (auto it = seen.begin(); it != seen.end();) {
      auto live = it->second.weak.lock();
      if (!live) {
        it = seen.erase(it);
        continue;
      }
      if (it->second.last < oldest && evictable(live, in_use)) {
        oldest = it->second.last;
        victim = std::move(live);
      }
      ++it;
    }
    return victim;
  }

  // The next victim: with a plan, the bound tensor used again latest (after op `index`), and
  // in a step that left its plan then the storage ops read least recently since; without a
  // plan, the storage ops read least recently.
  template <typename InUseFn>
  c10::intrusive_ptr<c10::StorageImpl> pick_victim(trace::OpIndex index, InUseFn in_use) {
    if (planless()) return least_recent(in_use);
    c10::intrusive_ptr<c10::StorageImpl> victim = pick_planned_victim(index, in_use);
    if (!victim && diverged) victim = least_recent(in_use);
    return victim;
  }

  template <typename InUseFn>
  c10::intrusive_ptr<c10::StorageImpl> pick_planned_victim(trace::OpIndex index, InUseFn in_use) {
    c10::intrusive_ptr<c10::StorageImpl> victim;
    const plan::Schedule& sched = shape().sched;
    const auto n_ops = static_cast<std::int64_t>(sched.num_ops);
    std::int64_t best = -1;
    for (std::size_t id = 0; id < bound.size() && id < sched.uses_of.size(); ++id) {
      auto live = bound[id].lock();
      if (!evictable(live, in_use)) continue;
      // Distance to the next use in this step, or past its end (used next step, or never).
      const auto& u = sched.uses_of[id];
      auto next = std::upper_bound(u.begin(), u.end(), index);
      const std::int64_t distance = next != u.end() ? *next - index : n_ops + 1;
      if (distance > best) {
        best = distance;
        victim = std::move(live);
      }
    }
    return victim;
  }

  // The bytes that could be written out now but for min_bytes (the tensors the plan knows, or
  // without a plan those ops read): what a smaller min_bytes would let go.
  template <typename InUseFn>
  std::uint64_t bytes_under_min_bytes(InUseFn in_use) const {
    std::uint64_t sum = 0;
    const auto add = [&](const c10::intrusive_ptr<c10::StorageImpl>& live) {
      if (live && live->nbytes() < opt.min_bytes && evictable_at_any_size(live, in_use)) {
        sum += live->nbytes();
      }
    };
    if (planless() || diverged) {
      for (const auto& [p, s] : seen) add(s.weak.lock());
    }
    if (!planless()) {
      for (const auto& b : bound) add(b.lock());
    }
    return sum;
  }

  // Writes out resident tensors that `in_use` does not name (pick_victim's order) while
  // `needed()`; returns the bytes freed.
  template <typename Needed, typename InUseFn>
  std::uint64_t evict_while(Needed needed, trace::OpIndex index, InUseFn in_use) {
    const auto t0 = Clock::now();
    bool evicted = false;
    std::uint64_t freed = 0;
    while (needed()) {
      c10::intrusive_ptr<c10::StorageImpl> victim = pick_victim(index, in_use);
      if (!victim) break;
      Slot& s = slots[victim.get()];
      s.weak = c10::weak_intrusive_ptr<c10::StorageImpl>(victim);
      s.nbytes = victim->nbytes();
      s.device = victim->device();
      s.cancel = false;
      s.tier = store.get();
      s.due = 0;  // waited for at once
      if (tl() != nullptr) s.tensor = planless() ? -1 : id_of(victim.get());
      detail::sync_current_stream(s.device);
      s.ticket = store->write(victim->data(), s.nbytes, io::Priority::kUrgent);
      record_start(s, plan::Direction::kWrite, plan::TransferKind::kEviction, -1);
      issued(s, plan::Direction::kWrite);
      settle(s, State::kWriting);
      ++stats.offloads;
      ++stats.evictions;
      stats.evicted_bytes += s.nbytes;
      evicted = true;
      finish_write(*victim, s);  // waits; on failure it stays and the next candidate is tried
      if (s.state == State::kResident) {
        slots.erase(victim.get());
        break;  // a failing store: stop evicting for this op
      }
      freed += s.nbytes;
    }
    if (evicted) {
      ++stats.budget_waits;
      stats.write_stall_seconds += since(t0);
      record_stall(plan::StallKind::kBudget, plan::Channel::kSsdWrite, "evictions", t0);
    }
    return freed;
  }

  // Waits for every read in flight that no running op reads (`running`, or the guard's record):
  // they become resident, so evictable. Returns whether there was one.
  template <typename InUseFn>
  bool finish_reads_in_flight(InUseFn running) {
    bool any = false;
    for (auto& [storage, s] : slots) {
      if (s.state != State::kReading || running(storage)) continue;
      if (g_guard.track_inputs.load(std::memory_order_acquire) && g_guard.in_use_now(storage))
        continue;
      c10::intrusive_ptr<c10::StorageImpl> live = s.weak.lock();
      if (!live) continue;
      try {
        s.tier->prioritize(s.ticket, io::Priority::kUrgent);
        finish_read(*live, s, false);
        any = true;
      } catch (const Error&) {
        s.error = std::current_exception();  // the op that needs it gets the error
      }
    }
    return any;
  }

  // Issues held prefetches, earliest deadline first, while they fit.
  void issue_held();

  // Issues migration `m` of a step that started `base` ops into the run.
  void run_migration(const plan::Migration& m, std::int64_t base);

  void run_trigger(trace::OpIndex index);

  // The plan's deadlines: before op `index`, the writes due by then are done (as the simulator
  // has them), so that the tensor is gone when the plan counts it gone, whatever the disk's
  // speed. Not the writes of the tensors this op uses (they stay: see before_op).
  void wait_for_deadlines(trace::OpIndex index, const std::vector<TensorRef>& inputs);
};

}  // namespace tidal::torch_layer
