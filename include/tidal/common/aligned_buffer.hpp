// An owning block of host memory whose start is aligned, as O_DIRECT and io_uring's fixed
// buffers need: one class instead of a deleter and a null check at every allocation.
#pragma once

#include <cstddef>

namespace tidal {

/// Owns `size()` bytes at an address that is a multiple of `alignment()`. The allocation is
/// rounded up to a whole number of alignments, so a buffer of an odd size may still be handed
/// whole to an I/O that moves aligned blocks. A buffer of 0 bytes owns nothing: data() is null.
///
/// Move-only; a moved-from buffer is empty. Not thread-safe: one owner at a time (the bytes
/// themselves may be shared with threads the owner coordinates, as any memory).
class AlignedBuffer {
 public:
  /// What the bytes hold after construction.
  enum class Fill {
    kUninitialized,  ///< whatever the allocator left there (the caller writes them all)
    kZero,           ///< every byte 0
  };

  /// An empty buffer: size() 0, data() null.
  AlignedBuffer() noexcept = default;
  /// Allocates `bytes` bytes aligned to `alignment` (a power of two). Throws tidal::Error when
  /// the alignment is not a power of two or the memory cannot be had.
  AlignedBuffer(std::size_t bytes, std::size_t alignment, Fill fill = Fill::kUninitialized);
  AlignedBuffer(AlignedBuffer&& other) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer();

  [[nodiscard]] unsigned char* data() noexcept { return data_; }
  [[nodiscard]] const unsigned char* data() const noexcept { return data_; }
  /// The bytes asked for (the allocation behind them may be rounded up to the alignment).
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] std::size_t alignment() const noexcept { return alignment_; }
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }

 private:
  unsigned char* data_ = nullptr;
  std::size_t size_ = 0;
  std::size_t alignment_ = 1;
};

}  // namespace tidal
