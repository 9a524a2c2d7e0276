// One entry point for the checkpoint formats specdec reads: a folder is a Hugging Face Llama
// checkpoint (config.json + safetensors), a file is a llama2.c checkpoint.
#pragma once

#include <filesystem>
#include <string>

#include "specdec/detail/torch_compat.hpp"
#include "specdec/io/errors.hpp"
#include "specdec/io/hf_llama.hpp"
#include "specdec/io/json.hpp"
#include "specdec/io/limits.hpp"
#include "specdec/io/llama2c.hpp"
#include "specdec/models/llama.hpp"

namespace specdec::io {

struct LlamaCheckpoint {
  models::LlamaConfig config{};
  models::LlamaWeights weights{};
  std::string format{};  // "huggingface" or "llama2.c v<N>"
};

// Loads the checkpoint at `path` with weights of `options`, within `limits`. A folder is read as a
// Hugging Face checkpoint, a file as llama2.c; a file of a Hugging Face folder (config.json, a
// .safetensors or .json file) is refused with a message that asks for its folder. With
// shard.world_size > 1 the weights are rank shard.rank's shard (models::llama_shard): a Hugging
// Face checkpoint reads only the shard's bytes of the split tensors; a llama2.c file (small
// models) is read whole and cut.
// Throws FormatError; std::invalid_argument for a shard the model does not divide into.
inline LlamaCheckpoint load_llama(const std::filesystem::path& path,
                                  const at::TensorOptions& options = at::kFloat, const LoadLimits& limits = {},
                                  const Shard& shard = {}) {
  std::error_code error;
  if (std::filesystem::is_directory(path, error)) {
    auto checkpoint = load_hf_llama(path, options, limits, shard);
    return {checkpoint.config, std::move(checkpoint.weights), "huggingface"};
  }
  if (!std::filesystem::exists(path, error)) detail::throw_format(path, "no such file or folder");
  if (!std::filesystem::is_regular_file(path, error)) {
    detail::throw_format(path, "is neither a llama2.c checkpoint file nor a Hugging Face checkpoint folder");
  }
  const auto extension = path.extension();
  if (extension == ".safetensors" || extension == ".json") {
    detail::throw_format(path, "is a file of a Hugging Face checkpoint: pass the folder that holds it (",
                         detail::printable(path.parent_path().empty() ? "." : path.parent_path().string(), 200),
                         ")");
  }
  auto checkpoint = load_llama2c(path, options, limits);
  if (shard.world_size > 1) {
    checkpoint.weights = models::llama_shard(checkpoint.config, checkpoint.weights, shard.rank, shard.world_size);
  }
  return {checkpoint.config, std::move(checkpoint.weights),
          "llama2.c v" + std::to_string(checkpoint.version)};
}

}  // namespace specdec::io
