#include "tidal/plan/model_trace.hpp"

#include <algorithm>
#include <utility>

#include "tidal/common/error.hpp"

namespace tidal::plan {

using trace::OpIndex;
using trace::Phase;
using trace::TensorClass;
using trace::TensorId;

namespace {

struct PrecisionName {
  Precision precision;
  const char* name;
};
constexpr PrecisionName kPrecisionNames[] = {
    {Precision::kFp32, "fp32"},
    {Precision::kBf16Mixed, "bf16-mixed"},
    {Precision::kBf16, "bf16"},
};

}  // namespace

const char* to_string(Precision p) {
  for (const auto& n : kPrecisionNames) {
    if (n.precision == p) return n.name;
  }
  return "?";
}

Precision precision_from_string(const std::string& s) {
  std::string names;
  for (const auto& n : kPrecisionNames) {
    if (s == n.name) return n.precision;
    names += (names.empty() ? "" : ", ") + std::string(n.name);
  }
  TIDAL_EXPECT_AS(InvalidArgument, false, "unknown precision '", s, "'; choose one of: ", names);
  return Precision::kFp32;
}

std::int64_t TransformerConfig::parameters() const {
  const std::int64_t h = hidden;
  const std::int64_t kv = h / heads * kv_heads;
  std::int64_t per_layer = 0;
  std::int64_t rest = 0;
  if (arch == Architecture::kLlama) {
    per_layer = 2 * h + h * h + 2 * h * kv + h * h + 3 * h * ffn;
    rest = vocab * h + h + (tied_embeddings ? 0 : vocab * h);
  } else {
    per_layer = 4 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * ffn + ffn) + (ffn * h + h);
    rest = vocab * h + max_seq * h + 2 * h;
  }
  return per_layer * layers + rest;
}

std::vector<std::string> model_preset_names() {
  return {"gpt2-small",  "gpt2-medium", "gpt2-large", "gpt2-xl",
          "llama3.2-1b", "llama3-8b",   "llama3-70b", "llama3.1-405b"};
}

TransformerConfig model_preset(const std::string& name) {
  TransformerConfig c;
  c.name = name;
  auto gpt2 = [&](int layers, std::int64_t hidden, int heads) {
    c.arch = Architecture::kGpt2;
    c.layers = layers;
    c.hidden = hidden;
    c.heads = c.kv_heads = heads;
    c.ffn = 4 * hidden;
    c.vocab = 50257;
    c.max_seq = 1024;
    c.tied_embeddings = true;
  };
  auto llama = [&](int layers, std::int64_t hidden, int heads, int kv, std::int64_t ffn,
                   bool tied) {
    c.arch = Architecture::kLlama;
    c.layers = layers;
    c.hidden = hidden;
    c.heads = heads;
    c.kv_heads = kv;
    c.ffn = ffn;
    c.vocab = 128256;
    c.max_seq = 131072;
    c.tied_embeddings = tied;
  };
  if (name == "gpt2-small") {
    gpt2(12, 768, 12);
  } else if (name == "gpt2-medium") {
    gpt2(24, 1024, 16);
  } else if (name == "gpt2-large") {
    gpt2(36, 1280, 20);
  } else if (name == "gpt2-xl") {
    gpt2(48, 1600, 25);
  } else if (name == "llama3.2-1b") {
    llama(16, 2048, 32, 8, 8192, true);
  } else if (name == "llama3-8b") {
    llama(32, 4096, 32, 8, 14336, false);
  } else if (name == "llama3-70b") {
    llama(80, 8192, 64, 8, 28672, false);
  } else if (name == "llama3.1-405b") {
    llama(126, 16384, 128, 8, 53248, false);
  } else {
    std::string names;
    for (const auto& n : model_preset_names()) names += (names.empty() ? "" : ", ") + n;
    TIDAL_EXPECT_AS(InvalidArgument, false, "unknown model '", name, "'; choose one of: ", names,
                    " (and shape it with --layers/--hidden/--heads/--ffn/--vocab)");
  }
  return c;
}

