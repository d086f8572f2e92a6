#include "tidal/common/stats.hpp"

#include <algorithm>
#include <cstddef>

namespace tidal {

double median(std::vector<double> samples) {
  if (samples.empty()) return 0;
  const std::size_t mid = samples.size() / 2;
  const auto mid_it = samples.begin() + static_cast<std::ptrdiff_t>(mid);
  std::nth_element(samples.begin(), mid_it, samples.end());
  const double upper = *mid_it;
  if (samples.size() % 2 == 1) return upper;
  return (*std::max_element(samples.begin(), mid_it) + upper) / 2;
}

}  // namespace tidal
