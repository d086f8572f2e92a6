// Where a tensor's bytes go: its stripes placed round robin over the files, in extents.
#include <algorithm>
#include <optional>

#include "io/store/store_impl.hpp"
#include "tidal/common/units.hpp"

namespace tidal::io {

// Places e.bytes over the files: stripe i on file (start + i) % F, one contiguous extent per
// file when possible, else one extent per stripe on any file with room.
bool TensorStore::Impl::layout(Entry& e) {
  const std::uint64_t unit = opt.stripe_unit;
  const std::uint64_t nstripes = (e.bytes + unit - 1) / unit;
  const std::size_t nfiles = files.size();
  // Continue the round robin where the previous tensor stopped, as RAID-0 does, so stripes
  // spread evenly however tensor sizes fall.
  const std::size_t start = rotate % nfiles;
  rotate += nstripes;
  auto stripe_len = [&](std::uint64_t i) {
    return static_cast<std::uint32_t>(std::min(unit, e.bytes - i * unit));
  };
  std::vector<std::uint64_t> need(nfiles, 0);
  for (std::uint64_t i = 0; i < nstripes; ++i) {
    need[(start + i) % nfiles] += align_up(stripe_len(i), kBlockSize);
  }
  std::vector<Extent> run(nfiles);
  bool ok = true;
  for (std::size_t f = 0; f < nfiles && ok; ++f) {
    if (need[f] == 0) continue;
    auto x = files[f]->extents->allocate(need[f]);
    if (x) {
      run[f] = *x;
      e.extents.emplace_back(static_cast<int>(f), *x);
    } else {
      ok = false;
    }
  }
  e.pieces.clear();
  if (ok) {
    std::vector<std::uint64_t> cursor(nfiles, 0);
    for (std::uint64_t i = 0; i < nstripes; ++i) {
      const std::size_t f = (start + i) % nfiles;
      const std::uint32_t len = stripe_len(i);
      e.pieces.push_back(Piece{static_cast<int>(f), run[f].offset + cursor[f], i * unit, len, 0});
      cursor[f] += align_up(len, kBlockSize);
    }
    return true;
  }
  release_extents(e);
  // Fragmented: one extent per stripe, preferring the round-robin file.
  for (std::uint64_t i = 0; i < nstripes; ++i) {
    const std::uint32_t len = stripe_len(i);
    std::optional<Extent> x;
    std::size_t f = (start + i) % nfiles;
    for (std::size_t k = 0; k < nfiles && !x; ++k) {
      f = (start + i + k) % nfiles;
      x = files[f]->extents->allocate(len);
    }
    if (!x) {
      release_extents(e);
      e.pieces.clear();
      return false;
    }
    e.extents.emplace_back(static_cast<int>(f), *x);
    e.pieces.push_back(Piece{static_cast<int>(f), x->offset, i * unit, len, 0});
  }
  return true;
}

void TensorStore::Impl::release_extents(Entry& e) {
  for (const auto& [f, x] : e.extents) files[static_cast<std::size_t>(f)]->extents->free(x);
  e.extents.clear();
}

}  // namespace tidal::io
