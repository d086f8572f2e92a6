// The policies compared in one simulator: ideal, keep-all, layer-wise recompute, SSDTrain-like
// activation offloading, ZeRO-Offload-like, ZeRO-Infinity-like, and tidal's planner.
// docs/simulator.md states what each one models and assumes. Torch-free.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tidal/plan/hardware.hpp"
#include "tidal/plan/host_step.hpp"
#include "tidal/plan/plan.hpp"
#include "tidal/plan/planner.hpp"
#include "tidal/plan/simulator.hpp"
#include "tidal/trace/trace.hpp"

namespace tidal::plan {

enum class Policy : std::uint8_t {
  kIdeal,         ///< unlimited device memory: compute time only
  kKeepAll,       ///< everything in device memory (fits or not)
  kRecompute,     ///< layer-wise activation checkpointing
  kActivations,   ///< SSDTrain-like: large activations to SSD, fixed lookahead, adaptive keep
  kZeroOffload,   ///< parameters, gradients, optimizer states in host memory; CPU Adam
  kZeroInfinity,  ///< the same on NVMe
  kTidal,         ///< the lifetime-aware planner
};

const char* to_string(Policy p);
/// Inverse of to_string; throws tidal::InvalidArgument listing the names.
Policy policy_from_string(const std::string& s);
/// All policies, ideal first.
std::vector<Policy> all_policies();

struct PolicyOptions {
  SimOptions sim;
  PlannerOptions planner;
  /// SSDTrain skips tensors under 8 Mi elements (32 MiB in fp32).
  std::uint64_t activation_min_bytes = 32ull << 20;
  /// Prefetch lookahead of the activation policy in backward ops (about two leaf modules).
  int activation_lookahead_ops = 4;
  bool adaptive_keep = true;
  /// ZeRO-3 keeps parameters under this many bytes resident (param persistence threshold,
  /// 1e5 elements in fp32).
  std::uint64_t zero_persistence_bytes = 400000;
  /// ZeRO-3 fetches parameters ahead of their use only up to this many elements in flight
  /// (DeepSpeed's stage3_prefetch_bucket_size, default 5e7): a parameter's read starts at the
  /// use of the parameter before it, or earlier only while the parameters used in between stay
  /// under the bucket. 0: no bucket; each read starts one block of ops (a layer's forward ops)
  /// before its use.
  std::uint64_t zero_prefetch_bucket_elements = 50'000'000;
  /// ZeRO-Infinity's optimizer step on NVMe: false (DeepSpeed's default, pipeline_read and
  /// pipeline_write off) runs each sub-group's swap-in, CPU Adam and swap-out one after the
  /// other, so the step takes read + compute + write; true overlaps them (the maximum).
  bool zero_overlap_step_io = false;
  /// Where tidal's plan runs the optimizer step (host_step.hpp): on the device (the trace as
  /// recorded), on the host, or whichever of the two simulates faster.
  OptimizerPlacement optimizer_step = OptimizerPlacement::kDevice;
};

/// One policy's outcome on one trace and hardware.
struct PolicyResult {
  Policy policy = Policy::kIdeal;
  SimResult sim;
  bool fits = false;  ///< device (and, for ZeRO-Offload, host) memory suffices
  double fraction_of_ideal = 0;
  double planning_seconds = 0;  ///< tidal only
  std::string note;             ///< what was assumed or why it does not fit
  std::optional<Plan> plan;     ///< the plan simulated, where there is one
  /// tidal: the stall bound of the trace, where its planner computed it (make_plan's `bound`);
  /// with PolicyOptions::optimizer_step host or auto, the bound of the class that was
  /// considered (the lower of the two placements' where both were).
  std::optional<StallBound> bound;
  /// tidal: where the plan runs the optimizer step, and the trace the plan and the simulation
  /// are of where that is not the one given (the host step's device trace).
  OptimizerPlacement optimizer_step = OptimizerPlacement::kDevice;
  std::shared_ptr<const trace::Trace> plan_trace;
};

/// Runs one policy. `ideal_seconds` (> 0) sets fraction_of_ideal. Never throws for a policy
/// that cannot fit: the result says fits == false and why; throws tidal::Error for a bad trace.
PolicyResult run_policy(Policy policy, const trace::Trace& trace, const Hardware& hw,
                        const PolicyOptions& options = {}, double ideal_seconds = 0);

/// Runs several policies; ideal is computed first (also when not listed) for the fractions.
std::vector<PolicyResult> run_policies(const std::vector<Policy>& policies,
                                       const trace::Trace& trace, const Hardware& hw,
                                       const PolicyOptions& options = {});

/// Layer-wise activation checkpointing as a trace rewrite: tensors produced by a block's
/// forward ops and used only within that block (forward) and by its backward ops are freed
/// after the forward pass; the block's forward ops run again right before its first backward
/// op, producing copies that the backward ops use instead. Needs Op::layer; a trace without it
/// is returned unchanged.
trace::Trace recompute_trace(const trace::Trace& trace);
/// The same for the blocks of the first `layers` layers only (in every pass): the earliest
/// layers' activations live longest, from their forward op to the end of backward, so they save
/// the most memory for the compute they cost again. `layers` >= the model's layers: all.
trace::Trace recompute_trace(const trace::Trace& trace, int layers);
/// Checkpointing per layer: the first `whole_layers` layers run their blocks again whole; the
/// `selective_layers` after them run only their memory-bound ops again (norms, activation
/// functions, element-wise products: selective checkpointing, Korthikanti et al. 2022), whose
/// inputs backward keeps anyway. A selective layer saves those ops' outputs (a llama block's
/// norms, SiLU and gate product: about 40% of its activations) for a few percent of its time
/// instead of a whole forward pass.
struct Checkpointing {
  int whole_layers = 0;
  int selective_layers = 0;
};
trace::Trace recompute_trace(const trace::Trace& trace, Checkpointing checkpointing);
/// How a note names `checkpointing` of a model of `layers` layers.
std::string checkpointing_name(Checkpointing checkpointing, int layers);

/// The SSDTrain-like plan: activations of at least min_bytes leave after their last forward
/// use for the SSD and are prefetched `lookahead` ops before their first backward use; with
/// adaptive keep, the first block whose offload the write bandwidth cannot hide and every
/// block after it stay in memory. `note` (optional) receives a sentence about the choice.
Plan activation_plan(const trace::Trace& trace, const Hardware& hw, const PolicyOptions& options,
                     std::string* note = nullptr);

}  // namespace tidal::plan
