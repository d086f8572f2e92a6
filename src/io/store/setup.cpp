// The store's setup: its options resolved (from the caller, the TIDAL_* variables, the defaults)
// and checked, its files opened and preallocated, the staging pool and the backends started; and
// the fall-back to the POSIX backend when io_uring breaks while running.
#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "io/host_copy.hpp"
#include "io/store/store_impl.hpp"
#include "tidal/common/env.hpp"
#include "tidal/common/error.hpp"
#include "tidal/common/text.hpp"
#include "tidal/common/units.hpp"
#ifdef TIDAL_WITH_CUDA
#include "io/cuda/device.hpp"
#endif

namespace tidal::io {
namespace {

using detail::StoreFile;

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

}  // namespace tidal::io
