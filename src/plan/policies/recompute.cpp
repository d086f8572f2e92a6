// Activation checkpointing as a trace rewrite (recompute_trace): which blocks, which of their
// ops run again in backward, and the rewritten trace.
#include <algorithm>
#include <limits>
#include <map>
#include <string>

#include "plan/policies/policies_impl.hpp"
#include "tidal/plan/policies.hpp"
#include "tidal/trace/lifetime.hpp"

namespace tidal::plan {

using detail::policy::gaps_in_durations;
using detail::policy::pass_of_ops;
using detail::policy::retime;
using trace::OpIndex;
using trace::Phase;
using trace::TensorClass;
using trace::TensorId;

namespace {

// The blocks of layer-wise activation checkpointing. A block is one layer in one
// forward/backward pass: with gradient accumulation each micro-batch's pass checkpoints and
// recomputes its own blocks. In the layer-major order one pass holds every micro-batch, so a
// block is one layer of one micro-batch, named by the analytic trace's "mb<i>." prefix.
struct CheckpointBlocks {
  std::vector<int> of_op;                     // the block of each op; -1 outside the layers
  std::vector<std::vector<OpIndex>> forward;  // each block's forward ops, in order
  std::vector<OpIndex> first_backward;        // each block's first backward op, or kNoOp

