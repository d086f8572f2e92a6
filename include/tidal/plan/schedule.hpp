// A plan compiled for execution: per op, the tensors it makes, uses and frees, the memory it
// allocates, and the migrations issued when it ends, each with its tier, channel and deadline.
// The simulator (simulator.hpp, the reference engine) and the plan executor (the real one,
// torch/executor.hpp) both run a Schedule, so that they take the same decisions on the same
// plan and differ only in time. Torch-free.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "tidal/plan/plan.hpp"
#include "tidal/plan/tiers.hpp"
#include "tidal/trace/trace.hpp"

namespace tidal::plan {

/// One migration of a schedule: a PlanAction with its channel and its urgency resolved.
struct Migration {
  trace::TensorId tensor = 0;
  ActionKind kind = ActionKind::kOffload;
  trace::OpIndex issue = 0;     ///< issued when this op ends
  trace::OpIndex deadline = 0;  ///< complete before this op starts (next iteration if wraps)
  bool wraps = false;
  Tier tier = Tier::kSsd;  ///< the lower tier written to or read from (a stage's: host memory)
  /// channel_of(tier, kind's direction); a stage's: Channel::kSsdRead.
  Channel channel = Channel::kSsdWrite;
  std::uint64_t bytes = 0;
  /// Urgency: the deadline's position counted from the start of the issuing iteration (the
  /// deadline, plus the iteration's op count when it wraps). Smaller is more urgent; both
  /// engines serve transfers, and hold back prefetches, in this order.
  std::int64_t due = 0;
};

/// Where a tensor is as an op starts, in both engines' terms. Snapshots of it per op
/// (SimOptions::record_residency, ExecutorOptions::on_op_start) are how the simulator and the
/// executor are compared.
enum class Residency : std::uint8_t {
  kAbsent,    ///< not alive (before its producer, after its last use)
  kResident,  ///< in device memory
  kLeaving,   ///< in device memory, its write to a lower tier in flight
  kAway,      ///< in a lower tier only
  kArriving,  ///< on its way back (a read in flight, or a prefetch issued and waiting its turn)
};
const char* to_string(Residency r);
/// True for the states in which the tensor's bytes are (or are about to be) in device memory
/// for the op that needs them: resident or arriving.
constexpr bool on_device_side(Residency r) {
  return r == Residency::kResident || r == Residency::kArriving;
}

struct Schedule {
  std::int32_t num_ops = 0;
  std::int32_t num_tensors = 0;
  /// Sorted by (issue, due, kind, tensor).
  std::vector<Migration> migrations;
  /// By op: indices into `migrations` issued when the op ends, most urgent first.
  std::vector<std::vector<std::int32_t>> issued_after;
  /// By op: the tensors it reads or writes; the tensors that come alive before it runs; the
  /// tensors dead after it (a persistent tensor with a gap dies and is made anew).
  std::vector<std::vector<trace::TensorId>> uses;
  std::vector<std::vector<trace::TensorId>> created;
  std::vector<std::vector<trace::TensorId>> freed;
  /// By op: the device memory it allocates (its workspace and the tensors it produces).
  std::vector<std::uint64_t> new_bytes;
  /// By tensor: the ops that use it, ascending.
  std::vector<std::vector<trace::OpIndex>> uses_of;
  /// Bytes the migrations move per iteration, per channel.
  std::array<std::uint64_t, kNumChannels> planned_bytes{};
};

/// Compiles `plan` (nullptr: no migrations) for `trace`.
///
/// strict: the plan is checked first (validate_plan; throws tidal::InvalidArgument naming the
/// first bad action), as the simulator wants. Otherwise only plans for another trace are
/// refused, and actions out of range are dropped: the executor runs any plan for its trace,
/// since a wrong plan costs time, never correctness.
Schedule compile_schedule(const trace::Trace& trace, const Plan* plan, bool strict = true);

}  // namespace tidal::plan
