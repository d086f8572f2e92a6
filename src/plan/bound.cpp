// The stall lower bound: see include/tidal/plan/bound.hpp and docs/simulator.md.
#include "tidal/plan/bound.hpp"

#include <algorithm>
#include <cstdint>
#include <limits>

#include "plan/int_index.hpp"
#include "tidal/trace/lifetime.hpp"

namespace tidal::plan {

namespace {

using detail::at;
using trace::OpIndex;
using trace::TensorId;

/// Seconds to move `bytes` at `rate`; infinite when something must move and nothing can.
double transfer_seconds(double bytes, double rate) {
  if (bytes <= 0) return 0;
  if (rate <= 0) return std::numeric_limits<double>::infinity();
  return bytes / rate;
}

// When each tensor comes to exist (as the simulator counts it: persistent ones before the
// iteration, the others at their producer or first use), its last use, and the tensors whose
// last use is op k.
struct Lifespans {
  std::vector<OpIndex> begin;  // n: never in memory; -1: before the iteration
  std::vector<OpIndex> last_use;
  std::vector<std::vector<TensorId>> dies_at;
};

Lifespans lifespans(const trace::Trace& trace, const trace::LifetimeAnalysis& la) {
  const auto n = static_cast<OpIndex>(trace.ops.size());
  const auto nt = trace.tensors.size();
  Lifespans out{std::vector<OpIndex>(nt, n), std::vector<OpIndex>(nt, trace::kNoOp),
                std::vector<std::vector<TensorId>>(static_cast<std::size_t>(n))};
  for (std::size_t t = 0; t < nt; ++t) {
    const auto& life = la.tensors[t];
    if (trace.tensors[t].persistent) {
      out.begin[t] = -1;
    } else if (life.live_begin != trace::kNoOp) {
      out.begin[t] = life.live_begin;
    }
    if (life.uses.empty()) continue;
    out.last_use[t] = life.uses.back();
    if (!trace.tensors[t].persistent) {
      at(out.dies_at, out.last_use[t]).push_back(static_cast<TensorId>(t));
    }
  }
  return out;
}

// The dynamic programme of the bound over the windows i..j: best[k], the largest total stall
// of disjoint windows within ops 0..k-1; from[k], the first op of the last window of that set,
// or -1 when op k-1 ends no window.
class WindowSearch {
 public:
  WindowSearch(const trace::Trace& trace, const Hardware& hw)
      : trace_(trace),
        la_(trace::analyze_lifetimes(trace)),
        spans_(lifespans(trace, la_)),
        n_(static_cast<OpIndex>(trace.ops.size())),
        cap_(static_cast<double>(hw.device_memory)),
        best_(static_cast<std::size_t>(n_) + 1, 0),
        from_(static_cast<std::size_t>(n_) + 1, -1),
        window_at_(static_cast<std::size_t>(n_) + 1),
        seen_read_(trace.tensors.size(), -1),
        seen_write_(trace.tensors.size(), -1) {
    const ChannelRates ch = hw.channels();
    ssd_read_rate_ = ch[Channel::kSsdRead];
    ssd_write_rate_ = ch[Channel::kSsdWrite];
    read_rate_ = ssd_read_rate_ + ch[Channel::kHostRead];
    write_rate_ = ssd_write_rate_ + ch[Channel::kHostWrite];
    host_ = read_rate_ > ssd_read_rate_ || write_rate_ > ssd_write_rate_
                ? static_cast<double>(hw.host_memory)
                : 0;
    // E(i, j) counts tensors live at op i and W(i, j) tensors live at op j, so neither exceeds
    // the peak of live bytes: once a window's compute covers moving the peak's share, no longer
    // window from the same start can stall, and it stops growing.
    const auto peak = static_cast<double>(la_.summary.peak_live_bytes);
    horizon_ = seconds_to_move(peak, peak);
  }

  StallBound run(const std::function<void(double)>& progress) {
    for (OpIndex i = 0; i < n_; ++i) {
      if (progress && (i & 255) == 0) progress(static_cast<double>(i) / n_);
      if (at(best_, i) > at(best_, i + 1)) {  // carry forward before windows from i compete
        at(best_, i + 1) = at(best_, i);
        at(from_, i + 1) = -1;
      }
      windows_from(i);
    }
    // Windows ending at k only improve best[k + 1]; make best monotone for the result.
    for (OpIndex k = 1; k <= n_; ++k) {
      if (at(best_, k - 1) > at(best_, k)) {
        at(best_, k) = at(best_, k - 1);
        at(from_, k) = -1;
      }
    }
    StallBound out;
    out.stall_seconds = at(best_, n_);
    out.iteration_seconds = trace_.compute_seconds() + out.stall_seconds;
    for (OpIndex k = n_; k > 0;) {
      if (at(from_, k) < 0) {
        --k;
        continue;
      }
      out.windows.push_back(at(window_at_, k));
      k = at(from_, k);
    }
    std::reverse(out.windows.begin(), out.windows.end());
    return out;
  }

