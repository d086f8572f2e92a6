// Lifetime analysis: when each tensor is live, when it is active, and how long it sits idle.
// Torch-free.
#pragma once

#include <cstdint>
#include <vector>

#include "tidal/trace/trace.hpp"

namespace tidal::trace {

/// A gap between two consecutive uses of one tensor, during which it could live elsewhere.
/// For a persistent tensor the last gap wraps around the iteration boundary: last_use is its
/// last use in this iteration and next_use its first use in the next (wraps == true, and
/// next_use <= last_use).
struct InactivePeriod {
  TensorId tensor = 0;
  std::uint64_t bytes = 0;
  OpIndex last_use = 0;  ///< the period starts after this op ends
  OpIndex next_use = 0;  ///< and ends before this op starts
  bool wraps = false;
  double idle_seconds = 0;  ///< compute time of the ops strictly between the two uses
};

/// The life of one tensor within the iteration.
///
/// Live interval: a persistent tensor is live at every op. An input is live from op 0 (or its
/// producer, if it has one) through freed_after, or through the last op when freed_after is
/// kNoOp. Any other tensor is live from its producer (its first use when the producer is kNoOp)
/// through freed_after (its last use when freed_after is kNoOp). A non-persistent tensor that is
/// neither produced nor used is never live: live_begin == live_end == kNoOp. A persistent
/// tensor with a gap (Tensor::has_gap) has live_begin = producer > live_end = freed_after: it is
/// live over [live_begin, last op] and [0, live_end], and no period spans its gap.
struct TensorLifetime {
  TensorId tensor = 0;
  OpIndex live_begin = 0;     ///< first op at which it occupies memory (0 for persistent/inputs)
  OpIndex live_end = 0;       ///< last op at which it occupies memory (inclusive)
  std::vector<OpIndex> uses;  ///< ops that read or write it, ascending, unique
  /// Gaps with at least one op strictly between two consecutive uses, ordered by last_use and
  /// disjoint. A persistent tensor also gets the wrapping gap from its last use to its first use
  /// of the next iteration (last in the list) when some op lies outside [first use, last use];
  /// with a single use that gap covers every other op and last_use == next_use.
  std::vector<InactivePeriod> periods;
};

struct LifetimeSummary {
  std::uint64_t peak_live_bytes = 0;
  OpIndex peak_live_op = 0;
  std::uint64_t peak_active_bytes = 0;
  /// Mean over the ops with live bytes > 0 of active/live bytes (TERAIO: 1.7%).
  double mean_active_ratio = 0;
  /// Inactive periods by tensor size class, always five entries:
  /// [<1 MiB, 1-10 MiB, 10-100 MiB, 100 MiB-1 GiB, >=1 GiB]; a tensor of b bytes falls in the
  /// class with min_bytes <= b < max_bytes (the last class also holds UINT64_MAX).
  struct SizeClass {
    std::uint64_t min_bytes = 0;
    std::uint64_t max_bytes = 0;  ///< exclusive; UINT64_MAX for the last
    std::int64_t periods = 0;
    double mean_idle_seconds = 0;
    double median_idle_seconds = 0;
    std::uint64_t total_bytes = 0;  ///< bytes summed over periods
  };
  std::vector<SizeClass> size_classes;
};

struct LifetimeAnalysis {
  std::vector<TensorLifetime> tensors;      ///< indexed by TensorId
  std::vector<std::uint64_t> live_bytes;    ///< per op: bytes of tensors live at it
  std::vector<std::uint64_t> active_bytes;  ///< per op: bytes of its inputs and outputs
  LifetimeSummary summary;
};

/// Computes lifetimes of a trace. Validates it first (throws tidal::Error like validate()).
/// O(ops + uses + tensors), plus the median selection per size class (linear on average).
LifetimeAnalysis analyze_lifetimes(const Trace& trace);

}  // namespace tidal::trace
