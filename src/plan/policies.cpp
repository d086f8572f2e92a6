#include "tidal/plan/policies.hpp"

#include <algorithm>
#include <chrono>
#include <map>
#include <sstream>

#include "tidal/common/enum_names.hpp"
#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"
#include "tidal/trace/lifetime.hpp"

namespace tidal::plan {

using trace::OpIndex;
using trace::Phase;
using trace::TensorClass;
using trace::TensorId;

namespace {

constexpr EnumName<Policy> kPolicyNames[] = {
    {Policy::kIdeal, "ideal"},
    {Policy::kKeepAll, "keep-all"},
    {Policy::kRecompute, "recompute"},
    {Policy::kActivations, "activations"},
    {Policy::kZeroOffload, "zero-offload"},
    {Policy::kZeroInfinity, "zero-infinity"},
    {Policy::kTidal, "tidal"},
};

// The same trace with the host time before each next op folded into the op's duration, so
// that a rewrite which copies or reorders ops and then retimes them keeps the iteration's time.
trace::Trace gaps_in_durations(const trace::Trace& t) {
  trace::Trace out = t;
  for (std::size_t k = 0; k < out.ops.size(); ++k) {
    out.ops[k].end_s = out.ops[k].start_s + t.op_seconds(k);
  }
  return out;
}

// Recomputes start/end times from durations, back to back.
void retime(trace::Trace& t) {
  double now = 0;
  for (auto& op : t.ops) {
    const double d = op.duration();
    op.start_s = now;
    now += d;
    op.end_s = now;
  }
}

void set_action(PlanAction& a, TensorId id, std::uint64_t bytes, ActionKind kind, OpIndex trigger,
                OpIndex deadline, Target target) {
  a.tensor = id;
  a.bytes = bytes;
  a.kind = kind;
  a.trigger = trigger;
  a.deadline = deadline;
  a.target = target;
  a.wraps = deadline <= trigger;
}

Plan empty_plan(const trace::Trace& t, const Hardware& hw) {
  Plan p;
  p.model = t.model;
  p.hardware = hw.name;
  p.num_ops = static_cast<std::int32_t>(t.ops.size());
  p.num_tensors = static_cast<std::int32_t>(t.tensors.size());
  p.summary.capacity_bytes = hw.device_memory;
  p.summary.compute_seconds = t.compute_seconds();
  return p;
}

void sort_actions(Plan& p) {
  std::sort(p.actions.begin(), p.actions.end(), [](const PlanAction& x, const PlanAction& y) {
    if (x.trigger != y.trigger) return x.trigger < y.trigger;
    if (x.kind != y.kind) return x.kind < y.kind;
    return x.tensor < y.tensor;
  });
}

// The forward/backward pass of each op: a pass starts at the first forward op after a backward
// op (with gradient accumulation, one pass per micro-batch). Never empty.
std::vector<int> pass_of_ops(const trace::Trace& t) {
  std::vector<int> pass_of(std::max<std::size_t>(1, t.ops.size()), 0);
  int pass = 0;
  bool in_backward = false;
  for (const auto& op : t.ops) {
    if (op.phase == Phase::kBackward) in_backward = true;
    if (op.phase == Phase::kForward && in_backward) {
      ++pass;
      in_backward = false;
    }
    pass_of[static_cast<std::size_t>(op.index)] = pass;
  }
  return pass_of;
}

// ZeRO accumulates gradients over micro-batches in its host buffer (DeepSpeed's offloaded
// gradient accumulation): each micro-batch's backward makes a fresh gradient on the device and
// ships it out after its last use there. The first op of a later pass that accumulates into a
// gradient becomes the maker of a new tensor for that pass, which the pass's later ops use.
void split_gradients_per_pass(trace::Trace& t) {
  const std::vector<int> pass = pass_of_ops(t);
  const std::size_t given = t.tensors.size();
  std::vector<TensorId> current(given, -1);
  std::vector<int> current_pass(given, -1);
  for (auto& op : t.ops) {
    const int p = pass[static_cast<std::size_t>(op.index)];
    std::vector<TensorId> made_here;
    for (TensorId& id : op.outputs) {
      const auto i = static_cast<std::size_t>(id);
      if (i >= given || t.tensors[i].cls != TensorClass::kGradient) continue;
      if (current_pass[i] < 0) {
        current[i] = id;
        current_pass[i] = p;
      } else if (current_pass[i] != p) {
        trace::Tensor copy = t.tensors[i];
        copy.id = static_cast<TensorId>(t.tensors.size());
        copy.name += ".pass" + std::to_string(p);
        t.tensors.push_back(copy);
        current[i] = copy.id;
        current_pass[i] = p;
        made_here.push_back(id);
      }
      id = current[i];
    }
    std::vector<TensorId> inputs;
    for (TensorId id : op.inputs) {
      const auto i = static_cast<std::size_t>(id);
      if (i < given && t.tensors[i].cls == TensorClass::kGradient) {
        if (std::find(made_here.begin(), made_here.end(), id) != made_here.end()) continue;
        if (current[i] >= 0) id = current[i];
      }
      inputs.push_back(id);
    }
    op.inputs = std::move(inputs);
  }
}

// The trace without the optimizer step and its states: the tensors and ops that are left,
// renumbered, with `op_remap` taking each given op to its new index (kNoOp for the dropped).
trace::Trace without_optimizer(const trace::Trace& in, std::vector<OpIndex>& op_remap) {
  std::vector<TensorId> remap(in.tensors.size(), -1);
  trace::Trace out;
  out.version = in.version;
  out.model = in.model;
  out.device = in.device;
  out.batch = in.batch;
  out.seq = in.seq;
  out.meta = in.meta;
  for (const auto& t : in.tensors) {
    if (t.cls == TensorClass::kOptimizerState) continue;
    trace::Tensor x = t;
    x.id = static_cast<TensorId>(out.tensors.size());
    remap[static_cast<std::size_t>(t.id)] = x.id;
    out.tensors.push_back(x);
  }
  op_remap.assign(in.ops.size(), trace::kNoOp);
  for (const auto& op : in.ops) {
    if (op.phase == Phase::kOptimizer) continue;
    trace::Op o = op;
    o.index = static_cast<OpIndex>(out.ops.size());
    op_remap[static_cast<std::size_t>(op.index)] = o.index;
    o.inputs.clear();
    o.outputs.clear();
    for (TensorId id : op.inputs) {
      if (remap[static_cast<std::size_t>(id)] >= 0)
        o.inputs.push_back(remap[static_cast<std::size_t>(id)]);
    }
    for (TensorId id : op.outputs) {
      if (remap[static_cast<std::size_t>(id)] >= 0)
        o.outputs.push_back(remap[static_cast<std::size_t>(id)]);
    }
    out.ops.push_back(std::move(o));
  }
  return out;
}

// One CPU op at the end of the trace that stands for the optimizer step.
void append_cpu_step(trace::Trace& out, double cpu_step_seconds) {
  trace::Op cpu;
  cpu.index = static_cast<OpIndex>(out.ops.size());
  cpu.name = "cpu_adam";
  cpu.phase = Phase::kOptimizer;
  cpu.start_s = 0;
  cpu.end_s = cpu_step_seconds;
  out.ops.push_back(cpu);
}

// Fixes producers, frees and output slots from the uses after the ZeRO rewrite: gradients are
// per-iteration tensors made by their first use where that use writes them; the other
// non-persistent tensors keep their producer and free, moved by `op_remap`.
void fix_zero_tensors(trace::Trace& out, const std::vector<OpIndex>& op_remap) {
  std::vector<OpIndex> first(out.tensors.size(), trace::kNoOp);
  std::vector<OpIndex> first_out(out.tensors.size(), trace::kNoOp);
  for (const auto& op : out.ops) {
    for (const auto* ids : {&op.inputs, &op.outputs}) {
      for (TensorId id : *ids) {
        auto& f = first[static_cast<std::size_t>(id)];
        if (f == trace::kNoOp) f = op.index;
      }
    }
    for (std::size_t s = 0; s < op.outputs.size(); ++s) {
      auto& fo = first_out[static_cast<std::size_t>(op.outputs[s])];
      if (fo == trace::kNoOp) fo = op.index;
    }
  }
  for (auto& t : out.tensors) {
    const auto i = static_cast<std::size_t>(t.id);
    if (t.cls == TensorClass::kGradient) {
      t.persistent = false;
      t.producer =
          first_out[i] != trace::kNoOp && first_out[i] == first[i] ? first_out[i] : trace::kNoOp;
      t.freed_after = trace::kNoOp;
    } else if (!t.persistent) {
      t.producer = t.producer == trace::kNoOp ? trace::kNoOp
                                              : op_remap[static_cast<std::size_t>(t.producer)];
      t.freed_after = t.freed_after == trace::kNoOp
                          ? trace::kNoOp
                          : op_remap[static_cast<std::size_t>(t.freed_after)];
    }
    if (t.producer != trace::kNoOp) {
      const auto& outs = out.ops[static_cast<std::size_t>(t.producer)].outputs;
      const auto it = std::find(outs.begin(), outs.end(), t.id);
      t.output_slot = it == outs.end() ? -1 : static_cast<std::int32_t>(it - outs.begin());
      if (it == outs.end()) t.producer = trace::kNoOp;
    }
  }
}

// The ZeRO rewrite: the optimizer step leaves the GPU (one CPU op instead) with the optimizer
// states; gradients become per-iteration tensors that are shipped out after their last use.
trace::Trace zero_trace(const trace::Trace& given, double cpu_step_seconds) {
  std::vector<OpIndex> op_remap;
  trace::Trace out = without_optimizer(gaps_in_durations(given), op_remap);
  split_gradients_per_pass(out);
  append_cpu_step(out, cpu_step_seconds);
  fix_zero_tensors(out, op_remap);
  retime(out);
  trace::validate(out);
  return out;
}

// Bytes per parameter element of a trace: 2 where the whole trace is bf16, else 4 (fp32, and
// bf16-mixed's fp32 weights).
double parameter_element_bytes(const trace::Trace& t) {
  const auto it = t.meta.find("precision");
  return it != t.meta.end() && it->second == "bf16" ? 2.0 : 4.0;
}

// ZeRO-3 style movement: parameters (above the persistence threshold) come in before each use
// and leave right after (a release: the SSD or host copy is current, so no write); gradients
// leave after their last use and must be out before the CPU step.
//
// How far ahead a parameter's read starts is DeepSpeed's prefetch: when a module starts, ZeRO-3
// fetches the parameters of the modules after it, in the order of the recorded trace, while the
// elements in flight stay under the prefetch bucket. So a parameter's read starts when the use
// of the parameter before it starts, and earlier only while the parameters used in between sum
// to less than the bucket; never before the first parameter use of its forward/backward pass
// (the trace restarts with each pass, and nothing is fetched during the optimizer step, which
// is updating these very parameters). With a bucket of 0, one block of ops ahead instead.
Plan zero_plan(const trace::Trace& t, const Hardware& hw, Target target, const PolicyOptions& opt) {
  Plan p = empty_plan(t, hw);
  const auto la = trace::analyze_lifetimes(t);
  const auto n = static_cast<OpIndex>(t.ops.size());
  const OpIndex cpu_op = n - 1;
  const std::vector<int> pass = pass_of_ops(t);
  int layers = 0;
  OpIndex fwd_ops = 0;
  for (const auto& op : t.ops) {
    layers = std::max(layers, op.layer + 1);
    if (op.phase == Phase::kForward) ++fwd_ops;
  }
  const auto passes = static_cast<OpIndex>(pass.back() + 1);
  const OpIndex block_ops =
      std::max<OpIndex>(1, layers > 0 ? fwd_ops / (static_cast<OpIndex>(layers) * passes) : 4);
  auto managed = [&](const trace::Tensor& x) {
    return x.cls == TensorClass::kParameter && x.persistent &&
           x.bytes >= opt.zero_persistence_bytes;
  };
  // The ops that use managed parameters, in order, with the elements they use.
  const double element_bytes = parameter_element_bytes(t);
  std::vector<OpIndex> use_ops;
  std::vector<double> use_elements;
  std::vector<std::int64_t> use_index(static_cast<std::size_t>(n), -1);
  for (const auto& op : t.ops) {
    double elements = 0;
    std::vector<TensorId> seen;
    for (const auto* ids : {&op.inputs, &op.outputs}) {
      for (TensorId id : *ids) {
        const auto& x = t.tensors[static_cast<std::size_t>(id)];
        if (!managed(x) || std::find(seen.begin(), seen.end(), id) != seen.end()) continue;
        seen.push_back(id);
        elements += static_cast<double>(x.bytes) / element_bytes;
      }
    }
    if (seen.empty()) continue;
    use_index[static_cast<std::size_t>(op.index)] = static_cast<std::int64_t>(use_ops.size());
    use_ops.push_back(op.index);
    use_elements.push_back(elements);
  }
  const auto bucket = static_cast<double>(opt.zero_prefetch_bucket_elements);
  // The op after which the read of a parameter used at op b is issued (cpu_op: when the step
  // before the iteration ends).
  auto prefetch_trigger = [&](OpIndex b) {
    std::int64_t i = use_index[static_cast<std::size_t>(b)];
    const int pass_b = pass[static_cast<std::size_t>(b)];
    if (i > 0 &&
        pass[static_cast<std::size_t>(use_ops[static_cast<std::size_t>(i - 1)])] == pass_b) {
      --i;  // the module before starts the read
      double between = 0;
      while (i > 0 &&
             pass[static_cast<std::size_t>(use_ops[static_cast<std::size_t>(i - 1)])] == pass_b &&
             between + use_elements[static_cast<std::size_t>(i)] < bucket) {
        between += use_elements[static_cast<std::size_t>(i)];
        --i;
      }
    }
    const OpIndex start = use_ops[static_cast<std::size_t>(i)];
    return start == 0 ? cpu_op : start - 1;
  };
  for (const auto& tensor : t.tensors) {
    const auto& life = la.tensors[static_cast<std::size_t>(tensor.id)];
    if (life.uses.empty() || tensor.bytes == 0) continue;
    if (managed(tensor)) {
      for (const auto& period : life.periods) {
        const OpIndex a = period.last_use;
        const OpIndex b = period.next_use;
        const OpIndex gap = period.wraps ? (n - 1 - a) + b : b - a - 1;
        if (gap < 2) continue;
        PlanAction off;
        set_action(off, tensor.id, tensor.bytes, ActionKind::kOffload, a, (a + 1) % n, target);
        OpIndex trigger = 0;
        if (bucket > 0) {
          trigger = prefetch_trigger(b);
          // Not before the release: a read issued earlier starts when the period does.
          const bool after_release =
              period.wraps ? (trigger == cpu_op || trigger < b) : (trigger > a && trigger < b);
          if (!after_release) trigger = (a + 1) % n;
        } else {
          const OpIndex back = std::min<OpIndex>(block_ops, gap - 1);
          trigger = ((b - 1 - back) % n + n) % n;
        }
        PlanAction pre;
        set_action(pre, tensor.id, tensor.bytes, ActionKind::kPrefetch, trigger, b, target);
        p.actions.push_back(off);
        p.actions.push_back(pre);
      }
    } else if (tensor.cls == TensorClass::kGradient && !tensor.persistent) {
      const OpIndex a = life.uses.back();
      if (a >= cpu_op) continue;
      PlanAction off;
      set_action(off, tensor.id, tensor.bytes, ActionKind::kOffload, a, cpu_op, target);
      p.actions.push_back(off);
    }
  }
  sort_actions(p);
  return p;
}

std::uint64_t bytes_of(const trace::Trace& t, TensorClass cls) {
  std::uint64_t s = 0;
  for (const auto& x : t.tensors) {
    if (x.cls == cls) s += x.bytes;
  }
  return s;
}

PolicyResult run_zero(const trace::Trace& tr, const Hardware& hw, const PolicyOptions& opt,
                      bool infinity) {
  PolicyResult r;
  r.policy = infinity ? Policy::kZeroInfinity : Policy::kZeroOffload;
  const auto params = static_cast<double>(bytes_of(tr, TensorClass::kParameter));
  const auto grads = static_cast<double>(bytes_of(tr, TensorClass::kGradient));
  const auto states = static_cast<double>(bytes_of(tr, TensorClass::kOptimizerState));
  const double elems = params / parameter_element_bytes(tr);
  const double compute = hw.cpu_adam_rate > 0 ? elems / hw.cpu_adam_rate : 0;
  double step = compute;
  // ZeRO-Infinity's step on NVMe, as DeepSpeed's partitioned optimizer swapper runs it, per
  // sub-group: read the fp32 master parameters, both Adam moments and the fp32 gradients; CPU
  // Adam; write the master parameters and moments back, and the updated parameters to the
  // parameter swap files that the next forward reads (measured with DeepSpeed 0.19.8:
  // bench/vs_deepspeed_train.sh, docs/results.md).
  const double step_read = 4 * elems + states + 4 * elems;
  const double step_write = 4 * elems + states + params;
  ChannelRates rates;
  Target target = Target::kHost;
  std::ostringstream note;
  if (infinity) {
    const double t_read = step_read / std::max(1.0, hw.ssd_read_total());
    const double t_write = step_write / std::max(1.0, hw.ssd_write_total());
    step = opt.zero_overlap_step_io ? std::max({compute, t_read, t_write})
                                    : compute + t_read + t_write;
    rates[Channel::kSsdWrite] = hw.ssd_write_total();
    rates[Channel::kSsdRead] = hw.ssd_read_total();
    target = Target::kSsd;
    note << "CPU step " << format_seconds(step) << " (reads " << format_bytes(step_read) << " in "
         << format_seconds(t_read) << ", Adam " << format_seconds(compute) << ", writes "
         << format_bytes(step_write) << " in " << format_seconds(t_write)
         << (opt.zero_overlap_step_io ? ", overlapped" : ", one after the other") << ")";
  } else {
    rates[Channel::kHostWrite] = rates[Channel::kHostRead] = hw.host_link_bw;
    note << "CPU Adam step " << format_seconds(step);
  }
  PolicyOptions o = opt;
  o.sim.channels = rates;
  auto attempt = [&](const trace::Trace& base) {
    const trace::Trace z = zero_trace(base, step);
    Plan plan = zero_plan(z, hw, target, o);
    SimResult sim = simulate(z, &plan, hw, o.sim);
    return std::make_pair(std::move(plan), std::move(sim));
  };
  auto [plan, sim] = attempt(tr);
  bool checkpointed = false;
  if (!sim.fits) {
    auto second = attempt(recompute_trace(tr));
    if (second.second.fits || second.second.peak_bytes < sim.peak_bytes) {
      plan = std::move(second.first);
      sim = std::move(second.second);
      checkpointed = true;
    }
  }
  if (infinity) {
    // The step's swaps are SSD traffic of the iteration too (endurance included).
    sim.ssd_bytes_read += static_cast<std::uint64_t>(step_read);
    sim.ssd_bytes_written += static_cast<std::uint64_t>(step_write);
    if (hw.ssd_tbw > 0 && hw.ssd_count > 0) {
      sim.ssd_lifetime_iterations =
          hw.ssd_tbw * hw.ssd_count / static_cast<double>(sim.ssd_bytes_written);
      sim.ssd_lifetime_days = sim.ssd_lifetime_iterations * sim.iteration_seconds / 86400.0;
    }
  }
  r.sim = sim;
  r.fits = sim.fits;
  if (checkpointed) note << "; with layer-wise activation checkpointing";
  if (!infinity && params + grads + states > static_cast<double>(hw.host_memory)) {
    r.fits = false;
    note << "; out of host memory: needs " << format_bytes(params + grads + states) << ", has "
         << format_bytes(static_cast<double>(hw.host_memory));
  }
  if (!sim.fits) note << "; device memory exceeded";
  r.note = note.str();
  r.plan = std::move(plan);
  return r;
}

}  // namespace

const char* to_string(Policy p) { return enum_name(kPolicyNames, p); }

Policy policy_from_string(const std::string& s) {
  for (const auto& n : kPolicyNames) {
    if (s == n.name) return n.value;
  }
  TIDAL_FAIL_AS(InvalidArgument, "unknown policy '", s,
                "'; choose one of: ", enum_names(kPolicyNames), " or all");
}

std::vector<Policy> all_policies() {
  std::vector<Policy> v;
  for (const auto& n : kPolicyNames) v.push_back(n.value);
  return v;
}

namespace {

// The blocks of layer-wise activation checkpointing. A block is one layer in one
// forward/backward pass: with gradient accumulation each micro-batch's pass checkpoints and
// recomputes its own blocks.
struct CheckpointBlocks {
  std::vector<int> of_op;                     // the block of each op; -1 outside the layers
  std::vector<std::vector<OpIndex>> forward;  // each block's forward ops, in order
  std::vector<OpIndex> first_backward;        // each block's first backward op, or kNoOp