 private:
  // A tensor the window from op i uses that existed before it counts once in E. A tensor with
  // a gap exists before op i when i is in its first live stretch or after its producer.
  [[nodiscard]] bool existed(TensorId x, OpIndex i) const {
    const auto& ten = at(trace_.tensors, x);
    return ten.has_gap() ? i <= ten.freed_after || i > ten.producer : at(spans_.begin, x) < i;
  }

  // Grows the windows that start at op i until none can stall any more, improving best[j + 1]
  // with each window i..j that stalls.
  void windows_from(OpIndex i) {
    double e = 0;
    double w = 0;
    double t = 0;
    auto count_read = [&](TensorId x) {
      if (existed(x, i) && at(seen_read_, x) != i) {
        at(seen_read_, x) = i;
        e += static_cast<double>(at(trace_.tensors, x).bytes);
      }
    };
    for (OpIndex j = i; j < n_; ++j) {
      const auto& op = at(trace_.ops, j);
      t += trace_.op_seconds(static_cast<std::size_t>(j));
      for (const TensorId x : op.inputs) count_read(x);
      for (const TensorId x : op.outputs) {
        count_read(x);
        const auto& ten = at(trace_.tensors, x);
        // Needed after j: persistent, or used later. A tensor with a gap counts only when made
        // or changed in its last live stretch (needed by the next iteration); before its gap it
        // is left out, which can only lower the bound.
        const bool needed =
            ten.has_gap() ? j >= ten.producer : ten.persistent || at(spans_.last_use, x) > j;
        if (at(seen_write_, x) != i && needed) {
          at(seen_write_, x) = i;
          w += static_cast<double>(ten.bytes);
        }
      }
      for (const TensorId x : at(spans_.dies_at, j)) {
        if (at(seen_write_, x) == i) {
          at(seen_write_, x) = -2;  // no longer needed after j; never counted again for this i
          w -= static_cast<double>(at(trace_.tensors, x).bytes);
        }
      }
      record(i, j, t, e, w);
      if (t >= horizon_) break;
    }
  }

  // The least time any plan takes to read what a window needs (e bytes that existed before it)
  // and to write what it leaves (w bytes needed after it). At most C of the e bytes are in
  // device memory when it starts: e - C are read during it, each tensor's first read from the
  // SSDs or from a host copy made before the window (one made during it would need the tensor
  // in device memory first), so at least e - C - H from the SSDs. Of the w bytes at most C stay:
  // w - C are written, and at most H of them are in host memory when it ends.
  [[nodiscard]] double seconds_to_move(double e, double w) const {
    return std::max({transfer_seconds(e - cap_, read_rate_),
                     transfer_seconds(e - cap_ - host_, ssd_read_rate_),
                     transfer_seconds(w - cap_, write_rate_),
                     transfer_seconds(w - cap_ - host_, ssd_write_rate_)});
  }

  // Window i..j with compute t that must read e and write w bytes.
  void record(OpIndex i, OpIndex j, double t, double e, double w) {
    const double need = seconds_to_move(e, w);
    const double stall = need - t;
    if (stall > 0 && at(best_, i) + stall > at(best_, j + 1)) {
      at(best_, j + 1) = at(best_, i) + stall;
      at(from_, j + 1) = i;
      at(window_at_, j + 1) = {i, j, t, std::max(0.0, e - cap_), std::max(0.0, w - cap_), stall};
    }
  }

  const trace::Trace& trace_;
  const trace::LifetimeAnalysis la_;
  const Lifespans spans_;
  OpIndex n_;
  double cap_;
  double read_rate_ = 0;  ///< SSD and host channels together
  double write_rate_ = 0;
  double ssd_read_rate_ = 0;
  double ssd_write_rate_ = 0;
  double host_ = 0;  ///< host memory that can hold offloaded tensors (0: no host tier)
  double horizon_ = 0;
  std::vector<double> best_;
  std::vector<OpIndex> from_;
  std::vector<StallWindow> window_at_;
  std::vector<OpIndex> seen_read_;   // window start that counted the tensor in E
  std::vector<OpIndex> seen_write_;  // window start that counted the tensor in W
};

}  // namespace

StallBound stall_lower_bound(const trace::Trace& trace, const Hardware& hw,
                             const std::function<void(double)>& progress) {
  StallBound b = WindowSearch(trace, hw).run(progress);
  if (progress) progress(1.0);
  return b;
}

}  // namespace tidal::plan
