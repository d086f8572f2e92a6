#include "tidal/common/units.hpp"

#include <gtest/gtest.h>

#include <random>

#include "tidal/common/error.hpp"

namespace tidal {
namespace {

TEST(Units, ParsesBinaryAndDecimalSizes) {
  EXPECT_EQ(parse_bytes("4096"), 4096u);
  EXPECT_EQ(parse_bytes("64MiB"), 64u * kMiB);
  EXPECT_EQ(parse_bytes("64M"), 64u * kMiB);
  EXPECT_EQ(parse_bytes("2GB"), 2000000000u);
  EXPECT_EQ(parse_bytes(" 1.5 gib "), 3u * kGiB / 2);
  EXPECT_EQ(parse_bytes("3KB"), 3000u);
  EXPECT_EQ(parse_bytes("1TiB"), 1024u * kGiB);
}

TEST(Units, RejectsGarbageWithAHint) {
  EXPECT_THROW(parse_bytes("lots"), InvalidArgument);
  EXPECT_THROW(parse_bytes("-5MiB"), InvalidArgument);
  try {
    parse_bytes("12 parsecs");
    FAIL() << "no exception";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("MiB"), std::string::npos) << e.what();
  }
}

// A size past what any memory or disk holds is refused with its text, never wrapped: 1e19 bytes
// once came back as 2^63 (llround out of range), and sizes near 2^64 overflowed the sums
// downstream.
TEST(Units, RejectsSizesThatWouldOverflow) {
  EXPECT_EQ(parse_bytes("1048576TiB"), std::uint64_t{1} << 60);  // 1 EiB, the largest
  for (const char* text : {"1048577TiB", "1e19", "18446744073709551615", "1e300GB"}) {
    try {
      const std::uint64_t got = parse_bytes(text);
      ADD_FAILURE() << text << " was accepted as " << got;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("too large"), std::string::npos) << e.what();
    }
  }
}

TEST(Units, ParsesBandwidthAndDurations) {
  EXPECT_DOUBLE_EQ(parse_bandwidth("6.5GB/s"), 6.5e9);
  EXPECT_DOUBLE_EQ(parse_bandwidth("800MiB/s"), 800.0 * kMiB);
  EXPECT_DOUBLE_EQ(parse_seconds("1.5ms"), 1.5e-3);
  EXPECT_DOUBLE_EQ(parse_seconds("2"), 2.0);
  EXPECT_THROW(parse_seconds("3 fortnights"), Error);
}

// A percentage is a number and '%', nothing between: "50xyz%" was read as 50%.
TEST(Units, ParsesPercentagesWholeOrNotAtAll) {
  EXPECT_DOUBLE_EQ(parse_percentage("50%"), 0.5);
  EXPECT_DOUBLE_EQ(parse_percentage(" 12.5 % "), 0.125);
  EXPECT_DOUBLE_EQ(parse_percentage("100%"), 1.0);
  for (const char* text : {"50xyz%", "50", "%", "x%", "50%%", "-5%", "nan%", "5e%"}) {
    try {
      const double got = parse_percentage(text);
      ADD_FAILURE() << text << " was accepted as " << got;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  }
}

TEST(Units, FormatThenParseRoundTripsWithinRounding) {
  std::mt19937_64 rng(7);
  for (int i = 0; i < 200; ++i) {
    const std::uint64_t n = rng() % (std::uint64_t{1} << 44);
    const double back = static_cast<double>(parse_bytes(format_bytes(static_cast<double>(n))));
    EXPECT_NEAR(back, static_cast<double>(n), static_cast<double>(n) * 0.01 + 1) << n;
  }
  EXPECT_EQ(align_up(1, 4096), 4096u);
  EXPECT_EQ(align_up(4096, 4096), 4096u);
  EXPECT_EQ(align_up(4097, 4096), 8192u);
}

}  // namespace
}  // namespace tidal
