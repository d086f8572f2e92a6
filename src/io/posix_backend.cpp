// POSIX thread pool backend: the fallback that works everywhere. Each thread takes the oldest
// queued op and runs it with pread/pwrite; the dispatcher already orders ops by priority and
// bounds how many are queued, so a FIFO here keeps that order.
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "tidal/common/error.hpp"
#include "tidal/io/backend.hpp"

namespace tidal::io {
namespace {

long transfer(int fd, const IoOp& op) {
  std::uint64_t done = 0;
  auto* p = static_cast<char*>(op.buffer);
  while (done < op.length) {
    const auto off = static_cast<off_t>(op.offset + done);
    const ssize_t n = op.write ? ::pwrite(fd, p + done, op.length - done, off)
                               : ::pread(fd, p + done, op.length - done, off);
    if (n < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    if (n == 0) break;  // end of file: reported as a short transfer
    done += static_cast<std::uint64_t>(n);
  }
  return static_cast<long>(done);
}

class PosixBackend final : public Backend {
 public:
  PosixBackend(std::vector<int> fds, int threads) : fds_(std::move(fds)) {
    TIDAL_EXPECT(threads > 0, "posix backend needs at least one thread");
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { run(); });
  }

  ~PosixBackend() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

  [[nodiscard]] const char* name() const override { return "posix"; }

  void submit(IoOp* op) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(op);
    }
    cv_.notify_one();
  }

 private:
  void run() {
    for (;;) {
      IoOp* op = nullptr;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stop_ and drained
        op = queue_.front();
        queue_.pop_front();
      }
      op->on_complete(op, transfer(fds_[static_cast<std::size_t>(op->file)], *op));
    }
  }

  std::vector<int> fds_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<IoOp*> queue_;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace

std::unique_ptr<Backend> make_posix_backend(std::vector<int> fds, int threads) {
  return std::make_unique<PosixBackend>(std::move(fds), threads);
}

}  // namespace tidal::io
