// The two orders of a step's micro-batches (TrainerOptions::micro_batch_order).
#include "tidal/models/trainer.hpp"

namespace tidal::models {

// Gradient accumulation: each micro-batch's forward and backward in turn, its loss divided by
// the number of micro-batches.
torch::Tensor Trainer::sequential_micro_batches(const torch::Tensor& inputs,
                                                const torch::Tensor& targets) {
  const auto n = options_.micro_batches;
  const auto in = inputs.chunk(n, 0);
  const auto tg = targets.chunk(n, 0);
  torch::Tensor total;
  for (std::int64_t m = 0; m < n; ++m) {
    notify_phase(trace::Phase::kForward);
    torch::Tensor loss = forward_loss(in[m], tg[m]) / static_cast<double>(n);
    notify_phase(trace::Phase::kBackward);
    torch::autograd::backward({loss});
    total = m == 0 ? loss.detach() : total + loss.detach();
  }
  return total;
}

// Layer-major (GreedySnake's order): every micro-batch through a layer before the next, in
// forward, and in backward from the last layer down. Each block's input is a detached leaf
// that requires a gradient, so each (layer, micro-batch) is its own graph: backward runs one at
// a time, handing the gradient of a block's input to the block below.
torch::Tensor Trainer::layer_major_micro_batches(const torch::Tensor& inputs,
                                                 const torch::Tensor& targets) {
  const auto n = static_cast<std::size_t>(options_.micro_batches);
  const auto layers = static_cast<std::size_t>(options_.config.layers);
  const auto in = inputs.chunk(static_cast<std::int64_t>(n), 0);
  const auto tg = targets.chunk(static_cast<std::int64_t>(n), 0);
  const auto leaf = [](const torch::Tensor& x) { return x.detach().requires_grad_(true); };

  notify_phase(trace::Phase::kForward);
  std::vector<torch::Tensor> embedded(n);
  for (std::size_t m = 0; m < n; ++m) embedded[m] = model_->embed(in[m]);
  // inputs_of[l][m] / outputs_of[l][m]: block l's detached input and its output, micro-batch m.
  std::vector<std::vector<torch::Tensor>> inputs_of(layers, std::vector<torch::Tensor>(n));
  std::vector<std::vector<torch::Tensor>> outputs_of(layers, std::vector<torch::Tensor>(n));
  std::vector<torch::Tensor> x = embedded;
  for (std::size_t l = 0; l < layers; ++l) {
    for (std::size_t m = 0; m < n; ++m) {
      inputs_of[l][m] = leaf(x[m]);
      outputs_of[l][m] = run_block(static_cast<std::int64_t>(l), inputs_of[l][m]);
      x[m] = outputs_of[l][m];
    }
  }
  std::vector<torch::Tensor> head_in(n);
  std::vector<torch::Tensor> losses(n);
  torch::Tensor total;
  for (std::size_t m = 0; m < n; ++m) {
    head_in[m] = leaf(x[m]);
    losses[m] = head_loss(head_in[m], tg[m]) / static_cast<double>(n);
    total = m == 0 ? losses[m].detach() : total + losses[m].detach();
  }
  x.clear();

  notify_phase(trace::Phase::kBackward);
  std::vector<torch::Tensor> grad(n);
  for (std::size_t m = 0; m < n; ++m) {
    torch::autograd::backward({losses[m]});
    losses[m] = torch::Tensor();
    grad[m] = head_in[m].grad();
    head_in[m] = torch::Tensor();
  }
  for (std::size_t l = layers; l-- > 0;) {
    for (std::size_t m = 0; m < n; ++m) {
      torch::autograd::backward({outputs_of[l][m]}, {grad[m]});
      outputs_of[l][m] = torch::Tensor();
      grad[m] = inputs_of[l][m].grad();
      inputs_of[l][m] = torch::Tensor();
    }
  }
  for (std::size_t m = 0; m < n; ++m) {
    torch::autograd::backward({embedded[m]}, {grad[m]});
    embedded[m] = torch::Tensor();
  }
  return total;
}

}  // namespace tidal::models
