// What the offloader did, step by step, as it ran: the ops, every transfer on its channel, the
// stalls and memory against the budget. Written as a Chrome trace (Perfetto, chrome://tracing)
// and an SVG, and summed into "where the time went" with the one thing that limits the run.
// Torch-free: the plan executor (and the activation offloader) record into it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "tidal/plan/tiers.hpp"
#include "tidal/trace/trace.hpp"

namespace tidal::plan {

/// Why a transfer ran.
enum class TransferKind : std::uint8_t {
  kPlanned,     ///< an action of the plan (an offload, or a prefetch ahead of its use)
  kMiss,        ///< a read an op needed at once: not prefetched, or not in time
  kEviction,    ///< a write outside the plan, to keep memory under the budget
  kActivation,  ///< activation mode: a saved tensor written, or read back for backward
};
/// "planned", "miss", "eviction", "activation".
const char* to_string(TransferKind k);

/// Why an op waited.
enum class StallKind : std::uint8_t {
  kRead,      ///< for a read it needed (a miss, or a prefetch not done)
  kBudget,    ///< for writes to finish (or evictions) so as not to cross the budget
  kDeadline,  ///< for a write the plan wants done before it
};
inline constexpr std::size_t kNumStallKinds = 3;
/// "read", "budget", "deadline".
const char* to_string(StallKind k);

struct TimelineOp {
  trace::OpIndex index = -1;  ///< in its step (-1: tidal's own work at the step's start)
  std::string name;
  double start = 0;  ///< seconds since the timeline began
  double end = -1;   ///< -1: still running (when written)
};

struct TimelineTransfer {
  Channel channel = Channel::kSsdWrite;
  TransferKind kind = TransferKind::kPlanned;
  std::string tensor;  ///< its name in the trace, or a description
  std::uint64_t bytes = 0;
  double start = 0;
  double end = -1;  ///< when tidal saw it complete (at the latest the next op's start); -1: not
  bool failed = false;
  /// The op (of this step) it must be done before, per the plan; -1: none.
  trace::OpIndex due_op = -1;
  /// Started after its step ended, before the next began (code between steps reading tensors
  /// back): drawn at its step's end.
  bool between_steps = false;
};

struct TimelineStall {
  StallKind kind = StallKind::kRead;
  Channel channel = Channel::kSsdRead;  ///< kRead: whose read it waited for
  trace::OpIndex op = -1;               ///< the op it delayed (-1: between ops)
  std::string tensor;
  double start = 0;
  double end = 0;
};

/// What a step was when it ran: the session's state then, or aborted (an exception left it).
enum class StepState : std::uint8_t { kOff, kWarmup, kProfiling, kExecuting, kAborted };
/// "off", "warmup", "profiling", "executing", "aborted" (the exporters' words).
const char* to_string(StepState s);

/// One step as it ran.
struct TimelineStep {
  std::int64_t step = 0;
  StepState state = StepState::kOff;
  double start = 0;
  double end = -1;
  std::uint64_t budget = 0;  ///< the memory budget asked for; 0: none
  /// The wall the executor held: the budget, or the least memory the plan reaches when no plan
  /// meets the budget; 0: none.
  std::uint64_t wall = 0;
  std::uint64_t peak = 0;  ///< the meter's peak over the step (set at its end)
  std::vector<TimelineOp> ops;
  std::vector<TimelineTransfer> transfers;
  std::vector<TimelineStall> stalls;
  std::vector<std::pair<double, std::uint64_t>> memory;  ///< (time, bytes in use)
  /// The plan's view of the step (empty/0 before a plan): memory while each op runs in the
  /// meter's bytes, and its predicted step time and stall.
  std::vector<std::uint64_t> planned_memory;
  double planned_seconds = 0;
  double planned_stall_seconds = 0;
  std::array<std::uint64_t, kNumChannels> planned_bytes{};
  /// Reads an op waited for without a prefetch, as the executor or offloader counted them (each
  /// is a transfer of kind kMiss in `transfers`).
  std::uint64_t misses = 0;
  /// The store in the step, when known (-1: not): seconds with I/O in flight (device time, not
  /// CPU), and the CPU seconds its threads spent on checksums.
  double io_busy_seconds = -1;
  double checksum_seconds = -1;
};

/// Where one step's time went (Timeline::report). Every figure is seconds per step, averaged over
/// the steps it covers.
struct TimeReport {
  int steps = 0;                   ///< executed steps it covers (0: nothing measured)
  double step_seconds = 0;         ///< wall time of a step
  double compute_seconds = 0;      ///< inside ops, less their stalls
  double between_ops_seconds = 0;  ///< outside ops: the loop's own code, data, Python
  std::array<double, kNumChannels> read_stall_seconds{};  ///< by channel (reads only)
  double write_stall_seconds = 0;                         ///< budget and deadline waits, evictions
  /// Not part of the sum (they run beside the step): the store's busy time (I/O in flight) and
  /// its threads' CPU time on checksums; -1: not measured.
  double io_busy_seconds = -1;
  double checksum_seconds = -1;
  std::array<std::uint64_t, kNumChannels> bytes{};          ///< moved per step, by channel
  std::array<std::uint64_t, kNumChannels> planned_bytes{};  ///< the plan's, by channel
  double misses = 0;                                        ///< per step
  double evictions = 0;                                     ///< per step
  int replans = 0;             ///< plans made after the first, in the whole run (the owner sets it)
  double planned_seconds = 0;  ///< the plan's step time (0: no plan)
  double planned_stall_seconds = 0;  ///< the plan's stall per step
  /// compute + between ops + stalls, over step_seconds (1.0 when every part was measured).
  [[nodiscard]] double accounted() const;
  /// What limits the run, in one sentence, and what would help.
  std::string limit;

