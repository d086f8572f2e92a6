// The CUDA runtime helpers of the I/O layer: device detection, pointer classification, copies on
// per-thread streams, host-memory pinning, and the per-thread error text.
#include "io/cuda/device.hpp"

#include <cuda_runtime_api.h>

#include <cerrno>
#include <string>
#include <utility>
#include <vector>

#include "io/cuda/last_error.hpp"

namespace tidal::io::detail::cuda {
namespace {

thread_local std::string t_last_error;

// Records a failed CUDA call and clears the runtime's per-thread error state, so that the next,
// unrelated call does not report this failure again through cudaGetLastError.
void record(cudaError_t err, const char* what) noexcept {
  (void)cudaGetLastError();
  try {
    std::string text = what;
    text += ": ";
    text += cudaGetErrorName(err);
    text += " (";
    text += cudaGetErrorString(err);
    text += ")";
    set_last_error(std::move(text));
  } catch (...) {
    // Out of memory while building a message: keep the previous text.
  }
}

// Records a failure that is not a CUDA error code ("no CUDA device", a null pointer).
void note(const char* what, const char* detail) noexcept {
  try {
    set_last_error(std::string(what) + ": " + detail);
  } catch (...) {
    // As above.
  }
}

// One non-blocking stream per thread and device: copies issued by different I/O threads then
// overlap, and none of them waits for (or holds up) work on the legacy default stream. The
// streams are destroyed when the thread ends.
class ThreadStreams {
 public:
  ThreadStreams() = default;
  ThreadStreams(const ThreadStreams&) = delete;
  ThreadStreams& operator=(const ThreadStreams&) = delete;
  ~ThreadStreams() {
    for (cudaStream_t s : streams_) {
      if (s != nullptr) cudaStreamDestroy(s);
    }
  }

  // The stream of the current device, created on first use; nullptr on failure (recorded).
  cudaStream_t get() noexcept {
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) {
      record(err, "cudaGetDevice");
      return nullptr;
    }
    try {
      if (static_cast<std::size_t>(device) >= streams_.size()) streams_.resize(device + 1);
    } catch (...) {
      note("cudaStreamCreateWithFlags", "out of host memory");
      return nullptr;
    }
    cudaStream_t& s = streams_[device];
    if (s == nullptr) {
      err = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
      if (err != cudaSuccess) {
        s = nullptr;
        record(err, "cudaStreamCreateWithFlags");
      }
    }
    return s;
  }

 private:
  std::vector<cudaStream_t> streams_;
};

thread_local ThreadStreams t_streams;

int copy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind,
         const char* what) noexcept {
  if (bytes == 0) return 0;
  if (dst == nullptr || src == nullptr) {
    note(what, "null pointer");
    return -EINVAL;
  }
  if (!device_available()) {
    note(what, "no CUDA device");
    return -ENODEV;
  }
  cudaStream_t stream = t_streams.get();
  if (stream == nullptr) return -EIO;
  cudaError_t err = cudaMemcpyAsync(dst, src, bytes, kind, stream);
  if (err != cudaSuccess) {
    record(err, what);
    return -EIO;
  }
  err = cudaStreamSynchronize(stream);
  if (err != cudaSuccess) {
    record(err, what);
    return -EIO;
  }
  return 0;
}

}  // namespace

void set_last_error(std::string text) noexcept { t_last_error = std::move(text); }

std::string last_error() { return t_last_error; }

bool device_available() noexcept {
  static const bool available = [] {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
      // No driver, no device, or a driver older than the runtime: all mean "no GPU here".
      (void)cudaGetLastError();
      return false;
    }
    return count > 0;
  }();
  return available;
}

bool is_device_pointer(const void* p) noexcept {
  if (p == nullptr || !device_available()) return false;
  cudaPointerAttributes attributes{};
  const cudaError_t err = cudaPointerGetAttributes(&attributes, p);
  if (err != cudaSuccess) {
    // Older runtimes fail for plain host memory instead of answering "unregistered"; neither is
    // device memory, and the error must not linger for the next call.
    (void)cudaGetLastError();
    return false;
  }
  return attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged;
}

int copy_device_to_host(void* host_dst, const void* device_src, std::size_t bytes) noexcept {
  return copy(host_dst, device_src, bytes, cudaMemcpyDeviceToHost, "copy device to host");
}

int copy_host_to_device(void* device_dst, const void* host_src, std::size_t bytes) noexcept {
  return copy(device_dst, host_src, bytes, cudaMemcpyHostToDevice, "copy host to device");
}

void* allocate_device_memory(std::size_t bytes) noexcept {
  if (!device_available()) {
    note("cudaMalloc", "no CUDA device");
    return nullptr;
  }
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, bytes);
  if (err != cudaSuccess) {
    record(err, "cudaMalloc");
    return nullptr;
  }
  return p;
}

void free_device_memory(void* device_ptr) noexcept {
  if (device_ptr == nullptr) return;
  const cudaError_t err = cudaFree(device_ptr);
  if (err != cudaSuccess) record(err, "cudaFree");
}

int pin_host_memory(void* p, std::size_t bytes) noexcept {
  if (p == nullptr || bytes == 0) return -EINVAL;
  if (!device_available()) {
    note("cudaHostRegister", "no CUDA device");
    return -ENODEV;
  }
  const cudaError_t err = cudaHostRegister(p, bytes, cudaHostRegisterDefault);
  if (err == cudaSuccess) return 0;
  record(err, "cudaHostRegister");
  switch (err) {
    case cudaErrorHostMemoryAlreadyRegistered:
      return -EEXIST;
    case cudaErrorInvalidValue:
      return -EINVAL;
    case cudaErrorMemoryAllocation:
      return -ENOMEM;
    case cudaErrorNotSupported:
      return -ENOTSUP;
    default:
      return -EIO;
  }
}

void unpin_host_memory(void* p) noexcept {
  if (p == nullptr || !device_available()) return;
  const cudaError_t err = cudaHostUnregister(p);
  if (err != cudaSuccess) record(err, "cudaHostUnregister");
}

}  // namespace tidal::io::detail::cuda
