#include "tidal/models/adamw.hpp"

#include <cmath>

namespace tidal::models {

AdamW::AdamW(std::vector<torch::Tensor> params, Options options)
    : params_(std::move(params)), options_(options) {
  torch::NoGradGuard no_grad;
  exp_avg_.reserve(params_.size());
  exp_avg_sq_.reserve(params_.size());
  for (const auto& p : params_) {
    exp_avg_.push_back(torch::zeros_like(p));
    exp_avg_sq_.push_back(torch::zeros_like(p));
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
  auto& p = params_.at(i);
  const auto& g = p.grad();
  if (!g.defined()) return;
  if (options_.weight_decay != 0 && p.dim() >= 2) p.mul_(1.0 - options_.lr * options_.weight_decay);
  exp_avg_[i].mul_(options_.beta1).add_(g, 1.0 - options_.beta1);
  exp_avg_sq_[i].mul_(options_.beta2).addcmul_(g, g, 1.0 - options_.beta2);
  auto denom = (exp_avg_sq_[i].sqrt() / sqrt_bc2_).add_(options_.eps);
  p.addcdiv_(exp_avg_[i], denom, -step_size_);
}

void AdamW::zero_grad() {
  torch::NoGradGuard no_grad;
  for (auto& p : params_) {
    auto g = p.grad();
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
