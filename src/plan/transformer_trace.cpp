// The analytic transformer trace (transformer_trace in model_trace.hpp): one GPU's ops of a
// training iteration, built block by block from a table of the model's parts.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "plan/trace_names.hpp"
#include "plan/transformer/moe_block.hpp"
#include "plan/transformer/trace_builder.hpp"
#include "tidal/common/error.hpp"
#include "tidal/plan/model_trace.hpp"

namespace tidal::plan {

namespace {

using detail::transformer::Builder;
using detail::transformer::check_arguments;
using detail::transformer::kFloat;
using detail::transformer::kNone;
using detail::transformer::MoeBlock;
using detail::transformer::MoeParams;
using detail::transformer::MoeSaved;
using detail::transformer::Param;

// The parameters of one block (indices into the builder's parameters; kNone where the
// architecture has no such part).
struct LayerParams {
  std::size_t n1 = kNone, n1b = kNone, n2 = kNone, n2b = kNone, q = kNone, k = kNone, v = kNone,
              o = kNone, ob = kNone, w1 = kNone, w2 = kNone, w3 = kNone, qkv = kNone, qkvb = kNone,
              fc = kNone, fcb = kNone, proj = kNone, projb = kNone;
  MoeParams moe;          ///< a mixture of experts' MLP (Llama with experts)
  std::size_t first = 0;  ///< first parameter of the block
  std::size_t end = 0;    ///< one past its last
};

// What a block's forward pass keeps for its backward pass.
struct Saved {
  TensorId x = -1, n1 = -1, s1 = -1, q = -1, k = -1, v = -1, qkv = -1, o = -1, lse = -1, h1 = -1,
           n2 = -1, s2 = -1, a = -1, up = -1, act = -1, m = -1;
  MoeSaved moe;
};

// One GPU's share of the model's dimensions under tensor parallelism: attention heads, the MLP
// and the vocabulary are split over the group (Megatron-LM's column/row split); the hidden
// dimension and the norms are whole on every GPU.
struct Dims {
  std::int64_t h = 0;      ///< hidden
  std::int64_t q = 0;      ///< this GPU's query/attention width (hidden / tp)
  std::int64_t kv = 0;     ///< this GPU's key/value width
  std::int64_t f = 0;      ///< this GPU's MLP width
  std::int64_t vocab = 0;  ///< this GPU's share of the vocabulary (embedding and head)
  std::int64_t heads = 0;  ///< this GPU's attention heads
  std::int64_t norm_stats = 1;
  double attn_flops = 0;  ///< one micro-batch's causal attention, this GPU's heads
};

constexpr double kAttnEfficiency = 0.7;

class TransformerTraceBuilder {
 public:
  TransformerTraceBuilder(const TransformerConfig& cfg, std::int64_t batch, std::int64_t seq,
                          const Hardware& hw, const AnalyticTraceOptions& o)
      : cfg_(cfg),
        opt_(o),
        llama_(cfg.arch == Architecture::kLlama),
        mb_batch_(batch / o.data_parallel / o.micro_batches),
        seq_(seq),
        b_(hw, mb_batch_ * seq, o.precision),
        moe_(b_, cfg, mb_batch_ * seq, o.tensor_parallel) {
    const int tp = o.tensor_parallel;
    d_.h = cfg.hidden;
    d_.q = cfg.hidden / tp;
    d_.kv = cfg.hidden / cfg.heads * cfg.kv_heads / tp;
    d_.f = cfg.ffn / tp;
    d_.vocab = cfg.vocab / tp;
    d_.heads = cfg.heads / tp;
    d_.norm_stats = llama_ ? 1 : 2;
    // Causal attention computes half of QK^T and PV; the backward pass is about 2.5x the forward.
    d_.attn_flops = 2.0 * static_cast<double>(mb_batch_) * static_cast<double>(seq) *
                    static_cast<double>(seq) * static_cast<double>(d_.q);
  }

