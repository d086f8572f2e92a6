// The pre-flight check: a model's state against the device budget, host memory and the SSDs.
#include "tidal/plan/preflight.hpp"

#include <gtest/gtest.h>

#include <string>

namespace tidal::plan {
namespace {

constexpr std::uint64_t kGiB = 1ull << 30;

Hardware machine(std::uint64_t host, std::uint64_t ssd) {
  Hardware hw;
  hw.ssd_count = 1;
  hw.ssd_write_bw = 2e9;
  hw.ssd_read_bw = 1.6e9;
  hw.host_link_bw = 50e9;
  hw.host_memory = host;
  hw.ssd_capacity = ssd;
  return hw;
}

TEST(Preflight, StateOutsideTheBudgetGoesToHostMemoryFirstAndIsTimed) {
  // gpt2-xl in fp32 with AdamW: about 23 GiB of state against an 8 GiB budget.
  const Preflight p = preflight(23 * kGiB, machine(10 * kGiB, 100 * kGiB), 8 * kGiB);
  EXPECT_TRUE(p.fits);
  EXPECT_EQ(p.outside_bytes, 15 * kGiB);
  EXPECT_EQ(p.to_host, 10 * kGiB);
  EXPECT_EQ(p.to_ssd, 5 * kGiB);
  // The host tier gets the link the SSDs leave it (48 and 48.4 GB/s), as the planner has it.
  const double want =
      10.0 * kGiB / 48e9 + 10.0 * kGiB / 48.4e9 + 5.0 * kGiB / 2e9 + 5.0 * kGiB / 1.6e9;
  EXPECT_NEAR(p.transfer_seconds, want, 1e-9 * want);
  EXPECT_NE(p.line.find("15.0 GiB"), std::string::npos) << p.line;
}

TEST(Preflight, StateThatFitsNowhereIsRefusedWithWhatToChange) {
  const Preflight p = preflight(200 * kGiB, machine(16 * kGiB, 64 * kGiB), 80 * kGiB);
  EXPECT_FALSE(p.fits);
  EXPECT_NE(p.line.find("does not fit"), std::string::npos) << p.line;
  EXPECT_NE(p.line.find("host memory"), std::string::npos) << p.line;
  EXPECT_NE(p.line.find("store capacity"), std::string::npos) << p.line;
  // Exactly full still fits.
  EXPECT_TRUE(preflight(160 * kGiB, machine(16 * kGiB, 64 * kGiB), 80 * kGiB).fits);
}

TEST(Preflight, StateWithinTheBudgetMovesNothing) {
  const Preflight p = preflight(4 * kGiB, machine(0, kGiB), 8 * kGiB);
  EXPECT_TRUE(p.fits);
  EXPECT_EQ(p.outside_bytes, 0u);
  EXPECT_EQ(p.transfer_seconds, 0);
}

TEST(Preflight, ABudgetNotKnownYetIsSaidNotGuessed) {
  const Preflight p = preflight(4 * kGiB, machine(0, kGiB), 0);
  EXPECT_TRUE(p.fits);
  EXPECT_EQ(p.transfer_seconds, -1);
  EXPECT_NE(p.line.find("share of a peak"), std::string::npos) << p.line;
}

}  // namespace
}  // namespace tidal::plan
