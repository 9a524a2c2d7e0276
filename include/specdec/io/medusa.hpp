// Loading Medusa heads in their published layout (the Medusa project's MedusaModel and the
// checkpoints made with it): a folder holding
//   config.json: medusa_num_heads (K) and medusa_num_layers (residual blocks per head); the
//     target's hidden_size and vocab_size when present, which must match the target's;
//   medusa_lm_head.safetensors (or model.safetensors): for head i < K and block j <
//     medusa_num_layers, `{i}.{j}.linear.weight` [H, H] and `{i}.{j}.linear.bias` [H], then the
//     head's classifier `{i}.{medusa_num_layers}.weight` [V, H]; every name may carry the prefix
//     `medusa_head.` (as the heads are named inside the whole model).
// The files are untrusted: counts are JSON integers within limits, every tensor must be present
// with its shape and a floating-point dtype, and a tensor the layout does not name is refused.
// Errors are FormatError naming the file and the field or tensor.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "specdec/io/errors.hpp"
#include "specdec/io/hf_config.hpp"
#include "specdec/io/json.hpp"
#include "specdec/io/limits.hpp"
#include "specdec/io/safetensors.hpp"
#include "specdec/models/medusa.hpp"

namespace specdec::io {

// The most heads and blocks per head a Medusa config may declare (published heads: 3 to 5 heads
// of 1 block).
inline constexpr int64_t kMaxMedusaHeads = 64;
inline constexpr int64_t kMaxMedusaLayers = 64;

// Medusa heads for a target of hidden size `hidden_size` and vocabulary `vocab_size`, as float32
// tensors with `options` (device, dtype) unless told otherwise.
inline models::MedusaHeads load_medusa(const std::filesystem::path& folder, int64_t hidden_size, int64_t vocab_size,
                                       const at::TensorOptions& options = at::kFloat, const LoadLimits& limits = {}) {
  const std::filesystem::path config_file = folder / "config.json";
  const nlohmann::json json = detail::read_json(config_file, limits);
  if (!json.is_object()) detail::throw_format(config_file, "not a JSON object");
  models::MedusaConfig config{.hidden_size = hidden_size, .vocab_size = vocab_size};
  config.num_heads = detail::config_integer(json, config_file, "medusa_num_heads", 1, kMaxMedusaHeads);
  config.num_layers = detail::config_integer(json, config_file, "medusa_num_layers", 0, kMaxMedusaLayers);
  for (const auto& [key, expected] : {std::pair<const char*, int64_t>{"hidden_size", hidden_size},
                                      std::pair<const char*, int64_t>{"vocab_size", vocab_size}}) {
    if (json.contains(key) && !json.at(key).is_null()) {
      const int64_t declared = detail::config_integer(json, config_file, key, 1, limits.max_dimension + limits.max_vocab_size);
      if (declared != expected) {
        detail::throw_format(config_file, key, " = ", declared, " but the target's is ", expected);
      }
    }
  }
  std::filesystem::path weights_file = folder / "medusa_lm_head.safetensors";
  if (!std::filesystem::exists(weights_file)) weights_file = folder / "model.safetensors";
  if (!std::filesystem::exists(weights_file)) {
    detail::throw_format(folder, "holds neither medusa_lm_head.safetensors nor model.safetensors");
  }
  std::map<std::string, at::Tensor> tensors = load_safetensors(weights_file, limits).tensors;
  // One naming: with or without the prefix, not both.
  std::map<std::string, at::Tensor> named;
  for (auto& [name, tensor] : tensors) {
    const std::string bare = name.rfind("medusa_head.", 0) == 0 ? name.substr(12) : name;
    if (!named.emplace(bare, tensor).second) detail::throw_format(weights_file, "tensor '", detail::printable(bare), "' appears twice");
  }
  std::set<std::string> used;
  const auto take = [&](const std::string& name, std::vector<int64_t> shape) {
    const auto it = named.find(name);
    if (it == named.end()) detail::throw_format(weights_file, "missing tensor '", name, "' (medusa_head.", name, ")");
    const at::Tensor& t = it->second;
    if (t.sizes() != at::IntArrayRef(shape)) {
      detail::throw_format(weights_file, "tensor '", name, "' has shape ", t.sizes(), ", expected ", at::IntArrayRef(shape));
    }
    if (!t.is_floating_point()) detail::throw_format(weights_file, "tensor '", name, "' is not floating point: ", t.scalar_type());
    used.insert(name);
    return t.to(options);
  };
  std::vector<models::MedusaHeadWeights> heads(static_cast<size_t>(config.num_heads));
  for (int64_t i = 0; i < config.num_heads; ++i) {
    models::MedusaHeadWeights& head = heads[static_cast<size_t>(i)];
    const std::string prefix = std::to_string(i) + ".";
    for (int64_t j = 0; j < config.num_layers; ++j) {
      const std::string block = prefix + std::to_string(j) + ".linear.";
      head.block_weights.push_back(take(block + "weight", {hidden_size, hidden_size}));
      head.block_biases.push_back(take(block + "bias", {hidden_size}));
    }
    head.classifier = take(prefix + std::to_string(config.num_layers) + ".weight", {vocab_size, hidden_size});
  }
  for (const auto& [name, tensor] : named) {
    if (!used.contains(name)) {
      detail::throw_format(weights_file, "unexpected tensor '", detail::printable(name), "' for ", config.num_heads,
                           " heads of ", config.num_layers, " blocks");
    }
  }
  return models::MedusaHeads(config, std::move(heads));
}

}  // namespace specdec::io
