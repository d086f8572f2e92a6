#include "tidal/trace/trace.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <iterator>
#include <vector>

#include "tidal/common/enum_names.hpp"
#include "tidal/common/error.hpp"

namespace tidal::trace {

namespace {

bool in_range(std::int64_t v, std::size_t n) { return v >= 0 && static_cast<std::uint64_t>(v) < n; }

}  // namespace

TIDAL_ENUM_NAMES(Phase, phase_from_string, "op phase", {Phase::kForward, "forward"},
                 {Phase::kBackward, "backward"}, {Phase::kOptimizer, "optimizer"},
                 {Phase::kOther, "other"})
TIDAL_ENUM_NAMES(TensorClass, tensor_class_from_string, "tensor class",
                 {TensorClass::kParameter, "parameter"}, {TensorClass::kGradient, "gradient"},
                 {TensorClass::kOptimizerState, "optimizer_state"},
                 {TensorClass::kActivation, "activation"}, {TensorClass::kTemporary, "temporary"},
                 {TensorClass::kInput, "input"})

double Trace::op_seconds(std::size_t k) const {
  const Op& op = ops[k];
  double t = std::max(0.0, op.duration());
  if (k + 1 < ops.size()) t += std::max(0.0, ops[k + 1].start_s - op.end_s);
  return t;
}

double Trace::compute_seconds() const {
  double total = 0;
  for (std::size_t k = 0; k < ops.size(); ++k) total += op_seconds(k);
  return total;
}

namespace {

// Sizes: every sum of them (live bytes, bandwidth buckets) must fit in 64 bits.
void check_sizes(const Trace& trace) {
  constexpr std::uint64_t kMaxTensorBytes = std::uint64_t{1} << 50;  // 1 PiB
  constexpr std::uint64_t kMaxTotalBytes = std::uint64_t{1} << 62;
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < trace.tensors.size(); ++i) {
    const Tensor& t = trace.tensors[i];
    TIDAL_EXPECT(t.id == static_cast<TensorId>(i), "tensor at position ", i, " ('", t.name,
                 "') has id ", t.id, "; tensor ids must be dense and equal to the position");
    TIDAL_EXPECT(t.bytes <= kMaxTensorBytes, "tensor ", i, " ('", t.name, "') has ", t.bytes,
                 " bytes: more than 1 PiB (2^50) is not a tensor; check the trace's sizes");
    total += t.bytes;
    TIDAL_EXPECT(total <= kMaxTotalBytes,
                 "the trace's tensors add up to more than 2^62 bytes "
                 "(at tensor ",
                 i, "); check the trace's sizes");
  }
  for (const Op& op : trace.ops) {
    TIDAL_EXPECT(op.workspace_bytes <= kMaxTensorBytes, "op ", op.index, " ('", op.name,
                 "') has a workspace of ", op.workspace_bytes,
                 " bytes: more than 1 PiB (2^50); check the trace's sizes");
  }
}

// Op k's index and times, against the op before it.
void check_op_times(const Trace& trace, std::size_t k) {
  const Op& op = trace.ops[k];
  TIDAL_EXPECT(op.index == static_cast<OpIndex>(k), "op at position ", k, " ('", op.name,
               "') has index ", op.index, "; op indices must be dense and equal to the position");
  TIDAL_EXPECT(std::isfinite(op.start_s) && std::isfinite(op.end_s), "op ", k, " ('", op.name,
               "') has a non-finite time (start ", op.start_s, " s, end ", op.end_s, " s)");
  TIDAL_EXPECT(op.end_s >= op.start_s, "op ", k, " ('", op.name, "') ends at ", op.end_s,
               " s before it starts at ", op.start_s, " s");
  if (k > 0) {
    const Op& prev = trace.ops[k - 1];
    TIDAL_EXPECT(op.start_s >= prev.start_s, "op ", k, " ('", op.name, "') starts at ", op.start_s,
                 " s, before op ", k - 1, " which starts at ", prev.start_s,
                 " s; op start times must be non-decreasing");
  }
}

// First and last op that uses each tensor (kNoOp when none does).
struct Uses {
  std::vector<OpIndex> first;
  std::vector<OpIndex> last;
};

// Checks every op's times and the tensors it lists, and gathers each tensor's first and last use.
Uses check_ops(const Trace& trace) {
  const std::size_t n_tensors = trace.tensors.size();
  Uses uses{std::vector<OpIndex>(n_tensors, kNoOp), std::vector<OpIndex>(n_tensors, kNoOp)};
  for (std::size_t k = 0; k < trace.ops.size(); ++k) {
    check_op_times(trace, k);
    const Op& op = trace.ops[k];
    for (int dir = 0; dir < 2; ++dir) {
      const auto& ids = dir == 0 ? op.inputs : op.outputs;
      for (TensorId id : ids) {
        TIDAL_EXPECT(in_range(id, n_tensors), "op ", k, " ('", op.name, "') lists ",
                     dir == 0 ? "input" : "output", " tensor ", id, ", which does not exist (",
                     n_tensors, " tensors)");
        if (uses.first[id] == kNoOp) uses.first[id] = static_cast<OpIndex>(k);
        uses.last[id] = static_cast<OpIndex>(k);
      }
    }
  }
  return uses;
}

// Tensors with a gap: no op may use them while they are dead.
void check_no_use_while_dead(const Trace& trace) {
  const std::size_t n_ops = trace.ops.size();
  for (std::size_t k = 0; k < n_ops; ++k) {
    const Op& op = trace.ops[k];
    for (const auto* ids : {&op.inputs, &op.outputs}) {
      for (TensorId id : *ids) {
        const Tensor& t = trace.tensors[static_cast<std::size_t>(id)];
        if (!t.has_gap() || !in_range(t.producer, n_ops) || t.freed_after >= t.producer) continue;
        TIDAL_EXPECT(t.live_at(static_cast<OpIndex>(k)), "tensor ", id, " ('", t.name,
                     "') is used by op ", k, " while it is dead (freed after op ", t.freed_after,
                     ", made anew by op ", t.producer, ")");
      }
    }
  }
}

// Tensor i's producer exists, lists it as an output, and (unless persistent) comes first.
void check_producer(const Trace& trace, std::size_t i, const Uses& uses) {
  const Tensor& t = trace.tensors[i];
  const std::size_t n_ops = trace.ops.size();
  TIDAL_EXPECT(in_range(t.producer, n_ops), "tensor ", i, " ('", t.name, "') has producer ",
               t.producer, ", which is not an op (", n_ops, " ops)");
  const Op& p = trace.ops[t.producer];
  bool listed = false;
  for (TensorId id : p.outputs) listed = listed || id == t.id;
  TIDAL_EXPECT(listed, "tensor ", i, " ('", t.name, "') names op ", t.producer, " ('", p.name,
               "') as its producer, but that op does not list it among its outputs");
  if (!t.persistent) {
    TIDAL_EXPECT(uses.first[i] >= t.producer, "tensor ", i, " ('", t.name, "') is used by op ",
                 uses.first[i], " before its producer op ", t.producer);
  }
}

// A persistent tensor with a gap is freed before a later op makes it anew; the uses inside the
// gap are checked by check_no_use_while_dead.
void check_gap(const Trace& trace, std::size_t i) {
  const Tensor& t = trace.tensors[i];
  TIDAL_EXPECT(in_range(t.freed_after, trace.ops.size()) && t.producer != kNoOp &&
                   t.freed_after < t.producer,
               "tensor ", i, " ('", t.name, "') is persistent with freed_after ", t.freed_after,
               " and producer ", t.producer,
               "; a persistent tensor may only be freed when a later op makes it anew (its "
               "producer, after freed_after)");
}

// Tensor i is freed after an op that exists, after its last use and its producer.
void check_freed_after(const Trace& trace, std::size_t i, const Uses& uses) {
  const Tensor& t = trace.tensors[i];
  const std::size_t n_ops = trace.ops.size();
  TIDAL_EXPECT(in_range(t.freed_after, n_ops), "tensor ", i, " ('", t.name, "') has freed_after ",
               t.freed_after, ", which is not an op (", n_ops, " ops)");
  TIDAL_EXPECT(uses.last[i] <= t.freed_after, "tensor ", i, " ('", t.name, "') is used by op ",
               uses.last[i], " after it is freed after op ", t.freed_after);
  TIDAL_EXPECT(t.producer == kNoOp || t.producer <= t.freed_after, "tensor ", i, " ('", t.name,
               "') is freed after op ", t.freed_after, " before its producer op ", t.producer);
}

}  // namespace

void validate(const Trace& trace) {
  check_sizes(trace);
  const Uses uses = check_ops(trace);
  check_no_use_while_dead(trace);
  for (std::size_t i = 0; i < trace.tensors.size(); ++i) {
    const Tensor& t = trace.tensors[i];
    if (t.producer != kNoOp) check_producer(trace, i, uses);
    if (t.has_gap()) {
      check_gap(trace, i);
    } else if (t.freed_after != kNoOp) {
      check_freed_after(trace, i, uses);
    }
  }
}

std::vector<std::string> op_names(const Trace& trace) {
  std::vector<std::string> names;
  names.reserve(trace.ops.size());
  for (const auto& op : trace.ops) names.push_back(op.name);
  return names;
}

}  // namespace tidal::trace
