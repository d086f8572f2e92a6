#include "tidal/common/memory_defaults.hpp"

#include <algorithm>
#include <charconv>
#include <fstream>
#include <sstream>
#include <string>

#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"

namespace tidal {
namespace {

// The first line of `path` as a number of bytes; 0 for "max", a missing file or text.
std::uint64_t read_bytes(const std::string& path) {
  std::ifstream in(path);
  std::string word;
  if (!(in >> word)) return 0;
  std::uint64_t v = 0;
  const auto r = std::from_chars(word.data(), word.data() + word.size(), v);
  return r.ec == std::errc() && r.ptr == word.data() + word.size() ? v : 0;
}

std::uint64_t mem_available(const std::string& proc) {
  std::ifstream in(proc + "/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("MemAvailable:", 0) != 0) continue;
    std::istringstream fields(line.substr(13));
    std::uint64_t kib = 0;
    return fields >> kib ? kib * 1024 : 0;
  }
  return 0;
}

// cgroup v2: this process's group (the "0::" line of /proc/self/cgroup), or the nearest
// ancestor with a limit.
void read_cgroup_v2(const std::string& proc, const std::string& cgroup, HostMemory& m) {
  std::ifstream in(proc + "/self/cgroup");
  std::string line;
  std::string group;
  while (std::getline(in, line)) {
    if (line.rfind("0::", 0) == 0) group = line.substr(3);
  }
  if (group.empty()) return;
  for (std::string dir = group;; dir = dir.substr(0, dir.rfind('/'))) {
    const std::string base = cgroup + (dir == "/" ? "" : dir);
    const std::uint64_t limit = read_bytes(base + "/memory.max");
    if (limit > 0) {
      m.cgroup_limit = limit;
      m.cgroup_usage = read_bytes(base + "/memory.current");
      return;
    }
    if (dir.empty() || dir == "/") return;
  }
}

std::string gib(std::uint64_t b) { return format_bytes(static_cast<double>(b)); }

}  // namespace

HostMemory read_host_memory(const std::string& proc, const std::string& cgroup) {
  HostMemory m;
  m.available = mem_available(proc);
  read_cgroup_v2(proc, cgroup, m);
  if (m.cgroup_limit == 0) {
    // cgroup v1; a limit of "unlimited" is a huge number there, not a limit.
    const std::uint64_t limit = read_bytes(cgroup + "/memory/memory.limit_in_bytes");
    if (limit > 0 && limit < (1ull << 62)) {
      m.cgroup_limit = limit;
      m.cgroup_usage = read_bytes(cgroup + "/memory/memory.usage_in_bytes");
    }
  }
  return m;
}

std::uint64_t host_room(const HostMemory& m) {
  std::uint64_t room = m.available;
  if (m.cgroup_limit > 0) {
    const std::uint64_t left =
        m.cgroup_limit > m.cgroup_usage ? m.cgroup_limit - m.cgroup_usage : 0;
    room = room == 0 ? left : std::min(room, left);
  }
  return room;
}

HostTierChoice default_host_tier(const HostMemory& m) {
  HostTierChoice c;
  const std::uint64_t room = host_room(m);
  const std::uint64_t reserve = std::max(kHostReserveFloor, room / 4);
  const std::string where =
      m.cgroup_limit > 0 && host_room(HostMemory{0, m.cgroup_limit, m.cgroup_usage}) < m.available
          ? "the cgroup's room, " + gib(room) + " (limit " + gib(m.cgroup_limit) + ", " +
                gib(m.cgroup_usage) + " used)"
          : gib(room) + " available";
  if (room <= reserve) {
    c.why = "no host tier: " + where + " is within the reserve of " + gib(reserve) +
            " kept for the process and the system";
    return c;
  }
  c.bytes = (room - reserve) / (1ull << 20) * (1ull << 20);
  c.why = "host tier " + gib(c.bytes) + ": " + where + " less a reserve of " + gib(reserve) +
          " (a quarter, at least " + gib(kHostReserveFloor) + ")";
  return c;
}

BudgetChoice default_device_budget(const DeviceMemory& d) {
  TIDAL_EXPECT_AS(InvalidArgument, d.total > 0 && d.free <= d.total && d.allocated <= d.reserved,
                  "the device's memory figures are inconsistent (total ", d.total, ", free ",
                  d.free, ", allocated ", d.allocated, ", reserved ", d.reserved,
                  "): give a memory budget in bytes");
  const std::uint64_t used = d.total - d.free;
  const std::uint64_t outside = used > d.reserved ? used - d.reserved : 0;
  const std::uint64_t cache = d.reserved - d.allocated;
  const std::uint64_t budget = d.total - outside - cache;
  TIDAL_EXPECT_AS(InvalidArgument, budget > d.allocated,
                  "the device has no memory left for tensors (", gib(d.total), " in all, ",
                  gib(outside), " used outside tensors): free it or give a budget in bytes");
  BudgetChoice c;
  c.bytes = budget;
  c.why = "budget " + gib(budget) + ": the device's " + gib(d.total) + " less " + gib(outside) +
          " outside tensors (CUDA context, libraries, other processes) and " + gib(cache) +
          " of the allocator's cache, measured at start";
  return c;
}

}  // namespace tidal
