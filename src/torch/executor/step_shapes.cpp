// Following the plan of a step shape: which shape the step runs, the tensors bound to its ids, and
// the migrations each op issues.
#include "torch/executor/executor_impl.hpp"

namespace tidal::torch_layer {

PlanExecutor::Impl::Shape PlanExecutor::Impl::make_shape(const trace::Trace& trace,
                                                         const plan::Plan& plan) {
  Shape s;
  s.sched = plan::compile_schedule(trace, &plan, /*strict=*/false);
  s.op_names = trace::op_names(trace);
  s.tensor_names.reserve(trace.tensors.size());
  for (const auto& t : trace.tensors) s.tensor_names.push_back(t.name);
  return s;
}

plan::Residency PlanExecutor::Impl::residency_of(std::size_t id) const {
  if (id >= bound.size()) return plan::Residency::kAbsent;
  auto live = bound[id].lock();
  if (!live) return plan::Residency::kAbsent;
  auto it = slots.find(live.get());
  if (it == slots.end()) return plan::Residency::kResident;
  switch (it->second.state) {
    case State::kResident:
      return plan::Residency::kResident;
    case State::kWriting:
      return it->second.cancel ? plan::Residency::kResident : plan::Residency::kLeaving;
    case State::kReading:
      return plan::Residency::kArriving;
    case State::kOffloaded:
      for (const auto& h : held) {
        if (h.storage.lock().get() == live.get()) return plan::Residency::kArriving;
      }
      return plan::Residency::kAway;
  }
  return plan::Residency::kResident;
}

void PlanExecutor::Impl::grow_bound(std::size_t n) {
  if (bound.size() < n) {
    bound.resize(n,
                 c10::weak_intrusive_ptr<c10::StorageImpl>(c10::intrusive_ptr<c10::StorageImpl>()));
  }
}

void PlanExecutor::Impl::advance(trace::OpIndex index, const std::string& name) {
  ++ops_run;
  if (diverged) return;
  const auto k = static_cast<std::size_t>(index);
  const Shape& cur = shapes[static_cast<std::size_t>(current)];
  if (index >= 0 && k < cur.op_names.size() && cur.op_names[k] == name) return;
  for (std::size_t j = 0; j < shapes.size() && index >= 0; ++j) {
    const Shape& s = shapes[j];
    if (static_cast<int>(j) != current && k < s.op_names.size() && s.op_names[k] == name &&
        same_start(s, cur, k)) {
      current = static_cast<int>(j);
      ++stats.shape_switches;
      grow_bound(static_cast<std::size_t>(s.sched.num_tensors));
      return;
    }
  }
  diverge(::tidal::detail::concat(
      "op ", index, " is ", name, " but the profile has ",
      index >= 0 && k < cur.op_names.size() ? cur.op_names[k] : std::string("no such op")));
}

void PlanExecutor::Impl::diverge(std::string why) {
  diverged = true;
  // From here the residency guard notes the storages ops read, so that eviction can take the
  // least recently read of those the plan does not know (the step's new tensors).
  g_guard.note_lru.store(true, std::memory_order_release);
  stats.diverged = true;
  stats.divergence = std::move(why);
}

void PlanExecutor::Impl::bind(const std::vector<TensorRef>& refs) {
  for (const auto& r : refs) {
    if (r.id < 0 || static_cast<std::size_t>(r.id) >= bound.size() || r.storage == nullptr) {
      continue;
    }
    bound[static_cast<std::size_t>(r.id)] = c10::weak_intrusive_ptr<c10::StorageImpl>(
        c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(r.storage));
  }
}

void PlanExecutor::Impl::issue_held() {
  while (!held.empty()) {
    auto live = held.front().storage.lock();
    if (!live) {
      held.erase(held.begin());
      continue;
    }
    auto it = slots.find(live.get());
    if (it == slots.end() || it->second.state != State::kOffloaded) {
      held.erase(held.begin());
      continue;
    }
    if (over(it->second.nbytes + reserve)) return;
    if (!start_prefetch(*live, it->second, held.front().due)) return;  // stays held
    held.erase(held.begin());
  }
}

void PlanExecutor::Impl::run_migration(const plan::Migration& m, std::int64_t base) {
  if (m.tensor < 0 || static_cast<std::size_t>(m.tensor) >= bound.size()) return;
  c10::intrusive_ptr<c10::StorageImpl> impl = bound[static_cast<std::size_t>(m.tensor)].lock();
  if (!impl) {
    ++stats.unbound;
    return;
  }
  if (m.kind == plan::ActionKind::kOffload) {
    if (impl->nbytes() < opt.min_bytes || !movable_storage(*impl)) return;
    if (is_held(impl.get())) return;
    Slot& s = slots[impl.get()];
    if (s.state != State::kResident || s.error) return;
    s.weak = c10::weak_intrusive_ptr<c10::StorageImpl>(impl);
    s.nbytes = impl->nbytes();
    s.device = impl->device();
    s.cancel = false;
    s.due = base + m.due;
    s.tensor = m.tensor;
    detail::sync_current_stream(s.device);  // the producing kernels must have finished
    // Where the plan says: host memory while the pool has room, else the SSD store.
    s.tier = store.get();
    if (m.tier == plan::Tier::kHost) {
      if (opt.host && opt.host->free_bytes() >= s.nbytes) {
        s.tier = opt.host.get();
        ++stats.host_offloads;
      } else {
        ++stats.host_fallbacks;
      }
    }
    s.ticket = s.tier->write(impl->data(), s.nbytes, io::Priority::kOffload);
    record_start(s, plan::Direction::kWrite, plan::TransferKind::kPlanned, s.due);
    issued(s, plan::Direction::kWrite);
    settle(s, State::kWriting);
    ++stats.offloads;
    return;
  }
  auto it = slots.find(impl.get());
  if (it == slots.end()) return;
  Slot& s = it->second;
  if (m.kind == plan::ActionKind::kStage) {
    start_stage(s, base + m.due);
    return;
  }
  if (s.state == State::kWriting && !s.cancel) {
    // Forwarding: the tensor is wanted back before its write is done. It keeps its memory;
    // a write not yet started is dropped, one that runs is finished and forgotten.
    ++stats.forwarded;
    if (s.tier->cancel_write(s.ticket)) {
      s.ticket = io::Ticket{};
      settle(s, State::kResident);
      record_end(s, false);
    } else {
      s.cancel = true;
    }
    return;
  }
  if (s.state != State::kOffloaded) return;
  wait_for_room(s.nbytes + reserve);
  if (!over(s.nbytes + reserve) && start_prefetch(*impl, s, base + m.due)) return;
  // No room yet (by the meter, or the wall refused it): hold it, most urgent first, until
  // memory allows or an op needs it.
  HeldPrefetch h{base + m.due, c10::weak_intrusive_ptr<c10::StorageImpl>(impl)};
  auto pos = std::upper_bound(held.begin(), held.end(), h,
                              [](const auto& x, const auto& y) { return x.due < y.due; });
  held.insert(pos, std::move(h));
  ++stats.delayed_prefetches;
}

void PlanExecutor::Impl::run_trigger(trace::OpIndex index) {
  const plan::Schedule& sched = shape().sched;
  if (index < 0 || static_cast<std::size_t>(index) >= sched.issued_after.size()) return;
  for (std::int32_t i : sched.issued_after[static_cast<std::size_t>(index)]) {
    run_migration(sched.migrations[static_cast<std::size_t>(i)], step_base);
  }
}

void PlanExecutor::Impl::wait_for_deadlines(trace::OpIndex index,
                                            const std::vector<TensorRef>& inputs) {
  if (!opt.wait_for_deadlines) return;
  const std::int64_t now = step_base + index;
  const auto t0 = Clock::now();
  bool waited = false;
  for (auto& [storage, s] : slots) {
    if (s.state != State::kWriting || s.cancel || s.due > now) continue;
    if (std::any_of(inputs.begin(), inputs.end(),
                    [&](const TensorRef& r) { return r.storage == storage; })) {
      continue;
    }
    c10::intrusive_ptr<c10::StorageImpl> live = s.weak.lock();
    if (!live) continue;
    if (!s.tier->ready(s.ticket)) waited = true;
    finish_write(*live, s);
  }
  if (waited) {
    ++stats.deadline_waits;
    stats.write_stall_seconds += since(t0);
    record_stall(plan::StallKind::kDeadline, plan::Channel::kSsdWrite, "", t0);
  }
}

}  // namespace tidal::torch_layer
