#include "torch/executor/executor.hpp"

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
#include "torch/executor/executor_impl.hpp"
#include "torch/ivalue_tensors.hpp"

namespace tidal::torch_layer {

namespace {

// tidal's own work at a step's start or end, as an op of the timeline (its stalls are inside).
class OpSpan {
 public:
  OpSpan(PlanExecutor::Impl& m, trace::OpIndex index, const char* name) : m_(m) {
    if (m_.tl() != nullptr) m_.tl()->op_start(index, name, m_.meter_bytes());
  }
  ~OpSpan() {
    if (m_.tl() != nullptr) m_.tl()->op_end(m_.meter_bytes());
  }
  OpSpan(const OpSpan&) = delete;
  OpSpan& operator=(const OpSpan&) = delete;

 private:
  PlanExecutor::Impl& m_;
};

}  // namespace

PlanExecutor::PlanExecutor(std::shared_ptr<io::TensorStore> store, const trace::Trace& trace,
                           const plan::Plan& plan, ExecutorOptions options)
    : PlanExecutor(std::move(store), std::move(options)) {
  add_shape(trace, plan);  // with a plan from the start: the guard tracks nothing
  g_guard.track_inputs.store(false, std::memory_order_release);
}

PlanExecutor::PlanExecutor(std::shared_ptr<io::TensorStore> store, ExecutorOptions options)
    : impl_(std::make_unique<Impl>()) {
  TIDAL_EXPECT(store != nullptr, "PlanExecutor needs a TensorStore");
  impl_->store = std::move(store);
  impl_->opt = std::move(options);
  PlanExecutor* expected = nullptr;
  TIDAL_EXPECT(g_guard.executor.compare_exchange_strong(expected, this),
               "another PlanExecutor is active in this process");
  // Without a plan: the guard tracks what runs, in LRU order (add_shape stops the order).
  g_guard.track_inputs.store(true, std::memory_order_release);
  g_guard.note_lru.store(true, std::memory_order_release);
}

bool PlanExecutor::planless() const {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  return impl_->planless();
}

bool movable_storage(const c10::StorageImpl& storage) {
  const c10::Allocator* alloc = storage.allocator();
  return alloc != nullptr && storage.data() != nullptr &&
         storage.data_ptr().get_deleter() == alloc->raw_deleter();
}

void PlanExecutor::track_inputs(bool on) {
  g_guard.track_inputs.store(on, std::memory_order_release);
}

void PlanExecutor::retry_out_of_memory(bool on) {
  g_guard.retry_oom.store(on, std::memory_order_release);
}

std::uint64_t PlanExecutor::out_of_memory_retries() {
  return g_guard.oom_retries.load(std::memory_order_relaxed);
}

void PlanExecutor::note_inputs(c10::ArrayRef<c10::StorageImpl*> storages, bool recent) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  Impl& m = *impl_;
  if (!m.planless() && !m.diverged) return;
  for (c10::StorageImpl* p : storages) {
    if (p == nullptr || p->nbytes() < m.opt.min_bytes || !movable_storage(*p)) continue;
    auto& e = m.seen[p];
    const bool fresh = e.weak.expired();
    if (fresh) {
      e.weak = c10::weak_intrusive_ptr<c10::StorageImpl>(
          c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(p));
      e.last = 0;
    }
    if (recent) e.last = ++m.notes;
  }
}

double PlanExecutor::io_wait_seconds() const {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  return impl_->waits() - impl_->waited_elsewhere;
}

PlanExecutor::~PlanExecutor() {
  try {
    restore_all();
  } catch (const std::exception&) {
    // A tensor that cannot be read back keeps an empty storage; the error reached the caller
    // of the op that needed it, or of restore_all() or end_step(), before.
  }
  {
    std::lock_guard<std::recursive_mutex> lock(impl_->mu);
    for (auto& [storage, s] : impl_->slots) {
      impl_->release_io(s);
      impl_->settle(s, Impl::State::kResident);
    }
    impl_->slots.clear();
  }
  if (impl_->guard_thread == std::this_thread::get_id()) set_residency_guard(false);
  g_guard.track_inputs.store(false, std::memory_order_release);
  g_guard.note_lru.store(false, std::memory_order_release);
  g_guard.executor.store(nullptr);
}

