#include "tidal/io/store.hpp"

#include <gtest/gtest.h>
#include <linux/magic.h>
#include <sys/statfs.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <thread>

#include "test_dir.hpp"
#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"

#if defined(__SANITIZE_THREAD__)
#define TIDAL_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define TIDAL_TSAN 1
#endif
#endif

namespace tidal::io {
namespace {

// Expects waiting for ticket t to fail with an IoError that says `what` (and has errno `errnum`
// unless 0).
void expect_io_error(TensorStore& store, Ticket t, const std::string& what, int errnum = 0) {
  try {
    store.wait(t);
    ADD_FAILURE() << "the request must fail with '" << what << "'";
  } catch (const IoError& e) {
    if (errnum != 0) EXPECT_EQ(e.errnum(), errnum);
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
}

// Reads ticket t back (n bytes) and waits for it.
std::vector<unsigned char> read_back(TensorStore& store, Ticket t, std::size_t n) {
  std::vector<unsigned char> back(n);
  store.read(t, back.data());
  store.wait(t);
  return back;
}

using testing::random_bytes;
using testing::TestDir;

// A buffer at a chosen misalignment from a 4 KiB boundary.
struct Buffer {
  Buffer(std::size_t n, std::size_t misalign) : n_(n) {
    raw_.reset(
        static_cast<unsigned char*>(std::aligned_alloc(4096, align_up(n + misalign + 1, 4096))));
    p_ = raw_.get() + misalign;
  }
  unsigned char* data() { return p_; }
  [[nodiscard]] std::size_t size() const { return n_; }

 private:
  struct Free {
    void operator()(unsigned char* p) const { std::free(p); }
  };
  std::unique_ptr<unsigned char, Free> raw_;
  unsigned char* p_;
  std::size_t n_;
};

class StoreTest : public ::testing::TestWithParam<BackendKind> {
 protected:
  StoreOptions options(std::uint64_t capacity = 64 * kMiB) {
    StoreOptions o;
    o.dirs = {dir_.path()};
    o.capacity = capacity;
    o.backend = GetParam();
    o.queue_depth = 8;
    return o;
  }
  void SetUp() override {
#ifdef TIDAL_TSAN
    if (GetParam() == BackendKind::kIoUring) {
      GTEST_SKIP() << "io_uring orders memory through the kernel, which ThreadSanitizer cannot "
                      "see; the posix variant runs under TSan";
    }
#endif
    if (GetParam() == BackendKind::kIoUring) {
      try {
        TensorStore probe(options(kMiB));
        if (probe.stats().backend.rfind("io_uring", 0) != 0) GTEST_SKIP() << "no io_uring";
      } catch (const IoError& e) {
        GTEST_SKIP() << "io_uring unavailable here: " << e.what();
      }
    }
  }
  TestDir dir_;
};

void round_trip(TensorStore& store, std::size_t n, std::size_t misalign_src,
                std::size_t misalign_dst, std::uint64_t seed) {
  auto data = random_bytes(n, seed);
  Buffer src(n, misalign_src);
  std::memcpy(src.data(), data.data(), n);
  Ticket t = store.write(src.data(), n);
  store.wait(t);
  EXPECT_EQ(store.size(t), n);
  Buffer dst(n, misalign_dst);
  std::memset(dst.data(), 0xee, n);
  store.read(t, dst.data(), Priority::kUrgent);
  store.wait(t);
  ASSERT_EQ(std::memcmp(dst.data(), data.data(), n), 0)
      << "size " << n << " misalign " << misalign_src << "/" << misalign_dst;
  store.free(t);
}

TEST_P(StoreTest, RoundTripsAtOddSizesAndAlignments) {
  TensorStore store(options());
  const std::size_t sizes[] = {1,           511,  512,      1024, 1025,     4095,
                               4096,        4097, kMiB - 1, kMiB, kMiB + 3, 3 * kMiB + 4097,
                               5 * kMiB / 2};
  std::uint64_t seed = 1;
  for (std::size_t n : sizes) {
    round_trip(store, n, 0, 0, seed++);
    round_trip(store, n, 1, 0, seed++);
    round_trip(store, n, 0, 513, seed++);
    round_trip(store, n, 4095, 7, seed++);
  }
  const StoreStats s = store.stats();
  EXPECT_EQ(s.used_bytes, 0u);
  EXPECT_EQ(s.tickets, 0u);
  EXPECT_EQ(s.failed_requests, 0u);
  EXPECT_GT(s.staged_ops, 0u) << "unaligned buffers must go through staging";
  EXPECT_FALSE(s.buffered);
}

TEST_P(StoreTest, ZeroBytesIsCompleteAtOnce) {
  TensorStore store(options());
  Ticket t = store.write(nullptr, 0);
  EXPECT_TRUE(store.ready(t));
  store.wait(t);
  store.read(t, nullptr);
  store.wait(t);
  store.free(t);
}

TEST_P(StoreTest, StripesOverTwoDirectories) {
  StoreOptions o = options(64 * kMiB);
  o.dirs = {dir_.sub("ssd0"), dir_.sub("ssd1")};
  o.stripe_unit = kMiB;
  TensorStore store(o);
  const std::size_t n = 4 * kMiB + 100;  // 5 stripes: 3 on one file, 2 on the other
  auto data = random_bytes(n, 77);
  Ticket t = store.write(data.data(), n);
  store.wait(t);
  StoreStats s = store.stats();
  ASSERT_EQ(s.file_used_bytes.size(), 2u);
  EXPECT_GT(s.file_used_bytes[0], 0u);
  EXPECT_GT(s.file_used_bytes[1], 0u);
  EXPECT_EQ(s.file_used_bytes[0] + s.file_used_bytes[1], 4 * kMiB + 4096);
  EXPECT_EQ(read_back(store, t, n), data);
  // The round robin goes on where the last tensor stopped: the next stripe lands on the file
  // that had fewer, so both now hold three stripes.
  Ticket u = store.write(data.data(), kMiB);
  store.wait(u);
  s = store.stats();
  EXPECT_EQ(s.file_used_bytes[0], 2 * kMiB + 4096);
  EXPECT_EQ(s.file_used_bytes[1], 3 * kMiB);
}

TEST_P(StoreTest, TmpFilesAreInvisibleInTheDirectory) {
  auto count = [&] {
    return std::distance(std::filesystem::directory_iterator(dir_.path()),
                         std::filesystem::directory_iterator{});
  };
  const auto before = count();
  TensorStore store(options());
  EXPECT_EQ(count(), before) << "the store file must have no name in the directory";
  auto data = random_bytes(kMiB, 5);
  Ticket t = store.write(data.data(), kMiB);
  store.wait(t);
  EXPECT_EQ(count(), before);
  EXPECT_TRUE(store.stats().tmpfile) << "ext4 supports O_TMPFILE";
}

TEST_P(StoreTest, FullStoreFailsOneRequestAndRecoversAfterFree) {
  TensorStore store(options(8 * kMiB));
  auto data = random_bytes(3 * kMiB, 9);
  Ticket a = store.write(data.data(), 3 * kMiB);
  Ticket b = store.write(data.data(), 3 * kMiB);
  Ticket c = store.write(data.data(), 3 * kMiB);  // 9 MiB > 8 MiB
  store.wait(a);
  store.wait(b);
  expect_io_error(store, c, "store is full", ENOSPC);
  EXPECT_THROW(store.read(c, data.data()), Error) << "a failed write holds no data";
  store.free(c);
  store.free(a);
  Ticket d = store.write(data.data(), 3 * kMiB);
  store.wait(d);
  EXPECT_EQ(read_back(store, b, 3 * kMiB), data) << "earlier data is untouched by the failure";
  EXPECT_EQ(read_back(store, d, 3 * kMiB), data);
  EXPECT_EQ(store.stats().failed_requests, 1u);
}

TEST_P(StoreTest, FragmentedStoreStillPlacesATensor) {
  StoreOptions o = options(16 * kMiB);
  o.stripe_unit = 256 * kKiB;
  TensorStore store(o);
  auto data = random_bytes(kMiB, 3);
  std::vector<Ticket> t;
  for (int i = 0; i < 16; ++i) t.push_back(store.write(data.data(), kMiB));
  for (auto& x : t) store.wait(x);
  for (int i = 0; i < 16; i += 2) store.free(t[static_cast<std::size_t>(i)]);
  // 8 MiB free in 1 MiB holes: a 4 MiB tensor only fits stripe by stripe.
  auto big = random_bytes(4 * kMiB, 4);
  Ticket b = store.write(big.data(), 4 * kMiB);
  store.wait(b);
  EXPECT_EQ(read_back(store, b, 4 * kMiB), big);
}

TEST_P(StoreTest, InjectedEioIsReportedAndTheStoreStaysUsable) {
  StoreOptions o = options();
  o.faults.fail_op = 2;
  TensorStore store(o);
  auto data = random_bytes(kMiB, 12);
  Ticket a = store.write(data.data(), kMiB);
  store.wait(a);
  Ticket b = store.write(data.data(), kMiB);
  expect_io_error(store, b, "Input/output error", EIO);
  store.wait(b);  // reported once
  Ticket c = store.write(data.data(), kMiB);
  store.wait(c);
  std::vector<unsigned char> back(kMiB);
  for (Ticket x : {a, c}) {
    store.read(x, back.data());
    store.wait(x);
    EXPECT_EQ(back, data);
  }
  EXPECT_EQ(store.stats().failed_requests, 1u);
}

TEST_P(StoreTest, InjectedEnospcFromTheDisk) {
  StoreOptions o = options();
  o.faults.fail_op = 1;
  o.faults.fail_errno = ENOSPC;
  TensorStore store(o);
  auto data = random_bytes(100000, 13);
  Ticket a = store.write(data.data(), data.size());
  try {
    store.wait(a);
    FAIL();
  } catch (const IoError& e) {
    EXPECT_EQ(e.errnum(), ENOSPC);
  }
  store.free(a);
  Ticket b = store.write(data.data(), data.size());
  store.wait(b);
}

TEST_P(StoreTest, ShortWriteAndShortReadFailTheirRequest) {
  StoreOptions o = options();
  o.faults.short_op = 1;  // the write
  TensorStore store(o);
  auto data = random_bytes(2 * 4096, 14);
  Ticket a = store.write(data.data(), data.size());
  try {
    store.wait(a);
    FAIL();
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("short write"), std::string::npos) << e.what();
  }
  StoreOptions o2 = options();
  o2.faults.short_op = 2;  // the read
  TensorStore store2(o2);
  Ticket b = store2.write(data.data(), data.size());
  store2.wait(b);
  std::vector<unsigned char> back(data.size());
  store2.read(b, back.data());
  expect_io_error(store2, b, "short read");
  store2.read(b, back.data());  // the data is still there: a retry succeeds
  store2.wait(b);
  EXPECT_EQ(back, data);
}

TEST_P(StoreTest, CorruptReadIsDetectedByChecksum) {
  StoreOptions o = options();
  o.faults.corrupt_read = 2;  // the second stripe read of the tensor
  o.stripe_unit = 64 * kKiB;
  TensorStore store(o);
  auto data = random_bytes(300 * 1000, 15);
  Ticket t = store.write(data.data(), data.size());
  store.wait(t);
  std::vector<unsigned char> back(data.size());
  store.read(t, back.data());
  expect_io_error(store, t, "checksum mismatch");
  store.read(t, back.data());
  store.wait(t);
  EXPECT_EQ(back, data);
}

// The checksums run on a pool beside the I/O (writes hashed while written, reads checked while
// later stripes are read): one bit flipped anywhere in any stripe of a tensor with many stripes
// in flight is still caught, named by its stripe, and the tensor reads back whole afterwards.
// Half the trials read into a misaligned buffer, so the check runs on the staging buffer.
TEST_P(StoreTest, ParallelChecksumsCatchAFlippedBitInAnyStripe) {
  constexpr std::uint64_t kStripe = 64 * kKiB;
  const std::size_t n = 4 * kMiB - 1234;  // 64 stripes, the last one short
  const std::uint64_t nstripes = (n + kStripe - 1) / kStripe;
  auto data = random_bytes(n, 77);
  std::mt19937_64 rng(78);
  int caught = 0;
  constexpr int kTrials = 12;
  for (int trial = 0; trial < kTrials; ++trial) {
    StoreOptions o = options();
    o.stripe_unit = kStripe;
    o.checksum_threads = 3;
    // The first and the last stripe, then random ones; the first and the last byte, then
    // random ones.
    const std::uint64_t stripe = trial == 0 ? 0 : trial == 1 ? nstripes - 1 : rng() % nstripes;
    const std::uint64_t len = std::min<std::uint64_t>(kStripe, n - stripe * kStripe);
    const std::uint64_t byte = trial == 2 ? 0 : trial == 3 ? len - 1 : rng() % len;
    o.faults.corrupt_read = stripe + 1;  // one directory: reads are submitted in stripe order
    o.faults.corrupt_byte = byte;
    o.faults.corrupt_xor = static_cast<unsigned char>(1U << (rng() % 8));
    TensorStore store(o);
    ASSERT_EQ(store.stats().checksum_threads, 3);
    Ticket t = store.write(data.data(), n);
    store.wait(t);
    Buffer back(n, trial % 2 == 0 ? 0 : 512);
    store.read(t, back.data());
    try {
      store.wait(t);
      ADD_FAILURE() << "bit flipped at byte " << byte << " of stripe " << stripe
                    << " went unnoticed";
    } catch (const IoError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("checksum mismatch in the stripe at tensor byte " +
                          std::to_string(stripe * kStripe) + " "),
                std::string::npos)
          << what;
      ++caught;
    }
    EXPECT_EQ(store.stats().read_corrupt.count, 1u);
    store.read(t, back.data());
    store.wait(t);
    EXPECT_EQ(std::memcmp(back.data(), data.data(), n), 0);
    store.free(t);
  }
  EXPECT_EQ(caught, kTrials);
}

TEST_P(StoreTest, WithoutChecksumsCorruptionGoesUnnoticed) {
  // The control for the test above: it is the checksum, not luck, that catches the flip.
  StoreOptions o = options();
  o.faults.corrupt_read = 1;
  o.checksum = false;
  TensorStore store(o);
  auto data = random_bytes(8192, 16);
  Ticket t = store.write(data.data(), data.size());
  store.wait(t);
  EXPECT_NE(read_back(store, t, data.size()), data);
}

// Every failed request is counted once, under the path it took, with the first message.
TEST_P(StoreTest, DegradedPathsAreCountedWithTheirReason) {
  auto data = random_bytes(3 * kMiB, 40);
  std::vector<unsigned char> back(data.size());
  auto expect_fails = [](TensorStore& store, Ticket t) { EXPECT_THROW(store.wait(t), IoError); };
  {
    TensorStore store(options(8 * kMiB));  // capacity: the third write has no room
    Ticket a = store.write(data.data(), data.size());
    Ticket b = store.write(data.data(), data.size());
    Ticket c = store.write(data.data(), data.size());
    store.wait(a);
    store.wait(b);
    expect_fails(store, c);
    const StoreStats s = store.stats();
    EXPECT_EQ(s.store_full.count, 1u);
    EXPECT_NE(s.store_full.reason.find("the store is full"), std::string::npos)
        << s.store_full.reason;
    EXPECT_EQ(s.write_failed.count + s.read_failed.count + s.read_corrupt.count, 0u);
  }
  {
    StoreOptions o = options();
    o.faults.fail_op = 1;
    o.faults.fail_errno = ENOSPC;  // the disk itself is full
    o.faults.only_writes = true;
    TensorStore store(o);
    Ticket a = store.write(data.data(), kMiB);
    expect_fails(store, a);
    EXPECT_EQ(store.stats().store_full.count, 1u);
    EXPECT_NE(store.stats().store_full.reason.find("No space left on device"), std::string::npos)
        << store.stats().store_full.reason;
  }
  {
    StoreOptions o = options();
    o.faults.fail_op = 1;  // EIO on the first write
    o.faults.only_writes = true;
    TensorStore store(o);
    Ticket a = store.write(data.data(), kMiB);
    expect_fails(store, a);
    const StoreStats s = store.stats();
    EXPECT_EQ(s.write_failed.count, 1u);
    EXPECT_NE(s.write_failed.reason.find("tensor store write of 1.00 MiB"), std::string::npos)
        << s.write_failed.reason;
    EXPECT_NE(s.write_failed.reason.find("Input/output error"), std::string::npos);
    EXPECT_EQ(s.store_full.count, 0u);
  }
  {
    StoreOptions o = options();
    o.faults.short_op = 2;  // the first read comes back short
    TensorStore store(o);
    Ticket a = store.write(data.data(), 4096);
    store.wait(a);
    store.read(a, back.data());
    expect_fails(store, a);
    store.read(a, back.data());  // the data is still there
    store.wait(a);
    EXPECT_EQ(store.stats().read_failed.count, 1u);
    EXPECT_NE(store.stats().read_failed.reason.find("short read"), std::string::npos)
        << store.stats().read_failed.reason;
  }
  {
    StoreOptions o = options();
    o.faults.corrupt_read = 1;
    TensorStore store(o);
    Ticket a = store.write(data.data(), kMiB);
    store.wait(a);
    store.read(a, back.data());
    expect_fails(store, a);
    const StoreStats s = store.stats();
    EXPECT_EQ(s.read_corrupt.count, 1u);
    EXPECT_EQ(s.read_failed.count, 0u);
    EXPECT_NE(s.read_corrupt.reason.find("checksum mismatch"), std::string::npos)
        << s.read_corrupt.reason;
    EXPECT_EQ(s.failed_requests, 1u);
    EXPECT_EQ(s.backend_fallback.count, 0u) << s.backend_fallback.reason;
  }
}

// A full store refuses the same writes every time the same requests come: room is decided
// when write() is called, from the extents, not by the disk later.
TEST_P(StoreTest, FullStoreRefusesTheSameWritesEveryRun) {
  auto run = [&] {
    TensorStore store(options(8 * kMiB));
    std::mt19937_64 rng(7);
    auto data = random_bytes(2 * kMiB, 41);
    std::vector<Ticket> live;
    std::vector<int> refused;
    for (int i = 0; i < 60; ++i) {
      const std::size_t n = 1 + rng() % data.size();
      Ticket t = store.write(data.data(), n);
      try {
        store.wait(t);
        live.push_back(t);
      } catch (const IoError& e) {
        EXPECT_EQ(e.errnum(), ENOSPC);
        refused.push_back(i);
        store.free(t);
      }
      if (rng() % 3 == 0 && !live.empty()) {
        store.free(live.front());
        live.erase(live.begin());
      }
    }
    EXPECT_EQ(store.stats().store_full.count, refused.size());
    return refused;
  };
  const auto first = run();
  EXPECT_GT(first.size(), 5u) << "the case must fill the store";
  EXPECT_EQ(run(), first);
}

TEST_P(StoreTest, UrgentRequestsOvertakeQueuedOffloads) {
  StoreOptions o = options();
  o.queue_depth = 1;
  o.threads = 1;
  o.faults.delay_us = 2000;  // every op takes >= 2 ms
  TensorStore store(o);
  auto data = random_bytes(kMiB, 17);
  std::vector<Ticket> offloads;
  for (int i = 0; i < 24; ++i) offloads.push_back(store.write(data.data(), 64 * kKiB));
  Ticket urgent = store.write(data.data(), 64 * kKiB, Priority::kUrgent);
  store.wait(urgent);
  int pending = 0;
  for (Ticket t : offloads) pending += store.ready(t) ? 0 : 1;
  EXPECT_GE(pending, 12) << "the urgent write waited behind the offloads";
  // prioritize() lifts a queued request the same way.
  Ticket late = store.write(data.data(), 64 * kKiB);
  store.prioritize(late, Priority::kUrgent);
  store.wait(late);
  pending = 0;
  for (Ticket t : offloads) pending += store.ready(t) ? 0 : 1;
  EXPECT_GE(pending, 6);
  for (Ticket t : offloads) store.wait(t);
}

TEST_P(StoreTest, CancelWriteDropsOnlyWritesThatHaveNotStarted) {
  StoreOptions o = options();
  o.queue_depth = 1;
  o.threads = 1;
  o.faults.delay_us = 3000;  // every op takes >= 3 ms: the later writes wait in the queue
  TensorStore store(o);
  auto data = random_bytes(256 * kKiB, 23);
  std::vector<Ticket> tickets;
  for (int i = 0; i < 8; ++i) tickets.push_back(store.write(data.data(), 64 * kKiB));
  const std::uint64_t used_before = store.stats().used_bytes;
  // The last one cannot have started (each op before it takes 3 ms, one at a time).
  ASSERT_TRUE(store.cancel_write(tickets.back()));
  EXPECT_LT(store.stats().used_bytes, used_before) << "its space went back";
  EXPECT_THROW((void)store.size(tickets.back()), Error) << "the ticket is gone";
  tickets.pop_back();
  for (Ticket t : tickets) store.wait(t);
  // Done writes, and reads, are not writes waiting to start.
  EXPECT_FALSE(store.cancel_write(tickets.front()));
  std::vector<unsigned char> back(64 * kKiB);
  store.read(tickets.front(), back.data());
  EXPECT_FALSE(store.cancel_write(tickets.front()));
  store.wait(tickets.front());
  EXPECT_EQ(0, std::memcmp(back.data(), data.data(), back.size()));
  for (Ticket t : tickets) store.free(t);
  EXPECT_EQ(store.stats().tickets, 0u);
}

TEST_P(StoreTest, ConcurrentRandomStressChecksEveryByte) {
  StoreOptions o = options(48 * kMiB);
  o.dirs = {dir_.sub("a"), dir_.sub("b")};
  o.stripe_unit = 128 * kKiB;
  TensorStore store(o);
  std::atomic<int> failures{0};
  std::atomic<int> full{0};
  auto worker = [&](int id) {
    std::mt19937_64 rng(1000 + id);
    std::map<std::uint64_t, std::pair<Ticket, std::vector<unsigned char>>> mine;
    std::uint64_t next = 0;
    for (int step = 0; step < 150; ++step) {
      const int action = static_cast<int>(rng() % 3);
      if (action == 0 || mine.empty()) {
        const std::size_t n = 1 + rng() % (700 * 1024);
        auto data = random_bytes(n, rng());
        const auto prio = static_cast<Priority>(rng() % 3);
        Ticket t = store.write(data.data(), n, prio);
        try {
          store.wait(t);
          mine.emplace(next++, std::make_pair(t, std::move(data)));
        } catch (const IoError& e) {
          if (e.errnum() != ENOSPC) failures++;
          full++;
          store.free(t);
        }
      } else {
        auto it = mine.begin();
        std::advance(it, static_cast<long>(rng() % mine.size()));
        if (action == 1) {
          std::vector<unsigned char> back(it->second.second.size() + 3);
          store.read(it->second.first, back.data() + (rng() % 4));
          store.wait(it->second.first);
          // Compare the bytes where the read landed.
          bool same = false;
          for (int off = 0; off < 4 && !same; ++off) {
            same = std::memcmp(back.data() + off, it->second.second.data(),
                               it->second.second.size()) == 0;
          }
          if (!same) failures++;
        } else {
          store.free(it->second.first);
          mine.erase(it);
        }
      }
    }
    for (auto& [k, v] : mine) store.free(v.first);
  };
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) threads.emplace_back(worker, i);
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  const StoreStats s = store.stats();
  EXPECT_EQ(s.used_bytes, 0u);
  EXPECT_EQ(s.tickets, 0u);
  EXPECT_GT(s.reads, 50u);
}