  [[nodiscard]] int of(OpIndex k) const { return of_op[static_cast<std::size_t>(k)]; }
  [[nodiscard]] int count() const { return static_cast<int>(forward.size()); }
};

CheckpointBlocks checkpoint_blocks(const trace::Trace& in, int max_layers) {
  // A pass starts at the first forward op after a backward op.
  const std::vector<int> pass_of = pass_of_ops(in);
  CheckpointBlocks blocks;
  blocks.of_op.assign(in.ops.size(), -1);
  for (const auto& op : in.ops) {
    const auto k = static_cast<std::size_t>(op.index);
    if (op.layer >= 0) blocks.of_op[k] = pass_of[k] * max_layers + op.layer;
  }
  const int passes = pass_of.back() + 1;
  const int count = passes * max_layers;
  blocks.forward.resize(static_cast<std::size_t>(count));
  blocks.first_backward.assign(static_cast<std::size_t>(count), trace::kNoOp);
  for (const auto& op : in.ops) {
    if (op.layer < 0) continue;
    const auto l = static_cast<std::size_t>(blocks.of(op.index));
    if (op.phase == Phase::kForward) blocks.forward[l].push_back(op.index);
    if (op.phase == Phase::kBackward && blocks.first_backward[l] == trace::kNoOp) {
      blocks.first_backward[l] = op.index;
    }
  }
  return blocks;
}

// Which tensors are dropped after the forward pass and made again: those made in a block's
// forward pass and used only in that block, its backward pass included.
std::vector<char> recomputed_tensors(const trace::Trace& in, const trace::LifetimeAnalysis& la,
                                     const CheckpointBlocks& blocks) {
  std::vector<char> recompute(in.tensors.size(), 0);
  for (const auto& t : in.tensors) {
    if (t.persistent || t.producer == trace::kNoOp) continue;
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

}  // namespace

trace::Trace recompute_trace(const trace::Trace& given) {
  trace::Trace in = gaps_in_durations(given);
  const auto la = trace::analyze_lifetimes(in);
  int max_layers = 0;
  for (const auto& op : in.ops) max_layers = std::max(max_layers, op.layer + 1);
  if (max_layers == 0) return in;
  const CheckpointBlocks blocks = checkpoint_blocks(in, max_layers);
  const std::vector<char> recompute = recomputed_tensors(in, la, blocks);

  trace::Trace out = in;
  out.ops.clear();
  out.meta["rewrite"] = "layer-wise activation checkpointing";
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

namespace {

// An activation that the activations policy may offload: its last forward use `a`, its first
// backward use `b` and the layer that made it.
struct ActivationCandidate {
  TensorId id;
  OpIndex a, b;
  int layer;
};

// The activations made in the layers' forward pass, at least opt.activation_min_bytes, with at
// least one op between their last forward use and first backward use.
std::vector<ActivationCandidate> activation_candidates(const trace::Trace& t,
                                                       const trace::LifetimeAnalysis& la,
                                                       const PolicyOptions& opt) {
  std::vector<ActivationCandidate> cands;
  for (const auto& x : t.tensors) {
    if (x.cls != TensorClass::kActivation || x.persistent || x.bytes < opt.activation_min_bytes ||
        x.producer == trace::kNoOp) {
      continue;
    }
    const auto& prod = t.ops[static_cast<std::size_t>(x.producer)];
    if (prod.phase != Phase::kForward || prod.layer < 0) continue;  // loss/embedding/head skipped
    OpIndex a = trace::kNoOp;
    OpIndex b = trace::kNoOp;
    for (OpIndex u : la.tensors[static_cast<std::size_t>(x.id)].uses) {
      const auto ph = t.ops[static_cast<std::size_t>(u)].phase;
      if (ph == Phase::kForward) a = u;
      if (ph == Phase::kBackward && b == trace::kNoOp) b = u;
    }
    if (a == trace::kNoOp || b == trace::kNoOp || b - a < 2) continue;
    cands.push_back({x.id, a, b, prod.layer});
  }
  return cands;
}

// Adaptive keep (SSDTrain): scopes are blocks in forward order; backward takes 2x forward. The
// first layer whose activations, with those of the layers before it, would need more than the
// SSDs' write bandwidth; that layer and the later ones keep theirs. -1 when every layer offloads.
int adaptive_keep_from(const trace::Trace& t, const Hardware& hw,
                       const std::vector<ActivationCandidate>& cands) {
  std::map<int, double> bytes;
  std::map<int, double> time;
  std::vector<int> order;
  double forward = 0;
  for (std::size_t k = 0; k < t.ops.size(); ++k) {
    const auto& op = t.ops[k];
    if (op.phase != Phase::kForward) continue;
    const double seconds = t.op_seconds(k);
    forward += seconds;
    if (op.layer < 0) continue;
    if (time.find(op.layer) == time.end()) order.push_back(op.layer);
    time[op.layer] += seconds;
  }
  for (const auto& c : cands)
    bytes[c.layer] += static_cast<double>(t.tensors[static_cast<std::size_t>(c.id)].bytes);
  const double bw = hw.ssd_write_total();
  double before_b = 0;
  double before_t = 0;
  for (int l : order) {
    const double denom = 3 * forward - 2 * before_t;
    if (denom <= 0 || (before_b + 2 * bytes[l]) / denom > bw) return l;
    before_b += bytes[l];
    before_t += time[l];
  }
  return -1;
}

}  // namespace

Plan activation_plan(const trace::Trace& t, const Hardware& hw, const PolicyOptions& opt,
                     std::string* note) {
  Plan p = empty_plan(t, hw);
  const auto la = trace::analyze_lifetimes(t);
  const std::vector<ActivationCandidate> cands = activation_candidates(t, la, opt);
  const int keep_from = opt.adaptive_keep ? adaptive_keep_from(t, hw, cands) : -1;
  for (const auto& c : cands) {
    if (keep_from >= 0 && c.layer >= keep_from) continue;  // kept in device memory
    const std::uint64_t bytes = t.tensors[static_cast<std::size_t>(c.id)].bytes;
    PlanAction off;
    set_action(off, c.id, bytes, ActionKind::kOffload, c.a, c.b, Target::kSsd);
    PlanAction pre;
    const OpIndex trig = std::max<OpIndex>(c.a + 1, c.b - 1 - opt.activation_lookahead_ops);
    set_action(pre, c.id, bytes, ActionKind::kPrefetch, trig, c.b, Target::kSsd);
    p.actions.push_back(off);
    p.actions.push_back(pre);
    p.summary.bytes_to_ssd += bytes;
    ++p.summary.offloads_ssd;
  }
  sort_actions(p);
  if (note != nullptr) {
    std::ostringstream s;
    s << p.summary.offloads_ssd << " activations offloaded";
    if (keep_from >= 0) s << "; adaptive keep from block " << keep_from;
    *note = s.str();
  }
  return p;
}

PolicyResult run_policy(Policy policy, const trace::Trace& tr, const Hardware& hw,
                        const PolicyOptions& opt, double ideal_seconds) {
  PolicyResult r;
  r.policy = policy;
  switch (policy) {
    case Policy::kIdeal: {
      r.sim = simulate(tr, nullptr, hw, opt.sim);
      r.fits = true;
      r.note = "unlimited device memory";
      break;
    }
    case Policy::kKeepAll: {
      r.sim = simulate(tr, nullptr, hw, opt.sim);
      r.fits = r.sim.fits;
      break;
    }
    case Policy::kRecompute: {
      const trace::Trace rt = recompute_trace(tr);
      r.sim = simulate(rt, nullptr, hw, opt.sim);
      r.fits = r.sim.fits;
      r.note = rt.ops.size() == tr.ops.size() ? "no layer information: nothing recomputed"
                                              : "layer-wise activation checkpointing";
      break;
    }
    case Policy::kActivations: {
      Plan p = activation_plan(tr, hw, opt, &r.note);
      SimOptions so = opt.sim;
      ChannelRates rates;
      rates[Channel::kSsdWrite] = hw.ssd_write_total();
      rates[Channel::kSsdRead] = hw.ssd_read_total();
      so.channels = rates;
      r.sim = simulate(tr, &p, hw, so);
      r.fits = r.sim.fits;
      r.plan = std::move(p);
      break;
    }
    case Policy::kZeroOffload:
    case Policy::kZeroInfinity:
      r = run_zero(tr, hw, opt, policy == Policy::kZeroInfinity);
      break;
    case Policy::kTidal: {
      try {
        Plan p = make_plan(tr, hw, opt.planner, &r.bound);
        r.planning_seconds = p.summary.planning_seconds;
        r.sim = simulate(tr, &p, hw, opt.sim);
        r.fits = r.sim.fits;
        std::ostringstream s;
        s << p.summary.offloads_ssd << " offloads to SSD, " << p.summary.offloads_host
          << " to host";
        if (p.summary.planned_stall_seconds > 0) {
          s << "; planned stall " << format_seconds(p.summary.planned_stall_seconds);
        }
        r.note = s.str();
        r.plan = std::move(p);
      } catch (const InvalidArgument& e) {
        r.sim = simulate(tr, nullptr, hw, opt.sim);
        r.fits = false;
        r.note = e.what();
      }
      break;
    }
  }
  if (ideal_seconds > 0 && r.sim.iteration_seconds > 0) {
    r.fraction_of_ideal = ideal_seconds / r.sim.iteration_seconds;
  }
  return r;
}

std::vector<PolicyResult> run_policies(const std::vector<Policy>& policies, const trace::Trace& tr,
                                       const Hardware& hw, const PolicyOptions& opt) {
  const PolicyResult ideal = run_policy(Policy::kIdeal, tr, hw, opt);
  const double ideal_s = ideal.sim.iteration_seconds;
  std::vector<PolicyResult> out;
  for (Policy p : policies) {
    if (p == Policy::kIdeal) {
      PolicyResult r = ideal;
      r.fraction_of_ideal = ideal_s > 0 ? 1.0 : 0;
      out.push_back(std::move(r));
    } else {
      out.push_back(run_policy(p, tr, hw, opt, ideal_s));
    }
  }
  return out;
}

}  // namespace tidal::plan
