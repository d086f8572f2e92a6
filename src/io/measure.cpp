#include "tidal/io/measure.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "tidal/common/error.hpp"
#include "tidal/io/extent_allocator.hpp"

namespace tidal::io {
namespace {

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

MeasuredBandwidth measure_bandwidth(TensorStore& store, std::uint64_t bytes, std::uint64_t block,
                                    int depth) {
  TIDAL_EXPECT_AS(InvalidArgument, block > 0 && depth > 0 && bytes >= block,
                  "measure_bandwidth needs bytes >= block > 0 and depth > 0");
  const std::uint64_t n = bytes / block;
  const std::uint64_t slots = std::min<std::uint64_t>(n, static_cast<std::uint64_t>(depth));
  // One aligned buffer per request in flight; random bytes, so compression cannot flatter us.
  std::unique_ptr<void, FreeDeleter> buf(std::aligned_alloc(kBlockSize, slots * block));
  TIDAL_EXPECT(buf != nullptr, "out of memory for the bandwidth measurement");
  std::mt19937_64 rng(42);
  auto* words = static_cast<std::uint64_t*>(buf.get());
  for (std::uint64_t i = 0; i < slots * block / 8; ++i) words[i] = rng();
  auto slot = [&](std::uint64_t i) { return static_cast<char*>(buf.get()) + (i % slots) * block; };

  std::vector<Ticket> t(n);
  // On a failed request, give back every ticket taken so far before reporting it.
  struct Release {
    TensorStore& store;
    std::vector<Ticket>& tickets;
    ~Release() {
      for (auto x : tickets) {
        if (x.valid()) store.free(x);
      }
    }
  } release{store, t};
  auto t0 = std::chrono::steady_clock::now();
  for (std::uint64_t i = 0; i < n; ++i) {
    if (i >= slots) store.wait(t[i - slots]);
    t[i] = store.write(slot(i), block);
  }
  for (std::uint64_t i = n - slots; i < n; ++i) store.wait(t[i]);
  MeasuredBandwidth m;
  m.bytes = n * block;
  m.write_bytes_per_second = static_cast<double>(m.bytes) / seconds_since(t0);
  t0 = std::chrono::steady_clock::now();
  for (std::uint64_t i = 0; i < n; ++i) {
    if (i >= slots) store.wait(t[i - slots]);
    store.read(t[i], slot(i));
  }
  for (std::uint64_t i = n - slots; i < n; ++i) store.wait(t[i]);
  m.read_bytes_per_second = static_cast<double>(m.bytes) / seconds_since(t0);
  return m;
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
