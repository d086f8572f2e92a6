// Progress of long work on stderr, one form for every command: on a terminal one line redrawn in
// place; elsewhere (a log, CI) either nothing or a line per update, as the command asks.
#pragma once

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <utility>

namespace tidal::cli {

class Progress {
 public:
  enum class Style {
    kPercent,  ///< "label  42%", erased when done; nothing off a terminal (bench-io, planning)
    kBar,      ///< "[#####...] 3/10 text", kept; a line per update off a terminal (steps)
  };

  Progress(std::string label, std::int64_t total, Style style)
      : label_(std::move(label)), total_(total), style_(style), tty_(isatty(STDERR_FILENO) != 0) {}

  /// `done` units of `total`; `text` follows the bar (kBar only).
  void update(std::int64_t done, const std::string& text = "") {
    if (style_ == Style::kPercent) {
      percent(done);
    } else {
      bar(done, text);
    }
  }

 private:
  void percent(std::int64_t done) {
    if (!tty_) return;
    const auto pct = static_cast<int>(100 * done / (total_ > 0 ? total_ : 1));
    if (pct == last_) return;
    last_ = pct;
    std::fprintf(stderr, "\r  %s %3d%%", label_.c_str(), pct);
    if (done >= total_) std::fprintf(stderr, "\r%*s\r", static_cast<int>(label_.size()) + 8, "");
    std::fflush(stderr);
  }
  void bar(std::int64_t done, const std::string& text) {
    constexpr int kWidth = 24;
    const int filled = total_ > 0 ? static_cast<int>(kWidth * done / total_) : kWidth;
    std::string cells(static_cast<std::size_t>(filled), '#');
    cells.resize(kWidth, '.');
    std::fprintf(stderr, "%s[%s] %lld/%lld %s%s", tty_ ? "\r" : "", cells.c_str(),
                 static_cast<long long>(done), static_cast<long long>(total_), text.c_str(),
                 tty_ ? "\x1b[K" : "\n");
    if (tty_ && done == total_) std::fputc('\n', stderr);
    std::fflush(stderr);
  }

  std::string label_;
  std::int64_t total_;
  Style style_;
  bool tty_;
  int last_ = -1;
};

/// A progress callback for a stage that reports the fraction done (PlannerOptions::progress,
/// stall_lower_bound's), labelled `label`.
inline std::function<void(double)> fraction_progress(const char* label) {
  return [p = std::make_shared<Progress>(label, 1000, Progress::Style::kPercent)](double f) {
    p->update(static_cast<std::int64_t>(f * 1000));
  };
}

/// A planner progress callback (PlannerOptions::progress takes the fraction done).
inline std::function<void(double)> planning_progress() { return fraction_progress("planning"); }

namespace detail {
inline char interrupt_message[160];
inline std::size_t interrupt_length = 0;
inline void on_interrupt(int /*signal*/) {
  // Only async-signal-safe calls here: write(2) and _exit(2).
  ssize_t ignored = ::write(STDERR_FILENO, interrupt_message, interrupt_length);
  (void)ignored;
  ::_exit(130);  // 128 + SIGINT, as a shell reports a process that SIGINT ended
}
}  // namespace detail

/// Ctrl-C (SIGINT) ends the command at once with "tidal <command>: interrupted" on stderr and
/// exit status 130, wherever it is: a large plan spends minutes in loops that call no progress
/// callback for long. For commands whose only output is written at the end (plan, simulate; a
/// plan file goes through AtomicFile, whose leftover the next writer removes). Installed over
/// SIG_IGN too (a shell starts background jobs with SIGINT ignored), so `kill -INT` reaches it.
inline void stop_on_interrupt(const char* command) {
  const int n =
      std::snprintf(detail::interrupt_message, sizeof detail::interrupt_message,
                    "\ntidal %s: interrupted (SIGINT); nothing more was written\n", command);
  detail::interrupt_length =
      n > 0 ? std::min(static_cast<std::size_t>(n), sizeof detail::interrupt_message - 1) : 0;
  struct sigaction sa {};
  sa.sa_handler = detail::on_interrupt;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGINT, &sa, nullptr);
}

}  // namespace tidal::cli
