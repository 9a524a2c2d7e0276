// Reading the model configuration of a Hugging Face Llama checkpoint (config.json). Plain C++
// and nlohmann-json. The file is untrusted: sizes must be JSON integers within LoadLimits, never
// floats (a 96.5 or a 1e23 is refused, not rounded), and messages quote values only in part.
#pragma once

#include <cstdint>
#include <filesystem>
#include <limits>
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
  // nlohmann-json holds every non-negative integer as unsigned: 0 is below a low of 1 there too.
  const bool below = value.is_number_unsigned() ? low > 0 && value.get<uint64_t>() < static_cast<uint64_t>(low)
                                                : value.get<int64_t>() < low;
  if (above && limit != nullptr) {
    throw_format(path, key, " = ", excerpt(value), " exceeds the limit of ", high, " (LoadLimits::", limit, ")");
  }
  if (above || below) throw_format(path, key, " = ", excerpt(value), " is outside [", low, ", ", high, "]");
  return value.get<int64_t>();
}

// The rotary settings of config.json: rope_theta and rope_scaling (null, or an object whose
// rope_type, in older files type, is default, linear or llama3) as transformers 4 writes them, or
// rope_parameters, the one object transformers 5 writes in their place (rope_theta, rope_type and
// the scaling fields together). linear reads factor; llama3 reads factor, low_freq_factor,
// high_freq_factor and original_max_position_embeddings. Errors name the field as the file has it.
struct RotarySettings {
  double theta = 10000.0;
  models::RopeScaling scaling{};
};

inline models::RopeScaling rope_scaling(const nlohmann::json& r, const std::filesystem::path& path, const char* field) {
  models::RopeScaling scaling;
  if (!r.is_object()) throw_format(path, field, " must be an object or null, got ", excerpt(r));
  const char* type_key = r.contains("rope_type") ? "rope_type" : "type";
  if (!r.contains(type_key) || !r[type_key].is_string()) throw_format(path, field, ".rope_type must be a string");
  const auto type = r[type_key].get<std::string>();
  const auto number = [&](const char* key) {
    if (!r.contains(key) || !r[key].is_number()) {
      throw_format(path, field, ".", key, " must be a number for rope_type '", type, "', got ",
                   r.contains(key) ? excerpt(r[key]) : std::string("nothing"));
    }
    return r[key].get<double>();
  };
  if (type == "default") return scaling;
  if (type == "linear") {
    scaling.type = models::RopeScaling::Type::linear;
    scaling.factor = number("factor");
  } else if (type == "llama3") {
    scaling.type = models::RopeScaling::Type::llama3;
    scaling.factor = number("factor");
    scaling.low_freq_factor = number("low_freq_factor");
    scaling.high_freq_factor = number("high_freq_factor");
    scaling.original_max_position_embeddings = config_integer(r, path, "original_max_position_embeddings", 1,
                                                              std::numeric_limits<int64_t>::max() / 2);
  } else {
    throw_format(path, field, ".rope_type '", printable(type), "' is not supported (supported: default, linear, llama3)");
  }
  return scaling;
}

inline RotarySettings rotary_settings(const nlohmann::json& config, const std::filesystem::path& path) {
  RotarySettings settings;
  if (config.contains("rope_parameters") && !config["rope_parameters"].is_null()) {
    const nlohmann::json& r = config["rope_parameters"];
    settings.scaling = rope_scaling(r, path, "rope_parameters");
    if (r.contains("rope_theta") && !r["rope_theta"].is_number()) {
      throw_format(path, "rope_parameters.rope_theta must be a number, got ", excerpt(r["rope_theta"]));
    }
    settings.theta = r.value("rope_theta", settings.theta);
    return settings;
  }
  settings.theta = config_value_or<double>(config, path, "rope_theta", settings.theta);
  if (config.contains("rope_scaling") && !config["rope_scaling"].is_null()) {
    settings.scaling = rope_scaling(config["rope_scaling"], path, "rope_scaling");
  }
  return settings;
}

}  // namespace detail

