// tidal's public C++ API in one include. Start here:
//
//   tidal/torch/session.hpp   Session: wrap each training step (begin_step/end_step); the whole
//                             runtime (profile, plan, execute; or activation offloading).
//   tidal/io/store.hpp        TensorStore: tensors' bytes striped over SSD directories.
//   tidal/plan/planner.hpp    make_plan: which tensors leave memory, when, and where to.
//   tidal/plan/simulator.hpp  simulate: a plan's iteration on a hardware model.
//   tidal/trace/trace.hpp     Trace: the ops of an iteration and the tensors they touch.
//
// The torch-free layers (common, io, trace, plan) build without libtorch; the torch layer is
// included only where tidal was built with it (TIDAL_WITH_TORCH).
#pragma once

#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"
#include "tidal/io/host_pool.hpp"
#include "tidal/io/store.hpp"
#include "tidal/plan/bound.hpp"
#include "tidal/plan/hardware.hpp"
#include "tidal/plan/plan.hpp"
#include "tidal/plan/planner.hpp"
#include "tidal/plan/simulator.hpp"
#include "tidal/plan/timeline.hpp"
#include "tidal/trace/io.hpp"
#include "tidal/trace/lifetime.hpp"
#include "tidal/trace/trace.hpp"

#if defined(TIDAL_WITH_TORCH) && TIDAL_WITH_TORCH
#include "tidal/torch/checkpoint.hpp"
#include "tidal/torch/session.hpp"
#include "tidal/torch/training_checkpoint.hpp"
#endif
