// The store's environment variables (common/env.hpp): each one, set to a good and a bad value,
// changes what the store does or is refused with a message that names it. The store reads the
// variables each time one opens, so each test sets them just before.
#include "tidal/common/env.hpp"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "test_dir.hpp"
#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"
#include "tidal/io/backend.hpp"
#include "tidal/io/store.hpp"

namespace tidal::io {
namespace {

using testing::TestDir;

// Sets (or, with nullopt, unsets) one variable for the scope and restores what was there.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, std::optional<std::string> value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value) {
      ::setenv(name, value->c_str(), 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// Every variable the store reads, unset for a test, so that the machine's own settings (a CI
// job with TIDAL_IO_BACKEND=posix) cannot change what it sees.
class StoreEnv : public ::testing::Test {
 protected:
  ScopedEnv backend_{"TIDAL_IO_BACKEND", std::nullopt};
  ScopedEnv gds_{"TIDAL_GDS", std::nullopt};
  ScopedEnv stripe_{"TIDAL_STRIPE_UNIT", std::nullopt};
  ScopedEnv depth_{"TIDAL_QUEUE_DEPTH", std::nullopt};
  TestDir dir_;

  [[nodiscard]] StoreOptions options(int dirs = 1) const {
    StoreOptions o;
    for (int i = 0; i < dirs; ++i) o.dirs.push_back(dir_.sub("d" + std::to_string(i)));
    o.capacity = 8 * kMiB * static_cast<std::uint64_t>(dirs);
    return o;
  }
};

// Opening a store with `o` throws InvalidArgument whose message names `variable` and `value`.
void expect_refused(const StoreOptions& o, const std::string& variable, const std::string& value) {
  try {
    TensorStore store(o);
    ADD_FAILURE() << variable << "=" << value << " was accepted";
  } catch (const InvalidArgument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(variable), std::string::npos) << msg;
    EXPECT_NE(msg.find(value), std::string::npos) << msg;
  }
}

TEST_F(StoreEnv, IoBackendChoosesTheHostBackend) {
  {
    ScopedEnv v("TIDAL_IO_BACKEND", "posix");
    TensorStore store(options());
    EXPECT_EQ(store.stats().backend, "posix");
    EXPECT_EQ(store.stats().backend_fallback.count, 0u);  // asked for, not a fallback
    EXPECT_EQ(store.options().backend, BackendKind::kPosix);
    // An explicit choice in the options wins over the variable (kvikio's rule).
    ScopedEnv uring("TIDAL_IO_BACKEND", "io_uring");
    StoreOptions o = options();
    o.backend = BackendKind::kPosix;
    TensorStore explicit_posix(o);
    EXPECT_EQ(explicit_posix.stats().backend, "posix");
  }
  {
    ScopedEnv v("TIDAL_IO_BACKEND", "io_uring");
    try {
      TensorStore store(options());
      EXPECT_EQ(store.options().backend, BackendKind::kIoUring);
      EXPECT_EQ(store.stats().backend, "io_uring");
    } catch (const IoError& e) {
      // Asked for by name, io_uring that cannot start is an error, not a silent fallback.
      EXPECT_FALSE(std::string(e.what()).empty());
      std::printf("io_uring unavailable here, refused as it must be: %s\n", e.what());
    }
  }
  {
    ScopedEnv v("TIDAL_IO_BACKEND", "cufile");  // cuFile is GDS: it turns GDS on
    try {
      TensorStore store(options());
      EXPECT_EQ(store.options().gds, GdsMode::kOn);
    } catch (const Error& e) {
      // Where a GPU is seen and cuFile cannot start, GDS asked for is an error.
      std::printf("cuFile asked for and unavailable, refused: %s\n", e.what());
    }
  }
  {
    ScopedEnv v("TIDAL_IO_BACKEND", "spdk");
    expect_refused(options(), "TIDAL_IO_BACKEND", "spdk");
  }
}

TEST_F(StoreEnv, StripeUnitSetsWhereTensorsAreSplit) {
  // 4 stripes of 64 KiB over two files: two on each. With the default 1 MiB stripe the whole
  // tensor would go to one file.
  std::vector<unsigned char> data = testing::random_bytes(256 * kKiB, 5);
  {
    ScopedEnv v("TIDAL_STRIPE_UNIT", "64KiB");
    TensorStore store(options(2));
    EXPECT_EQ(store.options().stripe_unit, 64 * kKiB);
    const Ticket t = store.write(data.data(), data.size());
    store.wait(t);
    const StoreStats s = store.stats();
    ASSERT_EQ(s.file_used_bytes.size(), 2u);
    EXPECT_EQ(s.file_used_bytes[0], 128 * kKiB);
    EXPECT_EQ(s.file_used_bytes[1], 128 * kKiB);
    std::vector<unsigned char> back(data.size());
    store.read(t, back.data());
    store.wait(t);
    EXPECT_EQ(back, data);
    store.free(t);
  }
  {
    TensorStore store(options(2));  // unset: the default
    EXPECT_EQ(store.options().stripe_unit, kMiB);
    const Ticket t = store.write(data.data(), data.size());
    store.wait(t);
    const StoreStats s = store.stats();
    EXPECT_EQ(s.file_used_bytes[0] + s.file_used_bytes[1], 256 * kKiB);
    EXPECT_TRUE(s.file_used_bytes[0] == 0 || s.file_used_bytes[1] == 0);
    store.free(t);
  }
  {
    ScopedEnv v("TIDAL_STRIPE_UNIT", "64KiB");
    StoreOptions o = options();
    o.stripe_unit = 256 * kKiB;  // the option wins
    TensorStore store(o);
    EXPECT_EQ(store.options().stripe_unit, 256 * kKiB);
  }
  for (const char* bad : {"3000", "1GiB", "2KiB"}) {  // sizes, but not stripe units
    ScopedEnv v("TIDAL_STRIPE_UNIT", bad);
    expect_refused(options(), "TIDAL_STRIPE_UNIT", "power of two");
  }
  ScopedEnv v("TIDAL_STRIPE_UNIT", "lots");
  expect_refused(options(), "TIDAL_STRIPE_UNIT", "lots");
}

TEST_F(StoreEnv, QueueDepthSetsRequestsInFlight) {
  {
    ScopedEnv v("TIDAL_QUEUE_DEPTH", "3");
    TensorStore store(options(2));
    EXPECT_EQ(store.options().queue_depth, 3);
    EXPECT_EQ(store.options().threads, 6);  // queue depth x files
    // Still moves data: 40 tensors through 3 requests per file.
    std::vector<unsigned char> data = testing::random_bytes(100 * kKiB + 7, 9);
    std::vector<Ticket> tickets;
    for (int i = 0; i < 40; ++i) tickets.push_back(store.write(data.data(), data.size()));
    for (Ticket t : tickets) store.wait(t);
    std::vector<unsigned char> back(data.size());
    store.read(tickets.back(), back.data());
    store.wait(tickets.back());
    EXPECT_EQ(back, data);
    for (Ticket t : tickets) store.free(t);
  }
  {
    TensorStore store(options());
    EXPECT_EQ(store.options().queue_depth, 32);  // the default
  }
  for (const char* bad : {"0", "-1", "deep", "8x", "5000"}) {
    ScopedEnv v("TIDAL_QUEUE_DEPTH", bad);
    expect_refused(options(), "TIDAL_QUEUE_DEPTH", bad);
  }
}

TEST_F(StoreEnv, GdsSetsTheCuFileMode) {
  {
    ScopedEnv v("TIDAL_GDS", "off");
    TensorStore store(options());
    EXPECT_EQ(store.options().gds, GdsMode::kOff);
    EXPECT_EQ(store.stats().backend.find("cufile"), std::string::npos) << store.stats().backend;
  }
  {
    ScopedEnv v("TIDAL_GDS", "auto");
    TensorStore store(options());
    EXPECT_EQ(store.options().gds, GdsMode::kAuto);
  }
  {
    ScopedEnv v("TIDAL_GDS", "on");
    StoreOptions o = options();
    o.gds = GdsMode::kOff;  // the option wins
    TensorStore store(o);
    EXPECT_EQ(store.options().gds, GdsMode::kOff);
  }
  for (const char* bad : {"yes", "1", "ON "}) {
    ScopedEnv v("TIDAL_GDS", bad);
    expect_refused(options(), "TIDAL_GDS", bad);
  }
}

// TIDAL_TIMELINE names a file; blanks only name none (a file called " " was written), and are
// refused with the variable named.
TEST(Env, TimelineOfOnlyBlanksIsRefused) {
  {
    ScopedEnv v("TIDAL_TIMELINE", "/var/tmp/run.json");
    EXPECT_EQ(read_env().timeline, std::optional<std::string>("/var/tmp/run.json"));
  }
  for (const char* blank : {" ", "  \t"}) {
    ScopedEnv v("TIDAL_TIMELINE", blank);
    try {
      const auto e = read_env();
      ADD_FAILURE() << "TIDAL_TIMELINE='" << blank << "' was taken as the file '"
                    << e.timeline.value_or("") << "'";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("TIDAL_TIMELINE"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("names no file"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace tidal::io
