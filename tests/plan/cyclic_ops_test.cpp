// Positions in a period on the cyclic iteration (src/plan/cyclic_ops.hpp) against the modulo
// arithmetic they replace, on every small case and odd sizes.
#include "plan/cyclic_ops.hpp"

#include <gtest/gtest.h>

#include <vector>

namespace tidal::plan::detail {
namespace {

int mod(int a, int n) { return ((a % n) + n) % n; }

TEST(CyclicOps, PositionsAndOpsMatchModuloArithmetic) {
  int wrapped = 0;
  for (const int n : {1, 2, 3, 7, 8, 33}) {
    const CyclicOps cycle(n);
    ASSERT_EQ(cycle.size(), n);
    for (int last_use = 0; last_use < n; ++last_use) {
      for (int pos = -n - last_use - 1; last_use + 1 + pos < 2 * n; ++pos) {
        ASSERT_EQ(cycle.op_at(last_use, pos), mod(last_use + 1 + pos, n));
      }
      for (int k = 0; k < n; ++k) {
        const int pos = cycle.pos_of(last_use, k);
        ASSERT_EQ(pos, mod(k - last_use - 1, n));
        ASSERT_EQ(cycle.op_at(last_use, pos), k);
      }
      // Every range of up to n positions: its segments list its ops in position order.
      for (int p0 = 0; p0 < n; ++p0) {
        for (int p1 = p0 - 1; p1 < p0 + n; ++p1) {
          Segment s[2];
          const int ns = cycle.segments(last_use, p0, p1, s);
          std::vector<int> got;
          for (int i = 0; i < ns; ++i) {
            ASSERT_LE(s[i].l, s[i].r);
            for (int k = s[i].l; k <= s[i].r; ++k) got.push_back(k);
          }
          std::vector<int> want;
          for (int p = p0; p <= p1; ++p) want.push_back(mod(last_use + 1 + p, n));
          ASSERT_EQ(got, want) << "n " << n << " last use " << last_use << " [" << p0 << ", " << p1
                               << "]";
          if (ns == 2) ++wrapped;
        }
      }
    }
  }
  EXPECT_GT(wrapped, 1000);  // the wrapping case was exercised
}

}  // namespace
}  // namespace tidal::plan::detail
