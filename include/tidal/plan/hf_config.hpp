// A Hugging Face `config.json` of a decoder-only model, read into the analytic trace's terms
// (TransformerConfig), so that a model is planned and estimated before it exists in memory.
// Torch-free; nothing is downloaded.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "tidal/plan/model_trace.hpp"

namespace tidal::plan {

/// What a config.json says about a model.
struct HfModel {
  TransformerConfig config;
  std::string model_type;  ///< "llama", "mistral", "qwen2", "mixtral", "qwen2_moe", "gpt2"
  /// The precision its weights are published in (torch_dtype): bfloat16 or float16 train in
  /// bf16-mixed, float32 in fp32; nullopt where the config does not say.
  std::optional<Precision> precision;
};

/// The model types read_hf_config understands.
std::vector<std::string> hf_model_types();

/// Reads a config.json's text; `name` names the model (TransformerConfig::name, and messages).
/// Throws tidal::InvalidArgument, saying what to do, on text that is not a JSON object, a
/// config without model_type, an encoder or encoder-decoder (not a decoder), an unknown
/// model_type (listing the known ones), a missing or non-positive field (naming it), and a
/// mixture of experts with dense layers among the sparse ones (decoder_sparse_step > 1 or
/// mlp_only_layers), which the analytic trace does not build.
HfModel parse_hf_config(const std::string& text, const std::string& name);

/// The same from a file (its name, without directories and ".json", names the model when the
/// config has no _name_or_path). Throws tidal::InvalidArgument when it cannot be read.
HfModel read_hf_config(const std::string& path);

}  // namespace tidal::plan
