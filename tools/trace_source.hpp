// Flags shared by `tidal plan` and `tidal simulate`: where the trace comes from (a profiled file
// or an analytic transformer) and the hardware model it runs on.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "hardware_flags.hpp"
#include "store_flags.hpp"
#include "tidal/common/error.hpp"
#include "tidal/common/text.hpp"
#include "tidal/common/units.hpp"
#include "tidal/io/measure.hpp"
#include "tidal/plan/hardware.hpp"
#include "tidal/plan/hf_config.hpp"
#include "tidal/plan/model_trace.hpp"
#include "tidal/trace/io.hpp"

namespace tidal::cli {

struct TraceSource {
  std::string trace_path;
  std::string model;
  std::string hf_config;  ///< a Hugging Face config.json instead of --model
  std::int64_t batch = 0;
  std::int64_t seq = 0;
  plan::ModelOverrides shape;
  bool optimizer_in_backward = false;
  bool optimizer_deferred = false;
  int micro_batches = 1;
  /// "sequential", "layer-major" or "auto" (both, planned; the faster kept); empty: not given
  /// (sequential, or layer-major with --layer-major).
  std::string micro_batch_order;
  bool layer_major = false;  ///< --layer-major: --micro-batch-order layer-major
  int data_parallel = 1;
  int tensor_parallel = 1;
  std::string precision;  ///< empty: fp32, or with --hf-config what its torch_dtype says
  std::string hardware = "h100-4ssd";
  HardwareFlags hw;
  std::optional<std::string> measure_dirs;  ///< measure these store directories (SSD figures)
  std::string io_compute_cost;  ///< "<write>/<read>/<host>" ns of compute per byte moved
};

/// Sets Hardware::compute_seconds_per_byte from "<ssd write>/<ssd read>/<host copy>", each in
/// nanoseconds of compute per byte (what `tidal train` measures on cpu-here and prints in its
/// plan summary). Throws tidal::InvalidArgument naming the flag otherwise.
inline void apply_io_compute_cost(plan::Hardware& hw, const std::string& text) {
  std::vector<double> ns;
  std::stringstream in(text);
  for (std::string part; std::getline(in, part, '/');) {
    try {
      std::size_t used = 0;
      ns.push_back(std::stod(part, &used));
      if (used != part.size()) ns.clear();
    } catch (const std::exception&) {
      ns.clear();
    }
    if (ns.empty() || ns.back() < 0 || ns.back() > 1e6) break;
  }
  TIDAL_EXPECT_AS(InvalidArgument, ns.size() == 3 && ns.back() >= 0 && ns.back() <= 1e6,
                  "--io-compute-cost '", text,
                  "': give three figures in ns per byte, SSD write/SSD read/host copy, e.g. "
                  "0.6/0.5/0.2");
  hw.compute_seconds_per_byte[plan::index_of(plan::Channel::kSsdWrite)] = ns[0] * 1e-9;
  hw.compute_seconds_per_byte[plan::index_of(plan::Channel::kSsdRead)] = ns[1] * 1e-9;
  hw.compute_seconds_per_byte[plan::index_of(plan::Channel::kHostWrite)] = ns[2] * 1e-9;
  hw.compute_seconds_per_byte[plan::index_of(plan::Channel::kHostRead)] = ns[2] * 1e-9;
}

/// Memory this machine can give now (MemAvailable), or 0 when unknown.
inline std::uint64_t available_memory() {
  std::FILE* f = std::fopen("/proc/meminfo", "r");
  if (f == nullptr) return 0;
  char line[256];
  unsigned long long kib = 0;
  while (std::fgets(line, sizeof line, f) != nullptr) {
    if (std::sscanf(line, "MemAvailable: %llu kB", &kib) == 1) break;
  }
  std::fclose(f);
  return static_cast<std::uint64_t>(kib) * 1024;
}

/// Refuses an analytic trace too large to hold and plan here, before it is built (a million
/// layers ended in std::bad_alloc after minutes), and says when planning it will take long.
/// The figure per op and tensor is what `tidal plan` held at its peak for Llama3-8B with 200 to
/// 800 layers (about 0.9 KiB: the trace, its lifetimes, the planner's trees, the plan).
inline void check_trace_fits(const plan::AnalyticTraceSize& size,
                             const plan::TransformerConfig& cfg) {
  constexpr double kBytesPerItem = 1024;
  const double need = kBytesPerItem * static_cast<double>(size.ops + size.tensors);
  const std::uint64_t avail = available_memory();
  TIDAL_EXPECT_AS(
      InvalidArgument, avail == 0 || need <= static_cast<double>(avail), "--layers ", cfg.layers,
      ": the trace of ", cfg.name, " would have ", size.ops, " ops and ", size.tensors,
      " tensors; planning it needs about ", format_bytes(need), " of memory, more than the ",
      format_bytes(static_cast<double>(avail)),
      " available here: give fewer layers (--layers; about ",
      static_cast<long long>(static_cast<double>(cfg.layers) * static_cast<double>(avail) / need),
      " fit) or run on a machine with more memory");
  // Planning grows faster than the ops (about as their 1.6th power: 6 s for 96,000 ops, 4.5
  // minutes for 960,000 on one core of the 2-core VM, issue 27): say so before a long wait,
  // with the way out.
  if (size.ops > 200000) {
    std::fprintf(stderr,
                 "note: %lld ops; planning time grows faster than the ops (about 4.5 minutes for "
                 "a million on one core), so this may take long (progress shows on a terminal; "
                 "Ctrl-C stops it)\n",
                 static_cast<long long>(size.ops));
  }
}

inline void add_trace_source_options(CLI::App* cmd, TraceSource& s) {
  cmd->add_option("--trace", s.trace_path, "trace JSON from `tidal profile`");
  std::string models;
  for (const auto& n : plan::model_preset_names()) models += (models.empty() ? "" : "|") + n;
  cmd->add_option("--model", s.model, "or an analytic trace of a transformer: " + models);
  cmd->add_option("--hf-config", s.hf_config,
                  "or an analytic trace of the decoder a Hugging Face config.json describes "
                  "(llama, mistral, qwen2, mixtral, qwen2_moe, gpt2; nothing is downloaded)")
      ->check(CLI::ExistingFile);
  cmd->add_option("--batch", s.batch, "batch size (with --model)");
  cmd->add_option("--seq", s.seq, "sequence length (with --model)");
  auto* in_backward = cmd->add_flag(
      "--optimizer-in-backward", s.optimizer_in_backward,
      "with --model: run each parameter's AdamW update right after its gradient is "
      "complete in backward (PyTorch's optimizer-in-backward) instead of after backward");
  cmd->add_flag("--optimizer-deferred", s.optimizer_deferred,
                "with --model: run each parameter's AdamW update right before its first use in "
                "the next forward pass (works with global-norm clipping)")
      ->excludes(in_backward);
  cmd->add_option("--micro-batches", s.micro_batches,
                  "with --model: split the batch into this many micro-batches, each with its own "
                  "forward and backward pass, accumulating gradients; one optimizer step after "
                  "the last (gradient accumulation)")
      ->capture_default_str();
  cmd->add_option("--micro-batch-order", s.micro_batch_order,
                  "with --model and --micro-batches: sequential (the default: each micro-batch's "
                  "forward and backward in turn, as training loops run them), layer-major (every "
                  "micro-batch through a layer before the next layer, in forward and backward: "
                  "GreedySnake's vertical order; each layer's weights read once per pass, every "
                  "micro-batch's activations alive at once), or auto (tidal plans and simulates "
                  "both and keeps the faster; the lower bound is then the lower of the two "
                  "orders' bounds)")
      ->check(CLI::IsMember({"sequential", "layer-major", "auto"}));
  cmd->add_flag("--layer-major", s.layer_major, "the same as --micro-batch-order layer-major");
  cmd->add_option("--data-parallel", s.data_parallel,
                  "with --model: data parallelism over this many GPUs; --batch is the global "
                  "batch, split over them, and the gradients are all-reduced on the GPU link "
                  "(--gpu-link) after the last micro-batch; the trace is one GPU's")
      ->capture_default_str();
  cmd->add_option("--tensor-parallel", s.tensor_parallel,
                  "with --model: tensor parallelism over this many GPUs (Megatron-LM's split of "
                  "the attention, MLP and vocabulary; all-reduces of activations on the GPU "
                  "link); the trace is one GPU's")
      ->capture_default_str();
  cmd->add_option("--precision", s.precision,
                  "with --model: fp32 (the paper; the default), bf16-mixed (bf16 activations and "
                  "matmuls, fp32 weights, gradients and Adam states: TorchTitan's default) or bf16 "
                  "(everything); with --hf-config the default is what its torch_dtype says "
                  "(bfloat16 or float16: bf16-mixed)");
  cmd->add_option("--layers", s.shape.layers, "override the number of blocks");
  cmd->add_option("--hidden", s.shape.hidden, "override the hidden size");
  cmd->add_option("--heads", s.shape.heads, "override the attention heads");
  cmd->add_option("--kv-heads", s.shape.kv_heads, "override the key/value heads");
  cmd->add_option("--ffn", s.shape.ffn,
                  "override the MLP width (a mixture of experts: each expert's)");
  cmd->add_option("--vocab", s.shape.vocab, "override the vocabulary size");
  cmd->add_option("--hardware", s.hardware, "h100-4ssd|a100-2ssd|cpu-here")->capture_default_str();
  add_hardware_flags(cmd, s.hw);
  cmd->add_option("--measure-dir", s.measure_dirs,
                  "measure the store on these directories (comma-separated, O_DIRECT, 256 MiB "
                  "each way) and use the figures as --ssd");
  cmd->add_option("--io-compute-cost", s.io_compute_cost,
                  "compute time each byte moved takes when the device is this CPU, in ns per "
                  "byte: SSD write/SSD read/host copy, e.g. 0.6/0.5/0.2 (`tidal train` on "
                  "cpu-here measures it and prints it in its plan summary; 0 on a GPU)");
}

/// The micro-batch order the flags ask for; nullopt for auto.
inline std::optional<plan::MicroBatchOrder> requested_order(const TraceSource& s) {
  TIDAL_EXPECT_AS(
      InvalidArgument,
      !s.layer_major || s.micro_batch_order.empty() || s.micro_batch_order == "layer-major",
      "--layer-major is --micro-batch-order layer-major: give one of --layer-major and "
      "--micro-batch-order ",
      s.micro_batch_order);
  if (s.layer_major || s.micro_batch_order.empty()) {
    return s.layer_major ? plan::MicroBatchOrder::kLayerMajor : plan::MicroBatchOrder::kSequential;
  }
  if (s.micro_batch_order == "auto") return std::nullopt;
  return plan::micro_batch_order_from_string(s.micro_batch_order);
}

/// What the flags describe: the hardware model and the traces to plan. One trace, but two for
/// --micro-batch-order auto with more than one micro-batch (sequential, then layer-major: the
/// same iteration in the two orders, of which the caller keeps the faster plan).
struct LoadedSource {
  plan::Hardware hw;
  std::vector<trace::Trace> traces;
  /// --micro-batch-order auto with two traces.
  [[nodiscard]] bool choose_order() const { return traces.size() > 1; }
  /// The traces, by address (for plan::choose_fastest_order); valid while this lives.
  [[nodiscard]] std::vector<const trace::Trace*> trace_pointers() const {
    std::vector<const trace::Trace*> out;
    for (const auto& t : traces) out.push_back(&t);
    return out;
  }
};

/// The hardware model the flags describe: the preset, the overrides, the measured store
/// (--measure-dir) and the compute cost of I/O.
inline plan::Hardware source_hardware(const TraceSource& s) {
  plan::Hardware hw = plan::hardware_preset(s.hardware);
  plan::HardwareOverrides overrides = parse_hardware_flags(s.hw);
  if (s.measure_dirs) {
    TIDAL_EXPECT_AS(InvalidArgument, !s.hw.ssd, "give either --ssd or --measure-dir, not both");
    io::StoreOptions so;
    so.dirs = parse_dir_flag("--measure-dir", *s.measure_dirs);
    so.capacity = (320ull << 20) * so.dirs.size();
    io::TensorStore store(so);
    const auto m = io::measure_bandwidth(store);
    const std::string spec = io::ssd_spec(m, so.dirs.size());
    overrides.ssd = plan::parse_ssd_spec(spec);
    std::fprintf(stderr, "measured %s: write %s, read %s (O_DIRECT) -> --ssd %s\n",
                 s.measure_dirs->c_str(), format_bandwidth(m.write_bytes_per_second).c_str(),
                 format_bandwidth(m.read_bytes_per_second).c_str(), spec.c_str());
  }
  TIDAL_EXPECT_AS(InvalidArgument, hw.device_memory > 0 || overrides.device_memory,
                  "the device memory of hardware '", hw.name,
                  "' is unknown; give it with --gpu-mem (e.g. --gpu-mem 8GiB)");
  plan::apply_overrides(hw, overrides);
  if (!s.io_compute_cost.empty()) apply_io_compute_cost(hw, s.io_compute_cost);
  return hw;
}

/// A profiled trace (--trace): refuses the flags that only shape an analytic one.
inline trace::Trace profiled_trace(const TraceSource& s) {
  TIDAL_EXPECT_AS(InvalidArgument, s.model.empty() && s.hf_config.empty(),
                  "give either --trace or --model (--hf-config), not both");
  TIDAL_EXPECT_AS(InvalidArgument, !s.optimizer_in_backward && !s.optimizer_deferred,
                  "--optimizer-in-backward and --optimizer-deferred build an analytic trace "
                  "(--model); a profiled trace has the schedule its training loop ran");
  TIDAL_EXPECT_AS(InvalidArgument, s.precision.empty() || s.precision == "fp32",
                  "--precision builds an analytic trace (--model); a profiled trace has the "
                  "sizes and times its training loop measured");
  TIDAL_EXPECT_AS(InvalidArgument,
                  s.micro_batches == 1 && requested_order(s) == plan::MicroBatchOrder::kSequential,
                  "--micro-batches and --micro-batch-order build an analytic trace (--model); a "
                  "profiled trace has the passes its training loop ran, in its order");
  TIDAL_EXPECT_AS(InvalidArgument, s.data_parallel == 1 && s.tensor_parallel == 1,
                  "--data-parallel and --tensor-parallel build an analytic trace (--model); a "
                  "profiled trace is the GPU it was profiled on");
  return trace::read_trace(s.trace_path);
}

/// Checks the sizes an analytic trace (--model) is built from, naming the flags.
inline void check_model_flags(const TraceSource& s) {
  TIDAL_EXPECT_AS(InvalidArgument, !s.model.empty() || !s.hf_config.empty(),
                  "give a trace (--trace T.json) or a model (--model llama3-8b --batch 8 --seq "
                  "4096, or --hf-config config.json --batch 8 --seq 4096)");
  TIDAL_EXPECT_AS(InvalidArgument, s.model.empty() || s.hf_config.empty(),
                  "give either --model or --hf-config, not both");
  TIDAL_EXPECT_AS(InvalidArgument, s.batch > 0 && s.seq > 0,
                  "--model needs --batch and --seq (positive)");
  // The library checks every size against what a trace can hold; this names the flags for the
  // product that would wrap first.
  std::int64_t tokens = 0;
  TIDAL_EXPECT_AS(InvalidArgument, !__builtin_mul_overflow(s.batch, s.seq, &tokens), "--batch ",
                  s.batch, " x --seq ", s.seq,
                  " tokens overflows a 64-bit count; give a smaller --batch or --seq");
  TIDAL_EXPECT_AS(InvalidArgument, s.data_parallel >= 1 && s.batch % s.data_parallel == 0,
                  "--data-parallel ", s.data_parallel, " must be at least 1 and divide --batch ",
                  s.batch);
  TIDAL_EXPECT_AS(
      InvalidArgument, s.micro_batches >= 1 && (s.batch / s.data_parallel) % s.micro_batches == 0,
      "--micro-batches ", s.micro_batches,
      " must be at least 1 and divide each GPU's batch (--batch ", s.batch,
      s.data_parallel > 1 ? " / --data-parallel " + std::to_string(s.data_parallel) : std::string(),
      ")");
  TIDAL_EXPECT_AS(InvalidArgument, s.tensor_parallel >= 1, "--tensor-parallel must be at least 1");
}

/// The analytic traces of --model on `hw`: one per micro-batch order to plan.
inline std::vector<trace::Trace> analytic_traces(const TraceSource& s, const plan::Hardware& hw) {
  check_model_flags(s);
  std::optional<plan::HfModel> hf;
  if (!s.hf_config.empty()) hf = plan::read_hf_config(s.hf_config);
  plan::TransformerConfig cfg = hf ? hf->config : plan::model_preset(s.model);
  plan::apply_overrides(cfg, s.shape);
  plan::AnalyticTraceOptions topt;
  topt.optimizer = optimizer_schedule(s.optimizer_in_backward, s.optimizer_deferred);
  topt.micro_batches = s.micro_batches;
  const std::optional<plan::MicroBatchOrder> order = requested_order(s);
  TIDAL_EXPECT_AS(
      InvalidArgument,
      s.micro_batches > 1 || order == plan::MicroBatchOrder::kSequential || !order.has_value(),
      "--micro-batch-order layer-major (--layer-major) orders micro-batches: give "
      "--micro-batches 2 or more");
  topt.data_parallel = s.data_parallel;
  topt.tensor_parallel = s.tensor_parallel;
  topt.precision = !s.precision.empty()              ? plan::precision_from_string(s.precision)
                   : hf && hf->precision.has_value() ? *hf->precision
                                                     : plan::Precision::kFp32;
  check_trace_fits(plan::analytic_trace_size(cfg, s.batch, s.seq, hw, topt), cfg);
  // auto with one micro-batch: the two orders are the same trace.
  std::vector<plan::MicroBatchOrder> orders;
  if (order) {
    orders.push_back(*order);
  } else {
    orders.push_back(plan::MicroBatchOrder::kSequential);
    if (s.micro_batches > 1) orders.push_back(plan::MicroBatchOrder::kLayerMajor);
  }
  std::vector<trace::Trace> traces;
  for (plan::MicroBatchOrder o : orders) {
    topt.micro_batch_order = o;
    traces.push_back(plan::transformer_trace(cfg, s.batch, s.seq, hw, topt));
  }
  return traces;
}

/// The hardware model and the traces the flags describe. Throws tidal::InvalidArgument with what
/// to give when the flags are incomplete or contradictory.
inline LoadedSource load_trace_source(const TraceSource& s) {
  LoadedSource out{source_hardware(s), {}};
  if (!s.trace_path.empty()) {
    out.traces.push_back(profiled_trace(s));
  } else {
    out.traces = analytic_traces(s, out.hw);
  }
  return out;
}

}  // namespace tidal::cli
