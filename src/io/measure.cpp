#include "tidal/io/measure.hpp"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "tidal/common/aligned_buffer.hpp"
#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"
#include "tidal/io/extent_allocator.hpp"

namespace tidal::io {
namespace {

// Less than this each way measures the request overhead, not the disk.
constexpr std::uint64_t kMinProbeBytes = 1ull << 20;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

namespace {

// Every core busy with dependent arithmetic in lock-step rounds, as a parallel matmul runs:
// each round ends when every core has done its share, so a core the I/O takes for a while
// delays them all. What an I/O phase takes away from the rounds is that phase's compute cost.
class Spinners {
 public:
  Spinners() : threads_count_(std::max(1u, std::thread::hardware_concurrency())) {
    for (std::size_t i = 0; i < threads_count_; ++i) threads_.emplace_back([this, i] { spin(i); });
  }
  Spinners(const Spinners&) = delete;
  Spinners& operator=(const Spinners&) = delete;
  ~Spinners() {
    stop_.store(true);
    for (auto& t : threads_) t.join();
  }
  /// Rounds completed so far.
  [[nodiscard]] std::uint64_t units() const { return rounds_.load(std::memory_order_acquire); }

 private:
  void spin(std::size_t i) {
    double x = 1.0 + static_cast<double>(i);
    std::uint64_t round = 0;
    while (!stop_.load(std::memory_order_relaxed)) {
      for (int k = 0; k < 2048; ++k) x = x * 0.999999 + 1e-3;
      // The last of the round's threads to arrive opens the next round.
      if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == threads_count_) {
        arrived_.store(0, std::memory_order_relaxed);
        rounds_.fetch_add(1, std::memory_order_acq_rel);
      }
      ++round;
      while (rounds_.load(std::memory_order_acquire) < round &&
             !stop_.load(std::memory_order_relaxed)) {
        std::this_thread::yield();  // as a BLAS thread waits: the I/O may have the core
      }
    }
    sink_.store(x, std::memory_order_relaxed);
  }
  std::size_t threads_count_;
  std::vector<std::thread> threads_;
  std::atomic<std::size_t> arrived_{0};
  std::atomic<std::uint64_t> rounds_{0};
  std::atomic<bool> stop_{false};
  std::atomic<double> sink_{0};
};

// Work units per second the spinners do alone, over `window`.
double spin_rate(const Spinners& s, std::chrono::milliseconds window) {
  const std::uint64_t u0 = s.units();
  const auto t0 = std::chrono::steady_clock::now();
  std::this_thread::sleep_for(window);
  return static_cast<double>(s.units() - u0) / seconds_since(t0);
}

// Runs `phase` (it returns the bytes it moved) beside the spinners and returns the compute
// seconds it took from them per byte: the phase's time less the time the work they still did
// would have taken alone (the rate alone: the mean of before and after the phase).
double lost_compute_per_byte(const std::function<std::uint64_t()>& phase) {
  Spinners s;
  std::this_thread::sleep_for(std::chrono::milliseconds(10));  // every spinner running
  const double before = spin_rate(s, std::chrono::milliseconds(40));
  const std::uint64_t u0 = s.units();
  const auto t0 = std::chrono::steady_clock::now();
  const std::uint64_t bytes = phase();
  const double seconds = seconds_since(t0);
  const auto done = static_cast<double>(s.units() - u0);
  const double rate = (before + spin_rate(s, std::chrono::milliseconds(40))) / 2;
  if (bytes == 0 || rate <= 0) return 0;
  return std::max(0.0, seconds - done / rate) / static_cast<double>(bytes);
}

// Writes and reads whole blocks through a store with a few requests in flight; the phases of
// measure_bandwidth.
class Transfers {
 public:
  Transfers(TensorStore& store, const MeasureOptions& o)
      : store_(store),
        block_(o.block),
        n_(o.bytes / o.block),
        slots_(std::min<std::uint64_t>(n_, static_cast<std::uint64_t>(o.depth))),
        buf_(slots_ * o.block, kBlockSize),
        tickets_(n_) {
    // Random bytes, so compression cannot flatter us.
    std::mt19937_64 rng(42);
    auto* words = reinterpret_cast<std::uint64_t*>(buf_.data());
    for (std::uint64_t i = 0; i < slots_ * block_ / 8; ++i) words[i] = rng();
  }
  Transfers(const Transfers&) = delete;
  Transfers& operator=(const Transfers&) = delete;
  // On a failed request, gives back every ticket taken so far before the error goes on.
  ~Transfers() { free_all(); }

