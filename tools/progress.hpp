// Progress of long work on stderr, one form for every command: on a terminal one line redrawn in
// place; elsewhere (a log, CI) either nothing or a line per update, as the command asks.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
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

/// A planner progress callback (PlannerOptions::progress takes the fraction done).
inline auto planning_progress() {
  return [p = std::make_shared<Progress>("planning", 1000, Progress::Style::kPercent)](double f) {
    p->update(static_cast<std::int64_t>(f * 1000));
  };
}

}  // namespace tidal::cli
