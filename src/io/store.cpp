// The tensor store: layout (striping + extents), the priority dispatcher, staging, checksums and
// error handling. Backends only move aligned blocks; everything a user can get wrong is here.
#include "tidal/io/store.hpp"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "io/checksum_pool.hpp"
#include "io/host_copy.hpp"
#include "tidal/common/aligned_buffer.hpp"
#include "tidal/common/env.hpp"
#include "tidal/common/error.hpp"
#include "tidal/common/text.hpp"
#include "tidal/common/units.hpp"
#include "tidal/io/extent_allocator.hpp"
#ifdef TIDAL_WITH_CUDA
#include "io/cuda/device.hpp"
#endif

namespace tidal::io {
namespace {

using detail::copy_in;
using detail::copy_out;
using detail::is_device_memory;

// One preallocated file in one directory.
struct StoreFile {
  std::string dir;
  int fd = -1;
  bool tmpfile = false;
  std::unique_ptr<ExtentAllocator> extents;

  StoreFile() = default;
  StoreFile(const StoreFile&) = delete;
  StoreFile& operator=(const StoreFile&) = delete;
  ~StoreFile() {
    if (fd >= 0) ::close(fd);
  }
};

std::uint64_t free_space(const std::string& dir) {
  struct statvfs st {};
  if (::statvfs(dir.c_str(), &st) != 0) return 0;
  return static_cast<std::uint64_t>(st.f_bavail) * st.f_frsize;
}

// A store directory must exist, be a directory, and be on a disk: not /proc or /sys, and not
// tmpfs or ramfs unless memory is allowed (offloading into memory saves nothing).
void check_store_dir(const std::string& dir, bool allow_memory_fs) {
  struct stat st {};
  TIDAL_EXPECT_AS(InvalidArgument, ::stat(dir.c_str(), &st) == 0, "store directory '", dir,
                  "' does not exist; create it (mkdir -p ", dir, ") or pass another directory");
  TIDAL_EXPECT_AS(InvalidArgument, S_ISDIR(st.st_mode), "store directory '", dir,
                  "' is not a directory; pass a directory on the SSD (e.g. /mnt/nvme0/tidal)");
  struct statfs fs {};
  if (::statfs(dir.c_str(), &fs) != 0) return;
  const auto type = static_cast<unsigned long>(fs.f_type);
  TIDAL_EXPECT_AS(InvalidArgument, type != PROC_SUPER_MAGIC && type != SYSFS_MAGIC,
                  "store directory '", dir,
                  "' is on a pseudo file system (/proc, /sys), not a disk; pass a directory on "
                  "the SSD");
  TIDAL_EXPECT_AS(InvalidArgument, allow_memory_fs || (type != TMPFS_MAGIC && type != RAMFS_MAGIC),
                  "store directory '", dir,
                  "' is in memory (tmpfs or ramfs): offloading there frees no memory; pass a "
                  "directory on the SSD, or set TIDAL_MEMORY_STORE=1 to try tidal without one");
}

// Each directory is one SSD to the store and the planner: the same directory twice, under any
// spelling ("d" and "d/", a symbolic link, a bind mount), would be planned as two drives' worth
// of bandwidth. Compared by device and inode, which stat() gives after resolving links.
void check_distinct_dirs(const std::vector<std::string>& dirs) {
  std::vector<std::pair<dev_t, ino_t>> ids;
  for (std::size_t i = 0; i < dirs.size(); ++i) {
    struct stat st {};
    if (::stat(dirs[i].c_str(), &st) != 0) continue;  // check_store_dir said why already
    for (std::size_t j = 0; j < ids.size(); ++j) {
      TIDAL_EXPECT_AS(InvalidArgument, ids[j] != std::make_pair(st.st_dev, st.st_ino),
                      "store directories '", dirs[j], "' and '", dirs[i],
                      "' are the same directory; each store directory is one SSD, so give each "
                      "directory once (one per SSD)");
    }
    ids.emplace_back(st.st_dev, st.st_ino);
  }
}

void open_store_file(StoreFile& f, std::uint64_t bytes, bool buffered) {
  struct stat st {};
  TIDAL_EXPECT_AS(InvalidArgument, ::stat(f.dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode),
                  "store directory '", f.dir, "' does not exist; create it (mkdir -p ", f.dir,
                  ") or pass another directory");
  const int flags = O_RDWR | O_CLOEXEC | (buffered ? 0 : O_DIRECT);
  // O_TMPFILE: no name, so the space goes back when the process ends, even on a crash.
  f.fd = ::open(f.dir.c_str(), O_TMPFILE | flags, 0600);
  f.tmpfile = f.fd >= 0;
  if (f.fd < 0) {
    std::string name = f.dir + "/.tidal-store-XXXXXX";
    f.fd = ::mkostemp(name.data(), flags & ~O_RDWR);
    if (f.fd >= 0) {
      ::unlink(name.c_str());
    } else if (errno == EINVAL && !buffered) {
      TIDAL_EXPECT_AS(InvalidArgument, false, "the filesystem of '", f.dir,
                      "' does not support O_DIRECT (tmpfs?); put the store on an SSD, or ask for "
                      "buffered I/O, which keeps the data in the page cache and frees no memory");
    } else {
      const int err = errno;
      TIDAL_FAIL_IO(err, "cannot create a store file in '", f.dir, "': ", std::strerror(err));
    }
  }
  if (::fallocate(f.fd, 0, 0, static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    if (err == EOPNOTSUPP) {
      TIDAL_SYSCALL(::ftruncate(f.fd, static_cast<off_t>(bytes)));  // sparse, but works
    } else {
      ::close(f.fd);
      f.fd = -1;
      TIDAL_FAIL_IO(err, "cannot reserve ", format_bytes(static_cast<double>(bytes)), " in '",
                    f.dir, "': ", std::strerror(err), " (",
                    format_bytes(static_cast<double>(free_space(f.dir))),
                    " free there); lower the store capacity or free disk space");
    }
  }
  f.extents = std::make_unique<ExtentAllocator>(bytes);
}

// The store's options, each from the caller, else its TIDAL_* variable, else the default; the
// checks run in this order so that a bad setup meets the same message first.
void resolve_dirs(StoreOptions& opt, const Env& env) {
  if (opt.dirs.empty() && env.dirs) {
    opt.dirs = split_list(*env.dirs);
  }
  TIDAL_EXPECT_AS(InvalidArgument, !opt.dirs.empty(),
                  "no store directory given: give one directory per SSD (e.g. /mnt/nvme0 and "
                  "/mnt/nvme1) or set TIDAL_DIRS");
  for (const auto& d : opt.dirs) {
    TIDAL_EXPECT_AS(InvalidArgument, !d.empty(),
                    "a store directory is an empty name; give one directory per SSD (e.g. "
                    "/mnt/nvme0 and /mnt/nvme1)");
  }
  if (env.memory_store) opt.allow_memory_fs = *env.memory_store;
  for (const auto& d : opt.dirs) check_store_dir(d, opt.allow_memory_fs);
  check_distinct_dirs(opt.dirs);
}

void resolve_io_sizes(StoreOptions& opt, const Env& env) {
  const bool stripe_from_env = opt.stripe_unit == 0 && env.stripe_unit;
  if (opt.stripe_unit == 0) opt.stripe_unit = env.stripe_unit.value_or(kMiB);
  TIDAL_EXPECT_AS(InvalidArgument,
                  opt.stripe_unit >= kBlockSize && opt.stripe_unit <= 256 * kMiB &&
                      (opt.stripe_unit & (opt.stripe_unit - 1)) == 0,
                  stripe_from_env ? "TIDAL_STRIPE_UNIT: " : "", "stripe unit ", opt.stripe_unit,
                  " must be a power of two from 4 KiB to 256 MiB (default 1 MiB)");
  if (opt.queue_depth == 0) opt.queue_depth = env.queue_depth.value_or(32);
  TIDAL_EXPECT_AS(InvalidArgument, opt.queue_depth > 0 && opt.queue_depth <= 4096, "queue depth ",
                  opt.queue_depth, " must be from 1 to 4096");
  if (env.checksum) opt.checksum = *env.checksum;
  const auto nfiles = static_cast<int>(opt.dirs.size());
  if (opt.threads <= 0) opt.threads = std::min(32, opt.queue_depth * nfiles);
  if (opt.staging_buffers <= 0) opt.staging_buffers = std::min(64, opt.queue_depth * nfiles);
  if (opt.checksum_threads <= 0) {
    opt.checksum_threads = std::clamp(static_cast<int>(std::thread::hardware_concurrency()), 1, 8);
  }
  TIDAL_EXPECT_AS(InvalidArgument, opt.checksum_threads <= 256, "checksum threads ",
                  opt.checksum_threads, " must be from 1 to 256 (0: one per core, at most 8)");
}

void resolve_backend_choice(StoreOptions& opt, const Env& env) {
  if (opt.backend == BackendKind::kAuto && env.io_backend) {
    if (*env.io_backend == "cufile") {
      opt.gds = GdsMode::kOn;
    } else {
      try {
        opt.backend = backend_kind_from_string(*env.io_backend);
      } catch (const InvalidArgument& e) {
        throw InvalidArgument(::tidal::detail::concat("TIDAL_IO_BACKEND='", *env.io_backend,
                                                      "' must be auto, io_uring, posix or cufile (",
                                                      e.what(), ")"));
      }
    }
  }
  if (opt.gds == GdsMode::kAuto && env.gds) {
    TIDAL_EXPECT_AS(InvalidArgument, *env.gds == "on" || *env.gds == "off" || *env.gds == "auto",
                    "TIDAL_GDS='", *env.gds, "' must be on, off or auto");
    opt.gds = *env.gds == "on" ? GdsMode::kOn : *env.gds == "off" ? GdsMode::kOff : GdsMode::kAuto;
  }
}

// Fills in the default capacity (a quarter of the first directory's free space, at most 64 GiB)
// and returns the bytes of each directory's file, whole blocks.
std::uint64_t resolve_capacity_per_file(StoreOptions& opt) {
  const auto nfiles = static_cast<int>(opt.dirs.size());
  if (opt.capacity == 0) {
    opt.capacity = std::min<std::uint64_t>(64 * kGiB, free_space(opt.dirs[0]) / 4);
  }
  const std::uint64_t per_file =
      opt.capacity / static_cast<std::uint64_t>(nfiles) / kBlockSize * kBlockSize;
  TIDAL_EXPECT_AS(InvalidArgument, per_file >= kBlockSize, "store capacity ",
                  format_bytes(static_cast<double>(opt.capacity)), " is too small for ", nfiles,
                  " director", nfiles == 1 ? "y" : "ies", "; give at least 4 KiB per directory");
  return per_file;
}

}  // namespace

// One stripe run of a tensor: `length` tensor bytes at `tensor_offset` stored at `file_offset`.
struct Piece {
  int file = 0;
  std::uint64_t file_offset = 0;
  std::uint64_t tensor_offset = 0;
  std::uint32_t length = 0;
  std::uint64_t checksum = 0;
};

struct Entry;

// One op of a request: queued in a lane, then in flight in a backend.
struct OpSlot {
  IoOp io;
  TensorStore::Impl* store = nullptr;
  Entry* entry = nullptr;
  std::uint32_t piece = 0;
  Priority priority = Priority::kOffload;
  std::uint64_t seq = 0;
  int staging = -1;
  // Parts of the op still running, guarded by mu: its I/O, and for a checksummed write the hash
  // of its source, which runs beside the I/O. A read's check runs after its I/O, as the same
  // part. The piece is done (its staging buffer free, its request one op closer) at zero.
  int parts = 0;
  bool queued = false;
  const Backend* backend = nullptr;  // where the op went (for its failure message)
};

struct Entry {
  std::uint64_t id = 0;
  std::uint64_t bytes = 0;
  std::vector<Piece> pieces;
  std::vector<std::pair<int, Extent>> extents;
  bool has_data = false;  // a write completed successfully
  bool checksummed = false;
  // The request in flight (at most one per ticket).
  bool busy = false;
  bool writing = false;
  bool device = false;
  char* user = nullptr;
  int pending = 0;
  int err = 0;
  bool corrupt = false;  // err is a checksum mismatch
  int waiters = 0;       // threads waiting for this request (completions wake only those)
  std::string err_msg;
  std::vector<OpSlot> slots;
};

struct LaneKey {
  bool operator()(const OpSlot* a, const OpSlot* b) const {
    if (a->priority != b->priority) return a->priority > b->priority;
    return a->seq < b->seq;
  }
};

struct TensorStore::Impl {
  StoreOptions opt;
  std::vector<std::unique_ptr<StoreFile>> files;
  std::unique_ptr<Backend> host_backend;
  std::unique_ptr<Backend> device_backend;  // cuFile, when in use
  // Host backends that broke while running, kept until the store closes: their threads may
  // still deliver completions.
  std::vector<std::unique_ptr<Backend>> retired_backends;
  std::vector<int> fds;
  std::string backend_name;

