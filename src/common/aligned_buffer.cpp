#include "tidal/common/aligned_buffer.hpp"

#include <cstdlib>
#include <cstring>
#include <limits>
#include <utility>

#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"

namespace tidal {

AlignedBuffer::AlignedBuffer(std::size_t bytes, std::size_t alignment, Fill fill)
    : size_(bytes), alignment_(alignment) {
  TIDAL_EXPECT(alignment > 0 && (alignment & (alignment - 1)) == 0, "buffer alignment ", alignment,
               " is not a power of two");
  if (bytes == 0) return;
  // aligned_alloc wants a whole number of alignments; this bound keeps the rounding from
  // overflowing.
  TIDAL_EXPECT(bytes <= std::numeric_limits<std::size_t>::max() - alignment,
               "out of memory allocating ", format_bytes(static_cast<double>(bytes)));
  const auto allocated = static_cast<std::size_t>(align_up(bytes, alignment));
  data_ = static_cast<unsigned char*>(std::aligned_alloc(alignment, allocated));
  TIDAL_EXPECT(data_ != nullptr, "out of memory allocating ",
               format_bytes(static_cast<double>(bytes)));
  if (fill == Fill::kZero) std::memset(data_, 0, allocated);
}

AlignedBuffer::AlignedBuffer(AlignedBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      alignment_(std::exchange(other.alignment_, 1)) {}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& other) noexcept {
  if (this != &other) {
    std::free(data_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    alignment_ = std::exchange(other.alignment_, 1);
  }
  return *this;
}

AlignedBuffer::~AlignedBuffer() { std::free(data_); }

}  // namespace tidal