  trace::Trace build() {
    add_parameters();
    const int M = opt_.micro_batches;
    // Gradient accumulation: each micro-batch runs forward and backward on its share of the
    // batch; the first backward op that writes a gradient makes it, the later ones (in this and
    // the next micro-batches) accumulate into it, and the optimizer step reads it once after the
    // last.
    if (M > 1 && opt_.micro_batch_order == MicroBatchOrder::kLayerMajor) {
      layer_major();
    } else {
      for (int mb = 0; mb < M; ++mb) {
        b_.set_prefix(M > 1 ? "mb" + std::to_string(mb) + "." : "");
        last_micro_batch_ = mb == M - 1;
        micro_batch();
      }
    }
    b_.set_prefix("");
    b_.optimizer_step();
    return b_.take();
  }

 private:
  [[nodiscard]] TensorId W(std::size_t i) const { return b_.weight(i); }
  [[nodiscard]] int tp() const { return opt_.tensor_parallel; }

  std::size_t add(const std::string& name, std::int64_t elems) { return b_.param(name, elems); }

  void add_parameters() {
    wte_ = add("tok_embeddings.weight", d_.vocab * d_.h);
    if (!llama_) wpe_ = add("wpe.weight", cfg_.max_seq * d_.h);
    lp_.resize(static_cast<std::size_t>(cfg_.layers));
    for (int l = 0; l < cfg_.layers; ++l) {
      LayerParams& x = lp_[static_cast<std::size_t>(l)];
      x.first = b_.param_count();
      if (llama_) {
        add_llama_block(block_prefix(l), x);
      } else {
        add_gpt2_block(block_prefix(l), x);
      }
      x.end = b_.param_count();
    }
    wf_ = add("norm.weight", d_.h);
    if (!llama_) wfb_ = add("norm.bias", d_.h);
    head_ = cfg_.tied_embeddings ? wte_ : add("output.weight", d_.vocab * d_.h);
  }

  void add_llama_block(const std::string& p, LayerParams& x) {
    const std::int64_t h = d_.h;
    x.n1 = add(p + "attention_norm.weight", h);
    x.q = add(p + "attention.wq.weight", h * d_.q);
    x.k = add(p + "attention.wk.weight", h * d_.kv);
    x.v = add(p + "attention.wv.weight", h * d_.kv);
    x.o = add(p + "attention.wo.weight", d_.q * h);
    x.n2 = add(p + "ffn_norm.weight", h);
    if (cfg_.moe()) {
      x.moe = moe_.add_parameters(p);
      return;
    }
    x.w1 = add(p + "feed_forward.w1.weight", h * d_.f);
    x.w3 = add(p + "feed_forward.w3.weight", h * d_.f);
    x.w2 = add(p + "feed_forward.w2.weight", d_.f * h);
  }

  void add_gpt2_block(const std::string& p, LayerParams& x) {
    const std::int64_t h = d_.h;
    x.n1 = add(p + "ln_1.weight", h);
    x.n1b = add(p + "ln_1.bias", h);
    x.qkv = add(p + "attn.c_attn.weight", h * 3 * d_.q);
    x.qkvb = add(p + "attn.c_attn.bias", 3 * d_.q);
    x.o = add(p + "attn.c_proj.weight", d_.q * h);
    x.ob = add(p + "attn.c_proj.bias", h);
    x.n2 = add(p + "ln_2.weight", h);
    x.n2b = add(p + "ln_2.bias", h);
    x.fc = add(p + "mlp.c_fc.weight", h * d_.f);
    x.fcb = add(p + "mlp.c_fc.bias", d_.f);
    x.proj = add(p + "mlp.c_proj.weight", d_.f * h);
    x.projb = add(p + "mlp.c_proj.bias", h);
  }

  static std::string block_prefix(int l) { return "layers." + std::to_string(l) + "."; }