  // Staging pool: fixed aligned buffers of stripe_unit bytes in one arena, pinned when a GPU
  // exists.
  AlignedBuffer staging_arena;
  std::vector<unsigned char*> staging;
  std::vector<int> staging_free;
  bool staging_pinned = false;

  mutable std::mutex mu;
  std::condition_variable dispatch_cv;
  std::condition_variable done_cv;
  std::vector<std::set<OpSlot*, LaneKey>> lanes;
  std::vector<int> in_flight;
  std::unordered_map<std::uint64_t, std::unique_ptr<Entry>> entries;
  std::uint64_t next_id = 1;
  std::uint64_t next_seq = 0;
  std::uint64_t rotate = 0;
  int busy_entries = 0;
  bool closing = false;  // the destructor waits for busy_entries to reach 0
  // One thread at a time submits to the backends: the dispatcher thread, or a caller that
  // submits its own request's ops (kick).
  bool dispatching = false;
  int ops_in_flight = 0;  // over all files, for busy_seconds
  std::chrono::steady_clock::time_point busy_start;
  bool stop = false;
  StoreStats counters;
  std::atomic<std::uint64_t> checksum_ns{0};  // summed over the threads that hash
  // Hashes stripes beside the I/O (null without checksums); see checksum_pool.hpp.
  std::unique_ptr<detail::ChecksumPool> checksum_pool;
  std::thread dispatcher;

