// The steps before the first plan, simulated: warm-up and profiled steps run under the memory
// budget with no plan (the session's planless executor, docs/runtime.md): every op's tensors are
// read back when it needs them, and when memory is short the tensors read least recently are
// written out at once. All I/O is synchronous with compute (nothing is known ahead). Together
// with a plan's simulated step this says what profiling costs and how soon the plan pays for
// it. Torch-free.
#pragma once

#include <cstdint>
#include <string>

#include "tidal/plan/hardware.hpp"
#include "tidal/trace/trace.hpp"

namespace tidal::plan {

struct ProfilingPhase {
  int steps = 0;                    ///< steps before the plan (warm-up + profiled)
  bool fits = false;                ///< every op's own tensors and workspace fit the device memory
  std::string note;                 ///< why not, when it does not
  double first_step_seconds = 0;    ///< step 0: the model's state starts on the SSD
  double step_seconds = 0;          ///< each later step without a plan
  double compute_seconds = 0;       ///< the trace's op times (no I/O)
  std::uint64_t bytes_read = 0;     ///< per later step
  std::uint64_t bytes_written = 0;  ///< per later step
  double total_seconds = 0;         ///< all `steps` steps
  /// Given a plan's step time and planning time: what the steps before it cost beyond as many
  /// planned steps, planning included, and the planned steps after which the plan has paid
  /// that back against going on without a plan (< 0: never, the plan is not faster).
  double planned_step_seconds = 0;
  double planning_seconds = 0;
  double extra_seconds = 0;
  double payback_steps = -1;
};

/// Simulates `steps` steps of `trace` on `hw` without a plan (device memory hw.device_memory
/// less hw.memory_margin; the SSD array's aggregate bandwidth, no host tier), then fills in the
/// plan's figures from `planned_step_seconds` and `planning_seconds` when they are > 0.
ProfilingPhase simulate_profiling_phase(const trace::Trace& trace, const Hardware& hw, int steps,
                                        double planned_step_seconds = 0,
                                        double planning_seconds = 0);

}  // namespace tidal::plan
