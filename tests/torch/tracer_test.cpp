// The tracer on a model small enough to derive its trace by hand, and on gpt-tiny.
#include "tidal/torch/tracer.hpp"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "tidal/models/trainer.hpp"
#include "tidal/trace/io.hpp"
#include "tidal/trace/lifetime.hpp"
#include "tidal/trace/trace.hpp"
#include "torch/test_models.hpp"

namespace {

using tidal::torch_layer::Tracer;
using tidal::trace::Phase;
using tidal::trace::TensorClass;

// Linear(4 -> 8), GELU, Linear(8 -> 2), MSE loss, AdamW, written with ATen calls whose names
// are the same on every libtorch version.
struct HandModel {
  static constexpr std::int64_t kBatch = 3;
  torch::Tensor w1, b1, w2, b2;
  std::unique_ptr<tidal::models::AdamW> opt;
  bool extra_op = false;  // to make one iteration diverge

  HandModel() {
    torch::manual_seed(0);
    w1 = torch::randn({8, 4}).requires_grad_();
    b1 = torch::randn({8}).requires_grad_();
    w2 = torch::randn({2, 8}).requires_grad_();
    b2 = torch::randn({2}).requires_grad_();
    opt = std::make_unique<tidal::models::AdamW>(std::vector<torch::Tensor>{w1, b1, w2, b2},
                                                 tidal::models::AdamW::Options{});
  }

  // Intermediates are locals so that only autograd keeps them: their frees are visible.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y) {
    auto h = torch::addmm(b1, x, w1.t());
    auto g = torch::gelu(h);
    if (extra_op) g = torch::relu(g);
    auto out = torch::addmm(b2, g, w2.t());
    return torch::mse_loss(out, y);
  }

  void step(Tracer* tracer, std::int64_t i) {
    auto x = torch::randn({kBatch, 4});
    auto y = torch::randn({kBatch, 2});
    if (tracer) tracer->begin_step(i, {x, y});
    if (tracer) tracer->begin_phase(Phase::kForward);
    auto loss = forward(x, y);
    if (tracer) tracer->begin_phase(Phase::kBackward);
    torch::autograd::backward({loss});
    if (tracer) tracer->begin_phase(Phase::kOptimizer);
    opt->step();
    opt->zero_grad();
    if (tracer) tracer->end_step(i);
  }

  void register_with(Tracer& t) {
    const char* names[] = {"w1", "b1", "w2", "b2"};
    const torch::Tensor params[] = {w1, b1, w2, b2};
    for (int i = 0; i < 4; ++i) {
      t.register_persistent(params[i], names[i], TensorClass::kParameter);
      t.register_persistent(params[i].grad(), std::string("grad.") + names[i],
                            TensorClass::kGradient);
    }
    for (const auto& [name, s] : opt->named_state()) {
      t.register_persistent(s, name, TensorClass::kOptimizerState);
    }
  }
};

bool is_view(const std::string& name) {
  static const std::set<std::string> kViews = {
      "aten::t",          "aten::view",   "aten::transpose", "aten::expand",  "aten::reshape",
      "aten::as_strided", "aten::detach", "aten::alias",     "aten::squeeze", "aten::unsqueeze"};
  return kViews.count(name) != 0;
}

// The ops, one a line, for failure messages.
std::string listing(const tidal::trace::Trace& t) {
  std::string out;
  for (const auto& op : t.ops) {
    out +=
        std::to_string(op.index) + " " + op.name + " " + tidal::trace::to_string(op.phase) + " in";
    for (auto id : op.inputs) out += " " + t.tensors[static_cast<std::size_t>(id)].name;
    out += " out";
    for (auto id : op.outputs) out += " " + t.tensors[static_cast<std::size_t>(id)].name;
    out += "\n";
  }
  return out;
}

std::vector<std::string> names_in(const tidal::trace::Trace& t, Phase phase) {
  std::vector<std::string> out;
  for (const auto& op : t.ops) {
    if (op.phase == phase) out.push_back(op.name);
  }
  return out;
}

