#include "tidal/trace/lifetime.hpp"

#include <algorithm>
#include <cstddef>
#include <iterator>
#include <limits>
#include <utility>

#include "tidal/common/stats.hpp"

namespace tidal::trace {

namespace {

constexpr std::uint64_t kMiB = 1ull << 20;
constexpr std::uint64_t kGiB = 1ull << 30;

LifetimeSummary summarize(const LifetimeAnalysis& a) {
  LifetimeSummary s;
  const std::size_t n_ops = a.live_bytes.size();
  double ratio_sum = 0;
  std::int64_t ratio_ops = 0;
  for (std::size_t k = 0; k < n_ops; ++k) {
    if (a.live_bytes[k] > s.peak_live_bytes) {
      s.peak_live_bytes = a.live_bytes[k];
      s.peak_live_op = static_cast<OpIndex>(k);
    }
    s.peak_active_bytes = std::max(s.peak_active_bytes, a.active_bytes[k]);
    if (a.live_bytes[k] > 0) {
      ratio_sum += static_cast<double>(a.active_bytes[k]) / static_cast<double>(a.live_bytes[k]);
      ++ratio_ops;
    }
  }
  s.mean_active_ratio = ratio_ops > 0 ? ratio_sum / static_cast<double>(ratio_ops) : 0;

  const std::uint64_t bounds[] = {0,          kMiB, 10 * kMiB,
                                  100 * kMiB, kGiB, std::numeric_limits<std::uint64_t>::max()};
  constexpr std::size_t kClasses = std::size(bounds) - 1;
  std::vector<std::vector<double>> idle(kClasses);
  s.size_classes.resize(kClasses);
  for (std::size_t c = 0; c < kClasses; ++c) {
    s.size_classes[c].min_bytes = bounds[c];
    s.size_classes[c].max_bytes = bounds[c + 1];
  }
  for (const TensorLifetime& t : a.tensors) {
    for (const InactivePeriod& p : t.periods) {
      std::size_t c = 0;
      while (c + 1 < kClasses && p.bytes >= bounds[c + 1]) ++c;
      auto& cls = s.size_classes[c];
      ++cls.periods;
      cls.total_bytes += p.bytes;
      idle[c].push_back(p.idle_seconds);
    }
  }
  for (std::size_t c = 0; c < kClasses; ++c) {
    auto& cls = s.size_classes[c];
    if (cls.periods == 0) continue;
    double sum = 0;
    for (double x : idle[c]) sum += x;
    cls.mean_idle_seconds = sum / static_cast<double>(cls.periods);
    cls.median_idle_seconds = median(std::move(idle[c]));
  }
  return s;
}

// Uses, and active bytes per op over the distinct tensors it touches. Ops are visited in order,
// so each tensor's uses come out ascending; last_seen drops repeats within an op.
void record_uses(const Trace& trace, LifetimeAnalysis& a) {
  std::vector<OpIndex> last_seen(trace.tensors.size(), kNoOp);
  for (std::size_t k = 0; k < trace.ops.size(); ++k) {
    const Op& op = trace.ops[k];
    const auto kk = static_cast<OpIndex>(k);
    for (const auto* ids : {&op.inputs, &op.outputs}) {
      for (TensorId id : *ids) {
        if (last_seen[id] == kk) continue;
        last_seen[id] = kk;
        a.tensors[id].uses.push_back(kk);
        a.active_bytes[k] += trace.tensors[id].bytes;
      }
    }
  }
}

// Prefix sums of op durations: the idle time strictly between ops i and j (i < j) is
// prefix[j] - prefix[i + 1].
std::vector<double> op_seconds_prefix(const Trace& trace) {
  const std::size_t n_ops = trace.ops.size();
  std::vector<double> prefix(n_ops + 1, 0);
  for (std::size_t k = 0; k < n_ops; ++k) prefix[k + 1] = prefix[k] + trace.op_seconds(k);
  return prefix;
}

// The live interval as TensorLifetime documents it; needs life.uses.
void set_live_interval(const Tensor& t, std::size_t n_ops, TensorLifetime& life) {
  const auto last_op = static_cast<OpIndex>(n_ops) - 1;
  // Not live during the iteration: no ops, or never used and never produced.
  if (n_ops == 0 ||
      (!t.has_gap() && !t.persistent && t.cls != TensorClass::kInput && life.uses.empty())) {
    life.live_begin = kNoOp;
    life.live_end = kNoOp;
  } else if (t.has_gap()) {
    // Live over [producer, end) and [0, freed_after]: begin after end says it wraps.
    life.live_begin = t.producer;
    life.live_end = t.freed_after;
  } else if (t.persistent) {
    life.live_begin = 0;
    life.live_end = last_op;
  } else if (t.cls == TensorClass::kInput) {
    life.live_begin = t.producer != kNoOp ? t.producer : 0;
    life.live_end = t.freed_after != kNoOp ? t.freed_after : last_op;
  } else {
    // validate() guarantees producer <= first use and last use <= freed_after.
    life.live_begin = t.producer != kNoOp ? t.producer : life.uses.front();
    life.live_end = t.freed_after != kNoOp ? t.freed_after : life.uses.back();
  }
}

// Adds the tensor's live interval to a difference array over ops (n_ops + 1 entries).
void add_live_interval(const Tensor& t, const TensorLifetime& life,
                       std::vector<std::uint64_t>& diff) {
  if (life.live_begin != kNoOp && life.live_begin > life.live_end) {
    diff[0] += t.bytes;  // a tensor with a gap: [0, end] and [begin, last op]
    diff[static_cast<std::size_t>(life.live_end) + 1] -= t.bytes;
    diff[static_cast<std::size_t>(life.live_begin)] += t.bytes;
  } else if (life.live_begin != kNoOp) {
    // Unsigned wrap-around is well defined, and the running sum below is exact modulo 2^64.
    diff[static_cast<std::size_t>(life.live_begin)] += t.bytes;
    diff[static_cast<std::size_t>(life.live_end) + 1] -= t.bytes;
  }
}

// The gaps between consecutive uses, and for a persistent tensor the one that wraps around the
// iteration boundary; needs life.uses.
void add_inactive_periods(const Tensor& t, const std::vector<double>& prefix,
                          TensorLifetime& life) {
  const std::size_t n_ops = prefix.size() - 1;
  const auto last_op = static_cast<OpIndex>(n_ops) - 1;
  const double total = prefix[n_ops];
  // An idle stretch over a tensor's gap is not a period: it is dead there, not idle.
  auto dead_between = [&](OpIndex a, OpIndex b) {
    if (!t.has_gap()) return false;
    return a < b ? a <= t.freed_after && b >= t.producer : a <= t.freed_after || b >= t.producer;
  };
  const auto& uses = life.uses;
  for (std::size_t u = 0; u + 1 < uses.size(); ++u) {
    if (uses[u + 1] - uses[u] < 2 || dead_between(uses[u], uses[u + 1])) continue;
    life.periods.push_back(InactivePeriod{t.id, t.bytes, uses[u], uses[u + 1], false,
                                          prefix[uses[u + 1]] - prefix[uses[u] + 1]});
  }
  if (t.persistent && !uses.empty()) {
    const OpIndex last = uses.back();
    const OpIndex first = uses.front();
    if ((last_op - last) + first > 0 && !dead_between(last, first)) {
      const double idle = (total - prefix[last + 1]) + prefix[first];
      life.periods.push_back(InactivePeriod{t.id, t.bytes, last, first, true, idle});
    }
  }
}

// Live bytes per op from the difference array; an op's workspace is live and active at it, and
// goes nowhere.
void add_up_live_bytes(const Trace& trace, const std::vector<std::uint64_t>& diff,
                       LifetimeAnalysis& a) {
  std::uint64_t running = 0;
  for (std::size_t k = 0; k < trace.ops.size(); ++k) {
    running += diff[k];
    a.live_bytes[k] = running + trace.ops[k].workspace_bytes;
    a.active_bytes[k] += trace.ops[k].workspace_bytes;
  }
}

}  // namespace

LifetimeAnalysis analyze_lifetimes(const Trace& trace) {
  validate(trace);
  const std::size_t n_ops = trace.ops.size();
  const std::size_t n_tensors = trace.tensors.size();

  LifetimeAnalysis a;
  a.tensors.resize(n_tensors);
  a.live_bytes.assign(n_ops, 0);
  a.active_bytes.assign(n_ops, 0);
  record_uses(trace, a);

  const std::vector<double> prefix = op_seconds_prefix(trace);
  std::vector<std::uint64_t> diff(n_ops + 1, 0);
  for (std::size_t i = 0; i < n_tensors; ++i) {
    const Tensor& t = trace.tensors[i];
    TensorLifetime& life = a.tensors[i];
    life.tensor = t.id;
    set_live_interval(t, n_ops, life);
    add_live_interval(t, life, diff);
    add_inactive_periods(t, prefix, life);
  }
  add_up_live_bytes(trace, diff, a);

  a.summary = summarize(a);
  return a;
}

}  // namespace tidal::trace
