#include "tidal/plan/model_trace.hpp"

#include <algorithm>
#include <utility>

#include "plan/trace_names.hpp"
#include "tidal/common/enum_names.hpp"
#include "tidal/common/error.hpp"

namespace tidal::plan {

TIDAL_ENUM_NAMES(Precision, precision_from_string, "precision", {Precision::kFp32, "fp32"},
                 {Precision::kBf16Mixed, "bf16-mixed"}, {Precision::kBf16, "bf16"})
TIDAL_ENUM_NAMES(MicroBatchOrder, micro_batch_order_from_string, "micro-batch order",
                 {MicroBatchOrder::kSequential, "sequential"},
                 {MicroBatchOrder::kLayerMajor, "layer-major"})

std::int64_t TransformerConfig::parameters() const {
  const std::int64_t h = hidden;
  const std::int64_t kv = h / heads * kv_heads;
  std::int64_t per_layer = 0;
  std::int64_t rest = 0;
  if (arch == Architecture::kLlama) {
    const auto e = static_cast<std::int64_t>(experts);
    const std::int64_t mlp = moe() ? h * e + e * 3 * h * expert_ffn +
                                         (shared_expert_ffn > 0 ? 3 * h * shared_expert_ffn + h : 0)
                                   : 3 * h * ffn;
    per_layer = 2 * h + h * h + 2 * h * kv + h * h + mlp;
    rest = vocab * h + h + (tied_embeddings ? 0 : vocab * h);
  } else {
    per_layer = 4 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * ffn + ffn) + (ffn * h + h);
    rest = vocab * h + max_seq * h + 2 * h;
  }
  return per_layer * layers + rest;
}

namespace {

constexpr Architecture kGpt = Architecture::kGpt2;
constexpr Architecture kLlama = Architecture::kLlama;

struct ModelPreset {
  const char* name;
  Architecture arch;
  int layers;
  std::int64_t hidden;
  int heads;
  int kv_heads;
  std::int64_t ffn;
  std::int64_t vocab;
  std::int64_t max_seq;
  bool tied;
  double rope_theta;
  int experts = 0;
  int experts_per_token = 0;
  std::int64_t expert_ffn = 0;
  std::int64_t shared_expert_ffn = 0;
};

// name, architecture, layers, hidden, heads, kv heads, MLP width, vocabulary, longest sequence,
// tied embeddings, rotary base; for a mixture of experts, the experts, experts per token, expert
// width and shared expert width (the MLP width is then the expert width).
constexpr ModelPreset kModelPresets[] = {
    {"gpt-tiny", kGpt, 2, 64, 4, 4, 256, 256, 256, true, 10000},
    {"gpt2-small", kGpt, 12, 768, 12, 12, 3072, 50257, 1024, true, 10000},
    {"gpt2-medium", kGpt, 24, 1024, 16, 16, 4096, 50257, 1024, true, 10000},
    {"gpt2-large", kGpt, 36, 1280, 20, 20, 5120, 50257, 1024, true, 10000},
    {"gpt2-xl", kGpt, 48, 1600, 25, 25, 6400, 50257, 1024, true, 10000},
    {"llama-tiny", kLlama, 2, 64, 4, 2, 192, 256, 256, false, 10000},
    {"llama3.2-1b", kLlama, 16, 2048, 32, 8, 8192, 128256, 131072, true, 500000},
    {"llama3-8b", kLlama, 32, 4096, 32, 8, 14336, 128256, 8192, false, 500000},
    {"granite-8b", kLlama, 36, 4096, 32, 8, 14336, 49152, 4096, true, 10000000},
    {"llama3-70b", kLlama, 80, 8192, 64, 8, 28672, 128256, 8192, false, 500000},
    {"llama3.1-405b", kLlama, 126, 16384, 128, 8, 53248, 128256, 131072, false, 500000},
    {"mixtral-8x7b", kLlama, 32, 4096, 32, 8, 14336, 32000, 32768, false, 1e6, 8, 2, 14336},
    // Qwen1.5-MoE-A2.7B (the Qwen2-MoE architecture); the biases of its query, key and value
    // projections (about 0.15M parameters) are not modelled.
    {"qwen2-moe-a2.7b", kLlama, 24, 2048, 16, 16, 1408, 151936, 8192, false, 1e6, 60, 4, 1408,
     5632},
};

}  // namespace

std::vector<std::string> model_preset_names() {
  std::vector<std::string> names;
  for (const auto& m : kModelPresets) names.emplace_back(m.name);
  return names;
}

TransformerConfig model_preset(const std::string& name) {
  for (const auto& m : kModelPresets) {
    if (name != m.name) continue;
    TransformerConfig c;
    c.name = name;
    c.arch = m.arch;
    c.layers = m.layers;
    c.hidden = m.hidden;
    c.heads = m.heads;
    c.kv_heads = m.kv_heads;
    c.ffn = m.ffn;
    c.vocab = m.vocab;
    c.max_seq = m.max_seq;
    c.tied_embeddings = m.tied;
    c.rope_theta = m.rope_theta;
    c.experts = m.experts;
    c.experts_per_token = m.experts_per_token;
    c.expert_ffn = m.expert_ffn;
    c.shared_expert_ffn = m.shared_expert_ffn;
    return c;
  }
  std::string names;
  for (const auto& n : model_preset_names()) names += (names.empty() ? "" : ", ") + n;
  TIDAL_FAIL_AS(InvalidArgument, "unknown model '", name, "'; choose one of: ", names,
                " (a preset's shape can be changed: layers, hidden size, heads, MLP width, "
                "vocabulary)");
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
  if (o.ffn && cfg.moe()) cfg.expert_ffn = *o.ffn;
  if (o.vocab) cfg.vocab = *o.vocab;
  if (cfg.arch == Architecture::kGpt2) cfg.kv_heads = cfg.heads;
  if (any) cfg.name += "-custom";
  TIDAL_EXPECT_AS(InvalidArgument,
                  cfg.layers > 0 && cfg.hidden > 0 && cfg.heads > 0 && cfg.kv_heads > 0 &&
                      cfg.ffn > 0 && cfg.vocab > 0,
                  "the model shape must be positive (layers, hidden, heads, ffn, vocab)");
  TIDAL_EXPECT_AS(InvalidArgument, cfg.hidden % cfg.heads == 0, "the hidden size ", cfg.hidden,
                  " is not divisible by the heads, ", cfg.heads);
  TIDAL_EXPECT_AS(InvalidArgument, cfg.heads % cfg.kv_heads == 0, "the heads, ", cfg.heads,
                  ", are not divisible by the key/value heads, ", cfg.kv_heads);
}

namespace {

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
  out.meta["optimizer_schedule"] = to_string(OptimizerSchedule::kInBackward);
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
  out.meta["optimizer_schedule"] = to_string(OptimizerSchedule::kDeferred);
  trace::validate(out);
  return out;
}

}  // namespace tidal::plan
