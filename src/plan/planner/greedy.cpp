// Choosing and committing migrations, and the greedy.
#include <algorithm>
#include <cstdint>
#include <queue>
#include <utility>
#include <vector>

#include "plan/planner/planner_impl.hpp"
#include "tidal/common/error.hpp"

namespace tidal::plan::detail::planning {

// With `ahead` false, c's own transfers only (a period that writes ahead for another writes
// for itself).
Choice Planner::evaluate_target(const Candidate& c, Target target, bool ahead) {
  Choice ch;
  if (!rates_.usable(target)) return ch;
  if (target == Target::kHost && !c.host_ok) return ch;
  if (target == Target::kSsd && !c.ssd_ok && !any_ssd_) return ch;
  if (!room(c, target)) return ch;
  const auto need = static_cast<double>(c.bytes);
  const int start = fill(bucket(target, Direction::kRead), c, 0, c.len - 1, need, Scan::kBackward);
  if (start < 1) return ch;
  const bool clean = clean_on(c, target);
  const int end =
      clean ? -1 : fill(bucket(target, Direction::kWrite), c, 0, c.len - 1, need, Scan::kForward);
  if (clean || (end >= 0 && end + 1 <= start - 1)) {
    ch.ok = true;
    ch.target = target;
    ch.offload_end = end;
    ch.prefetch_start = start;
    ch.score = over_time(c, end + 1, start - 1);
    ch.clean = clean;
  }
  if (ahead && !clean && clean_copies() && in_.write_ahead) write_ahead(c, target, start, ch);
  return ch;
}

// The write of c moved ahead (PlannerInternals::write_ahead): where no earlier period of c's
// version is planned, the longest of them in compute time whose transfers fit in its own
// buckets (the later on a tie) is planned too, and c then leaves with no write from its first op.
// Taken where that frees more of c's period over the target. The longest period, not the
// version's first: a parameter that fits in device memory through micro-batch 0 would otherwise
// be written in micro-batch 1's forward pass beside its activations, where the optimizer step
// had no room for its write; the longest period is in micro-batch 0 (docs/simulator.md, step 9).
void Planner::write_ahead(const Candidate& c, Target target, int start, Choice& ch) {
  const double score = over_time(c, 0, start - 1);
  if (ch.ok && score < ch.score) return;
  int e = -1;
  double longest = -1;
  bool planned = false;
  for_each_earlier(c, [&](int j) { planned = planned || at(candidates_, j).done; });
  if (planned) return;
  for_each_earlier(c, [&](int j) {
    const double seconds = period_seconds(at(candidates_, j));
    const bool longer = seconds > longest || (seconds == longest && e >= 0 &&
                                              at(candidates_, j).after > at(candidates_, e).after);
    if (longer && evaluate_target(at(candidates_, j), target, false).ok) {
      e = j;
      longest = seconds;
    }
  });
  if (e < 0) return;
  ch.ok = true;
  ch.target = target;
  ch.offload_end = -1;
  ch.prefetch_start = start;
  ch.score = score;
  ch.clean = true;
  ch.via = e;
}

// c on the SSDs and back through host memory (PlannerOptions::stage_via_host): the prefetch
// fills the host link's read buckets backward from the use, the stage the SSDs' read buckets
// backward from the op before the prefetch's trigger (the stage's deadline is that trigger op,
// which waits for it), after the offload's end and the op after it (so that the write is done
// when the stage is issued); host memory must hold c from the op before the stage's first
// bucket to the use. It frees the ops from the offload's end to the prefetch, as a plain SSD
// period does to its own (earlier) prefetch.
Choice Planner::evaluate_staged(const Candidate& c) {
  Choice ch;
  if (!staging() || (!c.ssd_ok && !any_ssd_) || !room(c, Target::kSsd)) return ch;
  const auto need = static_cast<double>(c.bytes);
  const int start =
      fill(bucket(Target::kHost, Direction::kRead), c, 0, c.len - 1, need, Scan::kBackward);
  if (start < 4) return ch;
  const bool clean = clean_on(c, Target::kSsd);
  const int end =
      clean ? -1
            : fill(bucket(Target::kSsd, Direction::kWrite), c, 0, start - 4, need, Scan::kForward);
  if (!clean && end < 0) return ch;
  const int stage =
      fill(bucket(Target::kSsd, Direction::kRead), c, end + 2, start - 2, need, Scan::kBackward);
  const int host_from = staged_host_from(stage);
  if (stage < 0 || !room(c, Target::kHost, host_from, c.len - 1)) return ch;
  // HostChoice::kDensest: host memory is promised to the densest periods; a stage takes only
  // what the promises leave.
  if (promised_ &&
      span_max(*promised_, c, host_from, c.len - 1) + static_cast<std::int64_t>(c.bytes) >
          static_cast<std::int64_t>(hw_.host_memory)) {
    return ch;
  }
  ch.ok = true;
  ch.target = Target::kSsd;
  ch.offload_end = end;
  ch.prefetch_start = start;
  ch.score = over_time(c, end + 1, start - 1);
  ch.clean = clean;
  ch.staged = true;
  ch.stage_start = stage;
  return ch;
}

// The target whose channels free more over-target time for this period; on a tie the SSDs
// (host memory is the scarcer resource), or host memory with options.prefer_host (fewer SSD
// writes); SSD alone when host memory is off or full. Taking SSD
// whenever it had any room (the first version) left the optimizer step of the after-backward
// schedule reading almost everything from the SSDs while the host channels idled: on
// Llama3-70B b16, 916 of 1,037 GB read in the step came from the SSDs, at 26.8 GB/s instead
// of the link's 55 GB/s (35 s of stall instead of 26 s).
Choice Planner::evaluate(const Candidate& c) {
  Choice ssd = evaluate_target(c, Target::kSsd);
  if (!ssd.ok || ssd.score <= 0) ssd = Choice{};
  Choice host = evaluate_target(c, Target::kHost);
  const bool host_on_tie = opt_.prefer_host || host_choice_ != HostChoice::kByScore;
  Choice best = ssd;
  if (host.ok && host.score > 0 &&
      (host.score > ssd.score || (host_on_tie && host.score >= ssd.score))) {
    best = host;
  }
  // Staged where it frees more than either: it takes host memory for part of the period only,
  // and two channels' bandwidth. Only in the way that promises host memory by density, where
  // a stage takes only what the promises leave (evaluate_staged): in the other two ways stages
  // in the greedy take host memory the denser periods need, and the pass after the fallback
  // stages there.
  // (The over-target time of the whole period bounds any choice's score.)
  if (staging() && host_choice_ == HostChoice::kDensest &&
      (!best.ok || over_time(c, 0, c.len - 1) > best.score)) {
    const Choice staged = evaluate_staged(c);
    if (staged.ok && staged.score > 0 && (!best.ok || staged.score > best.score)) return staged;
  }
  return best;
}

// Counts c's migration into (add) or out of (!add) the summary.
void Planner::count_offload(PlanSummary& sum, const Candidate& c, bool add) {
  const bool host = c.target == Target::kHost;
  std::int64_t& count = host ? sum.offloads_host : sum.offloads_ssd;
  std::uint64_t& bytes = host ? sum.bytes_to_host : sum.bytes_to_ssd;
  if (add) {
    ++count;
    bytes += c.bytes;
  } else {
    --count;
    bytes -= c.bytes;
  }
}

void Planner::commit(Plan& plan, Candidate& c, const Choice& ch) {
  if (ch.via >= 0) {  // the period that writes the version first
    Candidate& e = at(candidates_, ch.via);
    const Choice first = evaluate_target(e, ch.target, false);
    TIDAL_EXPECT(first.ok && !first.clean && first.via < 0,
                 "planner: the period that writes ahead no longer fits; this is a bug");
    commit(plan, e, first);
    TIDAL_EXPECT(clean_on(c, ch.target), "planner: the write ahead left no copy; a bug");
  }
  c.done = true;
  c.target = ch.target;
  c.offload_end = ch.offload_end;
  c.prefetch_start = ch.prefetch_start;
  c.clean = ch.clean;
  c.staged = ch.staged;
  c.stage_start = ch.stage_start;
  const auto need = static_cast<double>(c.bytes);
  if (!c.clean) {
    reserve(bucket(ch.target, Direction::kWrite), c, 0, c.offload_end, need, Scan::kForward,
            c.write_res);
  }
  if (c.staged) {
    reserve(bucket(Target::kSsd, Direction::kRead), c, c.stage_start, c.prefetch_start - 2, need,
            Scan::kBackward, c.stage_res);
  }
  reserve(bucket(read_tier(c), Direction::kRead), c, c.prefetch_start, c.len - 1, need,
          Scan::kBackward, c.read_res);
  free_span(c, c.offload_end + 1, c.prefetch_start - 1);
  mark_all_away(c, static_cast<std::int64_t>(c.bytes));
  if (c.staged && promised_) {
    span_add(*promised_, c, staged_host_from(c.stage_start), c.len - 1,
             static_cast<std::int64_t>(c.bytes));
  }
  count_offload(plan.summary, c, true);
  PlanAction off;
  off.tensor = c.tensor;
  off.kind = ActionKind::kOffload;
  off.target = ch.target;
  off.bytes = c.bytes;
  PlanAction pre = off;
  pre.kind = ActionKind::kPrefetch;
  pre.target = read_tier(c);
  c.off_action = plan.actions.size();
  plan.actions.push_back(off);
  plan.actions.push_back(pre);
  if (c.staged) add_stage_action(plan, c);
  set_times(plan, c);
  const int i = static_cast<int>(&c - candidates_.data());
  track_present(i);
  if (clean_copies()) clean_later(plan, c);
  if ((++commits_ & 255) == 0) report_progress();
}

void Planner::add_stage_action(Plan& plan, Candidate& c) {
  PlanAction stage = plan.actions[c.off_action + 1];
  stage.kind = ActionKind::kStage;
  stage.target = Target::kHost;
  c.stage_action = plan.actions.size();
  plan.actions.push_back(stage);
}

// The next committed migration of c's version to c's tier, if it booked a write, now finds
// that version there: its write is given back and it frees from its first op.
void Planner::clean_later(Plan& plan, const Candidate& c) {
  const int later = neighbours(c, c.target).second;
  if (later < 0) return;
  Candidate& m = at(candidates_, later);
  if (m.clean) return;
  release(bucket(m.target, Direction::kWrite), m, m.write_res, 0, m.len - 1);
  const int old_end = m.offload_end;
  m.clean = true;
  m.offload_end = -1;
  free_span(m, 0, old_end);
  set_times(plan, m);
  track_present(later);
}

// The share of the over-target compute time resolved so far, to PlannerOptions::progress. In
// the greedy every 256 commits; in the least-stall fallback after each op it relieves (that
// stage scans every candidate per op, so it is where large traces spend their time).
void Planner::report_progress() {
  if (opt_.progress && initial_over_time_ > 0) {
    opt_.progress(1.0 - over_time_->sum(0, n_ - 1) / initial_over_time_);
  }
}

// The actions' trigger and deadline ops from the candidate's transfer positions.
void Planner::set_times(Plan& plan, const Candidate& c) const {
  PlanAction& off = plan.actions[c.off_action];
  PlanAction& pre = plan.actions[c.off_action + 1];
  off.trigger = c.last_use;
  off.deadline = op_at(c, c.offload_end + 1);
  off.wraps = off.deadline <= off.trigger;
  pre.trigger = op_at(c, c.prefetch_start - 1);
  pre.deadline = c.next_use;
  pre.wraps = pre.deadline <= pre.trigger;
  if (c.staged) {  // issued before its first bucket, done before the prefetch's trigger op
    PlanAction& stage = plan.actions[c.stage_action];
    stage.trigger = op_at(c, c.stage_start - 1);
    stage.deadline = op_at(c, c.prefetch_start - 1);
    stage.wraps = stage.deadline <= stage.trigger;
  }
}

// Whether a migration went to the SSDs while host memory, which may take it, had no room for
// it: host memory was short for this plan.
void Planner::note_host_short(const Candidate& c, Target target) {
  if (target == Target::kSsd && !host_short_ && c.host_ok && rates_.usable(Target::kHost)) {
    host_short_ = !room(c, Target::kHost);
  }
}

void Planner::greedy(Plan& plan) {
  struct Entry {
    double score;
    std::uint64_t bytes;
    int cand;
    bool operator<(const Entry& o) const {
      return score != o.score ? score < o.score : bytes < o.bytes;
    }
  };
  std::priority_queue<Entry> heap;
  for (std::size_t i = 0; i < candidates_.size(); ++i) {
    const Choice ch = evaluate(candidates_[i]);
    if (ch.ok) heap.push({ch.score, candidates_[i].bytes, static_cast<int>(i)});
  }
  while (!heap.empty() && over_time_->sum(0, n_ - 1) > 0) {
    if ((++steps_ & 1023) == 0) check_cancel();
    const Entry top = heap.top();
    heap.pop();
    Candidate& c = at(candidates_, top.cand);
    if (c.done) continue;
    // The over-target time of the whole period bounds the score from above (the score is that
    // of a part of it, whatever the transfers' places, and the bound only shrinks): where the
    // bound is already under the next entry's, the candidate goes back with the bound as its
    // key, without the bucket searches of a full evaluation
    // (PlannerInternals::greedy_bound_skip).
    if (in_.greedy_bound_skip) {
      const double ub = over_time(c, 0, c.len - 1);
      if (ub <= 0) continue;  // nothing over the target left in its period: it frees nothing
      if (!heap.empty() && ub < heap.top().score * (1 - in_.greedy_tolerance)) {
        heap.push({ub, c.bytes, top.cand});
        continue;
      }
    }
    const Choice ch = evaluate(c);
    if (!ch.ok) continue;
    if (!heap.empty() && ch.score < heap.top().score * (1 - in_.greedy_tolerance)) {
      heap.push({ch.score, c.bytes, top.cand});  // scores only shrink: re-queue, look again
      continue;
    }
    note_host_short(c, ch.target);
    commit(plan, c, ch);
  }
}

}  // namespace tidal::plan::detail::planning
