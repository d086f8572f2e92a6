// The SSD tensor store: tensors' bytes in preallocated O_DIRECT files, one per directory (one
// directory per SSD), striped round-robin like a software RAID-0, moved asynchronously.
//
// Usage:
//   tidal::io::StoreOptions opt;
//   opt.dirs = {"/mnt/nvme0", "/mnt/nvme1"};
//   opt.capacity = 64 * tidal::kGiB;
//   tidal::io::TensorStore store(opt);
//   auto t = store.write(ptr, bytes);        // async; ptr must stay valid until wait(t)
//   store.wait(t);                           // throws tidal::IoError if the write failed
//   store.read(t, dst, Priority::kUrgent);   // async
//   store.wait(t);
//   store.free(t);
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tidal/io/backend.hpp"
#include "tidal/io/tier.hpp"

namespace tidal::io {

/// How device (GPU) memory reaches the files: through cuFile (GPUDirect Storage, or its
/// compatibility mode), or through the pinned staging pool and the host backend.
/// kAuto uses cuFile when libcufile loads; TIDAL_GDS=on|off|auto overrides kAuto.
enum class GdsMode : std::uint8_t { kAuto, kOn, kOff };

struct StoreOptions {
  /// One directory per SSD. Each gets one preallocated file of capacity / dirs.size() bytes.
  /// Empty: TIDAL_DIRS, else an error. Each must be a distinct directory (compared by device and
  /// inode, so "d", "d/" and a link to d are the same one): the same one twice is an error.
  std::vector<std::string> dirs;
  /// Total bytes over all files. 0: 25% of the free space of the first directory, at most 64 GiB.
  std::uint64_t capacity = 0;
  /// Bytes of a tensor placed on one file before moving to the next (a power of two, >= 4 KiB).
  /// 0: TIDAL_STRIPE_UNIT, else 1 MiB.
  std::uint64_t stripe_unit = 0;
  BackendKind backend = BackendKind::kAuto;
  GdsMode gds = GdsMode::kAuto;
  /// Ops in flight per file. 0: TIDAL_QUEUE_DEPTH, else 32.
  int queue_depth = 0;
  /// Threads of the POSIX and cuFile backends. 0: queue_depth x files, at most 32.
  int threads = 0;
  /// Pinned, aligned staging buffers (stripe_unit bytes each) for unaligned host buffers and
  /// device memory without cuFile. 0: 2 x queue_depth x files, at most 256.
  int staging_buffers = 0;
  /// Per-stripe xxHash3 of the data, checked on read: a corrupt read fails its request instead
  /// of returning wrong bytes. Costs one pass over the data each way, on checksum threads beside
  /// the I/O: a write's stripes are hashed while they are written, a read's stripes checked while
  /// later ones are read. TIDAL_CHECKSUM overrides.
  bool checksum = true;
  /// Threads that hash (with checksums on). 0: one per core, at most 8. One core hashes about
  /// 18 GB/s of freshly transferred data on the CI machine (docs/io.md), so few are needed.
  int checksum_threads = 0;
  /// Page-cache I/O instead of O_DIRECT. Only for filesystems without O_DIRECT (tmpfs before
  /// Linux 6.6); the data then sits in host memory, so it frees no memory. Reported in stats().
  bool buffered = false;
  /// A directory on tmpfs or ramfs keeps the "offloaded" bytes in host memory, which frees
  /// nothing (and takes the memory the budget was meant to save): refused unless this is set
  /// (or TIDAL_MEMORY_STORE=1), for trying tidal where no disk is at hand.
  bool allow_memory_fs = false;
  /// Test hook: deterministic faults injected between the store and its backend.
  FaultPlan faults;
};

/// One way the store can run degraded: how often it happened since the store opened, and the
/// first occurrence's message (the root cause, usually), empty while count is 0.
struct DegradedPath {
  std::uint64_t count = 0;
  std::string reason;
};

/// Counters since the store was opened.
struct StoreStats {
  std::uint64_t capacity = 0;
  std::uint64_t used_bytes = 0;  ///< allocated extents (padded to 4 KiB per stripe run)
  std::vector<std::uint64_t> file_used_bytes;  ///< used_bytes of each file, in dirs order
  std::uint64_t bytes_written = 0;             ///< tensor bytes of completed writes
  std::uint64_t bytes_read = 0;                ///< tensor bytes of completed reads
  std::uint64_t writes = 0;                    ///< completed write requests
  std::uint64_t reads = 0;                     ///< completed read requests
  /// Requests that failed, all causes: store_full + write_failed + read_failed + read_corrupt.
  std::uint64_t failed_requests = 0;
  /// Writes refused because the store had no room (the capacity is taken: refused when
  /// write() is called, before any I/O), or failed by the disk with ENOSPC.
  DegradedPath store_full;
  /// Writes that failed otherwise: an I/O error (EIO, ...) or a short write.
  DegradedPath write_failed;
  /// Reads that failed with an I/O error or came back short (the data on disk is kept).
  DegradedPath read_failed;
  /// Reads whose data failed its checksum (corrupt: not handed to the caller).
  DegradedPath read_corrupt;
  /// The host I/O backend in use is not the one asked for: io_uring was unavailable when the
  /// store opened, or its ring broke while running, and the POSIX backend took over (count is
  /// 0 or 1). reason says why, e.g. "io_uring_queue_init failed: Operation not permitted".
  DegradedPath backend_fallback;
  std::uint64_t staged_ops = 0;  ///< ops that went through the staging pool
  double busy_seconds = 0;       ///< time with at least one op in flight (device busy)
  /// Thread time spent computing and checking checksums (summed over the threads doing it;
  /// they run beside the I/O, so this is CPU cost, not necessarily added latency).
  double checksum_seconds = 0;
  int checksum_threads = 0;   ///< threads hashing beside the I/O (0: checksums off)
  std::uint64_t tickets = 0;  ///< tickets alive
  std::string backend;        ///< in use now, e.g. "io_uring", "posix", "+cufile"
  bool buffered = false;
  bool tmpfile = false;  ///< every file is an O_TMPFILE (no name in the directory)
};

/// The store. All member functions are thread-safe. Buffers passed to write() and read() are
/// borrowed: they must stay valid and untouched until the request completes (wait() returned
/// or ready() said true). Destroying the store waits for requests in flight, then closes and
/// deletes its files.
class TensorStore final : public Tier {
 public:
  /// Opens (creates and preallocates) the store files. The TIDAL_* variables (common/env.hpp)
  /// are read now, each time a store opens. Throws tidal::InvalidArgument for bad options or
  /// variables (naming the variable) and tidal::IoError when a directory is unusable, saying
  /// which and what to do.
  explicit TensorStore(StoreOptions options);
  ~TensorStore() override;
  TensorStore(const TensorStore&) = delete;
  TensorStore& operator=(const TensorStore&) = delete;