  explicit Impl(StoreOptions o);
  ~Impl();

  // The constructor's stages, after the options are resolved.
  void open_files(std::uint64_t per_file);
  std::vector<std::pair<void*, std::size_t>> make_staging();
  void open_host_backend(const std::vector<std::pair<void*, std::size_t>>& regions);
  void open_device_backend();

  Entry& find(Ticket t) const {
    auto it = entries.find(t.id);
    TIDAL_EXPECT(it != entries.end(), "ticket ", t.id, " is not in the store (freed already?)");
    return *it->second;
  }
  [[nodiscard]] bool fits_direct(const char* p, std::uint32_t len, bool device) const;
  bool layout(Entry& e);
  void release_extents(Entry& e);
  void start_request(Entry& e, char* user, bool write, Priority prio, bool device);
  void throw_pending_error(Entry& e);
  void wait_idle(std::unique_lock<std::mutex>& lock, Entry& e);
  [[nodiscard]] bool ops_queued() const;
  void dispatch_loop();
  bool collect(std::vector<OpSlot*>& batch, bool direct_only);
  void submit_batch(const std::vector<OpSlot*>& batch);
  void kick(std::unique_lock<std::mutex>& lock);
  void prepare_and_submit(OpSlot* s);
  std::unique_ptr<Backend> make_posix() const;
  void fall_back_if_broken();
  static void on_complete(IoOp* io, long result);
  // On the checksum pool: hash a write's source, check a read's data against its checksum.
  static void hash_written(void* slot);
  static void check_read(void* slot);
  // Where the op's data sits in host memory for hashing: its staging buffer, or the caller's
  // buffer; null for device memory that cuFile moves (not checksummed).
  [[nodiscard]] const char* hashed_data(const OpSlot* s) const;
  // XXH3 of a stripe, its time added to checksum_ns.
  std::uint64_t hash(const char* data, std::uint32_t length) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::uint64_t h = XXH3_64bits(data, length);
    checksum_ns.fetch_add(
        static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                       std::chrono::steady_clock::now() - t0)
                                       .count()),
        std::memory_order_relaxed);
    return h;
  }
  // With mu held: the op's I/O is over, so its queue slot is free for the next op.
  void release_queue_slot(OpSlot* s);
  // With mu held: one part of the op is over (err 0, or its failure).
  void finish_part(OpSlot* s, int err, std::string msg, bool corrupt = false);
  // Without mu: both of the above, for an op that has no part left after its I/O.
  void complete(OpSlot* s, int err, std::string msg, bool corrupt = false);
  void count_failure(const Entry& e);
};

