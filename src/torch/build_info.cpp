#include "tidal/torch/build_info.hpp"

#include <ATen/Version.h>
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
  if (!found.empty()) return found;
  // None loaded as a library: linked into libtorch itself (the PyPI wheels carry MKL), which
  // torch's build configuration names.
  const std::string config = at::show_config();
  const auto at = config.find("BLAS_INFO=");
  if (at != std::string::npos) {
    const auto begin = at + 10;
    const auto end = config.find_first_of(", \n", begin);
    return config.substr(begin, end - begin) + " (in libtorch)";
  }
  return "none loaded";
}

}  // namespace tidal::torch_layer
