// The offloading plan: which tensor leaves device memory after which op, where it goes, and
// when it must be back. Made by the planner (planner.hpp), replayed by the simulator
// (simulator.hpp), executed by the runtime executor. The JSON form is docs/plan-format.md.
// Torch-free.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tidal/plan/tiers.hpp"
#include "tidal/trace/trace.hpp"

namespace tidal::plan {

/// Version of the JSON schema written by plan_to_json (docs/plan-format.md).
inline constexpr int kPlanVersion = 1;

enum class ActionKind : std::uint8_t {
  kOffload,   ///< write the tensor out, then release its device memory
  kPrefetch,  ///< allocate device memory and read the tensor back
  /// Copy a tensor offloaded to the SSDs into host memory (target kHost), over the SSD read
  /// channel, so that its prefetch from host memory later comes over the faster host link: the
  /// SSDs read early, while host memory has room, and device memory is taken only just before
  /// the use. The tensor stays away from device memory; host memory holds it from the stage's
  /// issue on.
  kStage,
};

const char* to_string(ActionKind k);
/// Inverses of to_string; throw tidal::InvalidArgument on an unknown name. A plan's target is
/// "ssd" or "host" (never "device").
ActionKind action_kind_from_string(const std::string& s);
Target target_from_string(const std::string& s);

/// One migration. Every kind is issued when the trigger op ends and must have completed before
/// the deadline op starts:
/// - offload: the device memory is released when the write completes, at the latest before the
///   deadline op (the planner counts the tensor as gone from the deadline op on);
/// - prefetch: the device memory is allocated when issued (counted from trigger + 1 on) and the
///   tensor is resident before the deadline op, which uses it;
/// - stage: host memory is allocated when issued and the tensor's SSD copy is in it before the
///   deadline op (its prefetch's trigger op), so that its prefetch (target kHost) reads host
///   memory.
/// When deadline <= trigger, the deadline op is in the next iteration (wraps == true): the
/// period of a persistent tensor that spans the iteration boundary.
struct PlanAction {
  trace::TensorId tensor = 0;
  ActionKind kind = ActionKind::kOffload;
  trace::OpIndex trigger = 0;
  trace::OpIndex deadline = 0;
  Target target = Target::kSsd;
  std::uint64_t bytes = 0;  ///< the tensor's bytes (for checking and for readers)
  bool wraps = false;       ///< deadline is in the next iteration (deadline <= trigger)
};

/// What the planner concluded, for people and for the CLI's summary.
struct PlanSummary {
  std::uint64_t capacity_bytes = 0;     ///< device memory the plan was made for
  std::uint64_t target_bytes = 0;       ///< capacity minus the safety margin
  std::uint64_t peak_before_bytes = 0;  ///< peak live bytes with everything kept
  std::uint64_t peak_after_bytes = 0;   ///< planned peak (the planner's model)
  trace::OpIndex peak_after_op = 0;
  std::int64_t candidates = 0;  ///< inactive periods considered
  std::int64_t offloads_ssd = 0;
  std::int64_t offloads_host = 0;
  std::uint64_t bytes_to_ssd = 0;     ///< bytes written to SSD per iteration
  std::uint64_t bytes_to_host = 0;    ///< bytes written to host memory per iteration
  std::uint64_t peak_host_bytes = 0;  ///< host memory used at once
  double planned_stall_seconds = 0;   ///< stalls the plan accepted (least-stall fallback)
  double compute_seconds = 0;         ///< sum of op times of the trace
  double planning_seconds = 0;        ///< wall time of the planner
  bool fits = false;                  ///< planned peak <= capacity
};

/// A plan for one trace on one hardware model. Plain data; copyable; no synchronisation.
/// Actions are sorted by (trigger, kind, tensor).
struct Plan {
  int version = kPlanVersion;
  std::string model;     ///< Trace::model it was made for
  std::string hardware;  ///< Hardware::name
  std::int32_t num_ops = 0;
  std::int32_t num_tensors = 0;
  std::vector<PlanAction> actions;
  /// Stalls the plan accepts, as (op, seconds): the op may start that much later than compute
  /// alone allows, because the migrations before it need the time.
  std::vector<std::pair<trace::OpIndex, double>> stalls;
  PlanSummary summary;
};

/// JSON text of a plan (docs/plan-format.md) and its inverse. plan_from_json throws
/// tidal::InvalidArgument on a wrong version, a missing field or an unknown name.
std::string plan_to_json(const Plan& plan);
Plan plan_from_json(const std::string& text);
/// JSON text of a plan's summary alone (the "summary" object of plan_to_json).
std::string summary_to_json(const PlanSummary& summary);

/// Files. Throw tidal::Error when the file cannot be written or read, InvalidArgument when its
/// content is not a plan.
void write_plan(const Plan& plan, const std::string& path);
Plan read_plan(const std::string& path);

/// Checks a plan against the trace it is for: op and tensor indices in range, bytes equal to
/// the tensor's, a prefetch only for a tensor offloaded before, deadline/wraps consistent.
/// Throws tidal::InvalidArgument naming the first bad action.
void validate_plan(const Plan& plan, const trace::Trace& trace);

}  // namespace tidal::plan
