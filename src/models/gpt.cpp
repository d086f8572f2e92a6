#include "tidal/models/gpt.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

#include "tidal/common/error.hpp"
#include "tidal/plan/model_trace.hpp"

namespace tidal::models {
namespace {

namespace F = torch::nn::functional;

// What a block needs besides its input, set by the model before each forward: the causal mask
// and the rotary tables depend on the sequence length, and computing them once per forward keeps
// per-layer copies out of memory.
struct BlockContext {
  torch::Tensor causal_mask;  // [S, S] bool, true above the diagonal
  torch::Tensor rope_cos;     // [S, head_dim / 2] (Llama)
  torch::Tensor rope_sin;
};

class BlockBaseImpl : public torch::nn::Module {
 public:
  virtual torch::Tensor forward(const torch::Tensor& x) = 0;
  // Kept until the next forward, so that a block re-run during backward (activation
  // checkpointing) still finds it.
  void set_context(const BlockContext& ctx) { ctx_ = ctx; }

 protected:
  BlockContext ctx_;
};

// Scaled dot-product attention written out op by op (q, k, v: [B, heads, S, head_dim]).
torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const torch::Tensor& mask) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  auto scores = torch::matmul(q, k.transpose(-2, -1)) * scale;
  scores = scores.masked_fill(mask, -std::numeric_limits<float>::infinity());
  auto probs = torch::softmax(scores, -1);
  return torch::matmul(probs, v);
}