TEST(Tracer, HandBuiltModelHasTheOpsAndSavedTensorsDerivedByHand) {
  HandModel m;
  m.step(nullptr, 0);  // warm-up: the gradients exist from now on
  Tracer tracer({"hand", HandModel::kBatch, 1});
  m.register_with(tracer);
  tracer.start();
  m.step(&tracer, 1);
  m.step(&tracer, 2);
  tracer.stop();
  const auto r = tracer.result();
  ASSERT_EQ(r.iterations, 2);
  EXPECT_TRUE(r.consistent) << r.divergence;
  const auto& t = r.trace;
  ASSERT_NO_THROW(tidal::trace::validate(t));

  // Forward: exactly the calls of forward().
  EXPECT_EQ(names_in(t, Phase::kForward),
            (std::vector<std::string>{"aten::t", "aten::addmm", "aten::gelu", "aten::t",
                                      "aten::addmm", "aten::mse_loss"}));

  // Backward, views aside: the seed, one backward per nonlinearity and loss, three matrix
  // products (dW2, dG, dW1; x needs no gradient), two bias reductions and four accumulations
  // into the existing gradients.
  std::map<std::string, int> backward;
  for (const auto& n : names_in(t, Phase::kBackward)) {
    if (!is_view(n)) ++backward[n];
  }
  EXPECT_EQ(backward, (std::map<std::string, int>{{"aten::ones_like", 1},
                                                  {"aten::mse_loss_backward", 1},
                                                  {"aten::mm", 3},
                                                  {"aten::sum", 2},
                                                  {"aten::gelu_backward", 1},
                                                  {"aten::add_", 4}}));

  // Optimizer: AdamW per parameter (decay only on matrices), then zero_grad.
  const std::vector<std::string> matrix = {"aten::mul_", "aten::mul_",     "aten::add_",
                                           "aten::mul_", "aten::addcmul_", "aten::sqrt",
                                           "aten::div",  "aten::add_",     "aten::addcdiv_"};
  const std::vector<std::string> vector(matrix.begin() + 1, matrix.end());
  std::vector<std::string> expected;
  for (const auto* p : {&matrix, &vector, &matrix, &vector}) {
    expected.insert(expected.end(), p->begin(), p->end());
  }
  expected.insert(expected.end(), 4, "aten::zero_");
  EXPECT_EQ(names_in(t, Phase::kOptimizer), expected);

  // Tensor classes: 4 parameters, 4 gradients, 8 optimizer states, the 2 inputs, and exactly
  // three activations, the tensors autograd saves: addmm1's output (for gelu), gelu's output
  // (for addmm2) and addmm2's output (for the loss).
  std::map<TensorClass, int> count;
  for (const auto& x : t.tensors) ++count[x.cls];
  EXPECT_EQ(count[TensorClass::kParameter], 4);
  EXPECT_EQ(count[TensorClass::kGradient], 4);
  EXPECT_EQ(count[TensorClass::kOptimizerState], 8);
  EXPECT_EQ(count[TensorClass::kInput], 2);
  ASSERT_EQ(count[TensorClass::kActivation], 3);
  std::vector<std::string> producers;
  std::vector<std::uint64_t> bytes;
  std::vector<int> freed, last_uses;
  for (const auto& x : t.tensors) {
    if (x.cls != TensorClass::kActivation) continue;
    producers.push_back(t.ops[static_cast<std::size_t>(x.producer)].name);
    bytes.push_back(x.bytes);
    EXPECT_EQ(x.output_slot, 0);
    EXPECT_EQ(x.name, "op" + std::to_string(x.producer) + ":0");
    // Autograd drops a node's saved tensors when the node has run: h after gelu_backward, the
    // loss input after mse_loss_backward, and g after all of AddmmBackward0 (layer 2), whose
    // last op reduces the bias gradient, just before the first accumulation (add_ into grad.b2).
    int last_use = -1;
    for (const auto& op : t.ops) {
      const bool used = std::count(op.inputs.begin(), op.inputs.end(), x.id) +
                            std::count(op.outputs.begin(), op.outputs.end(), x.id) >
                        0;
      if (used) last_use = op.index;
    }
    freed.push_back(x.freed_after);
    last_uses.push_back(last_use);
  }
  int first_accumulation = -1;
  for (const auto& op : t.ops) {
    if (first_accumulation < 0 && op.phase == Phase::kBackward && op.name == "aten::add_") {
      first_accumulation = op.index;
    }
  }
  const auto index_of = [&](const std::string& name) {
    for (const auto& op : t.ops) {
      if (op.name == name) return op.index;
    }
    return -1;
  };
  EXPECT_EQ(freed, (std::vector<int>{index_of("aten::gelu_backward"), first_accumulation - 1,
                                     index_of("aten::mse_loss_backward")}))
      << listing(t);
  EXPECT_EQ(last_uses[0], freed[0]);
  EXPECT_LT(last_uses[1], freed[1]);
  EXPECT_EQ(last_uses[2], freed[2]);
  EXPECT_EQ(producers, (std::vector<std::string>{"aten::addmm", "aten::gelu", "aten::addmm"}));
  EXPECT_EQ(bytes, (std::vector<std::uint64_t>{3 * 8 * 4, 3 * 8 * 4, 3 * 2 * 4}));

  // Persistent tensors: the parameters' bytes, never freed; each gradient is written by one
  // accumulation in backward and zeroed in the optimizer phase.
  for (const auto& x : t.tensors) {
    if (x.cls == TensorClass::kParameter || x.cls == TensorClass::kGradient ||
        x.cls == TensorClass::kOptimizerState) {
      EXPECT_TRUE(x.persistent);
      EXPECT_EQ(x.freed_after, tidal::trace::kNoOp);
    }
    if (x.cls != TensorClass::kGradient) continue;
    std::vector<std::string> writers;
    for (const auto& op : t.ops) {
      if (std::count(op.outputs.begin(), op.outputs.end(), x.id) > 0) writers.push_back(op.name);
    }
    EXPECT_EQ(writers, (std::vector<std::string>{"aten::add_", "aten::zero_"})) << x.name;
  }
  EXPECT_EQ(t.tensors[0].name, "w1");
  EXPECT_EQ(t.tensors[0].bytes, 8u * 4 * 4);

  // gelu_backward reads the activation addmm1 produced.
  for (const auto& op : t.ops) {
    if (op.name != "aten::gelu_backward") continue;
    bool reads_h = false;
    for (auto id : op.inputs) {
      const auto& x = t.tensors[static_cast<std::size_t>(id)];
      reads_h = reads_h || (x.cls == TensorClass::kActivation &&
                            t.ops[static_cast<std::size_t>(x.producer)].name == "aten::addmm");
    }
    EXPECT_TRUE(reads_h);
  }
}

