// Internal: the threads that hash the store's stripes beside the I/O. A write's stripes are
// hashed while they are being written (the source may not change until the request completes),
// and a read's stripes are checked while later stripes are still being read, so the checksum
// adds CPU time on other cores, not time on the I/O path. The backend's completion thread only
// hands work over: it never hashes, so it frees queue slots as soon as the disk is done.
#pragma once

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "tidal/common/error.hpp"

namespace tidal::io::detail {

class ChecksumPool {
 public:
  /// A job: fn(arg), run once on one of the pool's threads.
  using Fn = void (*)(void* arg);

  explicit ChecksumPool(int threads) {
    TIDAL_EXPECT(threads > 0, "a checksum pool needs at least one thread");
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { run(); });
  }

  /// Runs the jobs still queued, then joins the threads.
  ~ChecksumPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

  ChecksumPool(const ChecksumPool&) = delete;
  ChecksumPool& operator=(const ChecksumPool&) = delete;

  /// Queues fn(arg). Thread-safe; never blocks on a job.
  void submit(Fn fn, void* arg) {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(Job{fn, arg});
    // Wake a thread only when none is idle-awake to take it (all busy or all asleep). Notified
    // under the lock: the job may finish the last request at once, and the store then destroys
    // the pool; a notify after the unlock would touch a destroyed condition variable (TSan).
    if (idle_ > 0) cv_.notify_one();
  }

  [[nodiscard]] int threads() const { return static_cast<int>(workers_.size()); }

 private:
  struct Job {
    Fn fn;
    void* arg;
  };

  void run() {
    for (;;) {
      Job job{};
      {
        std::unique_lock<std::mutex> lock(mu_);
        ++idle_;
        cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
        --idle_;
        if (queue_.empty()) return;  // stopping, and nothing left
        job = queue_.front();
        queue_.pop_front();
      }
      job.fn(job.arg);
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> queue_;
  int idle_ = 0;  // threads waiting on cv_
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace tidal::io::detail
