// io_uring backend: the dispatcher thread fills the submission queue, one reaper thread drains
// the completion queue (liburing allows one submitter and one reaper concurrently). Files are
// registered, and so are the staging buffers, so staged ops use READ_FIXED/WRITE_FIXED.
//
// Every op is accounted for until its callback ran: prepared (in the submission queue, not yet
// taken by the kernel) or in the kernel. When the ring stops working (io_uring_submit or
// io_uring_wait_cqe fails for good) the backend is broken: the ops it can no longer complete
// fail with the kernel's error, every later op fails at once, and broken_reason() says why, so
// that the store can move to the POSIX backend.
#include "io/uring/uring_backend.hpp"

#include <liburing.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_set>

#include "tidal/common/error.hpp"
#include "tidal/io/backend.hpp"

namespace tidal::io {
namespace detail {
namespace {

// user_data of the NOP that tells the reaper to stop, and of entries turned into NOPs because
// their ops were failed before the kernel took them.
constexpr std::uint64_t kStopToken = ~std::uint64_t{0};
constexpr std::uint64_t kIgnoreToken = ~std::uint64_t{0} - 1;
// EAGAIN and EBUSY (the kernel is short of memory, or completions are backed up) are retried
// this many times, a millisecond apart, before the ring counts as broken.
constexpr int kBusyRetries = 200;
// With IORING_FEAT_EXT_ARG the reaper wakes this often to notice a stop it was not woken for
// (when the ring refuses even the stop NOP).
constexpr long kReaperTickNs = 100'000'000;

int default_queue_init(unsigned entries, io_uring* ring, unsigned flags) {
  return io_uring_queue_init(entries, ring, flags);
}
int default_submit(io_uring* ring) { return io_uring_submit(ring); }
int default_wait(io_uring* ring, io_uring_cqe** cqe, __kernel_timespec* ts) {
  return ts != nullptr ? io_uring_wait_cqe_timeout(ring, cqe, ts) : io_uring_wait_cqe(ring, cqe);
}

UringCalls with_defaults(UringCalls c) {
  if (c.queue_init == nullptr) c.queue_init = &default_queue_init;
  if (c.submit == nullptr) c.submit = &default_submit;
  if (c.wait == nullptr) c.wait = &default_wait;
  return c;
}

UringCalls& global_calls() {
  static UringCalls calls;
  return calls;
}

class UringBackend final : public Backend {
 public:
  UringBackend(std::vector<int> fds, unsigned entries,
               const std::vector<std::pair<void*, std::size_t>>& buffers, UringCalls calls)
      : calls_(with_defaults(calls)) {
    // One extra entry for the stop NOP.
    const int rc = calls_.queue_init(entries + 1, &ring_, 0);
    if (rc < 0) {
      TIDAL_FAIL_IO(-rc, "io_uring_queue_init failed: ", std::strerror(-rc),
                    " (io_uring disabled or unsupported here; use TIDAL_IO_BACKEND=posix)");
    }
    if (io_uring_register_files(&ring_, fds.data(), static_cast<unsigned>(fds.size())) == 0) {
      fixed_files_ = true;
    }
    fds_ = std::move(fds);
    if (!buffers.empty()) {
      std::vector<iovec> iov;
      iov.reserve(buffers.size());
      for (const auto& [p, n] : buffers) iov.push_back(iovec{p, n});
      // All or none: the kernel registers the whole table or nothing. It can fail under a low
      // RLIMIT_MEMLOCK on old kernels: then plain ops are used.
      fixed_buffers_ =
          io_uring_register_buffers(&ring_, iov.data(), static_cast<unsigned>(iov.size())) == 0;
    }
    timed_wait_ = (ring_.features & IORING_FEAT_EXT_ARG) != 0;
    reaper_ = std::thread([this] { reap(); });
  }

  ~UringBackend() override {
    stopping_.store(true);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (io_uring_sqe* sqe = io_uring_get_sqe(&ring_)) {
        io_uring_prep_nop(sqe);
        io_uring_sqe_set_data64(sqe, kStopToken);
        int rc;
        do {
          rc = calls_.submit(&ring_);
        } while (rc == -EINTR);
      }
    }
    reaper_.join();
    io_uring_queue_exit(&ring_);
  }

