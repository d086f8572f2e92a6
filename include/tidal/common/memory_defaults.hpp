// What a session takes by default on a GPU machine: the device's memory as the budget, and the
// host memory the process may still use as a tier. The figures are read from the machine at
// start (read_host_memory here; the device's by the torch layer, torch_layer::
// measure_device_memory) and the choices made from them by plain functions, so that tests can
// give any machine's figures.
#pragma once

#include <cstdint>
#include <string>

namespace tidal {

/// Host memory as the kernel reports it for this process. 0 means not known (or no limit).
struct HostMemory {
  std::uint64_t available = 0;     ///< /proc/meminfo's MemAvailable
  std::uint64_t cgroup_limit = 0;  ///< the process's cgroup limit (memory.max), 0: none
  std::uint64_t cgroup_usage = 0;  ///< the cgroup's use now (memory.current)
};

/// Reads MemAvailable from `<proc>/meminfo` and the limit and use of this process's cgroup
/// (v2: `<cgroup>/<path of /proc/self/cgroup>/memory.max` and `memory.current`, the nearest
/// ancestor with a limit; v1: `<cgroup>/memory/memory.limit_in_bytes` and `usage_in_bytes`).
/// A file that cannot be read leaves its figure 0. Never throws.
HostMemory read_host_memory(const std::string& proc = "/proc",
                            const std::string& cgroup = "/sys/fs/cgroup");

/// What the process may still take: the lesser of MemAvailable and the cgroup's room.
std::uint64_t host_room(const HostMemory& m);

/// The host tier a session takes when none is given: host_room less a reserve for the rest of
/// the process and the system (a quarter of the room, at least kHostReserveFloor), rounded down
/// to whole MiB. `why` says how it was chosen, with the figures.
struct HostTierChoice {
  std::uint64_t bytes = 0;
  std::string why;
};
inline constexpr std::uint64_t kHostReserveFloor = 2ull << 30;
HostTierChoice default_host_tier(const HostMemory& m);

/// A device's memory as measured at start, after its context and its libraries' workspaces
/// exist (a first matmul).
struct DeviceMemory {
  std::uint64_t total = 0;      ///< the device's memory
  std::uint64_t free = 0;       ///< not used by anything (the driver's free figure)
  std::uint64_t allocated = 0;  ///< held by tensors now (the caching allocator's allocated)
  std::uint64_t reserved = 0;   ///< held by the caching allocator (tensors and its cache)
};

/// The budget a session takes on a device when none is given: what tensors can hold, that is
/// the device's memory less what is not tensors, each measured: the CUDA context, other
/// processes and library memory outside the caching allocator (total - free - reserved), and
/// the allocator's cache not holding tensors (reserved - allocated). Throws
/// tidal::InvalidArgument when the figures leave nothing (a device already full).
struct BudgetChoice {
  std::uint64_t bytes = 0;
  std::string why;
};
BudgetChoice default_device_budget(const DeviceMemory& d);

}  // namespace tidal