TensorStore::Impl::Impl(StoreOptions o) : opt(std::move(o)) {
  // Read at every opening, not cached for the process: a program (or a test) that sets a
  // variable before opening a store gets what it set.
  const Env env = read_env();
  resolve_dirs(opt, env);
  resolve_io_sizes(opt, env);
  resolve_backend_choice(opt, env);
  open_files(resolve_capacity_per_file(opt));
  const auto regions = make_staging();
  open_host_backend(regions);
  open_device_backend();
  counters.backend = backend_name;
  if (opt.checksum) checksum_pool = std::make_unique<detail::ChecksumPool>(opt.checksum_threads);
  counters.checksum_threads = opt.checksum ? opt.checksum_threads : 0;
  lanes.resize(files.size());
  in_flight.assign(files.size(), 0);
  dispatcher = std::thread([this] { dispatch_loop(); });
}

void TensorStore::Impl::open_files(std::uint64_t per_file) {
  counters.tmpfile = true;
  for (const auto& d : opt.dirs) {
    auto f = std::make_unique<StoreFile>();
    f->dir = d;
    open_store_file(*f, per_file, opt.buffered);
    counters.tmpfile = counters.tmpfile && f->tmpfile;
    fds.push_back(f->fd);
    files.push_back(std::move(f));
  }
  counters.capacity = per_file * static_cast<std::uint64_t>(files.size());
  counters.buffered = opt.buffered;
}

// Staging pool: opt.staging_buffers buffers of stripe_unit bytes, pinned when a GPU exists.
// Returns their regions, for the backends to register.
//
// One arena on 2 MiB pages where the kernel gives them (transparent huge pages, asked for with
// madvise before the first touch): a direct I/O is cut into requests where its pages stop being
// physically contiguous, and a virtual disk that pays per request or per segment moves far less
// from scattered 4 KiB pages (on the CI machine, 1 MiB reads from 4 KiB pages ran at 1.4 GB/s,
// from 2 MiB pages at 3.2 GB/s). Without huge pages it works as before.
std::vector<std::pair<void*, std::size_t>> TensorStore::Impl::make_staging() {
  const std::size_t unit = opt.stripe_unit;
  const std::size_t bytes = unit * static_cast<std::size_t>(opt.staging_buffers);
  staging_arena = AlignedBuffer(bytes, kHugePage);
  ::madvise(staging_arena.data(), align_up(bytes, kHugePage), MADV_HUGEPAGE);  // advice only
  std::vector<std::pair<void*, std::size_t>> regions;
  staging.reserve(static_cast<std::size_t>(opt.staging_buffers));
  for (int i = 0; i < opt.staging_buffers; ++i) {
    staging.push_back(staging_arena.data() + static_cast<std::size_t>(i) * unit);
    staging_free.push_back(opt.staging_buffers - 1 - i);
    regions.emplace_back(staging.back(), unit);
  }
#ifdef TIDAL_WITH_CUDA
  if (detail::cuda::device_available()) {
    // All or none, so that the destructor knows what to unpin.
    staging_pinned =
        detail::pin_all(regions, &detail::cuda::pin_host_memory, &detail::cuda::unpin_host_memory);
  }
#endif
  return regions;
}

// io_uring unless POSIX was asked for; POSIX when io_uring cannot start (unless it was asked
// for by name), with the reason kept in the counters.
void TensorStore::Impl::open_host_backend(
    const std::vector<std::pair<void*, std::size_t>>& regions) {
  const auto nfiles = static_cast<int>(files.size());
  if (opt.backend != BackendKind::kPosix) {
    try {
      host_backend =
          make_uring_backend(fds, static_cast<unsigned>(opt.queue_depth * nfiles), regions);
      if (opt.faults.any()) host_backend = make_fault_backend(std::move(host_backend), opt.faults);
    } catch (const IoError& e) {
      if (opt.backend == BackendKind::kIoUring) throw;
      counters.backend_fallback.count = 1;
      counters.backend_fallback.reason = e.what();
    }
  }
  if (!host_backend) host_backend = make_posix();
  backend_name = host_backend->name();
}

// cuFile for device memory, when a GPU exists and GDS is not off; a failure is fatal only when
// GDS was asked for.
void TensorStore::Impl::open_device_backend() {
#ifdef TIDAL_WITH_CUDA
  if (opt.gds != GdsMode::kOff && detail::cuda::device_available() && !opt.buffered) {
    try {
      device_backend = make_cufile_backend(fds, opt.threads);
      backend_name += "+cufile";
    } catch (const Error&) {
      if (opt.gds == GdsMode::kOn) throw;
    }
  }
#endif
}

TensorStore::Impl::~Impl() {
  {
    std::unique_lock<std::mutex> lock(mu);
    closing = true;
    done_cv.wait(lock, [this] { return busy_entries == 0; });
    stop = true;
  }
  dispatch_cv.notify_all();
  dispatcher.join();
  checksum_pool.reset();  // idle: every request is over, so every hash part is
  host_backend.reset();
  retired_backends.clear();
  device_backend.reset();
#ifdef TIDAL_WITH_CUDA
  if (staging_pinned) {
    for (unsigned char* b : staging) detail::cuda::unpin_host_memory(b);
  }
#endif
}

