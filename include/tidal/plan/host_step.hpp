// The optimizer step on the host as a class of plans: the fp32 master weights, the gradient
// accumulators and the Adam moments live in host memory; the device holds the weights' 16-bit
// copies (what its matmuls read) and makes 16-bit gradients, which leave after their last use;
// the host accumulates them and runs each parameter's Adam step as soon as its last gradient is
// in, then the new 16-bit copy goes back before the next forward pass uses it. ZeRO-Offload,
// torchao's CPUOffloadOptimizer and FSDP2's CPUOffloadPolicy place the step this way; here the
// planner also moves the device's tensors in their idle periods, and chooses between this and
// the step on the device (PolicyOptions::optimizer_step). Torch-free.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "tidal/plan/bound.hpp"
#include "tidal/plan/hardware.hpp"
#include "tidal/plan/planner.hpp"
#include "tidal/plan/simulator.hpp"
#include "tidal/trace/trace.hpp"

namespace tidal::plan {

/// Where the optimizer step runs.
enum class OptimizerPlacement : std::uint8_t {
  kDevice,  ///< on the device, over the state the plan moves (the trace as recorded)
  kHost,    ///< on the host, over host-resident fp32 state (host_step_model())
  kAuto,    ///< both planned and simulated; the faster that fits is kept
};
/// "device", "host", "auto".
const char* to_string(OptimizerPlacement p);
/// Inverse of to_string; throws tidal::InvalidArgument listing the names.
OptimizerPlacement optimizer_placement_from_string(const std::string& s);

/// Where the gradients of several micro-batches (forward/backward passes) add up, with the
/// optimizer step on the host.
enum class GradientAccumulation : std::uint8_t {
  /// Each pass's gradient goes to host memory after its last use there, 16-bit where it holds
  /// one micro-batch of a bf16-mixed trace (autocast's gradient before its cast to fp32), and
  /// the host adds it into the fp32 gradient (a host task per pass).
  kHost,
  /// The gradient stays one tensor over the passes, at the trace's gradient size (fp32), and the
  /// planner moves it between its uses like any other; it goes to host memory once, after the
  /// last pass's last use.
  kDevice,
};
const char* to_string(GradientAccumulation a);

/// A trace rewritten for the optimizer step on the host.
struct HostStepModel {
  GradientAccumulation accumulation = GradientAccumulation::kHost;
  /// The device's ops: the trace without its optimizer ops and states; parameters at their
  /// 16-bit size where the trace is bf16-mixed; the gradients as `accumulation` says (with
  /// kHost, one per forward/backward pass: each micro-batch's in the sequential order, the
  /// whole batch's in the layer-major order, where a layer's micro-batches accumulate on the
  /// device at the trace's gradient size).
  trace::Trace device;
  /// The host's work: per gradient of a pass before the last, its accumulation into the fp32
  /// gradient; per parameter, the last pass's accumulation and the Adam step, which refreshes
  /// the 16-bit copy. Each follows the op after which its gradient is complete.
  std::vector<HostTask> tasks;
  /// The gradients that leave device memory for host memory after their last use, with the op
  /// their offload must be done by (the next pass's first op; op 0 of the next iteration for
  /// the last pass), in `device`'s ids.
  std::vector<trace::TensorId> drained;
  std::vector<trace::OpIndex> drain_deadline;
  /// The parameters the host step rewrites, in `device`'s ids: each leaves device memory after
  /// its last use and comes back from host memory once its task is done.
  std::vector<trace::TensorId> refreshed;
  /// The Adam task of each refreshed parameter (index into `tasks`), parallel to `refreshed`.
  std::vector<std::size_t> refresh_task;
  /// Host memory the step's state takes: fp32 master weights, gradients and two moments (16
  /// bytes a parameter). The device copies' host side is the plan's (the simulator counts it).
  std::uint64_t host_state_bytes = 0;
  double host_seconds = 0;  ///< the tasks' CPU time per iteration
  std::int64_t parameters = 0;
};

/// Builds the model of `trace` on `hw`: the host's task times from Hardware::cpu_adam_rate and
/// Hardware::cpu_accumulate_rate. Works on traces whose optimizer ops each update parameters
/// with their gradients (one AdamW op per parameter, as the analytic traces have, or multi-tensor
/// ops listing parameters and gradients in the same order). Throws tidal::InvalidArgument when
/// the trace has no optimizer op, when an optimizer op's parameters and gradients do not pair
/// up, when either rate is 0, or when the host-memory channels have no bandwidth
/// (Hardware::channels(): the SSDs take the whole link, or there is no host memory).
HostStepModel host_step_model(const trace::Trace& trace, const Hardware& hw,
                              GradientAccumulation accumulation = GradientAccumulation::kHost);

/// The plan tidal's planner makes for the model: the device trace planned within the device
/// memory (less `reserve` bytes kept for gradients on their way out) and the host memory the
/// step's state leaves, then each drained gradient's offload to host memory and each refreshed
/// parameter's way out after its last use and back from host memory (at the planner's trigger
/// where it had moved the parameter over the iteration's end, else right after its way out: the
/// simulator holds the read until the task is done). Throws what make_plan() throws.
Plan host_step_plan(const HostStepModel& model, const Hardware& hw, const PlannerOptions& options,
                    std::uint64_t reserve);

/// A lower bound on the iteration of any plan of the class: the largest of
/// - the device trace's own stall bound (stall_lower_bound(): the class only adds constraints),
/// - the host tasks' CPU time (one host timeline),
/// - the drained bytes over the host-write channel, the refreshed bytes over the host-read one,
/// - for each parameter, the compute from its first use to the op that completes its last
///   gradient, plus that gradient's way out, its Adam task and its 16-bit copy's way back at
///   full rate: the next iteration's first use waits for all of it.
/// StallBound::stall_seconds is counted from `compute_seconds` (the original trace's compute,
/// so that the bound compares with the device step's); `limit` names the largest term.
StallBound host_step_bound(const HostStepModel& model, const Hardware& hw, double compute_seconds,
                           const std::function<void(double)>& progress = {});

}  // namespace tidal::plan