// Three iterations of the same two ops, one of them slow in both the op and the host time
// after it: the folded trace has the medians of each, so one slow step moves neither.
TEST(Tracer, FoldingTakesTheMedianOpTimeAndHostTime) {
  const auto iteration = [](double d0, double gap, double d1) {
    tidal::trace::Trace t;
    t.ops.resize(2);
    t.ops[0] = tidal::trace::Op{0, "a", Phase::kForward, 10.0, 10.0 + d0, {}, {}, 0};
    t.ops[1] =
        tidal::trace::Op{1, "b", Phase::kForward, 10.0 + d0 + gap, 10.0 + d0 + gap + d1, {}, {}, 0};
    return t;
  };
  const tidal::torch_layer::ProfileResult r = tidal::torch_layer::fold_iterations(
      {iteration(1.0, 0.1, 2.0), iteration(5.0, 3.0, 2.2), iteration(1.2, 0.2, 1.8)});
  ASSERT_TRUE(r.consistent);
  EXPECT_NEAR(r.trace.ops[0].duration(), 1.2, 1e-12);
  EXPECT_NEAR(r.trace.op_seconds(0), 1.2 + 0.2, 1e-12);
  EXPECT_NEAR(r.trace.ops[1].duration(), 2.0, 1e-12);
  EXPECT_NEAR(r.trace.compute_seconds(), 1.2 + 0.2 + 2.0, 1e-12);
  EXPECT_GE(r.trace.ops[1].start_s, r.trace.ops[0].end_s);
}

TEST(Tracer, ReportsTheFirstDivergence) {
  HandModel m;
  m.step(nullptr, 0);
  Tracer tracer({"hand", HandModel::kBatch, 1});
  m.register_with(tracer);
  tracer.start();
  m.step(&tracer, 1);
  m.extra_op = true;
  m.step(&tracer, 2);
  tracer.stop();
  const auto r = tracer.result();
  EXPECT_FALSE(r.consistent);
  // Op 3 is the first that differs: relu where the second aten::t was.
  EXPECT_NE(r.divergence.find("at op 3: 'aten::relu' instead of 'aten::t'"), std::string::npos)
      << r.divergence;
}

