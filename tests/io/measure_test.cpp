#include "tidal/io/measure.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "test_dir.hpp"
#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"

namespace tidal::io {
namespace {

// A store on the POSIX backend (the store's logic is under test; io_uring blinds TSan).
StoreOptions posix_store(std::vector<std::string> dirs, std::uint64_t capacity) {
  StoreOptions o;
  o.dirs = std::move(dirs);
  o.capacity = capacity;
  o.backend = BackendKind::kPosix;
  return o;
}

TEST(MeasureBandwidth, MovesWholeBlocksBothWaysAndLeavesTheStoreEmpty) {
  testing::TestDir dir;
  TensorStore store(posix_store({dir.sub("a"), dir.sub("b")}, 64 * kMiB));
  const MeasuredBandwidth m = measure_bandwidth(store, 10 * kMiB + 123, kMiB, 4);
  EXPECT_EQ(m.bytes, 10 * kMiB);
  EXPECT_GT(m.write_bytes_per_second, 0);
  EXPECT_GT(m.read_bytes_per_second, 0);
  const StoreStats s = store.stats();
  EXPECT_EQ(s.tickets, 0u);
  EXPECT_EQ(s.used_bytes, 0u);
  EXPECT_EQ(s.bytes_written, 10 * kMiB);
  EXPECT_EQ(s.bytes_read, 10 * kMiB);
  EXPECT_THROW(measure_bandwidth(store, 10, kMiB, 4), InvalidArgument);
}

TEST(MeasureBandwidth, TheComputeCostIsMeasuredOnlyWhenAskedAndLeavesTheStoreEmpty) {
  testing::TestDir dir;
  TensorStore store(posix_store({dir.path()}, 64 * kMiB));
  MeasureOptions mo;
  mo.bytes = 8 * kMiB;
  mo.depth = 4;
  const MeasuredBandwidth plain = measure_bandwidth(store, mo);
  EXPECT_EQ(plain.write_compute_seconds_per_byte, 0);
  EXPECT_EQ(plain.read_compute_seconds_per_byte, 0);
  mo.compute_cost = true;
  const MeasuredBandwidth m = measure_bandwidth(store, mo);
  EXPECT_EQ(m.bytes, 8 * kMiB);
  for (double cost : {m.write_compute_seconds_per_byte, m.read_compute_seconds_per_byte,
                      measure_copy_compute_cost(4 * kMiB)}) {
    EXPECT_TRUE(std::isfinite(cost));
    EXPECT_GE(cost, 0);
    EXPECT_LT(cost, 1e-6);  // a microsecond a byte would be a broken measurement, not a CPU
  }
  const StoreStats s = store.stats();
  EXPECT_EQ(s.tickets, 0u);
  EXPECT_EQ(s.used_bytes, 0u);
  EXPECT_EQ(s.bytes_written, 3 * 8 * kMiB);  // two timed writes, and one beside the spinners
  EXPECT_THROW(measure_copy_compute_cost(0), InvalidArgument);
}

TEST(MeasureBandwidth, AFailingStoreThrowsAndKeepsNoTickets) {
  testing::TestDir dir;
  StoreOptions o = posix_store({dir.path()}, 32 * kMiB);
  o.faults.fail_op = 3;
  TensorStore store(o);
  EXPECT_THROW(measure_bandwidth(store, 8 * kMiB, kMiB, 2), IoError);
  EXPECT_EQ(store.stats().tickets, 0u);
  EXPECT_EQ(store.stats().used_bytes, 0u);
}

// A store smaller than the probe asked for: the probe shrinks to half its free space, so the
// measurement never fills the user's store (once 64 MiB into a 32 MiB store counted
// "store_full x16" as the store's own degradation, and the figures were silently not measured).
TEST(MeasureBandwidth, TheProbeFitsTheStoreAndNeverFillsIt) {
  testing::TestDir dir;
  TensorStore store(posix_store({dir.path()}, 32 * kMiB));
  MeasureOptions mo;
  mo.bytes = 64 * kMiB;
  const MeasuredBandwidth m = measure_bandwidth(store, mo);
  EXPECT_GT(m.bytes, 0u);
  EXPECT_LE(m.bytes, 16 * kMiB);
  EXPECT_GT(m.write_bytes_per_second, 0);
  const StoreStats s = store.stats();
  EXPECT_EQ(s.store_full.count, 0u) << s.store_full.reason;
  EXPECT_EQ(s.failed_requests, 0u);
  EXPECT_EQ(s.tickets, 0u);
}

// Too small to measure at all: an IoError that says "not measured" and why, and still nothing
// counted against the store.
TEST(MeasureBandwidth, AStoreTooSmallToMeasureSaysWhyAndCountsNothing) {
  testing::TestDir dir;
  TensorStore store(posix_store({dir.path()}, kMiB));
  try {
    (void)measure_bandwidth(store);
    ADD_FAILURE() << "a 1 MiB store was measured";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("not measured"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("1.00 MiB"), std::string::npos) << e.what();
  }
  EXPECT_EQ(store.stats().store_full.count, 0u);
  EXPECT_EQ(store.stats().failed_requests, 0u);
}

TEST(MeasureBandwidth, SsdSpecIsPerDirectory) {
  MeasuredBandwidth m;
  m.write_bytes_per_second = 4e9;
  m.read_bytes_per_second = 3e9;
  const std::string spec = ssd_spec(m, 2);
  ASSERT_EQ(spec.rfind("2x", 0), 0u) << spec;
  const auto slash = spec.find('/');
  EXPECT_DOUBLE_EQ(parse_bandwidth(spec.substr(2, slash - 2) + "MB/s"), 2e9) << spec;
  EXPECT_DOUBLE_EQ(parse_bandwidth(spec.substr(slash + 1)), 1.5e9) << spec;
}

}  // namespace
}  // namespace tidal::io
