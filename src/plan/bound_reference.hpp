// The lower bound's reference search (private to plan/): the dynamic programme that grows the
// windows from every start one op at a time, O(ops^2) where the bound's own sweep is
// O((ops + uses) log ops). The tests hold the two to the same stall. Torch-free.
#pragma once

#include "tidal/plan/bound.hpp"
#include "tidal/plan/hardware.hpp"
#include "tidal/trace/trace.hpp"

namespace tidal::plan::detail {

/// stall_lower_bound() by growing every window (what it did before the sweep; it still runs
/// where a channel has rate 0).
StallBound stall_lower_bound_by_window_growth(const trace::Trace& trace, const Hardware& hw);

}  // namespace tidal::plan::detail
