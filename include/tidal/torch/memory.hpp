// Memory meter: how many bytes of tensor memory a training job holds now and at its peak.
//
// CPU: a tracking allocator installed as c10's CPU allocator. Every allocation is 4 KiB aligned
// and its size padded to a multiple of 4 KiB, so that the SSD store can read and write host
// tensors in place with O_DIRECT. CUDA: the caching allocator's statistics (libtorch 2.9 and
// later, through the device-generic c10::DeviceAllocator; without it the meter reports zeros).
#pragma once

#include <c10/core/Device.h>
#include <c10/core/StorageImpl.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "tidal/common/memory_defaults.hpp"

namespace tidal::torch_layer {

/// Alignment and size granularity of every allocation of the tracking CPU allocator.
inline constexpr std::size_t kHostAllocationAlignment = 4096;

/// Counters of one device's tensor memory. Bytes are what the allocator handed out (for the CPU
/// tracking allocator: padded sizes).
struct MemoryStats {
  std::uint64_t current_bytes = 0;
  std::uint64_t peak_bytes = 0;   ///< since install or the last reset_peak()
  std::uint64_t allocations = 0;  ///< allocation calls since install (CPU only)
  std::uint64_t frees = 0;        ///< free calls since install (CPU only)
  /// Allocations the strict meter refused (CPU only): each threw c10::OutOfMemoryError.
  std::uint64_t refusals = 0;
  /// Bytes the reclaimer freed when an allocation would have crossed the cap (CPU only).
  std::uint64_t reclaimed_bytes = 0;
  /// Host memory (HostMemoryScope) held now and at its peak, apart from the bytes above (CPU
  /// only).
  std::uint64_t host_bytes = 0;
  std::uint64_t host_peak_bytes = 0;
};

/// Installs the tracking allocator as the CPU allocator for the rest of the process. Idempotent
/// and thread-safe. Tensors allocated before keep their own deleter and are not counted: call it
/// first thing (the CLI and the tests do).
void install_tracking_cpu_allocator();

/// True once install_tracking_cpu_allocator() has run and the allocator is still c10's CPU
/// allocator.
bool tracking_cpu_allocator_active();

/// Host memory on a CPU device. While an object of this class lives on a thread, what that
/// thread allocates through the tracking allocator is host memory, not the device's: counted
/// apart (MemoryStats::host_bytes), never under the strict meter's cap, and marked for its life
/// (host_tier_storage), so that the tracer leaves it out of the trace and the executor never
/// moves it. What a host optimizer step keeps (fp32 masters, their gradients, the optimizer's
/// state) lives there, as it would in a GPU machine's RAM. Installs the tracking allocator.
class HostMemoryScope {
 public:
  /// active false: the object does nothing (for a scope that depends on a condition).
  explicit HostMemoryScope(bool active = true);
  ~HostMemoryScope();
  HostMemoryScope(const HostMemoryScope&) = delete;
  HostMemoryScope& operator=(const HostMemoryScope&) = delete;

 private:
  bool active_;
};

/// True for a storage allocated inside a HostMemoryScope.
bool host_tier_storage(const c10::StorageImpl& storage);

/// Padded size of a live block of the tracking allocator that starts at `ptr`, or 0 when `ptr` is
/// not such a block. Thread-safe.
std::uint64_t tracked_allocation_bytes(const void* ptr);

/// The strict meter: from now on an allocation of the tracking CPU allocator that would take
/// its current bytes past `bytes` first asks the reclaimer (below) to free memory, and when that
/// does not make room, is refused with c10::OutOfMemoryError (torch.OutOfMemoryError in Python),
/// the error a GPU's caching allocator raises there. CPU runs are then as strict as a GPU. 0
/// removes the cap. Installs the tracking allocator. Thread-safe.
void set_cpu_memory_cap(std::uint64_t bytes);
/// The cap set by set_cpu_memory_cap, or 0 for none.
std::uint64_t cpu_memory_cap();

/// Asked to free at least `bytes` of tracked CPU memory before an allocation is refused; returns
/// the bytes it freed (it may free less). It runs on the allocating thread, inside whatever op is
/// allocating, and must not evict that op's inputs. An allocation it makes itself is measured
/// against the cap but does not call it again.
using MemoryReclaimer = std::function<std::uint64_t(std::uint64_t bytes)>;
/// Sets (or, with an empty function, removes) the process's reclaimer; returns a token for
/// clear_cpu_memory_reclaimer, which removes it only if it is still the one set. Thread-safe.
std::uint64_t set_cpu_memory_reclaimer(MemoryReclaimer reclaimer);
void clear_cpu_memory_reclaimer(std::uint64_t token);
/// From inside a reclaimer: why it could not free more (a failing store, say). The refusal's
/// message carries it.
void note_reclaim_shortfall(std::string why);

/// A device's wall, the way a GPU raises it: from now on an allocation that would take the
/// device's memory past `bytes` is refused with c10::OutOfMemoryError, and nothing is asked to
/// free memory first (the residency guard of an executor with retry_out_of_memory on writes
/// tensors out and runs the refused op again). CUDA: the caching allocator's memory fraction
/// (bytes over the device's total; it counts the memory the allocator reserved, so a
/// fragmented cache reaches it first); CPU: the strict meter's cap, with the reclaimer left as
/// it is. 0 lifts the wall. Returns false where the device has no such wall (a torch built
/// without CUDA, another device type). Thread-safe.
bool set_device_memory_wall(const c10::Device& device, std::uint64_t bytes);

/// The bytes of this thread's last allocation refused for want of memory (the strict meter's,
/// or on CUDA the caching allocator's, seen through its out-of-memory observer), or 0; reading
/// it clears it.
std::uint64_t take_last_refused_bytes();

/// A device's memory now, after its context and its libraries' workspaces exist (a first
/// matmul runs on it): the figures default_device_budget takes. CUDA only; other devices (and
/// a torch without CUDA) give zeros, which default_device_budget refuses with a message that
/// asks for a budget in bytes.
DeviceMemory measure_device_memory(const c10::Device& device);

/// Sets the cap for the life of the object and puts the previous one back after.
class ScopedCpuMemoryCap {
 public:
  explicit ScopedCpuMemoryCap(std::uint64_t bytes);
  /// Puts the previous cap back, unless the cap was changed again inside the scope (a
  /// session's make_resident() lifting its wall): that would restore a wall nobody holds.
  ~ScopedCpuMemoryCap();
  ScopedCpuMemoryCap(const ScopedCpuMemoryCap&) = delete;
  ScopedCpuMemoryCap& operator=(const ScopedCpuMemoryCap&) = delete;

 private:
  std::uint64_t previous_;
  std::uint64_t bytes_;
};

/// Reads and resets a device's counters. Thread-safe (atomics on CPU; the caching allocator's own
/// locking on CUDA). Devices other than CPU and CUDA report zeros.
class MemoryMeter {
 public:
  /// A meter for `device`. On CPU, installs the tracking allocator if it is not yet installed.
  explicit MemoryMeter(c10::Device device = c10::Device(c10::kCPU));

  [[nodiscard]] MemoryStats stats() const;
  [[nodiscard]] std::uint64_t current_bytes() const { return stats().current_bytes; }
  [[nodiscard]] std::uint64_t peak_bytes() const { return stats().peak_bytes; }

  /// Restarts peak tracking from the current bytes.
  void reset_peak();

  [[nodiscard]] const c10::Device& device() const { return device_; }

 private:
  c10::Device device_;
};

}  // namespace tidal::torch_layer
