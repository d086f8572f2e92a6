// The planner's index structures over the ops of one iteration (private to plan/): the remaining
// bandwidth of a channel per op (BucketTree), memory per op with range updates (RangeTree), and
// prefix sums of the compute time of the ops still over the target (Fenwick). Torch-free.
//
// Indices are ops (int, as trace::OpIndex); none of these is thread-safe, each is owned by one
// planner.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "plan/int_index.hpp"

namespace tidal::plan::detail {

/// Which way a search walks along the ops: towards higher indices or lower ones.
enum class Scan : std::uint8_t { kForward, kBackward };

/// One leaf's index and value (a bucket and the bytes taken from or given back to it).
using Leaf = std::pair<int, double>;

/// The leaves [lo, hi] under a node of a segment tree stored as an implicit binary heap (root 1
/// over [0, leaves - 1], children 2x over [lo, mid] and 2x + 1 over [mid + 1, hi]) against a
/// query range [l, r]. The nodes travel as three ints: a struct made the searches 50% slower.
inline bool outside(int lo, int hi, int l, int r) { return hi < l || lo > r; }
inline bool inside(int lo, int hi, int l, int r) { return l <= lo && hi <= r; }

/// Non-negative values per op (a channel's remaining capacity in bytes) with range sums and
/// prefix searches. Values only shrink except where a planned stall adds capacity.
class BucketTree {
 public:
  explicit BucketTree(const std::vector<double>& values) : n_(static_cast<int>(values.size())) {
    while (leaves_ < n_) leaves_ <<= 1;
    node_.assign(2 * static_cast<std::size_t>(leaves_), 0.0);
    for (int i = 0; i < n_; ++i) node(leaves_ + i) = at(values, i);
    for (int x = leaves_ - 1; x >= 1; --x) pull(x);
  }

  [[nodiscard]] int size() const { return n_; }
  [[nodiscard]] double get(int i) const { return node(leaves_ + i); }

  /// Sets leaf i to max(0, v).
  void set(int i, double v) {
    int x = leaves_ + i;
    node(x) = std::max(0.0, v);
    for (x >>= 1; x >= 1; x >>= 1) pull(x);
  }

  /// Adds the (index, value) items, sorted by index, to their leaves (each clamped at 0), then
  /// updates each ancestor once per run of neighbouring items (giving back a reservation of m
  /// items costs O(m + log n), not m log n).
  void add(const Leaf* first, const Leaf* last) {
    auto& xs = scratch_;
    xs.clear();
    for (const Leaf* p = first; p != last; ++p) {
      const int x = leaves_ + p->first;
      node(x) = std::max(0.0, node(x) + p->second);
      if (xs.empty() || xs.back() != x) xs.push_back(x);
    }
    while (!xs.empty() && xs.front() > 1) {
      std::size_t out = 0;
      for (const int x : xs) {
        if (out == 0 || xs[out - 1] != x >> 1) xs[out++] = x >> 1;
      }
      xs.resize(out);
      for (const int x : xs) pull(x);
    }
  }

  /// Sum of [l, r] (0 when l > r).
  [[nodiscard]] double sum(int l, int r) const {
    double s = 0;
    if (l > r) return 0;
    for (int a = l + leaves_, b = r + leaves_ + 1; a < b; a >>= 1, b >>= 1) {
      if ((a & 1) != 0) s += node(a++);
      if ((b & 1) != 0) s += node(--b);
    }
    return s;
  }

  /// Forward: the smallest j in [l, r] with sum(l..j) >= need; backward: the largest j with
  /// sum(j..r) >= need. -1 when there is none (need > 0).
  [[nodiscard]] int find(int l, int r, double need, Scan scan) const {
    if (l > r) return -1;
    return scan == Scan::kForward ? descend<Scan::kForward>(1, 0, leaves_ - 1, l, r, need)
                                  : descend<Scan::kBackward>(1, 0, leaves_ - 1, l, r, need);
  }

  /// Sets [l, r] to zero and appends the (index, value) of every nonzero leaf it cleared, in
  /// index order.
  void zero(int l, int r, std::vector<Leaf>& cleared) {
    if (l <= r) zero(1, 0, leaves_ - 1, l, r, cleared);
  }

 private:
  double& node(int x) { return at(node_, x); }
  [[nodiscard]] double node(int x) const { return at(node_, x); }
  void pull(int x) { node(x) = node(2 * x) + node(2 * x + 1); }

