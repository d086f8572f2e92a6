// Internal: the CUDA pieces of the I/O layer. Compiled only with TIDAL_WITH_CUDA (nvcc/CUDA
// runtime present at build time); cuFile is loaded at run time with dlopen, so one binary runs
// with or without GPUDirect Storage. Everything here is thread-safe.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace tidal::io::detail::cuda {

/// True when the CUDA runtime reports at least one device. Never throws.
bool device_available() noexcept;

/// True when p is device (or managed) memory according to cudaPointerGetAttributes.
/// False for host pointers and when no device exists. Never throws.
bool is_device_pointer(const void* p) noexcept;

/// Synchronous copies between device memory and host memory (pinned or not). Use a per-thread
/// non-blocking stream so copies of different I/O threads overlap. Return 0 or -EIO (and log the
/// CUDA error text through last_error()).
int copy_device_to_host(void* host_dst, const void* device_src, std::size_t bytes) noexcept;
int copy_host_to_device(void* device_dst, const void* host_src, std::size_t bytes) noexcept;

/// Device memory on the current device (cudaMalloc), for tests and tools that need a device
/// buffer without including CUDA headers. Returns nullptr on failure (see last_error()). Release
/// with free_device_memory(); nullptr is ignored.
void* allocate_device_memory(std::size_t bytes) noexcept;
void free_device_memory(void* device_ptr) noexcept;

/// Page-locks [p, p + bytes) so device copies from/to it run at full speed (cudaHostRegister).
/// Returns 0, or -errno-style failure (the memory stays usable, just pageable).
int pin_host_memory(void* p, std::size_t bytes) noexcept;
void unpin_host_memory(void* p) noexcept;

/// Text of the last CUDA or cuFile error seen by this thread.
std::string last_error();

/// The cuFile (GDS) driver, loaded with dlopen("libcufile.so.0") on first use. In a machine
/// without the nvidia-fs module it runs in compatibility mode (POSIX I/O inside cuFile), which
/// is still a valid, tested path.
class CuFile {
 public:
  /// The process-wide instance, or nullptr when libcufile cannot be loaded or cuFileDriverOpen
  /// fails; unavailable_reason() then says why. Thread-safe; loads once.
  static CuFile* instance();
  static std::string unavailable_reason();

  /// Registers an O_DIRECT file descriptor; returns an opaque handle or nullptr (see last_error).
  void* register_file(int fd);
  void deregister_file(void* handle);

  /// Registers a device buffer for faster transfers (optional; unregistered buffers work too).
  int register_buffer(void* device_ptr, std::size_t bytes);
  void deregister_buffer(void* device_ptr);

  /// Synchronous transfers between device memory and the file. Return bytes moved, or -errno.
  ssize_t read(void* handle, void* device_ptr, std::size_t bytes, off_t file_offset);
  ssize_t write(void* handle, const void* device_ptr, std::size_t bytes, off_t file_offset);

  CuFile(const CuFile&) = delete;
  CuFile& operator=(const CuFile&) = delete;
  ~CuFile();

 private:
  CuFile() = default;
  struct Api;
  Api* api_ = nullptr;  // function pointers resolved by dlsym; owned, freed in the destructor
};

}  // namespace tidal::io::detail::cuda