  // y = x W^T (+ b) over all tokens: the forward op.
  TensorId linear(const std::string& name, int layer, TensorId x, std::size_t w, std::int64_t in,
                  std::int64_t outf, TensorClass cls = TensorClass::kActivation,
                  std::size_t bias = kNone) {
    return b_.linear(name, layer, x, w, tokens(), in, outf, cls, bias);
  }

  // Backward of a linear over all tokens: grad of the input and of the weight (and bias).
  TensorId linear_bwd(const std::string& name, int layer, TensorId gy, TensorId x, std::size_t w,
                      std::int64_t in, std::int64_t outf, std::size_t bias = kNone) {
    return b_.linear_bwd(name, layer, gy, x, w, tokens(), in, outf, bias);
  }

  // A norm's backward op: the output's gradient, the input, the saved statistics and the weight
  // in; the input's gradient out, with the weight's (and GPT-2's bias's) gradient made or
  // accumulated by the same op.
  void norm_bwd(const std::string& name, int layer, TensorId g_out, TensorId input, TensorId stats,
                std::size_t weight, std::size_t bias, TensorId g_in) {
    std::vector<TensorId> in{g_out, input, stats, W(weight)};
    std::vector<TensorId> out{g_in};
    b_.grad(weight, in, out);
    if (!llama_) b_.grad(bias, in, out);
    b_.op(name, Phase::kBackward, layer, in, out, 0);
  }

  // Tensor parallelism: the partial sums of a row-parallel output (or of a column-parallel
  // input's gradient) are added over the group.
  void tp_all_reduce(const std::string& name, Phase phase, int layer, TensorId t) {
    if (tp() > 1) b_.all_reduce(name + ".all_reduce", phase, layer, {t}, tp());
  }

  // Data parallelism: the gradients of `params` are averaged over the group once the last
  // micro-batch's backward has completed them.
  void dp_all_reduce(const std::string& name, int layer, const std::vector<std::size_t>& params) {
    if (opt_.data_parallel <= 1 || !last_micro_batch_) return;
    std::vector<TensorId> grads;
    grads.reserve(params.size());
    for (std::size_t i : params) grads.push_back(b_.gradient(i));
    b_.all_reduce(name + ".grads.all_reduce", Phase::kBackward, layer, grads, opt_.data_parallel);
  }

  [[nodiscard]] std::int64_t tokens() const { return mb_batch_ * seq_; }

  // A micro-batch's inputs (its tokens and targets) and its empty record of saved activations.
  void begin_micro_batch() {
    const auto T = static_cast<std::uint64_t>(tokens());
    tokens_ = b_.tensor(b_.prefix() + "tokens", T * 8, TensorClass::kInput);
    targets_ = b_.tensor(b_.prefix() + "targets", T * 8, TensorClass::kInput);
    saved_.assign(static_cast<std::size_t>(cfg_.layers), Saved{});
  }

  void micro_batch() {
    begin_micro_batch();
    TensorId x = embedding_forward();
    for (int l = 0; l < cfg_.layers; ++l) x = block_forward(l, x);
    TensorId gx = head_forward_backward(x);
    for (int l = cfg_.layers - 1; l >= 0; --l) gx = block_backward(l, gx);
    embedding_backward(gx);
  }

  // GreedySnake's vertical order: every micro-batch through a layer before the next layer, in
  // forward and in backward. Each layer's weights are read once per pass for all micro-batches
  // and its gradients are complete after its last micro-batch's backward; every micro-batch's
  // saved activations are alive at once between the passes.
  void layer_major() {
    const int M = opt_.micro_batches;
    struct MicroBatch {
      TensorId tokens = -1, targets = -1, x = -1;
      std::vector<Saved> saved;
    };
    std::vector<MicroBatch> mbs(static_cast<std::size_t>(M));
    const auto each = [&](const auto& body) {
      for (int mb = 0; mb < M; ++mb) {
        MicroBatch& m = mbs[static_cast<std::size_t>(mb)];
        b_.set_prefix("mb" + std::to_string(mb) + ".");
        last_micro_batch_ = mb == M - 1;
        tokens_ = m.tokens;
        targets_ = m.targets;
        saved_.swap(m.saved);
        body(m);
        saved_.swap(m.saved);
      }
    };
    each([&](MicroBatch& m) {
      begin_micro_batch();
      m.tokens = tokens_;
      m.targets = targets_;
      m.x = embedding_forward();
    });
    for (int l = 0; l < cfg_.layers; ++l) each([&](MicroBatch& m) { m.x = block_forward(l, m.x); });
    each([&](MicroBatch& m) { m.x = head_forward_backward(m.x); });  // m.x: the gradient now
    for (int l = cfg_.layers - 1; l >= 0; --l) {
      each([&](MicroBatch& m) { m.x = block_backward(l, m.x); });
    }
    each([&](MicroBatch& m) { embedding_backward(m.x); });
  }

