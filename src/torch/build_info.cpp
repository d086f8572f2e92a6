#include "tidal/torch/build_info.hpp"

#include <torch/torch.h>
#include <torch/version.h>

namespace tidal::torch_layer {

std::string torch_version() { return TORCH_VERSION; }

bool cuda_available() { return torch::cuda::is_available(); }

}  // namespace tidal::torch_layer
