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

#include "tidal/torch/memory.hpp"
#include "tidal/torch/session.hpp"

namespace {

int run(int argc, char** argv) {
  std::string mode = "activations";
  std::string dir = "/var/tmp/tidal";
  int steps = 10;
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

  torch::manual_seed(0);

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
  // Before the model, so that every tensor of the run is allocated while tidal is watching.
  tidal::torch_layer::Session session(options);
  tidal::torch_layer::MemoryMeter meter(torch::kCPU);

  auto model = torch::nn::Sequential(torch::nn::Linear(512, 2048), torch::nn::GELU(),
                                     torch::nn::Linear(2048, 512));
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));

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
    auto x = torch::randn({1024, 512});
    meter.reset_peak();
    const auto t0 = std::chrono::steady_clock::now();
    session.begin_step();
    optimizer.zero_grad();
    auto loss = (model->forward(x) - x).pow(2).mean();
    loss.backward();
    optimizer.step();
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
    std::printf("step %d loss %a\n", step, loss.item<double>());
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
