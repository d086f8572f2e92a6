#include "tidal/torch/checkpoint.hpp"

#include <gtest/gtest.h>

#include "tidal/models/trainer.hpp"
#include "tidal/torch/memory.hpp"
#include "torch/test_models.hpp"

namespace tidal::torch_layer {
namespace {

std::vector<double> run(bool recompute, std::uint64_t* peak) {
  MemoryMeter meter(torch::kCPU);
  models::Trainer trainer(testing::tiny_options("gpt-tiny", 8, 128, 5));
  if (recompute) {
    trainer.model()->set_block_wrapper([](std::int64_t, const models::BlockFn& block,
                                          const torch::Tensor& x) { return checkpoint(block, x); });
  }
  std::vector<double> losses;
  meter.reset_peak();
  for (int i = 0; i < 4; ++i) losses.push_back(trainer.step().loss);
  *peak = meter.peak_bytes();
  return losses;
}

TEST(Checkpoint, RecomputeGivesTheSameLossesWithLessMemory) {
  std::uint64_t keep_peak = 0;
  std::uint64_t recompute_peak = 0;
  const auto keep = run(false, &keep_peak);
  const auto recompute = run(true, &recompute_peak);
  ASSERT_EQ(keep.size(), recompute.size());
  for (std::size_t i = 0; i < keep.size(); ++i) EXPECT_EQ(keep[i], recompute[i]) << i;
  EXPECT_LT(recompute_peak, keep_peak) << "checkpointing must lower the activation peak";
}

}  // namespace
}  // namespace tidal::torch_layer
