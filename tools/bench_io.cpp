// tidal bench-io: write then read random tensors through the TensorStore, verify every byte, and
// print write and read bandwidth. O_DIRECT unless --buffered (and then it says so).
#include <sys/mman.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "commands.hpp"
#include "progress.hpp"
#include "store_flags.hpp"
#include "tidal/common/aligned_buffer.hpp"
#include "tidal/common/error.hpp"
#include "tidal/common/text.hpp"
#include "tidal/common/units.hpp"
#include "tidal/io/extent_allocator.hpp"
#include "tidal/io/store.hpp"

namespace tidal::cli {
namespace {

struct BenchIoArgs {
  std::string dirs;
  std::string size = "1GiB";
  std::string block = "1MiB";
  int depth = 16;
  std::string backend = "auto";
  std::string stripe = "1MiB";
  int queue_depth = 0;
  bool no_checksum = false;
  int checksum_threads = 0;
  bool buffered = false;
  bool json = false;
  std::string memory = "populated";
  std::string arena = "slots";
};

// How the tensors' memory is made before the timed passes. It matters on a disk that counts
// requests: the kernel cuts a direct I/O where its pages stop being physically contiguous (a
// request holds at most max_segments runs), so scattered 4 KiB pages give it smaller requests.
// On the CI machine's virtual disk, 8 MiB tensors first touched inside the timed write loop
// went out as 512 KiB requests on average and read at 1.1-1.2 GB/s; populated in one call,
// 1 MiB requests and 1.8 GB/s; on 2 MiB pages, 2 MiB requests and 2.4 GB/s.
enum class BenchMemory : std::uint8_t {
  kPageable,   ///< allocated; pages come as the timed write loop first touches them
  kPopulated,  ///< every page made in one call before timing, as pinned allocators do
  kHuge,       ///< asked for 2 MiB pages (transparent huge pages), then populated
};

BenchMemory bench_memory_from_string(const std::string& s) {
  if (s == "pageable") return BenchMemory::kPageable;
  if (s == "populated") return BenchMemory::kPopulated;
  if (s == "huge") return BenchMemory::kHuge;
  TIDAL_FAIL_AS(InvalidArgument, "--memory '", s, "' must be pageable, populated or huge");
}

// Populates n bytes at p (page-aligned) the way `memory` says. MADV_POPULATE_WRITE (Linux 5.14)
// makes the pages in one call, as mlock does for DeepNVMe's page-locked tensors; without it the
// bytes are written once in order.
void prepare_memory(unsigned char* p, std::size_t n, BenchMemory memory) {
  if (memory == BenchMemory::kPageable) return;
  if (memory == BenchMemory::kHuge) ::madvise(p, n, MADV_HUGEPAGE);  // advice: may be refused
#ifdef MADV_POPULATE_WRITE
  if (::madvise(p, n, MADV_POPULATE_WRITE) == 0) return;
#endif
  std::memset(p, 0, n);
}

// n bytes for O_DIRECT: block-aligned, the allocation rounded up to whole blocks.
AlignedBuffer aligned_bytes(std::size_t n) { return AlignedBuffer(n, io::kBlockSize); }

// Block i's bytes: the random slice of the slot it is written from, with the block number
// stamped at the start of every 4 KiB, so a stripe read back from the wrong place, or a read
// that moved nothing, cannot pass verification. Only the stamps change per block: the benchmark
// measures the store, not a data generator.
class Pattern {
 public:
  Pattern(std::size_t block, int slots, std::uint64_t seed) : block_(block), slots_(slots) {
    pool_size_ = align_up(block, io::kBlockSize) * static_cast<std::size_t>(slots);
    pool_ = aligned_bytes(pool_size_);
    std::uint64_t x = seed;
    auto* w = reinterpret_cast<std::uint64_t*>(pool_.data());
    for (std::size_t i = 0; i < pool_size_ / 8; ++i) {  // splitmix64
      x += 0x9e3779b97f4a7c15ULL;
      std::uint64_t z = x;
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
      w[i] = z ^ (z >> 31);
    }
  }
  [[nodiscard]] const unsigned char* slice(std::uint64_t i) const {
    return pool_.data() +
           (i % static_cast<std::uint64_t>(slots_)) * align_up(block_, io::kBlockSize);
  }
  /// Makes dst (which held block i - slots, or nothing) hold block i.
  void fill(std::uint64_t i, unsigned char* dst, bool first_use) const {
    if (first_use) std::memcpy(dst, slice(i), block_);
    for (std::size_t off = 0; off + 8 <= block_; off += io::kBlockSize) {
      std::memcpy(dst + off, &i, 8);
    }
  }
  /// Only the stamps: a stripe from the wrong place, or a read that moved nothing, fails this.
  [[nodiscard]] bool check_stamps(std::uint64_t i, const unsigned char* got) const {
    for (std::size_t off = 0; off + 8 <= block_; off += io::kBlockSize) {
      std::uint64_t stamp = 0;
      std::memcpy(&stamp, got + off, 8);
      if (stamp != i) return false;
    }
    return true;
  }
  /// Every byte.
  [[nodiscard]] bool check(std::uint64_t i, const unsigned char* got) const {
    const unsigned char* want = slice(i);
    for (std::size_t off = 0; off < block_; off += io::kBlockSize) {
      const std::size_t n = std::min<std::size_t>(io::kBlockSize, block_ - off);
      if (n >= 8) {
        std::uint64_t stamp = 0;
        std::memcpy(&stamp, got + off, 8);
        if (stamp != i || std::memcmp(got + off + 8, want + off + 8, n - 8) != 0) return false;
      } else if (std::memcmp(got + off, want + off, n) != 0) {
        return false;
      }
    }
    return true;
  }

