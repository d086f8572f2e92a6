// Positions inside an inactive period on the cyclic iteration (private to plan/): the planner
// counts a period's ops by position and maps them to ops, and ranges of positions to at most
// two ranges of ops. Torch-free.
#pragma once

namespace tidal::plan::detail {

/// Ops l..r, inclusive.
struct Segment {
  int l, r;
};

/// The n ops of one iteration as a cycle, seen from a period that starts after op `last_use`:
/// position 0 is op last_use + 1, position 1 the op after, wrapping from op n - 1 to op 0.
class CyclicOps {
 public:
  explicit CyclicOps(int n) : n_(n) {}

  [[nodiscard]] int size() const { return n_; }

  /// The op at position pos, for last_use + 1 + pos in [-n, 2n). Positions and ops are within
  /// one iteration of each other, so a compare replaces the modulo (this runs tens of millions
  /// of times on a 70B trace).
  [[nodiscard]] int op_at(int last_use, int pos) const {
    const int k = last_use + 1 + pos;
    return k >= n_ ? k - n_ : (k < 0 ? k + n_ : k);
  }
  /// The position of op k (0 <= k < n), in [0, n).
  [[nodiscard]] int pos_of(int last_use, int k) const {
    return k > last_use ? k - last_use - 1 : k - last_use - 1 + n_;
  }

  /// The op ranges covering positions [p0, p1] (p1 - p0 < n), in position order; returns how
  /// many (0 when p0 > p1, 2 when the range wraps past op n - 1).
  int segments(int last_use, int p0, int p1, Segment out[2]) const {
    if (p0 > p1) return 0;
    const int l = op_at(last_use, p0);
    const int len = p1 - p0;
    if (l + len < n_) {
      out[0] = {l, l + len};
      return 1;
    }
    out[0] = {l, n_ - 1};
    out[1] = {0, l + len - n_};
    return 2;
  }

 private:
  int n_;
};

}  // namespace tidal::plan::detail
