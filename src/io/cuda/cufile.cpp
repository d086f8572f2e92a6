// The cuFile (GPUDirect Storage) driver, loaded with dlopen so that one tidal binary runs with or
// without libcufile. Every entry point is resolved with dlsym; nothing links against libcufile.
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "io/cuda/cufile_shim.hpp"
#include "io/cuda/device.hpp"
#include "io/cuda/last_error.hpp"

namespace tidal::io::detail::cuda {

struct CuFile::Api {
  void* library = nullptr;  // never dlclose'd: libcufile keeps threads and exit handlers
  cufile_api::DriverOpenFn driver_open = nullptr;
  cufile_api::DriverCloseFn driver_close = nullptr;
  cufile_api::HandleRegisterFn handle_register = nullptr;
  cufile_api::HandleDeregisterFn handle_deregister = nullptr;
  cufile_api::BufRegisterFn buf_register = nullptr;
  cufile_api::BufDeregisterFn buf_deregister = nullptr;
  cufile_api::ReadFn read = nullptr;
  cufile_api::WriteFn write = nullptr;
};

namespace {

// Written once, inside the thread-safe initialisation of CuFile::instance(), read only after it.
std::string g_unavailable_reason;

// Short texts for the cuFile status codes (cufile.h, CUFILEOP_STATUS_ENTRIES), in our words.
struct OpErrorText {
  int code;
  const char* text;
};
constexpr OpErrorText kOpErrorTexts[] = {
    {0, "success"},
    {5001, "nvidia-fs driver not loaded (allow_compat_mode in cufile.json enables POSIX I/O)"},
    {5002, "invalid property"},
    {5003, "property out of range"},
    {5004, "nvidia-fs driver version mismatch"},
    {5005, "cannot read the nvidia-fs driver version"},
    {5006, "driver is shutting down"},
    {5007, "GPUDirect Storage not supported on this platform"},
    {5008, "GPUDirect Storage not supported on this file"},
    {5009, "GPUDirect Storage not supported on this GPU"},
    {5010, "nvidia-fs ioctl failed"},
    {5011, "CUDA driver error"},
    {5012, "invalid device pointer"},
    {5013, "invalid memory type for the pointer"},
    {5014, "pointer range exceeds the allocation"},
    {5015, "CUDA context mismatch"},
    {5016, "access beyond the maximum pinned size"},
    {5017, "access beyond the mapped size"},
    {5018, "unsupported file type"},
    {5019, "unsupported file open flags"},
    {5020, "file not opened with O_DIRECT"},
    {5022, "invalid argument"},
    {5023, "device memory already registered"},
    {5024, "device memory not registered"},
    {5025, "permission denied (driver or file)"},
    {5026, "driver already open"},
    {5027, "file not registered"},
    {5028, "file already registered"},
    {5029, "GPU not found"},
    {5030, "cuFile internal error"},
    {5031, "cannot obtain a new file descriptor"},
    {5033, "nvidia-fs set-up failed"},
    {5034, "GPUDirect Storage disabled by configuration for this file"},
    {5035, "batch submission failed"},
    {5036, "cannot pin GPU memory"},
    {5037, "batch queue full"},
    {5038, "stream operations not supported"},
    {5043, "cuFile out of memory"},
    {5044, "cuFile I/O error"},
};

// The text for a cuFile status code, or null for a code not in the table.
const char* op_error_text(int code) noexcept {
  for (const OpErrorText& e : kOpErrorTexts) {
    if (e.code == code) return e.text;
  }
  return nullptr;
}

std::string status_text(const CUfileError_t& status) {
  const int code = static_cast<int>(status.err);
  std::string text;
  if (const char* known = op_error_text(code)) {
    text = known;
    text += " (cuFile " + std::to_string(code) + ")";
  } else {
    text = "cuFile error " + std::to_string(code);
  }
  if (code == CU_FILE_CUDA_DRIVER_ERROR) {
    text += ", CUDA driver error " + std::to_string(static_cast<int>(status.cu_err));
  }
  return text;
}

void note_status(const char* call, const CUfileError_t& status) noexcept {
  try {
    set_last_error(std::string(call) + ": " + status_text(status));
  } catch (...) {
    // Out of memory while building a message: keep the previous text.
  }
}

// Turns a negative cuFileRead/cuFileWrite result into -errno and records its text: -1 means
// errno is set; other values are -errno or -CUfileOpError depending on the library version.
ssize_t transfer_error(const char* call, ssize_t rc) noexcept {
  const int saved_errno = errno;
  const long code = -static_cast<long>(rc);
  int result = -EIO;
  try {
    std::string text = std::string(call) + ": ";
    if (rc == -1) {
      result = saved_errno != 0 ? -saved_errno : -EIO;
      text += std::strerror(-result);
    } else if (code > 5000) {
      text += status_text(CUfileError_t{static_cast<CUfileOpError>(code), CUresult{}});
      if (code == CU_FILE_INVALID_VALUE || code == CU_FILE_DIO_NOT_SET) result = -EINVAL;
      if (code == CU_FILE_PERMISSION_DENIED) result = -EACCES;
    } else {
      result = static_cast<int>(-code);
      text += std::strerror(static_cast<int>(code));
    }
    set_last_error(std::move(text));
  } catch (...) {
    // As above.
  }
  return result;
}

// cuFile works in the CUDA context of the buffer; an I/O thread that never touched CUDA has no
// current context, and one that did may sit on another device. Make the buffer's device current.
bool use_device_of(const void* device_ptr, const char* call) noexcept {
  cudaPointerAttributes attributes{};
  cudaError_t err = cudaPointerGetAttributes(&attributes, device_ptr);
  if (err == cudaSuccess && attributes.type != cudaMemoryTypeDevice &&
      attributes.type != cudaMemoryTypeManaged) {
    try {
      set_last_error(std::string(call) + ": not device memory");
    } catch (...) {
    }
    return false;
  }
  int current = -1;
  if (err == cudaSuccess) err = cudaGetDevice(&current);
  if (err == cudaSuccess && current != attributes.device) err = cudaSetDevice(attributes.device);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    try {
      set_last_error(std::string(call) + ": " + cudaGetErrorString(err));
    } catch (...) {
    }
    return false;
  }
  return true;
}

template <typename Fn>
bool resolve(void* library, const char* name, Fn& fn) {
  fn = reinterpret_cast<Fn>(dlsym(library, name));
  return fn != nullptr;
}

constexpr const char* kInstallHint =
    "install NVIDIA GPUDirect Storage's user library (package libcufile-<cuda version> or "
    "nvidia-cufile from NVIDIA's CUDA repository, or the nvidia-cufile-cu<N> wheel) and make "
    "libcufile.so.0 findable (ldconfig or LD_LIBRARY_PATH)";

}  // namespace

