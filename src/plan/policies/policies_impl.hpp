// What the policies share (private to plan/): the plan and trace helpers of policies.cpp, and
// the ZeRO baselines of policies/zero.cpp. Torch-free.
#pragma once

#include <cstdint>
#include <vector>

#include "tidal/plan/hardware.hpp"
#include "tidal/plan/plan.hpp"
#include "tidal/plan/policies.hpp"
#include "tidal/trace/trace.hpp"

namespace tidal::plan::detail::policy {

/// The same trace with the host time before each next op folded into the op's duration, so
/// that a rewrite which copies or reorders ops and then retimes them keeps the iteration's time.
trace::Trace gaps_in_durations(const trace::Trace& t);

/// Recomputes start/end times from durations, back to back.
void retime(trace::Trace& t);

/// Sets every field of `a` (wraps from trigger and deadline).
void set_action(PlanAction& a, trace::TensorId id, std::uint64_t bytes, ActionKind kind,
                trace::OpIndex trigger, trace::OpIndex deadline, Target target);

/// A plan for `t` on `hw` with no actions.
Plan empty_plan(const trace::Trace& t, const Hardware& hw);

/// Sorts the plan's actions by trigger, kind and tensor.
void sort_actions(Plan& p);

/// The forward/backward pass of each op: a pass starts at the first forward op after a backward
/// op (with gradient accumulation, one pass per micro-batch). Never empty.
std::vector<int> pass_of_ops(const trace::Trace& t);

/// ZeRO-Offload (`infinity` false: optimizer states and step in host memory) or ZeRO-Infinity
/// (on the SSDs) on `tr`: its plan and simulation, with layer-wise activation checkpointing
/// where that fits better (policies/zero.cpp).
PolicyResult run_zero(const trace::Trace& tr, const Hardware& hw, const PolicyOptions& opt,
                      bool infinity);

}  // namespace tidal::plan::detail::policy