  TensorId embedding_forward() {
    const TensorId x = b_.act("embedding.out", d_.h);
    std::vector<TensorId> in{tokens_, W(wte_)};
    if (!llama_) in.push_back(W(wpe_));
    b_.op("embedding", Phase::kForward, -1, in, {x}, 0);
    tp_all_reduce("embedding", Phase::kForward, -1, x);
    return x;
  }

  TensorId block_forward(int l, TensorId x) {
    const LayerParams& P = lp_[static_cast<std::size_t>(l)];
    Saved& s = saved_[static_cast<std::size_t>(l)];
    const std::string p = block_prefix(l);
    s.x = x;
    s.n1 = b_.act(p + "norm1.out", d_.h);
    s.s1 = b_.act(p + "norm1.stats", d_.norm_stats);
    if (llama_) {
      llama_attention_forward(l, p, P, s);
    } else {
      gpt2_attention_forward(l, p, P, s);
    }
    const TensorId po =
        llama_ ? linear(p + "attention.wo", l, s.o, P.o, d_.q, d_.h, TensorClass::kTemporary)
               : linear(p + "attn.c_proj", l, s.o, P.o, d_.q, d_.h, TensorClass::kTemporary, P.ob);
    tp_all_reduce(p + "attention.out_proj", Phase::kForward, l, po);
    s.h1 = b_.act(p + "residual1", d_.h);
    b_.op(p + "add1", Phase::kForward, l, {x, po}, {s.h1}, 0);
    s.n2 = b_.act(p + "norm2.out", d_.h);
    s.s2 = b_.act(p + "norm2.stats", d_.norm_stats);
    const TensorId down = llama_ ? llama_mlp_forward(l, p, P, s) : gpt2_mlp_forward(l, p, P, s);
    tp_all_reduce(p + "mlp.down_proj", Phase::kForward, l, down);
    const TensorId out = b_.act(p + "out", d_.h);
    b_.op(p + "add2", Phase::kForward, l, {s.h1, down}, {out}, 0);
    return out;
  }

  void llama_attention_forward(int l, const std::string& p, const LayerParams& P, Saved& s) {
    b_.op(p + "attention_norm", Phase::kForward, l, {s.x, W(P.n1)}, {s.n1, s.s1}, 0);
    const TensorId q =
        linear(p + "attention.wq", l, s.n1, P.q, d_.h, d_.q, TensorClass::kTemporary);
    const TensorId k =
        linear(p + "attention.wk", l, s.n1, P.k, d_.h, d_.kv, TensorClass::kTemporary);
    s.v = linear(p + "attention.wv", l, s.n1, P.v, d_.h, d_.kv);
    s.q = b_.act(p + "rope.q", d_.q);
    s.k = b_.act(p + "rope.k", d_.kv);
    b_.op(p + "rope", Phase::kForward, l, {q, k}, {s.q, s.k}, 0);
    s.o = b_.act(p + "attention.out", d_.q);
    s.lse = b_.act(p + "attention.lse", d_.heads);
    b_.op(p + "attention", Phase::kForward, l, {s.q, s.k, s.v}, {s.o, s.lse}, d_.attn_flops,
          kAttnEfficiency);
  }

