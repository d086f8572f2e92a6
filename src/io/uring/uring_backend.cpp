// io_uring backend: the dispatcher thread fills the submission queue, one reaper thread drains
// the completion queue (liburing allows one submitter and one reaper concurrently). Files are
// registered, and so are the staging buffers, so staged ops use READ_FIXED/WRITE_FIXED.
#include <liburing.h>

#include <atomic>
#include <cstring>
#include <thread>

#include "tidal/common/error.hpp"
#include "tidal/io/backend.hpp"

namespace tidal::io {
namespace {

// user_data of the NOP that tells the reaper to stop.
constexpr std::uint64_t kStopToken = ~std::uint64_t{0};

class UringBackend final : public Backend {
 public:
  UringBackend(std::vector<int> fds, unsigned entries,
               const std::vector<std::pair<void*, std::size_t>>& buffers) {
    // One extra entry for the stop NOP.
    const int rc = io_uring_queue_init(entries + 1, &ring_, 0);
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
      // Registration can fail under a low RLIMIT_MEMLOCK on old kernels: then plain ops are used.
      fixed_buffers_ =
          io_uring_register_buffers(&ring_, iov.data(), static_cast<unsigned>(iov.size())) == 0;
    }
    reaper_ = std::thread([this] { reap(); });
  }

  ~UringBackend() override {
    io_uring_sqe* sqe = next_sqe();
    io_uring_prep_nop(sqe);
    io_uring_sqe_set_data64(sqe, kStopToken);
    io_uring_submit(&ring_);
    reaper_.join();
    io_uring_queue_exit(&ring_);
  }

  [[nodiscard]] const char* name() const override { return "io_uring"; }

  void submit(IoOp* op) override {
    io_uring_sqe* sqe = next_sqe();
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
    ++unsubmitted_;
  }

  void flush() override {
    if (unsubmitted_ == 0) return;
    int rc;
    do {
      rc = io_uring_submit(&ring_);
    } while (rc == -EINTR || rc == -EAGAIN);
    unsubmitted_ = 0;
  }

 private:
  io_uring_sqe* next_sqe() {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    while (sqe == nullptr) {  // queue full: push what is queued to the kernel and retry
      io_uring_submit(&ring_);
      unsubmitted_ = 0;
      std::this_thread::yield();
      sqe = io_uring_get_sqe(&ring_);
    }
    return sqe;
  }

  void reap() {
    for (;;) {
      io_uring_cqe* cqe = nullptr;
      const int rc = io_uring_wait_cqe(&ring_, &cqe);
      if (rc == -EINTR) continue;
      if (rc < 0) continue;
      const std::uint64_t data = io_uring_cqe_get_data64(cqe);
      const long res = cqe->res;
      io_uring_cqe_seen(&ring_, cqe);
      if (data == kStopToken) return;
      auto* op = reinterpret_cast<IoOp*>(data);
      op->on_complete(op, res);
    }
  }

  io_uring ring_{};
  std::vector<int> fds_;
  bool fixed_files_ = false;
  bool fixed_buffers_ = false;
  unsigned unsubmitted_ = 0;
  std::thread reaper_;
};

}  // namespace

std::unique_ptr<Backend> make_uring_backend(
    std::vector<int> fds, unsigned entries,
    const std::vector<std::pair<void*, std::size_t>>& buffers) {
  return std::make_unique<UringBackend>(std::move(fds), entries, buffers);
}

bool uring_compiled() { return true; }

}  // namespace tidal::io
