// The ZeRO baselines (ZeRO-Offload, ZeRO-Infinity): the trace rewritten as DeepSpeed runs it,
// ZeRO-3's parameter movement as a plan, and the CPU step.
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "plan/policies/policies_impl.hpp"
#include "tidal/common/units.hpp"
#include "tidal/plan/simulator.hpp"
#include "tidal/trace/lifetime.hpp"

namespace tidal::plan::detail::policy {

using trace::OpIndex;
using trace::Phase;
using trace::TensorClass;
using trace::TensorId;

// ZeRO accumulates gradients over micro-batches in its host buffer (DeepSpeed's offloaded
// gradient accumulation): each micro-batch's backward makes a fresh gradient on the device and
// ships it out after its last use there. The first op of a later pass that accumulates into a
// gradient becomes the maker of a new tensor for that pass, which the pass's later ops use.
void split_gradients_per_pass(trace::Trace& t, std::vector<TensorId>* origin) {
  const std::vector<int> pass = pass_of_ops(t);
  const std::size_t given = t.tensors.size();
  if (origin != nullptr) {
    origin->resize(given);
    std::iota(origin->begin(), origin->end(), TensorId{0});
  }
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
        if (origin != nullptr) origin->push_back(id);
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
trace::Trace without_optimizer(const trace::Trace& in, std::vector<OpIndex>& op_remap,
                               std::vector<TensorId>* tensor_remap) {
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
  if (tensor_remap != nullptr) *tensor_remap = std::move(remap);
  return out;
}

namespace {

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

}  // namespace

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

namespace {

// The ZeRO rewrite: the optimizer step leaves the GPU (one CPU op instead) with the optimizer
// states; gradients become per-iteration tensors that are shipped out after their last use. In
// bf16-mixed precision the GPU holds DeepSpeed's bf16 copy of each parameter (its fp32 master
// is with the optimizer state).
trace::Trace zero_trace(const trace::Trace& given, double cpu_step_seconds) {
  std::vector<OpIndex> op_remap;
  trace::Trace out = without_optimizer(gaps_in_durations(given), op_remap);
  const auto precision = given.meta.find("precision");
  if (precision != given.meta.end() && precision->second == "bf16-mixed") {
    for (auto& t : out.tensors) {
      if (t.cls == TensorClass::kParameter) t.bytes /= 2;
    }
    out.meta["parameter_element_bytes"] = "2";
  }
  split_gradients_per_pass(out);
  append_cpu_step(out, cpu_step_seconds);
  fix_zero_tensors(out, op_remap);
  retime(out);
  trace::validate(out);
  return out;
}

}  // namespace

double parameter_element_bytes(const trace::Trace& t) {
  const auto given = t.meta.find("parameter_element_bytes");
  if (given != t.meta.end()) return std::stod(given->second);
  const auto it = t.meta.find("precision");
  return it != t.meta.end() && it->second == "bf16" ? 2.0 : 4.0;
}

namespace {

// Whether ZeRO-3 moves parameter `x`: one above the persistence threshold.
bool managed(const trace::Tensor& x, const PolicyOptions& opt) {
  return x.cls == TensorClass::kParameter && x.persistent && x.bytes >= opt.zero_persistence_bytes;
}

// The ops of one forward pass of one layer (4 without layer information), at least 1: how far
// ahead a read starts without a prefetch bucket.
OpIndex block_ops_of(const trace::Trace& t, const std::vector<int>& pass) {
  int layers = 0;
  OpIndex fwd_ops = 0;
  for (const auto& op : t.ops) {
    layers = std::max(layers, op.layer + 1);
    if (op.phase == Phase::kForward) ++fwd_ops;
  }
  const auto passes = static_cast<OpIndex>(pass.back() + 1);
  return std::max<OpIndex>(1, layers > 0 ? fwd_ops / (static_cast<OpIndex>(layers) * passes) : 4);
}

// The ops that use managed parameters, in order, with the elements they use, and each op's
// place among them (-1: it uses none).
struct ParameterUses {
  std::vector<OpIndex> ops;
  std::vector<double> elements;
  std::vector<std::int64_t> index;
};

ParameterUses parameter_uses(const trace::Trace& t, const PolicyOptions& opt) {
  const double element_bytes = parameter_element_bytes(t);
  ParameterUses u;
  u.index.assign(t.ops.size(), -1);
  for (const auto& op : t.ops) {
    double elements = 0;
    std::vector<TensorId> seen;
    for (const auto* ids : {&op.inputs, &op.outputs}) {
      for (TensorId id : *ids) {
        const auto& x = t.tensors[static_cast<std::size_t>(id)];
        if (!managed(x, opt) || std::find(seen.begin(), seen.end(), id) != seen.end()) continue;
        seen.push_back(id);
        elements += static_cast<double>(x.bytes) / element_bytes;
      }
    }
    if (seen.empty()) continue;
    u.index[static_cast<std::size_t>(op.index)] = static_cast<std::int64_t>(u.ops.size());
    u.ops.push_back(op.index);
    u.elements.push_back(elements);
  }
  return u;
}

// The op after which the read of a parameter used at op b is issued, with a prefetch bucket of
// `bucket` elements (cpu_op: when the step before the iteration ends).
OpIndex prefetch_trigger(const ParameterUses& u, const std::vector<int>& pass, double bucket,
                         OpIndex cpu_op, OpIndex b) {
  std::int64_t i = u.index[static_cast<std::size_t>(b)];
  const int pass_b = pass[static_cast<std::size_t>(b)];
  if (i > 0 && pass[static_cast<std::size_t>(u.ops[static_cast<std::size_t>(i - 1)])] == pass_b) {
    --i;  // the module before starts the read
    double between = 0;
    while (i > 0 &&
           pass[static_cast<std::size_t>(u.ops[static_cast<std::size_t>(i - 1)])] == pass_b &&
           between + u.elements[static_cast<std::size_t>(i)] < bucket) {
      between += u.elements[static_cast<std::size_t>(i)];
      --i;
    }
  }
  const OpIndex start = u.ops[static_cast<std::size_t>(i)];
  return start == 0 ? cpu_op : start - 1;
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
  const OpIndex block_ops = block_ops_of(t, pass);
  const ParameterUses uses = parameter_uses(t, opt);
  const auto bucket = static_cast<double>(opt.zero_prefetch_bucket_elements);
  for (const auto& tensor : t.tensors) {
    const auto& life = la.tensors[static_cast<std::size_t>(tensor.id)];
    if (life.uses.empty() || tensor.bytes == 0) continue;
    if (managed(tensor, opt)) {
      for (const auto& period : life.periods) {
        const OpIndex a = period.last_use;
        const OpIndex b = period.next_use;
        const OpIndex gap = period.wraps ? (n - 1 - a) + b : b - a - 1;
        if (gap < 2) continue;
        PlanAction off;
        set_action(off, tensor.id, tensor.bytes, ActionKind::kOffload, a, (a + 1) % n, target);
        OpIndex trigger = 0;
        if (bucket > 0) {
          trigger = prefetch_trigger(uses, pass, bucket, cpu_op, b);
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

}  // namespace

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

}  // namespace tidal::plan::detail::policy
