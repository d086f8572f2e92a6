// Test helper: registers a tidal trainer's persistent tensors with a tracer, each with its class.
#pragma once

#include "tidal/models/trainer.hpp"
#include "tidal/torch/tracer.hpp"

namespace tidal::testing {

/// Parameters and optimizer states, and with `gradients` the gradients too.
inline void register_trainer(torch_layer::Tracer& tracer, models::Trainer& trainer,
                             bool gradients = true) {
  const auto named = trainer.persistent_tensors();
  for (const auto& [n, x] : named.parameters)
    tracer.register_persistent(x, n, trace::TensorClass::kParameter);
  if (gradients) {
    for (const auto& [n, x] : named.gradients)
      tracer.register_persistent(x, n, trace::TensorClass::kGradient);
  }
  for (const auto& [n, x] : named.optimizer_state)
    tracer.register_persistent(x, n, trace::TensorClass::kOptimizerState);
}

}  // namespace tidal::testing
