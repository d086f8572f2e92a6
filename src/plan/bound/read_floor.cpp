// The reads no plan avoids within one iteration: the read floor, the bound's packing term.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "plan/bound/bound_impl.hpp"
#include "plan/segment_trees.hpp"

namespace tidal::plan::detail::bounding {

bool by_last_op(const detail::KeptInterval& x, const detail::KeptInterval& y) {
  return x.r != y.r ? x.r < y.r : x.l > y.l;
}

namespace {

// The intervals between consecutive uses of each tensor (ops strictly between), and from the
// iteration's start to the first use of a tensor that exists then; only where the tensor exists
// throughout.
std::vector<detail::KeptInterval> use_intervals(const trace::Trace& trace,
                                                const trace::LifetimeAnalysis& la) {
  std::vector<detail::KeptInterval> out;
  for (std::size_t t = 0; t < trace.tensors.size(); ++t) {
    const trace::Tensor& ten = trace.tensors[t];
    const auto& uses = la.tensors[t].uses;
    const auto bytes = static_cast<std::int64_t>(ten.bytes);
    if (uses.empty() || bytes == 0) continue;
    // Whether the tensor exists at every op of [l, r].
    const auto exists = [&](OpIndex l, OpIndex r) {
      return !ten.has_gap() || std::max(l, ten.freed_after + 1) > std::min(r, ten.producer - 1);
    };
    if (ten.persistent && uses.front() > 0 && exists(0, uses.front() - 1)) {
      out.push_back({0, uses.front() - 1, bytes});
    }
    for (std::size_t i = 1; i < uses.size(); ++i) {
      const OpIndex l = uses[i - 1] + 1;
      const OpIndex r = uses[i] - 1;
      if (l <= r && exists(l, r)) out.push_back({l, r, bytes});
    }
  }
  std::sort(out.begin(), out.end(), by_last_op);
  return out;
}

}  // namespace

// The most bytes of `intervals` (sorted by last op) that can stay, an interval taking any share
// of its bytes, when op k holds at most cap[k]: by last op, each takes what every op it spans
// still has. Exchange argument (docs/simulator.md): some optimum agrees with the greedy on the
// interval that ends first, so the greedy is optimal.
std::int64_t pack(const std::vector<detail::KeptInterval>& intervals,
                  const std::vector<std::int64_t>& cap) {
  // The tree holds minus the room left per op, so that its max is minus the least room.
  std::vector<std::int64_t> neg(cap.size());
  for (std::size_t k = 0; k < cap.size(); ++k) neg[k] = -std::max<std::int64_t>(0, cap[k]);
  detail::RangeTree room(neg);
  std::int64_t kept = 0;
  for (const detail::KeptInterval& u : intervals) {
    const std::int64_t take = std::min(u.bytes, -room.max(u.l, u.r));
    if (take <= 0) continue;
    room.add(u.l, u.r, take);
    kept += take;
  }
  return kept;
}

ReadFloor read_floor(const trace::Trace& trace, const trace::LifetimeAnalysis& la,
                     std::uint64_t device, std::uint64_t host) {
  ReadFloor out;
  const std::vector<detail::KeptInterval> intervals = use_intervals(trace, la);
  std::int64_t total = 0;
  for (const detail::KeptInterval& u : intervals) total += u.bytes;
  std::vector<std::int64_t> cap(la.active_bytes.size());
  for (std::size_t k = 0; k < cap.size(); ++k) {
    cap[k] = static_cast<std::int64_t>(device) - static_cast<std::int64_t>(la.active_bytes[k]);
  }
  out.all = static_cast<double>(total - pack(intervals, cap));
  if (host > 0) {
    for (auto& c : cap) c += static_cast<std::int64_t>(host);
    out.ssd = static_cast<double>(total - pack(intervals, cap));
  } else {
    out.ssd = out.all;
  }
  return out;
}

}  // namespace tidal::plan::detail::bounding

namespace tidal::plan::detail {

using bounding::by_last_op;
using bounding::pack;

std::int64_t max_kept_bytes(std::vector<KeptInterval> intervals,
                            const std::vector<std::int64_t>& cap) {
  std::sort(intervals.begin(), intervals.end(), by_last_op);
  return pack(intervals, cap);
}

}  // namespace tidal::plan::detail