 private:
  std::size_t block_;
  int slots_;
  std::size_t pool_size_;
  AlignedBuffer pool_;
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// What bench-io moves: --size in tensors of --block, checked, and how their memory is made.
struct BenchSizes {
  std::uint64_t size = 0;
  std::uint64_t block = 0;
  std::uint64_t nblocks = 0;
  BenchMemory memory = BenchMemory::kPopulated;
};

BenchSizes bench_sizes(const BenchIoArgs& a) {
  BenchSizes z;
  z.size = parse_bytes(a.size);
  z.memory = bench_memory_from_string(a.memory);
  TIDAL_EXPECT_AS(InvalidArgument, a.arena == "slots" || a.arena == "whole", "--arena '", a.arena,
                  "' must be slots or whole");
  z.block = parse_bytes(a.block);
  TIDAL_EXPECT_AS(InvalidArgument, z.block <= 4 * kGiB, "--block ", a.block,
                  " must be at most 4GiB");
  // The store moves whole 4 KiB blocks with O_DIRECT: a smaller or ragged block measures the
  // padding (--block 3 moved 4 KiB per 3 bytes, for minutes, and reported 0.00 GB/s).
  TIDAL_EXPECT_AS(InvalidArgument, z.block >= io::kBlockSize && z.block % io::kBlockSize == 0,
                  "--block ", a.block, " is not a whole number of the store's ",
                  format_bytes(static_cast<double>(io::kBlockSize)),
                  " blocks (direct I/O moves whole blocks): give a multiple of 4KiB, e.g. "
                  "--block 4KiB or --block 1MiB");
  TIDAL_EXPECT_AS(InvalidArgument, z.size >= z.block, "--size (", a.size,
                  ") must be at least one --block (", a.block, ")");
  TIDAL_EXPECT_AS(InvalidArgument, a.depth >= 1 && a.depth <= 1024,
                  "--depth must be from 1 to 1024");
  z.nblocks = z.size / z.block;
  // A ticket per tensor is kept until the read pass: a bound on the count keeps that (and the
  // store's size below) from overflowing or exhausting memory.
  constexpr std::uint64_t kMaxTensors = std::uint64_t{1} << 24;
  TIDAL_EXPECT_AS(InvalidArgument, z.nblocks <= kMaxTensors, "--size ", a.size,
                  " in tensors of --block ", a.block, " is ", z.nblocks,
                  " tensors; bench-io moves at most ", kMaxTensors,
                  ": give a larger --block (e.g. 1MiB) or a smaller --size");
  return z;
}

// Said in bench-io's own options: the store would ask for a lower capacity, which bench-io
// derives from --size and --block.
void check_free_space(const io::StoreOptions& o, const BenchIoArgs& a, const BenchSizes& z,
                      std::uint64_t per_tensor) {
  const auto nfiles = std::max<std::uint64_t>(1, o.dirs.size());
  for (const auto& d : o.dirs) {
    struct statvfs st {};
    // Unreadable, or a file system without blocks (/proc, sysfs): the store says what is wrong.
    if (::statvfs(d.c_str(), &st) != 0 || st.f_blocks == 0) continue;
    const std::uint64_t free = static_cast<std::uint64_t>(st.f_bavail) * st.f_frsize;
    const std::uint64_t need = o.capacity / nfiles;
    TIDAL_EXPECT_AS(InvalidArgument, need <= free, "bench-io needs ",
                    format_bytes(static_cast<double>(need)), " in '", d, "' for --size ", a.size,
                    " in ", z.nblocks, " tensors of --block ", a.block, " (each takes ",
                    format_bytes(static_cast<double>(per_tensor)),
                    " of store space, whole 4 KiB blocks per stripe), but ",
                    format_bytes(static_cast<double>(free)),
                    " is free there: give a smaller --size, a larger --block, or more "
                    "directories in --dir (one per SSD)");
  }
}

io::StoreOptions store_options(const BenchIoArgs& a, const BenchSizes& z) {
  io::StoreOptions o;
  o.dirs = parse_dir_flag("--dir", a.dirs);
  o.stripe_unit = parse_bytes(a.stripe);
  // Checked here too: the sizing below divides by it before the store sees it.
  TIDAL_EXPECT_AS(InvalidArgument,
                  o.stripe_unit >= 4 * kKiB && o.stripe_unit <= 256 * kMiB &&
                      (o.stripe_unit & (o.stripe_unit - 1)) == 0,
                  "--stripe ", a.stripe,
                  " must be a power of two from 4KiB to 256MiB (default 1MiB)");
  o.backend = io::backend_kind_from_string(a.backend);
  o.checksum = !a.no_checksum;
  TIDAL_EXPECT_AS(InvalidArgument, a.checksum_threads >= 0 && a.checksum_threads <= 256,
                  "--checksum-threads must be from 0 (one per core) to 256");
  o.checksum_threads = a.checksum_threads;
  o.buffered = a.buffered;
  const std::uint64_t stripes_per_block = (z.block + o.stripe_unit - 1) / o.stripe_unit;
  const auto nfiles = std::max<std::uint64_t>(1, o.dirs.size());
  o.queue_depth =
      a.queue_depth > 0
          ? a.queue_depth
          : static_cast<int>(std::min<std::uint64_t>(
                4096,
                (static_cast<std::uint64_t>(a.depth) * stripes_per_block + nfiles - 1) / nfiles));
  // Each tensor takes whole 4 KiB blocks per stripe in the store.
  const std::uint64_t per_tensor =
      stripes_per_block * io::kBlockSize + align_up(z.block, io::kBlockSize);
  o.capacity = z.nblocks * per_tensor + nfiles * o.stripe_unit;
  check_free_space(o, a, z, per_tensor);
  return o;
}

// The tensors of one run and their tickets in the store. The pattern is read from, never
// handed to the store: its pages do not shape the requests. The tensors live in one arena made
// before timing, aligned to 2 MiB so that huge pages can back it: --arena slots holds the
// --depth tensors in flight (each slot refilled for the next tensor inside the timed loop, as
// before), --arena whole holds every tensor at its own place, filled before timing, as DeepNVMe
// writes one page-locked tensor of the whole size (on a disk that pays per request or segment,
// a large allocation, whose pages tend to be physically contiguous, moves more than a small
// one: compare like with like).
class BenchTensors {
 public:
  BenchTensors(const BenchIoArgs& a, const BenchSizes& z, io::TensorStore& store)
      : store_(store),
        pattern_(z.block, a.depth, 0x7fda1),
        whole_(a.arena == "whole"),
        block_(z.block),
        nblocks_(z.nblocks),
        stride_(align_up(z.block, io::kBlockSize)),
        nslots_(whole_ ? z.nblocks : static_cast<std::uint64_t>(a.depth)),
        depth_(static_cast<std::uint64_t>(a.depth)),
        arena_(stride_ * static_cast<std::size_t>(nslots_), kHugePage),
        tickets_(z.nblocks) {
    prepare_memory(arena_.data(), align_up(arena_.size(), kHugePage), z.memory);
    if (whole_) {
      for (std::uint64_t i = 0; i < nblocks_; ++i) pattern_.fill(i, tensor_data(i), true);
    }
  }

