// A saved tensor's way out (pack: written to host memory or the store) and back (unpack: read
// back, prefetched ahead of backward).
#include "torch/activations/activations_impl.hpp"

namespace tidal::torch_layer {

void ActivationOffloader::Impl::note_pack_locked() {
  if (first_pack) {
    first_pack = false;
    step_start = Clock::now();
    // Without an op tracer, the phases are the timeline's ops (a loop that marks them itself
    // marks the same ones).
    if (timeline) timeline->op_start(-1, "forward", plan::Timeline::kNoSample);
  }
  ++stats.packed;
  sample_memory();
  if (in_backward.load() && g_engine.backward_running.load() == 0) {
    // A forward pass after a backward in the same step (a GAN's second model, gradient
    // accumulation): its tensors are offloaded and prefetched like the first pass's.
    in_backward = false;
    prefetch_cursor = -1;
    prefetch_in_flight = 0;
    ++stats.passes;
  }
  poll_writes_locked(false);
}

std::uint64_t* ActivationOffloader::Impl::kept_counter(const at::Tensor& t) {
  // Weights, and the views of them that ops save (linear saves weight.t()), stay: they live
  // anyway, so writing them would free nothing. Leaves arrive detached, hence the storage map.
  if (t.is_leaf() && t.requires_grad()) return &stats.kept_parameter;
  if (t.is_view() && t._base().is_leaf() && t._base().requires_grad()) {
    return &stats.kept_parameter;  // weight.t() and other views of a leaf
  }
  if (t.has_storage()) {
    auto p = persistent.find(t.storage().unsafeGetStorageImpl());
    if (p != persistent.end() && p->second.lock().get() == p->first) {
      return &stats.kept_parameter;
    }
  }
  if (!t.has_storage() || t.storage().nbytes() < opt.min_bytes) return &stats.kept_small;
  return nullptr;
}

std::shared_ptr<Record> ActivationOffloader::Impl::shared_record_locked(const at::Tensor& t) {
  const c10::StorageImpl* key = t.storage().unsafeGetStorageImpl();
  auto it = by_storage.find(key);
  if (it == by_storage.end()) return nullptr;
  Record& r = *it->second;
  // The same live storage at the same version holds the same bytes: share the record. (The
  // weak reference keeps the StorageImpl's address from being reused while we map it.) Not a
  // record autograd has released (alive == 0): it gave up its bytes (a cancelled write leaves
  // it kept with no storage), and sharing it would unpack an empty storage.
  if (r.alive > 0 && r.identity.lock().get() == key && r.version == t._version()) {
    ++r.users;
    ++r.alive;
    ++stats.deduplicated;
    return it->second;
  }
  return nullptr;
}

std::shared_ptr<Record> ActivationOffloader::Impl::pack(const at::Tensor& t, at::Tensor* kept) {
  std::lock_guard<std::mutex> lock(mu);
  note_pack_locked();
  const auto keep = [&](std::uint64_t& counter) {
    ++counter;
    *kept = t.detach();  // never the tensor itself: that would close a cycle through grad_fn
    return std::shared_ptr<Record>();
  };
  if (std::uint64_t* counter = kept_counter(t)) return keep(*counter);
  if (auto shared = shared_record_locked(t)) return shared;
  const c10::StorageImpl* key = t.storage().unsafeGetStorageImpl();
  const std::size_t index = order.size();
  auto r = std::make_shared<Record>();
  r->nbytes = t.storage().nbytes();
  r->index = index;
  r->packed_at = since(step_start);
  // On a GPU: where the device is in the step (device_times_locked), and, for a write, when the
  // kernels that made the tensor have run (Record::ready). Null for CPU tensors.
  r->packed_event = detail::record_on_current_stream(t.device());
  if (!start_event) start_event = r->packed_event;
  if (keep_from >= 0 && static_cast<std::int64_t>(index) >= keep_from &&
      !host_has_room(r->nbytes)) {
    // Adaptive keep: needed first in backward, and their I/O to the SSDs could not be hidden
    // (host memory, when it has room, takes them at the link's speed). They stay in the pack
    // order (as kept records) so that the rule sees the whole timeline next step.
    order.push_back(r);
    return keep(stats.kept_adaptive);
  }
  r->storage = t.storage();
  r->identity = t.storage().getWeakStorageImpl();
  r->device = t.device();
  r->version = t._version();
  r->users = 1;
  r->alive = 1;
  // On a GPU the kernel that produced it may still be running: the bytes must be final before
  // the store's own streams copy them. An event on the producing stream says when; the training
  // thread goes on, and the write is handed to the store once the event has completed
  // (submit_ready_locked). CPU tensors are written at once.
  r->ready = r->packed_event;
  if (r->ready) {
    r->state = Record::State::kQueued;
    if (!submitter.joinable()) submitter = std::thread([this] { submit_loop(); });
    queued_cv.notify_one();
  } else {
    submit_write_locked(*r);
  }
  ++stats.offloaded;
  writing.push_back(r);
  by_storage[key] = r;
  order.push_back(r);
  return r;
}

void ActivationOffloader::Impl::submit_write_locked(Record& r) {
  r.ready.reset();
  try {
    // Host memory first (pinned on a GPU machine: the link's speed), the SSDs where it is short.
    r.tier = host_has_room(r.nbytes) ? static_cast<io::Tier*>(opt.host.get())
                                     : static_cast<io::Tier*>(store.get());
    r.ticket = r.tier->write(r.storage.data(), r.nbytes, io::Priority::kOffload);
    r.state = Record::State::kWriting;
    record_start(r, channel(r, plan::Direction::kWrite), plan::TransferKind::kActivation);
  } catch (const Error& e) {
    // Refused at once (a closed store, a size it cannot take): the tensor stays in memory.
    ++stats.write_failures;
    stats.write_error = e.what();
    r.state = Record::State::kKept;
  }
}

// Hands the store every queued write whose bytes are final (`block`: waits for them). Events
// of one stream complete in the order they were recorded: the first one not complete ends it.
void ActivationOffloader::Impl::submit_ready_locked(bool block) {
  for (auto& w : writing) {
    if (w->state != Record::State::kQueued) continue;
    if (block) {
      w->ready->synchronize();
    } else if (!w->ready->query()) {
      return;
    }
    submit_write_locked(*w);
  }
}

std::shared_ptr<c10::Event> ActivationOffloader::Impl::first_queued_locked() const {
  for (const auto& w : writing) {
    if (w->state == Record::State::kQueued) return w->ready;
  }
  return nullptr;
}

// The submitter thread: waits (unlocked) for the oldest queued write's event, then hands the
// store every write whose bytes are final. The event is shared, so a record cancelled meanwhile
// (backward, release) only makes the wait end early.
void ActivationOffloader::Impl::submit_loop() {
  std::unique_lock<std::mutex> lock(mu);
  for (;;) {
    std::shared_ptr<c10::Event> ready;
    queued_cv.wait(lock, [&] { return stopping || (ready = first_queued_locked()) != nullptr; });
    if (stopping) return;
    lock.unlock();
    ready->synchronize();
    lock.lock();
    submit_ready_locked(false);
  }
}

ActivationOffloader::Impl::~Impl() {
  {
    std::lock_guard<std::mutex> lock(mu);
    stopping = true;
  }
  queued_cv.notify_all();
  if (submitter.joinable()) submitter.join();
}

// Retires finished writes in order: their memory goes back as soon as the bytes are safe.
void ActivationOffloader::Impl::poll_writes_locked(bool block) {
  submit_ready_locked(block);
  while (!writing.empty()) {
    Record& r = *writing.front();
    if (r.state == Record::State::kQueued) return;  // not final yet (block: submitted above)
    if (r.state == Record::State::kWriting) {
      if (!block && !r.tier->ready(r.ticket)) return;
      finish_write_locked(r);
    }
    writing.pop_front();
  }
}

void ActivationOffloader::Impl::finish_write_locked(Record& r) {
  if (r.state == Record::State::kQueued) {
    r.ready->synchronize();
    submit_write_locked(r);
  }
  try {
    r.tier->wait(r.ticket);
    record_end(r, false);
    r.state = Record::State::kOffloaded;
    stats.bytes_written += r.nbytes;
    if (on_host(r)) stats.bytes_to_host += r.nbytes;
    r.storage = c10::Storage();  // drop our reference: the memory is freed if nobody else holds it
    if (r.alive == 0) {          // released while it was being written: nobody will read it back
      r.tier->free(r.ticket);
      r.ticket = io::Ticket{};
    }
  } catch (const IoError& e) {
    // A full or failing store never changes a result: the tensor simply stays in memory.
    ++stats.write_failures;
    if (e.errnum() == ENOSPC) ++stats.store_full;
    stats.write_error = e.what();
    record_end(r, true);
    r.tier->free(r.ticket);
    r.ticket = io::Ticket{};
    r.state = Record::State::kKept;
  }
}

void ActivationOffloader::Impl::start_read_locked(Record& r, io::Priority p) {
  at::Tensor bytes;
  {
    detail::ReadAllocationScope scope(r.device);  // no queued kernel may use this memory
    bytes = at::empty({static_cast<std::int64_t>(r.nbytes)},
                      at::TensorOptions().dtype(at::kByte).device(r.device));
  }
  r.storage = bytes.storage();
  r.tier->read(r.ticket, r.storage.mutable_data(), p);
  record_start(
      r, channel(r, plan::Direction::kRead),
      p == io::Priority::kUrgent ? plan::TransferKind::kMiss : plan::TransferKind::kActivation);
  r.state = Record::State::kReading;
  stats.bytes_read += r.nbytes;
}

// Starts reads for the records that backward will need next (reverse pack order), up to the
// lookahead in bytes.
void ActivationOffloader::Impl::prefetch_locked(std::size_t below) {
  // Reads wait for the writes in flight: a read ahead of them would hold their memory longer
  // than no offloading would (the disk serves both), for a tensor that is in memory anyway.
  poll_writes_locked(false);
  if (!writing.empty()) return;
  if (prefetch_cursor < 0 || static_cast<std::size_t>(prefetch_cursor) >= below) {
    prefetch_cursor = static_cast<std::int64_t>(below) - 1;
  }
  while (prefetch_cursor >= 0 && prefetch_in_flight < lookahead) {
    auto& r = order[static_cast<std::size_t>(prefetch_cursor)];
    --prefetch_cursor;
    if (!r || r->state != Record::State::kOffloaded || r->alive == 0) continue;
    if (!r->identity.expired()) continue;  // still in memory elsewhere: unpack forwards it
    start_read_locked(*r, io::Priority::kPrefetch);
    prefetch_in_flight += r->nbytes;
    ++stats.prefetched;
  }
}

// Backward has begun: remember how long forward took and start reading back the last tensors.
// Writes still waiting in the store's queue are of the tensors forward saved last, which
// backward needs first: they are dropped (the tensors stay in memory, as without offloading),
// and the ones already running go ahead of every read, so that their memory comes back.
void ActivationOffloader::Impl::begin_backward_locked() {
  if (in_backward.exchange(true)) return;
  if (timeline) timeline->op_start(-1, "backward", plan::Timeline::kNoSample);
  forward_seconds = since(step_start);
  if (start_event) {
    backward_event = detail::record_on_current_stream(start_event->device());
  }
  for (auto& w : writing) {
    if (w->state == Record::State::kQueued) {  // never handed to the store: nothing to cancel
      w->ready.reset();
      w->state = Record::State::kKept;
      note_cancelled_locked(*w);
      continue;
    }
    if (w->state != Record::State::kWriting) continue;
    if (w->tier->cancel_write(w->ticket)) {
      record_end(*w, false);
      w->ticket = io::Ticket{};
      w->state = Record::State::kKept;
      note_cancelled_locked(*w);
    } else {
      w->tier->prioritize(w->ticket, io::Priority::kUrgent);
    }
  }
  prefetch_locked(order.size());
}

void ActivationOffloader::Impl::note_backward() {
  if (in_backward.load()) return;
  std::lock_guard<std::mutex> lock(mu);
  begin_backward_locked();
}

// Someone else (the caller's variables, another graph) kept the storage alive: its bytes are
// still in memory, unchanged (the version check at pack), so no read and no second copy.
void ActivationOffloader::Impl::reuse_live_bytes_locked(Record& r,
                                                        std::unique_lock<std::mutex>& lock) {
  if (r.state == Record::State::kOffloaded || r.state == Record::State::kReading) {
    if (auto live = r.identity.lock()) {
      if (r.state == Record::State::kReading) {
        const io::Ticket t = r.ticket;
        lock.unlock();
        bool failed = false;
        try {
          r.tier->wait(t);
        } catch (const IoError&) {
          failed = true;
        }
        lock.lock();
        record_end(r, failed);
        prefetch_in_flight -= std::min(prefetch_in_flight, r.nbytes);
      }
      r.storage = c10::Storage(std::move(live));
      r.state = Record::State::kRestored;
      ++stats.forwarded;
    }
  }
}

// The record's bytes in memory: kept, forwarded from a write in flight, or read back (a miss, or
// a prefetch waited for). A failed or corrupt read throws.
void ActivationOffloader::Impl::await_bytes_locked(Record& r, std::unique_lock<std::mutex>& lock) {
  switch (r.state) {
    case Record::State::kKept:
    case Record::State::kQueued:
    case Record::State::kWriting:
    case Record::State::kRestored:
      if (r.state != Record::State::kRestored) ++stats.forwarded;
      break;
    case Record::State::kOffloaded:
      ++stats.misses;
      start_read_locked(r, io::Priority::kUrgent);
      [[fallthrough]];
    case Record::State::kReading: {
      r.tier->prioritize(r.ticket, io::Priority::kUrgent);
      const io::Ticket t = r.ticket;
      const auto t0 = Clock::now();
      lock.unlock();
      try {
        r.tier->wait(t);  // a failed or corrupt read throws: never a wrong gradient
      } catch (const Error&) {
        lock.lock();
        record_end(r, true);
        throw;
      }
      lock.lock();
      stats.stall_seconds += since(t0);
      record_stall(plan::StallKind::kRead, plan::Channel::kSsdRead, r, t0);
      record_end(r, false);
      if (r.state == Record::State::kReading) {
        r.state = Record::State::kRestored;
        prefetch_in_flight -= std::min(prefetch_in_flight, r.nbytes);
      }
      break;
    }
  }
}

at::Tensor ActivationOffloader::Impl::unpack(Record& r, const c10::TensorOptions& options,
                                             std::int64_t offset,
                                             const std::vector<std::int64_t>& sizes,
                                             const std::vector<std::int64_t>& strides,
                                             at::ScalarType dtype) {
  std::unique_lock<std::mutex> lock(mu);
  begin_backward_locked();
  sample_memory();
  poll_writes_locked(false);
  if (r.state == Record::State::kRestored && !r.storage) {
    // Unpacked more often than it was saved (retain_graph): read it again.
    TIDAL_EXPECT(r.ticket.valid(),
                 "a saved activation was unpacked after its step ended; call "
                 "backward before end_step()");
    r.state = Record::State::kOffloaded;
  }
  reuse_live_bytes_locked(r, lock);
  // end_step freed the step's bytes on the SSD: a graph kept past it cannot be run backward.
  TIDAL_EXPECT(r.state != Record::State::kOffloaded || r.ticket.valid(),
               "backward used a saved activation after its step ended (end_step, or the end of "
               "the offload_activations context, gave its bytes on the SSD back): call backward "
               "inside the step that ran the forward");
  await_bytes_locked(r, lock);
  TIDAL_EXPECT(r.storage, "a saved activation lost its bytes before backward used it (record ",
               r.index, " of this step); this is a tidal bug, please report it");
  // Taken before prefetch_locked: it retires finished writes, and when this record's own write
  // (still running: the tensor was forwarded from memory) finishes there, the record drops its
  // storage. Read after that, it was empty: PyTorch's "storage INTERNAL ASSERT" under load.
  c10::Storage storage = r.storage;
  detail::record_use_on_current_stream(storage.data_ptr(), r.device);
  prefetch_locked(r.index);
  if (++r.unpacked >= r.users && r.state == Record::State::kRestored) {
    r.storage = c10::Storage();  // autograd now holds what it needs
  }
  lock.unlock();
  return at::empty({0}, options.dtype(dtype)).set_(storage, offset, sizes, strides);
}

}  // namespace tidal::torch_layer