  void gpt2_attention_forward(int l, const std::string& p, const LayerParams& P, Saved& s) {
    b_.op(p + "ln_1", Phase::kForward, l, {s.x, W(P.n1), W(P.n1b)}, {s.n1, s.s1}, 0);
    s.qkv =
        linear(p + "attn.c_attn", l, s.n1, P.qkv, d_.h, 3 * d_.q, TensorClass::kActivation, P.qkvb);
    s.o = b_.act(p + "attention.out", d_.q);
    s.lse = b_.act(p + "attention.lse", d_.heads);
    b_.op(p + "attention", Phase::kForward, l, {s.qkv}, {s.o, s.lse}, d_.attn_flops,
          kAttnEfficiency);
  }

  TensorId llama_mlp_forward(int l, const std::string& p, const LayerParams& P, Saved& s) {
    b_.op(p + "ffn_norm", Phase::kForward, l, {s.h1, W(P.n2)}, {s.n2, s.s2}, 0);
    if (cfg_.moe()) return moe_.forward(l, p, P.moe, s.n2, s.moe);
    s.a = linear(p + "feed_forward.w1", l, s.n2, P.w1, d_.h, d_.f);
    s.up = linear(p + "feed_forward.w3", l, s.n2, P.w3, d_.h, d_.f);
    s.act = b_.act(p + "silu.out", d_.f);
    b_.op(p + "silu", Phase::kForward, l, {s.a}, {s.act}, 0);
    s.m = b_.act(p + "mul.out", d_.f);
    b_.op(p + "mul", Phase::kForward, l, {s.act, s.up}, {s.m}, 0);
    return linear(p + "feed_forward.w2", l, s.m, P.w2, d_.f, d_.h, TensorClass::kTemporary);
  }

  TensorId gpt2_mlp_forward(int l, const std::string& p, const LayerParams& P, Saved& s) {
    b_.op(p + "ln_2", Phase::kForward, l, {s.h1, W(P.n2), W(P.n2b)}, {s.n2, s.s2}, 0);
    s.a = linear(p + "mlp.c_fc", l, s.n2, P.fc, d_.h, d_.f, TensorClass::kActivation, P.fcb);
    s.act = b_.act(p + "gelu.out", d_.f);
    b_.op(p + "gelu", Phase::kForward, l, {s.a}, {s.act}, 0);
    return linear(p + "mlp.c_proj", l, s.act, P.proj, d_.f, d_.h, TensorClass::kTemporary, P.projb);
  }

  // The final norm, the head, the loss and their backward ops; returns the gradient of the last
  // block's output.
  TensorId head_forward_backward(TensorId xl) {
    const TensorId nf = b_.act("norm.out", d_.h);
    const TensorId sf = b_.act("norm.stats", d_.norm_stats);
    std::vector<TensorId> in{xl, W(wf_)};
    if (!llama_) in.push_back(W(wfb_));
    b_.op("norm", Phase::kForward, -1, in, {nf, sf}, 0);
    const TensorId logits =
        linear("output", -1, nf, head_, d_.h, d_.vocab, TensorClass::kTemporary);
    const TensorId lsm = b_.act("log_softmax.out", d_.vocab);
    b_.op("log_softmax", Phase::kForward, -1, {logits}, {lsm}, 0);
    if (tp() > 1) {
      // Vocabulary-parallel cross-entropy: each token's max, sum of exponentials and target
      // logit are reduced over the group.
      const TensorId partial = b_.temp("loss.partials", 3);
      b_.op("loss.partials", Phase::kForward, -1, {lsm, targets_}, {partial}, 0);
      b_.all_reduce("loss.all_reduce", Phase::kForward, -1, {partial}, tp());
    }
    const TensorId loss =
        b_.tensor(b_.prefix() + "loss", b_.activation_bytes(), TensorClass::kActivation);
    b_.op("nll_loss", Phase::kForward, -1, {lsm, targets_}, {loss}, 0);

    const TensorId g_lsm = b_.temp("nll_loss.grad", d_.vocab);
    b_.op("nll_loss.bwd", Phase::kBackward, -1, {loss, targets_}, {g_lsm}, 0);
    const TensorId g_logits = b_.temp("log_softmax.grad", d_.vocab);
    b_.op("log_softmax.bwd", Phase::kBackward, -1, {g_lsm, lsm}, {g_logits}, 0);
    const TensorId g_nf = linear_bwd("output", -1, g_logits, nf, head_, d_.h, d_.vocab);
    tp_all_reduce("output.grad_in", Phase::kBackward, -1, g_nf);
    const TensorId gx = b_.temp("norm.grad_in", d_.h);
    norm_bwd("norm.bwd", -1, g_nf, xl, sf, wf_, wfb_, gx);
    std::vector<std::size_t> head_params{wf_};
    if (!llama_) head_params.push_back(wfb_);
    if (head_ != wte_) head_params.push_back(head_);
    dp_all_reduce("head", -1, head_params);
    return gx;
  }

