// Internal: a pool of threads that run IoOps one at a time with a blocking call (pread/pwrite,
// cuFileRead/cuFileWrite) and report each through its on_complete. Shared by the POSIX and
// cuFile backends. The dispatcher orders ops by priority and bounds how many are queued, so a
// FIFO here keeps that order.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "tidal/common/error.hpp"
#include "tidal/io/backend.hpp"

namespace tidal::io::detail {

class OpPool {
 public:
  /// `execute` moves one op and returns the bytes moved or -errno; it runs on the pool's threads.
  OpPool(int threads, std::function<long(IoOp&)> execute) : execute_(std::move(execute)) {
    TIDAL_EXPECT(threads > 0, "an I/O thread pool needs at least one thread");
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { run(); });
  }

  /// Drains the queue, then joins the threads.
  ~OpPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

  OpPool(const OpPool&) = delete;
  OpPool& operator=(const OpPool&) = delete;

  void submit(IoOp* op) {
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
        if (queue_.empty()) return;  // stopping, and nothing left
        op = queue_.front();
        queue_.pop_front();
      }
      op->on_complete(op, execute_(*op));
    }
  }

  std::function<long(IoOp&)> execute_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<IoOp*> queue_;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace tidal::io::detail