class GptBlockImpl : public BlockBaseImpl {
 public:
  explicit GptBlockImpl(const ModelConfig& c) : heads_(c.heads), hidden_(c.hidden) {
    ln1_ = register_module(
        "ln_1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden}).eps(c.norm_eps)));
    c_attn_ = register_module("attn_c_attn", torch::nn::Linear(c.hidden, 3 * c.hidden));
    c_proj_ = register_module("attn_c_proj", torch::nn::Linear(c.hidden, c.hidden));
    ln2_ = register_module(
        "ln_2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden}).eps(c.norm_eps)));
    fc_ = register_module("mlp_c_fc", torch::nn::Linear(c.hidden, c.ffn_hidden));
    fc_proj_ = register_module("mlp_c_proj", torch::nn::Linear(c.ffn_hidden, c.hidden));
  }

  torch::Tensor forward(const torch::Tensor& x) override {
    const auto b = x.size(0);
    const auto s = x.size(1);
    const auto hd = hidden_ / heads_;
    auto qkv = c_attn_(ln1_(x)).split(hidden_, -1);
    auto q = qkv[0].view({b, s, heads_, hd}).transpose(1, 2);
    auto k = qkv[1].view({b, s, heads_, hd}).transpose(1, 2);
    auto v = qkv[2].view({b, s, heads_, hd}).transpose(1, 2);
    auto y = causal_attention(q, k, v, ctx_.causal_mask);
    y = y.transpose(1, 2).contiguous().view({b, s, hidden_});
    auto h = x + c_proj_(y);
    return h + fc_proj_(F::gelu(fc_(ln2_(h))));
  }

 private:
  std::int64_t heads_;
  std::int64_t hidden_;
  torch::nn::LayerNorm ln1_{nullptr}, ln2_{nullptr};
  torch::nn::Linear c_attn_{nullptr}, c_proj_{nullptr}, fc_{nullptr}, fc_proj_{nullptr};
};

class RmsNormImpl : public torch::nn::Module {
 public:
  RmsNormImpl(std::int64_t dim, double eps) : eps_(eps) {
    weight_ = register_parameter("weight", torch::ones({dim}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return x * torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps_) * weight_;
  }

 private:
  double eps_;
  torch::Tensor weight_;
};
TORCH_MODULE(RmsNorm);

// Rotary embedding, "rotate half" form: x = [x1, x2] -> [x1 cos - x2 sin, x1 sin + x2 cos].
torch::Tensor apply_rope(const torch::Tensor& x, const torch::Tensor& cos,
                         const torch::Tensor& sin) {
  auto halves = x.chunk(2, -1);
  return torch::cat({halves[0] * cos - halves[1] * sin, halves[0] * sin + halves[1] * cos}, -1);
}

class LlamaBlockImpl : public BlockBaseImpl {
 public:
  explicit LlamaBlockImpl(const ModelConfig& c)
      : heads_(c.heads), kv_heads_(c.kv_heads), hidden_(c.hidden) {
    const auto hd = c.hidden / c.heads;
    auto linear = [](std::int64_t in, std::int64_t out) {
      return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
    };
    attn_norm_ = register_module("attention_norm", RmsNorm(c.hidden, c.norm_eps));
    wq_ = register_module("attention_wq", linear(c.hidden, c.heads * hd));
    wk_ = register_module("attention_wk", linear(c.hidden, c.kv_heads * hd));
    wv_ = register_module("attention_wv", linear(c.hidden, c.kv_heads * hd));
    wo_ = register_module("attention_wo", linear(c.heads * hd, c.hidden));
    ffn_norm_ = register_module("ffn_norm", RmsNorm(c.hidden, c.norm_eps));
    w1_ = register_module("feed_forward_w1", linear(c.hidden, c.ffn_hidden));
    w2_ = register_module("feed_forward_w2", linear(c.ffn_hidden, c.hidden));
    w3_ = register_module("feed_forward_w3", linear(c.hidden, c.ffn_hidden));
  }

  torch::Tensor forward(const torch::Tensor& x) override {
    const auto b = x.size(0);
    const auto s = x.size(1);
    const auto hd = hidden_ / heads_;
    auto h = attn_norm_(x);
    auto q = wq_(h).view({b, s, heads_, hd}).transpose(1, 2);
    auto k = wk_(h).view({b, s, kv_heads_, hd}).transpose(1, 2);
    auto v = wv_(h).view({b, s, kv_heads_, hd}).transpose(1, 2);
    q = apply_rope(q, ctx_.rope_cos, ctx_.rope_sin);
    k = apply_rope(k, ctx_.rope_cos, ctx_.rope_sin);
    if (kv_heads_ != heads_) {
      const auto rep = heads_ / kv_heads_;
      k = k.unsqueeze(2).expand({b, kv_heads_, rep, s, hd}).reshape({b, heads_, s, hd});
      v = v.unsqueeze(2).expand({b, kv_heads_, rep, s, hd}).reshape({b, heads_, s, hd});
    }
    auto y = causal_attention(q, k, v, ctx_.causal_mask);
    y = y.transpose(1, 2).contiguous().view({b, s, hidden_});
    auto r = x + wo_(y);
    auto f = ffn_norm_(r);
    return r + w2_(torch::silu(w1_(f)) * w3_(f));
  }

 private:
  std::int64_t heads_;
  std::int64_t kv_heads_;
  std::int64_t hidden_;
  RmsNorm attn_norm_{nullptr}, ffn_norm_{nullptr};
  torch::nn::Linear wq_{nullptr}, wk_{nullptr}, wv_{nullptr}, wo_{nullptr};
  torch::nn::Linear w1_{nullptr}, w2_{nullptr}, w3_{nullptr};
};

// Whether the reference trainer builds this preset: GPT-2 (tied head) and Llama with its own head,
// without experts (its blocks are dense).
bool trainable(const plan::TransformerConfig& c) {
  return !c.moe() && (c.arch == plan::Architecture::kGpt2 || !c.tied_embeddings);
}

std::int64_t round_up(std::int64_t n, std::int64_t m) { return (n + m - 1) / m * m; }

}  // namespace

std::int64_t ModelConfig::parameter_count() const {
  const std::int64_t hd = heads > 0 ? hidden / heads : 0;
  if (arch == plan::Architecture::kGpt2) {
    const std::int64_t block = 2 * 2 * hidden                      // two LayerNorms
                               + hidden * 3 * hidden + 3 * hidden  // c_attn
                               + hidden * hidden + hidden          // c_proj
                               + hidden * ffn_hidden + ffn_hidden  // c_fc
                               + ffn_hidden * hidden + hidden;     // mlp c_proj
    return vocab * hidden + max_seq * hidden + layers * block + 2 * hidden;
  }
  const std::int64_t block = 2 * hidden                    // two RMSNorms
                             + hidden * heads * hd * 2     // wq, wo
                             + hidden * kv_heads * hd * 2  // wk, wv
                             + 3 * hidden * ffn_hidden;    // w1, w2, w3
  return 2 * vocab * hidden + layers * block + hidden;
}

std::vector<std::string> model_names() {
  std::vector<std::string> names;
  for (const auto& n : plan::model_preset_names()) {
    if (trainable(plan::model_preset(n))) names.push_back(n);
  }
  return names;
}

ModelConfig model_config(const std::string& name) {
  const std::vector<std::string> names = model_names();
  if (std::find(names.begin(), names.end(), name) == names.end()) {
    std::ostringstream list;
    for (const auto& n : names) list << " " << n;
    TIDAL_FAIL_AS(InvalidArgument, "unknown model '", name, "'; choose one of:", list.str());
  }
  const plan::TransformerConfig p = plan::model_preset(name);
  ModelConfig c;
  c.name = name;
  c.arch = p.arch;
  c.layers = p.layers;
  c.hidden = p.hidden;
  c.heads = p.heads;
  c.kv_heads = p.kv_heads;
  c.ffn_hidden = p.ffn;
  c.vocab = p.vocab;
  c.max_seq = p.max_seq;
  c.norm_eps = 1e-5;
  c.rope_theta = p.rope_theta;
  return c;
}

ModelConfig with_overrides(ModelConfig c, std::int64_t layers, std::int64_t hidden,
                           std::int64_t heads) {
  TIDAL_EXPECT_AS(InvalidArgument, layers >= 0 && hidden >= 0 && heads >= 0,
                  "the layers, hidden size and heads must be positive");
  const bool custom = layers > 0 || hidden > 0 || heads > 0;
  if (layers > 0) c.layers = layers;
  if (hidden > 0) {
    if (c.arch == plan::Architecture::kGpt2) {
      c.ffn_hidden = 4 * hidden;
    } else {
      const double ratio = static_cast<double>(c.ffn_hidden) / static_cast<double>(c.hidden);
      c.ffn_hidden = round_up(static_cast<std::int64_t>(ratio * static_cast<double>(hidden)), 64);
    }
    c.hidden = hidden;
  }
  if (heads > 0) c.heads = heads;
  TIDAL_EXPECT_AS(InvalidArgument, c.hidden % c.heads == 0, "hidden size ", c.hidden,
                  " is not a multiple of the number of heads ", c.heads,
                  "; pick a hidden size and heads so that hidden / heads is whole");
  TIDAL_EXPECT_AS(InvalidArgument,
                  (c.hidden / c.heads) % 2 == 0 || c.arch == plan::Architecture::kGpt2,
                  "rotary positions need an even head size; hidden / heads = ", c.hidden / c.heads);
  if (c.arch == plan::Architecture::kGpt2 || c.heads % c.kv_heads != 0) c.kv_heads = c.heads;
  if (custom) c.name += "-custom";
  return c;
}

TransformerImpl::TransformerImpl(const ModelConfig& config) : config_(config) {
  TIDAL_EXPECT_AS(InvalidArgument, config_.layers > 0 && config_.hidden > 0 && config_.heads > 0,
                  "model '", config_.name, "' needs positive layers, hidden and heads");
  tok_embedding_ =
      register_module("tok_embedding", torch::nn::Embedding(config_.vocab, config_.hidden));
  blocks_ = register_module("blocks", torch::nn::ModuleList());
  if (config_.arch == plan::Architecture::kGpt2) {
    pos_embedding_ =
        register_module("pos_embedding", torch::nn::Embedding(config_.max_seq, config_.hidden));
    for (std::int64_t i = 0; i < config_.layers; ++i) {
      blocks_->push_back(std::make_shared<GptBlockImpl>(config_));
    }
    final_norm_ = torch::nn::AnyModule(register_module(
        "final_norm",
        torch::nn::LayerNorm(torch::nn::LayerNormOptions({config_.hidden}).eps(config_.norm_eps))));
  } else {
    for (std::int64_t i = 0; i < config_.layers; ++i) {
      blocks_->push_back(std::make_shared<LlamaBlockImpl>(config_));
    }
    final_norm_ = torch::nn::AnyModule(
        register_module("final_norm", RmsNorm(config_.hidden, config_.norm_eps)));
    lm_head_ = register_module(
        "lm_head",
        torch::nn::Linear(torch::nn::LinearOptions(config_.hidden, config_.vocab).bias(false)));
  }

  // GPT-2's initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 x layers).
  torch::NoGradGuard no_grad;
  const double std = 0.02;
  const double residual_std = std / std::sqrt(2.0 * static_cast<double>(config_.layers));
  for (auto& p : named_parameters()) {
    const auto& name = p.key();
    auto& t = p.value();
    if (t.dim() >= 2) {
      const bool residual = name.find("c_proj") != std::string::npos ||
                            name.find("wo.") != std::string::npos ||
                            name.find("w2.") != std::string::npos;
      t.normal_(0.0, residual ? residual_std : std);
    } else if (name.find("bias") != std::string::npos) {
      t.zero_();
    }
  }
}

torch::Tensor TransformerImpl::block(std::int64_t layer, const torch::Tensor& x) {
  auto& block = *blocks_->ptr(layer)->as<BlockBaseImpl>();
  if (!block_wrapper_) return block.forward(x);
  return block_wrapper_(
      layer, [&block](const torch::Tensor& in) { return block.forward(in); }, x);
}

torch::Tensor TransformerImpl::embed(const torch::Tensor& tokens) {
  TIDAL_EXPECT_AS(InvalidArgument, tokens.dim() == 2, "tokens must be [batch, seq]");
  const auto s = tokens.size(1);
  TIDAL_EXPECT_AS(InvalidArgument, s <= config_.max_seq, "sequence length ", s,
                  " exceeds the model's maximum ", config_.max_seq, " (", config_.name, ")");
  const auto dev = tokens.device();
  BlockContext ctx;
  ctx.causal_mask =
      torch::ones({s, s}, torch::TensorOptions().dtype(torch::kBool).device(dev)).triu(1);
  torch::Tensor x = tok_embedding_(tokens);
  if (config_.arch == plan::Architecture::kGpt2) {
    auto pos = torch::arange(s, torch::TensorOptions().dtype(torch::kLong).device(dev));
    x = x + pos_embedding_(pos);
  } else {
    // Rotary tables for this length; no gradient flows through them.
    const auto hd = config_.hidden / config_.heads;
    auto fopts = torch::TensorOptions().dtype(torch::kFloat).device(dev);
    auto inv_freq =
        torch::pow(config_.rope_theta, torch::arange(0, hd, 2, fopts) / static_cast<double>(hd))
            .reciprocal();
    auto angles = torch::outer(torch::arange(s, fopts), inv_freq);
    ctx.rope_cos = angles.cos();
    ctx.rope_sin = angles.sin();
  }
  for (auto& m : *blocks_) m->as<BlockBaseImpl>()->set_context(ctx);
  return x;
}

torch::Tensor TransformerImpl::logits(const torch::Tensor& x) {
  auto h = final_norm_.forward(x);
  return config_.arch == plan::Architecture::kGpt2 ? F::linear(h, tok_embedding_->weight)
                                                   : lm_head_(h);
}

torch::Tensor TransformerImpl::forward(const torch::Tensor& tokens) {
  torch::Tensor x = embed(tokens);
  for (std::int64_t i = 0; i < config_.layers; ++i) x = block(i, x);
  return logits(x);
}

torch::Tensor TransformerImpl::loss(const torch::Tensor& tokens, const torch::Tensor& targets) {
  auto out = forward(tokens);
  return F::cross_entropy(out.view({-1, config_.vocab}), targets.reshape({-1}));
}

torch::Tensor TransformerImpl::head_loss(const torch::Tensor& x, const torch::Tensor& targets) {
  auto out = logits(x);
  return F::cross_entropy(out.view({-1, config_.vocab}), targets.reshape({-1}));
}

std::vector<std::vector<torch::Tensor>> TransformerImpl::parameter_stages() const {
  const auto layers = static_cast<std::size_t>(config_.layers);
  std::vector<std::vector<torch::Tensor>> stages(layers + 2);
  stages[0] = tok_embedding_->parameters();
  if (!pos_embedding_.is_empty()) {
    for (const auto& p : pos_embedding_->parameters()) stages[0].push_back(p);
  }
  for (std::size_t l = 0; l < layers; ++l) stages[1 + l] = blocks_->ptr(l)->parameters();
  stages[layers + 1] = final_norm_.ptr()->parameters();
  if (!lm_head_.is_empty()) {
    for (const auto& p : lm_head_->parameters()) stages[layers + 1].push_back(p);
  }
  return stages;
}

Transformer make_model(const ModelConfig& config, const torch::Device& device) {
  Transformer model(config);
  model->to(device);
  return model;
}

}  // namespace tidal::models