CuFile* CuFile::instance() {
  static const std::unique_ptr<CuFile> instance = []() -> std::unique_ptr<CuFile> {
    std::string& reason = g_unavailable_reason;
    void* library = nullptr;
    std::string tried;
    for (const char* name : {"libcufile.so.0", "libcufile.so"}) {
      library = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (library != nullptr) break;
      const char* why = dlerror();
      if (!tried.empty()) tried += "; ";
      tried += why != nullptr ? why : name;
    }
    if (library == nullptr) {
      reason = "libcufile could not be loaded (" + tried + "); " + kInstallHint;
      return nullptr;
    }

    auto api = std::make_unique<Api>();
    api->library = library;
    // Since CUDA 12.2 the header maps cuFileDriverClose to cuFileDriverClose_v2 (reference
    // counted); older libraries export only the original name.
    bool ok = resolve(library, "cuFileDriverClose_v2", api->driver_close) ||
              resolve(library, "cuFileDriverClose", api->driver_close);
    const char* missing = ok ? nullptr : "cuFileDriverClose_v2 or cuFileDriverClose";
    const auto need = [&](const char* name, auto& fn) {
      if (missing == nullptr && !resolve(library, name, fn)) missing = name;
    };
    need("cuFileDriverOpen", api->driver_open);
    need("cuFileHandleRegister", api->handle_register);
    need("cuFileHandleDeregister", api->handle_deregister);
    need("cuFileBufRegister", api->buf_register);
    need("cuFileBufDeregister", api->buf_deregister);
    need("cuFileRead", api->read);
    need("cuFileWrite", api->write);
    if (missing != nullptr) {
      reason = std::string("libcufile was loaded but lacks ") + missing +
               "; it is too old or not NVIDIA's: " + kInstallHint;
      return nullptr;
    }

    if (!device_available()) {
      reason = "libcufile is installed but the CUDA runtime reports no device";
      return nullptr;
    }
    // cuFileDriverOpen and buffer registration work in the current CUDA context: create the
    // primary context of the current device first.
    if (const cudaError_t err = cudaFree(nullptr); err != cudaSuccess) {
      (void)cudaGetLastError();
      reason = std::string("CUDA initialisation failed before cuFileDriverOpen: ") +
               cudaGetErrorString(err);
      return nullptr;
    }
    const CUfileError_t status = api->driver_open();
    if (status.err != CU_FILE_SUCCESS) {
      reason = "cuFileDriverOpen failed: " + status_text(status) +
               "; check /etc/cufile.json (allow_compat_mode) and the nvidia-fs module";
      return nullptr;
    }

    std::unique_ptr<CuFile> cufile(new CuFile());  // the constructor is private
    cufile->api_ = api.release();
    return cufile;
  }();
  return instance.get();
}

