// The defaults a session takes on a GPU machine, from faked device and host figures: the budget
// is what tensors can hold on the device, the host tier what the process may still take less a
// reserve, the cgroup's limit where it is the smaller.
#include "tidal/common/memory_defaults.hpp"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "io/test_dir.hpp"
#include "tidal/common/error.hpp"

namespace tidal {
namespace {

using testing::TestDir;
constexpr std::uint64_t kGiB = 1ull << 30;
constexpr std::uint64_t kMiB = 1ull << 20;

void write(const std::string& path, const std::string& text) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream(path) << text;
}

TEST(MemoryDefaults, ReadsMemAvailableAndTheProcessCgroupsLimit) {
  TestDir dir;
  const std::string proc = dir.path() + "/proc";
  const std::string cg = dir.path() + "/cgroup";
  write(proc + "/meminfo",
        "MemTotal:       131072000 kB\nMemFree:         1000 kB\nMemAvailable:   "
        "104857600 kB\n");
  write(proc + "/self/cgroup", "0::/job/step\n");
  // The limit is on the parent group; the process's own group has none ("max").
  write(cg + "/job/step/memory.max", "max\n");
  write(cg + "/job/memory.max", std::to_string(48 * kGiB) + "\n");
  write(cg + "/job/memory.current", std::to_string(6 * kGiB) + "\n");
  const HostMemory m = read_host_memory(proc, cg);
  EXPECT_EQ(m.available, 104857600ull * 1024);
  EXPECT_EQ(m.cgroup_limit, 48 * kGiB);
  EXPECT_EQ(m.cgroup_usage, 6 * kGiB);
  EXPECT_EQ(host_room(m), 42 * kGiB);  // the cgroup's room is the smaller
}

TEST(MemoryDefaults, MissingFilesLeaveFiguresUnknown) {
  TestDir dir;
  const HostMemory m = read_host_memory(dir.path() + "/none", dir.path() + "/none");
  EXPECT_EQ(m.available, 0u);
  EXPECT_EQ(m.cgroup_limit, 0u);
  EXPECT_EQ(default_host_tier(m).bytes, 0u);
  EXPECT_NE(default_host_tier(m).why.find("no host tier"), std::string::npos);
}

TEST(MemoryDefaults, TheHostTierKeepsAQuarterOrTwoGiB) {
  // The GPU machine of the issue: 128 GiB, about 120 GiB available, no cgroup limit.
  HostTierChoice c = default_host_tier(HostMemory{120 * kGiB, 0, 0});
  EXPECT_EQ(c.bytes, 90 * kGiB);
  EXPECT_NE(c.why.find("120"), std::string::npos) << c.why;
  // A small machine keeps the floor.
  c = default_host_tier(HostMemory{6 * kGiB, 0, 0});
  EXPECT_EQ(c.bytes, 4 * kGiB);
  // Under a cgroup limit the room is what the cgroup has left.
  c = default_host_tier(HostMemory{120 * kGiB, 16 * kGiB, 4 * kGiB});
  EXPECT_EQ(c.bytes, 9 * kGiB);
  EXPECT_NE(c.why.find("cgroup"), std::string::npos) << c.why;
  // Nothing beyond the reserve: no tier, said so.
  c = default_host_tier(HostMemory{kGiB + 3 * kMiB, 0, 0});
  EXPECT_EQ(c.bytes, 0u);
  // Whole MiB.
  c = default_host_tier(HostMemory{10 * kGiB + 12345, 0, 0});
  EXPECT_EQ(c.bytes % kMiB, 0u);
}

TEST(MemoryDefaults, TheDeviceBudgetIsWhatTensorsCanHold) {
  // An H200 after its context and cuBLAS: 139 GiB in all, 0.6 GiB outside the allocator, and
  // the allocator holding 40 MiB of which 8 MiB are tensors.
  DeviceMemory d;
  d.total = 139 * kGiB;
  d.reserved = 40 * kMiB;
  d.allocated = 8 * kMiB;
  d.free = d.total - d.reserved - 600 * kMiB;
  const BudgetChoice c = default_device_budget(d);
  EXPECT_EQ(c.bytes, d.total - 600 * kMiB - 32 * kMiB);
  EXPECT_EQ(c.bytes, d.free + d.allocated);
  EXPECT_NE(c.why.find("600"), std::string::npos) << c.why;
  // Another process holding most of the device lowers it the same way.
  d.free = 4 * kGiB;
  EXPECT_EQ(default_device_budget(d).bytes, 4 * kGiB + 8 * kMiB);
}

TEST(MemoryDefaults, ADeviceWithNothingLeftOrNonsenseFiguresIsRefused) {
  DeviceMemory d;
  EXPECT_THROW((void)default_device_budget(d), InvalidArgument);
  d.total = 80 * kGiB;
  d.free = 0;
  d.reserved = d.allocated = 0;
  EXPECT_THROW((void)default_device_budget(d), InvalidArgument);
  d.free = 90 * kGiB;  // more free than there is
  EXPECT_THROW((void)default_device_budget(d), InvalidArgument);
}

}  // namespace
}  // namespace tidal
