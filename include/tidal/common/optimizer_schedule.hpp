// When the optimizer updates each parameter within a training iteration: one name for the
// trainers (models/) and the analytic traces (plan/). Torch-free.
#pragma once

#include <cstdint>
#include <string>

namespace tidal {

enum class OptimizerSchedule : std::uint8_t {
  /// Every update after the backward pass (optimizer.step() after loss.backward()).
  kAfterBackward,
  /// Each parameter's update right after backward completes its gradient (PyTorch's
  /// register_post_accumulate_grad_hook, torchtune's optimizer_in_bwd); no global-norm clipping.
  kInBackward,
  /// Each parameter's update right before its first use in the next forward pass; works with
  /// clipping by the global norm.
  kDeferred,
};

/// The schedule two exclusive switches ask for (the CLI's --optimizer-in-backward and
/// --optimizer-deferred); after backward when neither is set.
inline OptimizerSchedule optimizer_schedule(bool in_backward, bool deferred) {
  if (in_backward) return OptimizerSchedule::kInBackward;
  return deferred ? OptimizerSchedule::kDeferred : OptimizerSchedule::kAfterBackward;
}

/// "after-backward", "in-backward", "deferred" (the traces' meta.optimizer_schedule).
const char* to_string(OptimizerSchedule s);
/// Inverse of to_string; throws tidal::InvalidArgument listing the names.
OptimizerSchedule optimizer_schedule_from_string(const std::string& s);

}  // namespace tidal
