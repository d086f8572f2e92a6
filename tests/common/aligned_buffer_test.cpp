#include "tidal/common/aligned_buffer.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "tidal/common/error.hpp"

namespace tidal {
namespace {

bool aligned_to(const void* p, std::size_t alignment) {
  return reinterpret_cast<std::uintptr_t>(p) % alignment == 0;
}

// Awkward sizes around a 4 KiB block, and every alignment from a byte to 64 KiB: the start is
// aligned and every byte asked for can be written and read back.
TEST(AlignedBuffer, AlignsEveryPowerOfTwoAtOddSizes) {
  for (std::size_t alignment = 1; alignment <= std::size_t{64} * 1024; alignment *= 2) {
    for (std::size_t bytes : {1, 7, 513, 1024, 1025, 4095, 4096, 4097, 12289}) {
      AlignedBuffer b(bytes, alignment);
      ASSERT_NE(b.data(), nullptr);
      EXPECT_TRUE(aligned_to(b.data(), alignment)) << bytes << " bytes at " << alignment;
      EXPECT_EQ(b.size(), bytes);
      EXPECT_EQ(b.alignment(), alignment);
      EXPECT_FALSE(b.empty());
      for (std::size_t i = 0; i < bytes; ++i) b.data()[i] = static_cast<unsigned char>(i * 31);
      std::size_t wrong = 0;
      for (std::size_t i = 0; i < bytes; ++i) {
        wrong += b.data()[i] != static_cast<unsigned char>(i * 31) ? 1 : 0;
      }
      EXPECT_EQ(wrong, 0u) << bytes << " bytes at " << alignment;
    }
  }
}

// The allocation is rounded up to whole alignments, so an O_DIRECT transfer of the rounded size
// stays inside it (the tools read whole blocks into buffers of odd sizes).
TEST(AlignedBuffer, ZeroFillCoversTheRoundedUpAllocation) {
  for (std::size_t bytes : {1, 513, 4096, 4097}) {
    AlignedBuffer b(bytes, 4096, AlignedBuffer::Fill::kZero);
    const std::size_t rounded = (bytes + 4095) / 4096 * 4096;
    std::size_t nonzero = 0;
    for (std::size_t i = 0; i < rounded; ++i) nonzero += b.data()[i] != 0 ? 1 : 0;
    EXPECT_EQ(nonzero, 0u) << bytes << " bytes";
  }
}

TEST(AlignedBuffer, ZeroBytesOwnNothing) {
  AlignedBuffer b(0, 4096);
  EXPECT_EQ(b.data(), nullptr);
  EXPECT_EQ(b.size(), 0u);
  EXPECT_TRUE(b.empty());
  AlignedBuffer d;
  EXPECT_EQ(d.data(), nullptr);
  EXPECT_TRUE(d.empty());
}

TEST(AlignedBuffer, MovesLeaveTheSourceEmpty) {
  AlignedBuffer a(5000, 4096, AlignedBuffer::Fill::kZero);
  a.data()[4999] = 42;
  unsigned char* p = a.data();

  AlignedBuffer b(std::move(a));
  EXPECT_EQ(b.data(), p);
  EXPECT_EQ(b.size(), 5000u);
  EXPECT_EQ(b.alignment(), 4096u);
  EXPECT_EQ(b.data()[4999], 42);
  EXPECT_EQ(a.data(), nullptr);  // NOLINT(bugprone-use-after-move): moved-from is empty
  EXPECT_EQ(a.size(), 0u);

  AlignedBuffer c(100, 64);
  c = std::move(b);  // frees c's own bytes (the leak check of a sanitizer build sees it)
  EXPECT_EQ(c.data(), p);
  EXPECT_EQ(c.size(), 5000u);
  EXPECT_EQ(b.data(), nullptr);  // NOLINT(bugprone-use-after-move)

  std::vector<AlignedBuffer> many;
  // No reserve: the vector's reallocations move the buffers.
  for (int i = 0; i < 20; ++i) many.emplace_back(4096, 4096);  // NOLINT(performance-*)
  for (const auto& m : many) EXPECT_TRUE(aligned_to(m.data(), 4096));
}

TEST(AlignedBuffer, BadAlignmentAndImpossibleSizesThrowTidalError) {
  EXPECT_THROW(AlignedBuffer(64, 0), Error);
  EXPECT_THROW(AlignedBuffer(64, 3), Error);
  EXPECT_THROW(AlignedBuffer(64, 4096 + 512), Error);
  // Larger than any address space once rounded up: refused before the allocator is asked.
  EXPECT_THROW(AlignedBuffer(std::numeric_limits<std::size_t>::max() - 1, 4096), Error);
  try {
    const AlignedBuffer b(std::numeric_limits<std::size_t>::max(), 4096);
    ADD_FAILURE() << "no exception";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("out of memory"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tidal
