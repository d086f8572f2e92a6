// The mixture-of-experts MLP of the analytic transformer trace (moe_block.hpp): the router and
// its top-k, the experts on their tokens, the combination, the shared expert, and their backward
// ops in reverse.
#include "plan/transformer/moe_block.hpp"

#include <cstdint>
#include <string>
#include <vector>

namespace tidal::plan::detail::transformer {

MoeBlock::MoeBlock(Builder& b, const TransformerConfig& cfg, std::int64_t tokens,
                   int tensor_parallel)
    : b_(b),
      h_(cfg.hidden),
      experts_(cfg.experts),
      per_token_(cfg.experts_per_token),
      f_(cfg.expert_ffn / tensor_parallel),
      shared_f_(cfg.shared_expert_ffn / tensor_parallel),
      tokens_(tokens),
      // Balanced routing: the tokens x experts_per_token assignments spread evenly.
      expert_tokens_(
          cfg.experts > 0 ? (tokens * cfg.experts_per_token + cfg.experts - 1) / cfg.experts : 0),
      tp_(tensor_parallel) {}

std::string MoeBlock::expert_prefix(const std::string& p, int e) const {
  return p + "feed_forward.experts." + std::to_string(e) + ".";
}

MoeParams MoeBlock::add_parameters(const std::string& p) {
  const auto swiglu = [&](const std::string& q, std::int64_t width) {
    SwigluParams s;
    s.w1 = b_.param(q + "w1.weight", h_ * width);
    s.w3 = b_.param(q + "w3.weight", h_ * width);
    s.w2 = b_.param(q + "w2.weight", width * h_);
    return s;
  };
  MoeParams P;
  P.gate = b_.param(p + "feed_forward.gate.weight", h_ * experts_);
  for (int e = 0; e < experts_; ++e) P.experts.push_back(swiglu(expert_prefix(p, e), f_));
  if (shared_f_ > 0) {
    P.shared = swiglu(p + "feed_forward.shared_expert.", shared_f_);
    P.shared_gate = b_.param(p + "feed_forward.shared_expert_gate.weight", h_);
  }
  return P;
}

TensorId MoeBlock::forward(int l, const std::string& p, const MoeParams& P, TensorId x,
                           MoeSaved& s) {
  const std::string ff = p + "feed_forward.";
  const TensorId logits =
      b_.linear(ff + "gate", l, x, P.gate, tokens_, h_, experts_, TensorClass::kTemporary);
  // The softmax over the experts and each token's top k: the probabilities stay for the
  // softmax's backward, the chosen experts and their weights for the combination.
  s.probs = b_.act(ff + "router.probs", experts_);
  s.weights = b_.act(ff + "router.weights", per_token_);
  s.indices =
      b_.tensor(b_.prefix() + ff + "router.indices",
                static_cast<std::uint64_t>(tokens_ * per_token_) * 8, TensorClass::kActivation);
  b_.op(ff + "router", Phase::kForward, l, {logits}, {s.probs, s.weights, s.indices}, 0);

  // Each expert's tokens gathered from the input (a permutation of the routed copies).
  s.experts.assign(static_cast<std::size_t>(experts_), SwigluSaved{});
  std::vector<TensorId> expert_inputs;
  for (int e = 0; e < experts_; ++e) {
    SwigluSaved& x_e = s.experts[static_cast<std::size_t>(e)];
    x_e.x = b_.rows(expert_prefix(p, e) + "in", expert_tokens_, h_);
    expert_inputs.push_back(x_e.x);
  }
  b_.op(ff + "dispatch", Phase::kForward, l, {x, s.indices}, expert_inputs, 0);

  std::vector<TensorId> combine_in{s.weights, s.indices};
  for (int e = 0; e < experts_; ++e) {
    SwigluSaved& x_e = s.experts[static_cast<std::size_t>(e)];
    swiglu_forward(l, expert_prefix(p, e), P.experts[static_cast<std::size_t>(e)], expert_tokens_,
                   f_, x_e);
    combine_in.push_back(x_e.y);
  }
  if (shared_f_ > 0) {
    s.shared.x = x;
    swiglu_forward(l, ff + "shared_expert.", P.shared, tokens_, shared_f_, s.shared);
    s.gate_logit = b_.linear(ff + "shared_expert_gate", l, x, P.shared_gate, tokens_, h_, 1);
    combine_in.push_back(s.shared.y);
    combine_in.push_back(s.gate_logit);
  }
  // Each token's output: its experts' outputs weighted by its routing weights, plus the shared
  // expert's times the sigmoid of its gate.
  const TensorId out = b_.act(ff + "combine.out", h_, TensorClass::kTemporary);
  b_.op(ff + "combine", Phase::kForward, l, combine_in, {out}, 0);
  return out;
}

TensorId MoeBlock::backward(int l, const std::string& p, const MoeParams& P, const MoeSaved& s,
                            TensorId x, TensorId gy) {
  const std::string ff = p + "feed_forward.";
  // The combination's backward: each expert's output gradient (its tokens' output gradients
  // times their weights), and the weights' gradients (dot products with the experts' outputs).
  std::vector<TensorId> in{gy, s.weights, s.indices};
  std::vector<TensorId> g_y;
  for (int e = 0; e < experts_; ++e) {
    in.push_back(s.experts[static_cast<std::size_t>(e)].y);
    g_y.push_back(
        b_.rows(expert_prefix(p, e) + "w2.grad_out", expert_tokens_, h_, TensorClass::kTemporary));
  }
  std::vector<TensorId> out = g_y;
  const TensorId g_weights =
      b_.act(ff + "router.weights.grad", per_token_, TensorClass::kTemporary);
  out.push_back(g_weights);
  std::vector<TensorId> g_gates{g_weights};
  TensorId g_shared = -1;
  if (shared_f_ > 0) {
    in.push_back(s.shared.y);
    in.push_back(s.gate_logit);
    g_shared = b_.act(ff + "shared_expert.w2.grad_out", h_, TensorClass::kTemporary);
    g_gates.push_back(b_.act(ff + "shared_expert_gate.grad_out", 1, TensorClass::kTemporary));
    out.push_back(g_shared);
    out.push_back(g_gates.back());
  }
  b_.op(ff + "combine.bwd", Phase::kBackward, l, in, out, 0);
  // Under tensor parallelism the experts' outputs are partial sums over the GPUs, so are the
  // gradients of the routing weights and of the gate: they are added over the group.
  if (tp_ > 1)
    b_.all_reduce(ff + "combine.grad_weights.all_reduce", Phase::kBackward, l, g_gates, tp_);

  std::vector<TensorId> grad_parts;
  if (shared_f_ > 0) {
    grad_parts.push_back(b_.linear_bwd(ff + "shared_expert_gate", l, g_gates.back(), x,
                                       P.shared_gate, tokens_, h_, 1));
    grad_parts.push_back(swiglu_backward(l, ff + "shared_expert.", P.shared, s.shared, tokens_,
                                         shared_f_, g_shared));
  }
  std::vector<TensorId> g_x(static_cast<std::size_t>(experts_));
  for (int e = experts_ - 1; e >= 0; --e) {
    const auto i = static_cast<std::size_t>(e);
    g_x[i] = swiglu_backward(l, expert_prefix(p, e), P.experts[i], s.experts[i], expert_tokens_, f_,
                             g_y[i]);
  }
  g_x.push_back(s.indices);
  grad_parts.push_back(b_.act(ff + "dispatch.grad", h_, TensorClass::kTemporary));
  b_.op(ff + "dispatch.bwd", Phase::kBackward, l, g_x, {grad_parts.back()}, 0);
  const TensorId g_logits = b_.act(ff + "gate.grad_out", experts_, TensorClass::kTemporary);
  b_.op(ff + "router.bwd", Phase::kBackward, l, {g_weights, s.probs, s.indices}, {g_logits}, 0);
  grad_parts.push_back(b_.linear_bwd(ff + "gate", l, g_logits, x, P.gate, tokens_, h_, experts_));
  // Under tensor parallelism the router's and the gate's parts are whole on every GPU and the
  // experts' partial: the sum counts the whole ones on one GPU, so that the all-reduce of the
  // MLP's input gradient that follows is exact (the same ops and bytes on every GPU).
  const TensorId g_in = b_.act(p + "norm2.grad_out", h_, TensorClass::kTemporary);
  b_.op(p + "ffn_norm.grad_sum", Phase::kBackward, l, grad_parts, {g_in}, 0);
  return g_in;
}

void MoeBlock::swiglu_forward(int l, const std::string& p, const SwigluParams& P, std::int64_t rows,
                              std::int64_t width, SwigluSaved& s) {
  s.a = b_.linear(p + "w1", l, s.x, P.w1, rows, h_, width);
  s.up = b_.linear(p + "w3", l, s.x, P.w3, rows, h_, width);
  s.act = b_.rows(p + "silu.out", rows, width);
  b_.op(p + "silu", Phase::kForward, l, {s.a}, {s.act}, 0);
  s.m = b_.rows(p + "mul.out", rows, width);
  b_.op(p + "mul", Phase::kForward, l, {s.act, s.up}, {s.m}, 0);
  s.y = b_.linear(p + "w2", l, s.m, P.w2, rows, width, h_);
}

TensorId MoeBlock::swiglu_backward(int l, const std::string& p, const SwigluParams& P,
                                   const SwigluSaved& s, std::int64_t rows, std::int64_t width,
                                   TensorId gy) {
  const TensorId g_m = b_.linear_bwd(p + "w2", l, gy, s.m, P.w2, rows, width, h_);
  const TensorId g_sa = b_.rows(p + "mul.grad_a", rows, width, TensorClass::kTemporary);
  const TensorId g_b = b_.rows(p + "mul.grad_b", rows, width, TensorClass::kTemporary);
  b_.op(p + "mul.bwd", Phase::kBackward, l, {g_m, s.act, s.up}, {g_sa, g_b}, 0);
  const TensorId g_a = b_.rows(p + "silu.grad", rows, width, TensorClass::kTemporary);
  b_.op(p + "silu.bwd", Phase::kBackward, l, {g_sa, s.a}, {g_a}, 0);
  const TensorId g3 = b_.linear_bwd(p + "w3", l, g_b, s.x, P.w3, rows, h_, width);
  const TensorId g1 = b_.linear_bwd(p + "w1", l, g_a, s.x, P.w1, rows, h_, width);
  const TensorId g_x = b_.rows(p + "grad_in", rows, h_, TensorClass::kTemporary);
  b_.op(p + "grad_sum", Phase::kBackward, l, {g1, g3}, {g_x}, 0);
  return g_x;
}

}  // namespace tidal::plan::detail::transformer
