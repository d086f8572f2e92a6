// Flags shared by `tidal train` and `tidal profile`: which model, its shape, the data and the
// optimizer.
#pragma once

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

#include "tidal/common/error.hpp"
#include "tidal/models/gpt.hpp"
#include "tidal/models/trainer.hpp"
#include "tidal/torch/build_info.hpp"

namespace tidal::cli {

struct ModelArgs {
  std::string model = "gpt-tiny";
  std::int64_t batch = 8;
  std::int64_t seq = 128;
  std::int64_t steps = 10;
  std::uint64_t seed = 1234;
  std::string data;
  double lr = 3e-4;
  std::int64_t layers = 0;
  std::int64_t hidden = 0;
  std::int64_t heads = 0;
  std::string device = "auto";
  bool optimizer_in_backward = false;
  bool optimizer_deferred = false;
  double clip_grad_norm = 0;
  std::int64_t micro_batches = 1;
  std::string micro_batch_order = "sequential";
  std::string optimizer_step = "device";
};

inline void add_model_options(CLI::App* cmd, ModelArgs& a) {
  std::string names;
  for (const auto& n : models::model_names()) names += (names.empty() ? "" : ", ") + n;
  cmd->add_option("--model", a.model, "model config: " + names)->capture_default_str();
  cmd->add_option("--batch", a.batch, "sequences per step")->capture_default_str();
  cmd->add_option("--seq", a.seq, "tokens per sequence")->capture_default_str();
  cmd->add_option("--steps", a.steps, "training steps")->capture_default_str();
  cmd->add_option("--seed", a.seed, "seed of weights and data")->capture_default_str();
  cmd->add_option("--data", a.data, "train on this text file (byte-level tokens)");
  cmd->add_option("--lr", a.lr, "AdamW learning rate")->capture_default_str();
  cmd->add_option("--layers", a.layers, "override the config's number of blocks");
  cmd->add_option("--hidden", a.hidden, "override the config's hidden size");
  cmd->add_option("--heads", a.heads, "override the config's attention heads");
  cmd->add_option("--device", a.device, "auto, cpu or cuda[:N]")->capture_default_str();
  auto* in_backward =
      cmd->add_flag("--optimizer-in-backward", a.optimizer_in_backward,
                    "update each parameter as soon as backward completes its gradient (same math; "
                    "lets offloading hide the optimizer step; not with global-norm clipping)");
  cmd->add_flag("--optimizer-deferred", a.optimizer_deferred,
                "update each parameter right before its first use in the next forward pass (same "
                "math; hides the optimizer step like --optimizer-in-backward, and allows "
                "--clip-grad-norm)")
      ->excludes(in_backward);
  cmd->add_option("--clip-grad-norm", a.clip_grad_norm,
                  "clip gradients to this global L2 norm (0: off)")
      ->capture_default_str();
  cmd->add_option("--micro-batches", a.micro_batches,
                  "cut each step's batch into this many micro-batches (gradient accumulation; "
                  "must divide --batch)")
      ->capture_default_str();
  cmd->add_option("--micro-batch-order", a.micro_batch_order,
                  "sequential (each micro-batch's forward and backward in turn) or layer-major "
                  "(every micro-batch through a layer before the next: offloading brings each "
                  "layer's weights in once for all of them)")
      ->check(CLI::IsMember({"sequential", "layer-major"}))
      ->capture_default_str();
  cmd->add_option("--optimizer-step", a.optimizer_step,
                  "device, or host: AdamW updates host copies of the parameters, with its state "
                  "and the gradients in host memory (outside the budget), and writes each "
                  "parameter back (same math)")
      ->check(CLI::IsMember({"device", "host"}))
      ->capture_default_str();
}

/// The optimizer schedule the flags ask for, as traces and reports name it.
inline const char* schedule_name(const models::TrainerOptions& o) { return to_string(o.optimizer); }

inline models::TrainerOptions to_trainer_options(const ModelArgs& a) {
  models::TrainerOptions o;
  o.config = models::with_overrides(models::model_config(a.model), a.layers, a.hidden, a.heads);
  o.batch = a.batch;
  o.seq = a.seq;
  o.seed = a.seed;
  o.data_path = a.data;
  TIDAL_EXPECT_AS(InvalidArgument, std::isfinite(a.lr) && a.lr > 0, "--lr ", a.lr,
                  " is not a learning rate: give a number above 0, e.g. 3e-4");
  o.adamw.lr = a.lr;
  o.adamw.on_host = a.optimizer_step == "host";
  o.optimizer = optimizer_schedule(a.optimizer_in_backward, a.optimizer_deferred);
  o.clip_grad_norm = a.clip_grad_norm;
  o.micro_batches = a.micro_batches;
  o.micro_batch_order = plan::micro_batch_order_from_string(a.micro_batch_order);
  if (a.device == "auto") {
    o.device =
        torch_layer::cuda_available() ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  } else {
    try {
      o.device = torch::Device(a.device);
    } catch (const c10::Error&) {
      TIDAL_EXPECT_AS(InvalidArgument, false, "--device ", a.device,
                      " is not a device: use auto, cpu or cuda[:N]");
    }
    TIDAL_EXPECT_AS(InvalidArgument, !o.device.is_cuda() || torch_layer::cuda_available(),
                    "--device ", a.device,
                    ": this libtorch has no CUDA or no GPU is visible; use --device cpu (or auto)");
  }
  return o;
}

}  // namespace tidal::cli
