// `tidal simulate --svg`: device memory over the iteration under each policy, as an SVG picture.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tidal/plan/policies.hpp"

namespace tidal::cli {

/// The SVG document: a line per policy's memory_per_op (its bucket maxima, at most 1500 points)
/// against `capacity`, titled `title`.
std::string svg_plot(const std::vector<plan::PolicyResult>& results, std::uint64_t capacity,
                     const std::string& title);

}  // namespace tidal::cli
