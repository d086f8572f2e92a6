// A tensor's stripes over the store's files (stripes.hpp): round robin, each file's stripes back to
// back in its run, padded to whole blocks.
#include "io/store/stripes.hpp"

#include <algorithm>

#include "tidal/common/units.hpp"
#include "tidal/io/extent_allocator.hpp"

namespace tidal::io::detail {

std::vector<Stripe> stripe_layout(std::uint64_t bytes, std::uint64_t stripe_unit,
                                  std::size_t nfiles, std::size_t first) {
  const std::uint64_t nstripes = (bytes + stripe_unit - 1) / stripe_unit;
  std::vector<Stripe> stripes;
  stripes.reserve(nstripes);
  std::vector<std::uint64_t> cursor(nfiles, 0);
  for (std::uint64_t i = 0; i < nstripes; ++i) {
    const std::size_t f = (first + i) % nfiles;
    const auto len = static_cast<std::uint32_t>(std::min(stripe_unit, bytes - i * stripe_unit));
    stripes.push_back(Stripe{f, cursor[f], i * stripe_unit, len});
    cursor[f] += align_up(len, kBlockSize);
  }
  return stripes;
}

std::vector<std::uint64_t> run_bytes(const std::vector<Stripe>& stripes, std::size_t nfiles) {
  std::vector<std::uint64_t> need(nfiles, 0);
  for (const Stripe& s : stripes) need[s.file] += align_up(s.length, kBlockSize);
  return need;
}

}  // namespace tidal::io::detail
