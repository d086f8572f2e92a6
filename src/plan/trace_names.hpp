// The trace types that the plan layer's sources name without `trace::`.
#pragma once

#include "tidal/trace/trace.hpp"

namespace tidal::plan {

using trace::OpIndex;
using trace::Phase;
using trace::TensorClass;
using trace::TensorId;

}  // namespace tidal::plan
