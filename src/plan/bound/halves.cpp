// The peaks between a write and a read: halves of windows, and the best disjoint set of them
// with the windows of the rest of the bound.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "plan/bound/bound_impl.hpp"
#include "plan/segment_trees.hpp"

namespace tidal::plan::detail::bounding {

namespace {

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

// A tensor that exists at a pivot p and that op p does not use: the op that made its version at
// p (< 0: in the iteration before; kNever: before that), its next use after p (n: none in this
// iteration), and its bytes.
constexpr OpIndex kNever = std::numeric_limits<OpIndex>::min();
struct Item {
  OpIndex born;
  OpIndex next;
  double bytes;
};

// The halves of one kind at a pivot in the order of their far op (a write half (i, p]: i, latest
// first; a read half (p, j]: j, earliest first), each with the best of those up to it, so that
// the best within a limit is one binary search.
struct BestSoFar {
  std::vector<OpIndex> far;
  std::vector<Half> best;
};

// The halves of one trace on one machine: the pivots, and at each the best halves.
class HalfSearch {
 public:
  HalfSearch(const trace::Trace& trace, const trace::LifetimeAnalysis& la, const Hardware& hw)
      : trace_(trace),
        la_(la),
        n_(static_cast<OpIndex>(trace.ops.size())),
        rates_(rates_of(hw)),
        cap_(static_cast<double>(hw.device_memory)),
        pre_(static_cast<std::size_t>(n_) + 1, 0),
        writes_(trace.tensors.size()) {
    for (OpIndex k = 0; k < n_; ++k) {
      at(pre_, k + 1) = at(pre_, k) + trace.op_seconds(static_cast<std::size_t>(k));
    }
    for (const auto& op : trace.ops) {
      for (const TensorId x : op.outputs) {
        auto& w = at(writes_, x);
        if (w.empty() || w.back() != op.index) w.push_back(op.index);
      }
    }
  }

  // Pivots: in each of kStretches stretches of ops, the one with the most live bytes, where
  // that is over the capacity.
  [[nodiscard]] std::vector<OpIndex> pivots() const {
    constexpr OpIndex kStretches = 64;
    std::vector<OpIndex> pivots;
    for (OpIndex s = 0; s < kStretches; ++s) {
      OpIndex top = -1;
      for (OpIndex k = s * n_ / kStretches; k < (s + 1) * n_ / kStretches; ++k) {
        if (top < 0 || at(la_.live_bytes, k) > at(la_.live_bytes, top)) top = k;
      }
      if (top >= 0 && static_cast<double>(at(la_.live_bytes, top)) > cap_) pivots.push_back(top);
    }
    return pivots;
  }

  // The best halves at pivot p, each also as far as each of `ends` allows, into `out`.
  void halves_at(OpIndex p, const std::vector<OpIndex>& ends, std::vector<Half>& out) const {
    const OpIndex n = n_;
    std::vector<Item> items = items_at(p);
    const double base = static_cast<double>(at(la_.active_bytes, p)) - cap_;
    std::vector<Item> by_born = items;  // latest first
    std::sort(by_born.begin(), by_born.end(),
              [](const Item& x, const Item& y) { return x.born > y.born; });
    std::sort(items.begin(), items.end(),
              [](const Item& x, const Item& y) { return x.next < y.next; });
    const BestSoFar writes_at = sweep(by_born, true, p, base);
    const BestSoFar reads_at = sweep(items, false, p, base);
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

 private:
  // Compute of ops a..b-1 (a < 0: from op a + n of the iteration before).
  [[nodiscard]] double compute(OpIndex a, OpIndex b) const {
    if (b <= a) return 0.0;
    return a >= 0 ? at(pre_, b) - at(pre_, a) : at(pre_, n_) - at(pre_, n_ + a) + at(pre_, b);
  }

  [[nodiscard]] double seconds(double bytes, double all, double ssd) const {
    return std::max(transfer_seconds(bytes, all), transfer_seconds(bytes - rates_.host, ssd));
  }

  // The tensors that exist at pivot p and that op p does not use.
  [[nodiscard]] std::vector<Item> items_at(OpIndex p) const {
    std::vector<Item> items;
    for (std::size_t x = 0; x < trace_.tensors.size(); ++x) {
      const trace::Tensor& ten = trace_.tensors[x];
      const auto& life = la_.tensors[x];
      if (ten.bytes == 0 || life.uses.empty()) continue;
      const bool live = ten.persistent ? ten.live_at(p)
                                       : life.live_begin != trace::kNoOp && life.live_begin <= p &&
                                             p <= life.live_end;
      if (!live || std::binary_search(life.uses.begin(), life.uses.end(), p)) continue;
      const auto u = std::upper_bound(life.uses.begin(), life.uses.end(), p);
      const auto& w = at(writes_, static_cast<TensorId>(x));
      const auto wb = std::upper_bound(w.begin(), w.end(), p);
      OpIndex born = kNever;
      if (wb != w.begin()) {
        born = *(wb - 1);
      } else if (ten.persistent && !w.empty()) {
        born = w.back() - n_;  // changed later in the iteration: made in the one before
      }
      items.push_back({born, u == life.uses.end() ? n_ : *u, static_cast<double>(ten.bytes)});
    }
    return items;
  }

  // The halves of one kind at p, from the items sorted by their far op.
  [[nodiscard]] BestSoFar sweep(const std::vector<Item>& sorted, bool write, OpIndex p,
                                double base) const {
    const OpIndex n = n_;
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
      const double stall = write ? seconds(bytes, rates_.write, rates_.ssd_write) - c
                                 : seconds(bytes, rates_.read, rates_.ssd_read) - c;
      if (stall > best.stall) {
        best = write ? Half{e, p, true, bytes, c, stall} : Half{p, e, false, bytes, c, stall};
      }
      s.far.push_back(e);
      s.best.push_back(best);
    }
    return s;
  }

