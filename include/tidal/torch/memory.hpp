// Memory meter: how many bytes of tensor memory a training job holds now and at its peak.
//
// CPU: a tracking allocator installed as c10's CPU allocator. Every allocation is 4 KiB aligned
// and its size padded to a multiple of 4 KiB, so that the SSD store can read and write host
// tensors in place with O_DIRECT. CUDA: the caching allocator's statistics (libtorch 2.9 and
// later, through the device-generic c10::DeviceAllocator; without it the meter reports zeros).
#pragma once

#include <c10/core/Device.h>

#include <cstddef>
#include <cstdint>

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
};

/// Installs the tracking allocator as the CPU allocator for the rest of the process. Idempotent
/// and thread-safe. Tensors allocated before keep their own deleter and are not counted: call it
/// first thing (the CLI and the tests do).
void install_tracking_cpu_allocator();

/// True once install_tracking_cpu_allocator() has run and the allocator is still c10's CPU
/// allocator.
bool tracking_cpu_allocator_active();

/// Padded size of a live block of the tracking allocator that starts at `ptr`, or 0 when `ptr` is
/// not such a block. Thread-safe.
std::uint64_t tracked_allocation_bytes(const void* ptr);

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
