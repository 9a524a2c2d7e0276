// Reading the model configuration of a Hugging Face Llama checkpoint (config.json). Plain C++
// and nlohmann-json. The file is untrusted: sizes must be JSON integers within LoadLimits, never
// floats (a 96.5 or a 1e23 is refused, not rounded), and messages quote values only in part.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>

#include "specdec/io/errors.hpp"
#include "specdec/io/json.hpp"
#include "specdec/io/limits.hpp"
#include "specdec/models/llama_config.hpp"

namespace specdec::io {
namespace detail {

template <class T>
T config_value(const nlohmann::json& config, const std::filesystem::path& path, const char* key) {
  if (!config.contains(key)) throw_format(path, "missing key '", key, "'");
  try {
    return config.at(key).get<T>();
  } catch (const nlohmann::json::exception&) {
    throw_format(path, "key '", key, "' has the wrong type: ", excerpt(config.at(key)));
  }
}

template <class T>
T config_value_or(const nlohmann::json& config, const std::filesystem::path& path, const char* key, T fallback) {
  if (!config.contains(key) || config.at(key).is_null()) return fallback;
  return config_value<T>(config, path, key);
}

// The integer under `key`, which must be a JSON integer in [low, high]; `limit` names the
// LoadLimits field that sets `high`, for the message.
inline int64_t config_integer(const nlohmann::json& config, const std::filesystem::path& path, const char* key,
                              int64_t low, int64_t high, const char* limit = nullptr) {
  if (!config.contains(key)) throw_format(path, "missing key '", key, "'");
  const nlohmann::json& value = config.at(key);
  if (!value.is_number_integer()) {
    throw_format(path, "key '", key, "' must be an integer, got ", excerpt(value));
  }
  const bool above = value.is_number_unsigned() ? value.get<uint64_t>() > static_cast<uint64_t>(high)
                                                 : value.get<int64_t>() > high;
  const bool below = !value.is_number_unsigned() && value.get<int64_t>() < low;
  if (above && limit != nullptr) {
    throw_format(path, key, " = ", excerpt(value), " exceeds the limit of ", high, " (LoadLimits::", limit, ")");
  }
  if (above || below) throw_format(path, key, " = ", excerpt(value), " is outside [", low, ", ", high, "]");
  return value.get<int64_t>();
}

}  // namespace detail

// Reads the LlamaConfig of a Hugging Face config.json. Throws FormatError on a missing key, a
// wrong type, a size that is not an integer or exceeds `limits`, an architecture other than
// Llama, or rope scaling the model does not implement.
inline std::pair<models::LlamaConfig, bool> load_hf_llama_config(const std::filesystem::path& file,
                                                                 const LoadLimits& limits = {}) {
  const nlohmann::json json = detail::read_json(file, limits);
  if (!json.is_object()) detail::throw_format(file, "not a JSON object");
  const auto model_type = detail::config_value_or<std::string>(json, file, "model_type", "llama");
  if (model_type != "llama") {
    detail::throw_format(file, "model_type '", detail::printable(model_type), "' is not 'llama'");
  }
  if (json.contains("rope_scaling") && !json["rope_scaling"].is_null()) {
    detail::throw_format(file, "rope_scaling ", detail::excerpt(json["rope_scaling"]), " is not supported");
  }
  const auto dimension = [&](const char* key) {
    return detail::config_integer(json, file, key, 1, limits.max_dimension, "max_dimension");
  };
  models::LlamaConfig config;
  config.dim = dimension("hidden_size");
  config.hidden_dim = dimension("intermediate_size");
  config.n_layers = dimension("num_hidden_layers");
  config.n_heads = dimension("num_attention_heads");
  config.n_kv_heads = json.contains("num_key_value_heads") && !json["num_key_value_heads"].is_null()
                          ? dimension("num_key_value_heads")
                          : config.n_heads;
  config.vocab_size = detail::config_integer(json, file, "vocab_size", 1, limits.max_vocab_size, "max_vocab_size");
  config.max_seq_len = detail::config_integer(json, file, "max_position_embeddings", 1, limits.max_sequence_length,
                                              "max_sequence_length");
  config.rope_theta = detail::config_value_or<double>(json, file, "rope_theta", 10000.0);
  config.norm_eps = detail::config_value_or<double>(json, file, "rms_norm_eps", 1e-6);
  if (json.contains("head_dim") && !json["head_dim"].is_null() &&
      dimension("head_dim") * config.n_heads != config.dim) {
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
