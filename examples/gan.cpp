// A small GAN on a 64-dimensional gaussian mixture, written the way libtorch's DCGAN example is,
// with a tidal Session around each step. Each step runs three backward passes (D on real data,
// D on fake data, G through D), and the two Adam optimizers create their state on their first
// step.
//
//   ./tidal_example_gan --mode activations --steps 40
//
// Flags: --mode none|activations|plan, --dir DIR (store), --steps N, --mem-budget FRACTION
// (plan mode).
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <stdexcept>
#include <string>

#include "tidal/torch/memory.hpp"
#include "tidal/torch/session.hpp"

namespace {

constexpr int64_t kBatch = 256;
constexpr int64_t kNoise = 32;
constexpr int64_t kDim = 64;
constexpr int64_t kModes = 8;

int run(int argc, char** argv) {
  std::string mode = "none";
  std::string dir = "/var/tmp/tidal";
  int steps = 40;
  double mem_budget = 0.5;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--mode") {
      mode = value();
    } else if (arg == "--dir") {
      dir = value();
    } else if (arg == "--steps") {
      steps = std::stoi(value());
    } else if (arg == "--mem-budget") {
      mem_budget = std::stod(value());
    } else {
      throw std::invalid_argument("unknown flag " + arg);
    }
  }

  torch::manual_seed(1);

  tidal::torch_layer::SessionOptions options;
  options.mode = tidal::torch_layer::offload_mode_from_string(mode);
  options.store.dirs = {dir};
  options.store.capacity = 1ull << 30;
  options.activations.min_bytes = 64 * 1024;
  options.executor.min_bytes = 64 * 1024;
  options.budget_fraction = mem_budget;
  if (options.mode != tidal::torch_layer::OffloadMode::kNone) {
    std::filesystem::create_directories(dir);
  }
  // Before the models, so that every tensor of the run is allocated while tidal is watching.
  tidal::torch_layer::Session session(options);
  tidal::torch_layer::MemoryMeter meter(torch::kCPU);

  torch::nn::Sequential generator(torch::nn::Linear(kNoise, 256), torch::nn::ReLU(),
                                  torch::nn::Linear(256, 512), torch::nn::ReLU(),
                                  torch::nn::Linear(512, kDim));
  torch::nn::Sequential discriminator(
      torch::nn::Linear(kDim, 512),
      torch::nn::LeakyReLU(torch::nn::LeakyReLUOptions().negative_slope(0.2)),
      torch::nn::Linear(512, 256),
      torch::nn::LeakyReLU(torch::nn::LeakyReLUOptions().negative_slope(0.2)),
      torch::nn::Linear(256, 1));
  torch::optim::Adam g_optimizer(generator->parameters(),
                                 torch::optim::AdamOptions(2e-4).betas({0.5, 0.999}));
  torch::optim::Adam d_optimizer(discriminator->parameters(),
                                 torch::optim::AdamOptions(2e-4).betas({0.5, 0.999}));
  torch::nn::BCEWithLogitsLoss criterion;

  // The "real" distribution: kModes gaussians around fixed random centres.
  const auto centres = torch::randn({kModes, kDim}) * 2;

  uint64_t peak = 0;
  // Peak of the steps after the first 4: past plan mode's warm-up and profiling steps (1 + 2),
  // and activation mode's warm-up, reference and two trial steps (1 + 1 + 2).
  uint64_t steady_peak = 0;
  uint64_t written = 0;
  uint64_t read = 0;
  uint64_t misses = 0;
  double seconds = 0;
  int timed = 0;
  for (int step = 0; step < steps; ++step) {
    auto real = centres.index_select(0, torch::randint(kModes, {kBatch})) +
                0.1 * torch::randn({kBatch, kDim});

    meter.reset_peak();
    const auto t0 = std::chrono::steady_clock::now();
    session.begin_step();

    // Discriminator: real batch, then the generator's batch with the generator cut off.
    d_optimizer.zero_grad();
    auto real_logits = discriminator->forward(real);
    auto d_loss_real = criterion(real_logits, torch::ones_like(real_logits));
    d_loss_real.backward();
    auto fake = generator->forward(torch::randn({kBatch, kNoise}));
    auto fake_logits = discriminator->forward(fake.detach());
    auto d_loss_fake = criterion(fake_logits, torch::zeros_like(fake_logits));
    d_loss_fake.backward();
    auto d_loss = d_loss_real + d_loss_fake;
    d_optimizer.step();

    // Generator: through the discriminator, labelled as real.
    g_optimizer.zero_grad();
    auto g_logits = discriminator->forward(fake);
    auto g_loss = criterion(g_logits, torch::ones_like(g_logits));
    g_loss.backward();
    g_optimizer.step();

    // Read before end_step: the session may reset the meter's peak there (plan mode checks its
    // budget at the end of a step).
    const uint64_t step_peak = meter.peak_bytes();
    peak = std::max(peak, step_peak);
    session.end_step();
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (step >= 4) {
      seconds += dt;
      steady_peak = std::max(steady_peak, step_peak);
      ++timed;
    }
    const auto s = session.stats();
    written += s.bytes_written;
    read += s.bytes_read;
    misses += s.misses;
    std::printf("step %d loss_d %a loss_g %a\n", step, d_loss.item<double>(),
                g_loss.item<double>());
    std::fflush(stdout);
  }

  const auto s = session.stats();
  // Plan mode: the session's own verdict over the steps its current plan ran (why, if not, in
  // s.budget_reason); the other modes have no budget.
  const bool within_budget =
      options.mode != tidal::torch_layer::OffloadMode::kPlan || s.within_budget;
  std::printf(
      "summary mode=%s peak_bytes=%llu budget=%llu within_budget=%d bytes_written=%llu "
      "bytes_read=%llu misses=%llu step_seconds=%.4f steady_peak_bytes=%llu\n",
      mode.c_str(), static_cast<unsigned long long>(peak),
      static_cast<unsigned long long>(s.memory_budget), within_budget ? 1 : 0,
      static_cast<unsigned long long>(written), static_cast<unsigned long long>(read),
      static_cast<unsigned long long>(misses), timed > 0 ? seconds / timed : 0.0,
      static_cast<unsigned long long>(steady_peak));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
