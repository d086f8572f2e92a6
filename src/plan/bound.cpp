// The stall lower bound: see include/tidal/plan/bound.hpp and docs/simulator.md.
#include "tidal/plan/bound.hpp"

#include <algorithm>
#include <cstdint>
#include <limits>

#include "tidal/trace/lifetime.hpp"

namespace tidal::plan {

namespace {

using trace::OpIndex;
using trace::TensorId;

/// Seconds to move `bytes` at `rate`; infinite when something must move and nothing can.
double transfer_seconds(double bytes, double rate) {
  if (bytes <= 0) return 0;
  if (rate <= 0) return std::numeric_limits<double>::infinity();
  return bytes / rate;
}

}  // namespace

StallBound stall_lower_bound(const trace::Trace& trace, const Hardware& hw) {
  const auto n = static_cast<OpIndex>(trace.ops.size());
  const auto nt = trace.tensors.size();
  const ChannelRates ch = hw.channels();
  const double read_rate = ch[Channel::kSsdRead] + ch[Channel::kHostRead];
  const double write_rate = ch[Channel::kSsdWrite] + ch[Channel::kHostWrite];
  const auto cap = static_cast<double>(hw.device_memory);

  // When each tensor comes to exist (as the simulator counts it: persistent ones before the
  // iteration, the others at their producer or first use), its last use, and the tensors whose
  // last use is op k.
  const trace::LifetimeAnalysis la = trace::analyze_lifetimes(trace);
  std::vector<OpIndex> begin(nt, n);  // n: never in memory; -1: before the iteration
  std::vector<OpIndex> last_use(nt, trace::kNoOp);
  std::vector<std::vector<TensorId>> dies_at(static_cast<std::size_t>(n));
  for (std::size_t t = 0; t < nt; ++t) {
    const auto& life = la.tensors[t];
    if (trace.tensors[t].persistent) {
      begin[t] = -1;
    } else if (life.live_begin != trace::kNoOp) {
      begin[t] = life.live_begin;
    }
    if (life.uses.empty()) continue;
    last_use[t] = life.uses.back();
    if (!trace.tensors[t].persistent) {
      dies_at[static_cast<std::size_t>(last_use[t])].push_back(static_cast<TensorId>(t));
    }
  }
  // E(i, j) counts tensors live at op i and W(i, j) tensors live at op j, so neither exceeds the
  // peak of live bytes: once a window's compute covers moving peak - C bytes, no longer window
  // from the same start can stall, and it stops growing.
  const auto peak = static_cast<double>(la.summary.peak_live_bytes);
  const double horizon =
      std::max(transfer_seconds(peak - cap, read_rate), transfer_seconds(peak - cap, write_rate));

  // best[k]: the largest total stall of disjoint windows within ops 0..k-1; from[k]: the first
  // op of the last window of that set, or -1 when op k-1 ends no window.
  std::vector<double> best(static_cast<std::size_t>(n) + 1, 0);
  std::vector<OpIndex> from(static_cast<std::size_t>(n) + 1, -1);
  std::vector<StallWindow> window_at(static_cast<std::size_t>(n) + 1);
  std::vector<OpIndex> seen_read(nt, -1);   // window start that counted the tensor in E
  std::vector<OpIndex> seen_write(nt, -1);  // window start that counted the tensor in W
  for (OpIndex i = 0; i < n; ++i) {
    const auto si = static_cast<std::size_t>(i);
    if (best[si] > best[si + 1]) {  // carry forward before windows starting at i compete
      best[si + 1] = best[si];
      from[si + 1] = -1;
    }
    double e = 0;
    double w = 0;
    double t = 0;
    // A tensor the window uses that existed before it counts once in E. A tensor with a gap
    // exists before op i when i is in its first live stretch or after its producer.
    auto existed = [&](TensorId x) {
      const auto& ten = trace.tensors[static_cast<std::size_t>(x)];
      return ten.has_gap() ? i <= ten.freed_after || i > ten.producer : begin[x] < i;
    };
    auto count_read = [&](TensorId x) {
      if (existed(x) && seen_read[x] != i) {
        seen_read[x] = i;
        e += static_cast<double>(trace.tensors[static_cast<std::size_t>(x)].bytes);
      }
    };
    for (OpIndex j = i; j < n; ++j) {
      const auto& op = trace.ops[static_cast<std::size_t>(j)];
      t += trace.op_seconds(static_cast<std::size_t>(j));
      for (const TensorId x : op.inputs) count_read(x);
      for (const TensorId x : op.outputs) {
        count_read(x);
        const auto& ten = trace.tensors[static_cast<std::size_t>(x)];
        // Needed after j: persistent, or used later. A tensor with a gap counts only when made
        // or changed in its last live stretch (needed by the next iteration); before its gap it
        // is left out, which can only lower the bound.
        const bool needed = ten.has_gap() ? j >= ten.producer : ten.persistent || last_use[x] > j;
        if (seen_write[x] != i && needed) {
          seen_write[x] = i;
          w += static_cast<double>(ten.bytes);
        }
      }
      for (const TensorId x : dies_at[static_cast<std::size_t>(j)]) {
        if (seen_write[x] == i) {
          seen_write[x] = -2;  // no longer needed after j; never counted again for this i
          w -= static_cast<double>(trace.tensors[static_cast<std::size_t>(x)].bytes);
        }
      }
      const double need =
          std::max(transfer_seconds(e - cap, read_rate), transfer_seconds(w - cap, write_rate));
      const double stall = need - t;
      const auto sj = static_cast<std::size_t>(j) + 1;
      if (stall > 0 && best[si] + stall > best[sj]) {
        best[sj] = best[si] + stall;
        from[sj] = i;
        window_at[sj] = {i, j, t, std::max(0.0, e - cap), std::max(0.0, w - cap), stall};
      }
      if (t >= horizon) break;
    }
  }
  // Windows ending at k only improve best[k + 1]; make best monotone for the result.
  for (std::size_t k = 1; k <= static_cast<std::size_t>(n); ++k) {
    if (best[k - 1] > best[k]) {
      best[k] = best[k - 1];
      from[k] = -1;
    }
  }
  StallBound out;
  out.stall_seconds = best[static_cast<std::size_t>(n)];
  out.iteration_seconds = trace.compute_seconds() + out.stall_seconds;
  for (auto k = static_cast<std::size_t>(n); k > 0;) {
    if (from[k] < 0) {
      --k;
      continue;
    }
    out.windows.push_back(window_at[k]);
    k = static_cast<std::size_t>(from[k]);
  }
  std::reverse(out.windows.begin(), out.windows.end());
  return out;
}

}  // namespace tidal::plan
