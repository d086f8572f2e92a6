#include "tidal/models/trainer.hpp"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <chrono>

#include "tidal/common/error.hpp"

namespace tidal::models {

namespace {

Transformer seeded_model(const TrainerOptions& o) {
  TIDAL_EXPECT_AS(InvalidArgument, o.batch >= 1, "the batch must be at least 1");
  TIDAL_EXPECT_AS(InvalidArgument, o.seq >= 1 && o.seq <= o.config.max_seq, "the sequence length ",
                  o.seq, " is outside 1..", o.config.max_seq, " for model ", o.config.name);
  torch::manual_seed(o.seed);
  return make_model(o.config, o.device);
}

TokenSource make_source(const TrainerOptions& o) {
  if (o.data_path.empty()) return TokenSource(o.config.vocab, o.seed);
  return TokenSource(o.data_path, o.config.vocab, o.seed);
}

// Each group of `groups` as the indices of its tensors in `params`, ascending.
std::vector<std::vector<std::size_t>> parameter_indices(
    const std::vector<std::vector<torch::Tensor>>& groups,
    const std::vector<torch::Tensor>& params) {
  std::vector<std::vector<std::size_t>> out(groups.size());
  for (std::size_t g = 0; g < groups.size(); ++g) {
    for (const auto& t : groups[g]) {
      const auto it = std::find_if(params.begin(), params.end(), [&t](const torch::Tensor& p) {
        return p.unsafeGetTensorImpl() == t.unsafeGetTensorImpl();
      });
      TIDAL_EXPECT(it != params.end(), "a parameter of stage ", g, " is not the model's");
      out[g].push_back(static_cast<std::size_t>(it - params.begin()));
    }
    std::sort(out[g].begin(), out[g].end());
  }
  return out;
}

}  // namespace

Trainer::Trainer(TrainerOptions options)
    : options_(std::move(options)),
      model_(seeded_model(options_)),
      optimizer_(model_->parameters(), options_.adamw),
      data_(make_source(options_)),
      params_(model_->parameters()) {
  TIDAL_EXPECT_AS(InvalidArgument, options_.clip_grad_norm >= 0, "the clipping norm must be >= 0");
  TIDAL_EXPECT_AS(InvalidArgument, options_.clip_grad_norm == 0 || !in_backward(),
                  "clipping by the global norm needs every gradient before any update, which "
                  "the in-backward schedule does not wait for; use the deferred schedule");
  TIDAL_EXPECT(params_.size() == optimizer_.size(), "optimizer and model disagree on parameters");
  TIDAL_EXPECT_AS(InvalidArgument,
                  options_.micro_batches >= 1 && options_.batch % options_.micro_batches == 0,
                  "micro-batches must divide the batch: ", options_.micro_batches,
                  " micro-batches of a batch of ", options_.batch);
  TIDAL_EXPECT_AS(
      InvalidArgument,
      options_.micro_batches == 1 ||
          (options_.optimizer == OptimizerSchedule::kAfterBackward && options_.clip_grad_norm == 0),
      "micro-batches need the after-backward optimizer schedule without clipping "
      "(the other schedules update a parameter after one micro-batch's gradient)");
  TIDAL_EXPECT_AS(
      InvalidArgument,
      !optimizer_.on_host() ||
          (options_.optimizer == OptimizerSchedule::kAfterBackward && options_.clip_grad_norm == 0),
      "the optimizer step on the host runs after backward, without clipping (for "
      "now): leave out --optimizer-in-backward, --optimizer-deferred and "
      "--clip-grad-norm, or keep the step on the device");
  if (optimizer_.on_host()) {
    on_gradient_ready([this](std::size_t i) { optimizer_.take_gradient(i); });
  }
  if (in_backward()) {
    on_gradient_ready([this](std::size_t i) {
      optimizer_.update(i);
      params_[i].mutable_grad() = torch::Tensor();  // set to none: a new one next backward
    });
  }
  if (deferred()) {
    update_groups_ = parameter_indices(model_->parameter_stages(), params_);
    pending_.assign(params_.size(), 0);
  }
  if (options_.clip_grad_norm > 0) {
    // Each gradient's norm when backward completes it: the clipping coefficient is then known
    // when backward ends, without reading every gradient again.
    grad_norms_.resize(params_.size());
    on_gradient_ready([this](std::size_t i) {
      torch::NoGradGuard no_grad;
      grad_norms_[i] = params_[i].grad().norm();
    });
  }
}

namespace {

// Runs after a gradient accumulator has added the last contribution of this backward pass to
// its parameter's .grad.
class GradientReadyHook : public torch::autograd::FunctionPostHook {
 public:
  explicit GradientReadyHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& /*inputs*/) override {
    fn_();
    return outputs;
  }

 private:
  std::function<void()> fn_;
};

}  // namespace

void Trainer::on_gradient_ready(std::function<void(std::size_t)> fn) {
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const auto& p = params_[i];
    TIDAL_EXPECT(p.is_leaf() && p.requires_grad(), "parameter ", i,
                 " is not a leaf that requires grad; gradient hooks need one");
    auto acc = torch::autograd::impl::grad_accumulator(p);
    TIDAL_EXPECT(acc != nullptr, "no gradient accumulator for parameter ", i);
    acc->add_post_hook(std::make_unique<GradientReadyHook>([fn, i] { fn(i); }));
    accumulators_.push_back(std::move(acc));
  }
}

