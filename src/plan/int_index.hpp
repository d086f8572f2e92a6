// Indexing by int (private to plan/): the planner and the simulator count ops, positions and
// tensors in int (trace::OpIndex, trace::TensorId), the standard containers in std::size_t.
#pragma once

#include <cstddef>

namespace tidal::plan::detail {

/// v[i] for an index counted in int (non-negative), without a cast at each use.
template <class Vector>
decltype(auto) at(Vector& v, int i) {
  return v[static_cast<std::size_t>(i)];
}

}  // namespace tidal::plan::detail
