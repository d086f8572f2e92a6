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
};

/// Writes then reads `bytes` (rounded to whole `block`s) through `store` with `depth` requests in
/// flight and times both. Uses and frees its own tickets; needs that much free capacity.
/// Throws tidal::IoError if a request fails. Not a benchmark (see `tidal bench-io`): no
/// verification beyond the store's checksums, a few hundred MiB at most is enough.
MeasuredBandwidth measure_bandwidth(TensorStore& store, std::uint64_t bytes = 256ull << 20,
                                    std::uint64_t block = 1ull << 20, int depth = 16);

/// The planner's SSD spec for a measurement over `ssds` directories: "<n>x<write>/<read>B/s",
/// each figure per directory (the override format of plan::HardwareOverrides::ssd).
std::string ssd_spec(const MeasuredBandwidth& m, std::size_t ssds);

}  // namespace tidal::io