  [[nodiscard]] const char* name() const override { return "io_uring"; }

  [[nodiscard]] std::string broken_reason() const override {
    if (!broken_flag_.load(std::memory_order_acquire)) return {};
    std::lock_guard<std::mutex> lock(mu_);
    return reason_;
  }

  void submit(IoOp* op) override {
    std::vector<IoOp*> failed;
    int err = 0;
    {
      std::unique_lock<std::mutex> lock(mu_);
      io_uring_sqe* sqe = broken_ ? nullptr : io_uring_get_sqe(&ring_);
      while (sqe == nullptr && !broken_) {
        // Queue full: push what is queued to the kernel and retry.
        submit_locked(lock, failed);
        sqe = broken_ ? nullptr : io_uring_get_sqe(&ring_);
        if (sqe == nullptr && !broken_) {
          lock.unlock();
          std::this_thread::yield();
          lock.lock();
        }
      }
      if (broken_) {
        failed.push_back(op);
      } else {
        prepare(sqe, op);
        pending_.push_back(Prepared{sqe, op});
      }
      err = errno_;  // read under the lock: the reaper may break the ring meanwhile
    }
    fail_all(failed, err);
  }

  void flush() override {
    std::vector<IoOp*> failed;
    int err = 0;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (pending_.empty()) return;
      submit_locked(lock, failed);
      err = errno_;
    }
    fail_all(failed, err);
  }

 private:
  struct Prepared {
    io_uring_sqe* sqe;
    IoOp* op;
  };

  void prepare(io_uring_sqe* sqe, IoOp* op) const {
    const int fd = fixed_files_ ? op->file : fds_[static_cast<std::size_t>(op->file)];
    const bool fixed_buf = fixed_buffers_ && op->fixed_buffer >= 0;
    if (op->write) {
      if (fixed_buf) {
        io_uring_prep_write_fixed(sqe, fd, op->buffer, op->length, op->offset, op->fixed_buffer);
      } else {
        io_uring_prep_write(sqe, fd, op->buffer, op->length, op->offset);
      }
    } else {
      if (fixed_buf) {
        io_uring_prep_read_fixed(sqe, fd, op->buffer, op->length, op->offset, op->fixed_buffer);
      } else {
        io_uring_prep_read(sqe, fd, op->buffer, op->length, op->offset);
      }
    }
    if (fixed_files_) sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data(sqe, op);
  }

  // With mu_ held (released while backing off): hands the prepared entries to the kernel. The
  // kernel takes them in order, so the first rc prepared ops are now in the kernel. A lasting
  // error breaks the ring; the ops it did not take are appended to `failed`.
  void submit_locked(std::unique_lock<std::mutex>& lock, std::vector<IoOp*>& failed) {
    int busy = 0;
    while (!pending_.empty() && !broken_) {
      const int rc = calls_.submit(&ring_);
      if (rc > 0) {
        busy = 0;
        const auto taken = std::min(static_cast<std::size_t>(rc), pending_.size());
        for (std::size_t i = 0; i < taken; ++i) in_kernel_.insert(pending_[i].op);
        pending_.erase(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(taken));
        continue;
      }
      if (rc == -EINTR) continue;
      const int err = rc == 0 ? EAGAIN : -rc;  // took nothing without saying why: try again
      if ((err == EAGAIN || err == EBUSY) && ++busy <= kBusyRetries) {
        lock.unlock();  // the reaper may need the lock to drain completions
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        lock.lock();
        continue;
      }
      break_locked(err, ::tidal::detail::concat("io_uring_submit failed: ", std::strerror(err)),
                   failed);
    }
  }

  // With mu_ held: marks the ring broken and fails the ops it has not handed to the kernel
  // (their entries become NOPs, in case the ring ever submits again, e.g. the stop NOP).
  void break_locked(int err, std::string reason, std::vector<IoOp*>& failed) {
    if (!broken_) {
      broken_ = true;
      errno_ = err;
      reason_ = std::move(reason);
      broken_flag_.store(true, std::memory_order_release);
    }
    for (const Prepared& p : pending_) {
      io_uring_prep_nop(p.sqe);
      io_uring_sqe_set_data64(p.sqe, kIgnoreToken);
      failed.push_back(p.op);
    }
    pending_.clear();
  }

