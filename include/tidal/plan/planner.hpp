// The lifetime-aware planner: TERAIO's greedy over inactive periods, with G10's per-op bandwidth
// buckets, made fast with lazy re-evaluation and segment trees. Torch-free.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "tidal/plan/bound.hpp"
#include "tidal/plan/hardware.hpp"
#include "tidal/plan/plan.hpp"
#include "tidal/trace/trace.hpp"

namespace tidal::plan {

struct PlannerOptions {
  /// Allow host memory as a destination (up to Hardware::host_memory) when the SSD channel has
  /// no room for a period.
  bool use_host = true;
  /// Where SSD and host memory would free the same (both have the bandwidth), take host
  /// memory, within its budget: fewer SSD writes (drive wear) for the same plan quality. Off by
  /// default: host memory is the scarcer resource (shared/DESIGN.md: SSD first).
  bool prefer_host = false;
  /// When no migration fits the bandwidth and memory still exceeds capacity, accept the
  /// migrations that add the least stall (true), or give up and return a plan that does not fit.
  bool allow_stalls = true;
  /// After the greedy and the least-stall fallback, drop every migration that the others make
  /// unnecessary (memory stays at or under the target without it over the ops it frees): fewer
  /// bytes written to SSD for the same fit, and never more stall.
  bool prune = true;
  /// When host memory fills up, the SSDs are the scarce channel (under half the host link's rate)
  /// and the plan stalls, plan a second time with host memory promised to the inactive periods
  /// that save the most SSD traffic per byte-second held (the shortest); simulate both and keep
  /// the faster that fits (docs/simulator.md, "Host memory against SSD bandwidth"). The second
  /// plan runs on a thread of its own beside the first wherever the hardware makes it possible,
  /// and is cancelled where the first plan does not need it: about twice the CPU time there.
  bool choose_host_by_density = true;
  /// A tier keeps its copy of a tensor until the tensor changes, so a period of a tensor
  /// unchanged since an earlier planned migration of it to the same tier books no write, and
  /// the version's first period may take the write ahead of a busy one (docs/simulator.md,
  /// planner step 9; the simulator skips those writes, SimOptions::skip_clean_writes). false:
  /// every offload books its write, for an executor that writes every offload (the plan
  /// executor does, so a training session plans with false).
  bool clean_copies = true;
  /// A period on the SSDs may come back through host memory (ActionKind::kStage): read from the
  /// SSDs into host memory early, where the SSD channel and host memory have room, then over
  /// the faster host link just before its use, so that it takes device memory for less of its
  /// period (docs/simulator.md, planner step 10). false: every prefetch reads the tier written
  /// to, for an executor that does not stage (the plan executor does not, so a training session
  /// plans with false).
  bool stage_via_host = true;
  /// Tensors smaller than this stay in device memory (their migration costs more than it frees).
  std::uint64_t min_bytes = 0;
  /// How the error for a plan that cannot fit tells the user to give more memory (the CLI's
  /// flag by default; a training session names its budget option instead).
  std::string more_memory_hint = "more device memory (--gpu-mem)";
  /// Called now and then with the share of over-capacity time already resolved (0..1), from 0 to
  /// 1 once per planning pass (planning into the waits makes several). Called only on the thread
  /// that called make_plan, never on the second plan's thread.
  std::function<void(double)> progress;
};

/// Makes a plan that keeps device memory under hw.device_memory x (1 - hw.memory_margin) at
/// every op of `trace`, moving tensors during their inactive periods.
///
/// Algorithm (docs/simulator.md): M[k] = live bytes at op k. Candidates are the inactive periods
/// (tensor t, bytes s, last use a, next use b). Each channel has per-op buckets of capacity
/// rate x op time; an offload fills write buckets forward from a + 1 (it completes in bucket
/// e), a prefetch fills read buckets backward from b - 1 (it starts in bucket p); the tensor is
/// gone for the ops e+1 .. p-1. The score of a candidate is the compute time of the ops in that
/// span whose memory still exceeds the target; the best is committed (SSD first, then host
/// memory within its cap), scores are re-evaluated lazily when popped (they only shrink; a
/// candidate within 1% of the best queued score is taken).
/// When nothing feasible is left and an op still exceeds the target, the candidate covering it
/// with the least added stall is committed together with that stall. Then periods on the SSDs
/// move to host memory or come back through it where that frees as much (options.stage_via_host),
/// and last (options.prune) the committed migrations that the others make unnecessary are
/// dropped, SSD ones first.
///
/// Planning into the waits (docs/simulator.md, planner step 8): make_plan first computes the
/// stall lower bound of `trace` on `hw` (plan/bound.hpp). Where it is positive, the trace is
/// planned as if each window of the bound took its stall as extra time (spread over the window's
/// ops by the bytes they use), so that both channels' buckets hold the transfers the iteration
/// can run while it waits; then up to three rounds plan again with the best plan's own
/// simulated waits, each kept only where it is faster. Where the bound's windows run over the
/// iteration's end, the waits of one iteration's windows come first, and the bound's own are
/// tried too where that plan is over 1.12 times the bound. Where the result is over twice the
/// bound or does not fit, the plan of the trace as it is is made too, and the faster kept. Where
/// the bound is zero, the plan of the trace as it is, with rounds of its simulated waits where
/// it stalls. Each plan chooses between the host-memory ways of
/// PlannerOptions::choose_host_by_density by simulating them (plan/simulator.hpp).
///
/// Thread-safe for distinct arguments (it only reads `trace` and `hw`). Runs on the calling
/// thread, plus one thread of its own per planning pass where the second host-memory way may be
/// needed (PlannerOptions::choose_host_by_density); those threads are joined before it returns,
/// an error included. Throws tidal::InvalidArgument when `hw` has no device memory, when even
/// the tensors that cannot leave (the active ones) exceed the capacity at some op (naming the op
/// and the shortfall), or when a bounded SSD store and host memory are both full where an op
/// must free memory.
/// `bound`, when given, receives the stall bound of `trace` on `hw` that make_plan computed to
/// plan into its waits, so that a caller that reports it need not compute it again (it is left
/// empty where the planner computed none).
Plan make_plan(const trace::Trace& trace, const Hardware& hw, const PlannerOptions& options = {},
               std::optional<StallBound>* bound = nullptr);

}  // namespace tidal::plan
