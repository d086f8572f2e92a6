// `tidal train`: trains a reference model and reports losses, step times and peak memory.
#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>

#include "commands.hpp"
#include "model_options.hpp"
#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"
#include "tidal/models/trainer.hpp"
#include "tidal/torch/memory.hpp"

namespace tidal::cli {
namespace {

struct TrainArgs {
  ModelArgs model;
  bool json = false;
};

void run_train(const TrainArgs& args) {
  TIDAL_EXPECT_AS(InvalidArgument, args.model.steps >= 1, "--steps must be at least 1");
  auto options = to_trainer_options(args.model);
  torch_layer::MemoryMeter meter(options.device);  // installs the CPU meter before any tensor
  meter.reset_peak();
  models::Trainer trainer(options);
  const auto& c = options.config;
  std::fprintf(stderr, "tidal train: %s (%.1fM parameters) batch %lld seq %lld on %s\n",
               c.name.c_str(), static_cast<double>(c.parameter_count()) / 1e6,
               static_cast<long long>(options.batch), static_cast<long long>(options.seq),
               options.device.str().c_str());

  ProgressBar bar(args.model.steps);
  std::vector<double> losses;
  std::vector<double> seconds;
  const double tokens_per_step = static_cast<double>(options.batch * options.seq);
  for (std::int64_t i = 0; i < args.model.steps; ++i) {
    const auto r = trainer.step();
    losses.push_back(r.loss);
    seconds.push_back(r.seconds);
    char text[128];
    std::snprintf(text, sizeof(text), "loss %.4f  %.0f tok/s", r.loss, tokens_per_step / r.seconds);
    bar.update(i + 1, text);
  }
  const double total = std::accumulate(seconds.begin(), seconds.end(), 0.0);
  const auto mem = meter.stats();
  const double tps = tokens_per_step * static_cast<double>(seconds.size()) / total;
  std::fprintf(stderr, "final loss %.4f, %.0f tokens/s, peak tensor memory %s\n", losses.back(),
               tps, format_bytes(static_cast<double>(mem.peak_bytes)).c_str());
  if (args.json) {
    nlohmann::json j;
    j["model"] = c.name;
    j["parameters"] = c.parameter_count();
    j["device"] = options.device.str();
    j["batch"] = options.batch;
    j["seq"] = options.seq;
    j["seed"] = options.seed;
    j["losses"] = losses;
    j["step_seconds"] = seconds;
    j["peak_bytes"] = mem.peak_bytes;
    j["tokens_per_second"] = tps;
    std::cout << j.dump() << std::endl;
  }
}

}  // namespace

void add_train_command(CLI::App& app) {
  auto args = std::make_shared<TrainArgs>();
  auto* cmd = app.add_subcommand("train", "train a reference GPT-2 / Llama model");
  add_model_options(cmd, args->model);
  cmd->add_flag("--json", args->json, "print one JSON object with the results as the last line");
  cmd->callback([args] { run_train(*args); });
}

}  // namespace tidal::cli
