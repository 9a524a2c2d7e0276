// Reading the model configuration of a Hugging Face Llama checkpoint (config.json). Plain C++
// and nlohmann-json.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>

#include "specdec/io/errors.hpp"
#include "specdec/models/llama_config.hpp"

namespace specdec::io {
namespace detail {

inline nlohmann::json read_json(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw_format(path, "cannot open file");
  in.seekg(0, std::ios::end);
  const auto size = static_cast<uint64_t>(in.tellg());
  if (size > (64u << 20)) throw_format(path, "JSON file of ", size, " bytes exceeds 64 MiB");
  in.seekg(0);
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw_format(path, "malformed JSON: ", e.what());
  }
}

template <class T>
T config_value(const nlohmann::json& config, const std::filesystem::path& path, const char* key) {
  if (!config.contains(key)) throw_format(path, "missing key '", key, "'");
  try {
    return config.at(key).get<T>();
  } catch (const nlohmann::json::exception&) {
    throw_format(path, "key '", key, "' has the wrong type: ", config.at(key).dump());
  }
}

template <class T>
T config_value_or(const nlohmann::json& config, const std::filesystem::path& path, const char* key, T fallback) {
  if (!config.contains(key) || config.at(key).is_null()) return fallback;
  return config_value<T>(config, path, key);
}

}  // namespace detail

// Reads the LlamaConfig of a Hugging Face config.json. Throws FormatError on a missing key, a
// wrong type, an architecture other than Llama, or rope scaling the model does not implement.
inline std::pair<models::LlamaConfig, bool> load_hf_llama_config(const std::filesystem::path& file) {
  const nlohmann::json json = detail::read_json(file);
  if (!json.is_object()) detail::throw_format(file, "not a JSON object");
  const auto model_type = detail::config_value_or<std::string>(json, file, "model_type", "llama");
  if (model_type != "llama") detail::throw_format(file, "model_type '", model_type, "' is not 'llama'");
  if (json.contains("rope_scaling") && !json["rope_scaling"].is_null()) {
    detail::throw_format(file, "rope_scaling ", json["rope_scaling"].dump(), " is not supported");
  }
  models::LlamaConfig config;
  config.dim = detail::config_value<int64_t>(json, file, "hidden_size");
  config.hidden_dim = detail::config_value<int64_t>(json, file, "intermediate_size");
  config.n_layers = detail::config_value<int64_t>(json, file, "num_hidden_layers");
  config.n_heads = detail::config_value<int64_t>(json, file, "num_attention_heads");
  config.n_kv_heads = detail::config_value_or<int64_t>(json, file, "num_key_value_heads", config.n_heads);
  config.vocab_size = detail::config_value<int64_t>(json, file, "vocab_size");
  config.max_seq_len = detail::config_value<int64_t>(json, file, "max_position_embeddings");
  config.rope_theta = detail::config_value_or<double>(json, file, "rope_theta", 10000.0);
  config.norm_eps = detail::config_value_or<double>(json, file, "rms_norm_eps", 1e-6);
  if (config.n_heads > 0 && json.contains("head_dim") &&
      detail::config_value<int64_t>(json, file, "head_dim") * config.n_heads != config.dim) {
    detail::throw_format(file, "head_dim * num_attention_heads must equal hidden_size");
  }
  try {
    config.validate();
  } catch (const std::invalid_argument& e) {
    detail::throw_format(file, e.what());
  }
  return {config, detail::config_value_or<bool>(json, file, "tie_word_embeddings", false)};
}

}  // namespace specdec::io
