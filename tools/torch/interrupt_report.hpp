// What `tidal train` says when a signal ends it during a run.
#pragma once

#include <unistd.h>

#include <array>
#include <atomic>
#include <csignal>
#include <cstring>
#include <string>

namespace tidal::cli {

// SIGINT and SIGTERM during a run: the process says what was saved and what was not, then
// dies of the signal as it would have (exit status 128 + signal). The message is written before
// each step (a signal handler may only write), in one of two buffers, published atomically.
class InterruptReport {
 public:
  InterruptReport() {
    struct sigaction sa {};
    sa.sa_handler = &InterruptReport::handle;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESETHAND;  // a second signal ends the process at once
    for (int sig : {SIGINT, SIGTERM}) ::sigaction(sig, &sa, &saved_[sig == SIGINT ? 0 : 1]);
  }
  ~InterruptReport() {
    ::sigaction(SIGINT, &saved_[0], nullptr);
    ::sigaction(SIGTERM, &saved_[1], nullptr);
    current_.store(-1);
  }
  InterruptReport(const InterruptReport&) = delete;
  InterruptReport& operator=(const InterruptReport&) = delete;

  // Before step `step` (1-based) of `steps`; `saved_step` 0 when no checkpoint is written yet.
  void before_step(std::int64_t step, std::int64_t steps, std::int64_t saved_step,
                   const std::string& checkpoint_dir) {
    const int next = current_.load() == 0 ? 1 : 0;
    std::string text = "\ntidal train: interrupted during step " + std::to_string(step) + " of " +
                       std::to_string(steps) + ": ";
    if (checkpoint_dir.empty()) {
      text += "nothing was saved (--checkpoint DIR saves the run to resume it).\n";
    } else if (saved_step == 0) {
      text +=
          "no checkpoint was written yet to '" + checkpoint_dir + "'; the steps so far are lost.\n";
    } else {
      text += "the last checkpoint is after step " + std::to_string(saved_step) + ", in '" +
              checkpoint_dir + "' (continue with --resume " + checkpoint_dir +
              "); the steps after it are lost, and a checkpoint being written is abandoned.\n";
    }
    auto& buf = buffers_[next];
    const std::size_t n = std::min(text.size(), buf.size());
    std::memcpy(buf.data(), text.data(), n);
    lengths_[next] = n;
    current_.store(next);
  }

 private:
  static void handle(int sig) {
    const int i = current_.load();
    if (i >= 0) {
      ssize_t ignored = ::write(STDERR_FILENO, buffers_[i].data(), lengths_[i]);
      (void)ignored;
    }
    ::raise(sig);  // SA_RESETHAND put the default action back: die of the signal
  }

  static inline std::array<std::array<char, 1024>, 2> buffers_{};
  static inline std::array<std::size_t, 2> lengths_{};
  static inline std::atomic<int> current_{-1};
  struct sigaction saved_[2]{};
};

}  // namespace tidal::cli