std::unique_ptr<Backend> TensorStore::Impl::make_posix() const {
  auto b = make_posix_backend(fds, opt.threads);
  if (opt.faults.any()) b = make_fault_backend(std::move(b), opt.faults);
  return b;
}

// On the dispatcher thread: when the io_uring ring broke (its failed ops have been reported),
// later ops go to the POSIX backend, unless io_uring was asked for by name.
void TensorStore::Impl::fall_back_if_broken() {
  std::string why = host_backend->broken_reason();
  if (why.empty() || opt.backend == BackendKind::kIoUring) return;
  auto posix = make_posix();
  std::lock_guard<std::mutex> lock(mu);
  retired_backends.push_back(std::move(host_backend));
  host_backend = std::move(posix);
  backend_name = host_backend->name();
  if (device_backend) backend_name += "+cufile";
  counters.backend = backend_name;
  ++counters.backend_fallback.count;
  if (counters.backend_fallback.reason.empty()) {
    counters.backend_fallback.reason =
        ::tidal::detail::concat(why, "; moved to the posix backend while running");
  }
}

bool TensorStore::Impl::fits_direct(const char* p, std::uint32_t len, bool device) const {
  if (device) return device_backend != nullptr;  // cuFile moves device memory itself
  if (opt.buffered) return true;
  return reinterpret_cast<std::uintptr_t>(p) % kBlockSize == 0 && len % kBlockSize == 0;
}

// Places e.bytes over the files: stripe i on file (start + i) % F, one contiguous extent per
// file when possible, else one extent per stripe on any file with room.
bool TensorStore::Impl::layout(Entry& e) {
  const std::uint64_t unit = opt.stripe_unit;
  const std::uint64_t nstripes = (e.bytes + unit - 1) / unit;
  const std::size_t nfiles = files.size();
  // Continue the round robin where the previous tensor stopped, as RAID-0 does, so stripes
  // spread evenly however tensor sizes fall.
  const std::size_t start = rotate % nfiles;
  rotate += nstripes;
  auto stripe_len = [&](std::uint64_t i) {
    return static_cast<std::uint32_t>(std::min(unit, e.bytes - i * unit));
  };
  std::vector<std::uint64_t> need(nfiles, 0);
  for (std::uint64_t i = 0; i < nstripes; ++i) {
    need[(start + i) % nfiles] += align_up(stripe_len(i), kBlockSize);
  }
  std::vector<Extent> run(nfiles);
  bool ok = true;
  for (std::size_t f = 0; f < nfiles && ok; ++f) {
    if (need[f] == 0) continue;
    auto x = files[f]->extents->allocate(need[f]);
    if (x) {
      run[f] = *x;
      e.extents.emplace_back(static_cast<int>(f), *x);
    } else {
      ok = false;
    }
  }
  e.pieces.clear();
  if (ok) {
    std::vector<std::uint64_t> cursor(nfiles, 0);
    for (std::uint64_t i = 0; i < nstripes; ++i) {
      const std::size_t f = (start + i) % nfiles;
      const std::uint32_t len = stripe_len(i);
      e.pieces.push_back(Piece{static_cast<int>(f), run[f].offset + cursor[f], i * unit, len, 0});
      cursor[f] += align_up(len, kBlockSize);
    }
    return true;
  }
  release_extents(e);
  // Fragmented: one extent per stripe, preferring the round-robin file.
  for (std::uint64_t i = 0; i < nstripes; ++i) {
    const std::uint32_t len = stripe_len(i);
    std::optional<Extent> x;
    std::size_t f = (start + i) % nfiles;
    for (std::size_t k = 0; k < nfiles && !x; ++k) {
      f = (start + i + k) % nfiles;
      x = files[f]->extents->allocate(len);
    }
    if (!x) {
      release_extents(e);
      e.pieces.clear();
      return false;
    }
    e.extents.emplace_back(static_cast<int>(f), *x);
    e.pieces.push_back(Piece{static_cast<int>(f), x->offset, i * unit, len, 0});
  }
  return true;
}

void TensorStore::Impl::release_extents(Entry& e) {
  for (const auto& [f, x] : e.extents) files[static_cast<std::size_t>(f)]->extents->free(x);
  e.extents.clear();
}

// Called with mu held: builds one op per piece and queues them.
void TensorStore::Impl::start_request(Entry& e, char* user, bool write, Priority prio,
                                      bool device) {
  e.busy = true;
  ++busy_entries;
  e.writing = write;
  e.device = device;
  e.user = user;
  e.err = 0;
  e.err_msg.clear();
  e.pending = static_cast<int>(e.pieces.size());
  e.slots.assign(e.pieces.size(), OpSlot{});
  for (std::size_t i = 0; i < e.pieces.size(); ++i) {
    OpSlot& s = e.slots[i];
    const Piece& p = e.pieces[i];
    s.store = this;
    s.entry = &e;
    s.piece = static_cast<std::uint32_t>(i);
    s.priority = prio;
    s.seq = next_seq++;
    s.queued = true;
    s.io.file = p.file;
    s.io.offset = p.file_offset;
    s.io.write = write;
    s.io.on_complete = &Impl::on_complete;
    s.io.context = &s;
    lanes[static_cast<std::size_t>(p.file)].insert(&s);
  }
  if (e.pieces.empty()) {  // zero bytes: complete at once
    e.busy = false;
    --busy_entries;
    if (write) e.has_data = true;
    done_cv.notify_all();
  }
}

