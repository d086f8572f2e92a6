// The analytic transformer trace's argument checks: what makes a trace impossible to build,
// said in the terms of the model's shape.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "plan/transformer/trace_builder.hpp"
#include "tidal/common/error.hpp"

namespace tidal::plan::detail::transformer {

namespace {

// a x b when it is at most `limit`, else nullopt (overflow included). Both non-negative.
std::optional<std::uint64_t> product_within(std::uint64_t a, std::uint64_t b, std::uint64_t limit) {
  std::uint64_t p = 0;
  if (__builtin_mul_overflow(a, b, &p) || p > limit) return std::nullopt;
  return p;
}

// Every tensor of the trace within kMaxTensorBytes, checked before anything is built, with the
// dimensions that make it too large named: a weight is at most two dimensions of the shape, an
// activation at most the tokens of a micro-batch times the widest per-token dimension, each
// element at most 4 bytes.
void check_sizes(const TransformerConfig& cfg, std::int64_t batch, std::int64_t seq,
                 const AnalyticTraceOptions& o) {
  const auto u = [](std::int64_t v) { return static_cast<std::uint64_t>(v); };
  struct Dim {
    const char* name;
    std::int64_t value;
  };
  std::vector<Dim> dims{{"hidden", cfg.hidden}, {"ffn", cfg.ffn}, {"vocab", cfg.vocab}};
  if (cfg.arch == Architecture::kGpt2) dims.push_back({"max_seq", cfg.max_seq});
  if (cfg.moe()) {
    dims.push_back({"experts", cfg.experts});
    dims.push_back({"expert_ffn", cfg.expert_ffn});
    dims.push_back({"shared_expert_ffn", cfg.shared_expert_ffn});
  }
  const Dim& hidden = dims.front();  // every weight has the hidden size as one side
  for (const Dim& d : dims) {
    TIDAL_EXPECT_AS(InvalidArgument,
                    product_within(u(hidden.value), u(d.value), kMaxTensorBytes / kFloat),
                    "a weight of hidden (", hidden.value, ") x ", d.name, " (", d.value,
                    ") elements would hold more than 1 PiB: give a smaller ", d.name,
                    &d == &hidden ? "" : " or hidden");
  }
  const std::int64_t per_micro_batch = batch / o.data_parallel / o.micro_batches;
  const auto tokens = product_within(u(per_micro_batch), u(seq), kMaxTensorBytes);
  std::int64_t widest = 3 * cfg.hidden;
  const char* widest_name = "3 x hidden";
  for (const Dim& d : dims) {
    if (d.value > widest && std::string(d.name) != "max_seq") {
      widest = d.value;
      widest_name = d.name;
    }
  }
  TIDAL_EXPECT_AS(
      InvalidArgument, tokens && product_within(*tokens, u(widest), kMaxTensorBytes / kFloat),
      "batch (", batch, ") x seq (", seq, ") makes ",
      tokens ? std::to_string(*tokens) : std::string("more than 2^50"),
      " tokens per micro-batch; an activation of that many tokens x ", widest_name, " (", widest,
      ") would hold more than 1 PiB: give a smaller batch or seq, or more "
      "micro-batches");
}

// A mixture of experts that the trace can build: a Llama block, at least one expert per token
// and no more than there are, positive widths that split over the tensor-parallel GPUs.
void check_experts(const TransformerConfig& cfg, int tp) {
  TIDAL_EXPECT_AS(InvalidArgument, cfg.experts >= 0, cfg.name, " has ", cfg.experts,
                  " experts: give 0 (a dense MLP) or more");
  if (!cfg.moe()) return;
  TIDAL_EXPECT_AS(InvalidArgument, cfg.arch == Architecture::kLlama, cfg.name,
                  " is a GPT-2 model with experts: mixture-of-experts blocks are built for the "
                  "Llama architecture only; give 0 experts");
  TIDAL_EXPECT_AS(InvalidArgument,
                  cfg.experts_per_token >= 1 && cfg.experts_per_token <= cfg.experts, cfg.name,
                  " routes each token to ", cfg.experts_per_token, " of its ", cfg.experts,
                  " experts: give between 1 and ", cfg.experts, " experts per token");
  TIDAL_EXPECT_AS(InvalidArgument, cfg.expert_ffn > 0 && cfg.shared_expert_ffn >= 0, cfg.name,
                  " has an expert width of ", cfg.expert_ffn, " and a shared expert width of ",
                  cfg.shared_expert_ffn,
                  ": the expert width must be positive, the shared one positive or 0 (none)");
  TIDAL_EXPECT_AS(InvalidArgument,
                  tp >= 1 && cfg.expert_ffn % tp == 0 && cfg.shared_expert_ffn % tp == 0,
                  "tensor parallelism over ", tp, " GPUs splits each expert's width (",
                  cfg.expert_ffn, ") and the shared expert's (", cfg.shared_expert_ffn,
                  "): each must divide evenly (the experts themselves are not spread over the "
                  "GPUs)");
}

}  // namespace

void check_arguments(const TransformerConfig& cfg, std::int64_t batch, std::int64_t seq,
                     const Hardware& hw, const AnalyticTraceOptions& o) {
  TIDAL_EXPECT_AS(InvalidArgument, batch > 0 && seq > 0, "batch and seq must be positive, got ",
                  batch, " and ", seq);
  TIDAL_EXPECT_AS(InvalidArgument, hw.gpu_flops > 0 && hw.gpu_mem_bw > 0,
                  "the hardware model needs gpu_flops and gpu_mem_bw for analytic op times");
  TIDAL_EXPECT_AS(InvalidArgument, cfg.arch != Architecture::kGpt2 || seq <= cfg.max_seq, cfg.name,
                  " has ", cfg.max_seq, " positions; a sequence of ", seq, " is longer");
  const int dp = o.data_parallel;
  const int tp = o.tensor_parallel;
  TIDAL_EXPECT_AS(InvalidArgument, dp >= 1 && batch % dp == 0, "the batch (", batch,
                  ") must split evenly over the data-parallel GPUs (", dp, ")");
  const int M = o.micro_batches;
  TIDAL_EXPECT_AS(InvalidArgument, M >= 1 && (batch / dp) % M == 0, "each GPU's batch (",
                  batch / dp, ") must split into micro_batches (", M, ") of equal size");
  // A mixture of experts has no dense MLP: its widths are checked by check_experts.
  TIDAL_EXPECT_AS(
      InvalidArgument,
      tp >= 1 && cfg.kv_heads % tp == 0 && (cfg.moe() || cfg.ffn % tp == 0) && cfg.vocab % tp == 0,
      "tensor parallelism over ", tp, " GPUs splits the key/value heads (", cfg.kv_heads,
      "), the MLP (", cfg.ffn, ") and the vocabulary (", cfg.vocab, "): each must divide evenly");
  check_experts(cfg, tp);
  check_sizes(cfg, batch, seq, o);
  TIDAL_EXPECT_AS(InvalidArgument, (dp == 1 && tp == 1) || hw.gpu_link_bw > 0,
                  "more than one GPU needs the bandwidth of the link between them (gpu_link_bw; "
                  "the ",
                  hw.name, " model has none)");
}

}  // namespace tidal::plan::detail::transformer
