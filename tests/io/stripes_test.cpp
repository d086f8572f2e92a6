// The store's striping (io/store/stripes.hpp) on awkward and random tensor sizes, stripe units and
// directory counts, checked against a reference computed here from the definition of round-robin
// striping: tensor byte b is in stripe b / unit, on file (first + stripe) % files, and the
// stripes before it on that file are whole ones.
#include "io/store/stripes.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

namespace tidal::io::detail {
namespace {

constexpr std::uint64_t kBlock = 4096;

std::uint64_t round_up_to_block(std::uint64_t n) { return (n + kBlock - 1) / kBlock * kBlock; }

// Where tensor byte b lies: its file, and its offset from the start of that file's run.
struct Place {
  std::size_t file;
  std::uint64_t run_offset;
};

Place reference_place(std::uint64_t b, std::uint64_t unit, std::size_t files, std::size_t first) {
  const std::uint64_t stripe = b / unit;
  return {(first + stripe) % files, stripe / files * unit + b % unit};
}

// The bytes of each file's run: its whole stripes, and the short last stripe padded to a block.
std::vector<std::uint64_t> reference_runs(std::uint64_t bytes, std::uint64_t unit,
                                          std::size_t files, std::size_t first) {
  const std::uint64_t whole = bytes / unit;
  std::vector<std::uint64_t> runs(files, 0);
  for (std::size_t f = 0; f < files; ++f) {
    const std::uint64_t from_first = (f + files - first) % files;  // f's turn after first
    const std::uint64_t count = whole / files + (from_first < whole % files ? 1 : 0);
    runs[f] = count * unit;
  }
  if (bytes % unit != 0) runs[(first + whole) % files] += round_up_to_block(bytes % unit);
  return runs;
}

// The stripe that holds tensor byte b (the stripes tile the tensor, in order).
const Stripe& stripe_of(const std::vector<Stripe>& stripes, std::uint64_t b) {
  auto it = std::upper_bound(stripes.begin(), stripes.end(), b,
                             [](std::uint64_t x, const Stripe& s) { return x < s.tensor_offset; });
  return *std::prev(it);
}

// Checks stripe_layout and run_bytes for one tensor; returns the bytes it checked the place of.
int check(std::uint64_t bytes, std::uint64_t unit, std::size_t files, std::size_t first,
          std::mt19937_64& rng) {
  SCOPED_TRACE(::testing::Message() << bytes << " bytes, stripe unit " << unit << ", " << files
                                    << " files from file " << first);
  const std::vector<Stripe> stripes = stripe_layout(bytes, unit, files, first);
  const std::uint64_t count = bytes == 0 ? 0 : (bytes - 1) / unit + 1;
  EXPECT_EQ(stripes.size(), count);
  // The stripes tile [0, bytes) in order, each a whole unit but the last.
  std::uint64_t next = 0;
  for (std::size_t k = 0; k < stripes.size(); ++k) {
    EXPECT_EQ(stripes[k].tensor_offset, next);
    EXPECT_EQ(stripes[k].length, k + 1 < stripes.size() ? unit : bytes - k * unit);
    EXPECT_EQ(stripes[k].run_offset % kBlock, 0U);
    next += stripes[k].length;
  }
  EXPECT_EQ(next, bytes);
  // Each file's run holds its stripes, padded, without overlap.
  const std::vector<std::uint64_t> runs = run_bytes(stripes, files);
  EXPECT_EQ(runs, reference_runs(bytes, unit, files, first));
  for (std::size_t f = 0; f < files; ++f) {
    std::uint64_t end = 0;
    for (const Stripe& s : stripes) {
      if (s.file != f) continue;
      EXPECT_GE(s.run_offset, end);
      end = s.run_offset + round_up_to_block(s.length);
    }
    EXPECT_LE(end, runs[f]);
  }
  if (bytes == 0) return 0;
  // Bytes at the ends, around every stripe boundary (at most 64 of them), and at random.
  std::vector<std::uint64_t> probes = {0, bytes - 1};
  for (std::uint64_t k = 1; k < count && k <= 64; ++k) {
    probes.push_back(k * unit - 1);
    probes.push_back(k * unit);
  }
  std::uniform_int_distribution<std::uint64_t> any(0, bytes - 1);
  for (int i = 0; i < 32; ++i) probes.push_back(any(rng));
  for (std::uint64_t b : probes) {
    const Stripe& s = stripe_of(stripes, b);
    const Place want = reference_place(b, unit, files, first);
    EXPECT_EQ(s.file, want.file) << "byte " << b;
    EXPECT_EQ(s.run_offset + (b - s.tensor_offset), want.run_offset) << "byte " << b;
  }
  // A random byte range [lo, hi) is exactly the stripes lo / unit to (hi - 1) / unit.
  const std::uint64_t lo = any(rng);
  const std::uint64_t hi = std::uniform_int_distribution<std::uint64_t>(lo + 1, bytes)(rng);
  std::vector<std::uint64_t> touched;
  for (std::size_t k = 0; k < stripes.size(); ++k) {
    const Stripe& s = stripes[k];
    if (s.tensor_offset < hi && lo < s.tensor_offset + s.length) touched.push_back(k);
  }
  if (touched.empty()) {
    ADD_FAILURE() << "no stripe holds bytes " << lo << " to " << hi;
    return 0;
  }
  EXPECT_EQ(touched.front(), lo / unit);
  EXPECT_EQ(touched.back(), (hi - 1) / unit);
  EXPECT_EQ(touched.size(), (hi - 1) / unit - lo / unit + 1);
  return static_cast<int>(probes.size());
}

TEST(Stripes, AwkwardSizes) {
  std::mt19937_64 rng(1025);
  int probed = 0;
  for (std::uint64_t unit : {kBlock, 2 * kBlock, 64 * kBlock, 256 * kBlock}) {
    for (std::size_t files = 1; files <= 5; ++files) {
      for (std::uint64_t bytes :
           {std::uint64_t{0}, std::uint64_t{1}, std::uint64_t{513}, std::uint64_t{1024},
            std::uint64_t{1025}, kBlock - 1, kBlock, kBlock + 1, unit - 1, unit, unit + 1,
            2 * unit - 1, 2 * unit + 1, files * unit - 1, files * unit, files * unit + 1,
            7 * unit + 513, (files + 1) * unit + kBlock - 1}) {
        for (std::size_t first = 0; first < files; ++first) {
          probed += check(bytes, unit, files, first, rng);
        }
      }
    }
  }
  EXPECT_GT(probed, 10000);  // not vacuous: bytes were placed and checked
}

TEST(Stripes, RandomSizes) {
  std::mt19937_64 rng(513);
  int probed = 0;
  for (int i = 0; i < 2000; ++i) {
    const std::uint64_t unit = kBlock << (rng() % 9);  // 4 KiB to 1 MiB
    const std::size_t files = 1 + rng() % 8;
    const std::size_t first = rng() % files;
    // Sizes from a byte to 40 stripes, often a block off a stripe boundary.
    std::uint64_t bytes = 1 + rng() % (40 * unit);
    if (rng() % 4 == 0) bytes = (bytes / unit + 1) * unit + (rng() % 2 ? kBlock : 0) - 1;
    probed += check(bytes, unit, files, first, rng);
  }
  EXPECT_GT(probed, 50000);
}

}  // namespace
}  // namespace tidal::io::detail
