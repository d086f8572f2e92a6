// Tests of the CUDA pieces of the I/O layer (src/io/cuda): copies, pointer classification,
// pinning and the cuFile driver. Built only with TIDAL_WITH_CUDA; every test skips with a reason
// when the machine has no CUDA device (or, for cuFile, no libcufile).
#ifdef TIDAL_WITH_CUDA

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "io/cuda/device.hpp"
#include "test_dir.hpp"

namespace tidal::io::detail::cuda {
namespace {

#define TIDAL_SKIP_WITHOUT_DEVICE() \
  if (!device_available()) GTEST_SKIP() << "no CUDA device"

using tidal::testing::random_bytes;

// Device memory released at scope exit.
struct DeviceBuffer {
  explicit DeviceBuffer(std::size_t n) : ptr(allocate_device_memory(n)) {}
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { free_device_memory(ptr); }
  void* ptr;
};

// 4 KiB-aligned host memory, as O_DIRECT wants.
struct AlignedHost {
  explicit AlignedHost(std::size_t n)
      : ptr(static_cast<unsigned char*>(std::aligned_alloc(4096, (n + 4095) / 4096 * 4096))) {}
  AlignedHost(const AlignedHost&) = delete;
  AlignedHost& operator=(const AlignedHost&) = delete;
  ~AlignedHost() { std::free(ptr); }
  unsigned char* ptr;
};

void round_trip(std::size_t bytes, std::uint64_t seed) {
  const auto src = random_bytes(bytes, seed);
  std::vector<unsigned char> back(bytes, 0);
  DeviceBuffer device(bytes);
  ASSERT_NE(device.ptr, nullptr) << last_error();
  ASSERT_EQ(copy_host_to_device(device.ptr, src.data(), bytes), 0) << last_error();
  ASSERT_EQ(copy_device_to_host(back.data(), device.ptr, bytes), 0) << last_error();
  EXPECT_EQ(std::memcmp(src.data(), back.data(), bytes), 0) << "bytes differ at size " << bytes;
}

TEST(CudaDevice, RoundTripOddSizes) {
  TIDAL_SKIP_WITHOUT_DEVICE();
  std::uint64_t seed = 1;
  for (std::size_t bytes :
       {std::size_t{1}, std::size_t{4095}, std::size_t{4097}, std::size_t{(1u << 20) + 3}}) {
    SCOPED_TRACE(bytes);
    round_trip(bytes, seed++);
  }
}

TEST(CudaDevice, ZeroByteCopyIsANoOp) {
  TIDAL_SKIP_WITHOUT_DEVICE();
  EXPECT_EQ(copy_host_to_device(nullptr, nullptr, 0), 0);
  EXPECT_EQ(copy_device_to_host(nullptr, nullptr, 0), 0);
}

TEST(CudaDevice, ConcurrentRoundTripsOnPerThreadStreams) {
  TIDAL_SKIP_WITHOUT_DEVICE();
  std::vector<std::thread> threads;
  threads.reserve(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([t] {
      for (int i = 0; i < 8; ++i) round_trip(257 * 1024 + 7 * i + t, 100 + 10 * t + i);
    });
  }
  for (auto& th : threads) th.join();
}

TEST(CudaDevice, PinnedHostRoundTrip) {
  TIDAL_SKIP_WITHOUT_DEVICE();
  const std::size_t bytes = (1u << 20) + 3;
  AlignedHost host(bytes);
  ASSERT_NE(host.ptr, nullptr);
  ASSERT_EQ(pin_host_memory(host.ptr, bytes), 0) << last_error();
  EXPECT_NE(pin_host_memory(host.ptr, bytes), 0) << "registering the same range twice";
  const auto src = random_bytes(bytes, 7);
  std::memcpy(host.ptr, src.data(), bytes);
  DeviceBuffer device(bytes);
  ASSERT_NE(device.ptr, nullptr) << last_error();
  ASSERT_EQ(copy_host_to_device(device.ptr, host.ptr, bytes), 0) << last_error();
  std::memset(host.ptr, 0, bytes);
  ASSERT_EQ(copy_device_to_host(host.ptr, device.ptr, bytes), 0) << last_error();
  EXPECT_EQ(std::memcmp(src.data(), host.ptr, bytes), 0);
  unpin_host_memory(host.ptr);
}

TEST(CudaDevice, ClassifiesPointers) {
  TIDAL_SKIP_WITHOUT_DEVICE();
  DeviceBuffer device(4096);
  ASSERT_NE(device.ptr, nullptr) << last_error();
  EXPECT_TRUE(is_device_pointer(device.ptr));
  EXPECT_TRUE(is_device_pointer(static_cast<char*>(device.ptr) + 100));
  std::vector<unsigned char> heap(4096);
  int stack_value = 0;
  EXPECT_FALSE(is_device_pointer(heap.data()));
  EXPECT_FALSE(is_device_pointer(&stack_value));
  EXPECT_FALSE(is_device_pointer(nullptr));
  // A failed classification must not leave an error behind for the next CUDA call.
  round_trip(4097, 3);
}

TEST(CudaDevice, NoDeviceAnswersWithoutThrowing) {
  if (device_available()) GTEST_SKIP() << "a CUDA device exists; this checks the no-device path";
  std::vector<unsigned char> host(16);
  EXPECT_FALSE(is_device_pointer(host.data()));
  EXPECT_LT(copy_host_to_device(host.data(), host.data(), host.size()), 0);
  EXPECT_FALSE(last_error().empty());
  EXPECT_EQ(allocate_device_memory(16), nullptr);
  EXPECT_EQ(CuFile::instance(), nullptr);
  EXPECT_FALSE(CuFile::unavailable_reason().empty());
}

// An O_DIRECT file in the first directory that supports it (tmpfs does not), unlinked at once.
struct DirectFile {
  DirectFile() {
    std::vector<std::string> dirs;
    if (const char* env = std::getenv("TIDAL_TEST_DIR")) dirs.emplace_back(env);
    dirs.insert(dirs.end(), {".", "/var/tmp", "/tmp"});
    for (const auto& dir : dirs) {
      std::string path = dir + "/tidal_cuda_test_XXXXXX";
      const int tmp = mkstemp(path.data());
      if (tmp < 0) continue;
      ::close(tmp);
      fd = ::open(path.c_str(), O_RDWR | O_DIRECT);
      ::unlink(path.c_str());
      if (fd >= 0) {
        this->dir = dir;
        return;
      }
      tried += dir + " ";
    }
  }
  DirectFile(const DirectFile&) = delete;
  DirectFile& operator=(const DirectFile&) = delete;
  ~DirectFile() {
    if (fd >= 0) ::close(fd);
  }
  int fd = -1;
  std::string dir;  // where the file was made
  std::string tried;
};

TEST(CudaCuFile, DeviceWriteThenReadBack) {
  TIDAL_SKIP_WITHOUT_DEVICE();
  CuFile* cufile = CuFile::instance();
  if (cufile == nullptr) {
    const std::string reason = CuFile::unavailable_reason();
    ASSERT_FALSE(reason.empty());
    GTEST_SKIP() << "cuFile unavailable: " << reason;
  }
  DirectFile file;
  if (file.fd < 0) GTEST_SKIP() << "no directory supports O_DIRECT (tried " << file.tried << ")";
  void* handle = cufile->register_file(file.fd);
  // cuFile registers only files on a file system it supports (with nvidia-fs, or in its
  // compatibility mode where cufile.json allows it); the store then uses its staging path.
  if (handle == nullptr) {
    GTEST_SKIP() << "cuFile cannot register a file in " << file.dir << ": " << last_error();
  }

  const std::size_t bytes = (1u << 20) + 3 * 4096;
  const off_t offset = off_t{8} * 4096;
  const auto src = random_bytes(bytes, 42);
  DeviceBuffer out(bytes);
  DeviceBuffer in(bytes);
  ASSERT_NE(out.ptr, nullptr) << last_error();
  ASSERT_NE(in.ptr, nullptr) << last_error();
  ASSERT_EQ(copy_host_to_device(out.ptr, src.data(), bytes), 0) << last_error();

  // The source unregistered, the destination registered: both paths of cuFile.
  ASSERT_EQ(cufile->write(handle, out.ptr, bytes, offset), static_cast<ssize_t>(bytes))
      << last_error();
  ASSERT_EQ(cufile->register_buffer(in.ptr, bytes), 0) << last_error();
  ASSERT_EQ(cufile->read(handle, in.ptr, bytes, offset), static_cast<ssize_t>(bytes))
      << last_error();
  cufile->deregister_buffer(in.ptr);

  std::vector<unsigned char> back(bytes, 0);
  ASSERT_EQ(copy_device_to_host(back.data(), in.ptr, bytes), 0) << last_error();
  EXPECT_EQ(std::memcmp(src.data(), back.data(), bytes), 0);

  // Reading past the end of the file returns what is there: nothing.
  EXPECT_EQ(cufile->read(handle, in.ptr, 4096, offset + static_cast<off_t>(bytes) + 4096), 0);
  cufile->deregister_file(handle);
}

TEST(CudaCuFile, UnavailableHasAReason) {
  if (CuFile::instance() != nullptr) GTEST_SKIP() << "cuFile is available here";
  EXPECT_FALSE(CuFile::unavailable_reason().empty());
}

}  // namespace
}  // namespace tidal::io::detail::cuda

#endif  // TIDAL_WITH_CUDA
