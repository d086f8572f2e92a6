// Analytic traces: the op-level trace of one fp32 training iteration (forward, backward, AdamW
// step) of a transformer, with exact tensor sizes and roofline op times, built without running
// anything. They let the planner be judged at the scale of the papers on any machine.
// Torch-free.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tidal/plan/hardware.hpp"
#include "tidal/trace/trace.hpp"

namespace tidal::plan {

enum class Architecture : std::uint8_t {
  kGpt2,   ///< LayerNorm with bias, fused QKV, GELU MLP, learned positions, tied head
  kLlama,  ///< RMSNorm, grouped-query attention with RoPE, SwiGLU MLP, untied head
};

/// Shape of a decoder-only transformer.
struct TransformerConfig {
  std::string name;
  Architecture arch = Architecture::kLlama;
  int layers = 0;
  std::int64_t hidden = 0;
  int heads = 0;
  int kv_heads = 0;  ///< grouped-query attention; equal to heads for GPT-2
  std::int64_t ffn = 0;
  std::int64_t vocab = 0;
  std::int64_t max_seq = 0;  ///< position table size (GPT-2)
  bool tied_embeddings = false;

  /// Number of parameters (elements).
  [[nodiscard]] std::int64_t parameters() const;
};

/// Names of the built-in configs: gpt2-small, gpt2-medium, gpt2-large, gpt2-xl, llama3.2-1b,
/// llama3-8b, llama3-70b.
std::vector<std::string> model_preset_names();

/// A built-in config. Throws tidal::InvalidArgument listing the names on an unknown one.
TransformerConfig model_preset(const std::string& name);

/// Shape overrides (--layers, --hidden, --heads, --kv-heads, --ffn, --vocab).
struct ModelOverrides {
  std::optional<int> layers;
  std::optional<std::int64_t> hidden;
  std::optional<int> heads;
  std::optional<int> kv_heads;
  std::optional<std::int64_t> ffn;
  std::optional<std::int64_t> vocab;
};
/// Applies the set fields and checks the shape (hidden divisible by heads, heads by kv_heads).
/// Throws tidal::InvalidArgument on an inconsistent shape.
void apply_overrides(TransformerConfig& cfg, const ModelOverrides& o);

/// The trace of one training iteration with fp32 weights, gradients (created in backward,
/// freed by the optimizer step: zero_grad(set_to_none=True)), AdamW states and activations.
/// Attention is the memory-efficient kind (saves its output and log-sum-exp, not the score
/// matrix). Op times: max(flops / (gpu_flops x matmul_efficiency), bytes / gpu_mem_bw) plus the
/// per-op overhead. Op::layer is the transformer block (-1 for embedding, head, loss, optimizer).
/// Throws tidal::InvalidArgument when batch or seq is not positive.
trace::Trace transformer_trace(const TransformerConfig& cfg, std::int64_t batch, std::int64_t seq,
                               const Hardware& hw);

}  // namespace tidal::plan
