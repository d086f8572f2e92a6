// The reference trainer: data, AdamW and the step loop used by `tidal train`, `tidal profile`,
// the tests and the benchmarks.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tidal/common/optimizer_schedule.hpp"
#include "tidal/models/adamw.hpp"
#include "tidal/models/gpt.hpp"
#include "tidal/models/token_source.hpp"
#include "tidal/plan/model_trace.hpp"
#include "tidal/torch/step.hpp"

namespace tidal::torch_layer {
class Session;
}

namespace tidal::models {

struct TrainerOptions {
  ModelConfig config;
  std::int64_t batch = 8;
  std::int64_t seq = 128;
  std::uint64_t seed = 1234;
  AdamW::Options adamw;
  std::string data_path;  ///< empty: synthetic tokens
  torch::Device device = torch::kCPU;
  /// When the optimizer updates each parameter (after backward by default).
  ///
  /// kInBackward: each parameter is updated by a hook on its gradient
  /// accumulator as soon as backward has completed its gradient, and the gradient is then
  /// dropped (set to none), instead of all parameters after the backward pass with gradients
  /// kept and zeroed. The same math, bit for bit (AdamW is per parameter and the update runs
  /// after every use of the parameter in backward); a gradient then lives from the op that
  /// makes it to its update, and optimizer states are needed for one op each instead of for a
  /// whole phase, which is what lets offloading hide the optimizer step (docs/simulator.md).
  /// Not for training that needs all gradients before any update (clipping by the global norm,
  /// accumulation over micro-batches).
  ///
  /// kDeferred: each parameter is updated right before its first use in the next
  /// step's forward pass (embeddings before the first block, block L's parameters when the
  /// forward pass enters block L, the final norm and head after the last block), and its
  /// gradient is dropped then. The same math, bit for bit, and it works with clip_grad_norm
  /// (each gradient's norm is taken by a hook when backward completes it). The last step's
  /// updates wait for the next step: call Trainer::flush_optimizer() before reading or saving
  /// the parameters.
  OptimizerSchedule optimizer = OptimizerSchedule::kAfterBackward;
  /// Clip the gradients to this global L2 norm before the update (0: no clipping), as
  /// torch.nn.utils.clip_grad_norm_: coefficient min(1, max_norm / (norm + 1e-6)). Needs every
  /// gradient before any update, so not with kInBackward.
  double clip_grad_norm = 0;
  /// Micro-batches per step (gradient accumulation): the batch is cut into this many equal
  /// parts (it must divide the batch), each part's mean loss divided by their number, and the
  /// parameters are updated once, after the last. StepResult::loss is the sum, the whole batch's
  /// mean. Needs the after-backward schedule without clipping (for now).
  std::int64_t micro_batches = 1;
  /// With micro_batches > 1: each micro-batch's forward and backward in turn (kSequential), or
  /// every micro-batch through a layer before the next layer, in forward and in backward
  /// (kLayerMajor, GreedySnake's order): each layer's parameters are then used once a pass for
  /// all micro-batches, so offloading brings them in once instead of once per micro-batch, and
  /// every micro-batch's activations live until backward reaches them. Layer-major cuts the
  /// autograd graph between blocks (each block's input a detached leaf, its gradient handed to
  /// the block below); a parameter's gradient sums its micro-batches in the same order as
  /// kSequential, but a weight used at both ends of the model (GPT-2's embedding, tied to the
  /// head) sums its two uses in another order: the losses match kSequential to rounding, not
  /// bit for bit (for models without tied weights they match bit for bit).
  plan::MicroBatchOrder micro_batch_order = plan::MicroBatchOrder::kSequential;
  // adamw.on_host puts the optimizer step on the host (AdamW::Options::on_host): each gradient
  // goes to the host when backward completes it. Needs the after-backward schedule without
  // clipping (for now).
};

/// What one step produced.
struct StepResult {
  std::int64_t step = 0;
  double loss = 0;
  double seconds = 0;  ///< wall time of the step, the loss read back included
};

/// Builds model, optimizer and data from TrainerOptions and runs training steps. The step loop is
/// step(): batch, forward, backward, optimizer, with StepObserver calls at each boundary.
/// Seeds torch's generator at construction: the same options give the same losses.
/// Not thread-safe; observers are not owned and must outlive their registration.
class Trainer {
 public:
  /// Throws tidal::InvalidArgument on a bad option (seq > max_seq, batch < 1, unreadable data).
  explicit Trainer(TrainerOptions options);

  /// Runs one step and returns its loss and time.
  StepResult step();

  /// Adds an observer called from step(); it is also told each layer forward enters.
  void add_observer(torch_layer::StepObserver* observer);
  /// Removes an observer added before (no-op if absent).
  void remove_observer(torch_layer::StepObserver* observer);

  /// Deferred schedule: applies the updates still pending from the last step (no-op
  /// otherwise). Call before reading or saving the parameters.
  void flush_optimizer();

