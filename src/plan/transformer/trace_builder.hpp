// The analytic transformer trace's op-by-op builder and its argument checks (private to plan/):
// shared by transformer_trace.cpp, which builds a model block by block with it, and
// transformer/argument_checks.cpp. Torch-free.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "plan/trace_names.hpp"
#include "tidal/common/error.hpp"
#include "tidal/plan/model_trace.hpp"

namespace tidal::plan::detail::transformer {

constexpr std::uint64_t kFloat = 4;
constexpr std::size_t kNone = SIZE_MAX;
// The most one tensor may hold (trace::validate's limit), and all of them together: far below
// 2^63, so that the sums of live bytes in the planner and simulator cannot overflow.
constexpr std::uint64_t kMaxTensorBytes = std::uint64_t{1} << 50;
constexpr double kMaxTraceBytes = 4611686018427387904.0;  // 2^62

// Bytes per element of each tensor class under a precision.
struct ElementBytes {
  std::uint64_t activation = kFloat;
  std::uint64_t parameter = kFloat;
  std::uint64_t gradient = kFloat;
  std::uint64_t state = kFloat;
};
inline ElementBytes element_bytes(Precision p) {
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

// Builds a trace op by op; times from the roofline of the hardware, collectives from its GPU link.
class Builder {
 public:
  Builder(const Hardware& hw, std::int64_t tokens, Precision precision)
      : hw_(hw), tokens_(tokens), bytes_(element_bytes(precision)) {
    flops_ =
        precision != Precision::kFp32 && hw.gpu_flops_bf16 > 0 ? hw.gpu_flops_bf16 : hw.gpu_flops;
  }
  [[nodiscard]] std::uint64_t activation_bytes() const { return bytes_.activation; }

  TensorId tensor(const std::string& name, std::uint64_t bytes, TensorClass cls,
                  bool persistent = false) {
    total_bytes_ += static_cast<double>(bytes);
    TIDAL_EXPECT_AS(InvalidArgument, total_bytes_ <= kMaxTraceBytes,
                    "the tensors of the analytic trace add up to more than 4 EiB (at '", name,
                    "'): the model (layers, hidden, ffn, vocab) or the batch x seq is too large");
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
  // A per-pass tensor of `per_token` elements per token, named within the current micro-batch.
  TensorId act(const std::string& name, std::int64_t per_token,
               TensorClass cls = TensorClass::kActivation) {
    return rows(name, tokens_, per_token, cls);
  }
  // A per-pass tensor of `per_row` elements for each of `rows` tokens (a share of the
  // micro-batch's tokens, such as an expert's), named within the current micro-batch.
  TensorId rows(const std::string& name, std::int64_t rows, std::int64_t per_row,
                TensorClass cls = TensorClass::kActivation) {
    return tensor(prefix_ + name, static_cast<std::uint64_t>(per_row * rows) * bytes_.activation,
                  cls);
  }
  // Names of the ops and activations that follow: "mb<i>." within micro-batch i of several.
  void set_prefix(std::string prefix) { prefix_ = std::move(prefix); }
  [[nodiscard]] const std::string& prefix() const { return prefix_; }
  TensorId temp(const std::string& name, std::int64_t per_token) {
    return act(name, per_token, TensorClass::kTemporary);
  }

  std::size_t param(const std::string& name, std::int64_t elems) {
    Param p;
    p.name = name;
    p.elems = elems;
    const auto e = static_cast<std::uint64_t>(elems);
    p.w = tensor(name, e * bytes_.parameter, TensorClass::kParameter, true);
    p.m = tensor(name + ".exp_avg", e * bytes_.state, TensorClass::kOptimizerState, true);
    p.v = tensor(name + ".exp_avg_sq", e * bytes_.state, TensorClass::kOptimizerState, true);
    params_.push_back(p);
    return params_.size() - 1;
  }
  [[nodiscard]] std::size_t param_count() const { return params_.size(); }
  [[nodiscard]] TensorId weight(std::size_t i) const { return params_[i].w; }
  [[nodiscard]] TensorId gradient(std::size_t i) const { return params_[i].g; }

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

  // An op timed by the roofline: max(compute, device-memory traffic) plus the launch overhead.
  void op(const std::string& name, Phase phase, int layer, std::vector<TensorId> in,
          std::vector<TensorId> out, double flops, double efficiency = 1.0) {
    double bytes = 0;
    std::vector<TensorId> seen;
    for (const auto* ids : {&in, &out}) {
      for (TensorId id : *ids) {
        if (std::find(seen.begin(), seen.end(), id) != seen.end()) continue;
        seen.push_back(id);
        bytes += static_cast<double>(trace_.tensors[id].bytes);
      }
    }
    const double compute = flops / (flops_ * hw_.matmul_efficiency * efficiency);
    const double memory = bytes / hw_.gpu_mem_bw;
    timed_op(name, phase, layer, std::move(in), std::move(out), std::max(compute, memory));
  }

  // y = x W^T (+ b) over `rows` tokens: the forward op, and its output of `outf` per token.
  TensorId linear(const std::string& name, int layer, TensorId x, std::size_t w, std::int64_t rows,
                  std::int64_t in, std::int64_t outf, TensorClass cls = TensorClass::kActivation,
                  std::size_t bias = kNone) {
    const TensorId y = this->rows(name + ".out", rows, outf, cls);
    std::vector<TensorId> ins{x, weight(w)};
    if (bias != kNone) ins.push_back(weight(bias));
    op(name, Phase::kForward, layer, ins, {y}, linear_flops(rows, in, outf));
    return y;
  }

  // Backward of linear(): the input's gradient (unless need_input_grad is false; -1 then) and
  // the weight's (and bias's), made or accumulated.
  TensorId linear_bwd(const std::string& name, int layer, TensorId gy, TensorId x, std::size_t w,
                      std::int64_t rows, std::int64_t in, std::int64_t outf,
                      std::size_t bias = kNone, bool need_input_grad = true) {
    TensorId gx = -1;
    const double flops = linear_flops(rows, in, outf);
    if (need_input_grad) {
      gx = this->rows(name + ".grad_in", rows, in, TensorClass::kTemporary);
      op(name + ".bwd_in", Phase::kBackward, layer, {gy, weight(w)}, {gx}, flops);
    }
    std::vector<TensorId> ins{x, gy};
    std::vector<TensorId> outs;
    grad(w, ins, outs);
    if (bias != kNone) grad(bias, ins, outs);
    op(name + ".bwd_w", Phase::kBackward, layer, ins, outs, flops);
    return gx;
  }

  // A ring all-reduce of `tensors` in place over `group` GPUs on the GPU link: each GPU sends
  // and receives 2 (group - 1) / group of the bytes. The collective runs between the compute ops
  // (in the profile it is an op like the others), so the ideal iteration includes it.
  void all_reduce(const std::string& name, Phase phase, int layer,
                  const std::vector<TensorId>& tensors, int group) {
    double bytes = 0;
    for (TensorId id : tensors) bytes += static_cast<double>(trace_.tensors[id].bytes);
    const double seconds = 2.0 * (group - 1) / group * bytes / hw_.gpu_link_bw;
    timed_op(name, phase, layer, tensors, tensors, seconds);
  }

  void optimizer_step() {
    for (const Param& p : params_) {
      TIDAL_EXPECT(p.g >= 0, "analytic trace: parameter ", p.name, " got no gradient");
      op("adamw." + p.name, Phase::kOptimizer, -1, {p.w, p.g, p.m, p.v}, {p.w, p.m, p.v},
         10.0 * static_cast<double>(p.elems));
    }
  }

  trace::Trace take() { return std::move(trace_); }

 private:
  static double linear_flops(std::int64_t rows, std::int64_t in, std::int64_t outf) {
    return 2.0 * static_cast<double>(rows) * static_cast<double>(in) * static_cast<double>(outf);
  }

  void timed_op(const std::string& name, Phase phase, int layer, std::vector<TensorId> in,
                std::vector<TensorId> out, double seconds) {
    trace::Op o;
    o.index = static_cast<OpIndex>(trace_.ops.size());
    o.name = prefix_ + name;
    o.phase = phase;
    o.layer = layer;
    for (std::size_t s = 0; s < out.size(); ++s) {
      trace::Tensor& t = trace_.tensors[out[s]];
      if (!t.persistent && t.producer == trace::kNoOp) {
        t.producer = o.index;
        t.output_slot = static_cast<std::int32_t>(s);
      }
    }
    o.start_s = now_;
    now_ += seconds + hw_.op_overhead_s;
    o.end_s = now_;
    o.inputs = std::move(in);
    o.outputs = std::move(out);
    trace_.ops.push_back(std::move(o));
  }

  const Hardware& hw_;
  std::int64_t tokens_;
  double now_ = 0;
  double total_bytes_ = 0;
  trace::Trace trace_;
  std::vector<Param> params_;
  std::string prefix_;
  ElementBytes bytes_;
  double flops_ = 0;
};

/// Throws tidal::InvalidArgument, with what to change, where the trace of `cfg` at `batch` x
/// `seq` on `hw` cannot be built: sizes that do not split over the GPUs, a tensor too large to
/// count, a missing rate (transformer/argument_checks.cpp).
void check_arguments(const TransformerConfig& cfg, std::int64_t batch, std::int64_t seq,
                     const Hardware& hw, const AnalyticTraceOptions& o);

}  // namespace tidal::plan::detail::transformer
