// The training tokens of the reference trainer: synthetic or a text file's bytes.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace tidal::models {

/// Where training tokens come from: a deterministic synthetic stream (default) or a text file
/// read as bytes (token = byte value, so the model's vocabulary must be at least 256).
/// Deterministic given the seed. Not thread-safe.
class TokenSource {
 public:
  /// Synthetic stream: a noisy affine recurrence over `vocab`, learnable so that losses fall.
  TokenSource(std::int64_t vocab, std::uint64_t seed);

  /// Byte-level text from `path`. Throws tidal::InvalidArgument if the file cannot be read, is
  /// shorter than seq + 1 bytes at first use, or vocab < 256.
  TokenSource(const std::string& path, std::int64_t vocab, std::uint64_t seed);

  /// The next batch: inputs [batch, seq] and targets (inputs shifted by one), int64, on CPU.
  std::pair<torch::Tensor, torch::Tensor> next_batch(std::int64_t batch, std::int64_t seq);

  /// The stream's position (generator state and recurrence), as text, and restoring it: a
  /// source restored to a saved position yields the batches that followed it.
  [[nodiscard]] std::string position() const;
  /// Throws tidal::InvalidArgument when `text` is not a position() of a source.
  void set_position(const std::string& text);

  /// What the stream is drawn from, for a checkpoint to compare at resume: "<n> bytes, XXH3
  /// <hex>" of a data file's contents; "" for the synthetic stream.
  [[nodiscard]] std::string content_id() const;

 private:
  std::int64_t vocab_;
  std::mt19937_64 rng_;
  std::vector<std::uint8_t> text_;  // empty: synthetic
  std::int64_t state_ = 0;          // synthetic stream position
};

}  // namespace tidal::models
