// Hugging Face config.json files as TransformerConfig (hf_config.hpp).
#include "tidal/plan/hf_config.hpp"

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "tidal/common/error.hpp"

namespace tidal::plan {

namespace {

using nlohmann::json;

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

// One config being read: its fields, with messages that name the file and the field.
class Fields {
 public:
  Fields(const json& j, std::string name, std::string type)
      : j_(j), name_(std::move(name)), type_(std::move(type)) {}

  [[nodiscard]] bool has(const char* key) const { return j_.contains(key) && !j_[key].is_null(); }

  std::int64_t count(const char* key) const {
    TIDAL_EXPECT_AS(InvalidArgument, has(key), "config.json of ", name_, " has no '", key,
                    "', which a ", type_, " model needs: is the file complete?");
    const json& v = j_[key];
    TIDAL_EXPECT_AS(InvalidArgument, v.is_number_integer() && v.get<std::int64_t>() > 0,
                    "config.json of ", name_, ": '", key, "' is ", v.dump(),
                    "; it must be a positive integer");
    return v.get<std::int64_t>();
  }
  std::int64_t count_or(const char* key, std::int64_t fallback) const {
    return has(key) ? count(key) : fallback;
  }
  bool flag_or(const char* key, bool fallback) const {
    return has(key) && j_[key].is_boolean() ? j_[key].get<bool>() : fallback;
  }
  double number_or(const char* key, double fallback) const {
    return has(key) && j_[key].is_number() ? j_[key].get<double>() : fallback;
  }

