// How the planner runs its stages (private to plan/): make_plan's settings, and the reference
// settings (a least-stall fallback that scans every candidate, the exact greedy) that the tests
// compare plans with. Torch-free.
#pragma once

#include "tidal/plan/hardware.hpp"
#include "tidal/plan/plan.hpp"
#include "tidal/plan/planner.hpp"
#include "tidal/trace/trace.hpp"

namespace tidal::plan::detail {

/// The planner's internal choices; the defaults are make_plan's.
struct PlannerInternals {
  /// A transfer the least-stall fallback moves ends at its booked buckets: a moved prefetch
  /// starts at the first bucket it has bytes in, a moved offload completes at the last. false:
  /// it starts (completes) next to the op it was moved for, and the next op over the target
  /// moves it again at no cost; on Llama3-70B with 200 blocks 5.57 of the fallback's 5.60
  /// million moves were such nominal ones.
  bool booked_spans = true;
  /// The fallback asks an index (segment_trees.hpp's IntervalStab) for the candidates that can
  /// still leave device memory at an op; false: it scans every candidate at every op.
  bool index_candidates = true;
  /// The greedy commits a re-scored candidate when its score is within this share of the best
  /// score still queued (a (1 - tolerance)-approximate lazy greedy); 1e-12: exact up to
  /// rounding, but it re-scores each candidate many times on a long trace; 1e-2 re-scores far
  /// fewer for plans as good (docs/simulator.md, planner step 4).
  double greedy_tolerance = 1e-2;
  /// Where make_plan plans a second time (host memory short, SSDs scarce, a stall), it also
  /// plans a third time with the SSDs only where host memory cannot hold what must leave. Off:
  /// with waits_first the third plan is rarely the one kept, and it takes a third of the
  /// planning time where it runs.
  bool ssd_where_needed = false;
  /// Where the plan of the trace as it is stalls, plan it again with each window of the stall
  /// bound (bound.hpp) given its stall as time, then once more with the faster plan's own
  /// simulated waits, and keep the fastest in simulation (docs/simulator.md, planner step 8).
  bool plan_into_waits = true;
  /// With plan_into_waits, where the stall bound is positive, the plan of the trace as it is is
  /// not made: the plan into the bound's stalls comes first, with the host-memory ways chosen
  /// there (docs/simulator.md, planner step 8). false: the plan of the trace first, the others
  /// only where it stalls, the fastest kept (never slower than the plan of the trace, and about
  /// twice the time where it stalls long).
  bool waits_first = true;
  /// With plan_into_waits, rounds of planning again with the best plan's own simulated waits,
  /// each kept only where faster, stopping at the first that is not (the reference: 1).
  int wait_rounds = 3;
  /// With waits_first, where the stall bound's windows run over the iteration's end: the plan
  /// into the waits of the windows of one iteration comes first, and where it is over this many
  /// times the bound, a second plan into the bound's own waits, the faster kept (0: never).
  /// A lower factor makes the second plan more often for little gain; a higher one misses the
  /// traces where it wins.
  double far_from_bound = 1.12;
  /// A period of a tensor unchanged since an earlier planned migration of it to the same tier
  /// (and none to the other tier since) books no write: the tier still holds that version,
  /// and the simulator drops the tensor without writing it (SimOptions::skip_clean_writes).
  /// false: every offload books its write.
  bool clean_copies = true;
  /// With clean_copies: where a period's write would keep it in device memory over ops above
  /// the target, an earlier period of the version (none of them planned; the longest in compute
  /// time whose transfers fit) is planned too, so that the write runs there and the period
  /// leaves at once with no write.
  bool write_ahead = true;
  /// Where the machine makes the second and third host-memory ways possible, they start beside
  /// the first and are cancelled where it does not need them; false: they start once the first
  /// plan says it needs them. The plans are the same; only the time differs.
  bool ways_together = true;
  /// The greedy re-queues a popped candidate without evaluating it where the over-target time
  /// of its whole period (an upper bound of its score) is already under the next entry's key;
  /// false: every popped candidate is evaluated. Still a (1 - tolerance)-approximate lazy
  /// greedy, but near-ties may be committed in another order.
  bool greedy_bound_skip = true;
  /// Periods on the SSDs may come back through host memory (PlannerOptions::stage_via_host, which
  /// must be on too); false: every prefetch reads the tier written to.
  bool stage_via_host = true;
  /// After the greedy and the fallback, periods on the SSDs move to host memory where it has
  /// room and the host link does their transfers no later (docs/simulator.md, planner step 11);
  /// false: a period stays on the tier the greedy or the fallback chose.
  bool retarget_to_host = true;
};

/// The reference settings: nominal moves, a scan of every candidate, the exact greedy, two ways
/// where host memory is short, and none of the later stages (waits, clean copies, write ahead,
/// bound skip, staging, retargeting).
inline PlannerInternals reference_internals() {
  return {false, false, 1e-12, false, false, false, 1,
          0.0,   false, false, false, false, false, false};
}

/// make_plan() with the given internals.
Plan make_plan_with(const trace::Trace& trace, const Hardware& hw, const PlannerOptions& options,
                    const PlannerInternals& internals,
                    std::optional<StallBound>* bound_out = nullptr);

}  // namespace tidal::plan::detail