  [[nodiscard]] int of(OpIndex k) const { return of_op[static_cast<std::size_t>(k)]; }
  [[nodiscard]] int count() const { return static_cast<int>(forward.size()); }
};

// The micro-batch of each op of a layer-major analytic trace ("mb<i>." names it), or the
// forward/backward pass of each op of any other trace (a pass starts at the first forward op
// after a backward op).
std::vector<int> checkpoint_groups(const trace::Trace& in) {
  const auto order = in.meta.find("micro_batch_order");
  if (order == in.meta.end() || order->second != "layer-major") return pass_of_ops(in);
  std::vector<int> group(in.ops.size(), 0);
  for (const auto& op : in.ops) {
    if (op.name.rfind("mb", 0) != 0) continue;
    const auto dot = op.name.find('.');
    if (dot == std::string::npos || dot <= 2) continue;
    try {
      group[static_cast<std::size_t>(op.index)] = std::stoi(op.name.substr(2, dot - 2));
    } catch (const std::exception&) {
      continue;  // not a micro-batch's name: group 0
    }
  }
  return group;
}

// Blocks of layers from `checkpointed` on have no forward ops listed and no first backward op:
// they are not recomputed.
CheckpointBlocks checkpoint_blocks(const trace::Trace& in, int max_layers, int checkpointed,
                                   const std::vector<char>& selected) {
  const std::vector<int> group_of = checkpoint_groups(in);
  CheckpointBlocks blocks;
  blocks.of_op.assign(in.ops.size(), -1);
  for (const auto& op : in.ops) {
    const auto k = static_cast<std::size_t>(op.index);
    if (op.layer >= 0) blocks.of_op[k] = group_of[k] * max_layers + op.layer;
  }
  const int groups = *std::max_element(group_of.begin(), group_of.end()) + 1;
  const int count = groups * max_layers;
  blocks.forward.resize(static_cast<std::size_t>(count));
  blocks.first_backward.assign(static_cast<std::size_t>(count), trace::kNoOp);
  for (const auto& op : in.ops) {
    if (op.layer < 0 || op.layer >= checkpointed) continue;
    const auto l = static_cast<std::size_t>(blocks.of(op.index));
    if (op.phase == Phase::kForward && selected[static_cast<std::size_t>(op.index)]) {
      blocks.forward[l].push_back(op.index);
    }
    if (op.phase == Phase::kBackward && blocks.first_backward[l] == trace::kNoOp) {
      blocks.first_backward[l] = op.index;
    }
  }
  return blocks;
}

// Which tensors are dropped after the forward pass and made again: those made in a block's
// forward pass and used only in that block, its backward pass included.
std::vector<char> recomputed_tensors(const trace::Trace& in, const trace::LifetimeAnalysis& la,
                                     const CheckpointBlocks& blocks,
                                     const std::vector<char>& selected) {
  std::vector<char> recompute(in.tensors.size(), 0);
  for (const auto& t : in.tensors) {
    if (t.persistent || t.producer == trace::kNoOp) continue;
    if (!selected[static_cast<std::size_t>(t.producer)]) continue;
    const auto& prod = in.ops[static_cast<std::size_t>(t.producer)];
    if (prod.phase != Phase::kForward || prod.layer < 0) continue;
    const int l = blocks.of(prod.index);
    if (blocks.first_backward[static_cast<std::size_t>(l)] == trace::kNoOp) continue;
    bool ok = true;
    bool backward_use = false;
    for (OpIndex u : la.tensors[static_cast<std::size_t>(t.id)].uses) {
      const auto& op = in.ops[static_cast<std::size_t>(u)];
      if (op.layer < 0 || blocks.of(op.index) != l) ok = false;
      if (op.phase == Phase::kBackward) backward_use = true;
      if (op.phase != Phase::kForward && op.phase != Phase::kBackward) ok = false;
    }
    recompute[static_cast<std::size_t>(t.id)] = ok && backward_use ? 1 : 0;
  }
  return recompute;
}

// Appends a copy of `src` to `out` as its next op and returns it.
trace::Op* append_op(trace::Trace& out, const trace::Op& src) {
  trace::Op o = src;
  o.index = static_cast<OpIndex>(out.ops.size());
  out.ops.push_back(std::move(o));
  return &out.ops.back();
}

// Appends the recomputation of one block's forward ops to `out`, in backward: their outputs
// that are not persistent become new tensors, recorded in `copies` (given id -> copy) so that
// later recomputed ops and the block's backward ops read the copies.
void append_recomputation(const trace::Trace& in, const std::vector<OpIndex>& forward_ops,
                          const std::vector<char>& recompute, std::map<TensorId, TensorId>& copies,
                          trace::Trace& out) {
  for (OpIndex f : forward_ops) {
    const auto& src = in.ops[static_cast<std::size_t>(f)];
    trace::Op* o = append_op(out, src);
    o->name = "recompute:" + src.name;
    o->phase = Phase::kBackward;
    for (TensorId& id : o->inputs) {
      const auto it = copies.find(id);
      if (it != copies.end()) id = it->second;
    }
    for (std::size_t s = 0; s < o->outputs.size(); ++s) {
      TensorId& id = o->outputs[s];
      if (in.tensors[static_cast<std::size_t>(id)].persistent) continue;
      trace::Tensor x = in.tensors[static_cast<std::size_t>(id)];
      x.id = static_cast<TensorId>(out.tensors.size());
      x.name += "@recompute";
      x.producer = o->index;
      x.output_slot = static_cast<std::int32_t>(s);
      x.freed_after = trace::kNoOp;
      if (!recompute[static_cast<std::size_t>(id)]) x.cls = TensorClass::kTemporary;
      out.tensors.push_back(x);
      copies[id] = x.id;
      id = x.id;
    }
  }
}

// Copies the given ops into `out` (whose ops are empty), each block's recomputation inserted
// before its first backward op, and the block's backward ops reading the recomputed tensors.
// Returns the new index of each given op.
std::vector<OpIndex> append_with_recomputation(const trace::Trace& in,
                                               const CheckpointBlocks& blocks,
                                               const std::vector<char>& recompute,
                                               trace::Trace& out) {
  const auto n = static_cast<OpIndex>(in.ops.size());
  const int layers = blocks.count();
  std::vector<OpIndex> op_remap(static_cast<std::size_t>(n), trace::kNoOp);
  // The block whose recomputation goes before each op.
  std::vector<int> block_of(static_cast<std::size_t>(n), -1);
  for (int l = 0; l < layers; ++l) {
    const auto b = static_cast<std::size_t>(l);
    if (blocks.first_backward[b] != trace::kNoOp && !blocks.forward[b].empty()) {
      block_of[static_cast<std::size_t>(blocks.first_backward[b])] = l;
    }
  }
  std::vector<std::map<TensorId, TensorId>> copies(static_cast<std::size_t>(layers));
  for (OpIndex k = 0; k < n; ++k) {
    const int l = block_of[static_cast<std::size_t>(k)];
    if (l >= 0) {
      append_recomputation(in, blocks.forward[static_cast<std::size_t>(l)], recompute,
                           copies[static_cast<std::size_t>(l)], out);
    }
    const auto& src = in.ops[static_cast<std::size_t>(k)];
    trace::Op* o = append_op(out, src);
    op_remap[static_cast<std::size_t>(k)] = o->index;
    if (src.phase == Phase::kBackward && src.layer >= 0) {
      const auto& map = copies[static_cast<std::size_t>(blocks.of(k))];
      for (auto* ids : {&o->inputs, &o->outputs}) {
        for (TensorId& id : *ids) {
          if (!recompute[static_cast<std::size_t>(id)]) continue;
          const auto it = map.find(id);
          if (it != map.end()) id = it->second;
        }
      }
    }
  }
  return op_remap;
}

// Bytes an op reads and writes, each tensor once.
double op_bytes(const trace::Trace& in, const trace::Op& op) {
  double bytes = 0;
  std::vector<TensorId> seen;
  for (const auto* ids : {&op.inputs, &op.outputs}) {
    for (TensorId id : *ids) {
      if (std::find(seen.begin(), seen.end(), id) != seen.end()) continue;
      seen.push_back(id);
      bytes += static_cast<double>(in.tensors[static_cast<std::size_t>(id)].bytes);
    }
  }
  return bytes;
}

// The ops selective checkpointing runs again: memory-bound forward ops of the layers (their
// time within kMemoryBoundSlack of their bytes at the trace's fastest bytes per second: norms,
// activation functions, element-wise products), none writing a persistent tensor, whose
// non-persistent inputs are made by another such op of the same layer or kept for backward
// anyway (read by a backward op): running them again keeps nothing alive longer.
std::vector<char> memory_bound_selection(const trace::Trace& in,
                                         const trace::LifetimeAnalysis& la) {
  constexpr double kMemoryBoundSlack = 2.0;
  std::vector<double> bytes(in.ops.size());
  double fastest = 0;
  for (const auto& op : in.ops) {
    bytes[static_cast<std::size_t>(op.index)] = op_bytes(in, op);
    if (op.duration() > 0) {
      fastest = std::max(fastest, bytes[static_cast<std::size_t>(op.index)] / op.duration());
    }
  }
  std::vector<char> backward_use(in.tensors.size(), 0);
  for (const auto& t : in.tensors) {
    for (OpIndex u : la.tensors[static_cast<std::size_t>(t.id)].uses) {
      if (in.ops[static_cast<std::size_t>(u)].phase == Phase::kBackward) {
        backward_use[static_cast<std::size_t>(t.id)] = 1;
      }
    }
  }
  std::vector<char> selected(in.ops.size(), 0);
  if (fastest <= 0) return selected;
  for (const auto& op : in.ops) {
    if (op.phase != Phase::kForward || op.layer < 0) continue;
    if (op.duration() > kMemoryBoundSlack * bytes[static_cast<std::size_t>(op.index)] / fastest) {
      continue;
    }
    bool ok = true;
    for (TensorId id : op.outputs) ok = ok && !in.tensors[static_cast<std::size_t>(id)].persistent;
    for (TensorId id : op.inputs) {
      const auto& t = in.tensors[static_cast<std::size_t>(id)];
      if (t.persistent || backward_use[static_cast<std::size_t>(id)]) continue;
      ok = ok && t.producer != trace::kNoOp && selected[static_cast<std::size_t>(t.producer)] &&
           in.ops[static_cast<std::size_t>(t.producer)].layer == op.layer;
    }
    selected[static_cast<std::size_t>(op.index)] = ok ? 1 : 0;
  }
  return selected;
}

}  // namespace

trace::Trace recompute_trace(const trace::Trace& given) {
  return recompute_trace(given, std::numeric_limits<int>::max());
}

trace::Trace recompute_trace(const trace::Trace& given, int layers) {
  return recompute_trace(given, Checkpointing{layers, 0});
}

trace::Trace recompute_trace(const trace::Trace& given, Checkpointing c) {
  trace::Trace in = gaps_in_durations(given);
  const auto la = trace::analyze_lifetimes(in);
  int max_layers = 0;
  for (const auto& op : in.ops) max_layers = std::max(max_layers, op.layer + 1);
  if (max_layers == 0) return in;
  const int whole = std::clamp(c.whole_layers, 0, max_layers);
  const int checkpointed = whole + std::clamp(c.selective_layers, 0, max_layers - whole);
  // Every op of a whole layer; the memory-bound ones of a selective layer.
  std::vector<char> selected(in.ops.size(), 1);
  if (checkpointed > whole) {
    const std::vector<char> memory_bound = memory_bound_selection(in, la);
    for (const auto& op : in.ops) {
      const auto k = static_cast<std::size_t>(op.index);
      if (op.layer >= whole) selected[k] = memory_bound[k];
    }
  }
  const CheckpointBlocks blocks = checkpoint_blocks(in, max_layers, checkpointed, selected);
  const std::vector<char> recompute = recomputed_tensors(in, la, blocks, selected);

  trace::Trace out = in;
  out.ops.clear();
  out.meta["rewrite"] = checkpointing_name(c, max_layers);
  const std::vector<OpIndex> op_remap = append_with_recomputation(in, blocks, recompute, out);
  for (std::size_t i = 0; i < in.tensors.size(); ++i) {
    trace::Tensor& t = out.tensors[i];
    if (t.producer != trace::kNoOp) t.producer = op_remap[static_cast<std::size_t>(t.producer)];
    if (recompute[i]) {
      t.freed_after = trace::kNoOp;
    } else if (t.freed_after != trace::kNoOp) {
      t.freed_after = op_remap[static_cast<std::size_t>(t.freed_after)];
    }
  }
  retime(out);
  trace::validate(out);
  return out;
}

std::string checkpointing_name(Checkpointing c, int layers) {
  const int whole = std::clamp(c.whole_layers, 0, layers);
  const int selective = std::clamp(c.selective_layers, 0, layers - whole);
  const auto of = [&](int n) {
    return n >= layers
               ? std::string()
               : " of the first " + std::to_string(n) + " of " + std::to_string(layers) + " layers";
  };
  if (whole > 0 && selective > 0) {
    return "layer-wise activation checkpointing of the first " + std::to_string(whole) + " of " +
           std::to_string(layers) + " layers, selective (memory-bound ops) of the " +
           std::to_string(selective) + " after them";
  }
  if (selective > 0) return "selective activation checkpointing (memory-bound ops)" + of(selective);
  if (whole > 0) return "layer-wise activation checkpointing" + of(whole);
  return "no activation checkpointing";
}

}  // namespace tidal::plan
