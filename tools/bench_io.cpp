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

void run_bench_io(const BenchIoArgs& a) {
  const std::uint64_t size = parse_bytes(a.size);
  const BenchMemory memory = bench_memory_from_string(a.memory);
  TIDAL_EXPECT_AS(InvalidArgument, a.arena == "slots" || a.arena == "whole", "--arena '", a.arena,
                  "' must be slots or whole");
  const std::uint64_t block = parse_bytes(a.block);
  TIDAL_EXPECT_AS(InvalidArgument, block <= 4 * kGiB, "--block ", a.block, " must be at most 4GiB");
  // The store moves whole 4 KiB blocks with O_DIRECT: a smaller or ragged block measures the
  // padding (--block 3 moved 4 KiB per 3 bytes, for minutes, and reported 0.00 GB/s).
  TIDAL_EXPECT_AS(InvalidArgument, block >= io::kBlockSize && block % io::kBlockSize == 0,
                  "--block ", a.block, " is not a whole number of the store's ",
                  format_bytes(static_cast<double>(io::kBlockSize)),
                  " blocks (direct I/O moves whole blocks): give a multiple of 4KiB, e.g. "
                  "--block 4KiB or --block 1MiB");
  TIDAL_EXPECT_AS(InvalidArgument, size >= block, "--size (", a.size,
                  ") must be at least one --block (", a.block, ")");
  TIDAL_EXPECT_AS(InvalidArgument, a.depth >= 1 && a.depth <= 1024,
                  "--depth must be from 1 to 1024");
  const std::uint64_t nblocks = size / block;
  // A ticket per tensor is kept until the read pass: a bound on the count keeps that (and the
  // store's size below) from overflowing or exhausting memory.
  constexpr std::uint64_t kMaxTensors = std::uint64_t{1} << 24;
  TIDAL_EXPECT_AS(InvalidArgument, nblocks <= kMaxTensors, "--size ", a.size,
                  " in tensors of --block ", a.block, " is ", nblocks,
                  " tensors; bench-io moves at most ", kMaxTensors,
                  ": give a larger --block (e.g. 1MiB) or a smaller --size");

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
  const std::uint64_t stripes_per_block = (block + o.stripe_unit - 1) / o.stripe_unit;
  const auto nfiles = std::max<std::uint64_t>(1, o.dirs.size());
  o.queue_depth =
      a.queue_depth > 0
          ? a.queue_depth
          : static_cast<int>(std::min<std::uint64_t>(
                4096,
                (static_cast<std::uint64_t>(a.depth) * stripes_per_block + nfiles - 1) / nfiles));
  // Each tensor takes whole 4 KiB blocks per stripe in the store.
  const std::uint64_t per_tensor =
      stripes_per_block * io::kBlockSize + align_up(block, io::kBlockSize);
  o.capacity = nblocks * per_tensor + nfiles * o.stripe_unit;
  // Said in bench-io's own options: the store would ask for a lower capacity, which bench-io
  // derives from --size and --block.
  for (const auto& d : o.dirs) {
    struct statvfs st {};
    // Unreadable, or a file system without blocks (/proc, sysfs): the store says what is wrong.
    if (::statvfs(d.c_str(), &st) != 0 || st.f_blocks == 0) continue;
    const std::uint64_t free = static_cast<std::uint64_t>(st.f_bavail) * st.f_frsize;
    const std::uint64_t need = o.capacity / nfiles;
    TIDAL_EXPECT_AS(InvalidArgument, need <= free, "bench-io needs ",
                    format_bytes(static_cast<double>(need)), " in '", d, "' for --size ", a.size,
                    " in ", nblocks, " tensors of --block ", a.block, " (each takes ",
                    format_bytes(static_cast<double>(per_tensor)),
                    " of store space, whole 4 KiB blocks per stripe), but ",
                    format_bytes(static_cast<double>(free)),
                    " is free there: give a smaller --size, a larger --block, or more "
                    "directories in --dir (one per SSD)");
  }
  io::TensorStore store(o);
  const io::StoreStats s0 = store.stats();

  Pattern pattern(block, a.depth, 0x7fda1);
  // The pattern is read from, never handed to the store: its pages do not shape the requests.
  // The tensors live in one arena made before timing, aligned to 2 MiB so that huge pages can
  // back it: --arena slots holds the --depth tensors in flight (each slot refilled for the next
  // tensor inside the timed loop, as before), --arena whole holds every tensor at its own place,
  // filled before timing, as DeepNVMe writes one page-locked tensor of the whole size (on a disk
  // that pays per request or segment, a large allocation, whose pages tend to be physically
  // contiguous, moves more than a small one: compare like with like).
  const bool whole = a.arena == "whole";
  const std::size_t stride = align_up(block, io::kBlockSize);
  const std::uint64_t nslots = whole ? nblocks : static_cast<std::uint64_t>(a.depth);
  const auto depth = static_cast<std::uint64_t>(a.depth);
  AlignedBuffer arena(stride * static_cast<std::size_t>(nslots), kHugePage);
  prepare_memory(arena.data(), align_up(arena.size(), kHugePage), memory);
  auto tensor_data = [&](std::uint64_t i) {
    return arena.data() + static_cast<std::size_t>(i % nslots) * stride;
  };
  if (whole) {
    for (std::uint64_t i = 0; i < nblocks; ++i) pattern.fill(i, tensor_data(i), true);
  }
  std::vector<io::Ticket> tickets(nblocks);

  if (!a.json) {
    std::cout << "tidal bench-io: " << format_bytes(static_cast<double>(nblocks * block)) << " as "
              << nblocks << " tensors of " << format_bytes(static_cast<double>(block)) << ", depth "
              << a.depth << ", " << o.dirs.size() << " director"
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

  // Write phase: at most --depth tensors in flight; tensor i waits for tensor i - depth (whose
  // slot it takes with --arena slots).
  Progress pw("write", static_cast<std::int64_t>(nblocks), Progress::Style::kPercent);
  auto t0 = std::chrono::steady_clock::now();
  for (std::uint64_t i = 0; i < nblocks; ++i) {
    if (i >= depth) store.wait(tickets[i - depth]);
    if (!whole) pattern.fill(i, tensor_data(i), i < depth);
    tickets[i] = store.write(tensor_data(i), block);
    pw.update(static_cast<std::int64_t>(i + 1));
  }
  for (std::uint64_t i = nblocks > depth ? nblocks - depth : 0; i < nblocks; ++i) {
    store.wait(tickets[i]);
  }
  const double write_s = seconds_since(t0);
  const double write_checksum_s = store.stats().checksum_seconds;

  // Read phase: each slot's block is checked when the slot is reused. The timed pass checks
  // the stamps of every 4 KiB (cheap: a misplaced stripe or a read that moved nothing fails),
  // then an untimed pass reads everything again and compares every byte: comparing 1 MiB per
  // tensor on the thread that issues the reads is the benchmark's cost, not the store's (fio
  // compares nothing), and on a loaded two-core machine it delayed the next read.
  // With --arena whole the arena holds what was written: poisoned before each pass (untimed) so
  // that a read that moved nothing fails. With slots, a slot holds the tensor read before.
  auto poison = [&] {
    if (whole) std::memset(arena.data(), 0xa5, arena.size());
  };
  auto read_pass = [&](const char* phase, bool every_byte) {
    std::uint64_t bad = 0;
    Progress pr(phase, static_cast<std::int64_t>(nblocks), Progress::Style::kPercent);
    auto check = [&](std::uint64_t b) {
      store.wait(tickets[b]);
      const unsigned char* got = tensor_data(b);
      if (!(every_byte ? pattern.check(b, got) : pattern.check_stamps(b, got))) ++bad;
    };
    for (std::uint64_t i = 0; i < nblocks; ++i) {
      if (i >= depth) check(i - depth);
      store.read(tickets[i], tensor_data(i));
      pr.update(static_cast<std::int64_t>(i + 1));
    }
    for (std::uint64_t i = nblocks > depth ? nblocks - depth : 0; i < nblocks; ++i) check(i);
    return bad;
  };
  poison();
  t0 = std::chrono::steady_clock::now();
  const std::uint64_t bad_stamps = read_pass("read", false);
  const double read_s = seconds_since(t0);
  const double read_checksum_s = store.stats().checksum_seconds - write_checksum_s;
  poison();
  const std::uint64_t bad = read_pass("verify", true);
  for (auto t : tickets) store.free(t);

  const double bytes = static_cast<double>(nblocks * block);
  const double wg = bytes / write_s / 1e9;
  const double rg = bytes / read_s / 1e9;
  const io::StoreStats s = store.stats();
  const bool verified = bad == 0 && bad_stamps == 0;
  if (a.json) {
    nlohmann::json j = {{"write_gbps", wg},
                        {"read_gbps", rg},
                        {"verified", verified},
                        {"bytes", nblocks * block},
                        {"block", block},
                        {"tensors", nblocks},
                        {"depth", a.depth},
                        {"dirs", o.dirs},
                        {"stripe_unit", o.stripe_unit},
                        {"backend", s.backend},
                        {"direct", !a.buffered},
                        {"checksum", o.checksum},
                        {"checksum_threads", s.checksum_threads},
                        {"memory", a.memory},
                        {"arena", a.arena},
                        {"write_seconds", write_s},
                        {"read_seconds", read_s},
                        {"staged_ops", s.staged_ops},
                        {"bad_tensors", bad},
                        {"bad_stamps", bad_stamps},
                        {"verify", "every byte in a second, untimed read pass"},
                        {"write_checksum_seconds", write_checksum_s},
                        {"read_checksum_seconds", read_checksum_s},
                        {"backend_fallback", s.backend_fallback.reason}};
    std::cout << j.dump() << "\n";
  } else {
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
    row("write", write_s, wg, write_checksum_s);
    row("read", read_s, rg, read_checksum_s);
    std::cout << "verified: " << (verified ? "yes, every byte" : "NO")
              << " (a second, untimed read pass; the timed one checked every 4 KiB's stamp): "
              << nblocks - bad << "/" << nblocks << " tensors good, " << bad_stamps
              << " bad stamps\n";
  }
  std::cout.flush();
  if (!verified) {
    TIDAL_FAIL(std::max(bad, bad_stamps), " of ", nblocks,
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
