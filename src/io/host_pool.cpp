#include "tidal/io/host_pool.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "io/host_copy.hpp"
#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"
#include "tidal/io/extent_allocator.hpp"

namespace tidal::io {
namespace {

using Clock = std::chrono::steady_clock;

// The host pool is page-locked as its use grows, this much at a time.
constexpr std::uint64_t kPinStep = 64ull << 20;

}  // namespace

struct HostPool::Impl {
  // One tensor's bytes in the pool.
  struct Entry {
    Extent extent;
    std::uint64_t bytes = 0;
    bool in_flight = false;  // a copy is queued or running
    bool writing = false;    // the request in flight (or last) is a write
    Priority priority = Priority::kOffload;
    char* user = nullptr;  // the caller's buffer of the request
    bool device = false;
    int err = 0;  // of the last request, reported once by wait()
    std::string err_msg;
  };

  std::uint64_t capacity = 0;
  char* base = nullptr;
  // Page-locked (CUDA) from base up to pinned_end, in regions pinned as the pool's use grew
  // (kPinStep at a time): a large default pool costs nothing until it is used.
  bool pin = false;  // a CUDA device is there: pin as the pool grows
  std::uint64_t pinned_end = 0;
  std::vector<char*> pinned_regions;
  std::string pin_failure;  // why pinning stopped, once it did

  mutable std::mutex mu;
  std::condition_variable work_cv;  // the copy thread waits for requests
  std::condition_variable done_cv;  // callers wait for completions
  ExtentAllocator extents{0};
  std::unordered_map<std::uint64_t, Entry> entries;
  std::deque<std::uint64_t> queue;  // ticket ids with a request waiting for the copy thread
  std::uint64_t next_id = 1;
  bool stop = false;
  HostPoolStats counters;
  std::thread worker;

  Entry& find(Ticket t) {
    auto it = entries.find(t.id);
    TIDAL_EXPECT(it != entries.end(), "unknown host pool ticket ", t.id);
    return it->second;
  }
  const Entry& find(Ticket t) const {
    auto it = entries.find(t.id);
    TIDAL_EXPECT(it != entries.end(), "unknown host pool ticket ", t.id);
    return it->second;
  }

  // The queued request to run next: the highest priority, the oldest among equals.
  std::deque<std::uint64_t>::iterator pick() {
    auto best = queue.end();
    for (auto it = queue.begin(); it != queue.end(); ++it) {
      if (best == queue.end() || entries.at(*it).priority > entries.at(*best).priority) best = it;
    }
    return best;
  }

  void run() {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      work_cv.wait(lock, [&] { return stop || !queue.empty(); });
      if (queue.empty()) return;  // stop, nothing left
      auto it = pick();
      const std::uint64_t id = *it;
      queue.erase(it);
      Entry& e = entries.at(id);
      char* pool = base + e.extent.offset;
      char* user = e.user;
      const std::uint64_t n = e.bytes;
      const bool writing = e.writing;
      const bool device = e.device;
      lock.unlock();
      const auto t0 = Clock::now();
      const int rc = writing ? detail::copy_out(pool, user, n, device)
                             : detail::copy_in(user, pool, n, device);
      const double took = std::chrono::duration<double>(Clock::now() - t0).count();
      lock.lock();
      counters.busy_seconds += took;
      Entry& done = entries.at(id);  // entries only leave when not in flight
      done.in_flight = false;
      if (rc != 0) {
        done.err = EIO;
        done.err_msg = writing ? "copying a tensor into the host pool failed"
                               : "copying a tensor out of the host pool failed";
      } else if (writing) {
        counters.bytes_written += n;
        ++counters.writes;
      } else {
        counters.bytes_read += n;
        ++counters.reads;
      }
      done_cv.notify_all();
    }
  }

  // Reports (once) the error of the entry's last request.
  static void throw_pending(Entry& e) {
    if (e.err == 0) return;
    const int err = e.err;
    const std::string msg = std::move(e.err_msg);
    e.err = 0;
    TIDAL_FAIL_IO(err, msg);
  }

  // Pins the pool up to `end` (a new extent's end), a kPinStep at a time. A refusal (the
  // memlock limit, a failed registration) stops pinning for good: the rest stays pageable and
  // copies from it are slower, said once in stats().pin_failure.
  void grow_pinned(std::uint64_t end) {
#ifdef TIDAL_WITH_CUDA
    if (!pin || end <= pinned_end) return;
    const std::uint64_t to = std::min(capacity, (end + kPinStep - 1) / kPinStep * kPinStep);
    if (detail::cuda::pin_host_memory(base + pinned_end, to - pinned_end) != 0) {
      pin = false;
      pin_failure = ::tidal::detail::concat(
          "pinning ", format_bytes(static_cast<double>(to - pinned_end)),
          " more of the host pool failed (", detail::cuda::last_error(),
          "): the rest of it is pageable, and copies between it and the GPU are slower; raise "
          "the memlock limit (ulimit -l) or give a smaller host memory size");
      counters.pin_failure = pin_failure;
      return;
    }
    pinned_regions.push_back(base + pinned_end);
    pinned_end = to;
    counters.pinned_bytes = pinned_end;
    counters.pinned = true;
#else
    (void)end;
#endif
  }

  void wait_locked(std::unique_lock<std::mutex>& lock, std::uint64_t id) {
    done_cv.wait(lock, [&] { return !entries.at(id).in_flight; });
  }
};

