// Internal: the per-thread error text behind tidal::io::detail::cuda::last_error(), shared by
// device.cpp (CUDA runtime) and cufile.cpp (cuFile).
#pragma once

#include <string>

namespace tidal::io::detail::cuda {

/// Replaces this thread's last error text. Never throws (on allocation failure the old text is
/// kept).
void set_last_error(std::string text) noexcept;

}  // namespace tidal::io::detail::cuda
