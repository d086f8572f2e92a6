// The seam between a training loop and tidal's per-step machinery (tracer today; the offload
// Session later). A trainer calls these around the one function that runs a step.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "tidal/trace/trace.hpp"

namespace tidal::torch_layer {

/// Receives the structure of each training step. All calls come from the thread that runs the
/// step, in this order: begin_step, begin_phase (forward, backward, optimizer), end_step. The
/// default implementations do nothing. The trainer does not own observers.
class StepObserver {
 public:
  virtual ~StepObserver() = default;

  /// A step starts. `inputs` are the data tensors fed to it (tokens, targets).
  virtual void begin_step(std::int64_t step, const std::vector<torch::Tensor>& inputs) {}

  /// The step enters a phase. Backward ops may run on an autograd worker thread, but always
  /// between begin_phase(kBackward) and the next begin_phase.
  virtual void begin_phase(trace::Phase phase) {}

  /// The forward pass enters transformer block `layer` (-1: outside any block).
  virtual void begin_layer(std::int64_t layer) {}

  /// The step's ops have all run (the optimizer included).
  virtual void end_step(std::int64_t step) {}
};

}  // namespace tidal::torch_layer
