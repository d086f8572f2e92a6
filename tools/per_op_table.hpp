// `tidal simulate --per-op`: a plan op by op, as CSV.
#pragma once

#include <string>

#include "tidal/plan/hardware.hpp"
#include "tidal/plan/plan.hpp"
#include "tidal/trace/trace.hpp"

namespace tidal::cli {

/// Replays plan `p` on `tr` and writes its CSV table to `path`: a row per op with its compute,
/// stall and device bytes, the device-side bytes of each tensor class and each channel's busy
/// seconds. Throws tidal::Error when the file cannot be written.
void write_per_op(const std::string& path, const trace::Trace& tr, const plan::Plan& p,
                  const plan::Hardware& hw);

}  // namespace tidal::cli