INSTANTIATE_TEST_SUITE_P(Backends, StoreTest,
                         ::testing::Values(BackendKind::kPosix, BackendKind::kIoUring),
                         [](const auto& info) {
                           return std::string(info.param == BackendKind::kPosix ? "posix"
                                                                                : "io_uring");
                         });

TEST(StoreErrors, MissingDirectorySaysWhatToDo) {
  StoreOptions o;
  o.dirs = {"/nonexistent/tidal-dir"};
  o.capacity = kMiB;
  try {
    TensorStore store(o);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("mkdir -p"), std::string::npos) << e.what();
  }
}

// Without a capacity the store sizes itself from the directory's free space: a missing
// directory, a file, /proc or a memory file system must each be named as such, not reported as
// "capacity 0 B is too small".
TEST(StoreErrors, EachBadDirectorySaysWhatItIs) {
  const auto message = [](const std::string& dir) {
    StoreOptions o;
    o.dirs = {dir};  // capacity 0: from free space
    try {
      TensorStore store(o);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  EXPECT_NE(message("/nonexistent/tidal-dir").find("does not exist; create it"), std::string::npos);
  TestDir dir;
  const std::string file = dir.path() + "/a-file";
  std::fclose(std::fopen(file.c_str(), "w"));
  EXPECT_NE(message(file).find("is not a directory"), std::string::npos) << message(file);
  EXPECT_NE(message("/proc").find("pseudo file system"), std::string::npos) << message("/proc");
  struct statfs fs {};
  if (::statfs("/dev/shm", &fs) == 0 && static_cast<unsigned long>(fs.f_type) == TMPFS_MAGIC) {
    EXPECT_NE(message("/dev/shm").find("TIDAL_MEMORY_STORE=1"), std::string::npos)
        << message("/dev/shm");
    StoreOptions o;
    o.dirs = {"/dev/shm"};
    o.capacity = kMiB;
    o.buffered = true;  // tmpfs before Linux 6.6 has no O_DIRECT
    o.allow_memory_fs = true;
    EXPECT_NO_THROW(TensorStore{o});
  }
}

TEST(StoreErrors, BadOptionsAreRejected) {
  TestDir dir;
  StoreOptions o;
  o.dirs = {dir.path()};
  o.capacity = kMiB;
  o.stripe_unit = 3000;
  EXPECT_THROW(TensorStore{o}, InvalidArgument);
  o.stripe_unit = 0;
  o.capacity = 100;
  EXPECT_THROW(TensorStore{o}, InvalidArgument);
  o.capacity = kMiB;
  TensorStore ok(o);
  EXPECT_THROW(ok.read(Ticket{12345}, nullptr), Error);
  EXPECT_THROW(ok.free(Ticket{12345}), Error);
}

TEST(StoreErrors, CapacityLargerThanTheDiskIsRefusedClearly) {
  TestDir dir;
  StoreOptions o;
  o.dirs = {dir.path()};
  o.capacity = std::uint64_t{1} << 60;  // an exabyte
  try {
    TensorStore store(o);
    FAIL();
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("lower the store capacity"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace tidal::io
