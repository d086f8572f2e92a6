#include "tidal/io/host_pool.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "test_dir.hpp"
#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"
#ifdef TIDAL_WITH_CUDA
#include "io/cuda/device.hpp"
#endif

namespace tidal::io {
namespace {

using testing::random_bytes;

bool cuda_device() {
#ifdef TIDAL_WITH_CUDA
  return detail::cuda::device_available();
#else
  return false;
#endif
}

TEST(HostPool, IsPinnedAsItsUseGrowsNotWholeAtStart) {
  // A default host tier is most of the machine's memory: pinned whole at start it would take
  // minutes and all of it at once. It is pinned to its most used, 64 MiB at a time.
  HostPool pool(1 * kGiB);
  std::vector<unsigned char> small(10 * kMiB, 7);
  Ticket a = pool.write(small.data(), small.size(), Priority::kOffload);
  pool.wait(a);
  if (!cuda_device()) {
    EXPECT_EQ(pool.stats().pinned_bytes, 0u);
    EXPECT_FALSE(pool.stats().pinned);
    GTEST_SKIP() << "no CUDA device: nothing is pinned (checked); the sizes need a GPU";
  }
  EXPECT_EQ(pool.stats().pinned_bytes, 64 * kMiB);
  std::vector<unsigned char> big(70 * kMiB, 1);
  Ticket b = pool.write(big.data(), big.size(), Priority::kOffload);
  pool.wait(b);
  EXPECT_EQ(pool.stats().pinned_bytes, 128 * kMiB);  // 80 MiB used: two steps
  pool.free(a);
  pool.free(b);
  EXPECT_EQ(pool.stats().pinned_bytes, 128 * kMiB);  // kept: the next use needs it again
  EXPECT_TRUE(pool.stats().pin_failure.empty()) << pool.stats().pin_failure;
}

TEST(HostPool, RoundTripsEveryByteAtOddSizes) {
  HostPool pool(8 * kMiB);
  std::mt19937_64 rng(5);
  for (std::size_t n : {std::size_t{1}, std::size_t{4095}, std::size_t{4097}, 3 * kMiB + 17}) {
    auto data = random_bytes(n, rng());
    Ticket t = pool.write(data.data(), n, Priority::kOffload);
    pool.wait(t);
    std::vector<unsigned char> back(n);
    pool.read(t, back.data(), Priority::kUrgent);
    pool.wait(t);
    EXPECT_EQ(back, data) << n << " bytes";
    pool.free(t);
  }
  const HostPoolStats st = pool.stats();
  EXPECT_EQ(st.used_bytes, 0u);
  EXPECT_EQ(st.tickets, 0u);
  EXPECT_EQ(st.bytes_written, st.bytes_read);
  EXPECT_GE(st.peak_used_bytes, 3 * kMiB);
}

TEST(HostPool, AFullPoolRefusesOneWriteWithAClearErrorAndStaysUsable) {
  HostPool pool(1 * kMiB);
  auto data = random_bytes(768 * kKiB, 9);
  Ticket a = pool.write(data.data(), data.size(), Priority::kOffload);
  Ticket b = pool.write(data.data(), data.size(), Priority::kOffload);
  pool.wait(a);
  try {
    pool.wait(b);
    FAIL() << "a write into a full pool succeeded";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("host pool is full"), std::string::npos) << e.what();
  }
  EXPECT_THROW(pool.read(b, data.data(), Priority::kUrgent), Error) << "nothing to read back";
  pool.free(b);
  pool.free(a);
  Ticket c = pool.write(data.data(), data.size(), Priority::kOffload);
  EXPECT_NO_THROW(pool.wait(c));
  EXPECT_EQ(pool.stats().full, 1u);
  pool.free(c);
}

TEST(HostPool, ZeroCapacityIsAnError) { EXPECT_THROW(HostPool(0), InvalidArgument); }

TEST(HostPool, ManyThreadsKeepTheirBytesApart) {
  HostPool pool(16 * kMiB);
  std::vector<std::thread> threads;
  std::vector<int> bad(4, 0);
  for (int id = 0; id < 4; ++id) {
    threads.emplace_back([&, id] {
      std::mt19937_64 rng(100 + id);
      for (int i = 0; i < 50; ++i) {
        const std::size_t n = 1 + rng() % (512 * 1024);
        auto data = random_bytes(n, rng());
        Ticket t = pool.write(data.data(), n, static_cast<Priority>(rng() % 3));
        std::vector<unsigned char> back(n);
        pool.read(t, back.data(), Priority::kPrefetch);  // waits for the write first
        pool.wait(t);
        if (back != data) ++bad[static_cast<std::size_t>(id)];
        pool.free(t);
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int b : bad) EXPECT_EQ(b, 0);
  EXPECT_EQ(pool.stats().used_bytes, 0u);
}

TEST(HostPool, CancelWriteReturnsTheSpaceOfAQueuedWrite) {
  HostPool pool(64 * kMiB);
  auto big = random_bytes(32 * kMiB, 3);
  auto small = random_bytes(4 * kKiB, 4);
  // The copy thread is busy with the big write for a while; later writes queue behind it.
  std::vector<Ticket> queued;
  Ticket first = pool.write(big.data(), big.size(), Priority::kOffload);
  for (int i = 0; i < 16; ++i)
    queued.push_back(pool.write(small.data(), small.size(), Priority::kOffload));
  int cancelled = 0;
  for (auto it = queued.rbegin(); it != queued.rend(); ++it) {
    if (pool.cancel_write(*it)) {
      ++cancelled;
      *it = Ticket{};
    }
  }
  EXPECT_GE(cancelled, 1) << "no write was still queued behind 32 MiB";
  pool.wait(first);
  EXPECT_FALSE(pool.cancel_write(first)) << "a finished write is not cancelled";
  for (Ticket t : queued) {
    if (t.valid()) pool.free(t);
  }
  pool.free(first);
  EXPECT_EQ(pool.stats().used_bytes, 0u);
  EXPECT_EQ(pool.stats().tickets, 0u);
}

}  // namespace
}  // namespace tidal::io
