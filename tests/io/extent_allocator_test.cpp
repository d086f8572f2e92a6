#include "tidal/io/extent_allocator.hpp"

#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"

namespace tidal::io {
namespace {

TEST(ExtentAllocator, AlignsAndRoundsUp) {
  ExtentAllocator a(10 * kBlockSize + 100);
  EXPECT_EQ(a.capacity(), 10 * kBlockSize);
  auto x = a.allocate(1);
  ASSERT_TRUE(x);
  EXPECT_EQ(x->offset % kBlockSize, 0u);
  EXPECT_EQ(x->length, kBlockSize);
  auto y = a.allocate(kBlockSize + 1);
  ASSERT_TRUE(y);
  EXPECT_EQ(y->length, 2 * kBlockSize);
  EXPECT_EQ(a.used_bytes(), 3 * kBlockSize);
  EXPECT_THROW(a.allocate(0), Error);
}

TEST(ExtentAllocator, BestFitPicksTheSmallestHole) {
  ExtentAllocator a(100 * kBlockSize);
  std::vector<Extent> x;
  for (std::uint64_t n : {5, 1, 3, 1, 8, 1}) x.push_back(*a.allocate(n * kBlockSize));
  a.free(x[0]);  // hole of 5 at 0
  a.free(x[2]);  // hole of 3 at 6
  a.free(x[4]);  // hole of 8 at 11
  auto y = a.allocate(3 * kBlockSize);
  ASSERT_TRUE(y);
  EXPECT_EQ(y->offset, x[2].offset) << "best fit takes the exact-size hole";
  auto z = a.allocate(4 * kBlockSize);
  ASSERT_TRUE(z);
  EXPECT_EQ(z->offset, x[0].offset) << "then the 5-block hole, not the 8-block one";
}

TEST(ExtentAllocator, CoalescesNeighboursOnFree) {
  ExtentAllocator a(64 * kBlockSize);
  std::vector<Extent> x;
  for (int i = 0; i < 16; ++i) x.push_back(*a.allocate(4 * kBlockSize));
  EXPECT_FALSE(a.allocate(kBlockSize)) << "full";
  // Free every other extent: 8 holes of 4 blocks, no 8-block extent available.
  for (int i = 0; i < 16; i += 2) a.free(x[i]);
  EXPECT_EQ(a.free_extent_count(), 8u);
  EXPECT_EQ(a.largest_free(), 4 * kBlockSize);
  EXPECT_FALSE(a.allocate(8 * kBlockSize)) << "fragmented: no room for 8 contiguous blocks";
  // Free the rest: everything merges back into one extent.
  for (int i = 1; i < 16; i += 2) a.free(x[i]);
  EXPECT_EQ(a.free_extent_count(), 1u);
  EXPECT_EQ(a.largest_free(), 64 * kBlockSize);
  EXPECT_TRUE(a.allocate(64 * kBlockSize));
}

TEST(ExtentAllocator, DoubleFreeIsCaught) {
  ExtentAllocator a(8 * kBlockSize);
  auto x = *a.allocate(2 * kBlockSize);
  a.free(x);
  EXPECT_THROW(a.free(x), Error);
  EXPECT_THROW(a.free(Extent{64 * kBlockSize, kBlockSize}), Error);
}

// Random allocate/free against a block bitmap: no overlap, accounting exact, and after freeing
// everything the file is one extent again.
TEST(ExtentAllocator, RandomAgainstBitmapModel) {
  constexpr std::uint64_t kBlocks = 512;
  ExtentAllocator a(kBlocks * kBlockSize);
  std::vector<bool> used(kBlocks, false);
  std::vector<Extent> live;
  std::mt19937_64 rng(42);
  for (int step = 0; step < 20000; ++step) {
    if (live.empty() || rng() % 3 != 0) {
      const std::uint64_t n = 1 + rng() % (3 * kBlockSize);
      auto x = a.allocate(n);
      if (!x) {
        EXPECT_LT(a.largest_free(), align_up(n, kBlockSize));
        continue;
      }
      ASSERT_GE(x->length, n);
      for (std::uint64_t b = x->offset / kBlockSize; b < (x->offset + x->length) / kBlockSize;
           ++b) {
        ASSERT_FALSE(used[b]) << "overlap at block " << b;
        used[b] = true;
      }
      live.push_back(*x);
    } else {
      const std::size_t i = rng() % live.size();
      for (std::uint64_t b = live[i].offset / kBlockSize;
           b < (live[i].offset + live[i].length) / kBlockSize; ++b) {
        used[b] = false;
      }
      a.free(live[i]);
      live[i] = live.back();
      live.pop_back();
    }
    std::uint64_t used_blocks = 0;
    for (bool u : used) used_blocks += u ? 1 : 0;
    ASSERT_EQ(a.used_bytes(), used_blocks * kBlockSize);
  }
  for (const auto& x : live) a.free(x);
  EXPECT_EQ(a.free_extent_count(), 1u);
  EXPECT_EQ(a.free_bytes(), kBlocks * kBlockSize);
}

}  // namespace
}  // namespace tidal::io