  static void fail_all(const std::vector<IoOp*>& ops, int err) {
    for (IoOp* op : ops) op->on_complete(op, -err);
  }

  void reap() {
    int busy = 0;
    std::vector<std::pair<IoOp*, long>> done;
    for (;;) {
      io_uring_cqe* cqe = nullptr;
      __kernel_timespec tick{0, kReaperTickNs};
      const int rc = calls_.wait(&ring_, &cqe, timed_wait_ ? &tick : nullptr);
      if (rc == -EINTR || rc == -ETIME || (rc == 0 && cqe == nullptr)) {
        if (finished()) return;
        continue;
      }
      if (rc < 0) {
        const int err = -rc;
        if ((err == EAGAIN || err == EBUSY) && ++busy <= kBusyRetries) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
          continue;
        }
        // The ring cannot tell us about the ops in the kernel any more: fail them (they may
        // still run; their requests are reported failed, so their data is not trusted), and
        // stop reaping.
        std::vector<IoOp*> failed;
        {
          std::lock_guard<std::mutex> lock(mu_);
          break_locked(err,
                       ::tidal::detail::concat("io_uring_wait_cqe failed: ", std::strerror(err)),
                       failed);
          failed.insert(failed.end(), in_kernel_.begin(), in_kernel_.end());
          in_kernel_.clear();
        }
        fail_all(failed, err);
        return;
      }
      busy = 0;
      // Take every completion that is there, with one lock for the lot.
      io_uring_cqe* batch[64];
      unsigned n = io_uring_peek_batch_cqe(&ring_, batch, 64);
      if (n == 0) {  // a wait hook may hand back a completion peek does not see
        batch[0] = cqe;
        n = 1;
      }
      done.clear();
      {
        std::lock_guard<std::mutex> lock(mu_);
        for (unsigned i = 0; i < n; ++i) {
          const std::uint64_t data = io_uring_cqe_get_data64(batch[i]);
          if (data == kStopToken || data == kIgnoreToken) continue;
          // The user data is the IoOp* this backend gave with the request.
          auto* op = reinterpret_cast<IoOp*>(data);  // NOLINT(performance-no-int-to-ptr)
          // Absent when the op was already failed (the ring broke while it ran).
          if (in_kernel_.erase(op) != 0) done.emplace_back(op, batch[i]->res);
        }
      }
      io_uring_cq_advance(&ring_, n);
      for (auto [op, res] : done) op->on_complete(op, res);
      if (finished()) return;
    }
  }

  // True when stopping and nothing is left in the kernel.
  bool finished() {
    if (!stopping_.load()) return false;
    std::lock_guard<std::mutex> lock(mu_);
    return in_kernel_.empty();
  }

  UringCalls calls_;
  io_uring ring_{};
  std::vector<int> fds_;
  bool fixed_files_ = false;
  bool fixed_buffers_ = false;
  bool timed_wait_ = false;

  mutable std::mutex mu_;  // guards what follows, and the submission queue
  std::deque<Prepared> pending_;
  std::unordered_set<IoOp*> in_kernel_;
  bool broken_ = false;
  int errno_ = 0;
  std::string reason_;
  std::atomic<bool> broken_flag_{false};
  std::atomic<bool> stopping_{false};
  std::thread reaper_;
};

}  // namespace

UringCalls uring_default_calls() { return with_defaults({}); }

std::unique_ptr<Backend> make_uring_backend_with(
    std::vector<int> fds, unsigned entries,
    const std::vector<std::pair<void*, std::size_t>>& buffers, UringCalls calls) {
  return std::make_unique<UringBackend>(std::move(fds), entries, buffers, calls);
}

UringCalls set_uring_calls_for_testing(UringCalls calls) {
  const UringCalls previous = global_calls();
  global_calls() = calls;
  return previous;
}

}  // namespace detail

std::unique_ptr<Backend> make_uring_backend(
    std::vector<int> fds, unsigned entries,
    const std::vector<std::pair<void*, std::size_t>>& buffers) {
  return detail::make_uring_backend_with(std::move(fds), entries, buffers, detail::global_calls());
}

bool uring_compiled() { return true; }

}  // namespace tidal::io
