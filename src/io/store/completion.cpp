// A request's ops as they finish: checksums hashed and checked on the checksum pool, the queue
// slot and staging buffer given back, the request's result counted and its waiters woken; and the
// error a failed request reports.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "io/host_copy.hpp"
#include "io/store/store_impl.hpp"
#include "tidal/common/error.hpp"
#include "tidal/common/text.hpp"
#include "tidal/common/units.hpp"

namespace tidal::io {

using detail::copy_in;

const char* TensorStore::Impl::hashed_data(const OpSlot* s) const {
  const Entry& e = *s->entry;
  if (s->staging >= 0) return static_cast<const char*>(s->io.buffer);
  return e.device ? nullptr : e.user + e.pieces[s->piece].tensor_offset;
}

void TensorStore::Impl::hash_written(void* slot) {
  auto* s = static_cast<OpSlot*>(slot);
  Impl* self = s->store;
  Piece& p = s->entry->pieces[s->piece];
  p.checksum = self->hash(self->hashed_data(s), p.length);
  std::lock_guard<std::mutex> lock(self->mu);
  self->finish_part(s, 0, {});
}

void TensorStore::Impl::check_read(void* slot) {
  auto* s = static_cast<OpSlot*>(slot);
  Impl* self = s->store;
  Entry& e = *s->entry;
  const Piece& p = e.pieces[s->piece];
  std::string msg;
  int err = 0;
  bool corrupt = false;
  if (self->hash(self->hashed_data(s), p.length) != p.checksum) {
    err = EIO;
    corrupt = true;
    msg = ::tidal::detail::concat("checksum mismatch in the stripe at tensor byte ",
                                  p.tensor_offset, " (file offset ", p.file_offset, " in '",
                                  self->files[static_cast<std::size_t>(p.file)]->dir,
                                  "'): the data read back is corrupt, so it was not used");
  } else if (s->staging >= 0 &&
             copy_in(e.user + p.tensor_offset, s->io.buffer, p.length, e.device) != 0) {
    err = EIO;
    msg = "copying the staging buffer to device memory failed";
  }
  std::lock_guard<std::mutex> lock(self->mu);
  self->finish_part(s, err, std::move(msg), corrupt);
}

// On a backend's completion thread: frees the op's queue slot at once and hands a read's check
// to the checksum pool, so that the next ops start while this one is verified.
void TensorStore::Impl::on_complete(IoOp* io, long result) {
  auto* s = static_cast<OpSlot*>(io->context);
  Impl* self = s->store;
  Entry& e = *s->entry;
  Piece& p = e.pieces[s->piece];
  const char* what = e.writing ? "write" : "read";
  const std::uint32_t want = s->io.length;
  std::string msg;
  int err = 0;
  if (result < 0) {
    err = static_cast<int>(-result);
    msg = ::tidal::detail::concat(what, " of ", want, " bytes at offset ", p.file_offset, " in '",
                                  self->files[static_cast<std::size_t>(p.file)]->dir,
                                  "' failed: ", std::strerror(err));
    const std::string broken = s->backend != nullptr ? s->backend->broken_reason() : "";
    if (!broken.empty()) {
      msg += ::tidal::detail::concat(
          " (the ", s->backend->name(), " backend stopped working: ", broken,
          self->opt.backend == BackendKind::kIoUring ? "; open the store with the posix backend)"
                                                     : "; later requests use the posix backend)");
    }
  } else if (static_cast<std::uint64_t>(result) < want) {
    err = EIO;
    msg = ::tidal::detail::concat("short ", what, ": ", result, " of ", want, " bytes at offset ",
                                  p.file_offset, " in '",
                                  self->files[static_cast<std::size_t>(p.file)]->dir, "'");
  } else if (!e.writing) {
    if (e.checksummed && self->hashed_data(s) != nullptr) {
      {
        std::lock_guard<std::mutex> lock(self->mu);
        self->release_queue_slot(s);
      }
      // The op's read part goes on: check_read finishes it.
      self->checksum_pool->submit(&Impl::check_read, s);
      return;
    }
    if (s->staging >= 0 &&
        copy_in(e.user + p.tensor_offset, s->io.buffer, p.length, e.device) != 0) {
      err = EIO;
      msg = "copying the staging buffer to device memory failed";
    }
  }
  self->complete(s, err, std::move(msg));
}

void TensorStore::Impl::complete(OpSlot* s, int err, std::string msg, bool corrupt) {
  std::lock_guard<std::mutex> lock(mu);
  release_queue_slot(s);
  finish_part(s, err, std::move(msg), corrupt);
}

void TensorStore::Impl::release_queue_slot(OpSlot* s) {
  --in_flight[static_cast<std::size_t>(s->entry->pieces[s->piece].file)];
  if (--ops_in_flight == 0) {
    counters.busy_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - busy_start).count();
  }
  // The op's queue slot is free: wake the dispatcher only if an op waits for it (an op that
  // waits for a staging buffer is woken when the buffer comes back, in finish_part).
  if (ops_queued()) dispatch_cv.notify_one();
}

void TensorStore::Impl::finish_part(OpSlot* s, int err, std::string msg, bool corrupt) {
  Entry& e = *s->entry;
  if (err != 0 && e.err == 0) {
    e.err = err;
    e.corrupt = corrupt;
    e.err_msg = std::move(msg);
  }
  if (--s->parts > 0) return;
  if (s->staging >= 0) {
    staging_free.push_back(s->staging);
    s->staging = -1;
    if (ops_queued()) dispatch_cv.notify_one();
  }
  if (--e.pending == 0) {
    if (e.err != 0) {
      count_failure(e);
    } else if (e.writing) {
      ++counters.writes;
      counters.bytes_written += e.bytes;
    } else {
      ++counters.reads;
      counters.bytes_read += e.bytes;
    }
    if (e.writing) e.has_data = e.err == 0;
    e.busy = false;
    --busy_entries;
    // Wake only threads that wait for this request (or for the store to go idle): with many
    // requests in flight, waking every waiter on every completion costs context switches that
    // a two-core machine pays for in bandwidth.
    if (e.waiters > 0 || closing) done_cv.notify_all();
  }
}

bool TensorStore::Impl::ops_queued() const {
  return std::any_of(lanes.begin(), lanes.end(), [](const auto& lane) { return !lane.empty(); });
}

// With mu held (through lock): waits until e has no request in flight.
void TensorStore::Impl::wait_idle(std::unique_lock<std::mutex>& lock, Entry& e) {
  if (!e.busy) return;
  ++e.waiters;
  done_cv.wait(lock, [&] { return !e.busy; });
  --e.waiters;
}

namespace {
std::string request_error(const Entry& e) {
  return ::tidal::detail::concat("tensor store ", e.writing ? "write" : "read", " of ",
                                 format_bytes(static_cast<double>(e.bytes)), " (ticket ", e.id,
                                 ") failed: ", e.err_msg);
}
}  // namespace

// With mu held: counts a failed request under its degraded path.
void TensorStore::Impl::count_failure(const Entry& e) {
  ++counters.failed_requests;
  DegradedPath& path = e.writing ? (e.err == ENOSPC ? counters.store_full : counters.write_failed)
                                 : (e.corrupt ? counters.read_corrupt : counters.read_failed);
  if (path.count++ == 0) path.reason = request_error(e);
}

// With mu held: reports (once) the error of the finished request.
void TensorStore::Impl::throw_pending_error(Entry& e) {
  if (e.err == 0) return;
  const int err = e.err;
  std::string msg = request_error(e);
  e.err = 0;
  e.err_msg.clear();
  throw IoError(msg, err);
}

}  // namespace tidal::io
