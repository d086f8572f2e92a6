// What the torch layers were built against, for trace provenance and `tidal --version`.
#pragma once

#include <string>

namespace tidal::torch_layer {

/// libtorch's version string, e.g. "1.13.1".
std::string torch_version();

/// True when libtorch was built with CUDA and a CUDA device is visible.
bool cuda_available();

}  // namespace tidal::torch_layer
