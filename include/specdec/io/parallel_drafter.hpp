// Parallel drafters (PARD) in the published layout: a Hugging Face causal LM folder (config.json
// and safetensors, any family load_hf_llama reads) whose config.json names the drafter's mask
// token as `pard_token`; PARD's trainer also writes `spd_type: "pard"`. The drafters trained here
// are written the same way (the mask token the row added after the target's vocabulary).
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "specdec/detail/torch_compat.hpp"
#include "specdec/io/errors.hpp"
#include "specdec/io/hf_config.hpp"
#include "specdec/io/hf_llama.hpp"
#include "specdec/io/json.hpp"
#include "specdec/io/limits.hpp"
#include "specdec/models/llama.hpp"

namespace specdec::io {

struct ParallelDrafterCheckpoint {
  models::LlamaConfig config{};
  models::LlamaWeights weights{};
  int64_t mask_token = -1;  // config.json's pard_token, in [0, config.vocab_size)
};

// Loads a parallel drafter's folder with weights of `options`, within `limits`.
// Throws FormatError naming config.json and the field when pard_token is missing, not an integer
// or outside the vocabulary, or spd_type is present and not "pard"; and whatever load_hf_llama
// throws for the rest of the checkpoint.
inline ParallelDrafterCheckpoint load_parallel_drafter(const std::filesystem::path& folder,
                                                       const at::TensorOptions& options = at::kFloat,
                                                       const LoadLimits& limits = {}) {
  const auto file = folder / "config.json";
  HfLlamaCheckpoint checkpoint = load_hf_llama(folder, options, limits);
  const nlohmann::json json = detail::read_json(file, limits);
  if (json.contains("spd_type") && !json["spd_type"].is_null()) {
    const nlohmann::json& kind = json["spd_type"];
    if (!kind.is_string() || kind.get<std::string>() != "pard") {
      detail::throw_format(file, "spd_type ", detail::excerpt(kind), " is not a parallel drafter's (expected \"pard\")");
    }
  }
  if (!json.contains("pard_token")) {
    detail::throw_format(file, "missing key 'pard_token': a parallel drafter's configuration names its mask token");
  }
  const int64_t mask = detail::config_integer(json, file, "pard_token", 0, checkpoint.config.vocab_size - 1);
  return {checkpoint.config, std::move(checkpoint.weights), mask};
}

// Writes a parallel drafter as load_parallel_drafter reads it: save_hf_llama's folder with
// pard_token and spd_type in config.json, tensors stored as `storage`.
inline void save_parallel_drafter(const std::filesystem::path& folder, const models::LlamaConfig& config,
                                  const models::LlamaWeights& weights, int64_t mask_token,
                                  at::ScalarType storage = at::kFloat,
                                  const std::map<std::string, std::string>& metadata = {}) {
  if (mask_token < 0 || mask_token >= config.vocab_size) {
    specdec::detail::throw_invalid_message("mask_token must be in [0, ", config.vocab_size, "), got ", mask_token);
  }
  const nlohmann::json extra{{"pard_token", mask_token}, {"spd_type", "pard"}};
  save_hf_llama(folder, config, weights, storage, extra, metadata);
}

}  // namespace specdec::io