  // The search of find(): takes whole nodes in the scan's order until one holds what is still
  // needed, then goes down into it.
  template <Scan kScan>
  int descend(int x, int lo, int hi, int l, int r, double& need) const {
    const double v = node(x);
    if (outside(lo, hi, l, r) || v <= 0) return -1;
    if (inside(lo, hi, l, r) && v < need) {
      need -= v;
      return -1;
    }
    if (lo == hi) return lo;
    const int mid = (lo + hi) / 2;
    if constexpr (kScan == Scan::kForward) {
      const int j = descend<kScan>(2 * x, lo, mid, l, r, need);
      return j >= 0 ? j : descend<kScan>(2 * x + 1, mid + 1, hi, l, r, need);
    } else {
      const int j = descend<kScan>(2 * x + 1, mid + 1, hi, l, r, need);
      return j >= 0 ? j : descend<kScan>(2 * x, lo, mid, l, r, need);
    }
  }

  void zero(int x, int lo, int hi, int l, int r, std::vector<Leaf>& cleared) {
    if (outside(lo, hi, l, r) || node(x) <= 0) return;
    if (lo == hi) {
      cleared.emplace_back(lo, node(x));
      node(x) = 0;
      return;
    }
    const int mid = (lo + hi) / 2;
    zero(2 * x, lo, mid, l, r, cleared);
    zero(2 * x + 1, mid + 1, hi, l, r, cleared);
    pull(x);
  }

  int n_ = 0;
  int leaves_ = 1;
  std::vector<double> node_;
  std::vector<int> scratch_;
};

/// int64 values per op with range add, range max, point set, and a search for the leftmost
/// value at or under a threshold (lazy propagation). A value of kInf marks an op that is out of
/// the search (the planner's ops that fit).
class RangeTree {
 public:
  static constexpr std::int64_t kInf = std::numeric_limits<std::int64_t>::max() / 4;

  explicit RangeTree(const std::vector<std::int64_t>& values)
      : n_(static_cast<int>(values.size())) {
    while (leaves_ < n_) leaves_ <<= 1;
    const auto nodes = 2 * static_cast<std::size_t>(leaves_);
    min_.assign(nodes, kInf);
    max_.assign(nodes, -kInf);
    pending_.assign(nodes, 0);
    for (int i = 0; i < n_; ++i) at(min_, leaves_ + i) = at(max_, leaves_ + i) = at(values, i);
    for (int x = leaves_ - 1; x >= 1; --x) pull(x);
  }

  [[nodiscard]] int size() const { return n_; }

  /// Adds v to [l, r] (nothing when l > r).
  void add(int l, int r, std::int64_t v) {
    if (l <= r) add(1, 0, leaves_ - 1, l, r, v);
  }
  /// Max of [l, r]; -kInf when l > r.
  std::int64_t max(int l, int r) { return l <= r ? max_in(1, 0, leaves_ - 1, l, r) : -kInf; }
  /// The largest value of all (the root: empty leaves hold -kInf).
  [[nodiscard]] std::int64_t max_all() const { return at(max_, 1); }
  std::int64_t get(int i) { return max_in(1, 0, leaves_ - 1, i, i); }
  void set(int i, std::int64_t v) { set(1, 0, leaves_ - 1, i, v); }
  /// Leftmost index in [l, r] whose value is <= threshold, or -1.
  int first_at_most(int l, int r, std::int64_t threshold) {
    return l <= r ? first_at_most(1, 0, leaves_ - 1, l, r, threshold) : -1;
  }

