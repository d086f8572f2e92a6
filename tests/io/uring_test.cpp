// The io_uring backend when the kernel misbehaves: submit and wait errors are injected through
// the backend's internal call table (io/uring/uring_backend.hpp), since no disk fails that way
// on demand. Each case used to hang a waiter (or spin) before the backend accounted for every op.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "io/host_copy.hpp"
#include "test_dir.hpp"
#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"
#include "tidal/io/backend.hpp"
#include "tidal/io/store.hpp"
#ifdef TIDAL_WITH_IO_URING
#include "io/uring/uring_backend.hpp"
#endif

namespace tidal::io {
namespace {

using testing::random_bytes;
using testing::TestDir;

TEST(PinAll, UnpinsWhatItPinnedWhenOneRegionFails) {
  std::vector<char> mem(5);
  std::vector<std::pair<void*, std::size_t>> regions;
  for (char& c : mem) regions.emplace_back(&c, 1);
  std::vector<void*> pinned;
  int calls = 0;
  auto pin = [&](void* p, std::size_t) {
    if (++calls == 3) return -12;  // the third region cannot be pinned (ENOMEM)
    pinned.push_back(p);
    return 0;
  };
  auto unpin = [&](void* p) { pinned.erase(std::find(pinned.begin(), pinned.end(), p)); };
  EXPECT_FALSE(detail::pin_all(regions, pin, unpin));
  EXPECT_TRUE(pinned.empty()) << pinned.size() << " region(s) left pinned";
  calls = 10;  // no failure this time
  EXPECT_TRUE(detail::pin_all(regions, pin, unpin));
  EXPECT_EQ(pinned.size(), 5u);
}

#ifdef TIDAL_WITH_IO_URING

// Injected behaviour, read by the hooks below (plain functions: the call table takes pointers).
std::atomic<int> g_submit_error{0};  // submit returns -this while set
std::atomic<int> g_submit_busy{0};   // submit returns -EBUSY this many more times
std::atomic<int> g_wait_error{0};    // wait returns -this after a completion arrived
std::atomic<int> g_wait_calls{0};
std::atomic<int> g_init_error{0};

int hook_submit(io_uring* ring) {
  if (const int e = g_submit_error.load(); e != 0) return -e;
  if (g_submit_busy.load() > 0) {
    --g_submit_busy;
    return -EBUSY;
  }
  return detail::uring_default_calls().submit(ring);
}

int hook_wait(io_uring* ring, io_uring_cqe** cqe, __kernel_timespec* ts) {
  ++g_wait_calls;
  const int rc = detail::uring_default_calls().wait(ring, cqe, ts);
  if (rc == 0 && g_wait_error.load() != 0) return -g_wait_error.load();  // the CQE stays
  return rc;
}

int hook_init(unsigned entries, io_uring* ring, unsigned flags) {
  if (const int e = g_init_error.load(); e != 0) return -e;
  return detail::uring_default_calls().queue_init(entries, ring, flags);
}

constexpr detail::UringCalls kHooks{&hook_init, &hook_submit, &hook_wait};

// Clears every injected fault at the end of a test, so that a backend left behind can drain.
struct ResetHooks {
  ~ResetHooks() {
    g_submit_error = 0;
    g_submit_busy = 0;
    g_wait_error = 0;
    g_init_error = 0;
  }
};

// An O_DIRECT file and aligned buffers; records each op's result.
class Ops {
 public:
  explicit Ops(const TestDir& dir, int n) : n_(n) {
    fd_ = ::open(dir.path().c_str(), O_TMPFILE | O_RDWR | O_DIRECT, 0600);
    if (fd_ < 0) fd_ = ::open((dir.path() + "/f").c_str(), O_CREAT | O_RDWR | O_DIRECT, 0600);
    EXPECT_GE(fd_, 0) << std::strerror(errno);
    EXPECT_EQ(::ftruncate(fd_, 4096L * n), 0);
    buf_ = static_cast<char*>(std::aligned_alloc(4096, 4096UL * static_cast<unsigned>(n)));
    std::memset(buf_, 0x5a, 4096UL * static_cast<unsigned>(n));
    ops_.resize(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) {
      IoOp& op = ops_[static_cast<std::size_t>(i)];
      op.file = 0;
      op.offset = 4096UL * static_cast<unsigned>(i);
      op.length = 4096;
      op.buffer = buf_ + 4096L * i;
      op.write = true;
      op.context = this;
      op.on_complete = &Ops::done;
    }
  }
  ~Ops() {
    std::free(buf_);
    ::close(fd_);
  }
  [[nodiscard]] int fd() const { return fd_; }
  IoOp* op(int i) { return &ops_[static_cast<std::size_t>(i)]; }