void apply_overrides(TransformerConfig& cfg, const ModelOverrides& o) {
  const bool any = o.layers || o.hidden || o.heads || o.kv_heads || o.ffn || o.vocab;
  if (o.layers) cfg.layers = *o.layers;
  if (o.hidden) cfg.hidden = *o.hidden;
  if (o.heads) {
    cfg.heads = *o.heads;
    if (cfg.arch == Architecture::kGpt2 || !o.kv_heads)
      cfg.kv_heads = std::min(cfg.kv_heads, *o.heads);
  }
  if (o.kv_heads) cfg.kv_heads = *o.kv_heads;
  if (o.ffn) cfg.ffn = *o.ffn;
  if (o.vocab) cfg.vocab = *o.vocab;
  if (cfg.arch == Architecture::kGpt2) cfg.kv_heads = cfg.heads;
  if (any) cfg.name += "-custom";
  TIDAL_EXPECT_AS(InvalidArgument,
                  cfg.layers > 0 && cfg.hidden > 0 && cfg.heads > 0 && cfg.kv_heads > 0 &&
                      cfg.ffn > 0 && cfg.vocab > 0,
                  "the model shape must be positive (layers, hidden, heads, ffn, vocab)");
  TIDAL_EXPECT_AS(InvalidArgument, cfg.hidden % cfg.heads == 0, "--hidden ", cfg.hidden,
                  " is not divisible by --heads ", cfg.heads);
  TIDAL_EXPECT_AS(InvalidArgument, cfg.heads % cfg.kv_heads == 0, "--heads ", cfg.heads,
                  " is not divisible by the kv heads ", cfg.kv_heads);
}

namespace {

constexpr std::uint64_t kFloat = 4;

// Bytes per element of each tensor class under a precision.
struct ElementBytes {
  std::uint64_t activation = kFloat;
  std::uint64_t parameter = kFloat;
  std::uint64_t gradient = kFloat;
  std::uint64_t state = kFloat;
};
ElementBytes element_bytes(Precision p) {
  switch (p) {
    case Precision::kFp32:
      return {};
    case Precision::kBf16Mixed:
      return {2, kFloat, kFloat, kFloat};
    case Precision::kBf16:
      return {2, 2, 2, 2};
  }
  return {};
}

struct Param {
  TensorId w = -1;
  TensorId g = -1;
  TensorId m = -1;
  TensorId v = -1;
  std::int64_t elems = 0;
  std::string name;
};

// Builds a trace op by op; times from the roofline of the hardware.
class Builder {
 public:
  Builder(const Hardware& hw, std::int64_t tokens, Precision precision)
      : hw_(hw), tokens_(tokens), bytes_(element_bytes(precision)) {
    flops_ =
        precision != Precision::kFp32 && hw.gpu_flops_bf16 > 0 ? hw.gpu_flops_bf16 : hw.gpu_flops;
  }
  std::uint64_t activation_bytes() const { return bytes_.activation; }

  TensorId tensor(const std::string& name, std::uint64_t bytes, TensorClass cls,
                  bool persistent = false) {
    trace::Tensor t;
    t.id = static_cast<TensorId>(trace_.tensors.size());
    t.name = name;
    t.bytes = bytes;
    t.device = "cuda:0";
    t.cls = cls;
    t.persistent = persistent;
    trace_.tensors.push_back(std::move(t));
    return trace_.tensors.back().id;
  }
  // An fp32 per-pass tensor of `per_token` elements per token, named within the current
  // micro-batch.
  TensorId act(const std::string& name, std::int64_t per_token,
               TensorClass cls = TensorClass::kActivation) {
    return tensor(prefix_ + name,
                  static_cast<std::uint64_t>(per_token * tokens_) * bytes_.activation, cls);
  }
  // Names of the ops and activations that follow: "mb<i>." within micro-batch i of several.
  void set_prefix(std::string prefix) { prefix_ = std::move(prefix); }
  const std::string& prefix() const { return prefix_; }
  TensorId temp(const std::string& name, std::int64_t per_token) {
    return act(name, per_token, TensorClass::kTemporary);
  }

  Param& param(const std::string& name, std::int64_t elems) {
    Param p;
    p.name = name;
    p.elems = elems;
    const auto e = static_cast<std::uint64_t>(elems);
    p.w = tensor(name, e * bytes_.parameter, TensorClass::kParameter, true);
    p.m = tensor(name + ".exp_avg", e * bytes_.state, TensorClass::kOptimizerState, true);
    p.v = tensor(name + ".exp_avg_sq", e * bytes_.state, TensorClass::kOptimizerState, true);
    params_.push_back(p);
    return params_.back();
  }
  std::size_t param_count() const { return params_.size(); }
  Param& param_at(std::size_t i) { return params_[i]; }

  // Adds the gradient of params_[i] to an op: created by the first op that writes it,
  // accumulated (read and written) by later ones.
  void grad(std::size_t i, std::vector<TensorId>& in, std::vector<TensorId>& out) {
    Param& p = params_[i];
    if (p.g < 0) {
      p.g = tensor(p.name + ".grad", static_cast<std::uint64_t>(p.elems) * bytes_.gradient,
                   TensorClass::kGradient);
    } else {
      in.push_back(p.g);
    }
    out.push_back(p.g);
  }

