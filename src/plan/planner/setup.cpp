// The stages in order, and the channels, candidates and memory they start from.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "plan/planner/planner_impl.hpp"
#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"

namespace tidal::plan::detail::planning {

// The stages: set up the channels, candidates and memory over the target; the greedy; the
// least-stall fallback; prune; the stalls and the summary.
Plan Planner::run() {
  const auto t0 = std::chrono::steady_clock::now();
  Plan plan = empty_plan();
  if (n_ == 0) {
    plan.summary.fits = true;
    return plan;
  }
  const trace::LifetimeAnalysis la = trace::analyze_lifetimes(tr_);
  for (std::uint64_t v : la.live_bytes) {
    plan.summary.peak_before_bytes = std::max(plan.summary.peak_before_bytes, v);
  }
  setup_channels();
  collect_candidates(la);
  plan.summary.candidates = static_cast<std::int64_t>(candidates_.size());
  check_active_fit(la);
  track_over_target(la);
  if (host_choice_ == HostChoice::kDensest) promise_host();
  if (host_choice_ == HostChoice::kSsdWhereNeeded) admit_ssd(la);

  greedy(plan);
  if (first_over(0, n_ - 1) >= 0 && opt_.allow_stalls) fallback(plan);
  if (retargeting()) retarget_pass(plan);
  if (staging()) stage_pass(plan);
  if (opt_.prune) prune(plan, la);
  drop_dead_actions(plan);
  stall_summary(plan);
  summarize(plan, la);

  if (opt_.progress) opt_.progress(1.0);
  plan.summary.planning_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return plan;
}

Plan Planner::empty_plan() {
  Plan plan;
  plan.model = tr_.model;
  plan.hardware = hw_.name;
  plan.num_ops = n_;
  plan.num_tensors = static_cast<std::int32_t>(tr_.tensors.size());
  PlanSummary& sum = plan.summary;
  sum.capacity_bytes = hw_.device_memory;
  target_ =
      static_cast<std::int64_t>(static_cast<double>(hw_.device_memory) * (1.0 - hw_.memory_margin));
  sum.target_bytes = static_cast<std::uint64_t>(target_);
  sum.compute_seconds = tr_.compute_seconds();
  return plan;
}

// The channels' rates and their buckets: per op, rate x op time bytes.
void Planner::setup_channels() {
  rates_ = hw_.channels();
  if (!opt_.use_host || hw_.host_memory == 0) {
    rates_[Channel::kHostWrite] = rates_[Channel::kHostRead] = 0;
  }
  op_seconds_.resize(ops());
  seconds_before_.assign(ops() + 1, 0.0);
  for (int k = 0; k < n_; ++k) {
    at(op_seconds_, k) = tr_.op_seconds(static_cast<std::size_t>(k));
    at(seconds_before_, k + 1) = at(seconds_before_, k) + at(op_seconds_, k);
  }
  for (Channel c : kChannels) {  // buckets_ in Channel order
    std::vector<double> cap(ops());
    for (int k = 0; k < n_; ++k) at(cap, k) = rates_[c] * at(op_seconds_, k);
    buckets_.emplace_back(cap);
  }
}

// Candidates: every inactive period of a tensor worth moving.
void Planner::collect_candidates(const trace::LifetimeAnalysis& la) {
  writes_.assign(tr_.tensors.size(), {});
  for (const auto& op : tr_.ops) {
    for (TensorId id : op.outputs) at(writes_, id).push_back(op.index);
  }
  periods_of_.assign(tr_.tensors.size(), {});
  for (const auto& life : la.tensors) {
    for (const auto& p : life.periods) {
      if (p.bytes == 0 || p.bytes < opt_.min_bytes) continue;
      Candidate c;
      c.tensor = p.tensor;
      c.bytes = p.bytes;
      c.last_use = p.last_use;
      c.next_use = p.next_use;
      c.len = p.wraps ? (n_ - 1 - p.last_use) + p.next_use : p.next_use - p.last_use - 1;
      if (c.len < 3) continue;  // nothing can be freed between the transfers
      std::tie(c.epoch, c.after) = version_of(c.tensor, c.last_use);
      at(periods_of_, c.tensor).push_back(static_cast<int>(candidates_.size()));
      candidates_.push_back(c);
    }
  }
}

// HostChoice::kDensest: host memory promised to the periods over ops that exceed the target,
// shortest (in compute time) first, while the promises fit in 1.25x host memory at every op.
void Planner::promise_host() {
  if (!rates_.usable(Target::kHost)) return;
  std::vector<std::pair<double, int>> order;
  for (std::size_t i = 0; i < candidates_.size(); ++i) {
    Candidate& c = candidates_[i];
    c.host_ok = false;
    if (over_time(c, 0, c.len - 1) <= 0) continue;
    double seconds = period_seconds(c);
    // A later period of an unchanged tensor saves only a read on the SSDs, whose copy of the
    // version stays (clean copies): half the SSD traffic per byte-second of host memory.
    if (clean_copies() && !is_first_of_version(c)) seconds *= 2;
    order.emplace_back(seconds, static_cast<int>(i));
  }
  std::sort(order.begin(), order.end());
  promised_ = std::make_unique<RangeTree>(std::vector<std::int64_t>(ops(), 0));
  RangeTree& promised = *promised_;
  // More is promised than host memory holds (room() still holds the commits to it): the greedy
  // commits only some of the promised periods, and pruning drops some of those, so promising
  // exactly host memory would leave part of it unused; promising much more gives it back to the
  // periods that save the least.
  constexpr double kOverPromise = 1.25;
  const auto cap = static_cast<std::int64_t>(kOverPromise * static_cast<double>(hw_.host_memory));
  for (const auto& [seconds, i] : order) {
    Candidate& c = at(candidates_, i);
    const auto bytes = static_cast<std::int64_t>(c.bytes);
    if (std::max<std::int64_t>(0, span_max(promised, c, 0, c.len - 1)) + bytes > cap) continue;
    span_add(promised, c, 0, c.len - 1, bytes);
    c.host_ok = true;
  }
}

// HostChoice::kSsdWhereNeeded: where the live bytes exceed the target and host memory
// together, the SSDs must hold the rest; the longest periods (in compute time) over those ops
// may go to the SSDs until they cover kSsdCover times that at every op, the others only to
// host memory. The cover is three times the need, not once: not every admitted period is
// committed (its transfers may not fit in the buckets). This way exists because a plan by score
// can put the optimizer states on one SSD and read them in a step of milliseconds while the
// host link idles.
void Planner::admit_ssd(const trace::LifetimeAnalysis& la) {
  if (!rates_.usable(Target::kHost)) return;
  constexpr double kSsdCover = 3.0;
  std::vector<std::int64_t> need(ops());
  for (int k = 0; k < n_; ++k) {
    const auto v = static_cast<std::int64_t>(at(la.live_bytes, k)) - target_ -
                   static_cast<std::int64_t>(hw_.host_memory);
    at(need, k) = v > 0 ? static_cast<std::int64_t>(kSsdCover * static_cast<double>(v)) : 0;
  }
  RangeTree left(need);
  std::vector<std::pair<double, int>> order;
  for (std::size_t i = 0; i < candidates_.size(); ++i) {
    Candidate& c = candidates_[i];
    c.ssd_ok = false;
    const double seconds = period_seconds(c);
    order.emplace_back(-seconds, static_cast<int>(i));
  }
  std::sort(order.begin(), order.end());
  for (const auto& [neg_seconds, i] : order) {
    if (left.max(0, n_ - 1) <= 0) break;
    Candidate& c = at(candidates_, i);
    if (span_max(left, c, 1, c.len - 2) <= 0) continue;
    c.ssd_ok = true;
    span_add(left, c, 1, c.len - 2, -static_cast<std::int64_t>(c.bytes));
  }
}

// The ops over the target, with their compute time as weight; nothing planned away yet.
void Planner::track_over_target(const trace::LifetimeAnalysis& la) {
  std::vector<std::int64_t> m(ops());
  over_time_ = std::make_unique<Fenwick>(n_);
  for (int k = 0; k < n_; ++k) {
    const auto v = static_cast<std::int64_t>(at(la.live_bytes, k));
    const bool over = v > target_;
    at(m, k) = over ? v : RangeTree::kInf;
    if (over) over_time_->add(k, weight(k));
  }
  over_memory_ = std::make_unique<RangeTree>(m);
  for (auto& tree : away_bytes_) {
    tree = std::make_unique<RangeTree>(std::vector<std::int64_t>(ops(), 0));
  }
  planned_delta_.assign(ops() + 1, 0);
  stall_at_.assign(ops(), 0.0);
  initial_over_time_ = over_time_->sum(0, n_ - 1);
}

void Planner::check_active_fit(const trace::LifetimeAnalysis& la) {
  // Bytes that may leave at op k: periods that cover it away from their ends.
  std::vector<std::int64_t> movable(ops() + 1, 0);
  for (const Candidate& c : candidates_) {
    for_each_segment(c, 1, c.len - 2, [&](const Segment& s) {
      at(movable, s.l) += static_cast<std::int64_t>(c.bytes);
      at(movable, s.r + 1) -= static_cast<std::int64_t>(c.bytes);
    });
  }
  std::int64_t run = 0;
  std::int64_t worst = 0;
  int worst_op = -1;
  for (int k = 0; k < n_; ++k) {
    run += at(movable, k);
    const std::int64_t pinned = static_cast<std::int64_t>(at(la.live_bytes, k)) - run;
    if (pinned - target_ > worst) {
      worst = pinned - target_;
      worst_op = k;
    }
  }
  if (worst_op < 0) return;
  const auto& op = at(tr_.ops, worst_op);
  TIDAL_EXPECT_AS(
      InvalidArgument, false, "the plan cannot fit: op ", worst_op, " '", op.name, "' (",
      trace::to_string(op.phase), ") needs ", format_bytes(static_cast<double>(worst + target_)),
      " of tensors that cannot leave device memory around it (",
      format_bytes(static_cast<double>(at(la.active_bytes, worst_op))),
      " used by the op itself), but ", format_bytes(static_cast<double>(target_)),
      " is available (", format_bytes(static_cast<double>(hw_.device_memory)), " less the ",
      hw_.memory_margin * 100, "% margin): ", format_bytes(static_cast<double>(worst)),
      " short. Use a smaller batch or sequence, or ", opt_.more_memory_hint, ".");
}

// The version of `tensor` at op k: the last op at or before k that modifies it (cyclically;
// -1: no op does), and the ops from there to k.
std::pair<int, int> Planner::version_of(TensorId tensor, int k) const {
  const auto& w = at(writes_, tensor);
  const auto it = std::upper_bound(w.begin(), w.end(), k);
  const int epoch = it != w.begin() ? *(it - 1) : (w.empty() ? -1 : w.back());
  const int after = epoch < 0 ? k : ((k - epoch) % n_ + n_) % n_;
  return {epoch, after};
}

// The committed migrations of c's version to `target` nearest before and after it (-1: none).
std::pair<int, int> Planner::neighbours(const Candidate& c, Target target) const {
  int before = -1;
  int later = -1;
  for (int j : at(periods_of_, c.tensor)) {
    const Candidate& m = at(candidates_, j);
    if (!m.done || m.target != target || m.epoch != c.epoch || &m == &c) continue;
    if (m.after < c.after && (before < 0 || m.after > at(candidates_, before).after)) before = j;
    if (m.after > c.after && (later < 0 || m.after < at(candidates_, later).after)) later = j;
  }
  return {before, later};
}

}  // namespace tidal::plan::detail::planning