std::string CuFile::unavailable_reason() {
  if (instance() != nullptr) return {};
  return g_unavailable_reason;
}

CuFile::~CuFile() {
  if (api_ == nullptr) return;
  // At process exit: registered files and buffers left behind are released by the driver.
  (void)api_->driver_close();
  delete api_;
}

void* CuFile::register_file(int fd) {
  CUfileDescr_t descr;
  std::memset(&descr, 0, sizeof descr);
  descr.type = CU_FILE_HANDLE_TYPE_OPAQUE_FD;
  descr.handle.fd = fd;
  descr.fs_ops = nullptr;
  CUfileHandle_t handle = nullptr;
  const CUfileError_t status = api_->handle_register(&handle, &descr);
  if (status.err != CU_FILE_SUCCESS) {
    note_status("cuFileHandleRegister", status);
    return nullptr;
  }
  return handle;
}

void CuFile::deregister_file(void* handle) {
  if (handle != nullptr) api_->handle_deregister(handle);
}

int CuFile::register_buffer(void* device_ptr, std::size_t bytes) {
  if (device_ptr == nullptr || bytes == 0) return -EINVAL;
  if (!use_device_of(device_ptr, "cuFileBufRegister")) return -EINVAL;
  const CUfileError_t status = api_->buf_register(device_ptr, bytes, 0);
  if (status.err == CU_FILE_SUCCESS) return 0;
  note_status("cuFileBufRegister", status);
  return status.err == CU_FILE_MEMORY_ALREADY_REGISTERED ? -EEXIST : -EIO;
}

void CuFile::deregister_buffer(void* device_ptr) {
  if (device_ptr == nullptr) return;
  const CUfileError_t status = api_->buf_deregister(device_ptr);
  if (status.err != CU_FILE_SUCCESS) note_status("cuFileBufDeregister", status);
}

// Both transfers loop: cuFile may move fewer bytes than asked (large requests are split at
// max_direct_io_size in compatibility mode). A read that reaches the end of the file returns
// the bytes it got; a write that makes no progress returns the bytes written so far.
// One transfer in a loop until all `bytes` moved, the file ends (0) or an error (negative),
// after the checks both directions make.
template <class Chunk>
ssize_t transfer_all(void* handle, const void* device_ptr, std::size_t bytes, off_t file_offset,
                     const char* what, Chunk chunk) {
  if (handle == nullptr || device_ptr == nullptr) return -EINVAL;
  if (bytes == 0) return 0;
  if (!use_device_of(device_ptr, what)) return -EINVAL;
  std::size_t done = 0;
  while (done < bytes) {
    const ssize_t n =
        chunk(bytes - done, file_offset + static_cast<off_t>(done), static_cast<off_t>(done));
    if (n < 0) return transfer_error(what, n);
    if (n == 0) break;
    done += static_cast<std::size_t>(n);
  }
  return static_cast<ssize_t>(done);
}

ssize_t CuFile::read(void* handle, void* device_ptr, std::size_t bytes, off_t file_offset) {
  return transfer_all(handle, device_ptr, bytes, file_offset, "cuFileRead",
                      [&](std::size_t n, off_t at, off_t buf_offset) {
                        return api_->read(handle, device_ptr, n, at, buf_offset);
                      });
}

ssize_t CuFile::write(void* handle, const void* device_ptr, std::size_t bytes, off_t file_offset) {
  return transfer_all(handle, device_ptr, bytes, file_offset, "cuFileWrite",
                      [&](std::size_t n, off_t at, off_t buf_offset) {
                        return api_->write(handle, device_ptr, n, at, buf_offset);
                      });
}

}  // namespace tidal::io::detail::cuda
