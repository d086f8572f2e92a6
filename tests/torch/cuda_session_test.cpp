// The torch layer on CUDA tensors: tidal's trainer on a CUDA device through a Session in every
// mode gives the losses and parameters of no offloading, bit for bit, and plan mode's meter is
// the CUDA caching allocator's. Each test skips, saying why, where torch sees no CUDA device.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/version.h>

#include "io/test_dir.hpp"
#include "tidal/common/units.hpp"
#include "tidal/models/trainer.hpp"
#include "tidal/torch/activations.hpp"
#include "tidal/torch/memory.hpp"
#include "tidal/torch/session.hpp"
#include "torch/test_models.hpp"

namespace tidal::torch_layer {
namespace {

#define TIDAL_SKIP_WITHOUT_CUDA()   \
  if (!torch::cuda::is_available()) \
  GTEST_SKIP() << "no CUDA device: torch " TORCH_VERSION " sees none on this machine"

struct CudaRun {
  std::vector<double> losses;
  std::vector<torch::Tensor> params;
  SessionStats stats;
};

CudaRun train_on_cuda(OffloadMode mode, const std::string& dir, int steps) {
  const torch::Device cuda(torch::kCUDA, 0);
  MemoryMeter meter(cuda);
  models::TrainerOptions o = testing::tiny_options("gpt-tiny", 8, 64, 21);
  o.device = cuda;
  models::Trainer trainer(o);
  SessionOptions so;
  so.mode = mode;
  so.device = cuda;
  so.store.dirs = {dir};
  so.store.capacity = 512 * kMiB;
  so.activations.min_bytes = 16 * 1024;
  so.activations.adaptive = false;
  so.executor.min_bytes = 16 * 1024;
  so.budget_fraction = 0.6;
  so.peak_bytes = [&meter] { return meter.peak_bytes(); };
  so.current_bytes = [&meter] { return meter.current_bytes(); };
  so.reset_peak = [&meter] { meter.reset_peak(); };
  CudaRun r;
  {
    Session session(so);
    trainer.add_observer(&session);
    for (int i = 0; i < steps; ++i) {
      r.losses.push_back(trainer.step().loss);
      if (i == 0) trainer.register_persistent(session);
    }
    trainer.remove_observer(&session);
    r.stats = session.stats();
  }
  for (auto& p : trainer.model()->parameters()) r.params.push_back(p.detach().cpu().clone());
  return r;
}

TEST(CudaSession, EveryModeIsBitIdenticalOnCudaTensors) {
  TIDAL_SKIP_WITHOUT_CUDA();
  testing::TestDir dir;
  const CudaRun none = train_on_cuda(OffloadMode::kNone, dir.path(), 8);
  for (auto mode : {OffloadMode::kActivations, OffloadMode::kPlan}) {
    const CudaRun run = train_on_cuda(mode, dir.path(), 8);
    EXPECT_EQ(run.losses, none.losses) << to_string(mode);
    ASSERT_EQ(run.params.size(), none.params.size());
    for (std::size_t i = 0; i < run.params.size(); ++i) {
      EXPECT_TRUE(torch::equal(run.params[i], none.params[i])) << to_string(mode) << " " << i;
    }
    EXPECT_GT(run.stats.bytes_written + run.stats.bytes_read, 0u) << to_string(mode);
  }
}

TEST(CudaSession, TheMeterIsTheCachingAllocators) {
  TIDAL_SKIP_WITHOUT_CUDA();
  const torch::Device cuda(torch::kCUDA, 0);
  MemoryMeter meter(cuda);
  meter.reset_peak();
  const std::uint64_t before = meter.current_bytes();
  auto t = torch::empty({1 << 20}, torch::TensorOptions().device(cuda).dtype(torch::kFloat));
  EXPECT_GE(meter.current_bytes(), before + (4u << 20));
  EXPECT_GE(meter.peak_bytes(), before + (4u << 20));
  t.reset();
  EXPECT_LT(meter.current_bytes(), before + (4u << 20));
}

// tidal's autograd engine is installed by the first activation offloader, often after
// backwards have run on PyTorch's (warm-up steps, a run without offloading): a CUDA backward on
// it must still find the engine's device threads (PyTorch 2.x starts them once a process).
TEST(CudaSession, BackwardOnCudaAfterTidalsEngineIsInstalledLate) {
  TIDAL_SKIP_WITHOUT_CUDA();
  const torch::Device cuda(torch::kCUDA, 0);
  const auto grad_of = [&](int seed) {
    torch::manual_seed(seed);
    auto x = torch::randn({64, 64}, torch::TensorOptions().device(cuda).requires_grad(true));
    (x.matmul(x).sin().sum()).backward();
    return std::make_pair(x.detach().cpu(), x.grad().cpu());
  };
  const auto before = grad_of(3);  // on PyTorch's engine: it starts the device threads
  install_autograd_engine();
  const auto after = grad_of(3);  // on tidal's
  EXPECT_TRUE(torch::equal(after.first, before.first));
  EXPECT_TRUE(torch::allclose(after.second, before.second));
  EXPECT_GT(after.second.abs().sum().item<double>(), 0.0);
}

// A meter made before the first tensor on the device (tidal train makes it first): the
// caching allocator is initialized by the meter, not assumed.
TEST(CudaSession, AMeterBeforeAnyTensorReadsZeroNotAnError) {
  TIDAL_SKIP_WITHOUT_CUDA();
  MemoryMeter meter(torch::Device(torch::kCUDA, 0));
  EXPECT_NO_THROW((void)meter.current_bytes());
  EXPECT_NO_THROW(meter.reset_peak());
}

}  // namespace
}  // namespace tidal::torch_layer
