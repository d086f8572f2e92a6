// The stall lower bound: see include/tidal/plan/bound.hpp and docs/simulator.md.
#include "tidal/plan/bound.hpp"

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>

#include "plan/bound_reference.hpp"
#include "plan/int_index.hpp"
#include "plan/segment_trees.hpp"
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

// The bound's four channels, from Hardware::channels(): reads and writes over the SSDs and host
// memory together and over the SSDs alone, and the host memory that can hold offloaded tensors
// (0 where no host channel moves bytes).
struct Rates {
  double read;
  double write;
  double ssd_read;
  double ssd_write;
  double host;
};

Rates rates_of(const Hardware& hw) {
  const ChannelRates ch = hw.channels();
  Rates r{};
  r.ssd_read = ch[Channel::kSsdRead];
  r.ssd_write = ch[Channel::kSsdWrite];
  r.read = r.ssd_read + ch[Channel::kHostRead];
  r.write = r.ssd_write + ch[Channel::kHostWrite];
  r.host = r.read > r.ssd_read || r.write > r.ssd_write ? static_cast<double>(hw.host_memory) : 0;
  return r;
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

// The reads no plan avoids within one iteration (docs/simulator.md, "Lower bound", the
// packing term). Between two uses a and b of a tensor (and, for a tensor that exists when the
// iteration starts, between the start and its first use), either the tensor is in device
// memory at every op in between, or at one of them it is not, and then all of its bytes are
// read before b, inside the iteration. At op k the tensors kept that way and the ones op k uses
// share the device memory C. Keeping the most bytes is an interval packing with capacity
// C - active(k) at op k; its fractional optimum (the greedy below) bounds every plan's, so the
// bytes read are at least the intervals' bytes less it. For the SSD reads the same with C + H
// per op: a tensor read from host memory was in host memory at the op where it was not in
// device memory.
struct ReadFloor {
  double all = 0;  // bytes read from the SSDs and host memory together, at least
  double ssd = 0;  // bytes read from the SSDs, at least
};

bool by_last_op(const detail::KeptInterval& x, const detail::KeptInterval& y) {
  return x.r != y.r ? x.r < y.r : x.l > y.l;
}

// The intervals between consecutive uses of each tensor (ops strictly between), and from the
// iteration's start to the first use of a tensor that exists then; only where the tensor exists
// throughout.
std::vector<detail::KeptInterval> use_intervals(const trace::Trace& trace,
                                                const trace::LifetimeAnalysis& la) {
  std::vector<detail::KeptInterval> out;
  for (std::size_t t = 0; t < trace.tensors.size(); ++t) {
    const trace::Tensor& ten = trace.tensors[t];
    const auto& uses = la.tensors[t].uses;
    const auto bytes = static_cast<std::int64_t>(ten.bytes);
    if (uses.empty() || bytes == 0) continue;
    // Whether the tensor exists at every op of [l, r].
    const auto exists = [&](OpIndex l, OpIndex r) {
      return !ten.has_gap() || std::max(l, ten.freed_after + 1) > std::min(r, ten.producer - 1);
    };
    if (ten.persistent && uses.front() > 0 && exists(0, uses.front() - 1)) {
      out.push_back({0, uses.front() - 1, bytes});
    }
    for (std::size_t i = 1; i < uses.size(); ++i) {
      const OpIndex l = uses[i - 1] + 1;
      const OpIndex r = uses[i] - 1;
      if (l <= r && exists(l, r)) out.push_back({l, r, bytes});
    }
  }
  std::sort(out.begin(), out.end(), by_last_op);
  return out;
}

// The most bytes of `intervals` (sorted by last op) that can stay, an interval taking any share
// of its bytes, when op k holds at most cap[k]: by last op, each takes what every op it spans
// still has. Exchange argument (docs/simulator.md): some optimum agrees with the greedy on the
// interval that ends first, so the greedy is optimal.
std::int64_t pack(const std::vector<detail::KeptInterval>& intervals,
                  const std::vector<std::int64_t>& cap) {
  // The tree holds minus the room left per op, so that its max is minus the least room.
  std::vector<std::int64_t> neg(cap.size());
  for (std::size_t k = 0; k < cap.size(); ++k) neg[k] = -std::max<std::int64_t>(0, cap[k]);
  detail::RangeTree room(neg);
  std::int64_t kept = 0;
  for (const detail::KeptInterval& u : intervals) {
    const std::int64_t take = std::min(u.bytes, -room.max(u.l, u.r));
    if (take <= 0) continue;
    room.add(u.l, u.r, take);
    kept += take;
  }
  return kept;
}

ReadFloor read_floor(const trace::Trace& trace, const trace::LifetimeAnalysis& la,
                     std::uint64_t device, std::uint64_t host) {
  ReadFloor out;
  const std::vector<detail::KeptInterval> intervals = use_intervals(trace, la);
  std::int64_t total = 0;
  for (const detail::KeptInterval& u : intervals) total += u.bytes;
  std::vector<std::int64_t> cap(la.active_bytes.size());
  for (std::size_t k = 0; k < cap.size(); ++k) {
    cap[k] = static_cast<std::int64_t>(device) - static_cast<std::int64_t>(la.active_bytes[k]);
  }
  out.all = static_cast<double>(total - pack(intervals, cap));
  if (host > 0) {
    for (auto& c : cap) c += static_cast<std::int64_t>(host);
    out.ssd = static_cast<double>(total - pack(intervals, cap));
  } else {
    out.ssd = out.all;
  }
  return out;
}

// The dynamic programme of the bound over the windows i..j: best[k], the largest total stall
// of disjoint windows within ops 0..k-1; from[k], the first op of the last window of that set,
// or -1 when op k-1 ends no window. This one grows the windows from each start one op at a time
// (O(ops^2)): the reference that WindowSweep is tested against.
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
    const Rates r = rates_of(hw);
    ssd_read_rate_ = r.ssd_read;
    ssd_write_rate_ = r.ssd_write;
    read_rate_ = r.read;
    write_rate_ = r.write;
    host_ = r.host;
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

// The four bounds on a window's time (docs/simulator.md), each (X - c) / r with X the bytes the
// window reads (E) or writes (W): all reads, SSD reads, all writes, SSD writes.
enum Term : std::uint8_t { kRead, kSsdRead, kWrite, kSsdWrite, kTerms };

// Per window start i (a leaf): best[i] + P[i] + X_t(i, j) / r_t for each term t, where P is the
// prefix sum of compute and X_t the window i..j's E or W, with range adds to E or W over starts
// and the max over all starts; starts not yet reached hold -inf. A leaf's lazy values are its
// raw E and W. Private to the bound; not thread-safe.
class WindowTree {
 public:
  WindowTree(int n, const std::array<double, kTerms>& inv_rate) : inv_(inv_rate) {
    while (leaves_ < n) leaves_ <<= 1;
    constexpr double kNone = -std::numeric_limits<double>::infinity();
    mx_.assign(2 * static_cast<std::size_t>(leaves_), {kNone, kNone, kNone, kNone});
    lz_.assign(2 * static_cast<std::size_t>(leaves_), {0.0, 0.0});
  }

  // Start i enters with best[i] + P[i] and nothing read or written yet. No lazy value lies on
  // its path: every add so far covered starts before it only.
  void activate(int i, double base) {
    int x = leaves_ + i;
    at(mx_, x) = {base, base, base, base};
    for (x >>= 1; x >= 1; x >>= 1) pull(x);
  }

  // Adds `bytes` to E (write false) or W (write true) of the starts [l, r].
  void add(int l, int r, double bytes, bool write) {
    if (l > r || bytes == 0) return;
    add(1, 0, leaves_ - 1, l, r, write ? 0.0 : bytes, write ? bytes : 0.0);
  }

  [[nodiscard]] double max(Term t) const { return at(mx_, 1)[t]; }

  // A start whose term t is the maximum (the leftmost where values tie), with its value and raw
  // E and W.
  struct Leaf {
    int start;
    double value;
    double e;
    double w;
  };
  Leaf argmax(Term t) {
    int x = 1;
    while (x < leaves_) {
      push(x);
      x = at(mx_, 2 * x)[t] >= at(mx_, 2 * x + 1)[t] ? 2 * x : 2 * x + 1;
    }
    return {x - leaves_, at(mx_, x)[t], at(lz_, x)[0], at(lz_, x)[1]};
  }

 private:
  void apply(int x, double e, double w) {
    auto& m = at(mx_, x);
    m[kRead] += e * inv_[kRead];
    m[kSsdRead] += e * inv_[kSsdRead];
    m[kWrite] += w * inv_[kWrite];
    m[kSsdWrite] += w * inv_[kSsdWrite];
    at(lz_, x)[0] += e;
    at(lz_, x)[1] += w;
  }
  void push(int x) {
    auto& z = at(lz_, x);
    if (z[0] == 0 && z[1] == 0) return;
    apply(2 * x, z[0], z[1]);
    apply(2 * x + 1, z[0], z[1]);
    z = {0.0, 0.0};
  }
  void pull(int x) {
    for (int t = 0; t < kTerms; ++t) {
      at(mx_, x)[t] = std::max(at(mx_, 2 * x)[t], at(mx_, 2 * x + 1)[t]);
    }
  }
  void add(int x, int lo, int hi, int l, int r, double e, double w) {
    if (hi < l || lo > r) return;
    if (l <= lo && hi <= r) {
      apply(x, e, w);
      return;
    }
    push(x);
    const int mid = (lo + hi) / 2;
    add(2 * x, lo, mid, l, r, e, w);
    add(2 * x + 1, mid + 1, hi, l, r, e, w);
    pull(x);
  }

  std::array<double, kTerms> inv_;
  int leaves_ = 1;
  std::vector<std::array<double, kTerms>> mx_;
  std::vector<std::array<double, 2>> lz_;  // at a leaf: its E and W
};

// The same dynamic programme as WindowSearch, swept over the window's last op j instead of its
// first: best[j + 1] = max(best[j], max over i of best[i] + need(i, j) - (P[j + 1] - P[i])). When
// op j uses a tensor, every start after the tensor's previous use (that it existed before) gains
// its bytes in E: a range add; W likewise with the ops that write a tensor the window leaves
// needed, and a range subtraction when the tensor dies. need is the max of four terms (X - c) / r,
// so the max over starts is the max over terms of a tree's max: O((ops + uses) log ops) in all,
// where WindowSearch grows up to every window. Needs all four rates positive.
class WindowSweep {
 public:
  WindowSweep(const trace::Trace& trace, const Hardware& hw)
      : trace_(trace),
        la_(trace::analyze_lifetimes(trace)),
        spans_(lifespans(trace, la_)),
        n_(static_cast<OpIndex>(trace.ops.size())) {
    const Rates r = rates_of(hw);
    const auto cap = static_cast<double>(hw.device_memory);
    rate_ = {r.read, r.ssd_read, r.write, r.ssd_write};
    threshold_ = {cap, cap + r.host, cap, cap + r.host};
    cap_ = cap;
  }

  // Whether the sweep applies: with a channel at rate 0 a term is infinite or 0, not linear.
  [[nodiscard]] bool applies() const {
    return std::all_of(rate_.begin(), rate_.end(), [](double r) { return r > 0; });
  }

  // The best disjoint windows within ops lo..hi (all ops by default). The tensors' uses before
  // lo are still swept, so that a window from lo knows what existed before it.
  StallBound run(const std::function<void(double)>& progress, OpIndex lo = 0, OpIndex hi = -1) {
    if (hi < 0) hi = n_ - 1;
    std::array<double, kTerms> inv{};
    for (int t = 0; t < kTerms; ++t) inv[t] = 1.0 / rate_[t];
    WindowTree tree(std::max(n_, 1), inv);
    const auto nt = trace_.tensors.size();
    std::vector<OpIndex> prev_use(nt, -1);    // last op so far that used the tensor
    std::vector<OpIndex> prev_write(nt, -1);  // last op so far that wrote it while needed after
    std::vector<double> best(static_cast<std::size_t>(n_) + 1, 0);
    std::vector<OpIndex> from(static_cast<std::size_t>(n_) + 1, -1);
    std::vector<StallWindow> window_at(static_cast<std::size_t>(n_) + 1);
    std::vector<double> p(static_cast<std::size_t>(n_) + 1, 0);  // compute before op k
    for (OpIndex k = 0; k < n_; ++k) {
      at(p, k + 1) = at(p, k) + trace_.op_seconds(static_cast<std::size_t>(k));
    }
    for (OpIndex j = 0; j <= hi; ++j) {
      if (progress && (j & 255) == 0) progress(static_cast<double>(j) / n_);
      // Before lo only the uses are followed: every add then covers starts before lo, which no
      // window takes.
      const bool starts = j >= lo;
      if (starts) tree.activate(j, at(best, j) + at(p, j));
      const auto& op = at(trace_.ops, j);
      auto read = [&](TensorId x) {
        OpIndex& prev = at(prev_use, x);
        if (prev == j) return;  // an op that lists a tensor twice uses it once
        const auto& ten = at(trace_.tensors, x);
        const auto bytes = static_cast<double>(ten.bytes);
        if (starts && ten.has_gap()) {  // existed before i: i <= freed_after or i > producer
          tree.add(prev + 1, std::min(j, ten.freed_after), bytes, false);
          tree.add(std::max(prev + 1, ten.producer + 1), j, bytes, false);
        } else if (starts) {
          tree.add(std::max(prev + 1, at(spans_.begin, x) + 1), j, bytes, false);
        }
        prev = j;
      };
      for (const TensorId x : op.inputs) read(x);
      for (const TensorId x : op.outputs) read(x);
      for (const TensorId x : op.outputs) {
        const auto& ten = at(trace_.tensors, x);
        const bool needed =
            ten.has_gap() ? j >= ten.producer : ten.persistent || at(spans_.last_use, x) > j;
        OpIndex& prev = at(prev_write, x);
        if (!needed || prev == j) continue;
        if (starts) tree.add(prev + 1, j, static_cast<double>(ten.bytes), true);
        prev = j;
      }
      for (const TensorId x : at(spans_.dies_at, j)) {
        OpIndex& prev = at(prev_write, x);
        if (prev < 0) continue;
        if (starts) tree.add(0, prev, -static_cast<double>(at(trace_.tensors, x).bytes), true);
        prev = -1;
      }
      if (!starts) continue;
      // The best window ending at j over the four terms; on a tie the earliest start.
      WindowTree::Leaf top{-1, 0, 0, 0};
      double value = -std::numeric_limits<double>::infinity();
      for (int t = 0; t < kTerms; ++t) {
        const auto term = static_cast<Term>(t);
        const double v = tree.max(term) - threshold_[t] / rate_[t] - at(p, j + 1);
        if (v < value) continue;
        const WindowTree::Leaf leaf = tree.argmax(term);
        const double lv = leaf.value - threshold_[t] / rate_[t] - at(p, j + 1);
        if (lv > value || (lv == value && leaf.start < top.start)) {
          value = lv;
          top = leaf;
        }
      }
      // As WindowSearch: a window that stalls ties with best[j] and wins when it starts before j.
      const double stall = value - at(best, top.start);
      const bool take = stall > 0 && (top.start < j ? value >= at(best, j) : value > at(best, j));
      if (take) {
        at(best, j + 1) = value;
        at(from, j + 1) = top.start;
        at(window_at, j + 1) = {top.start,
                                j,
                                at(p, j + 1) - at(p, top.start),
                                std::max(0.0, top.e - cap_),
                                std::max(0.0, top.w - cap_),
                                stall};
      } else {
        at(best, j + 1) = at(best, j);
      }
    }
    StallBound out;
    out.stall_seconds = at(best, hi + 1);
    out.iteration_seconds = at(p, hi + 1) - at(p, lo) + out.stall_seconds;
    for (OpIndex k = hi + 1; k > lo;) {
      if (at(from, k) < 0) {
        --k;
        continue;
      }
      out.windows.push_back(at(window_at, k));
      k = at(from, k);
    }
    std::reverse(out.windows.begin(), out.windows.end());
    return out;
  }

 private:
  const trace::Trace& trace_;
  const trace::LifetimeAnalysis la_;
  const Lifespans spans_;
  OpIndex n_;
  double cap_ = 0;
  std::array<double, kTerms> rate_{};
  std::array<double, kTerms> threshold_{};
};

// Two iterations of `trace` one after the other: ops n..2n-1 are ops 0..n-1 again, with the
// persistent tensors shared and every other tensor made anew. A persistent tensor with a gap
// (live over [producer, end) and [0, freed_after]) becomes two: one live over the first
// iteration's first stretch and the second's last (a gap from freed_after to n + producer), and
// one made by the first iteration's producer and used up to the second's freed_after.
trace::Trace two_iterations(const trace::Trace& trace) {
  const auto n = static_cast<OpIndex>(trace.ops.size());
  const auto nt = static_cast<TensorId>(trace.tensors.size());
  trace::Trace two = trace;
  std::vector<TensorId> second(static_cast<std::size_t>(nt));      // the tensor in iteration 2
  std::vector<TensorId> bridge(static_cast<std::size_t>(nt), -1);  // a gap's middle stretch
  const auto add = [&](trace::Tensor t) {
    t.id = static_cast<TensorId>(two.tensors.size());
    two.tensors.push_back(std::move(t));
    return two.tensors.back().id;
  };
  for (TensorId x = 0; x < nt; ++x) {
    const trace::Tensor& t = at(trace.tensors, x);
    if (t.has_gap()) {
      at(two.tensors, x).producer = n + t.producer;
      trace::Tensor mid = t;
      mid.persistent = false;
      mid.freed_after = trace::kNoOp;
      at(bridge, x) = add(std::move(mid));
      at(second, x) = x;
    } else if (t.persistent) {
      at(second, x) = x;
    } else {
      trace::Tensor copy = t;
      if (copy.producer != trace::kNoOp) copy.producer += n;
      if (copy.freed_after != trace::kNoOp) copy.freed_after += n;
      at(second, x) = add(std::move(copy));
    }
  }
  // Which tensor op k (of 2n) names for x.
  const auto name = [&](TensorId x, OpIndex k) {
    const trace::Tensor& t = at(trace.tensors, x);
    const OpIndex i = k % n;
    if (t.has_gap() && (k < n ? i >= t.producer : i <= t.freed_after)) return at(bridge, x);
    return k < n ? x : at(second, x);
  };
  const double length = trace.ops.empty() ? 0.0 : trace.ops.back().end_s;
  for (OpIndex i = 0; i < n; ++i) two.ops.push_back(at(trace.ops, i));
  for (OpIndex k = 0; k < 2 * n; ++k) {
    trace::Op& op = at(two.ops, k);
    if (k >= n) {
      op.index = k;
      op.start_s += length;
      op.end_s += length;
    }
    for (TensorId& x : op.inputs) x = name(x, k);
    for (TensorId& x : op.outputs) x = name(x, k);
  }
  return two;
}

// The candidates where a periodic schedule's cycle may be cut (docs/simulator.md, "Windows
// over the iteration's end"): the ends of the windows one iteration finds, which a window over
// the end would join.
std::vector<OpIndex> cuts(const StallBound& b, OpIndex n) {
  std::vector<OpIndex> out;
  const auto put = [&](OpIndex k) {
    if (k > 0 && k < n && std::find(out.begin(), out.end(), k) == out.end()) out.push_back(k);
  };
  if (!b.windows.empty()) {
    put(b.windows.front().last + 1);
    put(b.windows.back().first);
  }
  return out;
}

// A peak between a write and a read (docs/simulator.md, "Peaks between a write and a read"). At
// op p the simulator counts every tensor that exists and is resident, being written or being
// read; one that is not counted there finished its write before op p started and has its read
// issued after op p ended. So with the tensors that exist at p and op p does not use:
// - of those made or changed at op i or later, at least A = their bytes + active(p) - C are not
//   counted at p, each written after op i ended and before op p started: the ops i+1..p-1 and
//   the stalls before ops i+1..p last at least A / write rate (and (A - H) / SSD write rate: at
//   most H are in host memory at p);
// - of those whose next use is at op j or before, at least R = their bytes + active(p) - C are
//   not counted at p, each read after op p ended and before its use started: the ops p+1..j-1
//   and the stalls before ops p+1..j last at least R / read rate (and (R - H) / SSD read rate).
// Each is a window of its own (a "half"), whose stall lies before ops (first, last]; the halves
// and the windows of the rest of the bound (whose stall lies before ops (first, last + 1]) add
// up where those spans are disjoint.
struct Half {
  OpIndex from = 0;  // the stall lies before ops from+1..to (from < 0: op from + n of the
  OpIndex to = 0;    // iteration before)
  bool write = false;
  double bytes = 0;
  double compute = 0;
  double stall = 0;
};

std::vector<Half> halves(const trace::Trace& trace, const trace::LifetimeAnalysis& la,
                         const Hardware& hw, const std::vector<OpIndex>& stops) {
  std::vector<Half> out;
  const auto n = static_cast<OpIndex>(trace.ops.size());
  if (n < 3) return out;
  const Rates rates = rates_of(hw);
  if (rates.read <= 0 || rates.write <= 0) return out;
  const auto cap = static_cast<double>(hw.device_memory);
  std::vector<double> pre(static_cast<std::size_t>(n) + 1, 0);
  for (OpIndex k = 0; k < n; ++k) {
    at(pre, k + 1) = at(pre, k) + trace.op_seconds(static_cast<std::size_t>(k));
  }
  // Compute of ops a..b-1 (a < 0: from op a + n of the iteration before).
  const auto compute = [&](OpIndex a, OpIndex b) {
    if (b <= a) return 0.0;
    return a >= 0 ? at(pre, b) - at(pre, a) : at(pre, n) - at(pre, n + a) + at(pre, b);
  };
  std::vector<std::vector<OpIndex>> writes(trace.tensors.size());
  for (const auto& op : trace.ops) {
    for (const TensorId x : op.outputs) {
      auto& w = at(writes, x);
      if (w.empty() || w.back() != op.index) w.push_back(op.index);
    }
  }
  // Pivots: in each of kStretches stretches of ops, the one with the most live bytes, where
  // that is over the capacity.
  constexpr OpIndex kStretches = 64;
  std::vector<OpIndex> pivots;
  for (OpIndex s = 0; s < kStretches; ++s) {
    OpIndex top = -1;
    for (OpIndex k = s * n / kStretches; k < (s + 1) * n / kStretches; ++k) {
      if (top < 0 || at(la.live_bytes, k) > at(la.live_bytes, top)) top = k;
    }
    if (top >= 0 && static_cast<double>(at(la.live_bytes, top)) > cap) pivots.push_back(top);
  }
  // Where a half may be made to end so that it fits beside the other spans: the given stops
  // and the pivots.
  std::vector<OpIndex> ends = stops;
  ends.insert(ends.end(), pivots.begin(), pivots.end());
  std::sort(ends.begin(), ends.end());
  ends.erase(std::unique(ends.begin(), ends.end()), ends.end());
  constexpr OpIndex kNever = std::numeric_limits<OpIndex>::min();
  struct Item {
    OpIndex born;  // the op that made its version at p (< 0: in the iteration before; kNever)
    OpIndex next;  // its next use after p (n: none in this iteration)
    double bytes;
  };
  const auto seconds = [&](double bytes, double all, double ssd) {
    return std::max(transfer_seconds(bytes, all), transfer_seconds(bytes - rates.host, ssd));
  };
  for (const OpIndex p : pivots) {
    std::vector<Item> items;
    for (std::size_t x = 0; x < trace.tensors.size(); ++x) {
      const trace::Tensor& ten = trace.tensors[x];
      const auto& life = la.tensors[x];
      if (ten.bytes == 0 || life.uses.empty()) continue;
      const bool live = ten.persistent ? ten.live_at(p)
                                       : life.live_begin != trace::kNoOp && life.live_begin <= p &&
                                             p <= life.live_end;
      if (!live || std::binary_search(life.uses.begin(), life.uses.end(), p)) continue;
      const auto u = std::upper_bound(life.uses.begin(), life.uses.end(), p);
      const auto& w = at(writes, static_cast<TensorId>(x));
      const auto wb = std::upper_bound(w.begin(), w.end(), p);
      OpIndex born = kNever;
      if (wb != w.begin()) {
        born = *(wb - 1);
      } else if (ten.persistent && !w.empty()) {
        born = w.back() - n;  // changed later in the iteration: made in the one before
      }
      items.push_back({born, u == life.uses.end() ? n : *u, static_cast<double>(ten.bytes)});
    }
    const double base = static_cast<double>(at(la.active_bytes, p)) - cap;
    std::vector<Item> by_born = items;  // latest first
    std::sort(by_born.begin(), by_born.end(),
              [](const Item& x, const Item& y) { return x.born > y.born; });
    std::sort(items.begin(), items.end(),
              [](const Item& x, const Item& y) { return x.next < y.next; });
    // The halves of one kind at p in the order of their far op (a write half (i, p]: i, latest
    // first; a read half (p, j]: j, earliest first), each with the best of those up to it, so
    // that the best within a limit is one binary search.
    struct BestSoFar {
      std::vector<OpIndex> far;
      std::vector<Half> best;
    };
    const auto sweep = [&](const std::vector<Item>& sorted, bool write) {
      const auto far_of = [&](const Item& x) { return write ? x.born : x.next; };
      BestSoFar s;
      Half best{write ? 0 : p, write ? 0 : p, write, 0, 0, 0};
      double bytes = base;
      for (std::size_t q = 0; q < sorted.size(); ++q) {
        const OpIndex e = far_of(sorted[q]);
        if (write ? e <= -n : e >= n) break;  // made before the iteration before (kNever too)
        bytes += sorted[q].bytes;
        if (q + 1 < sorted.size() && far_of(sorted[q + 1]) == e) continue;
        const double c = write ? compute(e + 1, p) : compute(p + 1, e);
        const double stall = write ? seconds(bytes, rates.write, rates.ssd_write) - c
                                   : seconds(bytes, rates.read, rates.ssd_read) - c;
        if (stall > best.stall) {
          best = write ? Half{e, p, true, bytes, c, stall} : Half{p, e, false, bytes, c, stall};
        }
        s.far.push_back(e);
        s.best.push_back(best);
      }
      return s;
    };
    const BestSoFar writes_at = sweep(by_born, true);
    const BestSoFar reads_at = sweep(items, false);
    // The best of the first halves of s whose far op passes `within`.
    const auto best_of = [](const BestSoFar& s, const auto& within) {
      const auto k = std::partition_point(s.far.begin(), s.far.end(), within) - s.far.begin();
      return k == 0 ? Half{} : s.best[static_cast<std::size_t>(k - 1)];
    };
    // The write half with the most stall and i >= lo; the read half with the most and j <= hi.
    const auto best_write = [&](OpIndex lo) {
      return best_of(writes_at, [&](OpIndex i) { return i >= lo; });
    };
    const auto best_read = [&](OpIndex hi) {
      return best_of(reads_at, [&](OpIndex j) { return j <= hi; });
    };
    // A write half ends at p and a read half starts there: only this pivot's can be the same.
    const std::size_t mine = out.size();
    const auto put = [&](const Half& h) {
      if (h.stall <= 0) return;
      for (std::size_t q = mine; q < out.size(); ++q) {
        const Half& o = out[q];
        if (o.write == h.write && o.from == h.from && o.to == h.to) return;
      }
      out.push_back(h);
    };
    const Half w = best_write(-n + 1);
    const Half r = best_read(n - 1);
    put(w);
    put(r);
    // Each also as far as the other allows where the two meet over the iteration's end, and as
    // far as each stop allows (a stop s after p limits a write half's start to s of the
    // iteration before).
    if (w.stall > 0 && r.stall > 0 && w.from < 0 && r.to > w.from + n) {
      put(best_write(r.to - n));
      put(best_read(w.from + n));
    }
    for (const OpIndex s : ends) {
      if (s != p) put(best_write(s < p ? s : s - n));
      if (s > p) put(best_read(s));
    }
  }
  return out;
}

// The windows of `b` and the halves: the set with the largest stall whose stall spans are
// disjoint. Spans are of stall positions (l, r] on the cycle of one iteration's ops; one that
// runs over the iteration's end has r <= l.
StallBound with_halves(const trace::Trace& trace, const trace::LifetimeAnalysis& la,
                       const Hardware& hw, const StallBound& b) {
  const auto n = static_cast<OpIndex>(trace.ops.size());
  struct Span {
    OpIndex l;
    OpIndex r;
    double stall;
    int item;  // index in b.windows, or -1 - index in the halves
  };
  std::vector<Span> spans;
  for (std::size_t w = 0; w < b.windows.size(); ++w) {
    const StallWindow& x = b.windows[w];
    // Its stall lies before ops first+1..last+1 (the writes of its last op may complete in the
    // stall before the next).
    spans.push_back({x.first, x.last + 1, x.stall_seconds, static_cast<int>(w)});
  }
  // The halves anywhere, and each as far as an edge of b's windows allows.
  std::vector<OpIndex> stops;
  for (const StallWindow& x : b.windows) {
    stops.push_back(x.first);
    stops.push_back((x.last + 1) % n);
  }
  const std::vector<Half> hs = halves(trace, la, hw, stops);
  if (hs.empty()) return b;
  for (std::size_t q = 0; q < hs.size(); ++q) {
    const Half& h = hs[q];
    spans.push_back({h.from < 0 ? h.from + n : h.from, h.to, h.stall, -1 - static_cast<int>(q)});
  }
  std::vector<Span> lin;
  std::vector<Span> wraps;
  for (const Span& x : spans) (x.l < x.r ? lin : wraps).push_back(x);  // r = n: linear
  std::sort(lin.begin(), lin.end(), [](const Span& x, const Span& y) { return x.r < y.r; });
  // Weighted interval scheduling of the linear spans within (lo, hi].
  const auto solve = [&](OpIndex lo, OpIndex hi, std::vector<int>* chosen) {
    const std::size_t m = lin.size();
    std::vector<double> best(m + 1, 0);
    std::vector<int> take(m + 1, -1);
    std::vector<std::size_t> prev(m + 1, 0);
    for (std::size_t q = 0; q < m; ++q) {
      best[q + 1] = best[q];
      const Span& c = lin[q];
      if (c.l < lo || c.r > hi) continue;
      // The first k spans end at or before c's start (lin is sorted by end).
      const auto k = static_cast<std::size_t>(
          std::upper_bound(lin.begin(), lin.begin() + static_cast<std::ptrdiff_t>(q), c.l,
                           [](OpIndex l, const Span& x) { return l < x.r; }) -
          lin.begin());
      if (best[k] + c.stall > best[q + 1]) {
        best[q + 1] = best[k] + c.stall;
        take[q + 1] = static_cast<int>(q);
        prev[q + 1] = k;
      }
    }
    for (std::size_t q = m; q > 0;) {
      if (take[q] < 0) {
        --q;
        continue;
      }
      chosen->push_back(lin[static_cast<std::size_t>(take[q])].item);
      q = prev[q];
    }
    return best[m];
  };
  std::vector<int> chosen;
  double total = solve(0, n, &chosen);
  for (const Span& w : wraps) {
    std::vector<int> with;
    const double t = w.stall + solve(w.r, w.l, &with);
    if (t > total) {
      total = t;
      chosen = std::move(with);
      chosen.push_back(w.item);
    }
  }
  if (total <= b.stall_seconds * (1 + 1e-12)) return b;
  StallBound out;
  out.stall_seconds = total;
  out.iteration_seconds = trace.compute_seconds() + total;
  for (const int w : chosen) {
    if (w >= 0) {
      out.windows.push_back(b.windows[static_cast<std::size_t>(w)]);
      continue;
    }
    const Half& h = hs[static_cast<std::size_t>(-1 - w)];
    // As a window from..to-1, whose stall lies before ops from+1..to as the others' does (its
    // compute leaves out op from's: a write starts after the op that made the tensor, a read
    // after the pivot).
    out.windows.push_back({(h.from + n) % n, (h.to - 1 + n) % n, h.compute, h.write ? 0.0 : h.bytes,
                           h.write ? h.bytes : 0.0, h.stall});
  }
  std::sort(out.windows.begin(), out.windows.end(),
            [](const StallWindow& x, const StallWindow& y) { return x.first < y.first; });
  return out;
}

}  // namespace