  void op(const std::string& name, Phase phase, int layer, std::vector<TensorId> in,
          std::vector<TensorId> out, double flops, double efficiency = 1.0) {
    trace::Op o;
    o.index = static_cast<OpIndex>(trace_.ops.size());
    o.name = prefix_ + name;
    o.phase = phase;
    o.layer = layer;
    double bytes = 0;
    std::vector<TensorId> seen;
    for (const auto* ids : {&in, &out}) {
      for (TensorId id : *ids) {
        if (std::find(seen.begin(), seen.end(), id) != seen.end()) continue;
        seen.push_back(id);
        bytes += static_cast<double>(trace_.tensors[id].bytes);
      }
    }
    for (std::size_t s = 0; s < out.size(); ++s) {
      trace::Tensor& t = trace_.tensors[out[s]];
      if (!t.persistent && t.producer == trace::kNoOp) {
        t.producer = o.index;
        t.output_slot = static_cast<std::int32_t>(s);
      }
    }
    const double compute = flops / (flops_ * hw_.matmul_efficiency * efficiency);
    const double memory = bytes / hw_.gpu_mem_bw;
    o.start_s = now_;
    now_ += std::max(compute, memory) + hw_.op_overhead_s;
    o.end_s = now_;
    o.inputs = std::move(in);
    o.outputs = std::move(out);
    trace_.ops.push_back(std::move(o));
  }

  // y = x W^T (+ b) over all tokens: the forward op.
  TensorId linear(const std::string& name, int layer, TensorId x, std::size_t w, std::int64_t in,
                  std::int64_t outf, TensorClass cls = TensorClass::kActivation,
                  std::size_t bias = SIZE_MAX) {
    const TensorId y = act(name + ".out", outf, cls);
    std::vector<TensorId> ins{x, params_[w].w};
    if (bias != SIZE_MAX) ins.push_back(params_[bias].w);
    op(name, Phase::kForward, layer, ins, {y}, 2.0 * tokens_ * in * outf);
    return y;
  }

  // Backward of a linear: grad of the input (unless skip_input) and of the weight (and bias).
  TensorId linear_bwd(const std::string& name, int layer, TensorId gy, TensorId x, std::size_t w,
                      std::int64_t in, std::int64_t outf, std::size_t bias = SIZE_MAX,
                      bool need_input_grad = true) {
    TensorId gx = -1;
    const double flops = 2.0 * tokens_ * in * outf;
    if (need_input_grad) {
      gx = temp(name + ".grad_in", in);
      op(name + ".bwd_in", Phase::kBackward, layer, {gy, params_[w].w}, {gx}, flops);
    }
    std::vector<TensorId> ins{x, gy};
    std::vector<TensorId> outs;
    grad(w, ins, outs);
    if (bias != SIZE_MAX) grad(bias, ins, outs);
    op(name + ".bwd_w", Phase::kBackward, layer, ins, outs, flops);
    return gx;
  }

  void optimizer_step() {
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const Param& p = params_[i];
      TIDAL_EXPECT(p.g >= 0, "analytic trace: parameter ", p.name, " got no gradient");
      op("adamw." + p.name, Phase::kOptimizer, -1, {p.w, p.g, p.m, p.v}, {p.w, p.m, p.v},
         10.0 * static_cast<double>(p.elems));
    }
  }

  trace::Trace take() { return std::move(trace_); }

 private:
  const Hardware& hw_;
  std::int64_t tokens_;
  double now_ = 0;
  trace::Trace trace_;
  std::vector<Param> params_;
  std::string prefix_;
  ElementBytes bytes_;
  double flops_ = 0;
};

struct LayerParams {
  std::size_t n1, n1b, n2, n2b, q, k, v, o, w1, w2, w3, qkv, qkvb, ob, fc, fcb, proj, projb;
};

// The trace with its ops in `order` (a permutation of the op indices), renumbered and run back to
// back, each for its op_seconds (its duration and the host time after it travel with it); remap[k]
// receives old op k's new index, last[t] the new last use of tensor t. Tensors are copied as they
// are: the caller moves their producers and free points.
trace::Trace with_op_order(const trace::Trace& in, const std::vector<OpIndex>& order,
                           std::vector<OpIndex>& remap, std::vector<OpIndex>& last) {
  remap.assign(in.ops.size(), trace::kNoOp);
  trace::Trace out = in;
  out.ops.clear();
  double now = 0;
  for (OpIndex k : order) {
    trace::Op o = in.ops[static_cast<std::size_t>(k)];
    const double d = in.op_seconds(static_cast<std::size_t>(k));
    o.index = static_cast<OpIndex>(out.ops.size());
    remap[static_cast<std::size_t>(k)] = o.index;
    o.start_s = now;
    now += d;
    o.end_s = now;
    out.ops.push_back(std::move(o));
  }
  last.assign(out.tensors.size(), trace::kNoOp);
  for (const auto& op : out.ops) {
    for (const auto* ids : {&op.inputs, &op.outputs}) {
      for (TensorId id : *ids) last[static_cast<std::size_t>(id)] = op.index;
    }
  }
  return out;
}

}  // namespace

