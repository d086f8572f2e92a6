#include <algorithm>
#include <atomic>
#include <chrono>
#include <future>
#include <optional>
#include <utility>
#include <vector>

#include "plan/bound_reference.hpp"
#include "plan/planner/planner_impl.hpp"
#include "plan/planner_reference.hpp"
#include "tidal/common/error.hpp"
#include "tidal/plan/bound.hpp"
#include "tidal/plan/planner.hpp"
#include "tidal/plan/simulator.hpp"

namespace tidal::plan {

Plan make_plan(const trace::Trace& trace, const Hardware& hw, const PlannerOptions& options,
               std::optional<StallBound>* bound) {
  return detail::make_plan_with(trace, hw, options, detail::PlannerInternals{}, bound);
}

namespace detail {

namespace {

using planning::Cancelled;
using planning::HostChoice;
using planning::Planner;

// A plan, the host-memory way it was made with, and its simulation where one was made.
struct WayPlan {
  Plan plan;
  HostChoice way = HostChoice::kByScore;
  std::optional<SimResult> sim;  // on the trace the plan is for
};

// Whether the machine makes the second host-memory way worth planning. It is planned where host
// memory was short (a migration went to the SSDs for want of room in it), the SSDs are the scarce
// channel (under half of the host channel's rate) and the plan stalls: plan again with host
// memory promised to the periods that save the most SSD traffic per byte held, and keep the plan
// whose simulated iteration is shorter (the planned stall is only an upper bound of it, and can
// rank the two wrongly). Where the SSDs carry half the link or more the second plan gains little
// and doubles the planning time.
bool ways_may_help(const Hardware& hw, const PlannerOptions& options) {
  const ChannelRates rates = hw.channels();
  const bool ssds_scarce = rates[Channel::kSsdRead] < 0.5 * rates[Channel::kHostRead] ||
                           rates[Channel::kSsdWrite] < 0.5 * rates[Channel::kHostWrite];
  return options.choose_host_by_density && options.use_host && hw.host_memory > 0 && ssds_scarce;
}

// The host-memory ways, the first by score. A third where host memory is short: the SSDs only
// for the periods over the ops where host memory cannot hold what must leave
// (HostChoice::kSsdWhereNeeded). The fastest plan that fits is kept.
std::vector<HostChoice> ways_of(const PlannerInternals& internals) {
  std::vector<HostChoice> ways = {HostChoice::kByScore, HostChoice::kDensest};
  if (internals.ssd_where_needed) ways.push_back(HostChoice::kSsdWhereNeeded);
  return ways;
}

// The plan whose simulated iteration is shortest among those that fit (the first where none
// fits); every plan has its simulation.
WayPlan fastest(std::vector<WayPlan> plans) {
  std::size_t best = 0;
  for (std::size_t i = 1; i < plans.size(); ++i) {
    const SimResult& r = *plans[i].sim;
    const SimResult& b = *plans[best].sim;
    if (r.fits && (!b.fits || r.iteration_seconds < b.iteration_seconds)) best = i;
  }
  return std::move(plans[best]);
}

// The planner's ways of making a plan for `trace`, the fastest kept (simulated on `real`, the
// trace the plan is for: `trace` itself, or the same ops with waits as time). With `only`, the
// one way given.
WayPlan plan_ways(const trace::Trace& trace, const trace::Trace& real, const Hardware& hw,
                  const PlannerOptions& options, const PlannerInternals& internals,
                  std::optional<HostChoice> only = std::nullopt) {
  if (only) return {Planner(trace, hw, options, internals, *only).run(), *only, std::nullopt};
  const bool may_need_ways = ways_may_help(hw, options);
  const std::vector<HostChoice> ways = ways_of(internals);
  // The ways after the first start on threads of their own at once, where the machine says they
  // may be needed (the first plan says whether they are): a Planner only reads the trace, and
  // on two cores the three ways then take about the time of the slowest and a half instead of
  // the first's and the slowest's. Where the first plan does not need them they are cancelled.
  // Only this thread reports progress (PlannerOptions::progress is called only on the thread
  // that called make_plan).
  std::atomic<bool> cancel{false};
  const auto plan_way = [&](HostChoice way) -> std::optional<WayPlan> {
    PlannerOptions o = options;
    o.progress = nullptr;
    Planner p(trace, hw, o, internals, way);
    p.cancel_on(&cancel);
    try {
      WayPlan w{p.run(), way, std::nullopt};
      if (cancel) return std::nullopt;
      w.sim = simulate(real, &w.plan, hw);
      return w;
    } catch (const Cancelled&) {
      return std::nullopt;
    }
  };
  std::vector<std::future<std::optional<WayPlan>>> others;
  const auto start_others = [&] {
    for (std::size_t i = 1; i < ways.size(); ++i) {
      others.push_back(std::async(std::launch::async, plan_way, ways[i]));
    }
  };
  if (may_need_ways && internals.ways_together) start_others();
  // The other threads are stopped and joined on every way out, an error included.
  struct StopOthers {
    std::atomic<bool>& cancel;
    std::vector<std::future<std::optional<WayPlan>>>& others;
    ~StopOthers() {
      cancel = true;
      for (auto& f : others) {
        if (f.valid()) f.wait();
      }
    }
  } stop_others{cancel, others};
  Planner first(trace, hw, options, internals);
  Plan by_score = first.run();
  if (!may_need_ways || !first.host_short() || by_score.summary.planned_stall_seconds <= 0) {
    return {std::move(by_score), HostChoice::kByScore, std::nullopt};
  }
  if (others.empty()) start_others();
  std::vector<WayPlan> plans;
  SimResult first_sim = simulate(real, &by_score, hw);
  plans.push_back({std::move(by_score), HostChoice::kByScore, std::move(first_sim)});
  for (auto& f : others) {
    std::optional<WayPlan> w = f.get();  // rethrows a thread's error
    TIDAL_EXPECT(w.has_value(), "planner: a host-memory way was cancelled; this is a bug");
    plans.push_back(std::move(*w));
  }
  return fastest(std::move(plans));
}

// The waits the stall bound says no plan avoids, per op: each window's stall spread over the
// window's ops by the bytes they use (after op k's compute: wait[k] is time before op k + 1).
std::vector<double> bound_waits(const trace::Trace& trace, const StallBound& bound) {
  std::vector<double> wait(trace.ops.size(), 0.0);
  const auto used = [&](const trace::Op& op) {
    double b = 0;
    for (const trace::TensorId t : op.inputs) b += static_cast<double>(at(trace.tensors, t).bytes);
    for (const trace::TensorId t : op.outputs) b += static_cast<double>(at(trace.tensors, t).bytes);
    return b;
  };
  const auto n = static_cast<trace::OpIndex>(trace.ops.size());
  for (const StallWindow& w : bound.windows) {
    // A window over the iteration's end (last < first) holds the ops from first to the end and
    // from 0 to last.
    std::vector<trace::OpIndex> ops;
    for (trace::OpIndex k = w.first;; k = (k + 1) % n) {
      ops.push_back(k);
      if (k == w.last) break;
    }
    double total = 0;
    for (const trace::OpIndex k : ops) total += used(at(trace.ops, k));
    for (const trace::OpIndex k : ops) {
      const double share =
          total > 0 ? used(at(trace.ops, k)) / total : 1.0 / static_cast<double>(ops.size());
      at(wait, k) += w.stall_seconds * share;
    }
  }
  return wait;
}

// The waits a simulated plan had, per op in bound_waits' terms (the wait before op k + 1 is
// time after op k).
std::vector<double> simulated_waits(const SimResult& sim, std::size_t ops) {
  std::vector<double> wait(ops, 0.0);
  for (std::size_t k = 0; k + 1 < ops && k + 1 < sim.stall_per_op.size(); ++k) {
    wait[k] = sim.stall_per_op[k + 1];
  }
  return wait;
}

// A plan of `trace` made as if op k took wait[k] seconds longer: the planner's buckets (rate x
// op time) then hold the transfers both channels can run while the iteration waits there. The
// waits are stalls the plan accepts, added to its planned ones. With `way`, that host-memory
// way alone; without, the ways of plan_ways, and `*chosen` says which was kept.
Plan plan_with_waits(const trace::Trace& trace, const std::vector<double>& wait, const Hardware& hw,
                     const PlannerOptions& options, const PlannerInternals& internals,
                     std::optional<HostChoice> way, HostChoice* chosen = nullptr) {
  trace::Trace longer = trace;
  double shift = 0;
  for (std::size_t k = 0; k < longer.ops.size(); ++k) {
    longer.ops[k].start_s += shift;
    shift += wait[k];
    longer.ops[k].end_s += shift;
  }
  WayPlan w = plan_ways(longer, trace, hw, options, internals, way);
  if (chosen != nullptr) *chosen = w.way;
  Plan p = std::move(w.plan);
  std::vector<double> stall = wait;
  for (const auto& [op, sec] : p.stalls) at(stall, op) += sec;
  p.stalls.clear();
  double total = 0;
  for (std::size_t k = 0; k < stall.size(); ++k) {
    if (stall[k] <= 0) continue;
    p.stalls.emplace_back(static_cast<trace::OpIndex>(k), stall[k]);
    total += stall[k];
  }
  p.summary.planned_stall_seconds = total;
  p.summary.compute_seconds = trace.compute_seconds();
  return p;
}

// What every planning pass of make_plan_with shares.
struct Inputs {
  const trace::Trace& trace;
  const Hardware& hw;
  const PlannerOptions& options;
  const PlannerInternals& internals;
};

// A plan within 1% of the bound is kept as it is: another round would gain at most that.
bool near_bound(const SimResult& x, const StallBound& bound) {
  return x.fits && x.iteration_seconds <= bound.iteration_seconds * 1.01;
}

// A later plan only where it is faster by more than a rounding error.
bool faster(const SimResult& x, const SimResult& than) {
  return x.fits && (!than.fits || x.iteration_seconds < than.iteration_seconds * (1 - 1e-9));
}

// Rounds with the best plan's own simulated waits (where it really waits, which the bound only
// bounds), while each is faster than the best so far. `best.sim` is its simulation.
WayPlan with_simulated_waits(const Inputs& in, const StallBound& bound, WayPlan best) {
  for (int r = 0; r < in.internals.wait_rounds; ++r) {
    const SimResult& best_sim = *best.sim;
    if (best_sim.stall_seconds <= 0 || near_bound(best_sim, bound)) break;
    Plan again = plan_with_waits(in.trace, simulated_waits(best_sim, in.trace.ops.size()), in.hw,
                                 in.options, in.internals, best.way);
    SimResult c = simulate(in.trace, &again, in.hw);
    if (!faster(c, best_sim)) break;
    best.plan = std::move(again);
    best.sim = std::move(c);
  }
  return best;
}

// The plan into the waits of `from` (bound_waits), with the host-memory ways chosen there, and
// its simulation.
WayPlan into_waits(const Inputs& in, const StallBound& from) {
  WayPlan w;
  w.plan = plan_with_waits(in.trace, bound_waits(in.trace, from), in.hw, in.options, in.internals,
                           std::nullopt, &w.way);
  w.sim = simulate(in.trace, &w.plan, in.hw);
  return w;
}

// PlannerInternals::waits_first: the bound first. Where it says the iteration waits, the plan of
// the trace as it is (whose least-stall fallback is most of the planning time where a plan
// stalls long) is not made; the plan into the bound's stalls takes its place, with the
// host-memory ways chosen there, and then up to wait_rounds rounds of its simulated waits.
// The planner plans into the bound's windows without its peaks between a write and a read
// (docs/simulator.md): each of those is a bound only with its other half, and planning into
// them made plans slower.
Plan plan_bound_first(const Inputs& in, std::optional<StallBound>* bound_out) {
  const trace::Trace& trace = in.trace;
  StallBound bound;
  StallBound one_iteration;  // the windows of one iteration, which the bound computes first
  const StallBound full = stall_lower_bound_and_windows(trace, in.hw, {}, &one_iteration, &bound);
  if (bound_out != nullptr) *bound_out = full;
  if (bound.stall_seconds <= 0) {
    WayPlan plain = plan_ways(trace, trace, in.hw, in.options, in.internals);
    if (plain.plan.summary.planned_stall_seconds <= 0) return std::move(plain.plan);
    if (!plain.sim) plain.sim = simulate(trace, &plain.plan, in.hw);
    return with_simulated_waits(in, bound, std::move(plain)).plan;
  }
  // Where the bound's windows run over the iteration's end (docs/simulator.md, "Windows over
  // the iteration's end"), the plan goes into the waits of the windows of one iteration first
  // (usually the faster of the two), and into the bound's own only where that plan is still
  // over far_from_bound times the bound, the faster kept.
  const bool wraps = std::any_of(bound.windows.begin(), bound.windows.end(),
                                 [](const StallWindow& w) { return w.last < w.first; });
  const StallBound linear = wraps ? std::move(one_iteration) : StallBound{};
  WayPlan into = into_waits(in, wraps && linear.stall_seconds > 0 ? linear : bound);
  if (wraps && linear.stall_seconds > 0 && in.internals.far_from_bound > 0 &&
      (!into.sim->fits ||
       into.sim->iteration_seconds > in.internals.far_from_bound * bound.iteration_seconds)) {
    WayPlan other = into_waits(in, bound);
    if (faster(*other.sim, *into.sim)) into = std::move(other);
  }
  WayPlan best = with_simulated_waits(in, bound, std::move(into));
  // Far from the bound (over twice it), where the bound's waits say little about where a plan
  // waits, or where it does not fit, the plan of the trace as it is is made too, and the faster
  // kept (PlannerFuzz.PlanningIntoTheWaitsFirstFitsAndKeepsPace: random traces whose stall is
  // tens of times their compute).
  if (best.sim->fits && best.sim->iteration_seconds <= 2 * bound.iteration_seconds) {
    return std::move(best.plan);
  }
  WayPlan plain = plan_ways(trace, trace, in.hw, in.options, in.internals);
  const SimResult a = plain.sim ? std::move(*plain.sim) : simulate(trace, &plain.plan, in.hw);
  return faster(a, *best.sim) ? std::move(plain.plan) : std::move(best.plan);
}

// Without PlannerInternals::waits_first: the plan of the trace first; then, where it stalls, the
// plan into the bound's stalls with the host-memory way that the first plan kept (planning the
// ways again there gains nothing and takes about a quarter more time), and rounds of simulated
// waits; the fastest in simulation is kept.
Plan plan_trace_first(const Inputs& in, std::optional<StallBound>* bound_out) {
  const trace::Trace& trace = in.trace;
  WayPlan first = plan_ways(trace, trace, in.hw, in.options, in.internals);
  if (first.plan.summary.planned_stall_seconds <= 0) return std::move(first.plan);
  StallBound bound;
  const StallBound full = stall_lower_bound_and_windows(trace, in.hw, {}, nullptr, &bound);
  if (bound_out != nullptr) *bound_out = full;
  if (bound.stall_seconds <= 0) return std::move(first.plan);
  if (!first.sim) first.sim = simulate(trace, &first.plan, in.hw);
  if (near_bound(*first.sim, bound)) return std::move(first.plan);
  WayPlan into{
      plan_with_waits(trace, bound_waits(trace, bound), in.hw, in.options, in.internals, first.way),
      first.way, std::nullopt};
  into.sim = simulate(trace, &into.plan, in.hw);
  return with_simulated_waits(in, bound,
                              faster(*into.sim, *first.sim) ? std::move(into) : std::move(first))
      .plan;
}

}  // namespace

Plan make_plan_with(const trace::Trace& trace, const Hardware& hw, const PlannerOptions& options,
                    const PlannerInternals& internals, std::optional<StallBound>* bound_out) {
  if (bound_out != nullptr) bound_out->reset();
  TIDAL_EXPECT_AS(InvalidArgument, hw.device_memory > 0,
                  "the hardware model has no device memory capacity; give it one");
  const auto t0 = std::chrono::steady_clock::now();
  const Inputs in{trace, hw, options, internals};
  Plan plan;
  if (!internals.plan_into_waits) {
    plan = plan_ways(trace, trace, hw, options, internals).plan;
  } else if (internals.waits_first) {
    // Planning into the stalls no plan avoids (docs/simulator.md, planner step 8): the greedy
    // books each transfer in per-op buckets of rate x op time, so where the bound says the
    // iteration must wait (the optimizer step, which reads and writes the whole model state in
    // milliseconds of compute) the buckets are nearly empty, and the reads it needs land in the
    // ops before it and its writes in the ops after it, while in the wait itself one channel
    // idles. Given the wait as time, both channels book it.
    plan = plan_bound_first(in, bound_out);
  } else {
    plan = plan_trace_first(in, bound_out);
  }
  plan.summary.planning_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return plan;
}

}  // namespace detail
}  // namespace tidal::plan
