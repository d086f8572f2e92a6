// After the greedy and the fallback, periods moved to or staged through host memory.
#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "plan/planner/planner_impl.hpp"

namespace tidal::plan::detail::planning {

// After the greedy and the fallback: a period planned on the SSDs moves to host memory where
// host memory has room for all of it and the host link can write it no later and read it no
// earlier than the SSDs do (so it frees at least the same ops and its reservations fit): the
// SSDs' bandwidth goes to the periods that stay there. The greedy sends a period to the SSDs
// on a tie (host memory is the scarcer tier), which late in the greedy leaves the SSDs' reads
// oversubscribed where host memory and the host link still have room. Only periods whose SSD
// write serves no other period of their version (an activation, an accumulated gradient);
// the shortest first (the most SSD traffic per byte-second of host memory).
void Planner::retarget_pass(Plan& plan) {
  std::vector<int> order;
  for (std::size_t i = 0; i < candidates_.size(); ++i) {
    const Candidate& c = candidates_[i];
    if (!c.done || c.target != Target::kSsd || c.clean || !c.host_ok) continue;
    const auto [before, later] = neighbours(c, Target::kSsd);
    if (before >= 0 || later >= 0) continue;  // its SSD write serves others of its version
    order.push_back(static_cast<int>(i));
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return at(candidates_, a).len < at(candidates_, b).len; });
  for (int i : order) {
    check_cancel();
    Candidate& c = at(candidates_, i);
    // A staged period holds host memory from its stage on already, and reads it from there.
    const int held_from = c.staged ? staged_host_from(c.stage_start) : c.len;
    if (held_from > 0 && !room(c, Target::kHost, 0, held_from - 1)) continue;
    const auto need = static_cast<double>(c.bytes);
    const bool clean = clean_on(c, Target::kHost);
    int start = c.prefetch_start;
    if (!c.staged) {
      start = fill(bucket(Target::kHost, Direction::kRead), c, 0, c.len - 1, need, Scan::kBackward);
      if (start < c.prefetch_start) continue;
    }
    const int end = clean ? -1
                          : fill(bucket(Target::kHost, Direction::kWrite), c, 0, c.len - 1, need,
                                 Scan::kForward);
    if (!clean && (end < 0 || end > c.offload_end)) continue;
    release(bucket(Target::kSsd, Direction::kWrite), c, c.write_res, 0, c.len - 1);
    const bool was_staged = c.staged;
    if (was_staged) {  // (the promises of HostChoice::kDensest are read in the greedy only)
      release(bucket(Target::kSsd, Direction::kRead), c, c.stage_res, 0, c.len - 1);
      mark_away(c, Target::kHost, -static_cast<std::int64_t>(c.bytes), held_from, c.len - 1);
      dead_actions_.push_back(c.stage_action);
      c.staged = false;
      c.stage_start = -1;
    } else {
      release(bucket(Target::kSsd, Direction::kRead), c, c.read_res, 0, c.len - 1);
    }
    count_offload(plan.summary, c, false);
    mark_away(c, Target::kSsd, -static_cast<std::int64_t>(c.bytes));
    const int old_end = c.offload_end;
    const int old_start = c.prefetch_start;
    c.target = Target::kHost;
    c.clean = clean;
    c.offload_end = end;
    if (!clean) {
      reserve(bucket(Target::kHost, Direction::kWrite), c, 0, end, need, Scan::kForward,
              c.write_res);
    }
    if (!was_staged) {  // a staged one's prefetch reads host memory already
      c.prefetch_start = start;
      reserve(bucket(Target::kHost, Direction::kRead), c, start, c.len - 1, need, Scan::kBackward,
              c.read_res);
    }
    if (end < old_end) free_span(c, end + 1, old_end);
    if (start > old_start) free_span(c, old_start, start - 1);
    mark_away(c, Target::kHost, static_cast<std::int64_t>(c.bytes));
    count_offload(plan.summary, c, true);
    plan.actions[c.off_action].target = Target::kHost;
    plan.actions[c.off_action + 1].target = Target::kHost;
    set_times(plan, c);
    track_present(i);
    if (!clean && clean_copies()) clean_later(plan, c);
  }
}

// Removes the actions of dead_actions_ (the stages of periods moved to host memory) where
// prune has not (it removes them with its own).
void Planner::drop_dead_actions(Plan& plan) {
  if (dead_actions_.empty()) return;
  std::vector<char> dead(plan.actions.size(), 0);
  for (const std::size_t a : dead_actions_) dead[a] = 1;
  dead_actions_.clear();
  remove_actions(plan, dead);
}

// Keeps the actions whose entry in `dead` is 0, in order. Candidates' action indices are stale
// afterwards: only the last steps of run() remove actions.
void Planner::remove_actions(Plan& plan, const std::vector<char>& dead) {
  std::size_t out = 0;
  for (std::size_t i = 0; i < plan.actions.size(); ++i) {
    if (dead[i] == 0) plan.actions[out++] = plan.actions[i];
  }
  plan.actions.resize(out);
}

// After the greedy and the fallback: each period planned on the SSDs comes back through host
// memory where host memory has room for it from a stage to its use, and the host link can
// bring it in no earlier than its SSD prefetch started (so device memory is held no longer):
// its SSD read moves to where the SSDs have bandwidth, with host memory left over.
void Planner::stage_pass(Plan& plan) {
  std::vector<int> order;
  for (std::size_t i = 0; i < candidates_.size(); ++i) {
    const Candidate& c = candidates_[i];
    if (c.done && c.target == Target::kSsd && !c.staged) order.push_back(static_cast<int>(i));
  }
  // The largest first: host memory left over goes to the transfers that take the SSDs longest.
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return at(candidates_, a).bytes > at(candidates_, b).bytes;
  });
  for (int i : order) {
    check_cancel();
    Candidate& c = at(candidates_, i);
    const auto need = static_cast<double>(c.bytes);
    BucketTree& ssd_read = bucket(Target::kSsd, Direction::kRead);
    BucketTree& host_read = bucket(Target::kHost, Direction::kRead);
    const int start = fill(host_read, c, 0, c.len - 1, need, Scan::kBackward);
    if (start < c.prefetch_start) continue;
    // The SSD read given back first: the stage may take its buckets.
    Reservation old = c.read_res;
    release(ssd_read, c, c.read_res, 0, c.len - 1);
    const int stage = start - 2 >= c.offload_end + 2
                          ? fill(ssd_read, c, c.offload_end + 2, start - 2, need, Scan::kBackward)
                          : -1;
    if (stage < 0 || !room(c, Target::kHost, staged_host_from(stage), c.len - 1)) {
      for (const Leaf& l : old.items) ssd_read.set(l.first, ssd_read.get(l.first) - l.second);
      c.read_res = std::move(old);  // as it was before the release
      continue;
    }
    c.staged = true;
    c.stage_start = stage;
    reserve(ssd_read, c, stage, start - 2, need, Scan::kBackward, c.stage_res);
    reserve(host_read, c, start, c.len - 1, need, Scan::kBackward, c.read_res);
    const int old_start = c.prefetch_start;
    c.prefetch_start = start;
    free_span(c, old_start, start - 1);
    mark_away(c, Target::kHost, static_cast<std::int64_t>(c.bytes), staged_host_from(stage),
              c.len - 1);
    plan.actions[c.off_action + 1].target = Target::kHost;
    add_stage_action(plan, c);
    set_times(plan, c);
    track_present(i);
  }
}

}  // namespace tidal::plan::detail::planning