// The families config.json may name (model_type) and the class each loads as (architectures).
inline const char* hf_architecture(const std::string& model_type) {
  if (model_type == "llama") return "LlamaForCausalLM";
  if (model_type == "mistral") return "MistralForCausalLM";
  if (model_type == "qwen2") return "Qwen2ForCausalLM";
  return nullptr;
}

// Reads the LlamaConfig of a Hugging Face config.json, as transformers 4 or 5 writes it (see
// RotarySettings), of the Llama (1, 2, 3.x, with rope scaling llama3 or linear and
// attention_bias), Mistral (sliding_window) or Qwen2/Qwen2.5 (q, k, v biases) families. Throws FormatError naming the file and the field on a missing key, a wrong
// type, a size that is not an integer or exceeds `limits`, another model_type or architecture,
// or a feature the model does not implement (rope types other than default, linear and llama3;
// mlp_bias; Qwen2's use_sliding_window or sliding layer_types; an activation other than silu).
inline std::pair<models::LlamaConfig, bool> load_hf_llama_config(const std::filesystem::path& file,
                                                                 const LoadLimits& limits = {}) {
  const nlohmann::json json = detail::read_json(file, limits);
  if (!json.is_object()) detail::throw_format(file, "not a JSON object");
  const auto model_type = detail::config_value_or<std::string>(json, file, "model_type", "llama");
  const char* architecture = hf_architecture(model_type);
  if (architecture == nullptr) {
    detail::throw_format(file, "model_type '", detail::printable(model_type),
                         "' is not supported (supported: llama, mistral, qwen2)");
  }
  if (json.contains("architectures") && !json["architectures"].is_null()) {
    const nlohmann::json& names = json["architectures"];
    if (!names.is_array() || names.size() != 1 || !names[0].is_string() || names[0].get<std::string>() != architecture) {
      detail::throw_format(file, "architectures ", detail::excerpt(names), " is not supported for model_type '",
                           model_type, "' (expected [\"", architecture, "\"])");
    }
  }
  const auto hidden_act = detail::config_value_or<std::string>(json, file, "hidden_act", "silu");
  if (hidden_act != "silu") {
    detail::throw_format(file, "hidden_act '", detail::printable(hidden_act), "' is not supported (only silu)");
  }
  if (detail::config_value_or<bool>(json, file, "mlp_bias", false)) {
    detail::throw_format(file, "mlp_bias: true is not supported");
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
  const detail::RotarySettings rotary = detail::rotary_settings(json, file);
  config.rope_theta = rotary.theta;
  config.rope_scaling = rotary.scaling;
  config.norm_eps = detail::config_value_or<double>(json, file, "rms_norm_eps", 1e-6);
  if (model_type == "qwen2") {
    config.qkv_bias = true;
    if (detail::config_value_or<bool>(json, file, "use_sliding_window", false)) {
      detail::throw_format(file, "use_sliding_window: true is not supported (Qwen2's per-layer windows)");
    }
    // transformers 5 lists each layer's attention; only full attention is implemented.
    if (json.contains("layer_types") && !json["layer_types"].is_null()) {
      const nlohmann::json& types = json["layer_types"];
      if (!types.is_array()) detail::throw_format(file, "layer_types must be an array, got ", detail::excerpt(types));
      for (const nlohmann::json& type : types) {
        if (!type.is_string() || type.get<std::string>() != "full_attention") {
          detail::throw_format(file, "layer_types entry ", detail::excerpt(type),
                               " is not supported (only full_attention)");
        }
      }
    }
  } else {
    config.qkv_bias = config.o_bias = detail::config_value_or<bool>(json, file, "attention_bias", false);
  }
  if (model_type == "mistral" && json.contains("sliding_window") && !json["sliding_window"].is_null()) {
    config.sliding_window =
        detail::config_integer(json, file, "sliding_window", 1, std::numeric_limits<int64_t>::max() / 2);
  }
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
