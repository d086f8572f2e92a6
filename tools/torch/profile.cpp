// `tidal profile`: one warm-up step, a few unprofiled steps for comparison, then N profiled steps;
// writes the trace (and a Chrome trace) and prints the lifetime summary.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "commands.hpp"
#include "model_options.hpp"
#include "progress.hpp"
#include "tidal/common/error.hpp"
#include "tidal/common/stats.hpp"
#include "tidal/common/units.hpp"
#include "tidal/models/trainer.hpp"
#include "tidal/torch/memory.hpp"
#include "tidal/torch/tracer.hpp"
#include "tidal/trace/io.hpp"
#include "tidal/trace/lifetime.hpp"

namespace tidal::cli {
namespace {

struct ProfileArgs {
  ModelArgs model;
  std::string out;
  std::string chrome;
  std::int64_t baseline_steps = -1;  // -1: as many as --steps
};

void print_summary(const trace::Trace& t, const trace::LifetimeAnalysis& a) {
  std::uint64_t bytes_by_class[6] = {};
  std::int64_t count_by_class[6] = {};
  for (const auto& x : t.tensors) {
    bytes_by_class[static_cast<int>(x.cls)] += x.bytes;
    ++count_by_class[static_cast<int>(x.cls)];
  }
  std::int64_t ops_by_phase[4] = {};
  for (const auto& op : t.ops) ++ops_by_phase[static_cast<int>(op.phase)];
  std::printf(
      "\nTrace: %s, batch %lld, seq %lld, %s: %zu ops (forward %lld, backward %lld, "
      "optimizer %lld), %zu tensors, compute %s\n",
      t.model.c_str(), static_cast<long long>(t.batch), static_cast<long long>(t.seq),
      t.device.c_str(), t.ops.size(), static_cast<long long>(ops_by_phase[0]),
      static_cast<long long>(ops_by_phase[1]), static_cast<long long>(ops_by_phase[2]),
      t.tensors.size(), format_seconds(t.compute_seconds()).c_str());
  std::printf("\n%-16s %8s %12s\n", "tensor class", "count", "bytes");
  for (int c = 0; c < 6; ++c) {
    std::printf("%-16s %8lld %12s\n", trace::to_string(static_cast<trace::TensorClass>(c)),
                static_cast<long long>(count_by_class[c]),
                format_bytes(static_cast<double>(bytes_by_class[c])).c_str());
  }
  const auto& s = a.summary;
  const auto& peak_op = t.ops.at(static_cast<std::size_t>(s.peak_live_op));
  std::printf("\npeak live bytes      %s (at op %d, %s, %s)\n",
              format_bytes(static_cast<double>(s.peak_live_bytes)).c_str(), s.peak_live_op,
              peak_op.name.c_str(), trace::to_string(peak_op.phase));
  std::printf("peak active bytes    %s\n",
              format_bytes(static_cast<double>(s.peak_active_bytes)).c_str());
  std::printf("mean active/live     %.2f%%\n", 100.0 * s.mean_active_ratio);
  std::printf("\ninactive periods by tensor size\n%-20s %9s %12s %12s %12s\n", "size class",
              "periods", "mean idle", "median idle", "bytes");
  for (const auto& c : s.size_classes) {
    std::string label =
        format_bytes(static_cast<double>(c.min_bytes)) + " - " +
        (c.max_bytes == UINT64_MAX ? std::string("")
                                   : format_bytes(static_cast<double>(c.max_bytes)));
    std::printf("%-20s %9lld %12s %12s %12s\n", label.c_str(), static_cast<long long>(c.periods),
                format_seconds(c.mean_idle_seconds).c_str(),
                format_seconds(c.median_idle_seconds).c_str(),
                format_bytes(static_cast<double>(c.total_bytes)).c_str());
  }
}

void run_profile(const ProfileArgs& args) {
  TIDAL_EXPECT_AS(InvalidArgument, args.model.steps >= 1, "--steps must be at least 1");
  TIDAL_EXPECT_AS(InvalidArgument, !args.out.empty(), "--out TRACE.json is required");
  auto options = to_trainer_options(args.model);
  torch_layer::MemoryMeter meter(options.device);
  models::Trainer trainer(options);
  const auto& c = options.config;
  std::fprintf(stderr, "tidal profile: %s (%.1fM parameters) batch %lld seq %lld on %s\n",
               c.name.c_str(), static_cast<double>(c.parameter_count()) / 1e6,
               static_cast<long long>(options.batch), static_cast<long long>(options.seq),
               options.device.str().c_str());

  const auto warm = trainer.step();
  std::fprintf(stderr, "warm-up step: loss %.4f, %s\n", warm.loss,
               format_seconds(warm.seconds).c_str());
  const std::int64_t baseline_steps =
      args.baseline_steps < 0 ? args.model.steps : args.baseline_steps;
  std::vector<double> plain_seconds;
  Progress plain_bar("steps", baseline_steps, Progress::Style::kBar);
  for (std::int64_t i = 0; i < baseline_steps; ++i) {
    const auto r = trainer.step();
    plain_seconds.push_back(r.seconds);
    plain_bar.update(i + 1, "unprofiled, " + format_seconds(r.seconds));
  }

  torch_layer::Tracer::Options to{c.name, options.batch, options.seq};
  to.device = options.device;  // the trace holds this device's tensors
  torch_layer::Tracer tracer(to);
  trainer.register_persistent(tracer);
  tracer.start();
  trainer.add_observer(&tracer);
  meter.reset_peak();
  std::vector<double> traced_seconds;
  Progress bar("steps", args.model.steps, Progress::Style::kBar);
  for (std::int64_t i = 0; i < args.model.steps; ++i) {
    const auto r = trainer.step();
    traced_seconds.push_back(r.seconds);
    bar.update(i + 1,
               "profiled, loss " + std::to_string(r.loss) + ", " + format_seconds(r.seconds));
  }
  trainer.remove_observer(&tracer);
  tracer.stop();

  auto result = tracer.result();
  if (!result.consistent) {
    std::fprintf(stderr, "tidal profile: warning: %s; the trace is the last iteration\n",
                 result.divergence.c_str());
  }
  auto& t = result.trace;
  t.meta["tool"] = "tidal profile";
  t.meta["optimizer_schedule"] = schedule_name(options);
  t.meta["peak_bytes_meter"] = std::to_string(meter.peak_bytes());
  t.meta["step_seconds_unprofiled_median"] = std::to_string(median(plain_seconds));
  t.meta["step_seconds_profiled_median"] = std::to_string(median(traced_seconds));
  const auto analysis = trace::analyze_lifetimes(t);
  trace::write_trace(t, args.out);
  if (!args.chrome.empty()) trace::write_chrome_trace(t, analysis, args.chrome);

  print_summary(t, analysis);
  if (plain_seconds.empty()) {
    std::printf("\nstep time            profiled %s (median of %zu; no unprofiled steps timed)",
                format_seconds(median(traced_seconds)).c_str(), traced_seconds.size());
  } else {
    std::printf(
        "\nstep time            unprofiled %s, profiled %s (median of %zu and %zu): "
        "tracer slowdown x%.3f",
        format_seconds(median(plain_seconds)).c_str(),
        format_seconds(median(traced_seconds)).c_str(), plain_seconds.size(), traced_seconds.size(),
        median(traced_seconds) / median(plain_seconds));
  }
  std::printf("\npeak tensor memory   %s (memory meter, profiled steps)\n",
              format_bytes(static_cast<double>(meter.peak_bytes())).c_str());
  std::printf("wrote %s%s%s\n", args.out.c_str(), args.chrome.empty() ? "" : " and ",
              args.chrome.c_str());
}

}  // namespace

void add_profile_command(CLI::App& app) {
  auto args = std::make_shared<ProfileArgs>();
  auto* cmd = app.add_subcommand("profile",
                                 "profile tensor lifetimes of training steps and write the trace");
  add_model_options(cmd, args->model);
  cmd->add_option("--out", args->out, "trace file (JSON, docs/trace-format.md)")->required();
  cmd->add_option("--chrome", args->chrome, "also write a Chrome trace (Perfetto) here");
  cmd->add_option("--baseline-steps", args->baseline_steps,
                  "unprofiled steps timed for the slowdown ratio (default: --steps)");
  cmd->callback([args] { run_profile(*args); });
}

}  // namespace tidal::cli