 private:
  const json& j_;
  std::string name_;
  std::string type_;
};

int small(std::int64_t v, const std::string& name, const char* key) {
  TIDAL_EXPECT_AS(InvalidArgument, v <= (1 << 30), "config.json of ", name, ": '", key, "' is ", v,
                  ", more than a model of this kind can have");
  return static_cast<int>(v);
}

// Llama, Mistral, Qwen2 and their mixture-of-experts kin: RMSNorm, grouped-query attention
// with rotary positions, SwiGLU.
TransformerConfig llama_like(const Fields& f, const std::string& name, const std::string& type) {
  TransformerConfig c;
  c.name = name;
  c.arch = Architecture::kLlama;
  c.layers = small(f.count("num_hidden_layers"), name, "num_hidden_layers");
  c.hidden = f.count("hidden_size");
  c.heads = small(f.count("num_attention_heads"), name, "num_attention_heads");
  c.kv_heads = small(f.count_or("num_key_value_heads", c.heads), name, "num_key_value_heads");
  c.vocab = f.count("vocab_size");
  c.max_seq = f.count_or("max_position_embeddings", 4096);
  c.tied_embeddings = f.flag_or("tie_word_embeddings", false);
  c.rope_theta = f.number_or("rope_theta", 10000.0);
  if (type == "mixtral") {
    c.experts = small(f.count("num_local_experts"), name, "num_local_experts");
    c.experts_per_token = small(f.count("num_experts_per_tok"), name, "num_experts_per_tok");
    c.expert_ffn = f.count("intermediate_size");
    c.ffn = c.expert_ffn;
  } else if (type == "qwen2_moe") {
    TIDAL_EXPECT_AS(
        InvalidArgument, f.count_or("decoder_sparse_step", 1) == 1, "config.json of ", name,
        ": decoder_sparse_step > 1 mixes dense and expert layers, which tidal's "
        "analytic trace does not build; estimate a model whose every layer has experts");
    c.experts = small(f.count("num_experts"), name, "num_experts");
    c.experts_per_token = small(f.count("num_experts_per_tok"), name, "num_experts_per_tok");
    c.expert_ffn = f.count("moe_intermediate_size");
    c.shared_expert_ffn = f.count_or("shared_expert_intermediate_size", 0);
    c.ffn = c.expert_ffn;
  } else {
    c.ffn = f.count("intermediate_size");
  }
  return c;
}

TransformerConfig gpt2(const Fields& f, const std::string& name) {
  TransformerConfig c;
  c.name = name;
  c.arch = Architecture::kGpt2;
  c.layers = small(f.count("n_layer"), name, "n_layer");
  c.hidden = f.count("n_embd");
  c.heads = small(f.count("n_head"), name, "n_head");
  c.kv_heads = c.heads;
  c.ffn = f.count_or("n_inner", 4 * c.hidden);
  c.vocab = f.count("vocab_size");
  c.max_seq = f.count_or("n_positions", 1024);
  c.tied_embeddings = true;
  return c;
}

std::optional<Precision> precision_of(const json& j) {
  if (!j.contains("torch_dtype") || !j["torch_dtype"].is_string()) return std::nullopt;
  const auto dtype = j["torch_dtype"].get<std::string>();
  if (dtype == "bfloat16" || dtype == "float16") return Precision::kBf16Mixed;
  if (dtype == "float32") return Precision::kFp32;
  return std::nullopt;
}

}  // namespace

std::vector<std::string> hf_model_types() {
  return {"llama", "mistral", "qwen2", "mixtral", "qwen2_moe", "gpt2"};
}

HfModel parse_hf_config(const std::string& text, const std::string& given_name) {
  std::string name = given_name;
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    TIDAL_EXPECT_AS(InvalidArgument, false, "config.json of ", name, " is not JSON (", e.what(),
                    "): give a Hugging Face model's config.json");
  }
  TIDAL_EXPECT_AS(
      InvalidArgument, j.is_object() && j.contains("model_type") && j["model_type"].is_string(),
      "config.json of ", name, " has no model_type: is it a Hugging Face model's config.json?");
  const auto type = j["model_type"].get<std::string>();
  if (j.contains("_name_or_path") && j["_name_or_path"].is_string() &&
      !j["_name_or_path"].get<std::string>().empty()) {
    name = j["_name_or_path"].get<std::string>();
  }
  const bool encoder = j.value("is_encoder_decoder", false) || type == "bert" ||
                       type == "roberta" || type == "t5" || type == "bart";
  TIDAL_EXPECT_AS(InvalidArgument, !encoder, "config.json of ", name, " is a '", type,
                  "' model, not a decoder-only one: tidal estimates decoder-only language "
                  "models (",
                  joined(hf_model_types()), ")");
  const std::vector<std::string> known = hf_model_types();
  TIDAL_EXPECT_AS(InvalidArgument, std::find(known.begin(), known.end(), type) != known.end(),
                  "config.json of ", name, ": model_type '", type,
                  "' is not one tidal builds a trace of; it knows ", joined(known),
                  " (a Llama-like decoder can be given as llama with its sizes)");
  if (j.contains("mlp_only_layers") && j["mlp_only_layers"].is_array()) {
    TIDAL_EXPECT_AS(InvalidArgument, j["mlp_only_layers"].empty(), "config.json of ", name,
                    ": mlp_only_layers mixes dense and expert layers, which tidal's analytic "
                    "trace does not build");
  }
  const Fields f(j, name, type);
  HfModel m;
  m.model_type = type;
  m.config = type == "gpt2" ? gpt2(f, name) : llama_like(f, name, type);
  m.precision = precision_of(j);
  ModelOverrides none;
  apply_overrides(m.config, none);  // checks the shape: hidden by heads, heads by kv heads
  return m;
}

HfModel read_hf_config(const std::string& path) {
  std::ifstream in(path);
  TIDAL_EXPECT_AS(InvalidArgument, in.good(), "cannot read '", path,
                  "': give the path of a Hugging Face model's config.json");
  std::ostringstream text;
  text << in.rdbuf();
  std::string name = path;
  const auto slash = name.find_last_of('/');
  if (slash != std::string::npos) name = name.substr(slash + 1);
  if (name.size() > 5 && name.compare(name.size() - 5, 5, ".json") == 0) {
    name.resize(name.size() - 5);
  }
  return parse_hf_config(text.str(), name);
}

}  // namespace tidal::plan
