// What the executor and the activation offloader tell the timeline (plan::Timeline) about their
// transfers and stalls, for either of them, with or without a timeline kept.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "tidal/plan/timeline.hpp"

namespace tidal::torch_layer::timeline_glue {

using Clock = std::chrono::steady_clock;

/// Seconds from `t0` to now.
inline double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

/// A transfer's handle when none was recorded (no timeline kept).
inline constexpr std::size_t kNotRecorded = static_cast<std::size_t>(-1);

/// Starts a transfer of `bytes` on `channel` in `tl` (nullptr: none kept, and `label` is not
/// called). `due`: the op of this step that needs it, or -1. Returns its handle.
template <typename LabelFn>
std::size_t transfer_start(plan::Timeline* tl, plan::Channel channel, plan::TransferKind kind,
                           LabelFn label, std::uint64_t bytes, std::int64_t due) {
  if (tl == nullptr) return kNotRecorded;
  return tl->transfer_start(channel, kind, label(), bytes, due);
}

/// Ends the transfer `handle` (kNotRecorded: nothing to end) and forgets it.
inline void transfer_end(plan::Timeline* tl, std::size_t& handle, bool failed) {
  if (tl == nullptr || handle == kNotRecorded) return;
  tl->transfer_end(handle, failed);
  handle = kNotRecorded;
}

/// A stall from `t0` to now, on `channel`, waiting for the tensor `label()` names.
template <typename LabelFn>
void stall_since(plan::Timeline* tl, plan::StallKind kind, plan::Channel channel, LabelFn label,
                 Clock::time_point t0) {
  if (tl == nullptr) return;
  const double end = tl->now();
  tl->stall(kind, channel, label(), end - since(t0), end);
}

}  // namespace tidal::torch_layer::timeline_glue