  // Write phase: at most --depth tensors in flight; tensor i waits for tensor i - depth (whose
  // slot it takes with --arena slots). Returns its seconds.
  double write_pass() {
    Progress pw("write", static_cast<std::int64_t>(nblocks_), Progress::Style::kPercent);
    const auto t0 = std::chrono::steady_clock::now();
    for (std::uint64_t i = 0; i < nblocks_; ++i) {
      if (i >= depth_) store_.wait(tickets_[i - depth_]);
      if (!whole_) pattern_.fill(i, tensor_data(i), i < depth_);
      tickets_[i] = store_.write(tensor_data(i), block_);
      pw.update(static_cast<std::int64_t>(i + 1));
    }
    for (std::uint64_t i = nblocks_ > depth_ ? nblocks_ - depth_ : 0; i < nblocks_; ++i) {
      store_.wait(tickets_[i]);
    }
    return seconds_since(t0);
  }

  // With --arena whole the arena holds what was written: poisoned before each read pass
  // (untimed) so that a read that moved nothing fails. With slots, a slot holds the tensor read
  // before.
  void poison() {
    if (whole_) std::memset(arena_.data(), 0xa5, arena_.size());
  }

  // Reads every tensor back, each slot's block checked when the slot is reused: every byte, or
  // only the stamps. Returns the tensors that came back wrong.
  std::uint64_t read_pass(const char* phase, bool every_byte) {
    std::uint64_t bad = 0;
    Progress pr(phase, static_cast<std::int64_t>(nblocks_), Progress::Style::kPercent);
    auto check = [&](std::uint64_t b) {
      store_.wait(tickets_[b]);
      const unsigned char* got = tensor_data(b);
      if (!(every_byte ? pattern_.check(b, got) : pattern_.check_stamps(b, got))) ++bad;
    };
    for (std::uint64_t i = 0; i < nblocks_; ++i) {
      if (i >= depth_) check(i - depth_);
      store_.read(tickets_[i], tensor_data(i));
      pr.update(static_cast<std::int64_t>(i + 1));
    }
    for (std::uint64_t i = nblocks_ > depth_ ? nblocks_ - depth_ : 0; i < nblocks_; ++i) check(i);
    return bad;
  }

