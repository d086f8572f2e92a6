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

/// The trace without its optimizer step and the optimizer states: the tensors and ops that are
/// left, renumbered; `op_remap` takes each given op to its new index (trace::kNoOp for the
/// dropped), `tensor_remap` (when given) each given tensor to its new id (-1 for the dropped).
/// Producers and frees are left to fix_moved_tensors().
trace::Trace without_optimizer(const trace::Trace& in, std::vector<trace::OpIndex>& op_remap,
                               std::vector<trace::TensorId>* tensor_remap = nullptr);
/// A fresh gradient per forward/backward pass (pass_of_ops()): the first op of a later pass
/// that accumulates into a gradient becomes the maker of a new tensor, which the pass's later
/// ops use instead (offloaded gradient accumulation: each pass's gradient leaves the device).
/// `origin` (when given) receives, for every tensor after the split, the tensor it was copied
/// from (itself for the given ones).
void split_gradients_per_pass(trace::Trace& t, std::vector<trace::TensorId>* origin = nullptr);
/// Fixes producers, frees and output slots after without_optimizer() and
/// split_gradients_per_pass(): gradients are per-iteration tensors made by their first use
/// where that use writes them; the other non-persistent tensors keep their producer and free,
/// moved by `op_remap`.
void fix_zero_tensors(trace::Trace& out, const std::vector<trace::OpIndex>& op_remap);
/// Bytes per parameter element of a trace: meta["parameter_element_bytes"] where a rewrite set
/// it, else 2 where the whole trace is bf16, else 4 (fp32, and bf16-mixed's fp32 weights).
double parameter_element_bytes(const trace::Trace& t);
/// ZeRO-Offload (`infinity` false: optimizer states and step in host memory) or ZeRO-Infinity
/// (on the SSDs) on `tr`: its plan and simulation, with layer-wise activation checkpointing
/// where that fits better (policies/zero.cpp).
PolicyResult run_zero(const trace::Trace& tr, const Hardware& hw, const PolicyOptions& opt,
                      bool infinity);

/// tidal's planner with the optimizer step on the host (host_step.hpp): the plan of the
/// model's device trace, simulated with the host's tasks; PolicyResult::plan_trace is that
/// trace and PolicyResult::bound the class's bound (host_step_bound()). Throws what
/// host_step_model() and make_plan() throw (src/plan/host_step.cpp).
PolicyResult run_host_step(const trace::Trace& tr, const Hardware& hw, const PolicyOptions& opt);

}  // namespace tidal::plan::detail::policy