  TensorId block_backward(int l, TensorId gx) {
    const LayerParams& P = lp_[static_cast<std::size_t>(l)];
    const Saved& s = saved_[static_cast<std::size_t>(l)];
    const std::string p = block_prefix(l);
    const TensorId g_n2 =
        llama_ ? llama_mlp_backward(l, p, P, s, gx) : gpt2_mlp_backward(l, p, P, s, gx);
    tp_all_reduce(p + "mlp.grad_in", Phase::kBackward, l, g_n2);
    const TensorId g_h1p = b_.temp(p + "norm2.grad_in", d_.h);
    norm_bwd(p + "norm2.bwd", l, g_n2, s.h1, s.s2, P.n2, P.n2b, g_h1p);
    const TensorId g_h1 = b_.temp(p + "residual1.grad", d_.h);
    b_.op(p + "add2.bwd", Phase::kBackward, l, {gx, g_h1p}, {g_h1}, 0);
    const TensorId g_o = llama_
                             ? linear_bwd(p + "attention.wo", l, g_h1, s.o, P.o, d_.q, d_.h)
                             : linear_bwd(p + "attn.c_proj", l, g_h1, s.o, P.o, d_.q, d_.h, P.ob);
    const TensorId g_n1 = llama_ ? llama_attention_backward(l, p, P, s, g_o)
                                 : gpt2_attention_backward(l, p, P, s, g_o);
    tp_all_reduce(p + "attention.grad_in", Phase::kBackward, l, g_n1);
    const TensorId g_xp = b_.temp(p + "norm1.grad_in", d_.h);
    norm_bwd(p + "norm1.bwd", l, g_n1, s.x, s.s1, P.n1, P.n1b, g_xp);
    const TensorId g_x = b_.temp(p + "grad_in", d_.h);
    b_.op(p + "add1.bwd", Phase::kBackward, l, {g_h1, g_xp}, {g_x}, 0);
    std::vector<std::size_t> block_params(P.end - P.first);
    std::iota(block_params.begin(), block_params.end(), P.first);
    dp_all_reduce(p.substr(0, p.size() - 1), l, block_params);
    return g_x;
  }

  TensorId llama_mlp_backward(int l, const std::string& p, const LayerParams& P, const Saved& s,
                              TensorId gx) {
    if (cfg_.moe()) return moe_.backward(l, p, P.moe, s.moe, s.n2, gx);
    const TensorId g_m = linear_bwd(p + "feed_forward.w2", l, gx, s.m, P.w2, d_.f, d_.h);
    const TensorId g_sa = b_.temp(p + "mul.grad_a", d_.f);
    const TensorId g_b = b_.temp(p + "mul.grad_b", d_.f);
    b_.op(p + "mul.bwd", Phase::kBackward, l, {g_m, s.act, s.up}, {g_sa, g_b}, 0);
    const TensorId g_a = b_.temp(p + "silu.grad", d_.f);
    b_.op(p + "silu.bwd", Phase::kBackward, l, {g_sa, s.a}, {g_a}, 0);
    const TensorId g3 = linear_bwd(p + "feed_forward.w3", l, g_b, s.n2, P.w3, d_.h, d_.f);
    const TensorId g1 = linear_bwd(p + "feed_forward.w1", l, g_a, s.n2, P.w1, d_.h, d_.f);
    const TensorId g_n2 = b_.temp(p + "norm2.grad_out", d_.h);
    b_.op(p + "ffn_norm.grad_sum", Phase::kBackward, l, {g1, g3}, {g_n2}, 0);
    return g_n2;
  }