  [[nodiscard]] Transformer& model() { return model_; }
  [[nodiscard]] AdamW& optimizer() { return optimizer_; }
  [[nodiscard]] const TrainerOptions& options() const { return options_; }
  [[nodiscard]] std::int64_t steps_done() const { return step_; }

  /// A tensor that lives across steps, with its name and class.
  struct PersistentTensor {
    std::string name;  ///< "param:<name>", "buffer:<name>", "grad:<name>", "adamw:<state>.<i>"
    torch::Tensor tensor;
    trace::TensorClass cls;  ///< kParameter (parameters and buffers), kGradient, kOptimizerState
  };
  /// Parameters, buffers, the gradients that exist now (when `gradients`), optimizer state.
  [[nodiscard]] std::vector<PersistentTensor> persistent_tensors(bool gradients = true);

  /// Registers persistent_tensors(gradients) with `registry`: anything with
  /// register_persistent(tensor, name, class), such as a torch_layer::Session or Tracer.
  /// The optimizer's state on the host (AdamW::Options::on_host) is host memory, not the
  /// device's: not registered.
  template <typename Registry>
  void register_persistent(Registry& registry, bool gradients = true) {
    for (const auto& p : persistent_tensors(gradients)) {
      if (p.cls == trace::TensorClass::kOptimizerState && optimizer_.on_host()) continue;
      registry.register_persistent(p.tensor, p.name, p.cls);
    }
  }

  /// Writes everything a resumed run needs to continue bit for bit (parameters, buffers,
  /// optimizer state and step count, the data position and a hash of the data file's contents,
  /// torch's CPU random state, the step) to `path`, atomically (torch_layer::write_checkpoint).
  /// Applies pending deferred updates first (flush_optimizer: the same math). `session`: made
  /// resident first when tensors may be offloaded between steps. Call between steps. Throws
  /// tidal::IoError when the file cannot be written; the previous checkpoint stays intact.
  void save_checkpoint(const std::string& path, torch_layer::Session* session = nullptr);

  /// Restores a checkpoint written by save_checkpoint() with the same model, batch, seq, seed,
  /// data and optimizer options (the optimizer schedule may differ: it is the same math). The
  /// next step() is the step after the saved one. Throws tidal::InvalidArgument when the file is
  /// missing, unreadable or damaged, was written with other options (naming the first that
  /// differs, the model's name last), or on a data file whose contents changed since.
  void load_checkpoint(const std::string& path);

 private:
  [[nodiscard]] bool in_backward() const {
    return options_.optimizer == OptimizerSchedule::kInBackward;
  }
  [[nodiscard]] bool deferred() const { return options_.optimizer == OptimizerSchedule::kDeferred; }
  void notify_phase(trace::Phase phase);
  // Forward enters `layer` (-1: the head): the observers are told, and on the deferred schedule
  // the updates of the parameters that stage uses first run now.
  void enter_layer(std::int64_t layer);
  // The model's stages, driven here so that enter_layer() runs between them: forward_loss() is
  // the model's loss() with the same ops.
  torch::Tensor run_block(std::int64_t layer, const torch::Tensor& x);
  torch::Tensor head_loss(const torch::Tensor& x, const torch::Tensor& targets);
  torch::Tensor forward_loss(const torch::Tensor& tokens, const torch::Tensor& targets);
  // One step's forward and backward over micro-batches (micro_batches > 1); returns the loss.
  torch::Tensor sequential_micro_batches(const torch::Tensor& inputs, const torch::Tensor& targets);
  torch::Tensor layer_major_micro_batches(const torch::Tensor& inputs,
                                          const torch::Tensor& targets);
  // Calls fn(i) after backward has completed parameter i's gradient.
  void on_gradient_ready(std::function<void(std::size_t)> fn);
  // The clipping coefficient of this step's gradients (undefined without clipping).
  [[nodiscard]] torch::Tensor clip_coefficient() const;
  // Deferred schedule: the pending updates of one group of parameters.
  void apply_updates(std::size_t group);

  TrainerOptions options_;
  Transformer model_{nullptr};
  AdamW optimizer_;
  TokenSource data_;
  std::vector<torch_layer::StepObserver*> observers_;
  std::int64_t step_ = 0;
  // The gradient accumulators the update hooks hang on: a parameter holds its accumulator only
  // weakly, so they are kept alive here for the trainer's lifetime.
  // (std::shared_ptr up to torch 2.14, c10::intrusive_ptr from 2.15: whatever it returns.)
  std::vector<decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()))>
      accumulators_;
  std::vector<torch::Tensor> params_;  // the model's parameters, in the optimizer's order
  // Deferred schedule: parameter indices by where forward first uses them (the model's
  // parameter_stages(): 0 before the first block, 1 + L block L, layers + 1 after the last
  // block) and what is still to update.
  // Clipping: each gradient's norm, and the coefficient of the last step.
  std::vector<std::vector<std::size_t>> update_groups_;
  std::vector<char> pending_;
  std::vector<torch::Tensor> grad_norms_;
  torch::Tensor clip_coef_;
};

}  // namespace tidal::models
