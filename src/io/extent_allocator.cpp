#include "tidal/io/extent_allocator.hpp"

#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"

namespace tidal::io {

ExtentAllocator::ExtentAllocator(std::uint64_t capacity)
    : capacity_(capacity / kBlockSize * kBlockSize) {
  if (capacity_ > 0) insert_free(0, capacity_);
}

void ExtentAllocator::insert_free(std::uint64_t offset, std::uint64_t length) {
  by_offset_.emplace(offset, length);
  by_size_.emplace(length, offset);
  free_bytes_ += length;
}

void ExtentAllocator::erase_free(std::map<std::uint64_t, std::uint64_t>::iterator it) {
  by_size_.erase({it->second, it->first});
  free_bytes_ -= it->second;
  by_offset_.erase(it);
}

std::optional<Extent> ExtentAllocator::allocate(std::uint64_t bytes) {
  TIDAL_EXPECT(bytes > 0, "ExtentAllocator::allocate: zero-byte extent requested");
  const std::uint64_t length = align_up(bytes, kBlockSize);
  auto best = by_size_.lower_bound({length, 0});
  if (best == by_size_.end()) return std::nullopt;
  const std::uint64_t offset = best->second;
  const std::uint64_t free_length = best->first;
  erase_free(by_offset_.find(offset));
  if (free_length > length) insert_free(offset + length, free_length - length);
  return Extent{offset, length};
}

void ExtentAllocator::free(Extent e) {
  TIDAL_EXPECT(e.length > 0 && e.offset % kBlockSize == 0 && e.length % kBlockSize == 0 &&
                   e.offset + e.length <= capacity_,
               "ExtentAllocator::free: extent [", e.offset, ", +", e.length,
               ") is not an extent of this file");
  std::uint64_t offset = e.offset;
  std::uint64_t length = e.length;
  auto next = by_offset_.lower_bound(offset);
  TIDAL_EXPECT(next == by_offset_.end() || next->first >= offset + length,
               "ExtentAllocator::free: extent at ", offset, " overlaps free space (double free?)");
  if (next != by_offset_.begin()) {
    auto prev = std::prev(next);
    TIDAL_EXPECT(prev->first + prev->second <= offset, "ExtentAllocator::free: extent at ", offset,
                 " overlaps free space (double free?)");
    if (prev->first + prev->second == offset) {
      offset = prev->first;
      length += prev->second;
      erase_free(prev);
    }
  }
  next = by_offset_.lower_bound(e.offset);
  if (next != by_offset_.end() && next->first == e.offset + e.length) {
    length += next->second;
    erase_free(next);
  }
  insert_free(offset, length);
}

std::uint64_t ExtentAllocator::largest_free() const {
  return by_size_.empty() ? 0 : by_size_.rbegin()->first;
}

}  // namespace tidal::io
