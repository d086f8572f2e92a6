// The stall lower bound's terms (private to plan/bound/): the channels' rates, the read floor
// of the whole iteration, the windows over the iteration's end and the peaks between a write
// and a read, each in a file of its own (windows.cpp, read_floor.cpp, halves.cpp); bound.cpp
// puts them together. Torch-free.
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "plan/bound_reference.hpp"
#include "tidal/plan/bound.hpp"
#include "tidal/plan/hardware.hpp"
#include "tidal/trace/lifetime.hpp"
#include "tidal/trace/trace.hpp"

namespace tidal::plan::detail::bounding {

using trace::OpIndex;
using trace::TensorId;

/// Seconds to move `bytes` at `rate`; infinite when something must move and nothing can.
inline double transfer_seconds(double bytes, double rate) {
  if (bytes <= 0) return 0;
  if (rate <= 0) return std::numeric_limits<double>::infinity();
  return bytes / rate;
}

// The bound's four channels, from Hardware::channels(): reads and writes over the SSDs and host
// memory together and over the SSDs alone, and the host memory that can hold offloaded tensors
// (0 where no host channel moves bytes).
struct Rates {
  double read;
  double write;
  double ssd_read;
  double ssd_write;
  double host;
};

inline Rates rates_of(const Hardware& hw) {
  const ChannelRates ch = hw.channels();
  Rates r{};
  r.ssd_read = ch[Channel::kSsdRead];
  r.ssd_write = ch[Channel::kSsdWrite];
  r.read = r.ssd_read + ch[Channel::kHostRead];
  r.write = r.ssd_write + ch[Channel::kHostWrite];
  r.host = r.read > r.ssd_read || r.write > r.ssd_write ? static_cast<double>(hw.host_memory) : 0;
  return r;
}

// The reads no plan avoids within one iteration (docs/simulator.md, "Lower bound", the
// packing term). Between two uses a and b of a tensor (and, for a tensor that exists when the
// iteration starts, between the start and its first use), either the tensor is in device
// memory at every op in between, or at one of them it is not, and then all of its bytes are
// read before b, inside the iteration. At op k the tensors kept that way and the ones op k uses
// share the device memory C. Keeping the most bytes is an interval packing with capacity
// C - active(k) at op k; its fractional optimum (the greedy below) bounds every plan's, so the
// bytes read are at least the intervals' bytes less it. For the SSD reads the same with C + H
// per op: a tensor read from host memory was in host memory at the op where it was not in
// device memory.
struct ReadFloor {
  double all = 0;  // bytes read from the SSDs and host memory together, at least
  double ssd = 0;  // bytes read from the SSDs, at least
};

/// The read floor of `trace` with `device` bytes of device memory and `host` of host memory (0:
/// none): read_floor.cpp.
ReadFloor read_floor(const trace::Trace& trace, const trace::LifetimeAnalysis& la,
                     std::uint64_t device, std::uint64_t host);

/// Orders kept intervals by last op (on a tie, the shorter first), as pack() needs them.
bool by_last_op(const KeptInterval& x, const KeptInterval& y);

/// The most bytes of `intervals` (sorted by by_last_op) that can stay under cap[k] per op.
std::int64_t pack(const std::vector<KeptInterval>& intervals, const std::vector<std::int64_t>& cap);

/// `b` (the windows of one iteration) or, where it stalls more, the best windows of a periodic
/// schedule cut at an end of b's windows (windows.cpp, "Windows over the iteration's end").
StallBound windows_over_end(const trace::Trace& trace, const Hardware& hw, StallBound b);

/// The windows of `b` and the peaks between a write and a read: the set with the largest stall
/// whose stall spans are disjoint, or `b` where none stalls more (halves.cpp).
StallBound with_halves(const trace::Trace& trace, const trace::LifetimeAnalysis& la,
                       const Hardware& hw, const StallBound& b);

}  // namespace tidal::plan::detail::bounding
