// The host memory tier: a fixed pool of host memory (page-locked when a CUDA device is present,
// so that copies from and to the GPU run at the link's speed, as far as it has been used: it is
// reserved whole but pinned as it grows) that holds offloaded tensors where
// a plan says "host". Faster than the SSDs and scarcer: the planner uses it where the SSD
// channel has no room (docs/simulator.md), up to the pool's capacity.
//
// Copies run on one worker thread of the pool, highest priority first, so that the training
// thread never copies. On a CPU-only machine the pool is ordinary host memory outside the
// tensor allocator: it models a GPU's host memory, and the memory meter does not count it.
//
// Usage:
//   tidal::io::HostPool pool(8 * tidal::kGiB);
//   auto t = pool.write(ptr, bytes, tidal::io::Priority::kOffload);
//   pool.wait(t);                       // throws tidal::IoError when the pool had no room
//   pool.read(t, dst, tidal::io::Priority::kUrgent);
//   pool.wait(t);
//   pool.free(t);
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "tidal/io/tier.hpp"

namespace tidal::io {

/// Counters since the pool was made.
struct HostPoolStats {
  std::uint64_t capacity = 0;
  std::uint64_t used_bytes = 0;       ///< allocated (4 KiB granules)
  std::uint64_t peak_used_bytes = 0;  ///< the most used at once
  std::uint64_t bytes_written = 0;    ///< tensor bytes of completed writes (into the pool)
  std::uint64_t bytes_read = 0;       ///< tensor bytes of completed reads (out of the pool)
  std::uint64_t writes = 0;
  std::uint64_t reads = 0;
  std::uint64_t full = 0;     ///< writes refused for lack of room
  double busy_seconds = 0;    ///< time the copy thread spent copying
  std::uint64_t tickets = 0;  ///< tickets alive
  bool pinned = false;        ///< page-locked (a part or all) for a CUDA device
  /// Bytes page-locked from the pool's start: its most used so far rounded up to 64 MiB, as it
  /// grew (0 without a CUDA device). A pool is not pinned whole at start.
  std::uint64_t pinned_bytes = 0;
  /// Why pinning stopped (the memlock limit, a failed registration), or empty: the rest of the
  /// pool is pageable, and copies between it and the GPU are slower.
  std::string pin_failure;
};

class HostPool final : public Tier {
 public:
  /// Reserves `capacity` bytes of host memory (rounded up to 4 KiB). Throws
  /// tidal::InvalidArgument for 0, and tidal::Error when the memory cannot be reserved.
  explicit HostPool(std::uint64_t capacity);
  ~HostPool() override;  ///< waits for the copies in flight
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  Ticket write(const void* src, std::uint64_t bytes, Priority priority) override;
  void read(Ticket ticket, void* dst, Priority priority) override;
  [[nodiscard]] bool ready(Ticket ticket) const override;
  void wait(Ticket ticket) override;
  void prioritize(Ticket ticket, Priority priority) override;
  void free(Ticket ticket) override;
  bool cancel_write(Ticket ticket) override;
  [[nodiscard]] std::uint64_t free_bytes() const override;

  /// Takes `bytes` of the pool for a tensor that another tier will copy in (a stage: the SSD
  /// store reads into it). Returns the ticket and the memory, or nothing when the pool has no
  /// room. The caller fills the memory before any read() of the ticket.
  std::optional<std::pair<Ticket, void*>> reserve(std::uint64_t bytes);

  [[nodiscard]] std::uint64_t size(Ticket ticket) const;
  [[nodiscard]] HostPoolStats stats() const;

  struct Impl;  ///< opaque

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace tidal::io
