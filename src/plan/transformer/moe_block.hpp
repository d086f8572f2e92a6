// The mixture-of-experts MLP of a Llama block in the analytic transformer trace (private to
// plan/): a router, `experts` SwiGLU experts each run on its share of the tokens, the weighted
// combination of their outputs and, where the model has one, a shared expert with a sigmoid gate.
// Used by transformer_trace.cpp in place of the dense SwiGLU MLP. Torch-free.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "plan/transformer/trace_builder.hpp"
#include "tidal/plan/model_trace.hpp"

namespace tidal::plan::detail::transformer {

// A SwiGLU MLP's parameters (indices into the builder's parameters).
struct SwigluParams {
  std::size_t w1 = kNone, w3 = kNone, w2 = kNone;
};

// One block's mixture-of-experts parameters, in the order they are added.
struct MoeParams {
  std::size_t gate = kNone;  ///< the router, hidden -> experts
  std::vector<SwigluParams> experts;
  SwigluParams shared;              ///< kNone without a shared expert
  std::size_t shared_gate = kNone;  ///< the shared expert's gate, hidden -> 1
};

// What a SwiGLU MLP's forward pass keeps for its backward pass: its input, the two projections,
// the activation, their product and its output (which the combination's backward reads).
struct SwigluSaved {
  TensorId x = -1, a = -1, up = -1, act = -1, m = -1, y = -1;
};

// What the mixture-of-experts MLP's forward pass keeps for its backward pass.
struct MoeSaved {
  TensorId probs = -1;       ///< the router's softmax over the experts
  TensorId weights = -1;     ///< each token's routing weights (experts_per_token of them)
  TensorId indices = -1;     ///< each token's experts (int64)
  TensorId gate_logit = -1;  ///< the shared expert's gate before its sigmoid
  std::vector<SwigluSaved> experts;
  SwigluSaved shared;
};

// Builds the mixture-of-experts MLP's ops into a Builder, block by block. Routing is balanced:
// each expert gets tokens x experts_per_token / experts of the micro-batch's tokens (rounded up),
// no token is dropped and no capacity factor applies. Under tensor parallelism every expert's
// width (and the shared expert's) is split over the GPUs like the dense MLP, the router and the
// gate are whole on every GPU; the experts are not spread over GPUs (no expert parallelism).
class MoeBlock {
 public:
  // `tokens`: the micro-batch's tokens; `tensor_parallel`: the GPUs each expert is split over.
  // `b` must outlive the MoeBlock.
  MoeBlock(Builder& b, const TransformerConfig& cfg, std::int64_t tokens, int tensor_parallel);

  // Adds the parameters of the block whose names start with `p` ("layers.<l>.").
  MoeParams add_parameters(const std::string& p);

  // The forward ops on the normed input `x` (tokens x hidden); returns the MLP's output (a
  // temporary of tokens x hidden; under tensor parallelism a partial sum to all-reduce).
  TensorId forward(int l, const std::string& p, const MoeParams& P, TensorId x, MoeSaved& s);

  // The backward ops from the output's gradient `gy`; returns the gradient of `x`.
  TensorId backward(int l, const std::string& p, const MoeParams& P, const MoeSaved& s, TensorId x,
                    TensorId gy);

  // The tokens each routed expert runs on.
  [[nodiscard]] std::int64_t expert_tokens() const { return expert_tokens_; }

 private:
  void swiglu_forward(int l, const std::string& p, const SwigluParams& P, std::int64_t rows,
                      std::int64_t width, SwigluSaved& s);
  TensorId swiglu_backward(int l, const std::string& p, const SwigluParams& P, const SwigluSaved& s,
                           std::int64_t rows, std::int64_t width, TensorId gy);
  [[nodiscard]] std::string expert_prefix(const std::string& p, int e) const;

  Builder& b_;
  std::int64_t h_;              ///< hidden
  int experts_;                 ///< routed experts
  int per_token_;               ///< experts per token
  std::int64_t f_;              ///< this GPU's share of an expert's width
  std::int64_t shared_f_;       ///< this GPU's share of the shared expert's width (0: none)
  std::int64_t tokens_;         ///< the micro-batch's tokens
  std::int64_t expert_tokens_;  ///< each routed expert's tokens
  int tp_;
};

}  // namespace tidal::plan::detail::transformer