  TensorId gpt2_mlp_backward(int l, const std::string& p, const LayerParams& P, const Saved& s,
                             TensorId gx) {
    const TensorId g_g = linear_bwd(p + "mlp.c_proj", l, gx, s.act, P.proj, d_.f, d_.h, P.projb);
    const TensorId g_a = b_.temp(p + "gelu.grad", d_.f);
    b_.op(p + "gelu.bwd", Phase::kBackward, l, {g_g, s.a}, {g_a}, 0);
    return linear_bwd(p + "mlp.c_fc", l, g_a, s.n2, P.fc, d_.h, d_.f, P.fcb);
  }

  TensorId llama_attention_backward(int l, const std::string& p, const LayerParams& P,
                                    const Saved& s, TensorId g_o) {
    const TensorId g_q = b_.temp(p + "rope.grad_q", d_.q);
    const TensorId g_k = b_.temp(p + "rope.grad_k", d_.kv);
    const TensorId g_v = b_.temp(p + "attention.grad_v", d_.kv);
    b_.op(p + "attention.bwd", Phase::kBackward, l, {g_o, s.q, s.k, s.v, s.o, s.lse},
          {g_q, g_k, g_v}, 2.5 * d_.attn_flops, kAttnEfficiency);
    const TensorId g_q0 = b_.temp(p + "wq.grad_out", d_.q);
    const TensorId g_k0 = b_.temp(p + "wk.grad_out", d_.kv);
    b_.op(p + "rope.bwd", Phase::kBackward, l, {g_q, g_k}, {g_q0, g_k0}, 0);
    const TensorId gq = linear_bwd(p + "attention.wq", l, g_q0, s.n1, P.q, d_.h, d_.q);
    const TensorId gk = linear_bwd(p + "attention.wk", l, g_k0, s.n1, P.k, d_.h, d_.kv);
    const TensorId gv = linear_bwd(p + "attention.wv", l, g_v, s.n1, P.v, d_.h, d_.kv);
    const TensorId g_n1 = b_.temp(p + "norm1.grad_out", d_.h);
    b_.op(p + "attention_norm.grad_sum", Phase::kBackward, l, {gq, gk, gv}, {g_n1}, 0);
    return g_n1;
  }

  TensorId gpt2_attention_backward(int l, const std::string& p, const LayerParams& P,
                                   const Saved& s, TensorId g_o) {
    const TensorId g_qkv = b_.temp(p + "attn.c_attn.grad_out", 3 * d_.q);
    b_.op(p + "attention.bwd", Phase::kBackward, l, {g_o, s.qkv, s.o, s.lse}, {g_qkv},
          2.5 * d_.attn_flops, kAttnEfficiency);
    return linear_bwd(p + "attn.c_attn", l, g_qkv, s.n1, P.qkv, d_.h, 3 * d_.q, P.qkvb);
  }

  void embedding_backward(TensorId gx) {
    std::vector<TensorId> in{gx, tokens_};
    std::vector<TensorId> out;
    b_.grad(wte_, in, out);
    if (!llama_) b_.grad(wpe_, in, out);
    b_.op("embedding.bwd", Phase::kBackward, -1, in, out, 0);
    std::vector<std::size_t> params{wte_};
    if (!llama_) params.push_back(wpe_);
    dp_all_reduce("embedding", -1, params);
  }

