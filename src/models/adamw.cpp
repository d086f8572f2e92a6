#include "tidal/models/adamw.hpp"

#include <cmath>

#include "tidal/torch/memory.hpp"

namespace tidal::models {

namespace {

// Host memory for the step's tensors: the meter's host scope on a CPU device (beside a GPU they
// are made pinned on the CPU: host_like).
bool use_host_scope(bool on_host, const torch::Tensor& p) { return on_host && p.device().is_cpu(); }

torch::Tensor host_like(const torch::Tensor& p) {
  auto options = p.options().device(torch::kCPU);
  if (!p.device().is_cpu()) options = options.pinned_memory(true);
  return torch::empty_strided(p.sizes(), p.strides(), options);
}

}  // namespace

AdamW::AdamW(std::vector<torch::Tensor> params, Options options)
    : params_(std::move(params)), options_(options) {
  torch::NoGradGuard no_grad;
  exp_avg_.reserve(params_.size());
  exp_avg_sq_.reserve(params_.size());
  for (const auto& p : params_) {
    const torch_layer::HostMemoryScope scope(use_host_scope(options_.on_host, p));
    if (options_.on_host) {
      copies_.push_back(host_like(p).copy_(p));
      copy_grads_.emplace_back();
    }
    const auto& like = options_.on_host ? copies_.back() : p;
    exp_avg_.push_back(torch::zeros_like(like));
    exp_avg_sq_.push_back(torch::zeros_like(like));
  }
}

torch::Tensor& AdamW::target(std::size_t i) {
  return options_.on_host ? copies_.at(i) : params_.at(i);
}

torch::Tensor AdamW::gradient(std::size_t i) const {
  return options_.on_host ? copy_grads_.at(i) : params_.at(i).grad();
}

void AdamW::take_gradient(std::size_t i) {
  auto& p = params_.at(i);
  const torch::Tensor g = p.grad();
  if (!options_.on_host || !g.defined()) return;
  {
    torch::NoGradGuard no_grad;
    const torch_layer::HostMemoryScope scope(use_host_scope(true, p));
    auto& held = copy_grads_.at(i);
    if (!held.defined()) {
      held = host_like(g).copy_(g);
    } else {
      held.add_(g.device().is_cpu() ? g : g.to(torch::kCPU));
    }
  }
  p.mutable_grad() = torch::Tensor();
}

void AdamW::refresh_copies() {
  torch::NoGradGuard no_grad;
  for (std::size_t i = 0; i < copies_.size(); ++i) {
    copies_[i].copy_(params_[i]);
    copy_grads_[i] = torch::Tensor();
  }
}

void AdamW::step() {
  begin_step();
  for (std::size_t i = 0; i < params_.size(); ++i) update(i);
}

void AdamW::begin_step() {
  ++step_;
  const double t = static_cast<double>(step_);
  const double bias_correction1 = 1.0 - std::pow(options_.beta1, t);
  const double bias_correction2 = 1.0 - std::pow(options_.beta2, t);
  step_size_ = options_.lr / bias_correction1;
  sqrt_bc2_ = std::sqrt(bias_correction2);
}

void AdamW::update(std::size_t i) {
  torch::NoGradGuard no_grad;
  const torch::Tensor g = gradient(i);
  if (!g.defined()) return;
  {
    const torch_layer::HostMemoryScope scope(use_host_scope(options_.on_host, params_.at(i)));
    auto& p = target(i);
    if (options_.weight_decay != 0 && p.dim() >= 2) {
      p.mul_(1.0 - options_.lr * options_.weight_decay);
    }
    exp_avg_[i].mul_(options_.beta1).add_(g, 1.0 - options_.beta1);
    exp_avg_sq_[i].mul_(options_.beta2).addcmul_(g, g, 1.0 - options_.beta2);
    auto denom = (exp_avg_sq_[i].sqrt() / sqrt_bc2_).add_(options_.eps);
    p.addcdiv_(exp_avg_[i], denom, -step_size_);
  }
  // Beside a GPU the copy is queued on the current stream: the step's end (reading the loss)
  // waits for it before the next update changes the host copy.
  if (options_.on_host) params_[i].copy_(copies_[i], /*non_blocking=*/true);
}

void AdamW::zero_grad() {
  torch::NoGradGuard no_grad;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    auto g = gradient(i);
    if (g.defined()) g.zero_();
  }
}

std::vector<std::pair<std::string, torch::Tensor>> AdamW::named_state() const {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  out.reserve(2 * params_.size());
  for (std::size_t i = 0; i < params_.size(); ++i) {
    out.emplace_back("exp_avg." + std::to_string(i), exp_avg_[i]);
    out.emplace_back("exp_avg_sq." + std::to_string(i), exp_avg_sq_[i]);
  }
  return out;
}

}  // namespace tidal::models
