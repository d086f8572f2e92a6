// `tidal estimate`: before a model exists in memory, whether it trains on a machine (device
// memory, host memory, SSDs) at a batch and sequence length, and how fast: tidal's plan of its
// analytic trace, simulated, against the ideal and the lower bound.
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "commands.hpp"
#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"
#include "tidal/plan/order_choice.hpp"
#include "tidal/plan/policies.hpp"
#include "tidal/trace/cost_model.hpp"
#include "trace_report.hpp"
#include "trace_source.hpp"

namespace tidal::cli {
namespace {

struct EstimateArgs {
  TraceSource src;
  std::string optimizer_step = "auto";
  bool json = false;
};

// What the estimate found, in the terms it prints.
struct Estimate {
  plan::Hardware hw;
  std::string model;
  std::int64_t parameters = 0;
  std::string precision;
  std::string order = "sequential";
  plan::PolicyResult tidal;
  double ideal_seconds = 0;
  plan::StallBound bound;
  std::uint64_t host_needed = 0;  // the optimizer step's state on the host and what the plan puts
  double wall_seconds = 0;
};

std::string gib(std::uint64_t b) { return format_bytes(static_cast<double>(b)); }

// A trace made without running its ops (tidal.estimate of a module: its step on fake tensors)
// has op times of the machine that traced it: timed again for the device described, from its
// matrix products' FLOPs and its ops' bytes.
void time_for_device(LoadedSource& src) {
  for (auto& t : src.traces) {
    TIDAL_EXPECT_AS(InvalidArgument, t.meta.count("parameters") && t.meta.count("precision"),
                    "estimate --trace reads a trace with meta.parameters and meta.precision "
                    "(tidal.estimate writes them for a module's step); to replay a profiled "
                    "trace, use tidal simulate --trace");
    const bool half = t.meta.at("precision") != "fp32";
    trace::Roofline r;
    const double peak =
        half && src.hw.gpu_flops_bf16 > 0 ? src.hw.gpu_flops_bf16 : src.hw.gpu_flops;
    r.flops = peak * src.hw.matmul_efficiency;
    r.bytes_per_s = src.hw.gpu_mem_bw;
    r.element_bytes = half ? 2 : 4;
    trace::model_op_times(t, r);
    t.meta["op_durations"] = "roofline of the device described (tidal estimate --trace)";
  }
}

Estimate run_estimate(const EstimateArgs& a) {
  const auto t0 = std::chrono::steady_clock::now();
  LoadedSource src = load_trace_source(a.src);
  plan::PolicyOptions opt;
  if (!a.src.trace_path.empty()) {
    time_for_device(src);
    TIDAL_EXPECT_AS(InvalidArgument, a.optimizer_step != "host",
                    "--optimizer-step host needs the model's layers (--model or --hf-config): "
                    "a trace's optimizer step is planned on the device");
  }
  opt.optimizer_step = plan::optimizer_placement_from_string(
      a.src.trace_path.empty() ? a.optimizer_step : std::string("device"));
  Estimate e;
  e.hw = src.hw;
  const trace::Trace& first = src.traces[0];
  e.model = first.model;
  e.parameters = std::stoll(first.meta.at("parameters"));
  e.precision = first.meta.at("precision");
  e.ideal_seconds = plan::run_policy(plan::Policy::kIdeal, first, src.hw).sim.iteration_seconds;
  if (src.choose_order()) {
    const plan::OrderChoice choice = plan::choose_fastest_order(src.trace_pointers(), src.hw, opt);
    e.tidal = choice.best().tidal;
    e.order = choice.best().order;
    e.bound = choice.bound();
  } else {
    e.tidal = plan::run_policy(plan::Policy::kTidal, first, src.hw, opt, e.ideal_seconds);
    const auto it = first.meta.find("micro_batch_order");
    if (it != first.meta.end()) e.order = it->second;
    e.bound = e.tidal.bound ? *e.tidal.bound : plan::stall_lower_bound(first, src.hw);
  }
  e.tidal.fraction_of_ideal = e.ideal_seconds / e.tidal.sim.iteration_seconds;
  e.host_needed = e.tidal.sim.peak_host_bytes;
  if (e.tidal.optimizer_step == plan::OptimizerPlacement::kHost) {
    e.host_needed += 16 * static_cast<std::uint64_t>(e.parameters);
  }
  e.wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return e;
}

void print_estimate(const Estimate& e, const TraceSource& s, const plan::Hardware& hw) {
  const plan::SimResult& r = e.tidal.sim;
  if (s.trace_path.empty()) {
    std::printf("%s: %.2fB parameters, %s, batch %lld x %lld tokens in %d micro-batch%s (%s)\n",
                e.model.c_str(), static_cast<double>(e.parameters) / 1e9, e.precision.c_str(),
                static_cast<long long>(s.batch), static_cast<long long>(s.seq), s.micro_batches,
                s.micro_batches == 1 ? "" : "es", e.order.c_str());
  } else {
    std::printf("%s: %.2fB parameters, %s, its traced step (%s)\n", e.model.c_str(),
                static_cast<double>(e.parameters) / 1e9, e.precision.c_str(), s.trace_path.c_str());
  }
  std::printf("on %s: %s\n", hw.name.c_str(), hw.describe().c_str());
  if (e.tidal.fits) {
    std::printf("fits: yes, planned peak %s of %s device memory; host memory %s, SSD space %s\n",
                gib(r.peak_bytes).c_str(), gib(hw.device_memory).c_str(),
                gib(e.host_needed).c_str(), gib(r.peak_ssd_bytes).c_str());
  } else {
    std::printf("fits: NO: %s\n", e.tidal.note.c_str());
  }
  std::printf("step: %s planned, ideal %s (%s of ideal); no plan of this kind beats %s (%s)\n",
              format_seconds(r.iteration_seconds).c_str(), format_seconds(e.ideal_seconds).c_str(),
              pct(e.tidal.fraction_of_ideal).c_str(),
              format_seconds(e.bound.iteration_seconds).c_str(),
              pct(e.ideal_seconds / e.bound.iteration_seconds).c_str());
  std::printf("moves a step: %s to host memory and %s back, %s to the SSDs and %s back\n",
              gib(r.host_bytes_written).c_str(), gib(r.host_bytes_read).c_str(),
              gib(r.ssd_bytes_written).c_str(), gib(r.ssd_bytes_read).c_str());
  std::printf("optimizer step: on the %s; plan: %s\n", plan::to_string(e.tidal.optimizer_step),
              e.tidal.note.c_str());
  std::printf(
      "to train it: tidal.Session(model=model, optimizer=optimizer, budget=\"%s\", "
      "host_memory=\"%s\"%s)\n",
      gib(hw.device_memory).c_str(), gib(e.host_needed).c_str(),
      e.tidal.optimizer_step == plan::OptimizerPlacement::kHost ? ", optimizer_step=\"host\"" : "");
  std::printf("estimated in %s\n", format_seconds(e.wall_seconds).c_str());
}

void print_estimate_json(const Estimate& e, const TraceSource& s, const plan::Hardware& hw) {
  const plan::SimResult& r = e.tidal.sim;
  nlohmann::json j = {{"model", e.model},
                      {"parameters", e.parameters},
                      {"precision", e.precision},
                      {"batch", s.batch},
                      {"seq", s.seq},
                      {"micro_batches", s.micro_batches},
                      {"micro_batch_order", e.order},
                      {"hardware", hw.name},
                      {"device_memory", hw.device_memory},
                      {"fits", e.tidal.fits},
                      {"planned_peak_bytes", r.peak_bytes},
                      {"step_seconds", r.iteration_seconds},
                      {"ideal_seconds", e.ideal_seconds},
                      {"fraction_of_ideal", e.tidal.fraction_of_ideal},
                      {"lower_bound_seconds", e.bound.iteration_seconds},
                      {"optimizer_step", plan::to_string(e.tidal.optimizer_step)},
                      {"host_bytes_written", r.host_bytes_written},
                      {"host_bytes_read", r.host_bytes_read},
                      {"ssd_bytes_written", r.ssd_bytes_written},
                      {"ssd_bytes_read", r.ssd_bytes_read},
                      {"host_memory_needed", e.host_needed},
                      {"ssd_space_needed", r.peak_ssd_bytes},
                      {"note", e.tidal.note},
                      {"estimate_seconds", e.wall_seconds}};
  std::printf("%s\n", j.dump().c_str());
}

}  // namespace

void add_estimate_command(CLI::App& app) {
  auto args = std::make_shared<EstimateArgs>();
  auto* cmd = app.add_subcommand(
      "estimate",
      "Before a run: does a model train on this machine at this batch, and how fast "
      "(tidal's plan of its analytic trace, or of a module's step traced on fake tensors "
      "(--trace from tidal.estimate), simulated; nothing is allocated)");
  add_trace_source_options(cmd, args->src);
  cmd->add_option("--optimizer-step", args->optimizer_step,
                  "where the optimizer step runs: device, host, or auto (both planned, the "
                  "faster kept)")
      ->check(CLI::IsMember({"device", "host", "auto"}))
      ->capture_default_str();
  cmd->add_flag("--json", args->json, "print one JSON object instead of the summary");
  cmd->callback([args] {
    const Estimate e = run_estimate(*args);
    if (args->json) {
      print_estimate_json(e, args->src, e.hw);
    } else {
      print_estimate(e, args->src, e.hw);
    }
    std::fflush(stdout);
    TIDAL_EXPECT_AS(InvalidArgument, e.tidal.fits, "no plan fits ", e.model, " at --batch ",
                    args->src.batch, " x --seq ", args->src.seq,
                    " on this machine: give a smaller --batch or --seq, more --micro-batches, "
                    "or more memory (--gpu-mem, --host-mem)");
  });
}

}  // namespace tidal::cli