StallBound stall_lower_bound(const trace::Trace& trace, const Hardware& hw,
                             const std::function<void(double)>& progress) {
  return detail::stall_lower_bound_and_windows(trace, hw, progress, nullptr, nullptr);
}

namespace detail {

StallBound stall_lower_bound_and_windows(const trace::Trace& trace, const Hardware& hw,
                                         const std::function<void(double)>& progress,
                                         StallBound* one_iteration, StallBound* windows) {
  const trace::LifetimeAnalysis la = trace::analyze_lifetimes(trace);
  // An op that needs more than device memory by itself: no plan fits, and nothing bounds it.
  const auto most = std::max_element(la.active_bytes.begin(), la.active_bytes.end());
  if (most != la.active_bytes.end() && *most > hw.device_memory) {
    StallBound none;
    none.no_fit_op = static_cast<OpIndex>(most - la.active_bytes.begin());
    none.no_fit_bytes = *most;
    none.iteration_seconds = trace.compute_seconds();
    if (one_iteration != nullptr) *one_iteration = none;
    if (windows != nullptr) *windows = none;
    if (progress) progress(1.0);
    return none;
  }
  StallBound b = stall_lower_bound_by_windows(trace, hw, progress);
  if (one_iteration != nullptr) *one_iteration = b;
  // Windows over the iteration's end: in a periodic schedule (each iteration plans and runs as
  // the one before; the simulator's iteration is its third) the ops from r to the end and those
  // up to r - 1 of the next iteration are one iteration too. The windows within ops r..r+n-1 of
  // two iterations bound its stall as the windows of one do; a window over the optimizer step
  // and the next forward pass charges both the step's writes and the forward's.
  const auto n = static_cast<OpIndex>(trace.ops.size());
  if (n > 0) {
    const std::vector<OpIndex> at_cuts = cuts(b, n);
    if (!at_cuts.empty()) {
      const trace::Trace two = two_iterations(trace);
      WindowSweep sweep(two, hw);
      if (sweep.applies()) {
        for (const OpIndex r : at_cuts) {
          StallBound c = sweep.run({}, r, r + n - 1);
          if (c.stall_seconds <= b.stall_seconds) continue;
          for (StallWindow& w : c.windows) {
            w.first %= n;
            w.last %= n;
          }
          c.iteration_seconds = trace.compute_seconds() + c.stall_seconds;
          b = std::move(c);
        }
      }
    }
  }
  // The whole iteration as one window, with the reads no plan avoids (the packing term): where
  // it is longer than the windows' sum, it is the bound.
  if (n > 0) {
    const ChannelRates ch = hw.channels();
    const bool host = hw.host_memory > 0 && ch[Channel::kHostRead] > 0;
    const ReadFloor f = read_floor(trace, la, hw.device_memory, host ? hw.host_memory : 0);
    const double ssd_rate = ch[Channel::kSsdRead];
    const double rate = ssd_rate + (host ? ch[Channel::kHostRead] : 0.0);
    const double compute = trace.compute_seconds();
    const double need = std::max(transfer_seconds(f.all, rate), transfer_seconds(f.ssd, ssd_rate));
    if (need - compute > b.stall_seconds) {
      b.stall_seconds = need - compute;
      b.iteration_seconds = compute + b.stall_seconds;
      b.windows = {StallWindow{0, n - 1, compute, f.all, 0.0, b.stall_seconds}};
    }
  }
  if (windows != nullptr) *windows = b;
  // Peaks between a write and a read: where their windows with the others stall more, they are
  // the bound.
  if (n > 0) b = with_halves(trace, la, hw, b);
  if (progress) progress(1.0);
  return b;
}

StallBound stall_lower_bound_by_windows(const trace::Trace& trace, const Hardware& hw,
                                        const std::function<void(double)>& progress) {
  WindowSweep sweep(trace, hw);
  return sweep.applies() ? sweep.run(progress) : WindowSearch(trace, hw).run(progress);
}

StallBound stall_lower_bound_by_window_growth(const trace::Trace& trace, const Hardware& hw) {
  return WindowSearch(trace, hw).run({});
}

std::int64_t max_kept_bytes(std::vector<KeptInterval> intervals,
                            const std::vector<std::int64_t>& cap) {
  std::sort(intervals.begin(), intervals.end(), by_last_op);
  return pack(intervals, cap);
}

}  // namespace detail

}  // namespace tidal::plan
