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

/// A node x of a segment tree stored as an implicit binary heap (root 1, children 2x and
/// 2x + 1) and the leaves [lo, hi] under it.
struct TreeNode {
  int x;
  int lo;
  int hi;
  [[nodiscard]] TreeNode left() const { return {2 * x, lo, (lo + hi) / 2}; }
  [[nodiscard]] TreeNode right() const { return {2 * x + 1, (lo + hi) / 2 + 1, hi}; }
  [[nodiscard]] bool outside(int l, int r) const { return hi < l || lo > r; }
  [[nodiscard]] bool inside(int l, int r) const { return l <= lo && hi <= r; }
};

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
    const TreeNode root{1, 0, leaves_ - 1};
    return scan == Scan::kForward ? descend<Scan::kForward>(root, l, r, need)
                                  : descend<Scan::kBackward>(root, l, r, need);
  }

  /// Sets [l, r] to zero and appends the (index, value) of every nonzero leaf it cleared, in
  /// index order.
  void zero(int l, int r, std::vector<Leaf>& cleared) {
    if (l <= r) zero({1, 0, leaves_ - 1}, l, r, cleared);
  }

 private:
  double& node(int x) { return at(node_, x); }
  [[nodiscard]] double node(int x) const { return at(node_, x); }
  void pull(int x) { node(x) = node(2 * x) + node(2 * x + 1); }

  // The search of find(): takes whole nodes in the scan's order until one holds what is still
  // needed, then goes down into it.
  template <Scan kScan>
  int descend(TreeNode nd, int l, int r, double& need) const {
    const double v = node(nd.x);
    if (nd.outside(l, r) || v <= 0) return -1;
    if (nd.inside(l, r) && v < need) {
      need -= v;
      return -1;
    }
    if (nd.lo == nd.hi) return nd.lo;
    const TreeNode first = kScan == Scan::kForward ? nd.left() : nd.right();
    const TreeNode second = kScan == Scan::kForward ? nd.right() : nd.left();
    const int j = descend<kScan>(first, l, r, need);
    return j >= 0 ? j : descend<kScan>(second, l, r, need);
  }

  void zero(TreeNode nd, int l, int r, std::vector<Leaf>& cleared) {
    if (nd.outside(l, r) || node(nd.x) <= 0) return;
    if (nd.lo == nd.hi) {
      cleared.emplace_back(nd.lo, node(nd.x));
      node(nd.x) = 0;
      return;
    }
    zero(nd.left(), l, r, cleared);
    zero(nd.right(), l, r, cleared);
    pull(nd.x);
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
    if (l <= r) add(root(), l, r, v);
  }
  /// Max of [l, r]; -kInf when l > r.
  std::int64_t max(int l, int r) { return l <= r ? max_in(root(), l, r) : -kInf; }
  std::int64_t get(int i) { return max_in(root(), i, i); }
  void set(int i, std::int64_t v) { set(root(), i, v); }
  /// Leftmost index in [l, r] whose value is <= threshold, or -1.
  int first_at_most(int l, int r, std::int64_t threshold) {
    return l <= r ? first_at_most(root(), l, r, threshold) : -1;
  }

 private:
  [[nodiscard]] TreeNode root() const { return {1, 0, leaves_ - 1}; }

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
  void add(TreeNode nd, int l, int r, std::int64_t v) {
    if (nd.outside(l, r)) return;
    if (nd.inside(l, r)) {
      apply(nd.x, v);
      return;
    }
    push(nd.x);
    add(nd.left(), l, r, v);
    add(nd.right(), l, r, v);
    pull(nd.x);
  }
  std::int64_t max_in(TreeNode nd, int l, int r) {
    if (nd.outside(l, r)) return -kInf;
    if (nd.inside(l, r)) return at(max_, nd.x);
    push(nd.x);
    return std::max(max_in(nd.left(), l, r), max_in(nd.right(), l, r));
  }
  void set(TreeNode nd, int i, std::int64_t v) {
    if (nd.lo == nd.hi) {
      at(min_, nd.x) = at(max_, nd.x) = v;
      return;
    }
    push(nd.x);
    const TreeNode left = nd.left();
    if (i <= left.hi) {
      set(left, i, v);
    } else {
      set(nd.right(), i, v);
    }
    pull(nd.x);
  }
  int first_at_most(TreeNode nd, int l, int r, std::int64_t threshold) {
    if (nd.outside(l, r) || at(min_, nd.x) > threshold) return -1;
    if (nd.lo == nd.hi) return nd.lo;
    push(nd.x);
    const int j = first_at_most(nd.left(), l, r, threshold);
    return j >= 0 ? j : first_at_most(nd.right(), l, r, threshold);
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

}  // namespace tidal::plan::detail