// With mu held: moves the ops that may start now (a free slot in their file's queue, and a
// staging buffer where they need one) from the lanes into batch, highest priority first. With
// direct_only, a lane stops at an op that needs staging (its copy is the dispatcher thread's
// job); returns true when that happened.
bool TensorStore::Impl::collect(std::vector<OpSlot*>& batch, bool direct_only) {
  bool left_staged = false;
  for (std::size_t f = 0; f < lanes.size(); ++f) {
    auto& lane = lanes[f];
    while (in_flight[f] < opt.queue_depth && !lane.empty()) {
      OpSlot* s = *lane.begin();
      const Piece& p = s->entry->pieces[s->piece];
      if (!fits_direct(s->entry->user + p.tensor_offset, p.length, s->entry->device)) {
        if (direct_only) {
          left_staged = true;
          break;
        }
        if (staging_free.empty()) break;  // wait for a completion to return a buffer
        s->staging = staging_free.back();
        staging_free.pop_back();
        ++counters.staged_ops;
      }
      lane.erase(lane.begin());
      s->queued = false;
      ++in_flight[f];
      if (ops_in_flight++ == 0) busy_start = std::chrono::steady_clock::now();
      batch.push_back(s);
    }
  }
  return left_staged;
}

// Without mu, by the one thread that holds the dispatching role: hands batch to the backends.
void TensorStore::Impl::submit_batch(const std::vector<OpSlot*>& batch) {
  fall_back_if_broken();
  bool device_ops = false;
  for (OpSlot* s : batch) {
    device_ops = device_ops || (s->entry->device && s->staging < 0);
    prepare_and_submit(s);
  }
  host_backend->flush();
  if (device_ops) device_backend->flush();
}

// With mu held (through lock), on the thread that just queued a request: submits the ops that
// need no staging copy right here, which saves waking the dispatcher thread for each request
// (on a machine with few cores that hand-off costs bandwidth). Ops that need a staging copy are
// left to the dispatcher thread, so that the caller never copies.
void TensorStore::Impl::kick(std::unique_lock<std::mutex>& lock) {
  if (dispatching) {  // the holder of the role collects again before it lets go
    dispatch_cv.notify_one();
    return;
  }
  std::vector<OpSlot*> batch;
  bool left_staged = false;
  for (;;) {
    batch.clear();
    left_staged = collect(batch, true);
    if (batch.empty()) break;
    dispatching = true;
    lock.unlock();
    submit_batch(batch);
    lock.lock();
    dispatching = false;
  }
  if (left_staged) dispatch_cv.notify_one();
}

void TensorStore::Impl::dispatch_loop() {
  std::vector<OpSlot*> batch;
  std::unique_lock<std::mutex> lock(mu);
  while (!stop) {
    batch.clear();
    if (!dispatching) collect(batch, false);
    if (batch.empty()) {
      dispatch_cv.wait(lock);
      continue;
    }
    dispatching = true;
    lock.unlock();
    submit_batch(batch);
    lock.lock();
    dispatching = false;
  }
}

// Runs on the dispatcher thread without the lock: the op's entry is busy, so nobody else
// touches it. Kept light (no hashing) so that dispatching never waits on the CPU: a checksummed
// write's source is hashed on the checksum pool while the backend writes it.
void TensorStore::Impl::prepare_and_submit(OpSlot* s) {
  Entry& e = *s->entry;
  Piece& p = e.pieces[s->piece];
  char* user = e.user + p.tensor_offset;
  const bool staged = s->staging >= 0;
  if (staged) {
    char* buf = reinterpret_cast<char*>(staging[static_cast<std::size_t>(s->staging)]);
    s->io.buffer = buf;
    s->io.length =
        static_cast<std::uint32_t>(opt.buffered ? p.length : align_up(p.length, kBlockSize));
    s->io.fixed_buffer = s->staging;
    if (e.writing) {
      if (copy_out(buf, user, p.length, e.device) != 0) {
        s->parts = 1;
        complete(s, EIO, "copying device memory to the staging buffer failed");
        return;
      }
      std::memset(buf + p.length, 0, s->io.length - p.length);
    }
  } else {
    s->io.buffer = user;
    s->io.length = p.length;
    s->io.fixed_buffer = -1;
  }
  const bool hash_beside = e.writing && e.checksummed && hashed_data(s) != nullptr;
  s->parts = hash_beside ? 2 : 1;
  Backend& b = e.device && !staged ? *device_backend : *host_backend;
  s->backend = &b;
  b.submit(&s->io);
  // The source may not change until the request completes, so the hash sees what is written.
  if (hash_beside) checksum_pool->submit(&Impl::hash_written, s);
}

const char* TensorStore::Impl::hashed_data(const OpSlot* s) const {
  const Entry& e = *s->entry;
  if (s->staging >= 0) return static_cast<const char*>(s->io.buffer);
  return e.device ? nullptr : e.user + e.pieces[s->piece].tensor_offset;
}

void TensorStore::Impl::hash_written(void* slot) {
  auto* s = static_cast<OpSlot*>(slot);
  Impl* self = s->store;
  Piece& p = s->entry->pieces[s->piece];
  p.checksum = self->hash(self->hashed_data(s), p.length);
  std::lock_guard<std::mutex> lock(self->mu);
  self->finish_part(s, 0, {});
}