torch::Tensor Trainer::clip_coefficient() const {
  if (options_.clip_grad_norm <= 0) return {};
  std::vector<torch::Tensor> norms;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].grad().defined() && grad_norms_[i].defined()) norms.push_back(grad_norms_[i]);
  }
  if (norms.empty()) return {};
  torch::NoGradGuard no_grad;
  const torch::Tensor total = torch::stack(norms).norm();
  return (options_.clip_grad_norm / (total + 1e-6)).clamp_max(1.0);
}

void Trainer::apply_updates(std::size_t group) {
  if (group >= update_groups_.size()) return;
  torch::NoGradGuard no_grad;
  for (const std::size_t i : update_groups_[group]) {
    if (pending_[i] == 0) continue;
    pending_[i] = 0;
    auto& p = params_[i];
    if (!p.grad().defined()) continue;
    if (clip_coef_.defined()) p.mutable_grad().mul_(clip_coef_);
    optimizer_.update(i);
    p.mutable_grad() = torch::Tensor();
  }
}

void Trainer::flush_optimizer() {
  for (std::size_t g = 0; g < update_groups_.size(); ++g) apply_updates(g);
}

void Trainer::add_observer(torch_layer::StepObserver* observer) {
  TIDAL_EXPECT(observer != nullptr, "add_observer: null observer");
  if (std::find(observers_.begin(), observers_.end(), observer) == observers_.end()) {
    observers_.push_back(observer);
  }
}

void Trainer::remove_observer(torch_layer::StepObserver* observer) {
  observers_.erase(std::remove(observers_.begin(), observers_.end(), observer), observers_.end());
}

void Trainer::notify_phase(trace::Phase phase) {
  for (auto* o : observers_) o->begin_phase(phase);
}

void Trainer::enter_layer(std::int64_t layer) {
  for (auto* o : observers_) o->begin_layer(layer);
  if (deferred()) {
    apply_updates(static_cast<std::size_t>(layer >= 0 ? layer + 1 : options_.config.layers + 1));
  }
}

torch::Tensor Trainer::run_block(std::int64_t layer, const torch::Tensor& x) {
  enter_layer(layer);
  return model_->block(layer, x);
}

torch::Tensor Trainer::head_loss(const torch::Tensor& x, const torch::Tensor& targets) {
  enter_layer(-1);
  return model_->head_loss(x, targets);
}

torch::Tensor Trainer::forward_loss(const torch::Tensor& tokens, const torch::Tensor& targets) {
  torch::Tensor x = model_->embed(tokens);
  for (std::int64_t l = 0; l < options_.config.layers; ++l) x = run_block(l, x);
  return head_loss(x, targets);
}

StepResult Trainer::step() {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  auto [inputs, targets] = data_.next_batch(options_.batch, options_.seq);
  if (options_.device != torch::Device(torch::kCPU)) {
    inputs = inputs.to(options_.device);
    targets = targets.to(options_.device);
  }
  for (auto* o : observers_) o->begin_step(step_, {inputs, targets});

  torch::Tensor loss;
  if (options_.micro_batches > 1) {
    loss = options_.micro_batch_order == plan::MicroBatchOrder::kLayerMajor
               ? layer_major_micro_batches(inputs, targets)
               : sequential_micro_batches(inputs, targets);
  } else {
    notify_phase(trace::Phase::kForward);
    // Deferred: the last step's updates run as forward reaches each parameter (enter_layer).
    apply_updates(0);
    loss = forward_loss(inputs, targets);
    flush_optimizer();  // deferred: any parameter forward did not reach

    notify_phase(trace::Phase::kBackward);
    // Optimizer-in-backward: the hooks update each parameter during backward, with this step's
    // bias corrections.
    if (in_backward()) optimizer_.begin_step();
    for (auto& n : grad_norms_) n = torch::Tensor();  // the hooks take this backward's norms
    // torch::autograd::backward rather than Tensor::backward: the latter is itself a dispatched
    // op (aten::_backward) and would hide the backward ops from a tracer as nested calls.
    torch::autograd::backward({loss});
  }

  notify_phase(trace::Phase::kOptimizer);
  clip_coef_ = clip_coefficient();
  if (deferred()) {
    // This step's bias corrections and clipping coefficient serve the updates in the next
    // forward pass.
    optimizer_.begin_step();
    std::fill(pending_.begin(), pending_.end(), 1);
  } else if (!in_backward()) {
    if (clip_coef_.defined()) {
      torch::NoGradGuard no_grad;
      for (auto& p : params_) {
        if (p.grad().defined()) p.mutable_grad().mul_(clip_coef_);
      }
    }
    optimizer_.step();
    optimizer_.zero_grad();
  }

  for (auto* o : observers_) o->end_step(step_);

  StepResult r;
  r.step = step_++;
  r.loss = loss.item<double>();  // also waits for the device
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return r;
}

std::vector<Trainer::PersistentTensor> Trainer::persistent_tensors(bool gradients) {
  std::vector<PersistentTensor> out;
  for (const auto& p : model_->named_parameters()) {
    out.push_back({"param:" + p.key(), p.value(), trace::TensorClass::kParameter});
  }
  for (const auto& b : model_->named_buffers()) {
    out.push_back({"buffer:" + b.key(), b.value(), trace::TensorClass::kParameter});
  }
  if (gradients) {
    for (const auto& p : model_->named_parameters()) {
      if (p.value().grad().defined()) {
        out.push_back({"grad:" + p.key(), p.value().grad(), trace::TensorClass::kGradient});
      }
    }
  }
  for (auto& s : optimizer_.named_state()) {
    out.push_back({"adamw:" + s.first, s.second, trace::TensorClass::kOptimizerState});
  }
  return out;
}

}  // namespace tidal::models
