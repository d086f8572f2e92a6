// `tidal plan`: make an offloading plan for a trace on a hardware model.
#include <unistd.h>

#include <cstdio>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"
#include "tidal/plan/hardware.hpp"
#include "tidal/plan/model_trace.hpp"
#include "tidal/plan/planner.hpp"
#include "tidal/plan/simulator.hpp"
#include "tidal/trace/io.hpp"

namespace tidal::cli {
namespace {

struct PlanArgs {
  std::string trace_path;
  std::string model;
  std::int64_t batch = 0;
  std::int64_t seq = 0;
  plan::ModelOverrides shape;
  bool optimizer_in_backward = false;
  std::string hardware = "h100-4ssd";
  plan::HardwareOverrides hw;
  std::string out;
  std::string min_bytes;
  bool no_host = false;
  bool no_stalls = false;
  bool json = false;
};

void run_plan(const PlanArgs& a) {
  plan::Hardware hw = plan::hardware_preset(a.hardware);
  plan::apply_overrides(hw, a.hw);
  trace::Trace tr;
  if (!a.trace_path.empty()) {
    TIDAL_EXPECT_AS(InvalidArgument, a.model.empty(), "give either --trace or --model, not both");
    TIDAL_EXPECT_AS(InvalidArgument, !a.optimizer_in_backward,
                    "--optimizer-in-backward builds an analytic trace (--model); a profiled trace "
                    "has the schedule its training loop ran");
    tr = trace::read_trace(a.trace_path);
  } else {
    TIDAL_EXPECT_AS(InvalidArgument, !a.model.empty() && a.batch > 0 && a.seq > 0,
                    "give a trace (--trace T.json) or a model with --batch and --seq");
    plan::TransformerConfig cfg = plan::model_preset(a.model);
    plan::apply_overrides(cfg, a.shape);
    plan::AnalyticTraceOptions topt;
    topt.optimizer_in_backward = a.optimizer_in_backward;
    tr = plan::transformer_trace(cfg, a.batch, a.seq, hw, topt);
  }
  plan::PlannerOptions opt;
  opt.use_host = !a.no_host;
  opt.allow_stalls = !a.no_stalls;
  if (!a.min_bytes.empty()) opt.min_bytes = parse_bytes(a.min_bytes);
  if (isatty(2) != 0) {
    opt.progress = [](double f) {
      std::fprintf(stderr, "\rplanning: %3.0f%%", 100 * f);
      if (f >= 1) std::fprintf(stderr, "\r               \r");
    };
  }
  const plan::Plan p = plan::make_plan(tr, hw, opt);
  const plan::SimResult sim = plan::simulate(tr, &p, hw);
  const plan::PlanSummary& s = p.summary;
  const double cap = static_cast<double>(hw.device_memory);
  auto gb = [](std::uint64_t b) { return format_bytes(static_cast<double>(b)); };
  std::printf("plan for %s (batch %lld, seq %lld): %zu ops, %zu tensors\n", tr.model.c_str(),
              static_cast<long long>(tr.batch), static_cast<long long>(tr.seq), tr.ops.size(),
              tr.tensors.size());
  if (const auto it = tr.meta.find("optimizer_schedule"); it != tr.meta.end())
    std::printf("optimizer step: %s\n", it->second.c_str());
  std::printf("hardware %s: %s\n", hw.name.c_str(), hw.describe().c_str());
  std::printf("  peak with everything kept  %s (%.0f%% of device memory)\n",
              gb(s.peak_before_bytes).c_str(),
              100.0 * static_cast<double>(s.peak_before_bytes) / cap);
  std::printf("  planned peak               %s at op %d (target %s)\n",
              gb(s.peak_after_bytes).c_str(), s.peak_after_op, gb(s.target_bytes).c_str());
  std::printf("  inactive periods           %lld considered\n",
              static_cast<long long>(s.candidates));
  std::printf("  offloads to SSD            %lld, %s per iteration\n",
              static_cast<long long>(s.offloads_ssd), gb(s.bytes_to_ssd).c_str());
  std::printf("  offloads to host memory    %lld, %s per iteration, %s at once\n",
              static_cast<long long>(s.offloads_host), gb(s.bytes_to_host).c_str(),
              gb(s.peak_host_bytes).c_str());
  std::printf("  planned stall              %s over %zu ops\n",
              format_seconds(s.planned_stall_seconds).c_str(), p.stalls.size());
  std::printf("  planning time              %s\n", format_seconds(s.planning_seconds).c_str());
  std::printf("  simulated                  iteration %s (compute %s, stall %s), peak %s, %s\n",
              format_seconds(sim.iteration_seconds).c_str(),
              format_seconds(sim.compute_seconds).c_str(),
              format_seconds(sim.stall_seconds).c_str(), gb(sim.peak_bytes).c_str(),
              sim.fits ? "fits" : "DOES NOT FIT");
  if (!a.out.empty()) {
    plan::write_plan(p, a.out);
    std::printf("  wrote %zu actions to %s\n", p.actions.size(), a.out.c_str());
  }
  if (a.json) {
    nlohmann::json j = nlohmann::json::parse(plan::plan_to_json(p))["summary"];
    j["model"] = tr.model;
    if (const auto it = tr.meta.find("optimizer_schedule"); it != tr.meta.end())
      j["optimizer_schedule"] = it->second;
    j["actions"] = p.actions.size();
    j["simulated_iteration_seconds"] = sim.iteration_seconds;
    j["simulated_peak_bytes"] = sim.peak_bytes;
    j["simulated_fits"] = sim.fits;
    std::printf("%s\n", j.dump().c_str());
  }
}

}  // namespace

void add_plan_command(CLI::App& app) {
  auto args = std::make_shared<PlanArgs>();
  auto* cmd = app.add_subcommand("plan", "Make a lifetime-aware offloading plan for a trace");
  cmd->add_option("--trace", args->trace_path, "trace JSON from `tidal profile`");
  cmd->add_option("--model", args->model, "or an analytic trace: llama3-8b, gpt2-xl, ...");
  cmd->add_option("--batch", args->batch, "batch size (with --model)");
  cmd->add_option("--seq", args->seq, "sequence length (with --model)");
  cmd->add_flag("--optimizer-in-backward", args->optimizer_in_backward,
                "with --model: run each parameter's AdamW update right after its gradient is "
                "complete in backward (PyTorch's optimizer-in-backward) instead of after backward");
  cmd->add_option("--layers", args->shape.layers, "override the number of blocks");
  cmd->add_option("--hidden", args->shape.hidden, "override the hidden size");
  cmd->add_option("--heads", args->shape.heads, "override the attention heads");
  cmd->add_option("--kv-heads", args->shape.kv_heads, "override the key/value heads");
  cmd->add_option("--ffn", args->shape.ffn, "override the MLP width");
  cmd->add_option("--vocab", args->shape.vocab, "override the vocabulary size");
  cmd->add_option("--hardware", args->hardware, "h100-4ssd|a100-2ssd|cpu-here")
      ->capture_default_str();
  cmd->add_option("--gpu-mem", args->hw.gpu_mem, "device memory, e.g. 80GiB");
  cmd->add_option("--ssd", args->hw.ssd, "SSD array, e.g. 4x6.5/6.7GB/s (count x write/read)");
  cmd->add_option("--host-mem", args->hw.host_mem,
                  "host memory for offloaded tensors, e.g. 256GiB");
  cmd->add_option("--host-link", args->hw.host_link, "device-host link per direction, e.g. 55GB/s");
  cmd->add_option("--gpu-flops", args->hw.gpu_flops, "peak matmul FLOP/s, e.g. 60T");
  cmd->add_option("--gpu-mem-bw", args->hw.gpu_mem_bw, "device memory bandwidth, e.g. 3.9TB/s");
  cmd->add_option("--cpu-adam", args->hw.cpu_adam, "CPU Adam parameters/s, e.g. 2G");
  cmd->add_option("--tbw", args->hw.ssd_tbw, "SSD endurance per drive, e.g. 1200TB");
  cmd->add_option("--margin", args->hw.margin, "share of device memory kept free (0.01)");
  cmd->add_option("--min-bytes", args->min_bytes, "tensors smaller than this stay, e.g. 1MiB");
  cmd->add_flag("--no-host", args->no_host, "never use host memory as a destination");
  cmd->add_flag("--no-stalls", args->no_stalls,
                "do not accept planned stalls (the plan may then not fit)");
  cmd->add_option("--out", args->out, "write the plan JSON here");
  cmd->add_flag("--json", args->json, "print the summary as one JSON line at the end");
  cmd->callback([args] { run_plan(*args); });
}

}  // namespace tidal::cli
