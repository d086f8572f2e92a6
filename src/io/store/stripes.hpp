// Internal to io/store/: how one tensor is striped over the store's files, as a pure function of
// its size, the stripe unit and the number of files (no files opened, no space allocated): which
// file holds each stripe, and where in that file's run of the tensor. The store then puts each
// file's run in one extent of that file (or, when the files are fragmented, each stripe in an
// extent of its own).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace tidal::io::detail {

/// One stripe of a tensor: `length` tensor bytes from `tensor_offset`, on file `file`, at
/// `run_offset` bytes from the start of that file's run (the tensor's stripes on that file, each
/// padded to whole blocks, back to back, in tensor order).
struct Stripe {
  std::size_t file = 0;
  std::uint64_t run_offset = 0;
  std::uint64_t tensor_offset = 0;
  std::uint32_t length = 0;
};

/// A tensor of `bytes` cut into stripes of `stripe_unit` bytes (the last one shorter), stripe i
/// on file (first + i) % nfiles: round robin, like a software RAID-0, starting where the previous
/// tensor stopped so that stripes spread evenly however tensor sizes fall. No stripe for 0 bytes.
/// Requires stripe_unit > 0 (a multiple of kBlockSize, as the store's options check) and
/// nfiles > 0. Pure: thread-safe.
std::vector<Stripe> stripe_layout(std::uint64_t bytes, std::uint64_t stripe_unit,
                                  std::size_t nfiles, std::size_t first);

/// The bytes of each of the nfiles runs of `stripes` (stripe_layout's): its stripes, each padded
/// to whole blocks. 0 for a file that holds none.
std::vector<std::uint64_t> run_bytes(const std::vector<Stripe>& stripes, std::size_t nfiles);

}  // namespace tidal::io::detail