int PlanExecutor::add_shape(const trace::Trace& trace, const plan::Plan& plan) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  impl_->shapes.push_back(Impl::make_shape(trace, plan));
  impl_->grow_bound(trace.tensors.size());
  impl_->seen.clear();  // a plan picks victims from here on
  g_guard.note_lru.store(false, std::memory_order_release);
  return static_cast<int>(impl_->shapes.size()) - 1;
}

void PlanExecutor::set_min_bytes(std::uint64_t bytes) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  impl_->opt.min_bytes = bytes;
}

void PlanExecutor::replace_plan(int index, const trace::Trace& trace, const plan::Plan& plan) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  TIDAL_EXPECT(index >= 0 && static_cast<std::size_t>(index) < impl_->shapes.size(),
               "replace_plan: no step shape ", index);
  auto& shape = impl_->shapes[static_cast<std::size_t>(index)];
  Impl::Shape next = Impl::make_shape(trace, plan);
  // Another trace of the step (a plan made ahead, after step 0): its ids name other tensors.
  if (next.tensor_names != shape.tensor_names) impl_->bound.clear();
  shape = std::move(next);
  impl_->grow_bound(trace.tensors.size());
}

void PlanExecutor::hold(c10::StorageImpl* storage) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  ++impl_->holds[storage];
  auto it = impl_->slots.find(storage);
  if (it != impl_->slots.end() && it->second.state == Impl::State::kWriting) {
    it->second.cancel = true;
    impl_->finish_write(*storage, it->second);  // the bytes stay where they are: in memory
  }
  impl_->make_resident(storage);
}

void PlanExecutor::release(const c10::StorageImpl* storage) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  auto it = impl_->holds.find(storage);
  if (it != impl_->holds.end() && --it->second <= 0) impl_->holds.erase(it);
}

void PlanExecutor::restore_all() {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  std::exception_ptr first;
  for (auto& [storage, s] : impl_->slots) {
    c10::intrusive_ptr<c10::StorageImpl> live = s.weak.lock();
    if (!live) continue;
    if (s.state == Impl::State::kWriting) {
      s.cancel = true;
      impl_->finish_write(*live, s);
    }
    try {
      impl_->make_resident(live.get());
    } catch (const Error&) {
      if (!first) first = std::current_exception();
    }
  }
  impl_->poll();
  if (first) std::rethrow_exception(first);
}

void PlanExecutor::bind_alive(const BoundTensors& tensors) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  for (const auto& [id, storage] : tensors) {
    if (id >= 0 && static_cast<std::size_t>(id) < impl_->bound.size()) {
      impl_->bound[static_cast<std::size_t>(id)] = storage;
    }
  }
}

std::uint64_t PlanExecutor::reclaim(std::uint64_t bytes) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  Impl& m = *impl_;
  const double waits_at_start = m.waits();
  const bool elsewhere =
      m.guard_thread != std::thread::id() && m.guard_thread != std::this_thread::get_id();
  const std::uint64_t target = m.meter_bytes() > bytes ? m.meter_bytes() - bytes : 0;
  const auto index = static_cast<trace::OpIndex>(m.ops_run) - 1;
  const auto running = [&](const c10::StorageImpl* p) {
    return std::find(m.running_inputs.begin(), m.running_inputs.end(), p) != m.running_inputs.end();
  };
  const auto needed = [&] { return m.meter_bytes() > target; };
  std::uint64_t freed = m.evict_while(needed, m.diverged ? -1 : index, running);
  if (needed() && m.finish_reads_in_flight(running)) {
    // Prefetches in flight hold memory no eviction could take while they read: finished, they
    // are resident, and may go again (the last resort; the plan wanted them soon).
    freed += m.evict_while(needed, m.diverged ? -1 : index, running);
  }
  m.stats.reclaimed_bytes += freed;
  if (m.meter_bytes() > target) {
    const std::uint64_t small = m.bytes_under_min_bytes(running);
    if (m.stats.write_failures > 0) {
      m.shortfall = "writes to the store failed (" + m.stats.write_error + ")";
    } else if (small > 0) {
      m.shortfall = ::tidal::detail::concat(
          format_bytes(static_cast<double>(small)),
          " of tensors left in memory are under min_bytes, the smallest size tidal moves (now ",
          format_bytes(static_cast<double>(m.opt.min_bytes)),
          "): a smaller min_bytes (the CLI's --min-offload) lets them go");
    } else {
      m.shortfall = kNothingLeftToMove;
    }
    note_reclaim_shortfall(m.shortfall);
  }
  if (elsewhere) m.waited_elsewhere += m.waits() - waits_at_start;
  return freed;
}