void TensorStore::Impl::check_read(void* slot) {
  auto* s = static_cast<OpSlot*>(slot);
  Impl* self = s->store;
  Entry& e = *s->entry;
  const Piece& p = e.pieces[s->piece];
  std::string msg;
  int err = 0;
  bool corrupt = false;
  if (self->hash(self->hashed_data(s), p.length) != p.checksum) {
    err = EIO;
    corrupt = true;
    msg = ::tidal::detail::concat("checksum mismatch in the stripe at tensor byte ",
                                  p.tensor_offset, " (file offset ", p.file_offset, " in '",
                                  self->files[static_cast<std::size_t>(p.file)]->dir,
                                  "'): the data read back is corrupt, so it was not used");
  } else if (s->staging >= 0 &&
             copy_in(e.user + p.tensor_offset, s->io.buffer, p.length, e.device) != 0) {
    err = EIO;
    msg = "copying the staging buffer to device memory failed";
  }
  std::lock_guard<std::mutex> lock(self->mu);
  self->finish_part(s, err, std::move(msg), corrupt);
}

// On a backend's completion thread: frees the op's queue slot at once and hands a read's check
// to the checksum pool, so that the next ops start while this one is verified.
void TensorStore::Impl::on_complete(IoOp* io, long result) {
  auto* s = static_cast<OpSlot*>(io->context);
  Impl* self = s->store;
  Entry& e = *s->entry;
  Piece& p = e.pieces[s->piece];
  const char* what = e.writing ? "write" : "read";
  const std::uint32_t want = s->io.length;
  std::string msg;
  int err = 0;
  if (result < 0) {
    err = static_cast<int>(-result);
    msg = ::tidal::detail::concat(what, " of ", want, " bytes at offset ", p.file_offset, " in '",
                                  self->files[static_cast<std::size_t>(p.file)]->dir,
                                  "' failed: ", std::strerror(err));
    const std::string broken = s->backend != nullptr ? s->backend->broken_reason() : "";
    if (!broken.empty()) {
      msg += ::tidal::detail::concat(
          " (the ", s->backend->name(), " backend stopped working: ", broken,
          self->opt.backend == BackendKind::kIoUring ? "; open the store with the posix backend)"
                                                     : "; later requests use the posix backend)");
    }
  } else if (static_cast<std::uint64_t>(result) < want) {
    err = EIO;
    msg = ::tidal::detail::concat("short ", what, ": ", result, " of ", want, " bytes at offset ",
                                  p.file_offset, " in '",
                                  self->files[static_cast<std::size_t>(p.file)]->dir, "'");
  } else if (!e.writing) {
    if (e.checksummed && self->hashed_data(s) != nullptr) {
      {
        std::lock_guard<std::mutex> lock(self->mu);
        self->release_queue_slot(s);
      }
      // The op's read part goes on: check_read finishes it.
      self->checksum_pool->submit(&Impl::check_read, s);
      return;
    }
    if (s->staging >= 0 &&
        copy_in(e.user + p.tensor_offset, s->io.buffer, p.length, e.device) != 0) {
      err = EIO;
      msg = "copying the staging buffer to device memory failed";
    }
  }
  self->complete(s, err, std::move(msg));
}

void TensorStore::Impl::complete(OpSlot* s, int err, std::string msg, bool corrupt) {
  std::lock_guard<std::mutex> lock(mu);
  release_queue_slot(s);
  finish_part(s, err, std::move(msg), corrupt);
}

void TensorStore::Impl::release_queue_slot(OpSlot* s) {
  --in_flight[static_cast<std::size_t>(s->entry->pieces[s->piece].file)];
  if (--ops_in_flight == 0) {
    counters.busy_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - busy_start).count();
  }
  // The op's queue slot is free: wake the dispatcher only if an op waits for it (an op that
  // waits for a staging buffer is woken when the buffer comes back, in finish_part).
  if (ops_queued()) dispatch_cv.notify_one();
}

void TensorStore::Impl::finish_part(OpSlot* s, int err, std::string msg, bool corrupt) {
  Entry& e = *s->entry;
  if (err != 0 && e.err == 0) {
    e.err = err;
    e.corrupt = corrupt;
    e.err_msg = std::move(msg);
  }
  if (--s->parts > 0) return;
  if (s->staging >= 0) {
    staging_free.push_back(s->staging);
    s->staging = -1;
    if (ops_queued()) dispatch_cv.notify_one();
  }
  if (--e.pending == 0) {
    if (e.err != 0) {
      count_failure(e);
    } else if (e.writing) {
      ++counters.writes;
      counters.bytes_written += e.bytes;
    } else {
      ++counters.reads;
      counters.bytes_read += e.bytes;
    }
    if (e.writing) e.has_data = e.err == 0;
    e.busy = false;
    --busy_entries;
    // Wake only threads that wait for this request (or for the store to go idle): with many
    // requests in flight, waking every waiter on every completion costs context switches that
    // a two-core machine pays for in bandwidth.
    if (e.waiters > 0 || closing) done_cv.notify_all();
  }
}

bool TensorStore::Impl::ops_queued() const {
  return std::any_of(lanes.begin(), lanes.end(), [](const auto& lane) { return !lane.empty(); });
}

// With mu held (through lock): waits until e has no request in flight.
void TensorStore::Impl::wait_idle(std::unique_lock<std::mutex>& lock, Entry& e) {
  if (!e.busy) return;
  ++e.waiters;
  done_cv.wait(lock, [&] { return !e.busy; });
  --e.waiters;
}

namespace {
std::string request_error(const Entry& e) {
  return ::tidal::detail::concat("tensor store ", e.writing ? "write" : "read", " of ",
                                 format_bytes(static_cast<double>(e.bytes)), " (ticket ", e.id,
                                 ") failed: ", e.err_msg);
}
}  // namespace

