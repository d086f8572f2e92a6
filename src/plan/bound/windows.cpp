// The windows' dynamic programme: the best set of disjoint windows of one iteration, by a sweep
// over the windows' last op (and, for the tests, by growing every window), and over the
// iteration's end in a periodic schedule.
#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

#include "plan/bound/bound_impl.hpp"
#include "plan/segment_trees.hpp"

namespace tidal::plan::detail::bounding {

namespace {

// The windows of the dynamic programme's best set within ops lo..end-1, in order: from[k] is the
// first op of the last window of the best set before op k (-1: op k - 1 ends none), and
// window_at[k] that window.
std::vector<StallWindow> chosen_windows(const std::vector<OpIndex>& from,
                                        const std::vector<StallWindow>& window_at, OpIndex lo,
                                        OpIndex end) {
  std::vector<StallWindow> out;
  for (OpIndex k = end; k > lo;) {
    if (at(from, k) < 0) {
      --k;
      continue;
    }
    out.push_back(at(window_at, k));
    k = at(from, k);
  }
  std::reverse(out.begin(), out.end());
  return out;
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
    out.windows = chosen_windows(from_, window_at_, 0, n_);
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
      follow_uses(tree, j, starts, prev_use, prev_write);
      if (!starts) continue;
      double value = 0;
      const WindowTree::Leaf top = best_ending_at(tree, at(p, j + 1), value);
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
    out.windows = chosen_windows(from, window_at, lo, hi + 1);
    return out;
  }

 private:
  // The uses of op j in the tree: its reads add to E of every start after the tensor's previous
  // use (that it existed before), its writes of a tensor needed later to W, and a tensor that
  // dies at j leaves W. Before lo (`starts` false) only the uses are followed.
  void follow_uses(WindowTree& tree, OpIndex j, bool starts, std::vector<OpIndex>& prev_use,
                   std::vector<OpIndex>& prev_write) const {
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
  }

  // The best window ending at the op before `p_next` (the compute before the next op) over the
  // four terms; on a tie the earliest start. Its value (best[i] + need - compute) in `value`.
  WindowTree::Leaf best_ending_at(WindowTree& tree, double p_next, double& value) const {
    WindowTree::Leaf top{-1, 0, 0, 0};
    value = -std::numeric_limits<double>::infinity();
    for (int t = 0; t < kTerms; ++t) {
      const auto term = static_cast<Term>(t);
      const double v = tree.max(term) - threshold_[t] / rate_[t] - p_next;
      if (v < value) continue;
      const WindowTree::Leaf leaf = tree.argmax(term);
      const double lv = leaf.value - threshold_[t] / rate_[t] - p_next;
      if (lv > value || (lv == value && leaf.start < top.start)) {
        value = lv;
        top = leaf;
      }
    }
    return top;
  }

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

}  // namespace

// Windows over the iteration's end: in a periodic schedule (each iteration plans and runs as
// the one before; the simulator's iteration is its third) the ops from r to the end and those
// up to r - 1 of the next iteration are one iteration too. The windows within ops r..r+n-1 of
// two iterations bound its stall as the windows of one do; a window over the optimizer step
// and the next forward pass charges both the step's writes and the forward's.
StallBound windows_over_end(const trace::Trace& trace, const Hardware& hw, StallBound b) {
  const auto n = static_cast<OpIndex>(trace.ops.size());
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
  return b;
}

}  // namespace tidal::plan::detail::bounding

namespace tidal::plan::detail {

using bounding::WindowSearch;
using bounding::WindowSweep;

StallBound stall_lower_bound_by_windows(const trace::Trace& trace, const Hardware& hw,
                                        const std::function<void(double)>& progress) {
  WindowSweep sweep(trace, hw);
  return sweep.applies() ? sweep.run(progress) : WindowSearch(trace, hw).run(progress);
}

StallBound stall_lower_bound_by_window_growth(const trace::Trace& trace, const Hardware& hw) {
  return WindowSearch(trace, hw).run({});
}

}  // namespace tidal::plan::detail
