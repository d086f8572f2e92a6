// Reference decoder-only transformers for tidal's trainer, tests and benchmarks: GPT-2 (learned
// positions, pre-LayerNorm blocks, causal self-attention, GELU MLP, tied LM head) and a
// Llama-style variant (RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention, untied
// head). Plain libtorch C++ frontend modules, fp32, no fused kernels, so that the same sources
// run on libtorch 1.13 and 2.x and every ATen op is visible to the tracer.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "tidal/plan/model_trace.hpp"

namespace tidal::models {

/// Shape of a model. Plain data.
struct ModelConfig {
  std::string name;  ///< e.g. "gpt2-small"
  plan::Architecture arch = plan::Architecture::kGpt2;
  std::int64_t layers = 0;
  std::int64_t hidden = 0;
  std::int64_t heads = 0;
  std::int64_t kv_heads = 0;    ///< Llama grouped-query attention; equal to heads for GPT-2
  std::int64_t ffn_hidden = 0;  ///< MLP width: 4 x hidden for GPT-2, SwiGLU width for Llama
  std::int64_t vocab = 0;
  std::int64_t max_seq = 0;  ///< longest sequence (learned positions, rotary tables, mask)
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;

  /// Parameters the model will have (tied head counted once).
  [[nodiscard]] std::int64_t parameter_count() const;
};

/// Names accepted by model_config(), in a stable order.
std::vector<std::string> model_names();

/// The named config, from the preset table the analytic traces use (plan::model_preset): the
/// GPT-2 presets and the Llama ones with an untied head (gpt-tiny, gpt2-small/medium/large/xl,
/// llama-tiny, llama3-8b, llama3-70b, llama3.1-405b). Throws tidal::InvalidArgument listing the
/// valid names on an unknown one.
ModelConfig model_config(const std::string& name);

/// Returns `config` with the non-zero overrides applied (0 keeps the config's value). Derived
/// sizes follow: GPT-2's MLP width is 4 x hidden; Llama's SwiGLU width keeps its ratio to hidden
/// (rounded to a multiple of 64) and kv_heads falls back to heads when it no longer divides them.
/// Throws tidal::InvalidArgument when hidden is not a multiple of heads.
ModelConfig with_overrides(ModelConfig config, std::int64_t layers, std::int64_t hidden,
                           std::int64_t heads);

/// One block's forward: x -> block(x).
using BlockFn = std::function<torch::Tensor(const torch::Tensor&)>;

/// Wraps the call of one transformer block: (layer index, the block's forward, input) -> output.
/// The hook point for activation checkpointing and per-layer offloading: the default is a plain
/// call. Called on the thread that runs forward.
using BlockWrapper =
    std::function<torch::Tensor(std::int64_t layer, const BlockFn& block, const torch::Tensor& x)>;

/// A decoder-only language model. Create with make_model(); share through the returned holder
/// (torch::nn::ModuleHolder semantics: copies share one module). Not thread-safe: one forward at
/// a time.
class TransformerImpl : public torch::nn::Module {
 public:
  /// Builds and initialises the model (N(0, 0.02) weights, residual projections scaled by
  /// 1/sqrt(2 x layers), zero biases, unit norms) from the current torch random generator: seed
  /// it (torch::manual_seed) before for reproducible weights.
  explicit TransformerImpl(const ModelConfig& config);

  /// Logits [batch, seq, vocab] for tokens [batch, seq] (int64). Throws tidal::InvalidArgument
  /// when seq exceeds config().max_seq.
  torch::Tensor forward(const torch::Tensor& tokens);

  /// Mean cross-entropy of next-token prediction: a scalar tensor.
  torch::Tensor loss(const torch::Tensor& tokens, const torch::Tensor& targets);

  /// forward() and loss() in their three parts, for a caller that orders them itself (the
  /// trainer, which runs deferred optimizer updates and tells its observers the layer between
  /// them, and orders micro-batches layer-major): embed(tokens) -> block(0..layers-1) ->
  /// head_loss(x, targets) computes loss(tokens, targets) with the same ops. embed() prepares
  /// the blocks for its sequence length: every block() call until the next embed() must have
  /// that length. block() calls the block wrapper.
  torch::Tensor embed(const torch::Tensor& tokens);
  torch::Tensor block(std::int64_t layer, const torch::Tensor& x);
  torch::Tensor head_loss(const torch::Tensor& x, const torch::Tensor& targets);

  /// The parameters by the stage of forward that first uses them: [0] embed()'s, [1 + L] block
  /// L's, [layers + 1] those head_loss() uses first (the final norm's, and Llama's head: GPT-2's
  /// head is the token embedding, in [0]). Each in the order of parameters(); together, every
  /// parameter once. The tensors share storage with the model's.
  [[nodiscard]] std::vector<std::vector<torch::Tensor>> parameter_stages() const;

  [[nodiscard]] const ModelConfig& config() const { return config_; }

  /// Replaces the block wrapper (an empty function restores the plain call).
  void set_block_wrapper(BlockWrapper wrapper) { block_wrapper_ = std::move(wrapper); }

 private:
  // The final norm and the head: logits [batch, seq, vocab].
  torch::Tensor logits(const torch::Tensor& x);

  ModelConfig config_;
  torch::nn::Embedding tok_embedding_{nullptr};
  torch::nn::Embedding pos_embedding_{nullptr};  // GPT-2 only
  torch::nn::ModuleList blocks_{nullptr};
  torch::nn::AnyModule final_norm_;
  torch::nn::Linear lm_head_{nullptr};  // Llama only; GPT-2 ties the head to tok_embedding_
  BlockWrapper block_wrapper_;
};
TORCH_MODULE(Transformer);

/// Builds the model for `config` on `device`.
Transformer make_model(const ModelConfig& config, const torch::Device& device);

}  // namespace tidal::models