  /// Starts writing bytes from src (host or device memory). Never blocks on I/O. When the store
  /// has no room, the returned ticket is already failed with ENOSPC (wait() throws), and the
  /// store stays usable. bytes == 0 gives a ticket that is complete at once.
  Ticket write(const void* src, std::uint64_t bytes,
               Priority priority = Priority::kOffload) override;

  /// Starts reading the ticket's bytes into dst (size(ticket) bytes, host or device memory).
  /// If a request on this ticket is still in flight, first waits for it (throwing if it failed).
  /// Throws tidal::Error for an unknown ticket or one whose write failed.
  void read(Ticket ticket, void* dst, Priority priority = Priority::kPrefetch) override;

  /// True when no request of this ticket is in flight.
  [[nodiscard]] bool ready(Ticket ticket) const override;

  /// Waits for the ticket's request in flight. Throws tidal::IoError (with the errno of the first
  /// failed op and a message saying what failed) if it failed; a failure is reported once.
  void wait(Ticket ticket) override;

  /// Raises the priority of the ticket's ops that have not started yet (e.g. to kUrgent when the
  /// computation is about to need the tensor). Lowering is ignored.
  void prioritize(Ticket ticket, Priority priority) override;

  /// Waits for the ticket's request, then releases its space. Errors of that request are not
  /// reported (the data is being discarded). Unknown tickets throw tidal::Error.
  void free(Ticket ticket) override;

  /// Drops a write whose ops are all still queued (Tier::cancel_write).
  bool cancel_write(Ticket ticket) override;

  [[nodiscard]] std::uint64_t size(Ticket ticket) const;
  [[nodiscard]] StoreStats stats() const;
  [[nodiscard]] const StoreOptions& options() const;
  /// Free bytes, and the largest tensor that fits now (fragmentation), over all files.
  [[nodiscard]] std::uint64_t free_bytes() const override;

  struct Impl;  ///< opaque

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace tidal::io
