// Internal to plan/timeline/: what the timeline's files share (the recorder, the time report and
// its limit sentence, the Chrome trace, the SVG). Torch-free.
#pragma once

#include <array>
#include <string>

#include "tidal/plan/timeline.hpp"

namespace tidal::plan::detail {

// A transfer's end for drawing and sums: its end, or the step's end while it was still running.
inline double end_in(const TimelineTransfer& t, const TimelineStep& s) {
  return t.end >= 0 ? t.end : (s.end >= 0 ? s.end : t.start);
}

// The sentence: what limits this run and what would help. `r`: the report, averaged per step;
// `busy`: the seconds per step each channel had a transfer in flight; `rates`: what the plan
// assumed of each channel (0: unknown).
std::string limit_sentence(const TimeReport& r, const std::array<double, kNumChannels>& busy,
                           const ChannelRates& rates);

}  // namespace tidal::plan::detail
