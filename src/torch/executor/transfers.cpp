// One tensor's transfers: writes out, reads back, stages through host memory, and their ends.
#include "torch/executor/executor_impl.hpp"

namespace tidal::torch_layer {

std::string PlanExecutor::Impl::label(const Slot& s) const {
  if (s.tensor >= 0 && !shapes.empty()) {
    const auto& names = shape().tensor_names;
    if (static_cast<std::size_t>(s.tensor) < names.size()) {
      return names[static_cast<std::size_t>(s.tensor)];
    }
  }
  return ::tidal::detail::concat("storage of ", format_bytes(static_cast<double>(s.nbytes)));
}

std::int32_t PlanExecutor::Impl::id_of(const c10::StorageImpl* p) const {
  for (std::size_t id = 0; id < bound.size(); ++id) {
    if (bound[id].lock().get() == p) return static_cast<std::int32_t>(id);
  }
  return -1;
}

void PlanExecutor::Impl::record_start(Slot& s, plan::Direction dir, plan::TransferKind kind,
                                      std::int64_t due) {
  const plan::Tier tier = on_host(s) ? plan::Tier::kHost : plan::Tier::kSsd;
  const bool this_step = due >= step_base;
  s.recorded = timeline_glue::transfer_start(
      tl(), plan::channel_of(tier, dir), kind, [&] { return label(s); }, s.nbytes,
      this_step ? due - step_base : -1);
}

void PlanExecutor::Impl::record_end(Slot& s, bool failed) {
  timeline_glue::transfer_end(tl(), s.recorded, failed);
}

void PlanExecutor::Impl::record_stall(plan::StallKind kind, plan::Channel channel,
                                      std::string tensor, Clock::time_point t0) {
  timeline_glue::stall_since(
      tl(), kind, channel, [&] { return std::move(tensor); }, t0);
}

void PlanExecutor::Impl::settle(Slot& s, State next) {
  const bool was = s.state != State::kResident;
  const bool now = next != State::kResident;
  s.state = next;
  if (was && !now) g_guard.unsettled--;
  if (!was && now) g_guard.unsettled++;
}

void PlanExecutor::Impl::poll() {
  for (auto it = slots.begin(); it != slots.end();) {
    Slot& s = it->second;
    c10::intrusive_ptr<c10::StorageImpl> live = s.weak.lock();
    if (!live) {
      release_io(s);  // waits; errors of discarded data drop
      record_end(s, false);
      settle(s, State::kResident);
      it = slots.erase(it);
      continue;
    }
    if (s.state == State::kWriting && s.tier->ready(s.ticket)) finish_write(*live, s);
    if (s.state == State::kOffloaded && s.staged.valid()) finish_stage(s, false);
    if (s.state == State::kReading && s.tier->ready(s.ticket)) {
      try {
        finish_read(*live, s, false);
      } catch (const Error&) {
        s.error = std::current_exception();
      }
    }
    ++it;
  }
}

void PlanExecutor::Impl::release_io(Slot& s) {
  if (s.ticket.valid()) s.tier->free(s.ticket);  // waits for a request in flight
  s.ticket = io::Ticket{};
  if (s.staged.valid()) opt.host->free(s.staged);
  s.staged = io::Ticket{};
}

void PlanExecutor::Impl::start_stage(Slot& s, std::int64_t due) {
  if (!opt.host || s.state != State::kOffloaded || on_host(s) || s.staged.valid()) return;
  if (s.error || !s.ticket.valid()) return;
  const auto room = opt.host->reserve(s.nbytes);
  if (!room) {
    ++stats.stage_skips;
    return;
  }
  s.staged = room->first;
  s.tier->read(s.ticket, room->second, io::Priority::kPrefetch);
  record_start(s, plan::Direction::kRead, plan::TransferKind::kPlanned, due);
  issued(s, plan::Direction::kRead);
}

void PlanExecutor::Impl::finish_stage(Slot& s, bool wait) {
  if (!s.staged.valid() || (!wait && !s.tier->ready(s.ticket))) return;
  try {
    s.tier->wait(s.ticket);
  } catch (const Error&) {
    ++stats.stage_failures;
    opt.host->free(s.staged);
    s.staged = io::Ticket{};
    record_end(s, true);
    return;
  }
  record_end(s, false);
  s.tier->free(s.ticket);
  s.ticket = s.staged;
  s.tier = opt.host.get();
  s.staged = io::Ticket{};
  ++stats.stages;
  stats.bytes_staged += s.nbytes;
  stats.bytes_read += s.nbytes;
}

void PlanExecutor::Impl::finish_write(c10::StorageImpl& impl, Slot& s) {
  try {
    s.tier->wait(s.ticket);
  } catch (const IoError& e) {
    ++stats.write_failures;  // the tensor keeps its memory: nothing is lost
    if (e.errnum() == ENOSPC) ++stats.store_full;
    stats.write_error = e.what();
    s.tier->free(s.ticket);
    s.ticket = io::Ticket{};
    settle(s, State::kResident);
    record_end(s, true);
    return;
  }
  record_end(s, false);
  (on_host(s) ? stats.bytes_to_host : stats.bytes_written) += s.nbytes;
  if (s.cancel) {
    ++stats.cancelled;
    s.tier->free(s.ticket);
    s.ticket = io::Ticket{};
    settle(s, State::kResident);
    return;
  }
  impl.set_data_ptr_noswap(c10::DataPtr(nullptr, s.device));  // frees the memory
  settle(s, State::kOffloaded);
  ++stats.released;
}

void PlanExecutor::Impl::start_read(c10::StorageImpl& impl, Slot& s, io::Priority p,
                                    plan::TransferKind kind, std::int64_t due) {
  finish_stage(s, true);  // a stage in flight lands first: the read then takes the pool's copy
  c10::Allocator* alloc = impl.allocator();
  {
    detail::ReadAllocationScope scope(s.device);  // no queued kernel may use this memory
    s.incoming = alloc->allocate(s.nbytes);
  }
  s.tier->read(s.ticket, s.incoming.get(), p);
  record_start(s, plan::Direction::kRead, kind, due);
  settle(s, State::kReading);
  (on_host(s) ? stats.bytes_from_host : stats.bytes_read) += s.nbytes;
  issued(s, plan::Direction::kRead);
}

bool PlanExecutor::Impl::start_prefetch(c10::StorageImpl& impl, Slot& s, std::int64_t due) {
  try {
    start_read(impl, s, io::Priority::kPrefetch, plan::TransferKind::kPlanned, due);
  } catch (const c10::OutOfMemoryError&) {
    (void)take_last_refused_bytes();
    ++stats.refused_prefetches;
    return false;
  }
  ++stats.prefetches;
  return true;
}

void PlanExecutor::Impl::issued(const Slot& s, plan::Direction dir) {
  const plan::Tier tier = on_host(s) ? plan::Tier::kHost : plan::Tier::kSsd;
  stats.issued_bytes[plan::index_of(plan::channel_of(tier, dir))] += s.nbytes;
}

void PlanExecutor::Impl::finish_read(c10::StorageImpl& impl, Slot& s, bool needed) {
  const auto t0 = Clock::now();
  const auto stalled = [&] {
    const double dt = since(t0);
    stats.stall_seconds += dt;
    if (on_host(s)) stats.host_stall_seconds += dt;
    if (needed) {
      record_stall(plan::StallKind::kRead,
                   on_host(s) ? plan::Channel::kHostRead : plan::Channel::kSsdRead, label(s), t0);
    }
  };
  try {
    s.tier->wait(s.ticket);
  } catch (const Error&) {
    stalled();
    record_end(s, true);
    s.incoming.clear();
    settle(s, State::kOffloaded);
    throw;
  }
  stalled();
  record_end(s, false);
  detail::record_use_on_current_stream(s.incoming, s.device);
  impl.set_data_ptr_noswap(std::move(s.incoming));
  s.tier->free(s.ticket);
  s.ticket = io::Ticket{};
  settle(s, State::kResident);
}

void PlanExecutor::Impl::make_resident(c10::StorageImpl* storage) {
  auto it = slots.find(storage);
  if (it == slots.end()) return;
  Slot& s = it->second;
  if (s.error) {
    std::exception_ptr e = std::move(s.error);
    s.error = nullptr;
    std::rethrow_exception(e);
  }
  switch (s.state) {
    case State::kResident:
      return;
    case State::kWriting:
      s.cancel = true;  // the op may change it: the memory stays, the write is dropped
      return;
    case State::kOffloaded:
      ++stats.misses;
      start_read(*storage, s, io::Priority::kUrgent, plan::TransferKind::kMiss, -1);
      [[fallthrough]];
    case State::kReading:
      s.tier->prioritize(s.ticket, io::Priority::kUrgent);
      finish_read(*storage, s, true);
      return;
  }
}

void PlanExecutor::Impl::wait_for_room(std::uint64_t more) {
  if (!over(more)) return;
  const auto t0 = Clock::now();
  bool waited = false;
  while (over(more)) {
    Slot* oldest = nullptr;
    for (auto& entry : slots) {
      Slot& s = entry.second;
      if (s.state == State::kWriting && !s.cancel &&
          (oldest == nullptr || s.ticket.id < oldest->ticket.id)) {
        oldest = &s;
      }
    }
    if (oldest == nullptr) break;
    c10::intrusive_ptr<c10::StorageImpl> live = oldest->weak.lock();
    if (!live) break;
    waited = true;
    finish_write(*live, *oldest);
  }
  if (waited) {
    ++stats.budget_waits;
    stats.write_stall_seconds += since(t0);
    record_stall(plan::StallKind::kBudget, plan::Channel::kSsdWrite, "", t0);
  }
}

}  // namespace tidal::torch_layer