  [[nodiscard]] std::uint64_t bytes() const { return n_ * block_; }
  std::uint64_t write() {
    run([this](std::uint64_t i) { tickets_[i] = store_.write(slot(i), block_); });
    return bytes();
  }
  std::uint64_t read() {
    run([this](std::uint64_t i) { store_.read(tickets_[i], slot(i)); });
    return bytes();
  }
  void free_all() {
    for (auto& t : tickets_) {
      if (t.valid()) store_.free(t);
      t = Ticket{};
    }
  }

 private:
  char* slot(std::uint64_t i) {
    return reinterpret_cast<char*>(buf_.data()) + (i % slots_) * block_;
  }
  template <class Start>
  void run(const Start& start) {
    for (std::uint64_t i = 0; i < n_; ++i) {
      if (i >= slots_) store_.wait(tickets_[i - slots_]);
      start(i);
    }
    for (std::uint64_t i = n_ - slots_; i < n_; ++i) store_.wait(tickets_[i]);
  }

  TensorStore& store_;
  std::uint64_t block_, n_, slots_;
  AlignedBuffer buf_;
  std::vector<Ticket> tickets_;
};

}  // namespace

MeasuredBandwidth measure_bandwidth(TensorStore& store, const MeasureOptions& asked) {
  TIDAL_EXPECT_AS(InvalidArgument, asked.block > 0 && asked.depth > 0 && asked.bytes >= asked.block,
                  "measure_bandwidth needs bytes >= block > 0 and depth > 0");
  // The probe takes at most half of the store's free space, in whole 4 KiB blocks and at least
  // four requests: it must never fill the store it measures (a refused write would count as the
  // store's own degradation, store_full, in the user's statistics).
  const std::uint64_t free = store.free_bytes();
  const std::uint64_t room = free / 2 / kBlockSize * kBlockSize;
  MeasureOptions o = asked;
  o.bytes = std::min(asked.bytes, room);
  o.block = std::min(asked.block, o.bytes / 4 / kBlockSize * kBlockSize);
  if (o.bytes < kMinProbeBytes || o.block == 0) {
    TIDAL_FAIL_IO(
        ENOSPC, "bandwidth not measured: the store has ", format_bytes(static_cast<double>(free)),
        " free of ", format_bytes(static_cast<double>(store.stats().capacity)),
        "; the probe needs at least ", format_bytes(static_cast<double>(2 * kMinProbeBytes)),
        " free (it takes half, to leave the rest to the store's user): give the store "
        "more capacity, or the SSD figures yourself");
  }
  Transfers io(store, o);
  MeasuredBandwidth m;
  m.bytes = io.bytes();
  auto t0 = std::chrono::steady_clock::now();
  io.write();
  m.write_bytes_per_second = static_cast<double>(m.bytes) / seconds_since(t0);
  t0 = std::chrono::steady_clock::now();
  io.read();
  m.read_bytes_per_second = static_cast<double>(m.bytes) / seconds_since(t0);
  io.free_all();
  if (o.compute_cost) {
    // Apart from the timed phases: the spinners slow the I/O down too.
    m.write_compute_seconds_per_byte = lost_compute_per_byte([&] { return io.write(); });
    m.read_compute_seconds_per_byte = lost_compute_per_byte([&] { return io.read(); });
    io.free_all();
  }
  return m;
}

MeasuredBandwidth measure_bandwidth(TensorStore& store, std::uint64_t bytes, std::uint64_t block,
                                    int depth) {
  MeasureOptions o;
  o.bytes = bytes;
  o.block = block;
  o.depth = depth;
  return measure_bandwidth(store, o);
}

double measure_copy_compute_cost(std::uint64_t bytes) {
  TIDAL_EXPECT_AS(InvalidArgument, bytes > 0, "measure_copy_compute_cost needs bytes > 0");
  std::vector<char> from(bytes, 1);
  std::vector<char> to(bytes, 0);  // both touched: no page faults in the measured copy
  return lost_compute_per_byte([&] {
    std::memcpy(to.data(), from.data(), bytes);
    volatile char last = to[bytes - 1];  // the copy is used: it cannot be left out
    (void)last;
    return static_cast<std::uint64_t>(bytes);
  });
}

std::string ssd_spec(const MeasuredBandwidth& m, std::size_t ssds) {
  const double k = static_cast<double>(std::max<std::size_t>(1, ssds));
  // Within what plan::parse_ssd_spec takes (1 MB/s to 1 TB/s a drive): a store measured slower
  // still (a failing or saturated disk) is planned as a 1 MB/s one rather than refused.
  const auto mbps = [k](double bytes_per_second) {
    return std::clamp(bytes_per_second / k / 1e6, 1.0, 1e6);
  };
  char text[96];
  std::snprintf(text, sizeof text, "%zux%.1f/%.1fMB/s", std::max<std::size_t>(1, ssds),
                mbps(m.write_bytes_per_second), mbps(m.read_bytes_per_second));
  return text;
}

}  // namespace tidal::io
