// What the torch layers were built against, for trace provenance and `tidal --version`.
#pragma once

#include <string>

namespace tidal::torch_layer {

/// libtorch's version string, e.g. "1.13.1".
std::string torch_version();

/// True when libtorch was built with CUDA and a CUDA device is visible.
bool cuda_available();

/// The BLAS libtorch runs its CPU matmuls on, as loaded in this process: "openblas-pthread",
/// "reference" (Debian's netlib libblas), "mkl", or the library's file name; else the one
/// torch's build configuration names ("mkl (in libtorch)": the PyPI wheels); "none loaded"
/// when no BLAS library is mapped. Figures depend on it: results name it.
std::string blas_library();

}  // namespace tidal::torch_layer