// With mu held: counts a failed request under its degraded path.
void TensorStore::Impl::count_failure(const Entry& e) {
  ++counters.failed_requests;
  DegradedPath& path = e.writing ? (e.err == ENOSPC ? counters.store_full : counters.write_failed)
                                 : (e.corrupt ? counters.read_corrupt : counters.read_failed);
  if (path.count++ == 0) path.reason = request_error(e);
}

// With mu held: reports (once) the error of the finished request.
void TensorStore::Impl::throw_pending_error(Entry& e) {
  if (e.err == 0) return;
  const int err = e.err;
  std::string msg = request_error(e);
  e.err = 0;
  e.err_msg.clear();
  throw IoError(msg, err);
}

TensorStore::TensorStore(StoreOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}

TensorStore::~TensorStore() = default;

Ticket TensorStore::write(const void* src, std::uint64_t bytes, Priority priority) {
  TIDAL_EXPECT(src != nullptr || bytes == 0, "TensorStore::write: null source buffer");
  const bool device = bytes > 0 && is_device_memory(src);
  std::unique_lock<std::mutex> lock(impl_->mu);
  auto entry = std::make_unique<Entry>();
  Entry& e = *entry;
  e.id = impl_->next_id++;
  e.bytes = bytes;
  e.checksummed = impl_->opt.checksum && (!device || impl_->device_backend == nullptr);
  impl_->entries.emplace(e.id, std::move(entry));
  if (bytes > 0 && !impl_->layout(e)) {
    std::uint64_t free = 0;
    std::uint64_t largest = 0;
    for (const auto& f : impl_->files) {
      free += f->extents->free_bytes();
      largest = std::max(largest, f->extents->largest_free());
    }
    e.err = ENOSPC;
    e.err_msg = ::tidal::detail::concat(
        "the store is full: the tensor needs ", format_bytes(static_cast<double>(bytes)),
        " but only ", format_bytes(static_cast<double>(free)), " of ",
        format_bytes(static_cast<double>(impl_->counters.capacity)),
        " is free (largest free extent ", format_bytes(static_cast<double>(largest)),
        "); free tickets or open the store with a larger capacity");
    e.writing = true;
    impl_->count_failure(e);
    return Ticket{e.id};
  }
  impl_->start_request(e, static_cast<char*>(const_cast<void*>(src)), true, priority, device);
  const Ticket t{e.id};
  impl_->kick(lock);  // e may be gone after this (a failed op completes, another thread frees)
  return t;
}

void TensorStore::read(Ticket ticket, void* dst, Priority priority) {
  std::unique_lock<std::mutex> lock(impl_->mu);
  Entry& e = impl_->find(ticket);
  TIDAL_EXPECT(dst != nullptr || e.bytes == 0, "TensorStore::read: null destination buffer");
  impl_->wait_idle(lock, e);
  impl_->throw_pending_error(e);
  TIDAL_EXPECT(e.has_data, "ticket ", ticket.id,
               " holds no data: its write failed, so there is nothing to read back");
  const bool device = e.bytes > 0 && is_device_memory(dst);
  impl_->start_request(e, static_cast<char*>(dst), false, priority, device);
  impl_->kick(lock);
}

bool TensorStore::ready(Ticket ticket) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return !impl_->find(ticket).busy;
}

void TensorStore::wait(Ticket ticket) {
  std::unique_lock<std::mutex> lock(impl_->mu);
  Entry& e = impl_->find(ticket);
  impl_->wait_idle(lock, e);
  impl_->throw_pending_error(e);
}

void TensorStore::prioritize(Ticket ticket, Priority priority) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Entry& e = impl_->find(ticket);
  if (!e.busy) return;
  for (OpSlot& s : e.slots) {
    if (!s.queued || s.priority >= priority) continue;
    auto& lane = impl_->lanes[static_cast<std::size_t>(e.pieces[s.piece].file)];
    lane.erase(&s);
    s.priority = priority;
    lane.insert(&s);
  }
  impl_->dispatch_cv.notify_one();
}

void TensorStore::free(Ticket ticket) {
  std::unique_lock<std::mutex> lock(impl_->mu);
  Entry& e = impl_->find(ticket);
  impl_->wait_idle(lock, e);
  impl_->release_extents(e);
  impl_->entries.erase(ticket.id);
}

bool TensorStore::cancel_write(Ticket ticket) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Entry& e = impl_->find(ticket);
  if (!e.busy || !e.writing) return false;
  for (const OpSlot& s : e.slots) {
    if (!s.queued) return false;
  }
  for (OpSlot& s : e.slots) {
    impl_->lanes[static_cast<std::size_t>(e.pieces[s.piece].file)].erase(&s);
  }
  e.busy = false;
  --impl_->busy_entries;
  impl_->release_extents(e);
  impl_->entries.erase(ticket.id);
  impl_->done_cv.notify_all();
  return true;
}

std::uint64_t TensorStore::size(Ticket ticket) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->find(ticket).bytes;
}

StoreStats TensorStore::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  StoreStats s = impl_->counters;
  if (impl_->ops_in_flight > 0) {
    s.busy_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - impl_->busy_start).count();
  }
  s.used_bytes = 0;
  for (const auto& f : impl_->files) {
    s.file_used_bytes.push_back(f->extents->used_bytes());
    s.used_bytes += f->extents->used_bytes();
  }
  s.tickets = impl_->entries.size();
  s.checksum_seconds = static_cast<double>(impl_->checksum_ns.load()) * 1e-9;
  return s;
}

const StoreOptions& TensorStore::options() const { return impl_->opt; }

std::uint64_t TensorStore::free_bytes() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::uint64_t n = 0;
  for (const auto& f : impl_->files) n += f->extents->free_bytes();
  return n;
}

}  // namespace tidal::io
