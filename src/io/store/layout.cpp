// Where a tensor's bytes go: its stripes (stripes.hpp) placed in extents of the store's files.
#include <algorithm>
#include <optional>

#include "io/store/store_impl.hpp"
#include "tidal/common/units.hpp"

namespace tidal::io {

// Places e.bytes over the files: stripe i on file (start + i) % F, one contiguous extent per
// file when possible, else one extent per stripe on any file with room.
bool TensorStore::Impl::layout(Entry& e) {
  const std::size_t nfiles = files.size();
  // Continue the round robin where the previous tensor stopped, as RAID-0 does, so stripes
  // spread evenly however tensor sizes fall.
  const std::size_t start = rotate % nfiles;
  const std::vector<detail::Stripe> stripes =
      detail::stripe_layout(e.bytes, opt.stripe_unit, nfiles, start);
  rotate += stripes.size();
  std::vector<Extent> run(nfiles);
  const bool ok = allocate_runs(e, detail::run_bytes(stripes, nfiles), run);
  e.pieces.clear();
  if (ok) {
    for (const detail::Stripe& s : stripes) {
      e.pieces.push_back(Piece{static_cast<int>(s.file), run[s.file].offset + s.run_offset,
                               s.tensor_offset, s.length, 0});
    }
    return true;
  }
  release_extents(e);
  return place_each_stripe(e, stripes);
}

bool TensorStore::Impl::allocate_runs(Entry& e, const std::vector<std::uint64_t>& need,
                                      std::vector<Extent>& run) {
  for (std::size_t f = 0; f < need.size(); ++f) {
    if (need[f] == 0) continue;
    auto x = files[f]->extents->allocate(need[f]);
    if (!x) return false;
    run[f] = *x;
    e.extents.emplace_back(static_cast<int>(f), *x);
  }
  return true;
}

// Fragmented: one extent per stripe, preferring the round-robin file.
bool TensorStore::Impl::place_each_stripe(Entry& e, const std::vector<detail::Stripe>& stripes) {
  const std::size_t nfiles = files.size();
  for (const detail::Stripe& s : stripes) {
    std::optional<Extent> x;
    std::size_t f = s.file;
    for (std::size_t k = 0; k < nfiles && !x; ++k) {
      f = (s.file + k) % nfiles;
      x = files[f]->extents->allocate(s.length);
    }
    if (!x) {
      release_extents(e);
      e.pieces.clear();
      return false;
    }
    e.extents.emplace_back(static_cast<int>(f), *x);
    e.pieces.push_back(Piece{static_cast<int>(f), x->offset, s.tensor_offset, s.length, 0});
  }
  return true;
}

void TensorStore::Impl::release_extents(Entry& e) {
  for (const auto& [f, x] : e.extents) files[static_cast<std::size_t>(f)]->extents->free(x);
  e.extents.clear();
}

}  // namespace tidal::io
