// A candidate's period, the memory over the target, the tiers, the reservations.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "plan/planner/planner_impl.hpp"

namespace tidal::plan::detail::planning {

// The compute time of c's inactive period.
double Planner::period_seconds(const Candidate& c) const {
  double seconds = 0;
  for_each_segment(c, 0, c.len - 1, [&](const Segment& g) {
    seconds += at(seconds_before_, g.r + 1) - at(seconds_before_, g.l);
  });
  return seconds;
}

double Planner::bucket_sum(const BucketTree& t, const Candidate& c, int p0, int p1) const {
  double v = 0;
  for_each_segment(c, p0, p1, [&](const Segment& s) { v += t.sum(s.l, s.r); });
  return v;
}

// The largest value of `tree` (per op) over positions [p0, p1] of c, and adding `v` there.
std::int64_t Planner::span_max(RangeTree& tree, const Candidate& c, int p0, int p1) const {
  std::int64_t m = std::numeric_limits<std::int64_t>::min();
  for_each_segment(c, p0, p1, [&](const Segment& g) { m = std::max(m, tree.max(g.l, g.r)); });
  return m;
}

void Planner::span_add(RangeTree& tree, const Candidate& c, int p0, int p1, std::int64_t v) const {
  for_each_segment(c, p0, p1, [&](const Segment& g) { tree.add(g.l, g.r, v); });
}

// Filling `need` bytes into positions [p0, p1] of c, from p0 up (forward) or from p1 down
// (backward): the position where it completes, or -1.
int Planner::fill(const BucketTree& t, const Candidate& c, int p0, int p1, double need,
                  Scan scan) const {
  Segment s[2];
  const int ns = segments(c, p0, p1, s);
  for (int q = 0; q < ns; ++q) {
    const Segment& seg = s[scan == Scan::kForward ? q : ns - 1 - q];
    const double have = t.sum(seg.l, seg.r);
    if (have >= need) {
      int j = t.find(seg.l, seg.r, need, scan);
      if (j < 0) j = scan == Scan::kForward ? seg.r : seg.l;  // rounding
      return pos_of(c, j);
    }
    need -= have;
  }
  return -1;
}

// Compute time of the ops over the target at positions [p0, p1].
double Planner::over_time(const Candidate& c, int p0, int p1) const {
  double v = 0;
  for_each_segment(c, p0, p1, [&](const Segment& s) { v += over_time_->sum(s.l, s.r); });
  return v;
}

// Adds `bytes` to the planned memory of ops [s.l, s.r].
void Planner::add_planned(const Segment& s, std::int64_t bytes) {
  at(planned_delta_, s.l) += bytes;
  at(planned_delta_, s.r + 1) -= bytes;
}

// Lowers the memory by the candidate's bytes over positions [p0, p1] and retires ops that now
// fit.
void Planner::free_span(const Candidate& c, int p0, int p1) {
  const auto s = static_cast<std::int64_t>(c.bytes);
  for_each_segment(c, p0, p1, [&](const Segment& seg) {
    over_memory_->add(seg.l, seg.r, -s);
    for (int k = over_memory_->first_at_most(seg.l, seg.r, target_); k >= 0;
         k = over_memory_->first_at_most(seg.l, seg.r, target_)) {
      over_memory_->set(k, RangeTree::kInf);
      over_time_->add(k, -weight(k));
    }
    add_planned(seg, -s);
  });
}

// Adds `bytes` (negative: removes) to what `target` holds over positions [p0, p1] of c's
// inactive period (by default all of it).
void Planner::mark_away(const Candidate& c, Target target, std::int64_t bytes, int p0, int p1) {
  if (!bounded(target)) return;
  span_add(away(target), c, p0, p1 < 0 ? c.len - 1 : p1, bytes);
}

// What c holds where: the SSDs (or host memory) over its whole period, and a staged one host
// memory too from staged_host_from(its stage) on.
void Planner::mark_all_away(const Candidate& c, std::int64_t bytes) {
  mark_away(c, c.target, bytes);
  if (c.staged) mark_away(c, Target::kHost, bytes, staged_host_from(c.stage_start), c.len - 1);
}

// Whether `target` can hold c over positions [p0, p1] of its inactive period (by default all
// of it).
bool Planner::room(const Candidate& c, Target target, int p0, int p1) {
  if (!bounded(target)) return true;
  const std::uint64_t cap = tier_capacity(target);
  // Where the tier has room for c at its fullest op, it has room over c's period (the same
  // answer without a range query: a tenth of the planning time on the paper's bf16 cells).
  if (away(target).max_all() + static_cast<std::int64_t>(c.bytes) <=
      static_cast<std::int64_t>(cap)) {
    return true;
  }
  const std::int64_t used =
      std::max<std::int64_t>(0, span_max(away(target), c, p0, p1 < 0 ? c.len - 1 : p1));
  return used + static_cast<std::int64_t>(c.bytes) <= static_cast<std::int64_t>(cap);
}

// Reserves `need` bytes of positions [p0, p1] of c into res: all of the buckets but the last
// one the scan meets (p1 forward, p0 backward), and the rest from that one.
void Planner::reserve(BucketTree& t, const Candidate& c, int p0, int p1, double need, Scan scan,
                      Reservation& res) {
  const bool forward = scan == Scan::kForward;
  Segment s[2];
  const int ns = forward ? segments(c, p0, p1 - 1, s) : segments(c, p0 + 1, p1, s);
  const int k = op_at(c, forward ? p1 : p0);
  auto& items = res.items;
  const std::size_t first = items.size();
  for (int i = 0; i < ns; ++i) t.zero(s[i].l, s[i].r, items);
  double took = 0;
  for (std::size_t i = first; i < items.size(); ++i) took += items[i].second;
  const double part = std::min(t.get(k), std::max(0.0, need - took));
  t.set(k, t.get(k) - part);
  if (part > 0) items.emplace_back(k, part);
  index(c, res);
}

// Sorts res's items by position in c's period and rebuilds the positions and prefix sums.
void Planner::index(const Candidate& c, Reservation& res) const {
  auto& items = res.items;
  const auto by_pos = [&](const auto& x, const auto& y) {
    return pos_of(c, x.first) < pos_of(c, y.first);
  };
  if (!std::is_sorted(items.begin(), items.end(), by_pos)) {
    std::stable_sort(items.begin(), items.end(), by_pos);
  }
  res.pos.resize(items.size());
  res.cum.assign(items.size() + 1, 0.0);
  for (std::size_t i = 0; i < items.size(); ++i) {
    res.pos[i] = pos_of(c, items[i].first);
    res.cum[i + 1] = res.cum[i] + items[i].second;
  }
}

// The items of res at positions [p0, p1], as a half-open index range.
std::pair<std::size_t, std::size_t> Planner::span_of(const Reservation& res, int p0, int p1) {
  const auto i = std::lower_bound(res.pos.begin(), res.pos.end(), p0) - res.pos.begin();
  const auto j = std::upper_bound(res.pos.begin(), res.pos.end(), p1) - res.pos.begin();
  return {static_cast<std::size_t>(i), static_cast<std::size_t>(std::max(i, j))};
}

// Bytes of a reservation at positions [p0, p1] of c's interior.
double Planner::reserved(const Reservation& res, int p0, int p1) {
  const auto [i, j] = span_of(res, p0, p1);
  return res.cum[j] - res.cum[i];
}

// Gives back the part of a reservation at positions [p0, p1]; returns its bytes.
double Planner::release(BucketTree& t, const Candidate& c, Reservation& res, int p0, int p1) {
  const auto [i, j] = span_of(res, p0, p1);
  const double v = res.cum[j] - res.cum[i];
  t.add(res.items.data() + i, res.items.data() + j);
  res.items.erase(res.items.begin() + static_cast<std::ptrdiff_t>(i),
                  res.items.begin() + static_cast<std::ptrdiff_t>(j));
  index(c, res);
  return v;
}

}  // namespace tidal::plan::detail::planning