  /// Waits up to 5 s for `count` completions; true when they all came.
  bool wait_for(int count) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(5),
                        [&] { return static_cast<int>(results_.size()) >= count; });
  }
  std::vector<long> results() {
    std::lock_guard<std::mutex> lock(mu_);
    return results_;
  }

 private:
  static void done(IoOp* op, long result) {
    auto* self = static_cast<Ops*>(op->context);
    std::lock_guard<std::mutex> lock(self->mu_);
    self->results_.push_back(result);
    self->cv_.notify_all();
  }
  int n_;
  int fd_ = -1;
  char* buf_ = nullptr;
  std::vector<IoOp> ops_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<long> results_;
};

// A backend with the hooked calls on a file of five 4 KiB blocks; skipped without io_uring.
class UringBackendFaults : public ::testing::Test {
 protected:
  void SetUp() override {
    try {
      b_ = detail::make_uring_backend_with({ops_.fd()}, 8, {}, kHooks);
    } catch (const IoError& e) {
      GTEST_SKIP() << "io_uring unavailable here: " << e.what();
    }
  }
  ResetHooks reset_;  // first in, last out: the backend below drains with the faults cleared
  TestDir dir_;
  Ops ops_{dir_, 5};
  std::unique_ptr<Backend> b_;
};

TEST_F(UringBackendFaults, SubmitErrorFailsTheQueuedOpsInsteadOfLosingThem) {
  b_->submit(ops_.op(0));
  b_->flush();
  ASSERT_TRUE(ops_.wait_for(1));
  EXPECT_EQ(ops_.results()[0], 4096);
  g_submit_error = EBADF;  // the ring stops taking entries
  for (int i = 1; i < 4; ++i) b_->submit(ops_.op(i));
  b_->flush();
  const bool all_came = ops_.wait_for(4);
  EXPECT_TRUE(all_came) << "ops whose submission failed never completed: their waiters hang";
  if (all_came) {
    for (int i = 1; i < 4; ++i) EXPECT_EQ(ops_.results()[static_cast<std::size_t>(i)], -EBADF);
    EXPECT_NE(b_->broken_reason().find("io_uring_submit failed: Bad file descriptor"),
              std::string::npos)
        << b_->broken_reason();
    b_->submit(ops_.op(4));  // a broken ring fails new ops at once
    EXPECT_TRUE(ops_.wait_for(5));
    EXPECT_EQ(ops_.results().back(), -EBADF);
  }
  // Destroying the backend while the ring still refuses everything must not hang.
  b_.reset();
}

TEST_F(UringBackendFaults, BusyRingIsRetriedNotDropped) {
  g_submit_busy = 3;  // completions backed up for a moment: EBUSY, then fine
  for (int i = 0; i < 3; ++i) b_->submit(ops_.op(i));
  b_->flush();
  ASSERT_TRUE(ops_.wait_for(3)) << "entries left behind by an EBUSY submit never ran";
  for (long r : ops_.results()) EXPECT_EQ(r, 4096);
  EXPECT_EQ(b_->broken_reason(), "");
}

TEST_F(UringBackendFaults, WaitErrorFailsTheOpsInTheKernelAndDoesNotSpin) {
  g_wait_error = EFAULT;  // from the first completion on, waiting fails for good
  b_->submit(ops_.op(0));
  b_->submit(ops_.op(1));
  b_->flush();
  const bool came = ops_.wait_for(2);
  EXPECT_TRUE(came) << "the reaper kept retrying a lasting error; the ops never completed";
  if (came) {
    for (long r : ops_.results()) EXPECT_EQ(r, -EFAULT);
    EXPECT_NE(b_->broken_reason().find("io_uring_wait_cqe failed: Bad address"), std::string::npos)
        << b_->broken_reason();
  }
  const int calls = g_wait_calls.load();
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(g_wait_calls.load(), calls) << "the reaper spins on the error";
  b_->submit(ops_.op(2));
  EXPECT_TRUE(ops_.wait_for(3));
  EXPECT_EQ(ops_.results().back(), -EFAULT);
  g_wait_error = 0;
}

