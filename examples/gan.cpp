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

#include "example_report.hpp"
#include "tidal/torch/session.hpp"

namespace {

constexpr int64_t kBatch = 256;
constexpr int64_t kNoise = 32;
constexpr int64_t kDim = 64;
constexpr int64_t kModes = 8;

int run(int argc, char** argv) {
  tidal_example::Args args;
  args.steps = 40;
  tidal_example::parse_args(argc, argv, args);

  torch::manual_seed(1);
  // Before the models, so that every tensor of the run is allocated while tidal is watching.
  tidal::torch_layer::Session session(tidal_example::session_options(args));

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

  tidal_example::Report report;
  for (int step = 0; step < args.steps; ++step) {
    auto real = centres.index_select(0, torch::randint(kModes, {kBatch})) +
                0.1 * torch::randn({kBatch, kDim});

    report.start_step();
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

    session.end_step();
    report.end_step(step, session,
                    {{"loss_d", d_loss.item<double>()}, {"loss_g", g_loss.item<double>()}});
  }

  report.print_summary(args, session);
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return tidal_example::main_with_errors(argc, argv, run); }
