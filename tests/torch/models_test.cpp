// Reference trainer and memory meter: determinism, data, configs, 4 KiB-aligned tracking
// allocator, peak memory growing with batch size.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"
#include "tidal/models/gpt.hpp"
#include "tidal/models/trainer.hpp"
#include "tidal/torch/memory.hpp"
#include "torch/test_models.hpp"

namespace {

using tidal::models::Trainer;
using tidal::models::TrainerOptions;
using tidal::torch_layer::MemoryMeter;

using tidal::testing::tiny_options;

std::vector<double> losses(TrainerOptions o, int steps) {
  Trainer t(std::move(o));
  std::vector<double> out;
  for (int i = 0; i < steps; ++i) out.push_back(t.step().loss);
  return out;
}

TEST(Models, SameSeedSameLossesDifferentSeedDifferent) {
  const auto a = losses(tiny_options("gpt-tiny", 2, 32, 7), 3);
  const auto b = losses(tiny_options("gpt-tiny", 2, 32, 7), 3);
  const auto c = losses(tiny_options("gpt-tiny", 2, 32, 8), 3);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  const auto la = losses(tiny_options("llama-tiny", 2, 32, 7), 3);
  const auto lb = losses(tiny_options("llama-tiny", 2, 32, 7), 3);
  EXPECT_EQ(la, lb);
}

TEST(Models, LossFallsOnTheSyntheticStream) {
  for (const char* name : {"gpt-tiny", "llama-tiny"}) {
    auto o = tiny_options(name, 4, 32, 1);
    o.adamw.lr = 3e-3;
    const auto l = losses(o, 30);
    EXPECT_NEAR(l.front(), std::log(256.0), 0.3) << name;  // starts near uniform
    EXPECT_LT(l.back(), l.front() - 0.5) << name;
  }
}

TEST(Models, ParameterCountMatchesTheModule) {
  for (const char* name : {"gpt-tiny", "llama-tiny"}) {
    const auto c = tidal::models::model_config(name);
    auto m = tidal::models::make_model(c, torch::kCPU);
    std::int64_t n = 0;
    for (const auto& p : m->parameters()) n += p.numel();
    EXPECT_EQ(n, c.parameter_count()) << name;
  }
  // GPT-2 small is the 124M model (tied head).
  EXPECT_NEAR(tidal::models::model_config("gpt2-small").parameter_count() / 1e6, 124.4, 0.1);
  EXPECT_NEAR(tidal::models::model_config("llama3-8b").parameter_count() / 1e9, 8.03, 0.01);
}

// The stages group the parameters as their names say: the embeddings, each block's, and the rest
// (the final norm, Llama's head), every parameter once and in the module's order.
TEST(Models, ParameterStagesFollowTheForwardPass) {
  for (const char* name : {"gpt-tiny", "llama-tiny"}) {
    const auto c = tidal::models::model_config(name);
    auto m = tidal::models::make_model(c, torch::kCPU);
    const auto layers = static_cast<std::size_t>(c.layers);
    std::vector<std::vector<const void*>> want(layers + 2);
    for (const auto& p : m->named_parameters()) {
      const std::string& key = p.key();
      std::size_t stage = layers + 1;
      if (key.rfind("blocks.", 0) == 0) {
        stage = 1 + std::stoul(key.substr(7, key.find('.', 7) - 7));
      } else if (key.rfind("tok_embedding.", 0) == 0 || key.rfind("pos_embedding.", 0) == 0) {
        stage = 0;
      }
      want.at(stage).push_back(p.value().unsafeGetTensorImpl());
    }
    const auto stages = m->parameter_stages();
    ASSERT_EQ(stages.size(), want.size()) << name;
    for (std::size_t s = 0; s < stages.size(); ++s) {
      std::vector<const void*> got;
      for (const auto& t : stages[s]) got.push_back(t.unsafeGetTensorImpl());
      EXPECT_EQ(got, want[s]) << name << " stage " << s;
      EXPECT_FALSE(got.empty()) << name << " stage " << s;
    }
  }
}

TEST(Models, OverridesAndErrors) {
  auto c = tidal::models::with_overrides(tidal::models::model_config("gpt2-small"), 2, 128, 4);
  EXPECT_EQ(c.layers, 2);
  EXPECT_EQ(c.hidden, 128);
  EXPECT_EQ(c.ffn_hidden, 512);
  EXPECT_THROW(tidal::models::model_config("gpt5"), tidal::InvalidArgument);
  EXPECT_THROW(tidal::models::with_overrides(c, 0, 100, 3), tidal::InvalidArgument);
  auto o = tiny_options("gpt-tiny", 1, 10000, 1);
  EXPECT_THROW(Trainer{o}, tidal::InvalidArgument);
}

TEST(Models, ByteLevelDataFile) {
  const std::string path = ::testing::TempDir() + "tidal_models_data.txt";
  std::string text;
  for (int i = 0; i < 50; ++i) text += "the quick brown fox jumps over the lazy dog. ";
  std::ofstream(path, std::ios::binary) << text;
  tidal::models::TokenSource src(path, 256, 3);
  auto [x, y] = src.next_batch(3, 17);
  ASSERT_EQ(x.sizes(), (std::vector<std::int64_t>{3, 17}));
  // Each row is a window of the file and targets are the inputs shifted by one byte.
  for (int b = 0; b < 3; ++b) {
    std::string row;
    for (int i = 0; i < 17; ++i) row += static_cast<char>(x[b][i].item<std::int64_t>());
    EXPECT_NE(text.find(row), std::string::npos);
    EXPECT_TRUE(torch::equal(x[b].narrow(0, 1, 16), y[b].narrow(0, 0, 16)));
  }
  auto o = tiny_options("gpt-tiny", 2, 16, 1);
  o.data_path = path;
  EXPECT_GT(losses(o, 1).front(), 0);
  EXPECT_THROW(tidal::models::TokenSource("/nonexistent/file", 256, 1), tidal::InvalidArgument);
  std::remove(path.c_str());
}

TEST(MemoryMeter, AllocationsAre4KiBAlignedAndPadded) {
  MemoryMeter meter;
  ASSERT_TRUE(tidal::torch_layer::tracking_cpu_allocator_active());
  const auto before = meter.stats();
  std::vector<torch::Tensor> keep;
  std::uint64_t padded = 0;
  for (std::int64_t n : {1, 513, 1024, 1025, 4096, 4097, 1 << 20}) {
    auto t = torch::empty({n}, torch::kUInt8);
    const auto addr = reinterpret_cast<std::uintptr_t>(t.data_ptr());
    EXPECT_EQ(addr % tidal::torch_layer::kHostAllocationAlignment, 0u) << n;
    const auto bytes = tidal::torch_layer::tracked_allocation_bytes(t.data_ptr());
    EXPECT_EQ(bytes, tidal::align_up(static_cast<std::uint64_t>(n), 4096)) << n;
    padded += bytes;
    keep.push_back(t);
  }
  const auto during = meter.stats();
  EXPECT_EQ(during.current_bytes - before.current_bytes, padded);
  EXPECT_GE(during.peak_bytes, during.current_bytes);
  EXPECT_EQ(during.allocations - before.allocations, keep.size());
  keep.clear();
  const auto after = meter.stats();
  EXPECT_EQ(after.current_bytes, before.current_bytes);
  EXPECT_EQ(after.frees - before.frees, 7u);
  meter.reset_peak();
  EXPECT_EQ(meter.peak_bytes(), meter.current_bytes());
}

// Tensors of 2 MiB or more start on a 2 MiB boundary (TIDAL_HUGE_PAGES, on by default), so that
// their whole 2 MiB pages can be huge pages; the meter still counts their 4 KiB-padded size,
// and their bytes read and write as any tensor's.
TEST(MemoryMeter, LargeAllocationsStartOnA2MiBBoundary) {
  if (std::getenv("TIDAL_HUGE_PAGES") != nullptr &&
      std::string(std::getenv("TIDAL_HUGE_PAGES")) == "0") {
    GTEST_SKIP() << "TIDAL_HUGE_PAGES=0";
  }
  MemoryMeter meter;
  constexpr std::uint64_t kHuge = std::uint64_t{2} << 20;
  std::vector<torch::Tensor> keep;
  for (std::int64_t n : {2 << 20, (2 << 20) + 1, 5 << 20, 17 << 20}) {
    auto t = torch::randint(0, 255, {n}, torch::kUInt8);
    const auto addr = reinterpret_cast<std::uintptr_t>(t.data_ptr());
    EXPECT_EQ(addr % kHuge, 0u) << n;
    EXPECT_EQ(tidal::torch_layer::tracked_allocation_bytes(t.data_ptr()),
              tidal::align_up(static_cast<std::uint64_t>(n), 4096))
        << n;
    auto copy = t.clone();
    EXPECT_TRUE(torch::equal(copy, t)) << n;
    keep.push_back(copy);
  }
}

// The strict meter: past the cap an allocation throws the error class a GPU's caching allocator
// throws, after the reclaimer had its chance; what is held is untouched, and the cap goes back.
TEST(MemoryMeter, TheStrictMeterRefusesPastItsCapAsAGpuWould) {
  MemoryMeter meter;
  const std::uint64_t base = meter.current_bytes();
  {
    tidal::torch_layer::ScopedCpuMemoryCap cap(base + 3 * tidal::kMiB);
    auto a = torch::rand({256, 1024});  // 1 MiB: fits
    EXPECT_THROW(torch::empty({3 * 256, 1024}), c10::OutOfMemoryError);
    try {
      (void)torch::mm(a.t(), a);  // 4 MiB result inside an op
      ADD_FAILURE() << "no refusal";
    } catch (const c10::OutOfMemoryError& e) {
      EXPECT_NE(std::string(e.what()).find("strict memory meter"), std::string::npos) << e.what();
    }
    EXPECT_EQ(meter.current_bytes(), base + tidal::kMiB) << "a refusal holds nothing";
    EXPECT_GE(meter.stats().refusals, 2u);
    auto b = torch::rand({256, 1024});  // what fits still fits
    EXPECT_EQ(meter.current_bytes(), base + 2 * tidal::kMiB);
  }
  EXPECT_EQ(tidal::torch_layer::cpu_memory_cap(), 0u);
  auto big = torch::empty({16, 1024, 1024});  // no cap any more
  EXPECT_EQ(big.numel(), 16 * 1024 * 1024);
}

TEST(MemoryMeter, TheReclaimerIsAskedBeforeARefusal) {
  MemoryMeter meter;
  std::vector<torch::Tensor> spare;
  for (int i = 0; i < 4; ++i) spare.push_back(torch::rand({256, 1024}));  // 4 x 1 MiB
  const std::uint64_t base = meter.current_bytes();
  tidal::torch_layer::ScopedCpuMemoryCap cap(base + 2 * tidal::kMiB);
  std::vector<std::uint64_t> asked;
  const auto token = tidal::torch_layer::set_cpu_memory_reclaimer([&](std::uint64_t bytes) {
    asked.push_back(bytes);
    std::uint64_t freed = 0;
    while (freed < bytes && !spare.empty()) {  // frees whole tensors until enough
      spare.pop_back();
      freed += tidal::kMiB;
    }
    return freed;
  });
  auto c = torch::empty({4 * 256, 1024});  // 4 MiB: 2 over the cap; two spares go
  ASSERT_EQ(asked.size(), 1u);
  EXPECT_EQ(asked[0], 2 * tidal::kMiB);
  EXPECT_EQ(spare.size(), 2u);
  EXPECT_LE(meter.current_bytes(), base + 2 * tidal::kMiB);
  EXPECT_THROW(torch::empty({8 * 256, 1024}), c10::OutOfMemoryError);  // spares not enough
  EXPECT_TRUE(spare.empty());
  tidal::torch_layer::clear_cpu_memory_reclaimer(token);
  EXPECT_GE(meter.stats().reclaimed_bytes, 4 * tidal::kMiB);
}

// Optimizer-in-backward drops each gradient once its parameter is updated: after a step no
// gradient is left (after-backward keeps all of them, zeroed), the losses are the same, and the
// step's peak is lower than with all gradients held through backward.
TEST(Models, OptimizerInBackwardDropsEachGradientAfterItsUpdate) {
  MemoryMeter meter;
  std::uint64_t peak[2] = {0, 0};
  std::uint64_t grad_bytes = 0;
  std::vector<double> loss[2];
  for (const bool in_backward : {false, true}) {
    auto o = tiny_options("gpt-tiny", 4, 64, 3);
    o.optimizer = in_backward ? tidal::OptimizerSchedule::kInBackward
                              : tidal::OptimizerSchedule::kAfterBackward;
    const std::uint64_t before = meter.current_bytes();
    {
      Trainer t(o);
      loss[in_backward].push_back(t.step().loss);
      grad_bytes = 0;
      for (const auto& p : t.model()->parameters()) {
        EXPECT_EQ(p.grad().defined(), !in_backward);
        grad_bytes += static_cast<std::uint64_t>(p.numel() * p.element_size());
      }
      meter.reset_peak();
      loss[in_backward].push_back(t.step().loss);
      peak[in_backward] = meter.peak_bytes() - before;
    }
  }
  EXPECT_EQ(loss[0], loss[1]);
  RecordProperty("peak_after_backward", std::to_string(peak[0]));
  RecordProperty("peak_in_backward", std::to_string(peak[1]));
  RecordProperty("gradient_bytes", std::to_string(grad_bytes));
  // At the after-backward peak (in backward) most gradients exist; in-backward has dropped the
  // gradients of the blocks already done.
  EXPECT_LE(peak[1] + grad_bytes / 2, peak[0]);
}

// The deferred schedule leaves a step's updates to the next forward pass: after a step the
// parameters are still the old ones and the gradients are kept; flush_optimizer() applies the
// updates, which are then exactly those of the step after backward.
TEST(Models, OptimizerDeferredUpdatesInTheNextForward) {
  auto o = tiny_options("llama-tiny", 2, 32, 5);
  Trainer after(o);
  o.optimizer = tidal::OptimizerSchedule::kDeferred;
  Trainer deferred(o);
  std::vector<torch::Tensor> init;
  for (const auto& p : deferred.model()->parameters()) init.push_back(p.detach().clone());
  EXPECT_EQ(after.step().loss, deferred.step().loss);
  const auto pa = after.model()->parameters();
  const auto pd = deferred.model()->parameters();
  for (std::size_t i = 0; i < pd.size(); ++i) {
    EXPECT_TRUE(torch::equal(pd[i].detach(), init[i])) << "updated before the next forward: " << i;
    EXPECT_TRUE(pd[i].grad().defined()) << i;
    EXPECT_FALSE(torch::equal(pa[i].detach(), init[i])) << i;
  }
  EXPECT_EQ(after.step().loss, deferred.step().loss);  // the second forward applies them first
  deferred.flush_optimizer();
  for (std::size_t i = 0; i < pd.size(); ++i) {
    EXPECT_TRUE(torch::equal(pa[i].detach(), pd[i].detach())) << i;
    EXPECT_FALSE(pd[i].grad().defined()) << i;
  }
  // Clipping needs every gradient before any update: not with optimizer-in-backward.
  auto bad = tiny_options("gpt-tiny", 2, 32, 5);
  bad.optimizer = tidal::OptimizerSchedule::kInBackward;
  bad.clip_grad_norm = 1.0;
  try {
    Trainer t(bad);
    FAIL() << "accepted clipping with optimizer-in-backward";
  } catch (const tidal::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("deferred schedule"), std::string::npos) << e.what();
  }
}

TEST(MemoryMeter, PeakGrowsWithBatchSize) {
  MemoryMeter meter;
  std::vector<std::uint64_t> peaks;
  for (std::int64_t batch : {1, 4, 16}) {
    Trainer t(tiny_options("gpt-tiny", batch, 64, 1));
    t.step();
    meter.reset_peak();
    t.step();
    peaks.push_back(meter.peak_bytes() - meter.current_bytes());
  }
  EXPECT_LT(peaks[0], peaks[1]);
  EXPECT_LT(peaks[1], peaks[2]);
  // Activations scale with the batch: 16x the batch needs several times the extra memory.
  EXPECT_GT(static_cast<double>(peaks[2]), 4.0 * static_cast<double>(peaks[0]));
}

}  // namespace
