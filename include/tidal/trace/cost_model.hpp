// Op times for a trace recorded without running its ops (Python's tidal.fake_trace), from a
// roofline: what the executed steps then measure replaces them.
#pragma once

#include <cstdint>

#include "tidal/trace/trace.hpp"

namespace tidal::trace {

/// The rates an op's time is taken from.
struct Roofline {
  double flops = 0;           ///< matrix-product FLOP/s (> 0)
  double bytes_per_s = 0;     ///< memory bandwidth (> 0)
  int element_bytes = 4;      ///< of the matrix products' operands (2 for bf16)
  double op_overhead = 5e-6;  ///< seconds each op costs beyond its work (launch, dispatch)
};

/// Each op's time: the longer of its FLOPs at `r.flops` (a matrix product's 2*m*k*n, which is
/// 2*sqrt(a*b*c) for its two largest inputs' and its output's element counts; a batched
/// product is overestimated by the square root of its batch) and the bytes it reads and writes
/// at `r.bytes_per_s`, plus `r.op_overhead`; the ops laid end to end from 0. The step-end op
/// takes no time. Throws tidal::InvalidArgument for rates that are not positive.
void model_op_times(Trace& trace, const Roofline& r);

}  // namespace tidal::trace
