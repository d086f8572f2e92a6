// The lower bound's parts (private to plan/): the windows' dynamic programme alone, its
// reference search that grows the windows from every start one op at a time (O(ops^2) where the
// bound's own sweep is O((ops + uses) log ops); the tests hold the two to the same stall), and
// the packing behind the whole iteration's read term. Torch-free.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "tidal/plan/bound.hpp"
#include "tidal/plan/hardware.hpp"
#include "tidal/trace/trace.hpp"

namespace tidal::plan::detail {

/// The windows' part of stall_lower_bound(): the best set of disjoint windows of one iteration,
/// without the windows over its end and the whole iteration's read term.
StallBound stall_lower_bound_by_windows(const trace::Trace& trace, const Hardware& hw,
                                        const std::function<void(double)>& progress = {});

/// stall_lower_bound(), and in *one_iteration (where not null) its windows' part of one
/// iteration (stall_lower_bound_by_windows), which it computes first, and in *windows (where
/// not null) the bound without the peaks between a write and a read: the planner plans into
/// those two.
StallBound stall_lower_bound_and_windows(const trace::Trace& trace, const Hardware& hw,
                                         const std::function<void(double)>& progress,
                                         StallBound* one_iteration, StallBound* windows = nullptr);

/// The windows' part by growing every window (what it did before the sweep; it still runs
/// where a channel has rate 0).
StallBound stall_lower_bound_by_window_growth(const trace::Trace& trace, const Hardware& hw);

/// A stretch of ops l..r (inclusive) over which `bytes` of one tensor may stay in device memory.
struct KeptInterval {
  trace::OpIndex l;
  trace::OpIndex r;
  std::int64_t bytes;
};

/// The most bytes of the intervals that can stay when op k holds at most cap[k] (an interval
/// may keep any share of its bytes): the fractional interval packing the read term solves.
std::int64_t max_kept_bytes(std::vector<KeptInterval> intervals,
                            const std::vector<std::int64_t>& cap);

}  // namespace tidal::plan::detail
