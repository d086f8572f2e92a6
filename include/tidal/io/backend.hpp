// I/O backends of the tensor store: the engines that move aligned blocks between memory and the
// store files. The TensorStore owns one backend (plus a cuFile one for device memory when GDS is
// in use) and drives it from a single dispatcher thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace tidal::io {

/// Which engine moves host memory. kAuto picks io_uring when it works on this kernel, else the
/// POSIX thread pool; TIDAL_IO_BACKEND overrides kAuto (never an explicit choice).
enum class BackendKind : std::uint8_t { kAuto, kIoUring, kPosix };

const char* to_string(BackendKind kind);
/// Parses "auto", "io_uring" (or "uring"), "posix". Throws tidal::InvalidArgument otherwise.
BackendKind backend_kind_from_string(const std::string& name);

/// One contiguous transfer between a buffer and a store file. Offsets, lengths and (except for
/// device buffers on the cuFile backend) buffer addresses are multiples of kBlockSize.
struct IoOp {
  int file = 0;              ///< index of the store file (the fd passed at construction)
  std::uint64_t offset = 0;  ///< byte offset in the file
  std::uint32_t length = 0;  ///< bytes to move
  void* buffer = nullptr;    ///< source (write) or destination (read)
  bool write = false;
  int fixed_buffer = -1;  ///< io_uring registered-buffer index, or -1
  /// Called exactly once, from a backend thread, with the bytes moved or -errno.
  /// A backend never retries: short transfers are reported as they are.
  void (*on_complete)(IoOp* op, long result) = nullptr;
  void* context = nullptr;  ///< owner's data for on_complete
};

/// Asynchronous engine. submit() is called by one thread only (the store's dispatcher); the
/// completion callbacks run on backend threads and must not call submit().
class Backend {
 public:
  virtual ~Backend() = default;
  [[nodiscard]] virtual const char* name() const = 0;
  /// Queues op; it may not start before flush().
  virtual void submit(IoOp* op) = 0;
  /// Starts every queued op.
  virtual void flush() {}
  /// Why this backend stopped working (e.g. "io_uring_submit failed: Bad file descriptor"), or
  /// empty while it works. A broken backend has failed the ops it could not complete with the
  /// kernel's error and fails every later op at once; the store then moves to another backend.
  /// Thread-safe.
  [[nodiscard]] virtual std::string broken_reason() const { return {}; }
};

/// POSIX thread pool: `threads` threads doing pread/pwrite (always available).
std::unique_ptr<Backend> make_posix_backend(std::vector<int> fds, int threads);

/// io_uring with registered files and, when given, registered buffers (the staging pool);
/// `entries` bounds the ops in flight. Throws tidal::IoError when io_uring is unavailable
/// (old kernel, disabled by sysctl or seccomp) so that kAuto can fall back.
std::unique_ptr<Backend> make_uring_backend(
    std::vector<int> fds, unsigned entries,
    const std::vector<std::pair<void*, std::size_t>>& buffers);
/// True when this build has the io_uring backend.
bool uring_compiled();

/// cuFile (GDS) for device buffers: `threads` threads calling cuFileRead/cuFileWrite.
/// Throws tidal::Error saying why when cuFile is not available.
std::unique_ptr<Backend> make_cufile_backend(const std::vector<int>& fds, int threads);

/// Deterministic faults for tests: each counter is 1-based over the ops that reach the backend
/// (0 = never). The matching op fails, comes back short, or (reads only) comes back with one
/// byte flipped after a successful transfer.
struct FaultPlan {
  std::uint64_t fail_op = 0;       ///< fail the k-th op with fail_errno
  int fail_errno = 5;              ///< EIO by default; ENOSPC (28) to mimic a full disk
  bool fail_every_after = false;   ///< fail op k and every op after it (a dying disk)
  bool only_writes = false;        ///< count and fail writes only (reads pass untouched)
  bool only_reads = false;         ///< count and fail reads only (writes pass untouched)
  std::uint64_t short_op = 0;      ///< report the k-th op as short by 512 bytes
  std::uint64_t corrupt_read = 0;  ///< flip a byte of the k-th read after it completes
  /// Which byte of that read to flip (from the start of the op; past its end: the middle).
  std::uint64_t corrupt_byte = ~std::uint64_t{0};
  unsigned char corrupt_xor = 0x5a;  ///< what the byte is XORed with (one bit: a bit flip)
  unsigned delay_us = 0;             ///< hold every completion this long (a slow disk)
  [[nodiscard]] bool any() const {
    return fail_op != 0 || short_op != 0 || corrupt_read != 0 || delay_us != 0;
  }
};

/// Wraps a backend with the faults of plan.
std::unique_ptr<Backend> make_fault_backend(std::unique_ptr<Backend> inner, FaultPlan plan);

}  // namespace tidal::io