HostPool::HostPool(std::uint64_t capacity) : impl_(std::make_unique<Impl>()) {
  TIDAL_EXPECT_AS(InvalidArgument, capacity > 0,
                  "the host pool needs a capacity above 0 B; give the host memory tensors may "
                  "use, or no host pool at all");
  const std::uint64_t rounded = (capacity + kBlockSize - 1) / kBlockSize * kBlockSize;
  void* p = mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    TIDAL_FAIL_IO(errno, "cannot reserve ", format_bytes(static_cast<double>(rounded)),
                  " of host memory for the host pool; give a smaller host memory size");
  }
  impl_->base = static_cast<char*>(p);
  impl_->capacity = rounded;
  impl_->extents = ExtentAllocator(rounded);
  impl_->counters.capacity = rounded;
#ifdef TIDAL_WITH_CUDA
  impl_->pin = detail::cuda::device_available();
#endif
  impl_->worker = std::thread([this] { impl_->run(); });
}

HostPool::~HostPool() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stop = true;
  }
  impl_->work_cv.notify_all();
  impl_->worker.join();
#ifdef TIDAL_WITH_CUDA
  for (char* region : impl_->pinned_regions) detail::cuda::unpin_host_memory(region);
#endif
  munmap(impl_->base, impl_->capacity);
}

Ticket HostPool::write(const void* src, std::uint64_t bytes, Priority priority) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& m = *impl_;
  const std::uint64_t id = m.next_id++;
  Impl::Entry& e = m.entries[id];
  e.bytes = bytes;
  e.writing = true;
  if (bytes == 0) return Ticket{id};
  const auto extent = m.extents.allocate(bytes);
  if (!extent) {
    ++m.counters.full;
    e.err = ENOSPC;
    e.err_msg = ::tidal::detail::concat(
        "the host pool is full: the tensor needs ", format_bytes(static_cast<double>(bytes)),
        " but only ", format_bytes(static_cast<double>(m.extents.free_bytes())), " of ",
        format_bytes(static_cast<double>(m.capacity)),
        " is free; give more host memory, or let the SSD store take it");
    return Ticket{id};
  }
  e.extent = *extent;
  m.grow_pinned(extent->offset + extent->length);
  e.user = const_cast<char*>(static_cast<const char*>(src));
  e.device = detail::is_device_memory(src);
  e.priority = priority;
  e.in_flight = true;
  m.counters.used_bytes = m.extents.used_bytes();
  m.counters.peak_used_bytes = std::max(m.counters.peak_used_bytes, m.counters.used_bytes);
  m.queue.push_back(id);
  m.work_cv.notify_one();
  return Ticket{id};
}

void HostPool::read(Ticket ticket, void* dst, Priority priority) {
  std::unique_lock<std::mutex> lock(impl_->mu);
  Impl& m = *impl_;
  Impl::Entry* e = &m.find(ticket);
  if (e->in_flight) {
    m.wait_locked(lock, ticket.id);
    e = &m.find(ticket);
  }
  Impl::throw_pending(*e);
  TIDAL_EXPECT(e->extent.length > 0 || e->bytes == 0, "host pool ticket ", ticket.id,
               " holds no bytes (its write failed)");
  e->writing = false;
  if (e->bytes == 0) return;
  e->user = static_cast<char*>(dst);
  e->device = detail::is_device_memory(dst);
  e->priority = priority;
  e->in_flight = true;
  m.queue.push_back(ticket.id);
  m.work_cv.notify_one();
}

bool HostPool::ready(Ticket ticket) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return !impl_->find(ticket).in_flight;
}

void HostPool::wait(Ticket ticket) {
  std::unique_lock<std::mutex> lock(impl_->mu);
  impl_->find(ticket);
  impl_->wait_locked(lock, ticket.id);
  Impl::Entry& e = impl_->find(ticket);
  Impl::throw_pending(e);
}

void HostPool::prioritize(Ticket ticket, Priority priority) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl::Entry& e = impl_->find(ticket);
  e.priority = std::max(e.priority, priority);
}

void HostPool::free(Ticket ticket) {
  std::unique_lock<std::mutex> lock(impl_->mu);
  impl_->find(ticket);
  impl_->wait_locked(lock, ticket.id);
  Impl::Entry& e = impl_->find(ticket);
  if (e.extent.length > 0) impl_->extents.free(e.extent);
  impl_->entries.erase(ticket.id);
  impl_->counters.used_bytes = impl_->extents.used_bytes();
}

bool HostPool::cancel_write(Ticket ticket) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& m = *impl_;
  Impl::Entry& e = m.find(ticket);
  if (!e.in_flight || !e.writing) return false;
  auto it = std::find(m.queue.begin(), m.queue.end(), ticket.id);
  if (it == m.queue.end()) return false;  // the copy thread has it
  m.queue.erase(it);
  m.extents.free(e.extent);
  m.entries.erase(ticket.id);
  m.counters.used_bytes = m.extents.used_bytes();
  m.done_cv.notify_all();
  return true;
}

std::uint64_t HostPool::free_bytes() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->extents.free_bytes();
}

std::optional<std::pair<Ticket, void*>> HostPool::reserve(std::uint64_t bytes) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& m = *impl_;
  const auto extent = bytes == 0 ? std::optional<Extent>(Extent{}) : m.extents.allocate(bytes);
  if (!extent) return std::nullopt;
  m.grow_pinned(extent->offset + extent->length);
  const std::uint64_t id = m.next_id++;
  Impl::Entry& e = m.entries[id];
  e.bytes = bytes;
  e.writing = true;
  e.extent = *extent;
  m.counters.used_bytes = m.extents.used_bytes();
  m.counters.peak_used_bytes = std::max(m.counters.peak_used_bytes, m.counters.used_bytes);
  return std::make_pair(Ticket{id}, static_cast<void*>(m.base + e.extent.offset));
}

std::uint64_t HostPool::size(Ticket ticket) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->find(ticket).bytes;
}

HostPoolStats HostPool::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  HostPoolStats s = impl_->counters;
  s.tickets = impl_->entries.size();
  return s;
}

}  // namespace tidal::io
