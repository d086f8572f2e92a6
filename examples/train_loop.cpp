// A plain libtorch training loop with tidal: the model is untouched; the Session wraps each step.
// Build: part of the tidal build (target tidal_example_train_loop). Run:
//   ./tidal_example_train_loop --mode activations --dir /var/tmp/tidal --steps 10
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
#include "tidal/tidal.hpp"

namespace {

int run(int argc, char** argv) {
  tidal_example::Args args;
  args.mode = "activations";
  tidal_example::parse_args(argc, argv, args);

  torch::manual_seed(0);
  // Before the model, so that every tensor of the run is allocated while tidal is watching.
  tidal::torch_layer::Session session(tidal_example::session_options(args));

  auto model = torch::nn::Sequential(torch::nn::Linear(512, 2048), torch::nn::GELU(),
                                     torch::nn::Linear(2048, 512));
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));

  tidal_example::Report report;
  for (int step = 0; step < args.steps; ++step) {
    auto x = torch::randn({1024, 512});
    report.start_step();
    session.begin_step();
    optimizer.zero_grad();
    auto loss = (model->forward(x) - x).pow(2).mean();
    loss.backward();
    optimizer.step();
    session.end_step();
    report.end_step(step, session, {{"loss", loss.item<double>()}});
  }

  report.print_summary(args, session);
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return tidal_example::main_with_errors(argc, argv, run); }
