// AdamW, the optimizer of the reference trainer.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace tidal::models {

/// AdamW with decoupled weight decay (Loshchilov & Hutter), written with plain ATen ops so that
/// every state tensor is visible and the same on libtorch 1.13 and 2.x. Weight decay applies to
/// parameters with two or more dimensions (GPT-2 practice). State tensors are created at
/// construction, so they exist (and can be registered with a tracer) before the first step.
/// Not thread-safe. Holds references to the parameters it was given.
class AdamW {
 public:
  struct Options {
    double lr = 3e-4;
    double beta1 = 0.9;
    double beta2 = 0.95;
    double eps = 1e-8;
    double weight_decay = 0.1;
    /// The step on the host: the optimizer updates host copies of the parameters
    /// (fp32 masters, same dtype), its state and the gradients live in host memory (on a CPU
    /// device the meter's host scope, torch_layer::HostMemoryScope; beside a GPU pinned
    /// memory), and each update writes the parameter on the device from its copy. The same
    /// ATen ops on the same values as on the device: bit-identical on a CPU device.
    bool on_host = false;
  };

  AdamW(std::vector<torch::Tensor> params, Options options);

  /// One update of every parameter that has a gradient: begin_step(), then update(i) for each.
  void step();

  /// Starts a step: advances the step count that the bias corrections use. For callers that
  /// update parameters one at a time (the optimizer-in-backward schedule).
  void begin_step();

  /// Updates parameter i from its gradient (nothing when it has none) with the bias
  /// corrections of the step begin_step() started. Runs under torch::NoGradGuard. The same
  /// ATen ops on the same values as step() does for i: the results are bit-identical.
  void update(std::size_t i);

  [[nodiscard]] std::size_t size() const { return params_.size(); }

  /// Zeroes the gradients in place (they stay allocated: persistent across steps). On the host:
  /// the host copies' gradients.
  void zero_grad();

  /// On the host: adds parameter i's gradient into its host copy's (as autograd adds into
  /// `.grad`) and drops it from the device. Call when backward has completed it (a gradient
  /// accumulator's post hook), once per backward pass.
  void take_gradient(std::size_t i);

  /// On the host: the host copies from the parameters (after the parameters were loaded), and
  /// no gradient held.
  void refresh_copies();

  [[nodiscard]] bool on_host() const { return options_.on_host; }

  /// The state tensors with a name: ("exp_avg.<i>", t), ("exp_avg_sq.<i>", t) for parameter i.
  [[nodiscard]] std::vector<std::pair<std::string, torch::Tensor>> named_state() const;

  [[nodiscard]] const Options& options() const { return options_; }
  [[nodiscard]] std::int64_t steps_taken() const { return step_; }
  /// Resuming: the step count the bias corrections continue from.
  void set_steps_taken(std::int64_t steps) { step_ = steps; }

 private:
  // The tensor update(i) changes and the gradient it reads: the parameter and its .grad, or on
  // the host its copy and the copy's gradient.
  [[nodiscard]] torch::Tensor& target(std::size_t i);
  [[nodiscard]] torch::Tensor gradient(std::size_t i) const;

  std::vector<torch::Tensor> params_;
  std::vector<torch::Tensor> copies_;      // on the host: the parameters' host copies
  std::vector<torch::Tensor> copy_grads_;  // on the host: their gradients (undefined: none)
  std::vector<torch::Tensor> exp_avg_;
  std::vector<torch::Tensor> exp_avg_sq_;
  Options options_;
  std::int64_t step_ = 0;
  double step_size_ = 0;  // of the current step, set by begin_step()
  double sqrt_bc2_ = 1;
};

}  // namespace tidal::models
