// Internal: copies between a user buffer that may be device memory and host memory, shared by
// the store's staging path and the host pool.
#pragma once

#include <cstddef>
#include <cstring>
#include <utility>
#include <vector>

#ifdef TIDAL_WITH_CUDA
#include "io/cuda/device.hpp"
#endif

namespace tidal::io::detail {

inline bool is_device_memory(const void* p) {
#ifdef TIDAL_WITH_CUDA
  return cuda::device_available() && cuda::is_device_pointer(p);
#else
  (void)p;
  return false;
#endif
}

// Between host memory and a (possibly device) buffer, either way. Returns 0 or -EIO.
inline int copy_host(void* dst, const void* src, std::size_t n, bool device, bool to_device) {
#ifdef TIDAL_WITH_CUDA
  if (device) {
    return to_device ? cuda::copy_host_to_device(dst, src, n)
                     : cuda::copy_device_to_host(dst, src, n);
  }
#endif
  (void)device;
  (void)to_device;
  std::memcpy(dst, src, n);
  return 0;
}

// From a (possibly device) buffer to host memory.
inline int copy_out(void* host_dst, const void* src, std::size_t n, bool device) {
  return copy_host(host_dst, src, n, device, false);
}

// From host memory to a (possibly device) buffer.
inline int copy_in(void* dst, const void* host_src, std::size_t n, bool device) {
  return copy_host(dst, host_src, n, device, true);
}

// Pins every region with pin(p, n) (0 on success), or none: when one fails, the regions pinned
// before it are unpinned again, so the owner knows with one flag what to unpin later.
template <class Pin, class Unpin>
bool pin_all(const std::vector<std::pair<void*, std::size_t>>& regions, Pin pin, Unpin unpin) {
  for (std::size_t i = 0; i < regions.size(); ++i) {
    if (pin(regions[i].first, regions[i].second) != 0) {
      while (i > 0) unpin(regions[--i].first);
      return false;
    }
  }
  return true;
}

}  // namespace tidal::io::detail
