// The trace data model: what the profiler records about one training iteration, and what the
// planner and the simulator consume. Torch-free.
//
// A Trace is one iteration: an ordered list of ops (forward, backward, optimizer) and the tensors
// they touch. Tensor ids are dense indices into Trace::tensors. Op indices are dense indices into
// Trace::ops. Plain data: copyable, no internal synchronisation.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace tidal::trace {

/// Version of the JSON schema written by write_trace (docs/trace-format.md).
inline constexpr int kTraceVersion = 1;

using TensorId = std::int32_t;
using OpIndex = std::int32_t;
inline constexpr OpIndex kNoOp = -1;

enum class Phase : std::uint8_t { kForward, kBackward, kOptimizer, kOther };

enum class TensorClass : std::uint8_t {
  kParameter,       ///< model weight; persistent
  kGradient,        ///< .grad of a parameter; persistent unless zeroed to None each step
  kOptimizerState,  ///< e.g. AdamW exp_avg / exp_avg_sq; persistent
  kActivation,      ///< produced in forward and used again in backward (saved for backward)
  kTemporary,       ///< produced and dead within one phase
  kInput,           ///< data fed to the iteration (tokens, targets)
};

const char* to_string(Phase p);
const char* to_string(TensorClass c);
/// Inverse of to_string; throws tidal::InvalidArgument on an unknown name.
Phase phase_from_string(const std::string& s);
TensorClass tensor_class_from_string(const std::string& s);

/// One operator call of the iteration.
struct Op {
  OpIndex index = 0;  ///< position in the iteration, 0-based, equal to its place in ops
  std::string name;   ///< e.g. "aten::mm"
  Phase phase = Phase::kOther;
  double start_s = 0;             ///< start time in seconds from the iteration start
  double end_s = 0;               ///< end time; end_s - start_s is the op's compute time
  std::vector<TensorId> inputs;   ///< tensors read (active at this op)
  std::vector<TensorId> outputs;  ///< tensors written or created (active at this op)
  std::int32_t layer = -1;        ///< transformer block the op belongs to, -1 if none or unknown
  /// Memory the op allocates and frees again before it returns (scratch buffers, temporaries
  /// of composite ops), measured while profiling: it counts at this op like a live tensor that
  /// cannot move. 0 when not measured (analytic traces).
  std::uint64_t workspace_bytes = 0;

  [[nodiscard]] double duration() const { return end_s - start_s; }
};

/// One tensor (one storage) seen during the iteration.
struct Tensor {
  TensorId id = 0;             ///< equal to its place in Trace::tensors
  std::string name;            ///< human label: parameter name, or "op<k>:<slot>"
  std::uint64_t bytes = 0;     ///< storage bytes
  std::string device = "cpu";  ///< "cpu", "cuda:0", ...
  TensorClass cls = TensorClass::kTemporary;
  bool persistent = false;        ///< alive across iterations (parameters, grads, optimizer state)
  OpIndex producer = kNoOp;       ///< op that creates it; kNoOp for persistent tensors and inputs
  std::int32_t output_slot = -1;  ///< output slot of producer; (producer, slot) names it
  OpIndex freed_after = kNoOp;    ///< op after which its memory is released; kNoOp: persistent,
                                  ///< or (per-iteration) freed after its last use
  /// A persistent tensor with freed_after set and a producer after it is alive across the
  /// iteration boundary but dead in between: released after freed_after, made anew by producer
  /// (a gradient made in backward that a deferred optimizer step consumes early in the next
  /// iteration). It is live over ops [producer, end) and [0, freed_after].
  [[nodiscard]] bool has_gap() const { return persistent && freed_after != kNoOp; }
  /// Whether the tensor occupies memory at op k (for a tensor that is used at all).
  [[nodiscard]] bool live_at(OpIndex k) const {
    return !has_gap() || k <= freed_after || k >= producer;
  }
};

/// One profiled (or analytically built) training iteration.
struct Trace {
  int version = kTraceVersion;
  std::string model;  ///< e.g. "gpt2-small"
  std::string device = "cpu";
  std::int64_t batch = 0;
  std::int64_t seq = 0;
  std::vector<Op> ops;
  std::vector<Tensor> tensors;
  std::map<std::string, std::string> meta;  ///< free-form provenance (tool, torch version, ...)

  /// The time op k takes in the iteration: from its start to the next op's start, i.e. its
  /// duration plus the host time before the next op (the framework's own work between ops,
  /// recorded by a profiled trace's timestamps; zero where ops are back to back, as in analytic
  /// traces, or out of order). The last op: its duration.
  [[nodiscard]] double op_seconds(std::size_t k) const;
  /// Sum of op_seconds: the time of the iteration without stalls.
  [[nodiscard]] double compute_seconds() const;
};

/// The names of the trace's ops, in order: the "shape" of an iteration.
std::vector<std::string> op_names(const Trace& trace);

/// Checks the structural invariants (dense ids and indices, references in range, producer and
/// freed_after consistent with uses, times non-decreasing). Throws tidal::Error naming the first
/// violation.
///
/// In detail: ops[k].index == k and tensors[i].id == i; every input and output id names a
/// tensor; times are finite, end_s >= start_s and start_s never decreases (ops may overlap); a
/// producer, when set, is an op listing the tensor among its outputs, and no op uses a
/// per-iteration tensor before it; freed_after, when set, is an op at or after the tensor's last
/// use and its producer, and only per-iteration tensors have one.
void validate(const Trace& trace);

}  // namespace tidal::trace
