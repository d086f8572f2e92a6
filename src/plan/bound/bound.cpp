// The stall lower bound (include/tidal/plan/bound.hpp, docs/simulator.md): the windows of one
// iteration, those over its end, the read floor of the whole iteration and the peaks between a
// write and a read, the largest kept.
#include "tidal/plan/bound.hpp"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "plan/bound/bound_impl.hpp"
#include "plan/bound_reference.hpp"
#include "tidal/trace/lifetime.hpp"

namespace tidal::plan {

StallBound stall_lower_bound(const trace::Trace& trace, const Hardware& hw,
                             const std::function<void(double)>& progress) {
  return detail::stall_lower_bound_and_windows(trace, hw, progress, nullptr, nullptr);
}

namespace detail {

using bounding::ReadFloor;
using bounding::transfer_seconds;
using trace::OpIndex;

StallBound stall_lower_bound_and_windows(const trace::Trace& trace, const Hardware& hw,
                                         const std::function<void(double)>& progress,
                                         StallBound* one_iteration, StallBound* windows) {
  const trace::LifetimeAnalysis la = trace::analyze_lifetimes(trace);
  // An op that needs more than device memory by itself: no plan fits, and nothing bounds it.
  const auto most = std::max_element(la.active_bytes.begin(), la.active_bytes.end());
  if (most != la.active_bytes.end() && *most > hw.device_memory) {
    StallBound none;
    none.no_fit_op = static_cast<OpIndex>(most - la.active_bytes.begin());
    none.no_fit_bytes = *most;
    none.iteration_seconds = trace.compute_seconds();
    if (one_iteration != nullptr) *one_iteration = none;
    if (windows != nullptr) *windows = none;
    if (progress) progress(1.0);
    return none;
  }
  StallBound b = stall_lower_bound_by_windows(trace, hw, progress);
  if (one_iteration != nullptr) *one_iteration = b;
  // Windows over the iteration's end (windows.cpp): a window over the optimizer step and the
  // next forward pass charges both the step's writes and the forward's.
  const auto n = static_cast<OpIndex>(trace.ops.size());
  if (n > 0) b = bounding::windows_over_end(trace, hw, std::move(b));
  // The whole iteration as one window, with the reads no plan avoids (the packing term): where
  // it is longer than the windows' sum, it is the bound.
  if (n > 0) {
    const ChannelRates ch = hw.channels();
    const bool host = hw.host_memory > 0 && ch[Channel::kHostRead] > 0;
    const ReadFloor f =
        bounding::read_floor(trace, la, hw.device_memory, host ? hw.host_memory : 0);
    const double ssd_rate = ch[Channel::kSsdRead];
    const double rate = ssd_rate + (host ? ch[Channel::kHostRead] : 0.0);
    const double compute = trace.compute_seconds();
    const double need = std::max(transfer_seconds(f.all, rate), transfer_seconds(f.ssd, ssd_rate));
    if (need - compute > b.stall_seconds) {
      b.stall_seconds = need - compute;
      b.iteration_seconds = compute + b.stall_seconds;
      b.windows = {StallWindow{0, n - 1, compute, f.all, 0.0, b.stall_seconds}};
    }
  }
  if (windows != nullptr) *windows = b;
  // Peaks between a write and a read: where their windows with the others stall more, they are
  // the bound.
  if (n > 0) b = bounding::with_halves(trace, la, hw, b);
  if (progress) progress(1.0);
  return b;
}

}  // namespace detail

}  // namespace tidal::plan
