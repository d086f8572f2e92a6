// The planner's index structures (src/plan/segment_trees.hpp) against brute force on random
// data and odd sizes. Values are whole numbers, so that sums in any order are exact and the
// searches must agree with the reference to the index.
#include "plan/segment_trees.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

namespace tidal::plan::detail {
namespace {

constexpr int kSizes[] = {1, 2, 3, 7, 8, 9, 64, 100, 513, 1025};

// A random whole number in [0, hi], zero one time in four (empty buckets are common).
double whole(std::mt19937_64& rng, int hi) {
  if (rng() % 4 == 0) return 0;
  return static_cast<double>(std::uniform_int_distribution<int>(0, hi)(rng));
}

double ref_sum(const std::vector<double>& v, int l, int r) {
  double s = 0;
  for (int i = l; i <= r; ++i) s += at(v, i);
  return s;
}

int ref_find(const std::vector<double>& v, int l, int r, double need, Scan scan) {
  double s = 0;
  if (scan == Scan::kForward) {
    for (int j = l; j <= r; ++j) {
      s += at(v, j);
      if (s >= need) return j;
    }
  } else {
    for (int j = r; j >= l; --j) {
      s += at(v, j);
      if (s >= need) return j;
    }
  }
  return -1;
}

// A random range [l, r] of n indices, sometimes empty (l = r + 1).
std::pair<int, int> range(std::mt19937_64& rng, int n) {
  std::uniform_int_distribution<int> pick(0, n - 1);
  int l = pick(rng);
  int r = pick(rng);
  if (l > r) std::swap(l, r);
  if (rng() % 16 == 0) return {r + 1, r};
  return {l, r};
}

TEST(BucketTree, SumsAndSearchesMatchBruteForce) {
  std::mt19937_64 rng(7);
  int found = 0;
  int missed = 0;
  for (const int n : kSizes) {
    std::vector<double> ref(static_cast<std::size_t>(n));
    for (auto& x : ref) x = whole(rng, 1000);
    BucketTree tree(ref);
    ASSERT_EQ(tree.size(), n);
    for (int step = 0; step < 400; ++step) {
      const auto [l, r] = range(rng, n);
      switch (rng() % 5) {
        case 0: {  // set one leaf (negative values clamp at 0)
          const int i = static_cast<int>(rng() % static_cast<unsigned>(n));
          const double v = whole(rng, 1000) - 100;
          tree.set(i, v);
          at(ref, i) = std::max(0.0, v);
          break;
        }
        case 1: {  // zero a range, then give part of it back with add()
          std::vector<Leaf> cleared;
          tree.zero(l, r, cleared);
          std::vector<Leaf> expect;
          for (int i = l; i <= r; ++i) {
            if (at(ref, i) > 0) expect.emplace_back(i, at(ref, i));
            at(ref, i) = 0;
          }
          ASSERT_EQ(cleared, expect);
          std::vector<Leaf> back;
          for (const Leaf& leaf : cleared) {
            if (rng() % 2 == 0) back.emplace_back(leaf.first, leaf.second - 1);
          }
          tree.add(back.data(), back.data() + back.size());
          for (const Leaf& leaf : back) at(ref, leaf.first) = std::max(0.0, leaf.second);
          break;
        }
        default: {  // searches
          const double total = ref_sum(ref, l, r);
          ASSERT_EQ(tree.sum(l, r), total);
          const double need = 1 + std::floor(std::uniform_real_distribution<double>(0, 1.2)(rng) *
                                             std::max(total, 1.0));
          for (const Scan scan : {Scan::kForward, Scan::kBackward}) {
            const int want = ref_find(ref, l, r, need, scan);
            ASSERT_EQ(tree.find(l, r, need, scan), want)
                << "n " << n << " [" << l << ", " << r << "] need " << need;
            ++(want >= 0 ? found : missed);
          }
        }
      }
      if (l <= r) ASSERT_EQ(tree.get(l), at(ref, l));
    }
  }
  // Both outcomes of the search were exercised many times.
  EXPECT_GT(found, 1000);
  EXPECT_GT(missed, 200);
}

// kInf marks an op out of the search: it is never found, and it reads as at least kInf / 2
// whatever is added over it (how the planner retires the ops that fit).
TEST(RangeTree, RangeAddMaxAndSearchMatchBruteForce) {
  std::mt19937_64 rng(11);
  int hits = 0;
  for (const int n : kSizes) {
    std::vector<std::int64_t> ref(static_cast<std::size_t>(n));
    std::vector<bool> retired(static_cast<std::size_t>(n), false);
    std::uniform_int_distribution<std::int64_t> value(-1000, 1000);
    for (auto& x : ref) x = value(rng);
    RangeTree tree(ref);
    ASSERT_EQ(tree.size(), n);
    const auto expect_value = [&](int i) {
      if (at(retired, i)) {
        ASSERT_GE(tree.get(i), RangeTree::kInf / 2);
      } else {
        ASSERT_EQ(tree.get(i), at(ref, i));
      }
    };
    for (int step = 0; step < 400; ++step) {
      const auto [l, r] = range(rng, n);
      switch (rng() % 4) {
        case 0: {
          const std::int64_t v = value(rng);
          tree.add(l, r, v);
          for (int i = l; i <= r; ++i) at(ref, i) += v;
          break;
        }
        case 1: {  // set, sometimes to the "out of the search" sentinel
          const int i = static_cast<int>(rng() % static_cast<unsigned>(n));
          const bool retire = rng() % 5 == 0;
          const std::int64_t v = value(rng);
          tree.set(i, retire ? RangeTree::kInf : v);
          at(ref, i) = v;
          at(retired, i) = retire;
          break;
        }
        default: {
          std::int64_t mx = -RangeTree::kInf;
          bool any_retired = false;
          for (int i = l; i <= r; ++i) {
            if (at(retired, i)) any_retired = true;
            mx = std::max(mx, at(ref, i));
          }
          if (any_retired) {
            ASSERT_GE(tree.max(l, r), RangeTree::kInf / 2);
          } else {
            ASSERT_EQ(tree.max(l, r), mx);
          }
          const std::int64_t threshold = value(rng);
          int want = -1;
          for (int i = l; i <= r && want < 0; ++i) {
            if (!at(retired, i) && at(ref, i) <= threshold) want = i;
          }
          ASSERT_EQ(tree.first_at_most(l, r, threshold), want);
          if (want >= 0) ++hits;
        }
      }
      expect_value(static_cast<int>(rng() % static_cast<unsigned>(n)));
    }
  }
  EXPECT_GT(hits, 500);
}

TEST(Fenwick, RangeSumsMatchBruteForce) {
  std::mt19937_64 rng(13);
  for (const int n : kSizes) {
    std::vector<double> ref(static_cast<std::size_t>(n), 0.0);
    Fenwick tree(n);
    for (int step = 0; step < 300; ++step) {
      const int i = static_cast<int>(rng() % static_cast<unsigned>(n));
      const double v = whole(rng, 100) - 50;
      tree.add(i, v);
      at(ref, i) += v;
      const auto [l, r] = range(rng, n);
      ASSERT_EQ(tree.sum(l, r), l > r ? 0.0 : ref_sum(ref, l, r));
    }
  }
}

// Ids with one or two intervals each, replaced at random under new versions, against the brute
// force list of each id's current intervals: a stab reports exactly the ids (once each) whose
// current intervals contain the op.
TEST(IntervalStab, StabsMatchBruteForce) {
  std::mt19937_64 rng(29);
  for (const int n : kSizes) {
    constexpr int kIds = 40;
    IntervalStab index(n);
    std::vector<std::uint32_t> version(kIds, 0);
    std::vector<std::vector<std::pair<int, int>>> ref(kIds);
    const auto replace = [&](int id) {
      ++at(version, id);
      auto& mine = at(ref, id);
      mine.clear();
      // Two disjoint intervals, either possibly empty, as a migration's prefix and suffix.
      auto [l, r] = range(rng, n);
      if (l > r) return;  // no interval at all
      const int mid = l + (r - l) / 2;
      const std::pair<int, int> parts[2] = {{l, mid - static_cast<int>(rng() % 2)}, {mid + 1, r}};
      for (const auto& [a, b] : parts) {
        if (rng() % 5 == 0 || a > b) continue;
        mine.emplace_back(a, b);
        index.insert(a, b, id, at(version, id));
      }
    };
    for (int id = 0; id < kIds; ++id) replace(id);
    int reported = 0;
    for (int step = 0; step < 400; ++step) {
      if (rng() % 2 == 0) replace(static_cast<int>(rng() % kIds));
      const int k = static_cast<int>(rng() % static_cast<unsigned>(n));
      std::vector<int> got;
      index.stab(
          k, [&](int id) { return at(version, id); }, [&](int id) { got.push_back(id); });
      std::sort(got.begin(), got.end());
      std::vector<int> want;
      for (int id = 0; id < kIds; ++id) {
        for (const auto& [a, b] : at(ref, id)) {
          if (a <= k && k <= b) want.push_back(id);
        }
      }
      ASSERT_EQ(got, want) << "n " << n << " step " << step;
      reported += static_cast<int>(got.size());
    }
    EXPECT_GT(reported, 0) << "n " << n;
  }
}

}  // namespace
}  // namespace tidal::plan::detail
