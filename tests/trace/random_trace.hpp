// Random but well-formed training-iteration traces for tests (header-only, reusable by the plan
// and torch test suites: #include "trace/random_trace.hpp").
//
// The shape mimics a real iteration: inputs (tokens, targets); per layer persistent parameters,
// gradients and optimizer states; forward ops that read parameters and the running hidden state
// and produce temporaries and saved activations; backward ops over the layers in reverse order
// that read the saved activations and parameters and write the gradients; one optimizer op per
// parameter that reads the parameter, its gradient and its states and writes the parameter and
// the states. Phases are in order forward -> backward -> optimizer. Producers are the first op
// that writes a tensor; some per-iteration tensors get a freed_after a few ops past their last
// use. The result passes tidal::trace::validate.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "tidal/trace/trace.hpp"

namespace tidal::trace::testutil {

struct RandomTraceOptions {
  int layers = 3;
  int params_per_layer = 2;
  int forward_ops_per_layer = 3;
  int backward_ops_per_layer = 3;
  int optimizer_states_per_param = 2;
  /// Chance that a per-iteration tensor gets an explicit freed_after past its last use.
  double freed_after_probability = 0.3;
  /// Chance that a forward output is saved for backward (an activation) rather than a temporary.
  double save_probability = 0.5;
  /// Gradients made by backward and freed after their optimizer op (zero_grad(set_to_none)),
  /// instead of persistent gradients.
  bool gradients_set_to_none = false;
  /// Tensor sizes are log-uniform in [min_bytes, max_bytes].
  std::uint64_t min_bytes = 4;
  std::uint64_t max_bytes = 4ull << 30;
};

/// A random trace, deterministic in seed.
inline Trace random_trace(std::uint64_t seed, const RandomTraceOptions& opt = {}) {
  std::mt19937_64 rng(seed);
  auto uniform = [&](double a, double b) {
    return std::uniform_real_distribution<double>(a, b)(rng);
  };
  auto pick = [&](std::size_t n) {
    return std::uniform_int_distribution<std::size_t>(0, n - 1)(rng);
  };
  auto chance = [&](double p) { return uniform(0, 1) < p; };
  auto random_bytes = [&]() {
    const double lo = std::log(static_cast<double>(opt.min_bytes));
    const double hi = std::log(static_cast<double>(opt.max_bytes));
    return static_cast<std::uint64_t>(std::exp(uniform(lo, hi)));
  };

  Trace t;
  t.model = "random-" + std::to_string(seed);
  t.device = "cuda:0";
  t.batch = 1 + static_cast<std::int64_t>(pick(16));
  t.seq = 1 + static_cast<std::int64_t>(pick(2048));
  t.meta["generator"] = "tests/trace/random_trace.hpp";
  t.meta["seed"] = std::to_string(seed);

  auto add_tensor = [&](const std::string& name, TensorClass cls, bool persistent) {
    Tensor x;
    x.id = static_cast<TensorId>(t.tensors.size());
    x.name = name;
    x.bytes = random_bytes();
    x.device = t.device;
    x.cls = cls;
    x.persistent = persistent;
    t.tensors.push_back(x);
    return x.id;
  };
  auto add_op = [&](const std::string& name, Phase phase, int layer, std::vector<TensorId> inputs,
                    std::vector<TensorId> outputs) {
    Op op;
    op.index = static_cast<OpIndex>(t.ops.size());
    op.name = name;
    op.phase = phase;
    op.layer = layer;
    op.inputs = std::move(inputs);
    op.outputs = std::move(outputs);
    t.ops.push_back(op);
  };

  const int L = opt.layers;
  const int P = opt.params_per_layer;
  std::vector<std::vector<TensorId>> params(L), grads(L);
  std::vector<std::vector<std::vector<TensorId>>> states(L);
  for (int l = 0; l < L; ++l) {
    for (int j = 0; j < P; ++j) {
      const std::string base = "layers." + std::to_string(l) + ".w" + std::to_string(j);
      params[l].push_back(add_tensor(base, TensorClass::kParameter, true));
      grads[l].push_back(
          add_tensor(base + ".grad", TensorClass::kGradient, !opt.gradients_set_to_none));
      states[l].emplace_back();
      for (int s = 0; s < opt.optimizer_states_per_param; ++s) {
        states[l][j].push_back(
            add_tensor(base + ".state" + std::to_string(s), TensorClass::kOptimizerState, true));
      }
    }
  }
  const TensorId tokens = add_tensor("tokens", TensorClass::kInput, false);
  const TensorId targets = add_tensor("targets", TensorClass::kInput, false);

  // Forward. Each parameter is read by at least one op of its layer (a random one).
  std::vector<std::vector<TensorId>> saved(L);
  TensorId hidden = tokens;
  for (int l = 0; l < L; ++l) {
    const int n = std::max(1, opt.forward_ops_per_layer);
    std::vector<std::vector<TensorId>> reads(n);
    for (int j = 0; j < P; ++j) reads[pick(n)].push_back(params[l][j]);
    for (int i = 0; i < n; ++i) {
      std::vector<TensorId> in{hidden};
      for (TensorId p : reads[i]) in.push_back(p);
      if (chance(0.2)) in.push_back(hidden);  // x * x reads one tensor twice
      const bool save = chance(opt.save_probability);
      const TensorId out =
          add_tensor("", save ? TensorClass::kActivation : TensorClass::kTemporary, false);
      std::vector<TensorId> outs{out};
      if (chance(0.2)) outs.push_back(add_tensor("", TensorClass::kTemporary, false));  // unused
      if (save) saved[l].push_back(out);
      add_op("fwd.l" + std::to_string(l) + ".op" + std::to_string(i), Phase::kForward, l, in, outs);
      hidden = out;
    }
  }
  const TensorId loss = add_tensor("", TensorClass::kTemporary, false);
  add_op("loss", Phase::kForward, -1, {hidden, targets}, {loss});

  // Backward, layers in reverse. Saved activations of a layer are spread over its ops.
  TensorId grad = add_tensor("", TensorClass::kTemporary, false);
  add_op("loss.backward", Phase::kBackward, -1, {loss}, {grad});
  for (int l = L - 1; l >= 0; --l) {
    const int n = std::max(1, opt.backward_ops_per_layer);
    std::vector<std::vector<TensorId>> reads(n);
    for (TensorId a : saved[l]) reads[pick(n)].push_back(a);
    std::vector<std::vector<TensorId>> writes(n);
    for (int j = 0; j < P; ++j) {
      const std::size_t i = pick(n);
      reads[i].push_back(params[l][j]);
      writes[i].push_back(grads[l][j]);
    }
    for (int i = 0; i < n; ++i) {
      std::vector<TensorId> in{grad};
      for (TensorId x : reads[i]) in.push_back(x);
      const TensorId out = add_tensor("", TensorClass::kTemporary, false);
      std::vector<TensorId> outs{out};
      for (TensorId g : writes[i]) outs.push_back(g);
      add_op("bwd.l" + std::to_string(l) + ".op" + std::to_string(i), Phase::kBackward, l, in,
             outs);
      grad = out;
    }
  }

  // Optimizer: one op per parameter.
  for (int l = 0; l < L; ++l) {
    for (int j = 0; j < P; ++j) {
      std::vector<TensorId> in{params[l][j], grads[l][j]};
      std::vector<TensorId> outs{params[l][j]};
      for (TensorId s : states[l][j]) {
        in.push_back(s);
        outs.push_back(s);
      }
      add_op("adamw.l" + std::to_string(l) + ".w" + std::to_string(j), Phase::kOptimizer, l, in,
             outs);
    }
  }

  // Producers, output slots, names, freed_after.
  const auto n_ops = static_cast<OpIndex>(t.ops.size());
  std::vector<OpIndex> last_use(t.tensors.size(), kNoOp);
  for (const Op& op : t.ops) {
    for (TensorId id : op.inputs) last_use[id] = op.index;
    for (TensorId id : op.outputs) last_use[id] = op.index;
  }
  for (const Op& op : t.ops) {
    for (std::size_t s = 0; s < op.outputs.size(); ++s) {
      Tensor& x = t.tensors[op.outputs[s]];
      if (x.persistent || x.producer != kNoOp) continue;
      x.producer = op.index;
      x.output_slot = static_cast<std::int32_t>(s);
      x.name = "op" + std::to_string(op.index) + ":" + std::to_string(s);
    }
  }
  for (Tensor& x : t.tensors) {
    if (x.persistent || !chance(opt.freed_after_probability)) continue;
    const OpIndex from =
        x.cls == TensorClass::kInput ? std::max<OpIndex>(last_use[x.id], 0) : last_use[x.id];
    if (from == kNoOp) continue;
    const OpIndex to = std::min<OpIndex>(n_ops - 1, from + 3);
    x.freed_after = from + static_cast<OpIndex>(pick(static_cast<std::size_t>(to - from) + 1));
  }

  // Times: random durations (some zero) and small gaps between ops.
  double now = 0;
  for (Op& op : t.ops) {
    if (chance(0.5)) now += uniform(0, 2e-5);
    op.start_s = now;
    op.end_s = now + (chance(0.05) ? 0.0 : uniform(1e-6, 2e-3));
    now = op.end_s;
  }
  return t;
}

}  // namespace tidal::trace::testutil