// With the deferred optimizer schedule each gradient is made in backward and read (then dropped)
// by its update in the next step's forward: the tracer joins the two into one tensor with a gap
// per parameter, made by a backward op and freed after an op of forward.
TEST(Tracer, DeferredGradientsBecomeTensorsWithAGap) {
  tidal::models::TrainerOptions o = tidal::testing::tiny_options("llama-tiny", 2, 32, 3);
  o.optimizer = tidal::OptimizerSchedule::kDeferred;
  o.clip_grad_norm = 0.5;
  tidal::models::Trainer trainer(o);
  trainer.step();  // warm-up
  Tracer tracer({"llama-tiny", o.batch, o.seq});
  // Its gradients are dropped by their updates: not persistent, so not registered.
  trainer.register_persistent(tracer, false);
  tracer.start();
  trainer.add_observer(&tracer);
  for (int i = 0; i < 3; ++i) trainer.step();
  trainer.remove_observer(&tracer);
  tracer.stop();
  const auto r = tracer.result();
  ASSERT_TRUE(r.consistent) << r.divergence;
  const auto& t = r.trace;
  ASSERT_NO_THROW(tidal::trace::validate(t));
  std::uint64_t gap_bytes = 0;
  int gaps = 0;
  for (const auto& x : t.tensors) {
    if (!x.has_gap()) continue;
    ++gaps;
    gap_bytes += x.bytes;
    EXPECT_EQ(x.cls, TensorClass::kGradient) << x.name;
    EXPECT_EQ(t.ops[static_cast<std::size_t>(x.producer)].phase, Phase::kBackward) << x.name;
    EXPECT_EQ(t.ops[static_cast<std::size_t>(x.freed_after)].phase, Phase::kForward) << x.name;
  }
  std::uint64_t param_bytes = 0;
  for (const auto& p : trainer.model()->parameters()) {
    param_bytes += static_cast<std::uint64_t>(p.numel() * p.element_size());
  }
  EXPECT_EQ(gaps, static_cast<int>(trainer.model()->parameters().size()));
  EXPECT_EQ(gap_bytes, param_bytes);  // one gradient per parameter, no 4 KiB padding in nbytes
}

TEST(Tracer, ProfiledGptTinyTrainsExactlyLikeAnUnprofiledOne) {
  tidal::models::TrainerOptions o = tidal::testing::tiny_options("gpt-tiny", 2, 32, 11);
  tidal::models::Trainer plain(o);
  tidal::models::Trainer profiled(o);
  std::vector<double> a, b;
  a.push_back(plain.step().loss);
  b.push_back(profiled.step().loss);  // warm-up

  Tracer tracer({"gpt-tiny", o.batch, o.seq});
  profiled.register_persistent(tracer, true);
  tracer.start();
  profiled.add_observer(&tracer);
  for (int i = 0; i < 3; ++i) {
    a.push_back(plain.step().loss);
    b.push_back(profiled.step().loss);
  }
  tracer.stop();
  EXPECT_EQ(a, b);  // bit for bit

  const auto r = tracer.result();
  EXPECT_EQ(r.iterations, 3);
  EXPECT_TRUE(r.consistent) << r.divergence;
  const auto& t = r.trace;
  std::map<Phase, int> ops;
  std::set<std::int32_t> forward_layers, backward_layers;
  for (const auto& op : t.ops) {
    ++ops[op.phase];
    if (op.phase == Phase::kForward) forward_layers.insert(op.layer);
    if (op.phase == Phase::kBackward) backward_layers.insert(op.layer);
  }
  EXPECT_GT(ops[Phase::kForward], 0);
  EXPECT_GT(ops[Phase::kBackward], ops[Phase::kForward]);
  EXPECT_GT(ops[Phase::kOptimizer], 0);
  EXPECT_EQ(ops[Phase::kOther], 0);
  EXPECT_EQ(forward_layers, (std::set<std::int32_t>{-1, 0, 1}));
  EXPECT_EQ(backward_layers, (std::set<std::int32_t>{-1, 0, 1}));

  std::map<TensorClass, int> count;
  std::uint64_t param_bytes = 0;
  for (const auto& x : t.tensors) {
    ++count[x.cls];
    if (x.cls == TensorClass::kParameter) param_bytes += x.bytes;
  }
  EXPECT_EQ(param_bytes, static_cast<std::uint64_t>(o.config.parameter_count()) * 4);
  EXPECT_EQ(count[TensorClass::kGradient], count[TensorClass::kParameter]);
  EXPECT_EQ(count[TensorClass::kOptimizerState], 2 * count[TensorClass::kParameter]);
  EXPECT_GT(count[TensorClass::kActivation], 10);

  // A real trace survives the JSON round trip.
  const auto back = tidal::trace::trace_from_json(tidal::trace::trace_to_json(t));
  ASSERT_EQ(back.ops.size(), t.ops.size());
  ASSERT_EQ(back.tensors.size(), t.tensors.size());
  for (std::size_t i = 0; i < t.tensors.size(); ++i) {
    EXPECT_EQ(back.tensors[i].name, t.tensors[i].name);
    EXPECT_EQ(back.tensors[i].freed_after, t.tensors[i].freed_after);
  }

  const auto a_life = tidal::trace::analyze_lifetimes(t);
  EXPECT_GT(a_life.summary.peak_live_bytes, param_bytes * 4);  // params, grads, 2 states, more
  EXPECT_GT(a_life.summary.mean_active_ratio, 0.0);
  EXPECT_LT(a_life.summary.mean_active_ratio, 1.0);
}

}  // namespace