 private:
  void pull(int x) {
    at(min_, x) = std::min(at(min_, 2 * x), at(min_, 2 * x + 1));
    at(max_, x) = std::max(at(max_, 2 * x), at(max_, 2 * x + 1));
  }
  // Adds v to everything under x (empty leaves stay at their sentinels).
  void apply(int x, std::int64_t v) {
    if (at(min_, x) < kInf) at(min_, x) += v;
    if (at(max_, x) > -kInf) at(max_, x) += v;
    at(pending_, x) += v;
  }
  // Hands x's pending add down to its children.
  void push(int x) {
    const std::int64_t v = at(pending_, x);
    if (v != 0) {
      apply(2 * x, v);
      apply(2 * x + 1, v);
      at(pending_, x) = 0;
    }
  }
  void add(int x, int lo, int hi, int l, int r, std::int64_t v) {
    if (outside(lo, hi, l, r)) return;
    if (inside(lo, hi, l, r)) {
      apply(x, v);
      return;
    }
    push(x);
    const int mid = (lo + hi) / 2;
    add(2 * x, lo, mid, l, r, v);
    add(2 * x + 1, mid + 1, hi, l, r, v);
    pull(x);
  }
  std::int64_t max_in(int x, int lo, int hi, int l, int r) {
    if (outside(lo, hi, l, r)) return -kInf;
    if (inside(lo, hi, l, r)) return at(max_, x);
    push(x);
    const int mid = (lo + hi) / 2;
    return std::max(max_in(2 * x, lo, mid, l, r), max_in(2 * x + 1, mid + 1, hi, l, r));
  }
  void set(int x, int lo, int hi, int i, std::int64_t v) {
    if (lo == hi) {
      at(min_, x) = at(max_, x) = v;
      return;
    }
    push(x);
    const int mid = (lo + hi) / 2;
    if (i <= mid) {
      set(2 * x, lo, mid, i, v);
    } else {
      set(2 * x + 1, mid + 1, hi, i, v);
    }
    pull(x);
  }
  int first_at_most(int x, int lo, int hi, int l, int r, std::int64_t threshold) {
    if (outside(lo, hi, l, r) || at(min_, x) > threshold) return -1;
    if (lo == hi) return lo;
    push(x);
    const int mid = (lo + hi) / 2;
    const int j = first_at_most(2 * x, lo, mid, l, r, threshold);
    return j >= 0 ? j : first_at_most(2 * x + 1, mid + 1, hi, l, r, threshold);
  }

  int n_ = 0;
  int leaves_ = 1;
  std::vector<std::int64_t> min_;
  std::vector<std::int64_t> max_;
  std::vector<std::int64_t> pending_;  // added to the whole subtree, not yet to the children
};

/// Point add and range sum over doubles (a Fenwick or binary indexed tree).
class Fenwick {
 public:
  explicit Fenwick(int n) : t_(static_cast<std::size_t>(n) + 1, 0.0) {}
  void add(int i, double v) {
    for (++i; i < static_cast<int>(t_.size()); i += i & -i) at(t_, i) += v;
  }
  /// Sum of [0, i].
  [[nodiscard]] double prefix(int i) const {
    double s = 0;
    for (++i; i > 0; i -= i & -i) s += at(t_, i);
    return s;
  }
  /// Sum of [l, r] (0 when l > r).
  [[nodiscard]] double sum(int l, int r) const {
    return l > r ? 0 : prefix(r) - (l > 0 ? prefix(l - 1) : 0);
  }

 private:
  std::vector<double> t_;
};

/// Intervals of ops, each under an id and a version, with stabbing queries: the ids of the
/// intervals that contain an op. An id's intervals are replaced by inserting new ones under a
/// newer version; the old ones are dropped lazily, when a query meets them. Each interval is
/// kept at the O(log n) nodes that cover it, so a query costs O(log n + the entries it meets),
/// and each stale entry is met at most once. The least-stall fallback asks, per op over the
/// target, for the migrations whose tensor is still in device memory there; a scan of every
/// candidate made it quadratic in the ops.
class IntervalStab {
 public:
  explicit IntervalStab(int n) : n_(n) {
    while (leaves_ < n_) leaves_ <<= 1;
    node_.resize(2 * static_cast<std::size_t>(leaves_));
  }

  /// Adds [l, r] (nothing when l > r) under id and version.
  void insert(int l, int r, int id, std::uint32_t version) {
    const Entry e{id, version};
    for (int a = l + leaves_, b = r + leaves_ + 1; a < b; a >>= 1, b >>= 1) {
      if ((a & 1) != 0) at(node_, a++).push_back(e);
      if ((b & 1) != 0) at(node_, --b).push_back(e);
    }
  }

  /// Calls fn(id) for each interval containing op k whose version is current(id); drops the
  /// others. The order is the nodes' (leaf up), each node's in insertion order but for drops.
  template <class Current, class Fn>
  void stab(int k, Current current, Fn fn) {
    for (int x = k + leaves_; x >= 1; x >>= 1) {
      auto& v = at(node_, x);
      for (std::size_t i = 0; i < v.size();) {
        if (v[i].version != current(v[i].id)) {
          v[i] = v.back();
          v.pop_back();
          continue;
        }
        fn(v[i].id);
        ++i;
      }
    }
  }

 private:
  struct Entry {
    int id;
    std::uint32_t version;
  };
  int n_;
  int leaves_ = 1;
  std::vector<std::vector<Entry>> node_;
};

}  // namespace tidal::plan::detail
