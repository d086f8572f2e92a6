// Replays a trace with a plan on a hardware model: iteration time with stalls, memory per op,
// channel utilisation, bytes written per iteration, SSD lifetime. Torch-free.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tidal/plan/hardware.hpp"
#include "tidal/plan/plan.hpp"
#include "tidal/plan/schedule.hpp"
#include "tidal/trace/trace.hpp"

namespace tidal::plan {

/// Work the host CPU does beside the device's ops, in a plan whose optimizer step runs on the
/// host (host_step.hpp): accumulating a gradient the device sent, or one parameter's Adam step.
/// The host runs its tasks one at a time, in the order they are queued; the device does not
/// wait for them, only for the tensors they rewrite.
struct HostTask {
  std::string name;
  trace::OpIndex after = 0;  ///< queued when this device op ends, every iteration
  double seconds = 0;        ///< host CPU time
  /// Device tensors the task reads from host memory: it starts once the plan's offload of each
  /// (to host memory, issued at or before `after`) has completed.
  std::vector<trace::TensorId> inputs;
  /// Device tensors whose host copy the task rewrites (a parameter's 16-bit copy): their device
  /// copy is stale from then on, and their next read from host memory starts once the task is
  /// done. The plan must have them away from device memory at that point.
  std::vector<trace::TensorId> refreshes;
};

struct SimOptions {
  /// Iterations replayed; the last one is reported (the first starts with every persistent
  /// tensor in device memory, the later ones are in steady state). At least 1.
  int iterations = 3;
  /// An offload of a tensor that is unchanged since it was last written to the same target
  /// costs no write: each tier keeps its copy until the tensor is modified, whatever the other
  /// tier does (ZeRO's parameter release works this way too).
  bool skip_clean_writes = true;
  /// Channel rates; unset: Hardware::channels().
  std::optional<ChannelRates> channels;
  /// Fill SimResult::residency (ops x tensors states: for tests and comparisons).
  bool record_residency = false;
  /// The host CPU's share of the iteration (empty: none).
  std::vector<HostTask> host_tasks;
};

/// What one replayed iteration did. All byte counts are per iteration.
struct SimResult {
  double iteration_seconds = 0;
  double compute_seconds = 0;  ///< sum of op times, with the host time between ops
  /// Compute the iteration's transfers took from the device (Hardware::compute_seconds_per_byte;
  /// 0 on a GPU).
  double io_compute_seconds = 0;
  double stall_seconds = 0;  ///< iteration_seconds - compute_seconds - io_compute_seconds
  std::vector<std::uint64_t> memory_per_op;  ///< device bytes while op k runs
  std::vector<double> stall_per_op;          ///< seconds op k waited for transfers to start
  /// Seconds each channel (index_of(Channel)) was busy from op k's turn (its wait included) to
  /// the next op's: where the iteration used its bandwidth.
  std::vector<std::array<double, kNumChannels>> busy_per_op;
  std::uint64_t peak_bytes = 0;
  trace::OpIndex peak_op = 0;
  std::uint64_t capacity_bytes = 0;
  bool fits = false;  ///< peak_bytes <= capacity_bytes
  std::uint64_t ssd_bytes_written = 0;
  std::uint64_t ssd_bytes_read = 0;
  std::uint64_t host_bytes_written = 0;
  std::uint64_t host_bytes_read = 0;
  std::uint64_t peak_host_bytes = 0;  ///< host memory holding offloaded tensors at once
  std::uint64_t peak_ssd_bytes = 0;   ///< SSD bytes holding offloaded tensors at once
  double ssd_write_utilisation = 0;   ///< busy share of the iteration, 0..1
  double ssd_read_utilisation = 0;
  double host_write_utilisation = 0;
  double host_read_utilisation = 0;
  std::int64_t misses = 0;     ///< tensors needed but not resident nor on their way (read late)
  std::int64_t forwarded = 0;  ///< prefetches answered by a tensor whose write was in flight
  /// Host CPU time of the host tasks queued in the iteration (SimOptions::host_tasks), and the
  /// tensor reads that waited for one (a refreshed tensor the plan wanted back earlier).
  double host_task_seconds = 0;
  std::int64_t refresh_waits = 0;
  /// Days until the SSDs reach their rated endurance at this rate (0: no SSD writes or no
  /// endurance figure); iterations likewise.
  double ssd_lifetime_days = 0;
  double ssd_lifetime_iterations = 0;
  /// With SimOptions::record_residency: where each tensor is as each op of the reported
  /// iteration comes up, before anything is done for it (by op, then by tensor id).
  std::vector<std::vector<Residency>> residency;
};

/// Replays `trace` with `plan` (nullptr: keep everything) on `hw`: the reference engine of the
/// plan's Schedule (schedule.hpp), which the plan executor runs for real.
///
/// Model: ops run in trace order for their recorded duration, each followed by the host time
/// the trace recorded before the next (Trace::op_seconds). An op starts when
/// the previous one has ended, every tensor it uses is resident (prefetch reads done; a tensor
/// neither resident nor being read is read at once, counted as a miss) and every offload whose
/// deadline is this op has completed. Each channel (ChannelRates) moves one transfer at a time
/// at its full rate, earliest deadline first, preempting. Device memory counts a tensor from
/// its creation (or prefetch issue) until its free point (or offload completion).
///
/// Host tasks (SimOptions::host_tasks) run on their own timeline: each starts when the host is
/// free, its op has ended and its inputs' offloads are done; a read of a tensor it refreshes
/// (the plan's prefetch, or the op that needs it) starts no earlier than the task's end.
///
/// Throws tidal::InvalidArgument when the plan does not match the trace or uses a channel whose
/// rate is zero, or when a host task reads a tensor the plan does not write to host memory.
SimResult simulate(const trace::Trace& trace, const Plan* plan, const Hardware& hw,
                   const SimOptions& options = {});

}  // namespace tidal::plan
