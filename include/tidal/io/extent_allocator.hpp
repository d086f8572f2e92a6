// Extent allocator for one store file: 4 KiB-aligned extents, best fit, coalescing on free.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <utility>

namespace tidal::io {

/// Alignment of every extent offset and length (O_DIRECT's logical block size, conservatively).
inline constexpr std::uint64_t kBlockSize = 4096;

/// A byte range [offset, offset + length) of a store file.
struct Extent {
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
  friend bool operator==(const Extent& a, const Extent& b) {
    return a.offset == b.offset && a.length == b.length;
  }
};

/// Hands out aligned extents of a file of fixed capacity. Best fit (the smallest free extent that
/// is large enough, lowest offset on ties); freed extents merge with free neighbours.
/// Not thread-safe: the TensorStore serialises calls under its own lock.
class ExtentAllocator {
 public:
  /// capacity is rounded down to kBlockSize.
  explicit ExtentAllocator(std::uint64_t capacity);

  /// An extent of at least `bytes` (rounded up to kBlockSize), or nullopt when no free extent is
  /// large enough. bytes == 0 is an error (throws tidal::Error).
  std::optional<Extent> allocate(std::uint64_t bytes);

  /// Returns an extent obtained from allocate(). Freeing an extent that overlaps free space, or
  /// lies outside the file, throws tidal::Error (a double free is a bug, not a user error).
  void free(Extent e);

  [[nodiscard]] std::uint64_t capacity() const { return capacity_; }
  [[nodiscard]] std::uint64_t free_bytes() const { return free_bytes_; }
  [[nodiscard]] std::uint64_t used_bytes() const { return capacity_ - free_bytes_; }
  /// The largest single extent allocate() could return now.
  [[nodiscard]] std::uint64_t largest_free() const;
  /// Number of free extents (1 for an empty file, more when fragmented).
  [[nodiscard]] std::size_t free_extent_count() const { return by_offset_.size(); }

 private:
  void insert_free(std::uint64_t offset, std::uint64_t length);
  void erase_free(std::map<std::uint64_t, std::uint64_t>::iterator it);

  std::uint64_t capacity_;
  std::uint64_t free_bytes_ = 0;
  std::map<std::uint64_t, std::uint64_t> by_offset_;           // offset -> length
  std::set<std::pair<std::uint64_t, std::uint64_t>> by_size_;  // (length, offset)
};

}  // namespace tidal::io