  const trace::Trace& trace_;
  const trace::LifetimeAnalysis& la_;
  OpIndex n_;
  Rates rates_;
  double cap_;
  std::vector<double> pre_;                   // compute before op k
  std::vector<std::vector<OpIndex>> writes_;  // per tensor, the ops that write it, in order
};

std::vector<Half> halves(const trace::Trace& trace, const trace::LifetimeAnalysis& la,
                         const Hardware& hw, const std::vector<OpIndex>& stops) {
  std::vector<Half> out;
  const auto n = static_cast<OpIndex>(trace.ops.size());
  if (n < 3) return out;
  const Rates rates = rates_of(hw);
  if (rates.read <= 0 || rates.write <= 0) return out;
  const HalfSearch search(trace, la, hw);
  const std::vector<OpIndex> pivots = search.pivots();
  // Where a half may be made to end so that it fits beside the other spans: the given stops
  // and the pivots.
  std::vector<OpIndex> ends = stops;
  ends.insert(ends.end(), pivots.begin(), pivots.end());
  std::sort(ends.begin(), ends.end());
  ends.erase(std::unique(ends.begin(), ends.end()), ends.end());
  for (const OpIndex p : pivots) search.halves_at(p, ends, out);
  return out;
}

// A stall span (l, r] on the cycle of one iteration's ops, and what it comes from: a window of
// the bound or a half.
struct Span {
  OpIndex l;
  OpIndex r;
  double stall;
  int item;  // index in b.windows, or -1 - index in the halves
};

// Weighted interval scheduling of the linear spans `lin` (sorted by end) within (lo, hi]: the
// largest total stall, and in *chosen the items of the spans that make it.
double best_disjoint(const std::vector<Span>& lin, OpIndex lo, OpIndex hi,
                     std::vector<int>* chosen) {
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
}

// The bound of the chosen windows of `b` and halves `hs`, whose stalls add up to `total`.
StallBound chosen_bound(const trace::Trace& trace, const StallBound& b, const std::vector<Half>& hs,
                        const std::vector<int>& chosen, double total) {
  const auto n = static_cast<OpIndex>(trace.ops.size());
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

// The windows of `b` and the halves: the set with the largest stall whose stall spans are
// disjoint. Spans are of stall positions (l, r] on the cycle of one iteration's ops; one that
// runs over the iteration's end has r <= l.
StallBound with_halves(const trace::Trace& trace, const trace::LifetimeAnalysis& la,
                       const Hardware& hw, const StallBound& b) {
  const auto n = static_cast<OpIndex>(trace.ops.size());
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
  std::vector<int> chosen;
  double total = best_disjoint(lin, 0, n, &chosen);
  for (const Span& w : wraps) {
    std::vector<int> with;
    const double t = w.stall + best_disjoint(lin, w.r, w.l, &with);
    if (t > total) {
      total = t;
      chosen = std::move(with);
      chosen.push_back(w.item);
    }
  }
  if (total <= b.stall_seconds * (1 + 1e-12)) return b;
  return chosen_bound(trace, b, hs, chosen, total);
}

}  // namespace tidal::plan::detail::bounding
