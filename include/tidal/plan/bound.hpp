// A lower bound on the stall of any offloading plan for a trace on a hardware model: what no
// planner can beat, so that "x% of ideal" can be read against what is possible. Torch-free.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "tidal/plan/hardware.hpp"
#include "tidal/trace/trace.hpp"

namespace tidal::plan {

/// One window of consecutive ops whose transfers cannot hide behind its compute.
struct StallWindow {
  trace::OpIndex first = 0;  ///< first op of the window
  trace::OpIndex last = 0;   ///< last op, inclusive
  double compute_seconds = 0;
  double read_bytes = 0;   ///< bytes that must be read during the window, at least
  double write_bytes = 0;  ///< bytes that must be written during the window, at least
  double stall_seconds = 0;
};

struct StallBound {
  /// No plan that keeps device memory at or under the capacity at every op stalls less than
  /// this in one iteration (on the four channels of Hardware::channels()).
  double stall_seconds = 0;
  /// compute + stall_seconds: the shortest iteration any plan can reach.
  double iteration_seconds = 0;
  /// Disjoint windows whose stalls add up to stall_seconds, in op order from a cut of the
  /// iteration (at most one runs over its end).
  std::vector<StallWindow> windows;
  /// The op whose own inputs and outputs exceed the device's capacity most (-1: none). Then no
  /// plan fits and there is no bound: stall_seconds is 0, iteration_seconds the compute and
  /// windows empty, and a report says so instead of giving them.
  trace::OpIndex no_fit_op = -1;
  std::uint64_t no_fit_bytes = 0;  ///< what that op uses by itself
  /// For a bound not made of windows (host_step_bound()): what limits it, in a few words.
  std::string limit;
};

/// The bound (docs/simulator.md, "Lower bound"). For a window of ops i..j with compute time T:
/// the tensors it uses that exist before op i (E bytes) must all be in device memory at their
/// use, and at most C (device capacity) of them can be there or on their way when the window
/// starts, so at least E - C bytes are read during it; the tensors it creates or modifies that
/// are needed after op j (W bytes) cannot all stay, so at least W - C bytes are written during
/// it. The window takes at least max((E - C) / read rate, (W - C) / write rate), where the rates
/// are the SSD and host channels together, and stalls by that minus T. Disjoint windows stall
/// independently; the best set of them is found by dynamic programming over all windows, swept
/// over the window's last op with a segment tree over its first (O((ops + tensor uses) log ops);
/// where a channel has rate 0, by growing every window, O(ops^2)). A window may run over the
/// iteration's end (last < first: ops first..end and 0..last of the next iteration): the
/// iteration repeats, so the ops from a cut r to the end and those before r in the next
/// iteration are one period, and the windows within it are found on two iterations one after
/// the other, for the cuts at the ends of the windows of one iteration (docs/simulator.md,
/// "Windows over the iteration's end"). Then the halves: a tensor that exists at a pivot op p, is
/// not used by it and is not in device memory there was written after the op that made it and
/// before op p, and is read after op p and before its next use; with active(p) the bytes op p
/// uses, at least (bytes of such tensors) + active(p) - C of them are away, so the ops before p
/// and those after it each last at least that many bytes' transfer time, one after the other
/// (docs/simulator.md, "Peaks between a write and a read"); windows and halves whose stalls lie
/// before disjoint ops add up. The bound holds for periodic plans, as the simulator's (its third
/// iteration) are.
/// `progress`, when set, is called now and then with the share of ops swept (0..1), on the
/// calling thread.
StallBound stall_lower_bound(const trace::Trace& trace, const Hardware& hw,
                             const std::function<void(double)>& progress = {});

}  // namespace tidal::plan
