#include "tidal/models/token_source.hpp"

#include <xxhash.h>

#include <fstream>
#include <iterator>
#include <sstream>

#include "tidal/common/error.hpp"

namespace tidal::models {

TokenSource::TokenSource(std::int64_t vocab, std::uint64_t seed) : vocab_(vocab), rng_(seed) {
  TIDAL_EXPECT_AS(InvalidArgument, vocab >= 2, "the vocabulary needs at least two tokens");
}

TokenSource::TokenSource(const std::string& path, std::int64_t vocab, std::uint64_t seed)
    : vocab_(vocab), rng_(seed) {
  TIDAL_EXPECT_AS(InvalidArgument, vocab >= 256,
                  "a data file trains on bytes: the model's vocabulary (", vocab,
                  ") must hold at least 256 tokens");
  std::ifstream in(path, std::ios::binary);
  TIDAL_EXPECT_AS(InvalidArgument, in.good(), "cannot open the data file '", path,
                  "'; check its path");
  text_.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  TIDAL_EXPECT_AS(InvalidArgument, text_.size() >= 2, "the data file '", path, "' is empty");
}

std::pair<torch::Tensor, torch::Tensor> TokenSource::next_batch(std::int64_t batch,
                                                                std::int64_t seq) {
  TIDAL_EXPECT_AS(InvalidArgument, batch >= 1 && seq >= 1, "batch and seq must be at least 1");
  std::vector<std::int64_t> rows(static_cast<std::size_t>(batch * (seq + 1)));
  if (!text_.empty()) {
    TIDAL_EXPECT_AS(InvalidArgument, static_cast<std::int64_t>(text_.size()) > seq,
                    "the data file holds ", text_.size(), " bytes, fewer than seq + 1 = ", seq + 1,
                    "; use a shorter sequence or a longer file");
    std::uniform_int_distribution<std::int64_t> offset(
        0, static_cast<std::int64_t>(text_.size()) - seq - 1);
    for (std::int64_t b = 0; b < batch; ++b) {
      const auto start = offset(rng_);
      for (std::int64_t i = 0; i <= seq; ++i) {
        rows[static_cast<std::size_t>(b * (seq + 1) + i)] =
            text_[static_cast<std::size_t>(start + i)];
      }
    }
  } else {
    // t[i+1] = (5 t[i] + 3) mod vocab, replaced by a random token one time in eight.
    std::uniform_int_distribution<std::int64_t> token(0, vocab_ - 1);
    std::uniform_int_distribution<int> noise(0, 7);
    for (std::int64_t b = 0; b < batch; ++b) {
      for (std::int64_t i = 0; i <= seq; ++i) {
        state_ = noise(rng_) == 0 ? token(rng_) : (5 * state_ + 3) % vocab_;
        rows[static_cast<std::size_t>(b * (seq + 1) + i)] = state_;
      }
    }
  }
  auto all = torch::from_blob(rows.data(), {batch, seq + 1}, torch::kLong).clone();
  return {all.narrow(1, 0, seq).contiguous(), all.narrow(1, 1, seq).contiguous()};
}

std::string TokenSource::position() const {
  std::ostringstream out;
  out << rng_ << ' ' << state_;
  return out.str();
}

std::string TokenSource::content_id() const {
  if (text_.empty()) return "";
  std::ostringstream out;
  out << text_.size() << " bytes, XXH3 " << std::hex << XXH3_64bits(text_.data(), text_.size());
  return out.str();
}

void TokenSource::set_position(const std::string& text) {
  std::istringstream in(text);
  std::mt19937_64 rng;
  std::int64_t state = 0;
  in >> rng >> state;
  TIDAL_EXPECT_AS(InvalidArgument, !in.fail(), "not a data position: '", text.substr(0, 40),
                  "...'");
  rng_ = rng;
  state_ = state;
}

}  // namespace tidal::models
