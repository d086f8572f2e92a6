// Small statistics over measured samples.
#pragma once

#include <vector>

namespace tidal {

/// The median of `samples`: the middle value, or the mean of the two middle values for an even
/// count; 0 for none. Takes a copy (it reorders it).
double median(std::vector<double> samples);

}  // namespace tidal
