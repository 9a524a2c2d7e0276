// One entry point for the checkpoint formats specdec reads: a folder is a Hugging Face Llama
// checkpoint (config.json + safetensors), a file is a llama2.c checkpoint.
#pragma once

#include <ATen/ATen.h>

#include <filesystem>
#include <string>

#include "specdec/io/errors.hpp"
#include "specdec/io/hf_llama.hpp"
#include "specdec/io/llama2c.hpp"
#include "specdec/models/llama.hpp"

namespace specdec::io {

struct LlamaCheckpoint {
  models::LlamaConfig config;
  models::LlamaWeights weights;
  std::string format;  // "huggingface" or "llama2.c v<N>"
};

// Loads the checkpoint at `path` with weights of `options`. Throws FormatError.
inline LlamaCheckpoint load_llama(const std::filesystem::path& path,
                                  const at::TensorOptions& options = at::kFloat) {
  if (std::filesystem::is_directory(path)) {
    auto checkpoint = load_hf_llama(path, options);
    return {checkpoint.config, std::move(checkpoint.weights), "huggingface"};
  }
  if (!std::filesystem::exists(path)) detail::throw_format(path, "no such file or folder");
  auto checkpoint = load_llama2c(path, options);
  return {checkpoint.config, std::move(checkpoint.weights),
          "llama2.c v" + std::to_string(checkpoint.version)};
}

}  // namespace specdec::io
