// Internal: the cuFile (GPUDirect Storage) types and function signatures tidal uses.
//
// Where NVIDIA's cufile.h exists at build time (the nvidia-cufile package; CMake then defines
// TIDAL_HAVE_CUFILE_H) it is included and nothing is declared here, so the build checks the
// signatures below against the real header. Elsewhere we declare the few types ourselves, with
// the same names, values and layouts as cufile.h (CUDA 11.4 to 13), so one binary built on a
// machine without cufile.h still calls the real libcufile correctly once it is dlopen'ed.
//
// Nothing here links against libcufile: the functions are reached only through the pointer
// types in tidal::io::detail::cuda::cufile_api, filled by dlsym (src/io/cuda/cufile.cpp).
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <type_traits>

#ifdef TIDAL_HAVE_CUFILE_H
#include <cufile.h>
#else
#include <cuda.h>  // CUresult, the CUDA driver's error enum; only the type is used, not libcuda

extern "C" {

/// cuFile status codes: 0, or 5000 + n. Only the codes tidal names are listed; any other value
/// the library returns is still representable (the enum's underlying type is int-sized).
enum CUfileOpError {
  CU_FILE_SUCCESS = 0,
  CU_FILE_DRIVER_NOT_INITIALIZED = 5001,
  CU_FILE_DRIVER_INVALID_PROPS = 5002,
  CU_FILE_DRIVER_UNSUPPORTED_LIMIT = 5003,
  CU_FILE_DRIVER_VERSION_MISMATCH = 5004,
  CU_FILE_DRIVER_VERSION_READ_ERROR = 5005,
  CU_FILE_DRIVER_CLOSING = 5006,
  CU_FILE_PLATFORM_NOT_SUPPORTED = 5007,
  CU_FILE_IO_NOT_SUPPORTED = 5008,
  CU_FILE_DEVICE_NOT_SUPPORTED = 5009,
  CU_FILE_NVFS_DRIVER_ERROR = 5010,
  CU_FILE_CUDA_DRIVER_ERROR = 5011,
  CU_FILE_CUDA_POINTER_INVALID = 5012,
  CU_FILE_CUDA_MEMORY_TYPE_INVALID = 5013,
  CU_FILE_CUDA_POINTER_RANGE_ERROR = 5014,
  CU_FILE_CUDA_CONTEXT_MISMATCH = 5015,
  CU_FILE_INVALID_MAPPING_SIZE = 5016,
  CU_FILE_INVALID_MAPPING_RANGE = 5017,
  CU_FILE_INVALID_FILE_TYPE = 5018,
  CU_FILE_INVALID_FILE_OPEN_FLAG = 5019,
  CU_FILE_DIO_NOT_SET = 5020,
  CU_FILE_INVALID_VALUE = 5022,
  CU_FILE_MEMORY_ALREADY_REGISTERED = 5023,
  CU_FILE_MEMORY_NOT_REGISTERED = 5024,
  CU_FILE_PERMISSION_DENIED = 5025,
  CU_FILE_DRIVER_ALREADY_OPEN = 5026,
  CU_FILE_HANDLE_NOT_REGISTERED = 5027,
  CU_FILE_HANDLE_ALREADY_REGISTERED = 5028,
  CU_FILE_DEVICE_NOT_FOUND = 5029,
  CU_FILE_INTERNAL_ERROR = 5030,
  CU_FILE_GETNEWFD_FAILED = 5031,
  CU_FILE_NVFS_SETUP_ERROR = 5033,
  CU_FILE_IO_DISABLED = 5034,
};

/// Returned by the driver and registration calls: a cuFile status, plus the CUDA driver's code
/// when err is CU_FILE_CUDA_DRIVER_ERROR. Passed and returned by value (8 bytes).
typedef struct CUfileError {
  CUfileOpError err;
  CUresult cu_err;
} CUfileError_t;

enum CUfileFileHandleType {
  CU_FILE_HANDLE_TYPE_OPAQUE_FD = 1,     // a Linux file descriptor: the only kind tidal uses
  CU_FILE_HANDLE_TYPE_OPAQUE_WIN32 = 2,  // unsupported by NVIDIA
  CU_FILE_HANDLE_TYPE_USERSPACE_FS = 3,
};

/// File-system operation table for user-space file systems. tidal leaves fs_ops null (the
/// kernel file system is used), so the table stays an incomplete type here.
typedef struct CUfileFSOps CUfileFSOps_t;

/// What cuFileHandleRegister registers: a descriptor of the given type.
typedef struct CUfileDescr_t {
  enum CUfileFileHandleType type;
  union {
    int fd;
    void* handle;
  } handle;
  const CUfileFSOps_t* fs_ops;
} CUfileDescr_t;

/// An opaque registered-file handle.
typedef void* CUfileHandle_t;

}  // extern "C"

