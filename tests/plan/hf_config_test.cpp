// Tests of Hugging Face config.json reading (plan/hf_config.hpp) on the configs shipped in
// tests/plan/hf_configs (published models' files, nothing downloaded).
#include "tidal/plan/hf_config.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "tidal/common/error.hpp"
#include "tidal/plan/hardware.hpp"
#include "tidal/plan/model_trace.hpp"
#include "tidal/plan/policies.hpp"

namespace tidal::plan {
namespace {

std::string config_path(const std::string& name) {
  return std::string(TIDAL_HF_CONFIGS) + "/" + name + ".json";
}

// Parameters as the model cards publish them (billions), against what the config gives.
TEST(HfConfig, ParameterCountsOfPublishedModels) {
  const struct {
    const char* file;
    double billions;
    const char* type;
  } cases[] = {{"Meta-Llama-3-8B", 8.03, "llama"},
               {"Meta-Llama-3-70B", 70.55, "llama"},
               {"Qwen2.5-32B", 32.76, "qwen2"},
               {"Mixtral-8x7B-v0.1", 46.70, "mixtral"}};
  for (const auto& c : cases) {
    const HfModel m = read_hf_config(config_path(c.file));
    EXPECT_EQ(m.model_type, c.type);
    ASSERT_TRUE(m.precision.has_value());
    EXPECT_EQ(*m.precision, Precision::kBf16Mixed);
    const double b = static_cast<double>(m.config.parameters()) / 1e9;
    // Qwen2's attention biases (0.5M) are left out; the rest is exact to the published figure.
    EXPECT_NEAR(b, c.billions, 0.01 * c.billions) << c.file;
  }
  const HfModel mixtral = read_hf_config(config_path("Mixtral-8x7B-v0.1"));
  EXPECT_EQ(mixtral.config.experts, 8);
  EXPECT_EQ(mixtral.config.experts_per_token, 2);
  EXPECT_EQ(mixtral.config.expert_ffn, 14336);
}

// Where a built-in preset is the same model, the config gives the same trace: the same tensor
// bytes and, on the same hardware, the same ideal step.
TEST(HfConfig, SameTraceAsTheBuiltInModel) {
  const Hardware hw = hardware_preset("h100-4ssd");
  const struct {
    const char* file;
    const char* preset;
  } cases[] = {{"Meta-Llama-3-8B", "llama3-8b"}, {"Meta-Llama-3-70B", "llama3-70b"}};
  for (const auto& c : cases) {
    TransformerConfig from_file = read_hf_config(config_path(c.file)).config;
    TransformerConfig built_in = model_preset(c.preset);
    from_file.layers = built_in.layers = 2;  // the blocks are alike; two keep the test short
    AnalyticTraceOptions o;
    o.precision = Precision::kBf16Mixed;
    const trace::Trace a = transformer_trace(from_file, 2, 512, hw, o);
    const trace::Trace b = transformer_trace(built_in, 2, 512, hw, o);
    ASSERT_EQ(a.tensors.size(), b.tensors.size()) << c.file;
    double bytes_a = 0;
    double bytes_b = 0;
    for (std::size_t i = 0; i < a.tensors.size(); ++i) {
      bytes_a += static_cast<double>(a.tensors[i].bytes);
      bytes_b += static_cast<double>(b.tensors[i].bytes);
    }
    EXPECT_NEAR(bytes_a, bytes_b, 0.02 * bytes_b) << c.file;
    const double ideal_a = run_policy(Policy::kIdeal, a, hw).sim.iteration_seconds;
    const double ideal_b = run_policy(Policy::kIdeal, b, hw).sim.iteration_seconds;
    EXPECT_NEAR(ideal_a, ideal_b, 0.02 * ideal_b) << c.file;
  }
}

TEST(HfConfig, BadConfigsSayWhatIsWrong) {
  const auto message = [](const std::string& text) -> std::string {
    try {
      (void)parse_hf_config(text, "test");
    } catch (const InvalidArgument& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(message("{not json").find("is not JSON"), std::string::npos);
  EXPECT_NE(message(R"({"hidden_size": 4})").find("no model_type"), std::string::npos);
  EXPECT_NE(message(R"({"model_type": "bert", "hidden_size": 768})").find("not a decoder-only"),
            std::string::npos);
  EXPECT_NE(message(R"({"model_type": "t5", "is_encoder_decoder": true})").find("decoder-only"),
            std::string::npos);
  EXPECT_NE(message(R"({"model_type": "falcon"})").find("knows llama"), std::string::npos);
  const std::string no_layers =
      R"({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
          "intermediate_size": 128, "vocab_size": 100})";
  EXPECT_NE(message(no_layers).find("'num_hidden_layers'"), std::string::npos);
  const std::string negative =
      R"({"model_type": "llama", "hidden_size": -64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100})";
  EXPECT_NE(message(negative).find("positive integer"), std::string::npos);
  const std::string mixed_moe =
      R"({"model_type": "qwen2_moe", "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "vocab_size": 100, "num_experts": 4,
          "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 2})";
  EXPECT_NE(message(mixed_moe).find("decoder_sparse_step"), std::string::npos);
  const std::string bad_heads =
      R"({"model_type": "llama", "hidden_size": 65, "num_hidden_layers": 2,
          "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100})";
  EXPECT_FALSE(message(bad_heads).empty());
  EXPECT_THROW(read_hf_config(config_path("no-such-model")), InvalidArgument);
}

TEST(HfConfig, Gpt2AndQwenMoeFields) {
  const HfModel gpt = parse_hf_config(
      R"({"model_type": "gpt2", "n_embd": 1600, "n_layer": 48, "n_head": 25,
          "vocab_size": 50257, "n_positions": 1024})",
      "gpt2-xl");
  EXPECT_EQ(gpt.config.parameters(), model_preset("gpt2-xl").parameters());
  EXPECT_FALSE(gpt.precision.has_value());
  const HfModel qwen = parse_hf_config(
      R"({"model_type": "qwen2_moe", "hidden_size": 2048, "num_hidden_layers": 24,
          "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 151936,
          "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
          "shared_expert_intermediate_size": 5632, "intermediate_size": 5632,
          "torch_dtype": "float32"})",
      "Qwen1.5-MoE-A2.7B");
  EXPECT_EQ(qwen.config.experts, 60);
  EXPECT_EQ(qwen.config.shared_expert_ffn, 5632);
  EXPECT_EQ(*qwen.precision, Precision::kFp32);
  // Qwen1.5-MoE-A2.7B: 14.3B parameters in all.
  EXPECT_NEAR(static_cast<double>(qwen.config.parameters()) / 1e9, 14.3, 0.2);
}

}  // namespace
}  // namespace tidal::plan