  void free_all() {
    for (auto t : tickets_) store_.free(t);
  }

 private:
  unsigned char* tensor_data(std::uint64_t i) {
    return arena_.data() + static_cast<std::size_t>(i % nslots_) * stride_;
  }

  io::TensorStore& store_;
  Pattern pattern_;
  bool whole_;
  std::uint64_t block_;
  std::uint64_t nblocks_;
  std::size_t stride_;
  std::uint64_t nslots_;
  std::uint64_t depth_;
  AlignedBuffer arena_;
  std::vector<io::Ticket> tickets_;
};

void print_bench_header(const BenchIoArgs& a, const BenchSizes& z, const io::StoreOptions& o,
                        const io::TensorStore& store, const io::StoreStats& s0) {
  std::cout << "tidal bench-io: " << format_bytes(static_cast<double>(z.nblocks * z.block))
            << " as " << z.nblocks << " tensors of " << format_bytes(static_cast<double>(z.block))
            << ", depth " << a.depth << ", " << o.dirs.size() << " director"
            << (o.dirs.size() == 1 ? "y" : "ies") << ", stripe "
            << format_bytes(static_cast<double>(o.stripe_unit)) << ", backend " << s0.backend
            << ", " << (a.buffered ? "BUFFERED (page cache: not a real offload)" : "O_DIRECT")
            << ", " << a.memory << " memory (" << a.arena << ")"
            << ", checksums "
            << (store.options().checksum
                    ? "on (" + std::to_string(s0.checksum_threads) + " threads)"
                    : std::string("OFF"))
            << "\n";
  if (s0.backend_fallback.count > 0) {
    std::cout << "backend fallback: " << s0.backend_fallback.reason << "\n";
  }
}

// What the timed passes measured and the checks found.
struct BenchResult {
  double write_s = 0;
  double write_checksum_s = 0;
  double read_s = 0;
  double read_checksum_s = 0;
  std::uint64_t bad = 0;         // tensors not equal to what was written, byte for byte
  std::uint64_t bad_stamps = 0;  // tensors with a wrong stamp in the timed read
};

void print_bench_json(const BenchIoArgs& a, const BenchSizes& z, const io::StoreOptions& o,
                      const io::StoreStats& s, const BenchResult& r) {
  const double bytes = static_cast<double>(z.nblocks * z.block);
  nlohmann::json j = {{"write_gbps", bytes / r.write_s / 1e9},
                      {"read_gbps", bytes / r.read_s / 1e9},
                      {"verified", r.bad == 0 && r.bad_stamps == 0},
                      {"bytes", z.nblocks * z.block},
                      {"block", z.block},
                      {"tensors", z.nblocks},
                      {"depth", a.depth},
                      {"dirs", o.dirs},
                      {"stripe_unit", o.stripe_unit},
                      {"backend", s.backend},
                      {"direct", !a.buffered},
                      {"checksum", o.checksum},
                      {"checksum_threads", s.checksum_threads},
                      {"memory", a.memory},
                      {"arena", a.arena},
                      {"write_seconds", r.write_s},
                      {"read_seconds", r.read_s},
                      {"staged_ops", s.staged_ops},
                      {"bad_tensors", r.bad},
                      {"bad_stamps", r.bad_stamps},
                      {"verify", "every byte in a second, untimed read pass"},
                      {"write_checksum_seconds", r.write_checksum_s},
                      {"read_checksum_seconds", r.read_checksum_s},
                      {"backend_fallback", s.backend_fallback.reason}};
  std::cout << j.dump() << "\n";
}

void print_bench_table(const BenchSizes& z, const BenchResult& r) {
  const double bytes = static_cast<double>(z.nblocks * z.block);
  // The checksum cost: thread time spent hashing, which runs beside the I/O on the store's
  // checksum threads, so it is CPU used rather than time added to the phase.
  char line[160];
  std::printf("%-6s %10s %12s %18s %14s\n", "phase", "seconds", "GB/s", "checksum CPU s",
              "hash GB/s");
  auto row = [&](const char* phase, double sec, double gbps, double cs) {
    // Without checksums nothing was hashed: the rate is not a measurement, so it is a dash.
    char rate[32] = "-";
    if (cs > 0) std::snprintf(rate, sizeof rate, "%.1f", bytes / cs / 1e9);
    std::snprintf(line, sizeof line, "%-6s %10.3f %12.2f %18.3f %14s\n", phase, sec, gbps, cs,
                  rate);
    std::cout << line;
  };
  row("write", r.write_s, bytes / r.write_s / 1e9, r.write_checksum_s);
  row("read", r.read_s, bytes / r.read_s / 1e9, r.read_checksum_s);
  std::cout << "verified: " << (r.bad == 0 && r.bad_stamps == 0 ? "yes, every byte" : "NO")
            << " (a second, untimed read pass; the timed one checked every 4 KiB's stamp): "
            << z.nblocks - r.bad << "/" << z.nblocks << " tensors good, " << r.bad_stamps
            << " bad stamps\n";
}

void run_bench_io(const BenchIoArgs& a) {
  const BenchSizes z = bench_sizes(a);
  const io::StoreOptions o = store_options(a, z);
  io::TensorStore store(o);
  const io::StoreStats s0 = store.stats();
  BenchTensors tensors(a, z, store);
  if (!a.json) print_bench_header(a, z, o, store, s0);

  BenchResult r;
  r.write_s = tensors.write_pass();
  r.write_checksum_s = store.stats().checksum_seconds;
  // The timed read pass checks the stamps of every 4 KiB (cheap: a misplaced stripe or a read
  // that moved nothing fails), then an untimed pass reads everything again and compares every
  // byte: comparing 1 MiB per tensor on the thread that issues the reads is the benchmark's
  // cost, not the store's (fio compares nothing), and on a loaded two-core machine it delayed
  // the next read.
  tensors.poison();
  const auto t0 = std::chrono::steady_clock::now();
  r.bad_stamps = tensors.read_pass("read", false);
  r.read_s = seconds_since(t0);
  r.read_checksum_s = store.stats().checksum_seconds - r.write_checksum_s;
  tensors.poison();
  r.bad = tensors.read_pass("verify", true);
  tensors.free_all();

  if (a.json) {
    print_bench_json(a, z, o, store.stats(), r);
  } else {
    print_bench_table(z, r);
  }
  std::cout.flush();
  if (r.bad != 0 || r.bad_stamps != 0) {
    TIDAL_FAIL(std::max(r.bad, r.bad_stamps), " of ", z.nblocks,
               " tensors came back different from what was written");
  }
}

}  // namespace

void add_bench_io_command(CLI::App& app) {
  auto a = std::make_shared<BenchIoArgs>();
  auto* cmd = app.add_subcommand(
      "bench-io", "Write then read random tensors through the store; verify every byte; GB/s");
  cmd->add_option("--dir", a->dirs, "Store directories, comma-separated (one per SSD)")->required();
  cmd->add_option("--size", a->size, "Bytes to write then read (units: 4GiB, 512MiB)")
      ->capture_default_str();
  cmd->add_option("--block", a->block, "Bytes per tensor, a multiple of 4KiB")
      ->capture_default_str();
  cmd->add_option("--depth", a->depth, "Tensors in flight")->capture_default_str();
  cmd->add_option("--backend", a->backend, "auto, io_uring or posix")->capture_default_str();
  cmd->add_option("--stripe", a->stripe, "Stripe unit")->capture_default_str();
  cmd->add_option("--queue-depth", a->queue_depth,
                  "Ops in flight per file (default: enough for --depth tensors)");
  cmd->add_flag("--no-checksum", a->no_checksum, "Skip the per-stripe xxHash3 checksums");
  cmd->add_option("--checksum-threads", a->checksum_threads,
                  "Threads hashing beside the I/O (0: one per core, at most 8)")
      ->capture_default_str();
  cmd->add_flag("--buffered", a->buffered,
                "Page-cache I/O instead of O_DIRECT (measures memory, not the disk)");
  cmd->add_option("--memory", a->memory,
                  "How the tensors' memory is made: pageable (pages made by the first write), "
                  "populated (made in one call before timing, as pinned memory is), huge (2 MiB "
                  "pages where the kernel allows, populated)")
      ->capture_default_str();
  cmd->add_option("--arena", a->arena,
                  "slots: memory for the --depth tensors in flight, refilled as they go; whole: "
                  "every tensor at its own place, filled before timing (as DeepNVMe's one tensor)")
      ->capture_default_str();
  cmd->add_flag("--json", a->json, "Print one JSON object as the last line");
  cmd->callback([a] { run_bench_io(*a); });
}

}  // namespace tidal::cli