std::uint64_t PlanExecutor::make_room_after_refusal(std::uint64_t refused, int attempt) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  Impl& m = *impl_;
  m.poll();
  const std::uint64_t want = std::max<std::uint64_t>(refused, std::uint64_t{1} << 20)
                             << std::min(attempt, 10);
  const std::uint64_t meter = m.meter_bytes();
  const std::uint64_t over = meter + want > m.opt.budget ? meter + want - m.opt.budget : 0;
  m.shortfall.clear();
  return reclaim(std::max(over, want));
}

std::uint64_t PlanExecutor::memory_in_use() const {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  return impl_->meter_bytes();
}

std::uint64_t PlanExecutor::budget() const {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  return impl_->opt.budget;
}

std::string PlanExecutor::last_reclaim_shortfall() const {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  return impl_->shortfall.empty() ? kNothingLeftToMove : impl_->shortfall;
}

void PlanExecutor::set_budget(std::uint64_t bytes) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  impl_->opt.budget = bytes;
}

void PlanExecutor::fit_budget() {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  impl_->poll();
  impl_->wait_for_room(0);
  impl_->evict_for(0, -1, [](const c10::StorageImpl*) { return false; });
}

void PlanExecutor::ensure_resident(c10::ArrayRef<c10::StorageImpl*> storages) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  Impl& m = *impl_;
  // Reads the op needs at once (misses) take memory too: room is made for them first, never by
  // writing out another tensor this op uses.
  std::uint64_t missing = 0;
  for (c10::StorageImpl* s : storages) {
    auto it = m.slots.find(s);
    if (it != m.slots.end() && it->second.state == Impl::State::kOffloaded) {
      missing += it->second.nbytes;
    }
  }
  if (missing > 0) {
    m.wait_for_room(missing);
    m.evict_for(missing, static_cast<trace::OpIndex>(m.ops_run) - 1,
                [&](const c10::StorageImpl* p) {
                  return std::find(storages.begin(), storages.end(), p) != storages.end();
                });
  }
  for (c10::StorageImpl* s : storages) m.make_resident(s);
}

void PlanExecutor::before_op(trace::OpIndex index, const std::string& name,
                             const std::vector<TensorRef>& inputs) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  Impl& m = *impl_;
  if (m.tl() != nullptr) m.tl()->op_start(index, name, m.meter_bytes());
  if (is_compiled_region(name) && !m.diverged) {
    // A torch.compile'd region the profile did not have: its kernels bypass the residency
    // guard, so everything comes back now and the rest of the step runs on demand. (A failed
    // read cannot stop the op from here; the tensor stays offloaded and the guard reports it
    // at the next ATen op that reads it.)
    m.diverge(::tidal::detail::concat("op ", index, " is ", name, ", a torch.compile'd region"));
    try {
      restore_all();
    } catch (const Error&) {
    }
  }
  m.advance(index, name);
  m.running_inputs.clear();
  for (const auto& r : inputs) m.running_inputs.push_back(r.storage);
  if (!m.diverged) m.bind(inputs);
  if (m.opt.on_op_start && !m.diverged && index >= 0) {
    std::vector<plan::Residency> where(static_cast<std::size_t>(m.shape().sched.num_tensors));
    for (std::size_t id = 0; id < where.size(); ++id) where[id] = m.residency_of(id);
    m.opt.on_op_start(index, where);
  }
  // No reads here (this runs in a RecordFunction callback, where a failure could not stop the
  // op): the residency guard reads what the op needs. A write in flight is cancelled, though, so
  // that an op changing the tensor in place never loses its change.
  for (const auto& r : inputs) {
    auto it = m.slots.find(r.storage);
    if (it != m.slots.end() && it->second.state == Impl::State::kWriting) it->second.cancel = true;
  }
  m.poll();
  if (!m.diverged && index >= 0) {
    const auto& new_bytes = m.shape().sched.new_bytes;
    m.wait_for_deadlines(index, inputs);
    if (static_cast<std::size_t>(index) < new_bytes.size()) {
      const std::uint64_t more = new_bytes[static_cast<std::size_t>(index)];
      m.wait_for_room(more);
      m.evict_for(more, index, [&](const c10::StorageImpl* p) {
        return std::any_of(inputs.begin(), inputs.end(),
                           [&](const TensorRef& r) { return r.storage == p; });
      });
      m.reserve = more;
    }
  }
  m.issue_held();
}