trace::Trace optimizer_in_backward(const trace::Trace& in) {
  trace::validate(in);
  const auto n = in.ops.size();
  // For each op, the optimizer ops that run right after it (kNoOp slot: those that stay put).
  std::vector<std::vector<OpIndex>> after(n);
  std::vector<char> moved(n, 0);
  std::vector<OpIndex> last_use(in.tensors.size(), trace::kNoOp);
  for (const auto& op : in.ops) {
    if (op.phase == Phase::kOptimizer) continue;
    for (const auto* ids : {&op.inputs, &op.outputs}) {
      for (TensorId id : *ids) last_use[static_cast<std::size_t>(id)] = op.index;
    }
  }
  for (const auto& op : in.ops) {
    if (op.phase != Phase::kOptimizer) continue;
    // After the last op that uses any of its tensors (the gradient's last accumulation, and
    // any later read of the weight), and only if it reads a gradient at all.
    OpIndex at = trace::kNoOp;
    bool reads_grad = false;
    for (const auto* ids : {&op.inputs, &op.outputs}) {
      for (TensorId id : *ids) {
        if (in.tensors[static_cast<std::size_t>(id)].cls == TensorClass::kGradient)
          reads_grad = true;
        const OpIndex u = last_use[static_cast<std::size_t>(id)];
        if (u != trace::kNoOp && (at == trace::kNoOp || u > at)) at = u;
      }
    }
    if (!reads_grad || at == trace::kNoOp || at > op.index) continue;
    after[static_cast<std::size_t>(at)].push_back(op.index);
    moved[static_cast<std::size_t>(op.index)] = 1;
  }
  std::vector<OpIndex> order;
  order.reserve(n);
  for (std::size_t k = 0; k < n; ++k) {
    if (!moved[k]) order.push_back(static_cast<OpIndex>(k));
    for (OpIndex o : after[k]) order.push_back(o);
  }
  std::vector<OpIndex> remap;
  std::vector<OpIndex> new_last;
  trace::Trace out = with_op_order(in, order, remap, new_last);
  // A free point that an update moved before a use of the tensor moves to that use.
  for (auto& t : out.tensors) {
    if (t.producer != trace::kNoOp) t.producer = remap[static_cast<std::size_t>(t.producer)];
    if (t.freed_after != trace::kNoOp) {
      t.freed_after = std::max(remap[static_cast<std::size_t>(t.freed_after)],
                               new_last[static_cast<std::size_t>(t.id)]);
    }
  }
  out.meta["optimizer_schedule"] = "in-backward";
  trace::validate(out);
  return out;
}

trace::Trace optimizer_deferred(const trace::Trace& in) {
  trace::validate(in);
  const auto n = in.ops.size();
  // First use of each tensor by an op outside the optimizer phase.
  std::vector<OpIndex> first_use(in.tensors.size(), trace::kNoOp);
  for (const auto& op : in.ops) {
    if (op.phase == Phase::kOptimizer) continue;
    for (const auto* ids : {&op.inputs, &op.outputs}) {
      for (TensorId id : *ids) {
        auto& f = first_use[static_cast<std::size_t>(id)];
        if (f == trace::kNoOp) f = op.index;
      }
    }
  }
  // For each op, the optimizer ops that run right before it.
  std::vector<std::vector<OpIndex>> before(n);
  std::vector<char> moved(n, 0);
  std::vector<OpIndex> gradient_update(in.tensors.size(), trace::kNoOp);
  std::size_t moves = 0;
  for (const auto& op : in.ops) {
    if (op.phase != Phase::kOptimizer) continue;
    bool reads_grad = false;
    for (TensorId id : op.inputs) {
      const auto& t = in.tensors[static_cast<std::size_t>(id)];
      TIDAL_EXPECT_AS(InvalidArgument, !t.has_gap(), "tensor ", id, " ('", t.name,
                      "') already lives across the iteration boundary; the trace is deferred");
      reads_grad = reads_grad || t.cls == TensorClass::kGradient;
    }
    OpIndex at = trace::kNoOp;
    for (TensorId id : op.outputs) {
      const OpIndex f = first_use[static_cast<std::size_t>(id)];
      if (f != trace::kNoOp && (at == trace::kNoOp || f < at)) at = f;
    }
    if (!reads_grad || at == trace::kNoOp) continue;
    before[static_cast<std::size_t>(at)].push_back(op.index);
    moved[static_cast<std::size_t>(op.index)] = 1;
    ++moves;
    for (TensorId id : op.inputs) {
      if (in.tensors[static_cast<std::size_t>(id)].cls == TensorClass::kGradient) {
        gradient_update[static_cast<std::size_t>(id)] = op.index;
      }
    }
  }
  TIDAL_EXPECT_AS(InvalidArgument, moves > 0,
                  "no optimizer op reads a gradient and writes a tensor that forward or backward "
                  "uses; there is nothing to defer");
  std::vector<OpIndex> order;
  order.reserve(n);
  for (std::size_t k = 0; k < n; ++k) {
    for (OpIndex o : before[k]) order.push_back(o);
    if (!moved[k]) order.push_back(static_cast<OpIndex>(k));
  }
  std::vector<OpIndex> remap;
  std::vector<OpIndex> new_last;
  trace::Trace out = with_op_order(in, order, remap, new_last);
  for (auto& t : out.tensors) {
    const auto id = static_cast<std::size_t>(t.id);
    if (t.producer != trace::kNoOp) t.producer = remap[static_cast<std::size_t>(t.producer)];
    if (gradient_update[id] != trace::kNoOp && t.producer != trace::kNoOp) {
      // Made in backward, read by its update early in the next iteration: a tensor with a gap.
      t.persistent = true;
      t.freed_after = remap[static_cast<std::size_t>(gradient_update[id])];
      continue;
    }
    if (t.freed_after != trace::kNoOp) {
      t.freed_after = std::max(remap[static_cast<std::size_t>(t.freed_after)], new_last[id]);
    }
  }
  out.meta["optimizer_schedule"] = "deferred";
  trace::validate(out);
  return out;
}