// The store with the hooked calls: kAuto falls back to POSIX, explicit io_uring does not.
class HookedStore {
 public:
  HookedStore() : previous_(detail::set_uring_calls_for_testing(kHooks)) {}
  ~HookedStore() { detail::set_uring_calls_for_testing(previous_); }

 private:
  detail::UringCalls previous_;
};

StoreOptions store_options(const TestDir& dir, BackendKind kind) {
  StoreOptions o;
  o.dirs = {dir.path()};
  o.capacity = 16 * kMiB;
  o.queue_depth = 4;
  o.backend = kind;
  return o;
}

bool uring_works(const TestDir& dir) {
  try {
    TensorStore probe(store_options(dir, BackendKind::kIoUring));
    return true;
  } catch (const IoError&) {
    return false;
  }
}

// Expects the store to have moved to POSIX once, for `why`; returns its stats.
StoreStats expect_fell_back(const TensorStore& store, const std::string& why) {
  const StoreStats s = store.stats();
  EXPECT_EQ(s.backend, "posix");
  EXPECT_EQ(s.backend_fallback.count, 1u);
  EXPECT_NE(s.backend_fallback.reason.find(why), std::string::npos) << s.backend_fallback.reason;
  return s;
}

// A store's directory with the calls hooked (and the hooks reset after); skipped where the
// kernel has no working io_uring.
class UringFaults : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!uring_works(dir_)) GTEST_SKIP() << "io_uring unavailable here";
  }
  ResetHooks reset_;
  HookedStore hooks_;
  TestDir dir_;
};

TEST_F(UringFaults, StoreMovesToPosixWhenTheRingBreaksAndSaysWhy) {
  TensorStore store(store_options(dir_, BackendKind::kAuto));
  ASSERT_EQ(store.stats().backend, "io_uring");
  EXPECT_EQ(store.stats().backend_fallback.count, 0u);
  auto data = random_bytes(kMiB + 100, 31);
  Ticket a = store.write(data.data(), data.size());
  store.wait(a);
  g_submit_error = EBADF;
  Ticket b = store.write(data.data(), data.size());
  try {
    store.wait(b);
    FAIL() << "the write whose submission failed must fail";
  } catch (const IoError& e) {
    EXPECT_EQ(e.errnum(), EBADF);
    EXPECT_NE(std::string(e.what()).find("io_uring backend stopped working"), std::string::npos)
        << e.what();
  }
  // Later requests run on the POSIX backend, the ring still refusing everything.
  Ticket c = store.write(data.data(), data.size());
  store.wait(c);
  std::vector<unsigned char> back(data.size());
  for (Ticket t : {a, c}) {
    store.read(t, back.data());
    store.wait(t);
    EXPECT_EQ(back, data);
  }
  const StoreStats s = expect_fell_back(store, "io_uring_submit failed: Bad file descriptor");
  EXPECT_EQ(s.write_failed.count, 1u);
  EXPECT_EQ(s.failed_requests, 1u);
}

TEST_F(UringFaults, ExplicitIoUringDoesNotFallBack) {
  TensorStore store(store_options(dir_, BackendKind::kIoUring));
  auto data = random_bytes(8192, 32);
  g_submit_error = EBADF;
  for (int i = 0; i < 2; ++i) {
    Ticket t = store.write(data.data(), data.size());
    try {
      store.wait(t);
      FAIL() << "write " << i << " must fail";
    } catch (const IoError& e) {
      EXPECT_NE(std::string(e.what()).find("open the store with the posix backend"),
                std::string::npos)
          << e.what();
    }
  }
  EXPECT_EQ(store.stats().backend, "io_uring");
  EXPECT_EQ(store.stats().backend_fallback.count, 0u);
}

TEST(UringFaultsAtOpen, FallbackWhenOpeningKeepsItsReason) {
  ResetHooks reset;
  HookedStore hooks;
  TestDir dir;
  g_init_error = EPERM;  // io_uring disabled by sysctl or seccomp
  TensorStore store(store_options(dir, BackendKind::kAuto));
  expect_fell_back(store, "io_uring_queue_init failed: Operation not permitted");
  EXPECT_THROW(TensorStore(store_options(dir, BackendKind::kIoUring)), IoError)
      << "asked for by name, io_uring is not replaced";
}

#endif  // TIDAL_WITH_IO_URING

}  // namespace
}  // namespace tidal::io
