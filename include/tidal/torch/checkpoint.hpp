// Activation checkpointing (layer-wise recompute) for libtorch C++, which has no
// torch.utils.checkpoint: the block runs without saving activations in forward and is run
// again, with autograd on, during backward. The "recompute" point of the ROK curve.
#pragma once

#include <torch/torch.h>

#include <functional>

namespace tidal::torch_layer {

/// y = fn(x), keeping only x for backward. fn must be deterministic (no dropout or other RNG),
/// and may read parameters, whose gradients accumulate as usual. Thread: the caller's; the
/// recomputation runs on autograd's thread in backward.
torch::Tensor checkpoint(const std::function<torch::Tensor(const torch::Tensor&)>& fn,
                         const torch::Tensor& x);

}  // namespace tidal::torch_layer