trace::Trace transformer_trace(const TransformerConfig& cfg, std::int64_t batch, std::int64_t seq,
                               const Hardware& hw, const AnalyticTraceOptions& options) {
  TIDAL_EXPECT_AS(InvalidArgument, batch > 0 && seq > 0, "batch and seq must be positive, got ",
                  batch, " and ", seq);
  TIDAL_EXPECT_AS(InvalidArgument, hw.gpu_flops > 0 && hw.gpu_mem_bw > 0,
                  "the hardware model needs gpu_flops and gpu_mem_bw for analytic op times");
  TIDAL_EXPECT_AS(InvalidArgument, cfg.arch != Architecture::kGpt2 || seq <= cfg.max_seq, cfg.name,
                  " has ", cfg.max_seq, " positions; --seq ", seq, " is longer");
  const int M = options.micro_batches;
  TIDAL_EXPECT_AS(InvalidArgument, M >= 1 && batch % M == 0, "the batch (", batch,
                  ") must split into micro_batches (", M, ") of equal size");
  const std::int64_t mb_batch = batch / M;
  const std::int64_t T = mb_batch * seq;  // tokens per micro-batch
  const std::int64_t h = cfg.hidden;
  const std::int64_t kv = h / cfg.heads * cfg.kv_heads;
  const std::int64_t f = cfg.ffn;
  const std::int64_t V = cfg.vocab;
  const bool llama = cfg.arch == Architecture::kLlama;
  // Causal attention computes half of QK^T and PV; the backward pass is about 2.5x the forward.
  const double attn_flops = 2.0 * static_cast<double>(mb_batch) * seq * seq * h;
  constexpr double kAttnEfficiency = 0.7;

  Builder b(hw, T, options.precision);
  const std::size_t wte = b.param_count();
  b.param("tok_embeddings.weight", V * h);
  std::size_t wpe = SIZE_MAX;
  if (!llama) {
    wpe = b.param_count();
    b.param("wpe.weight", cfg.max_seq * h);
  }
  std::vector<LayerParams> lp(static_cast<std::size_t>(cfg.layers));
  for (int l = 0; l < cfg.layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    LayerParams& x = lp[static_cast<std::size_t>(l)];
    auto add = [&](const std::string& n, std::int64_t e) {
      const std::size_t i = b.param_count();
      b.param(p + n, e);
      return i;
    };
    if (llama) {
      x.n1 = add("attention_norm.weight", h);
      x.q = add("attention.wq.weight", h * h);
      x.k = add("attention.wk.weight", h * kv);
      x.v = add("attention.wv.weight", h * kv);
      x.o = add("attention.wo.weight", h * h);
      x.n2 = add("ffn_norm.weight", h);
      x.w1 = add("feed_forward.w1.weight", h * f);
      x.w3 = add("feed_forward.w3.weight", h * f);
      x.w2 = add("feed_forward.w2.weight", f * h);
    } else {
      x.n1 = add("ln_1.weight", h);
      x.n1b = add("ln_1.bias", h);
      x.qkv = add("attn.c_attn.weight", h * 3 * h);
      x.qkvb = add("attn.c_attn.bias", 3 * h);
      x.o = add("attn.c_proj.weight", h * h);
      x.ob = add("attn.c_proj.bias", h);
      x.n2 = add("ln_2.weight", h);
      x.n2b = add("ln_2.bias", h);
      x.fc = add("mlp.c_fc.weight", h * f);
      x.fcb = add("mlp.c_fc.bias", f);
      x.proj = add("mlp.c_proj.weight", f * h);
      x.projb = add("mlp.c_proj.bias", h);
    }
  }
  const std::size_t wf = b.param_count();
  b.param("norm.weight", h);
  std::size_t wfb = SIZE_MAX;
  if (!llama) {
    wfb = b.param_count();
    b.param("norm.bias", h);
  }
  std::size_t head = wte;
  if (!cfg.tied_embeddings) {
    head = b.param_count();
    b.param("output.weight", V * h);
  }
  const auto W = [&](std::size_t i) { return b.param_at(i).w; };
  // A norm's backward op: the output's gradient, the input, the saved statistics and the weight
  // in; the input's gradient out, with the weight's (and GPT-2's bias's) gradient made or
  // accumulated by the same op.
  const auto norm_bwd = [&](const std::string& name, int layer, TensorId g_out, TensorId input,
                            TensorId stats, std::size_t weight, std::size_t bias, TensorId g_in) {
    std::vector<TensorId> in{g_out, input, stats, W(weight)};
    std::vector<TensorId> out{g_in};
    b.grad(weight, in, out);
    if (!llama) b.grad(bias, in, out);
    b.op(name, Phase::kBackward, layer, in, out, 0);
  };

  // Gradient accumulation: each micro-batch runs forward and backward on its share of the batch;
  // the first backward op that writes a gradient makes it, the later ones (in this and the next
  // micro-batches) accumulate into it, and the optimizer step reads it once after the last.
  for (int mb = 0; mb < M; ++mb) {
    b.set_prefix(M > 1 ? "mb" + std::to_string(mb) + "." : "");
    const TensorId tokens =
        b.tensor(b.prefix() + "tokens", static_cast<std::uint64_t>(T) * 8, TensorClass::kInput);
    const TensorId targets =
        b.tensor(b.prefix() + "targets", static_cast<std::uint64_t>(T) * 8, TensorClass::kInput);

    // ---- forward
    TensorId x = b.act("embedding.out", h);
    {
      std::vector<TensorId> in{tokens, W(wte)};
      if (!llama) in.push_back(W(wpe));
      b.op("embedding", Phase::kForward, -1, in, {x}, 0);
    }
    struct Saved {
      TensorId x, n1, s1, q, k, v, qkv, o, lse, h1, n2, s2, a, bb, sa, m, g;
    };
    std::vector<Saved> saved(static_cast<std::size_t>(cfg.layers));
    const std::int64_t norm_stats = llama ? 1 : 2;
    for (int l = 0; l < cfg.layers; ++l) {
      const LayerParams& P = lp[static_cast<std::size_t>(l)];
      Saved& s = saved[static_cast<std::size_t>(l)];
      const std::string p = "layers." + std::to_string(l) + ".";
      s.x = x;
      s.n1 = b.act(p + "norm1.out", h);
      s.s1 = b.act(p + "norm1.stats", norm_stats);
      if (llama) {
        b.op(p + "attention_norm", Phase::kForward, l, {x, W(P.n1)}, {s.n1, s.s1}, 0);
        const TensorId q =
            b.linear(p + "attention.wq", l, s.n1, P.q, h, h, TensorClass::kTemporary);
        const TensorId k =
            b.linear(p + "attention.wk", l, s.n1, P.k, h, kv, TensorClass::kTemporary);
        s.v = b.linear(p + "attention.wv", l, s.n1, P.v, h, kv);
        s.q = b.act(p + "rope.q", h);
        s.k = b.act(p + "rope.k", kv);
        b.op(p + "rope", Phase::kForward, l, {q, k}, {s.q, s.k}, 0);
        s.o = b.act(p + "attention.out", h);
        s.lse = b.act(p + "attention.lse", cfg.heads);
        b.op(p + "attention", Phase::kForward, l, {s.q, s.k, s.v}, {s.o, s.lse}, attn_flops,
             kAttnEfficiency);
      } else {
        b.op(p + "ln_1", Phase::kForward, l, {x, W(P.n1), W(P.n1b)}, {s.n1, s.s1}, 0);
        s.qkv =
            b.linear(p + "attn.c_attn", l, s.n1, P.qkv, h, 3 * h, TensorClass::kActivation, P.qkvb);
        s.o = b.act(p + "attention.out", h);
        s.lse = b.act(p + "attention.lse", cfg.heads);
        b.op(p + "attention", Phase::kForward, l, {s.qkv}, {s.o, s.lse}, attn_flops,
             kAttnEfficiency);
      }
      const TensorId po =
          llama ? b.linear(p + "attention.wo", l, s.o, P.o, h, h, TensorClass::kTemporary)
                : b.linear(p + "attn.c_proj", l, s.o, P.o, h, h, TensorClass::kTemporary, P.ob);
      s.h1 = b.act(p + "residual1", h);
      b.op(p + "add1", Phase::kForward, l, {x, po}, {s.h1}, 0);
      s.n2 = b.act(p + "norm2.out", h);
      s.s2 = b.act(p + "norm2.stats", norm_stats);
      TensorId d = -1;
      if (llama) {
        b.op(p + "ffn_norm", Phase::kForward, l, {s.h1, W(P.n2)}, {s.n2, s.s2}, 0);
        s.a = b.linear(p + "feed_forward.w1", l, s.n2, P.w1, h, f);
        s.bb = b.linear(p + "feed_forward.w3", l, s.n2, P.w3, h, f);
        s.sa = b.act(p + "silu.out", f);
        b.op(p + "silu", Phase::kForward, l, {s.a}, {s.sa}, 0);
        s.m = b.act(p + "mul.out", f);
        b.op(p + "mul", Phase::kForward, l, {s.sa, s.bb}, {s.m}, 0);
        d = b.linear(p + "feed_forward.w2", l, s.m, P.w2, f, h, TensorClass::kTemporary);
      } else {
        b.op(p + "ln_2", Phase::kForward, l, {s.h1, W(P.n2), W(P.n2b)}, {s.n2, s.s2}, 0);
        s.a = b.linear(p + "mlp.c_fc", l, s.n2, P.fc, h, f, TensorClass::kActivation, P.fcb);
        s.g = b.act(p + "gelu.out", f);
        b.op(p + "gelu", Phase::kForward, l, {s.a}, {s.g}, 0);
        d = b.linear(p + "mlp.c_proj", l, s.g, P.proj, f, h, TensorClass::kTemporary, P.projb);
      }
      x = b.act(p + "out", h);
      b.op(p + "add2", Phase::kForward, l, {s.h1, d}, {x}, 0);
    }
    const TensorId xl = x;
    const TensorId nf = b.act("norm.out", h);
    const TensorId sf = b.act("norm.stats", norm_stats);
    {
      std::vector<TensorId> in{xl, W(wf)};
      if (!llama) in.push_back(W(wfb));
      b.op("norm", Phase::kForward, -1, in, {nf, sf}, 0);
    }
    const TensorId logits = b.linear("output", -1, nf, head, h, V, TensorClass::kTemporary);
    const TensorId lsm = b.act("log_softmax.out", V);
    b.op("log_softmax", Phase::kForward, -1, {logits}, {lsm}, 0);
    const TensorId loss =
        b.tensor(b.prefix() + "loss", b.activation_bytes(), TensorClass::kActivation);
    b.op("nll_loss", Phase::kForward, -1, {lsm, targets}, {loss}, 0);

    // ---- backward
    const TensorId g_lsm = b.temp("nll_loss.grad", V);
    b.op("nll_loss.bwd", Phase::kBackward, -1, {loss, targets}, {g_lsm}, 0);
    const TensorId g_logits = b.temp("log_softmax.grad", V);
    b.op("log_softmax.bwd", Phase::kBackward, -1, {g_lsm, lsm}, {g_logits}, 0);
    const TensorId g_nf = b.linear_bwd("output", -1, g_logits, nf, head, h, V);
    TensorId gx = b.temp("norm.grad_in", h);
    norm_bwd("norm.bwd", -1, g_nf, xl, sf, wf, wfb, gx);
    for (int l = cfg.layers - 1; l >= 0; --l) {
      const LayerParams& P = lp[static_cast<std::size_t>(l)];
      const Saved& s = saved[static_cast<std::size_t>(l)];
      const std::string p = "layers." + std::to_string(l) + ".";
      TensorId g_n2 = -1;
      if (llama) {
        const TensorId g_m = b.linear_bwd(p + "feed_forward.w2", l, gx, s.m, P.w2, f, h);
        const TensorId g_sa = b.temp(p + "mul.grad_a", f);
        const TensorId g_b = b.temp(p + "mul.grad_b", f);
        b.op(p + "mul.bwd", Phase::kBackward, l, {g_m, s.sa, s.bb}, {g_sa, g_b}, 0);
        const TensorId g_a = b.temp(p + "silu.grad", f);
        b.op(p + "silu.bwd", Phase::kBackward, l, {g_sa, s.a}, {g_a}, 0);
        const TensorId g3 = b.linear_bwd(p + "feed_forward.w3", l, g_b, s.n2, P.w3, h, f);
        const TensorId g1 = b.linear_bwd(p + "feed_forward.w1", l, g_a, s.n2, P.w1, h, f);
        g_n2 = b.temp(p + "norm2.grad_out", h);
        b.op(p + "ffn_norm.grad_sum", Phase::kBackward, l, {g1, g3}, {g_n2}, 0);
      } else {
        const TensorId g_g = b.linear_bwd(p + "mlp.c_proj", l, gx, s.g, P.proj, f, h, P.projb);
        const TensorId g_a = b.temp(p + "gelu.grad", f);
        b.op(p + "gelu.bwd", Phase::kBackward, l, {g_g, s.a}, {g_a}, 0);
        g_n2 = b.linear_bwd(p + "mlp.c_fc", l, g_a, s.n2, P.fc, h, f, P.fcb);
      }
      const TensorId g_h1p = b.temp(p + "norm2.grad_in", h);
      norm_bwd(p + "norm2.bwd", l, g_n2, s.h1, s.s2, P.n2, P.n2b, g_h1p);
      const TensorId g_h1 = b.temp(p + "residual1.grad", h);
      b.op(p + "add2.bwd", Phase::kBackward, l, {gx, g_h1p}, {g_h1}, 0);
      const TensorId g_o = llama ? b.linear_bwd(p + "attention.wo", l, g_h1, s.o, P.o, h, h)
                                 : b.linear_bwd(p + "attn.c_proj", l, g_h1, s.o, P.o, h, h, P.ob);
      TensorId g_n1 = -1;
      if (llama) {
        const TensorId g_q = b.temp(p + "rope.grad_q", h);
        const TensorId g_k = b.temp(p + "rope.grad_k", kv);
        const TensorId g_v = b.temp(p + "attention.grad_v", kv);
        b.op(p + "attention.bwd", Phase::kBackward, l, {g_o, s.q, s.k, s.v, s.o, s.lse},
             {g_q, g_k, g_v}, 2.5 * attn_flops, kAttnEfficiency);
        const TensorId g_q0 = b.temp(p + "wq.grad_out", h);
        const TensorId g_k0 = b.temp(p + "wk.grad_out", kv);
        b.op(p + "rope.bwd", Phase::kBackward, l, {g_q, g_k}, {g_q0, g_k0}, 0);
        const TensorId gq = b.linear_bwd(p + "attention.wq", l, g_q0, s.n1, P.q, h, h);
        const TensorId gk = b.linear_bwd(p + "attention.wk", l, g_k0, s.n1, P.k, h, kv);
        const TensorId gv = b.linear_bwd(p + "attention.wv", l, g_v, s.n1, P.v, h, kv);
        g_n1 = b.temp(p + "norm1.grad_out", h);
        b.op(p + "attention_norm.grad_sum", Phase::kBackward, l, {gq, gk, gv}, {g_n1}, 0);
      } else {
        const TensorId g_qkv = b.temp(p + "attn.c_attn.grad_out", 3 * h);
        b.op(p + "attention.bwd", Phase::kBackward, l, {g_o, s.qkv, s.o, s.lse}, {g_qkv},
             2.5 * attn_flops, kAttnEfficiency);
        g_n1 = b.linear_bwd(p + "attn.c_attn", l, g_qkv, s.n1, P.qkv, h, 3 * h, P.qkvb);
      }
      const TensorId g_xp = b.temp(p + "norm1.grad_in", h);
      norm_bwd(p + "norm1.bwd", l, g_n1, s.x, s.s1, P.n1, P.n1b, g_xp);
      const TensorId g_x = b.temp(p + "grad_in", h);
      b.op(p + "add1.bwd", Phase::kBackward, l, {g_h1, g_xp}, {g_x}, 0);
      gx = g_x;
    }
    {
      std::vector<TensorId> in{gx, tokens};
      std::vector<TensorId> out;
      b.grad(wte, in, out);
      if (!llama) b.grad(wpe, in, out);
      b.op("embedding.bwd", Phase::kBackward, -1, in, out, 0);
    }
  }
  b.set_prefix("");

  // ---- optimizer
  b.optimizer_step();

  trace::Trace t = b.take();
  t.model = cfg.name;
  t.device = "cuda:0";
  t.batch = batch;
  if (M > 1) t.meta["micro_batches"] = std::to_string(M);
  t.seq = seq;
  t.meta["generator"] = "tidal analytic transformer trace";
  t.meta["precision"] = to_string(options.precision);
  t.meta["optimizer"] = "AdamW";
  t.meta["hardware"] = hw.name;
  t.meta["parameters"] = std::to_string(cfg.parameters());
  t.meta["optimizer_schedule"] = "after-backward";
  trace::validate(t);
  TIDAL_EXPECT_AS(InvalidArgument, !(options.optimizer_in_backward && options.optimizer_deferred),
                  "choose one optimizer schedule: in-backward or deferred");
  if (options.optimizer_deferred) return optimizer_deferred(t);
  return options.optimizer_in_backward ? optimizer_in_backward(t) : t;
}

}  // namespace tidal::plan
