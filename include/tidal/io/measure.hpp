// A quick bandwidth measurement of a TensorStore, for hardware models that should describe the
// disks actually in use (the planner's cpu-here preset).
#pragma once

#include <cstdint>
#include <string>

#include "tidal/io/store.hpp"

namespace tidal::io {

struct MeasuredBandwidth {
  double write_bytes_per_second = 0;  ///< over all the store's directories together
  double read_bytes_per_second = 0;
  std::uint64_t bytes = 0;  ///< moved each way
  /// Compute time each byte moved takes from a computation that keeps every core busy: the
  /// CPU work of the I/O itself (submission, checksums, the kernel's and a virtual machine's
  /// share of each request). Measured only when asked (MeasureOptions::compute_cost); 0
  /// otherwise. What the simulator charges to compute when the device is this CPU.
  double write_compute_seconds_per_byte = 0;
  double read_compute_seconds_per_byte = 0;
};

struct MeasureOptions {
  std::uint64_t bytes = 256ull << 20;  ///< moved each way, rounded down to whole blocks
  std::uint64_t block = 1ull << 20;
  int depth = 16;  ///< requests in flight
  /// Also measure what the I/O costs a computation on every core (the *_compute_seconds_per_byte
  /// figures): a spinning workload on each core runs alone, then while each phase moves its
  /// bytes, and the work it lost is divided by the bytes. Adds about 0.1 s.
  bool compute_cost = false;
};

/// Writes then reads `bytes` (rounded to whole `block`s) through `store` with `depth` requests in
/// flight and times both. Uses and frees its own tickets. The probe fits the store: at most half
/// of its free space (bytes and block lowered to that, MeasuredBandwidth::bytes says what moved),
/// so it never fills the store nor counts a store_full against it. Throws tidal::IoError (ENOSPC)
/// saying "bandwidth not measured" and why when the store has less than 2 MiB free, and
/// tidal::IoError if a request fails; the caller then says which figures it uses instead. Not a
/// benchmark (see `tidal bench-io`): no verification beyond the store's checksums, a few hundred
/// MiB at most is enough.
MeasuredBandwidth measure_bandwidth(TensorStore& store, const MeasureOptions& options);
MeasuredBandwidth measure_bandwidth(TensorStore& store, std::uint64_t bytes = 256ull << 20,
                                    std::uint64_t block = 1ull << 20, int depth = 16);

/// Compute time per byte a memory copy of `bytes` takes from a computation that keeps every core
/// busy (the copies of the host-memory tier when the device is this CPU), measured as
/// MeasureOptions::compute_cost measures I/O.
double measure_copy_compute_cost(std::uint64_t bytes = 64ull << 20);

/// The planner's SSD spec for a measurement over `ssds` directories: "<n>x<write>/<read>B/s",
/// each figure per directory (the override format of plan::HardwareOverrides::ssd).
std::string ssd_spec(const MeasuredBandwidth& m, std::size_t ssds);

}  // namespace tidal::io
