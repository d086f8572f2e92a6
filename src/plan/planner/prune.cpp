// Dropping the migrations the others make unnecessary, the stalls and the summary.
#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "plan/planner/planner_impl.hpp"

namespace tidal::plan::detail::planning {

// Drops the committed migrations that the others make unnecessary. The greedy scores a period
// by the time it frees while the ops are over the target, but commits the whole period; the
// later commits then cover the ops the early ones were taken for, and the planned peak ends
// far under the target (Llama3-8B in-backward: 25 GiB against 86.7 GiB). A migration can go
// when M' (memory per op with all the others) plus its bytes stays at or under the target over
// the ops it frees; dropping it gives back its bandwidth, so the planned stall can only shrink.
//
// What a drop saves depends on the tensor's other migrations: a tensor unchanged since its
// last write to a target is not written there again (the store keeps the copy; the simulator
// models this), so of the migrations of one tensor to one target between two ops that modify
// it (a "group") only the first writes. Dropping one member of a group saves a read and no
// write, and dropping the first moves the write to the next member, later than the planner's
// deadlines assumed it. So: first whole groups, where every member can go (their periods are
// disjoint, so each member is checked on its own); then, in what is left, single members
// other than the one that writes. SSD before host memory (SSD writes wear the drives); within
// a pass, least relief needed first (compute time over the target, with everything kept, of
// the ops a group frees; zero for ops that never exceeded it), then the largest. M' only grows
// as migrations go, so each pass is maximal for its order.
void Planner::prune(Plan& plan, const trace::LifetimeAnalysis& la) {
  std::vector<double> over_prefix;
  PruneState st{planned_memory(la, over_prefix), prune_members(), {}, {}};
  st.groups = prune_groups(st.members, over_prefix);
  st.dropped.assign(plan.actions.size(), 0);
  for (const std::size_t a : dead_actions_) st.dropped[a] = 1;
  dead_actions_.clear();
  for (bool host : {false, true}) {
    for (const PruneGroup& g : st.groups) {
      if (g.host == host) drop_group(plan, st, g);
    }
    for (const PruneGroup& g : st.groups) {
      if (g.host == host) drop_readers(plan, st, g);
    }
  }
  remove_actions(plan, st.dropped);
}

// M' per op (memory with every committed migration), and the prefix sums of the compute
// time of the ops that exceed the target with everything kept.
RangeTree Planner::planned_memory(const trace::LifetimeAnalysis& la,
                                  std::vector<double>& over_prefix) {
  std::vector<std::int64_t> m(ops());
  over_prefix.assign(ops() + 1, 0.0);
  std::int64_t run = 0;
  for (int k = 0; k < n_; ++k) {
    run += at(planned_delta_, k);
    const auto live = static_cast<std::int64_t>(at(la.live_bytes, k));
    at(m, k) = live + run;
    at(over_prefix, k + 1) = at(over_prefix, k) + (live > target_ ? weight(k) : 0.0);
  }
  return RangeTree(m);
}

// The committed migrations, by target (SSD first), tensor, epoch and offload time.
std::vector<PruneMember> Planner::prune_members() const {
  std::vector<PruneMember> members;
  for (std::size_t i = 0; i < candidates_.size(); ++i) {
    const Candidate& c = candidates_[i];
    if (!c.done) continue;
    members.push_back({c.target == Target::kHost, c.tensor, c.epoch, c.after, static_cast<int>(i)});
  }
  std::sort(members.begin(), members.end(), [](const PruneMember& x, const PruneMember& y) {
    if (x.host != y.host) return !x.host;
    if (x.tensor != y.tensor) return x.tensor < y.tensor;
    if (x.epoch != y.epoch) return x.epoch < y.epoch;
    return x.after < y.after;
  });
  return members;
}

// The groups of the sorted members, in the order prune() tries them.
std::vector<PruneGroup> Planner::prune_groups(const std::vector<PruneMember>& members,
                                              const std::vector<double>& over_prefix) const {
  std::vector<PruneGroup> groups;
  for (std::size_t i = 0; i < members.size();) {
    std::size_t j = i;
    PruneGroup g{members[i].host, 0.0, 0, i, i};
    while (j < members.size() && members[j].host == members[i].host &&
           members[j].tensor == members[i].tensor && members[j].epoch == members[i].epoch) {
      const Candidate& c = at(candidates_, members[j].cand);
      for_each_segment(c, c.offload_end + 1, c.prefetch_start - 1, [&](const Segment& s) {
        g.need += at(over_prefix, s.r + 1) - at(over_prefix, s.l);
      });
      g.bytes += c.bytes;
      ++j;
    }
    g.last = j;
    groups.push_back(g);
    i = j;
  }
  std::sort(groups.begin(), groups.end(), [](const PruneGroup& x, const PruneGroup& y) {
    if (x.host != y.host) return !x.host;
    if (x.need != y.need) return x.need < y.need;
    if (x.bytes != y.bytes) return x.bytes > y.bytes;
    return x.first < y.first;
  });
  return groups;
}

// Drops every member of g when each can go.
void Planner::drop_group(Plan& plan, PruneState& st, const PruneGroup& g) {
  bool all = true;
  for (std::size_t i = g.first; i < g.last && all; ++i) {
    all = can_drop(st, at(candidates_, st.members[i].cand));
  }
  if (!all) return;
  for (std::size_t i = g.first; i < g.last; ++i) {
    drop(plan, st, at(candidates_, st.members[i].cand));
  }
}

// Drops the members of g that can go after the one that writes (they only read).
void Planner::drop_readers(Plan& plan, PruneState& st, const PruneGroup& g) {
  std::size_t writer = g.first;
  while (writer < g.last && !at(candidates_, st.members[writer].cand).done) ++writer;
  for (std::size_t i = writer + 1; i < g.last; ++i) {
    Candidate& c = at(candidates_, st.members[i].cand);
    if (c.done && can_drop(st, c)) drop(plan, st, c);
  }
}

bool Planner::can_drop(PruneState& st, const Candidate& c) {
  Segment seg[2];
  const int ns = segments(c, c.offload_end + 1, c.prefetch_start - 1, seg);
  for (int q = 0; q < ns; ++q) {
    if (st.memory.max(seg[q].l, seg[q].r) + static_cast<std::int64_t>(c.bytes) > target_) {
      return false;
    }
  }
  return true;
}

void Planner::drop(Plan& plan, PruneState& st, Candidate& c) {
  const auto s = static_cast<std::int64_t>(c.bytes);
  for_each_segment(c, c.offload_end + 1, c.prefetch_start - 1, [&](const Segment& seg) {
    st.memory.add(seg.l, seg.r, s);
    add_planned(seg, s);
  });
  const auto give_back = [&](BucketTree& t, Reservation& res) {
    t.add(res.items.data(), res.items.data() + res.items.size());
    res = Reservation{};
  };
  give_back(bucket(c.target, Direction::kWrite), c.write_res);
  give_back(bucket(read_tier(c), Direction::kRead), c.read_res);
  give_back(bucket(Target::kSsd, Direction::kRead), c.stage_res);
  mark_all_away(c, -s);
  count_offload(plan.summary, c, false);
  c.done = false;
  st.dropped[c.off_action] = st.dropped[c.off_action + 1] = 1;
  if (c.staged) st.dropped[c.stage_action] = 1;
  c.staged = false;
}

// The stalls the plan needs: the channels run at once, so a stall in bucket k serves all of
// them and only has to be as long as the channel that uses most of it needs (its reservations
// there beyond the op's own time, over its rate), not the sum of the stalls that were added
// there one channel at a time. The reservations stay feasible with these stalls.
void Planner::stall_summary(Plan& plan) const {
  for (int k = 0; k < n_; ++k) {
    const double added = at(stall_at_, k);
    if (added <= 0) continue;
    double need = 0;
    for (Channel c : kChannels) {
      const double rate = rates_[c];
      if (rate <= 0) continue;
      const double own = rate * at(op_seconds_, k);
      const double used = own + rate * added - buckets_[index_of(c)].get(k);
      need = std::max(need, (used - own) / rate);
    }
    need = std::min(added, need);
    if (need > 0) plan.stalls.emplace_back((k + 1) % n_, need);
  }
}

// The planned memory per op, the peaks, and the actions in trigger order.
void Planner::summarize(Plan& plan, const trace::LifetimeAnalysis& la) {
  PlanSummary& sum = plan.summary;
  std::int64_t run = 0;
  for (int k = 0; k < n_; ++k) {
    run += at(planned_delta_, k);
    const std::int64_t v = static_cast<std::int64_t>(at(la.live_bytes, k)) + run;
    if (static_cast<std::uint64_t>(v) > sum.peak_after_bytes) {
      sum.peak_after_bytes = static_cast<std::uint64_t>(v);
      sum.peak_after_op = k;
    }
  }
  sum.peak_host_bytes =
      static_cast<std::uint64_t>(std::max<std::int64_t>(0, away(Target::kHost).max(0, n_ - 1)));
  sum.fits = sum.peak_after_bytes <= hw_.device_memory;
  for (const auto& [op, s] : plan.stalls) sum.planned_stall_seconds += s;
  std::sort(plan.actions.begin(), plan.actions.end(), [](const PlanAction& x, const PlanAction& y) {
    if (x.trigger != y.trigger) return x.trigger < y.trigger;
    if (x.kind != y.kind) return x.kind < y.kind;
    return x.tensor < y.tensor;
  });
}

}  // namespace tidal::plan::detail::planning