  const TransformerConfig& cfg_;
  const AnalyticTraceOptions& opt_;
  bool llama_;
  std::int64_t mb_batch_;  ///< sequences per micro-batch
  std::int64_t seq_;
  Dims d_;
  Builder b_;
  MoeBlock moe_;  ///< the blocks' mixture-of-experts MLP, where the model has experts
  std::size_t wte_ = kNone, wpe_ = kNone, wf_ = kNone, wfb_ = kNone, head_ = kNone;
  std::vector<LayerParams> lp_;
  std::vector<Saved> saved_;
  TensorId tokens_ = -1;
  TensorId targets_ = -1;
  bool last_micro_batch_ = true;
};

}  // namespace

AnalyticTraceSize analytic_trace_size(const TransformerConfig& cfg, std::int64_t batch,
                                      std::int64_t seq, const Hardware& hw,
                                      const AnalyticTraceOptions& options) {
  check_arguments(cfg, batch, seq, hw, options);
  TransformerConfig small = cfg;
  AnalyticTraceSize one;
  AnalyticTraceSize two;
  for (int layers : {1, 2}) {
    small.layers = layers;
    const trace::Trace t = TransformerTraceBuilder(small, batch, seq, hw, options).build();
    AnalyticTraceSize& s = layers == 1 ? one : two;
    s.ops = static_cast<std::int64_t>(t.ops.size());
    s.tensors = static_cast<std::int64_t>(t.tensors.size());
  }
  const auto blocks = static_cast<std::int64_t>(cfg.layers) - 1;
  AnalyticTraceSize out{one.ops + blocks * (two.ops - one.ops),
                        one.tensors + blocks * (two.tensors - one.tensors)};
  constexpr std::int64_t kMaxIndex = std::numeric_limits<std::int32_t>::max();
  TIDAL_EXPECT_AS(InvalidArgument, out.ops <= kMaxIndex && out.tensors <= kMaxIndex,
                  "an analytic trace of ", cfg.name, " with ", cfg.layers, " layers would have ",
                  out.ops, " ops and ", out.tensors,
                  " tensors, more than a trace can index (2^31): give fewer layers");
  return out;
}

trace::Trace transformer_trace(const TransformerConfig& cfg, std::int64_t batch, std::int64_t seq,
                               const Hardware& hw, const AnalyticTraceOptions& options) {
  check_arguments(cfg, batch, seq, hw, options);
  // Beyond a few blocks, the index limits are checked before anything is allocated.
  if (cfg.layers > 2) (void)analytic_trace_size(cfg, batch, seq, hw, options);
  trace::Trace t = TransformerTraceBuilder(cfg, batch, seq, hw, options).build();
  t.model = cfg.name;
  t.device = "cuda:0";
  t.batch = batch / options.data_parallel;
  if (options.micro_batches > 1) {
    t.meta["micro_batches"] = std::to_string(options.micro_batches);
    t.meta["micro_batch_order"] = to_string(options.micro_batch_order);
  }
  if (options.data_parallel > 1) t.meta["data_parallel"] = std::to_string(options.data_parallel);
  if (options.tensor_parallel > 1)
    t.meta["tensor_parallel"] = std::to_string(options.tensor_parallel);
  t.seq = seq;
  t.meta["generator"] = "tidal analytic transformer trace";
  t.meta["precision"] = to_string(options.precision);
  t.meta["optimizer"] = "AdamW";
  t.meta["hardware"] = hw.name;
  t.meta["parameters"] = std::to_string(cfg.parameters());
  t.meta["optimizer_schedule"] = to_string(OptimizerSchedule::kAfterBackward);
  trace::validate(t);
  switch (options.optimizer) {
    case OptimizerSchedule::kInBackward:
      return optimizer_in_backward(t);
    case OptimizerSchedule::kDeferred:
      return optimizer_deferred(t);
    case OptimizerSchedule::kAfterBackward:
      break;
  }
  return t;
}

}  // namespace tidal::plan
