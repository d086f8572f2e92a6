#include "tidal/torch/build_info.hpp"

#include <torch/torch.h>
#include <torch/version.h>

#include <fstream>
#include <string>

namespace tidal::torch_layer {

std::string torch_version() { return TORCH_VERSION; }

bool cuda_available() { return torch::cuda::is_available(); }

std::string blas_library() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  std::string found;
  while (std::getline(maps, line)) {
    const auto slash = line.find('/');
    if (slash == std::string::npos) continue;
    const std::string path = line.substr(slash);
    if (path.find("mkl") != std::string::npos) return "mkl";
    if (path.find("openblas") != std::string::npos) {
      return path.find("pthread") != std::string::npos  ? "openblas-pthread"
             : path.find("openmp") != std::string::npos ? "openblas-openmp"
                                                        : "openblas";
    }
    if (path.find("/blas/libblas") != std::string::npos) found = "reference";
    if (found.empty() && path.find("libblas") != std::string::npos) {
      found = path.substr(path.rfind('/') + 1);
    }
  }
  return found.empty() ? "none loaded" : found;
}

}  // namespace tidal::torch_layer
