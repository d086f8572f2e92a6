// Tests of activation checkpointing as a trace rewrite: selective checkpointing runs only a
// block's memory-bound ops again, keeps what they read alive no longer, and saves their outputs
// for a small part of the compute that whole-block checkpointing costs.
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <string>

#include "tidal/plan/hardware.hpp"
#include "tidal/plan/model_trace.hpp"
#include "tidal/plan/policies.hpp"
#include "tidal/trace/lifetime.hpp"
#include "tidal/trace/trace.hpp"

namespace tidal::plan {
namespace {

using trace::Phase;

TransformerConfig three_layers(const std::string& name) {
  TransformerConfig cfg = model_preset(name);
  ModelOverrides o;
  o.layers = 3;
  apply_overrides(cfg, o);
  return cfg;
}

// Live bytes at the first backward op: what the forward pass left for backward.
std::uint64_t at_backward(const trace::Trace& t) {
  const auto la = trace::analyze_lifetimes(t);
  for (const auto& op : t.ops) {
    if (op.phase == Phase::kBackward) return la.live_bytes[static_cast<std::size_t>(op.index)];
  }
  return 0;
}

std::string op_kind(const std::string& name) {
  const auto dot = name.rfind('.');
  return dot == std::string::npos ? name : name.substr(dot + 1);
}

class SelectiveCheckpointing : public ::testing::TestWithParam<std::string> {};

TEST_P(SelectiveCheckpointing, RunsTheMemoryBoundOpsAgainForPartOfTheSaving) {
  const Hardware hw = hardware_preset("h100-4ssd");
  const trace::Trace t = transformer_trace(three_layers(GetParam()), 2, 512, hw);
  const trace::Trace sel = recompute_trace(t, Checkpointing{0, 1000});
  const trace::Trace full = recompute_trace(t, Checkpointing{1000, 0});
  EXPECT_NO_THROW(trace::validate(sel));

  // What runs again: norms and activation functions, never a matmul or attention.
  std::map<std::string, int> again;
  for (const auto& op : sel.ops) {
    if (op.name.rfind("recompute:", 0) == 0) ++again[op_kind(op.name.substr(10))];
  }
  ASSERT_FALSE(again.empty());
  for (const auto& [kind, n] : again) {
    EXPECT_EQ(kind.find("attention"), std::string::npos) << kind;
    EXPECT_EQ(kind.find("proj"), std::string::npos) << kind;
    EXPECT_EQ(kind.find("feed_forward"), std::string::npos) << kind;
    EXPECT_EQ(n % 3, 0) << kind << ": once per layer";
  }

  // It saves memory between forward and backward, less than whole blocks do, for a small part
  // of their extra compute.
  EXPECT_LT(at_backward(sel), at_backward(t));
  EXPECT_GT(at_backward(sel), at_backward(full));
  const double extra_sel = sel.compute_seconds() - t.compute_seconds();
  const double extra_full = full.compute_seconds() - t.compute_seconds();
  EXPECT_GT(extra_sel, 0);
  EXPECT_LT(extra_sel, 0.2 * extra_full);
  // Nothing it reads lives longer: the peak is no higher than without checkpointing.
  EXPECT_LE(trace::analyze_lifetimes(sel).summary.peak_live_bytes,
            trace::analyze_lifetimes(t).summary.peak_live_bytes);
}

// Whole blocks for the first layers and selective for the rest: between the two, and named so.
TEST(Checkpointing, WholeBlocksFirstThenSelective) {
  const Hardware hw = hardware_preset("h100-4ssd");
  const trace::Trace t = transformer_trace(three_layers("llama3.2-1b"), 2, 512, hw);
  const trace::Trace mixed = recompute_trace(t, Checkpointing{1, 2});
  const trace::Trace sel = recompute_trace(t, Checkpointing{0, 3});
  const trace::Trace full = recompute_trace(t, Checkpointing{3, 0});
  EXPECT_NO_THROW(trace::validate(mixed));
  EXPECT_LT(at_backward(mixed), at_backward(sel));
  EXPECT_GT(at_backward(mixed), at_backward(full));
  EXPECT_GT(mixed.compute_seconds(), sel.compute_seconds());
  EXPECT_LT(mixed.compute_seconds(), full.compute_seconds());
  for (const auto& op : mixed.ops) {
    if (op.name.rfind("recompute:", 0) != 0 || op.layer == 0) continue;
    EXPECT_EQ(op.name.find("feed_forward"), std::string::npos) << op.name << ": a selective layer";
  }
  EXPECT_EQ(checkpointing_name({1, 2}, 3),
            "layer-wise activation checkpointing of the first 1 of 3 layers, selective "
            "(memory-bound ops) of the 2 after them");
  EXPECT_EQ(checkpointing_name({3, 0}, 3), "layer-wise activation checkpointing");
}

INSTANTIATE_TEST_SUITE_P(Models, SelectiveCheckpointing,
                         ::testing::Values("gpt2-small", "llama3.2-1b"), [](const auto& info) {
                           std::string n = info.param;
                           for (auto& c : n) c = (c == '-' || c == '.') ? '_' : c;
                           return n;
                         });

}  // namespace
}  // namespace tidal::plan
