// A request's way to the backends: its ops queued in lanes (one per file, by priority), collected
// as queue slots and staging buffers free up, prepared (staged copies) and submitted.
#include <algorithm>
#include <chrono>
#include <cstring>

#include "io/host_copy.hpp"
#include "io/store/store_impl.hpp"
#include "tidal/common/units.hpp"

namespace tidal::io {

using detail::copy_out;

bool TensorStore::Impl::fits_direct(const char* p, std::uint32_t len, bool device) const {
  if (device) return device_backend != nullptr;  // cuFile moves device memory itself
  if (opt.buffered) return true;
  return reinterpret_cast<std::uintptr_t>(p) % kBlockSize == 0 && len % kBlockSize == 0;
}

// Called with mu held: builds one op per piece and queues them.
void TensorStore::Impl::start_request(Entry& e, char* user, bool write, Priority prio,
                                      bool device) {
  e.busy = true;
  ++busy_entries;
  e.writing = write;
  e.device = device;
  e.user = user;
  e.err = 0;
  e.err_msg.clear();
  e.pending = static_cast<int>(e.pieces.size());
  e.slots.assign(e.pieces.size(), OpSlot{});
  for (std::size_t i = 0; i < e.pieces.size(); ++i) {
    OpSlot& s = e.slots[i];
    const Piece& p = e.pieces[i];
    s.store = this;
    s.entry = &e;
    s.piece = static_cast<std::uint32_t>(i);
    s.priority = prio;
    s.seq = next_seq++;
    s.queued = true;
    s.io.file = p.file;
    s.io.offset = p.file_offset;
    s.io.write = write;
    s.io.on_complete = &Impl::on_complete;
    s.io.context = &s;
    lanes[static_cast<std::size_t>(p.file)].insert(&s);
  }
  if (e.pieces.empty()) {  // zero bytes: complete at once
    e.busy = false;
    --busy_entries;
    if (write) e.has_data = true;
    done_cv.notify_all();
  }
}

// With mu held: moves the ops that may start now (a free slot in their file's queue, and a
// staging buffer where they need one) from the lanes into batch, highest priority first. With
// direct_only, a lane stops at an op that needs staging (its copy is the dispatcher thread's
// job); returns true when that happened.
bool TensorStore::Impl::collect(std::vector<OpSlot*>& batch, bool direct_only) {
  bool left_staged = false;
  for (std::size_t f = 0; f < lanes.size(); ++f) {
    auto& lane = lanes[f];
    while (in_flight[f] < opt.queue_depth && !lane.empty()) {
      OpSlot* s = *lane.begin();
      const Piece& p = s->entry->pieces[s->piece];
      if (!fits_direct(s->entry->user + p.tensor_offset, p.length, s->entry->device)) {
        if (direct_only) {
          left_staged = true;
          break;
        }
        if (staging_free.empty()) break;  // wait for a completion to return a buffer
        s->staging = staging_free.back();
        staging_free.pop_back();
        ++counters.staged_ops;
      }
      lane.erase(lane.begin());
      s->queued = false;
      ++in_flight[f];
      if (ops_in_flight++ == 0) busy_start = std::chrono::steady_clock::now();
      batch.push_back(s);
    }
  }
  return left_staged;
}

// Without mu, by the one thread that holds the dispatching role: hands batch to the backends.
void TensorStore::Impl::submit_batch(const std::vector<OpSlot*>& batch) {
  fall_back_if_broken();
  bool device_ops = false;
  for (OpSlot* s : batch) {
    device_ops = device_ops || (s->entry->device && s->staging < 0);
    prepare_and_submit(s);
  }
  host_backend->flush();
  if (device_ops) device_backend->flush();
}

// With mu held (through lock), on the thread that just queued a request: submits the ops that
// need no staging copy right here, which saves waking the dispatcher thread for each request
// (on a machine with few cores that hand-off costs bandwidth). Ops that need a staging copy are
// left to the dispatcher thread, so that the caller never copies.
void TensorStore::Impl::kick(std::unique_lock<std::mutex>& lock) {
  if (dispatching) {  // the holder of the role collects again before it lets go
    dispatch_cv.notify_one();
    return;
  }
  std::vector<OpSlot*> batch;
  bool left_staged = false;
  for (;;) {
    batch.clear();
    left_staged = collect(batch, true);
    if (batch.empty()) break;
    dispatching = true;
    lock.unlock();
    submit_batch(batch);
    lock.lock();
    dispatching = false;
  }
  if (left_staged) dispatch_cv.notify_one();
}

void TensorStore::Impl::dispatch_loop() {
  std::vector<OpSlot*> batch;
  std::unique_lock<std::mutex> lock(mu);
  while (!stop) {
    batch.clear();
    if (!dispatching) collect(batch, false);
    if (batch.empty()) {
      dispatch_cv.wait(lock);
      continue;
    }
    dispatching = true;
    lock.unlock();
    submit_batch(batch);
    lock.lock();
    dispatching = false;
  }
}

// Runs on the dispatcher thread without the lock: the op's entry is busy, so nobody else
// touches it. Kept light (no hashing) so that dispatching never waits on the CPU: a checksummed
// write's source is hashed on the checksum pool while the backend writes it.
void TensorStore::Impl::prepare_and_submit(OpSlot* s) {
  Entry& e = *s->entry;
  Piece& p = e.pieces[s->piece];
  char* user = e.user + p.tensor_offset;
  const bool staged = s->staging >= 0;
  if (staged) {
    char* buf = reinterpret_cast<char*>(staging[static_cast<std::size_t>(s->staging)]);
    s->io.buffer = buf;
    s->io.length =
        static_cast<std::uint32_t>(opt.buffered ? p.length : align_up(p.length, kBlockSize));
    s->io.fixed_buffer = s->staging;
    if (e.writing) {
      if (copy_out(buf, user, p.length, e.device) != 0) {
        s->parts = 1;
        complete(s, EIO, "copying device memory to the staging buffer failed");
        return;
      }
      std::memset(buf + p.length, 0, s->io.length - p.length);
    }
  } else {
    s->io.buffer = user;
    s->io.length = p.length;
    s->io.fixed_buffer = -1;
  }
  const bool hash_beside = e.writing && e.checksummed && hashed_data(s) != nullptr;
  s->parts = hash_beside ? 2 : 1;
  Backend& b = e.device && !staged ? *device_backend : *host_backend;
  s->backend = &b;
  b.submit(&s->io);
  // The source may not change until the request completes, so the hash sees what is written.
  if (hash_beside) checksum_pool->submit(&Impl::hash_written, s);
}

}  // namespace tidal::io