  [[nodiscard]] double stall_seconds() const;
};

/// Thread-safe recorder of the last steps (or chosen ones). Times are seconds from its creation,
/// on the steady clock.
class Timeline {
 public:
  struct Options {
    /// Keep the events of the last this many steps (older ones are dropped as steps end).
    std::size_t last_steps = 4;
    /// Keep these steps instead (when not empty), whenever they ran.
    std::vector<std::int64_t> steps;
    /// Seconds on some clock (tests); unset: the steady clock.
    std::function<double()> clock;
  };
  Timeline() : Timeline(Options{}) {}
  explicit Timeline(Options options);

  [[nodiscard]] double now() const;

  void begin_step(std::int64_t step, StepState state, std::uint64_t budget, std::uint64_t wall);
  /// Relabels the running step (its state changed as it started: profiling, say).
  void label_step(StepState state, std::uint64_t budget, std::uint64_t wall);
  /// Closes the step with what the owner knows of it: `facts`' peak, misses, io_busy_seconds and
  /// checksum_seconds, and the plan's view (planned_memory, planned_seconds,
  /// planned_stall_seconds, planned_bytes; empty/0 without a plan). Its other fields are ignored.
  void end_step(const TimelineStep& facts);
  /// An op starts (it ends the op still open: ops do not nest). A phase that two recorders
  /// both mark (index -1, the name of the op still open) is one op. `memory_now`: the meter's
  /// bytes, or kNoSample.
  void op_start(trace::OpIndex index, const std::string& name, std::uint64_t memory_now);
  void op_end(std::uint64_t memory_now);
  static constexpr std::uint64_t kNoSample = ~std::uint64_t{0};
  /// Returns a handle for transfer_end (kept while the step runs or the transfer is in flight).
  std::size_t transfer_start(Channel channel, TransferKind kind, std::string tensor,
                             std::uint64_t bytes, trace::OpIndex due_op);
  void transfer_end(std::size_t handle, bool failed);
  void stall(StallKind kind, Channel channel, std::string tensor, double start, double end);
  void memory(std::uint64_t bytes);

  /// The steps kept, oldest first (a copy).
  [[nodiscard]] std::vector<TimelineStep> steps() const;
  /// Where the time went over the kept steps in state kExecuting (all kept steps when none).
  /// `rates`: what the plan assumed of each channel, bytes/s (0: unknown), for the sentence.
  [[nodiscard]] TimeReport report(const ChannelRates& rates = {}) const;

  /// Chrome trace (JSON object format) of the kept steps; Perfetto and chrome://tracing open it.
  [[nodiscard]] std::string chrome_json() const;
  /// SVG: memory over the last kept step against the budget, measured and planned, with the I/O
  /// lanes and the stalls under it.
  [[nodiscard]] std::string svg() const;
  /// Writes chrome_json() (or svg() for a path ending in .svg) atomically, mode 0644 (through
  /// AtomicFile: a symlink planted at a temporary name is never followed). Throws tidal::Error.
  void write(const std::string& path) const;

 private:
  TimelineStep* current_locked();
  Options opt_;
  mutable std::mutex mu_;
  std::deque<TimelineStep> steps_;
  bool open_ = false;  // the back of steps_ is running
  // Transfers in flight, by handle: (step number, index in its transfers).
  std::vector<std::pair<std::int64_t, std::size_t>> handles_;
  std::vector<std::size_t> free_handles_;
  double t0_ = 0;
};

/// Where the time went as text lines (for the end of a run), with the plan's figures beside.
std::string format_report(const TimeReport& r);
/// The report as a JSON object (text): seconds per step; read stalls, bytes and planned bytes by
/// channel name; null for what was not measured; "limit", the sentence. tidal train's --json
/// "time_report" and Python's Session.time_report() (which adds "text").
std::string time_report_json(const TimeReport& r);

}  // namespace tidal::plan