// The layout the library expects on LP64 Linux: a 4-byte enum, padding, an 8-byte union and a
// pointer. A mismatch would corrupt every registration, so check it where it is declared.
static_assert(sizeof(CUfileOpError) == 4, "CUfileOpError must be int-sized");
static_assert(sizeof(CUfileError_t) == 8, "CUfileError_t layout differs from cufile.h");
static_assert(sizeof(CUfileDescr_t) == 24, "CUfileDescr_t layout differs from cufile.h");
static_assert(offsetof(CUfileDescr_t, handle) == 8, "CUfileDescr_t layout differs from cufile.h");
static_assert(offsetof(CUfileDescr_t, fs_ops) == 16, "CUfileDescr_t layout differs from cufile.h");
#endif             // TIDAL_HAVE_CUFILE_H

namespace tidal::io::detail::cuda::cufile_api {

// Signatures of the cuFile entry points tidal resolves with dlsym.
using DriverOpenFn = CUfileError_t (*)();
using DriverCloseFn = CUfileError_t (*)();  // "cuFileDriverClose_v2", else "cuFileDriverClose"
using HandleRegisterFn = CUfileError_t (*)(CUfileHandle_t* fh, CUfileDescr_t* descr);
using HandleDeregisterFn = void (*)(CUfileHandle_t fh);
using BufRegisterFn = CUfileError_t (*)(const void* buf_base, std::size_t length, int flags);
using BufDeregisterFn = CUfileError_t (*)(const void* buf_base);
/// Return bytes moved; -1 with errno set for a system error; -CUfileOpError for a cuFile error.
using ReadFn = ssize_t (*)(CUfileHandle_t fh, void* buf_base, std::size_t size, off_t file_offset,
                           off_t buf_offset);
using WriteFn = ssize_t (*)(CUfileHandle_t fh, const void* buf_base, std::size_t size,
                            off_t file_offset, off_t buf_offset);

#ifdef TIDAL_HAVE_CUFILE_H
// With the real header, prove that the signatures above are NVIDIA's. (cufile.h maps the name
// cuFileDriverClose to cuFileDriverClose_v2 with a macro in newer versions; both share a type.)
static_assert(std::is_same_v<decltype(&::cuFileDriverOpen), DriverOpenFn>);
static_assert(std::is_same_v<decltype(&::cuFileDriverClose), DriverCloseFn>);
static_assert(std::is_same_v<decltype(&::cuFileHandleRegister), HandleRegisterFn>);
static_assert(std::is_same_v<decltype(&::cuFileHandleDeregister), HandleDeregisterFn>);
static_assert(std::is_same_v<decltype(&::cuFileBufRegister), BufRegisterFn>);
static_assert(std::is_same_v<decltype(&::cuFileBufDeregister), BufDeregisterFn>);
static_assert(std::is_same_v<decltype(&::cuFileRead), ReadFn>);
static_assert(std::is_same_v<decltype(&::cuFileWrite), WriteFn>);
#endif

}  // namespace tidal::io::detail::cuda::cufile_api
