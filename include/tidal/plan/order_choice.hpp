// The execution order as a planner choice: tidal's plan on each of several traces of one
// iteration whose ops run in different orders (the micro-batch orders of transformer_trace()),
// each simulated, and the faster kept, with a lower bound that holds for the choice. Torch-free.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "tidal/plan/bound.hpp"
#include "tidal/plan/hardware.hpp"
#include "tidal/plan/policies.hpp"
#include "tidal/trace/trace.hpp"

namespace tidal::plan {

/// One order planned and simulated.
struct OrderCandidate {
  /// The trace's meta["micro_batch_order"], or "trace <i>" for a trace without it.
  std::string order;
  /// run_policy(Policy::kTidal) on the trace, fraction_of_ideal against its own ideal.
  PolicyResult tidal;
  /// stall_lower_bound() of the trace: no plan of this order beats it.
  StallBound bound;
  /// Wall time of stall_lower_bound() on this machine.
  double bound_wall_seconds = 0;
};

/// What choose_fastest_order() found.
struct OrderChoice {
  /// One per trace given, in the order given.
  std::vector<OrderCandidate> candidates;
  /// The candidate to run: the shortest simulated iteration among the plans that fit (among
  /// all when none fits); the earliest on a tie (iterations within a millionth of each other).
  std::size_t chosen = 0;
  /// The candidate whose bound is the shortest iteration (the earliest on a tie).
  std::size_t bound_from = 0;

  [[nodiscard]] const OrderCandidate& best() const { return candidates[chosen]; }
  /// The lower bound for the choice: the shortest of the candidates' bounds. No plan on any of
  /// the orders beats it, so the chosen plan's fraction of it stays a fraction of what is
  /// possible; each order's own bound would not (a plan on the other order may beat it).
  [[nodiscard]] const StallBound& bound() const { return candidates[bound_from].bound; }
};

/// Plans each trace with tidal's planner (options.planner), simulates the plan (options.sim),
/// computes each trace's lower bound, and chooses. The traces are meant to be one iteration in
/// different orders (the same ops and op times), so that their iterations compare; nothing
/// else is assumed. Planning time is the sum of the traces' (each is in its
/// PolicyResult::planning_seconds). `bound_progress`, when set, gets the share (0..1) of all the
/// bounds' sweeps done. Throws tidal::InvalidArgument when `traces` is empty or holds a null
/// pointer, and what run_policy() and stall_lower_bound() throw for a bad trace.
OrderChoice choose_fastest_order(const std::vector<const trace::Trace*>& traces, const Hardware& hw,
                                 const PolicyOptions& options = {},
                                 const std::function<void(double)>& bound_progress = {});

}  // namespace tidal::plan