void PlanExecutor::after_op(trace::OpIndex index, const std::vector<TensorRef>& outputs) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  Impl& m = *impl_;
  m.running_inputs.clear();
  if (m.tl() != nullptr) m.tl()->op_end(m.meter_bytes());
  if (m.diverged) return;  // on-demand only: the guard still serves every op
  m.bind(outputs);
  const auto& new_bytes = m.shape().sched.new_bytes;
  const auto next = static_cast<std::size_t>(index) + 1;
  m.reserve = index >= 0 && next < new_bytes.size() ? new_bytes[next] : 0;
  try {
    m.run_trigger(index);
  } catch (const Error&) {
    // Starting an offload or a prefetch failed (no memory for a read, say): the tensors stay
    // where they are, and the guard fetches what an op needs.
  }
}

void PlanExecutor::step_end(trace::OpIndex index, const std::vector<TensorRef>& alive) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  Impl& m = *impl_;
  const OpSpan span(m, index, kStepEndOp);
  m.advance(index, kStepEndOp);
  if (!m.diverged) m.bind(alive);
  m.poll();
  std::exception_ptr first;
  for (const auto& r : alive) {
    try {
      m.make_resident(r.storage);
    } catch (const Error&) {
      if (!first) first = std::current_exception();
    }
  }
  m.deferred.clear();
  if (m.planless()) {
    if (first) std::rethrow_exception(first);
    return;
  }
  const plan::Schedule& sched = m.shape().sched;
  if (!m.diverged && index >= 0 && static_cast<std::size_t>(index) < sched.issued_after.size()) {
    for (std::int32_t i : sched.issued_after[static_cast<std::size_t>(index)]) {
      m.deferred.push_back(sched.migrations[static_cast<std::size_t>(i)]);
    }
    m.deferred_base = m.step_base;
  }
  if (first) std::rethrow_exception(first);
}

void PlanExecutor::begin_step(std::int64_t /*step*/, const std::vector<torch::Tensor>& /*in*/) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  Impl& m = *impl_;
  m.waited_before += m.stats.stall_seconds + m.stats.write_stall_seconds;
  m.stats = ExecutorStats{};
  m.step_base += static_cast<std::int64_t>(m.ops_run);
  m.diverged = m.planless();  // without a plan every op is served on demand
  if (!m.planless()) {        // a step that diverged noted the storages ops read: not this one
    m.seen.clear();
    g_guard.note_lru.store(false, std::memory_order_release);
  }
  m.ops_run = 0;
  m.held.clear();
  m.current = m.last_completed;
  const OpSpan span(m, -1, "tidal::step_begin");
  set_residency_guard(true);
  m.guard_thread = std::this_thread::get_id();
  // What the plan moves after the last step's end (the step-end op's actions) starts now, so
  // that between steps everything stays the caller's.
  try {
    for (const auto& mig : m.deferred) m.run_migration(mig, m.deferred_base);
  } catch (const Error&) {
  }
  m.deferred.clear();
}

void PlanExecutor::end_step(std::int64_t /*step*/) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  Impl& m = *impl_;
  m.holds.clear();  // a hold lasts at most to the end of its step
  m.poll();
  if (m.planless()) {
    m.last = m.stats;
    return;
  }
  const auto& shape = m.shapes[static_cast<std::size_t>(m.current)];
  if (!m.diverged && m.ops_run != shape.op_names.size()) {
    // The step stopped early: it is the prefix of a known shape, or a shape of its own.
    bool found = false;
    for (std::size_t j = 0; j < m.shapes.size() && !found; ++j) {
      if (m.shapes[j].op_names.size() == m.ops_run &&
          Impl::same_start(m.shapes[j], shape, m.ops_run)) {
        m.current = static_cast<int>(j);
        found = true;
      }
    }
    if (!found) {
      m.diverge(::tidal::detail::concat("the step ended after ", m.ops_run,
                                        " ops; the profile has ", shape.op_names.size()));
    }
  }
  if (!m.diverged) {
    m.stats.shape = m.current;
    m.stats.planned_bytes = m.shape().sched.planned_bytes;
    m.last_completed = m.current;
  }
  m.last = m.stats;
}

void PlanExecutor::abort_step() {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  Impl& m = *impl_;
  m.holds.clear();
  m.deferred.clear();
  m.poll();
  m.stats.shape = -1;
  m.last = m.stats;
}

ExecutorStats PlanExecutor::last_step() const {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  return impl_->last;
}

}  // namespace tidal::torch_layer
