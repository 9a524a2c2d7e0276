// Loading and writing llama2.c checkpoints as reference-model weights (the formats:
// llama2c_format.hpp). Files are untrusted: the header is validated and the file size must be
// exactly what the header implies before anything is read.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "specdec/detail/torch_compat.hpp"
#include "specdec/io/atomic_file.hpp"
#include "specdec/io/binary_reader.hpp"
#include "specdec/io/detail/read_tensor.hpp"
#include "specdec/io/errors.hpp"
#include "specdec/io/llama2c_format.hpp"
#include "specdec/models/llama.hpp"

namespace specdec::io {

struct Llama2cCheckpoint {
  models::LlamaConfig config{};
  models::LlamaWeights weights{};
  int version = 0;               // 0 legacy, 1 fp32, 2 Q8_0
  bool shared_classifier = true; // the classifier is the token embedding
};

namespace detail {

// Assigns matrices in version 1/2 file order to the weights.
inline void assign_matrices(models::LlamaWeights& w, const models::LlamaConfig& c,
                            const std::vector<at::Tensor>& m, bool classifier) {
  size_t next = 0;
  w.token_embedding = m[next++];
  w.layers.resize(static_cast<size_t>(c.n_layers));
  for (at::Tensor models::LlamaLayerWeights::*field :
       {&models::LlamaLayerWeights::wq, &models::LlamaLayerWeights::wk, &models::LlamaLayerWeights::wv,
        &models::LlamaLayerWeights::wo, &models::LlamaLayerWeights::w1, &models::LlamaLayerWeights::w2,
        &models::LlamaLayerWeights::w3}) {
    for (auto& layer : w.layers) layer.*field = m[next++];
  }
  w.output = classifier ? m[next] : w.token_embedding;
}

}  // namespace detail

// Loads a llama2.c checkpoint of version 0, 1 or 2 into weights of `options` (Q8_0 weights are
// dequantized). The header and file size are validated by parse_llama2c first, against `limits`.
// Throws FormatError naming the file and the problem.
inline Llama2cCheckpoint load_llama2c(const std::filesystem::path& path,
                                      const at::TensorOptions& options = at::kFloat, const LoadLimits& limits = {}) {
  const Llama2cLayout layout = parse_llama2c(path, limits);
  const models::LlamaConfig& c = layout.config;
  const bool classifier = !layout.shared_classifier;
  const auto matrices = detail::llama2c_matrices(c, classifier);
  detail::BinaryReader reader(path);
  reader.seek(layout.weights_offset);
  const auto read = [&](const std::vector<int64_t>& shape, at::ScalarType type, const char* what) {
    return detail::read_tensor(reader, shape, type, what);
  };
  const auto norms = [&](const char* what) {
    std::vector<at::Tensor> out;
    for (int64_t l = 0; l < c.n_layers; ++l) out.push_back(read({c.dim}, at::kFloat, what).to(options));
    return out;
  };
  Llama2cCheckpoint checkpoint{c, {}, layout.version, layout.shared_classifier};
  models::LlamaWeights& w = checkpoint.weights;
  std::vector<at::Tensor> attention_norms, ffn_norms, m;
  if (layout.version == 0) {
    // Legacy order: embedding, attention norms, wq, wk, wv, wo, ffn norms, w1, w2, w3, final norm,
    // two RoPE tables (recomputed by the model, skipped), [classifier].
    size_t next = 0;
    const auto matrix = [&] { return read(matrices[next++], at::kFloat, "weights").to(options); };
    m.push_back(matrix());
    attention_norms = norms("attention norms");
    for (int64_t i = 0; i < 4 * c.n_layers; ++i) m.push_back(matrix());
    ffn_norms = norms("ffn norms");
    for (int64_t i = 0; i < 3 * c.n_layers; ++i) m.push_back(matrix());
    w.norm = read({c.dim}, at::kFloat, "final norm").to(options);
    reader.seek(reader.position() + 2 * 4 * static_cast<uint64_t>(c.max_seq_len * (c.head_dim() / 2)));
    if (classifier) m.push_back(matrix());
  } else {
    attention_norms = norms("attention norms");
    ffn_norms = norms("ffn norms");
    w.norm = read({c.dim}, at::kFloat, "final norm").to(options);
    if (layout.version == 1) {
      for (const auto& shape : matrices) m.push_back(read(shape, at::kFloat, "weights").to(options));
    } else {
      // All int8 values first, then all scales.
      const int64_t group = layout.group_size;
      std::vector<at::Tensor> quantized;
      for (const auto& shape : matrices) quantized.push_back(read(shape, at::kChar, "int8 weights"));
      for (size_t i = 0; i < matrices.size(); ++i) {
        const auto groups = static_cast<int64_t>(detail::element_count(matrices[i])) / group;
        const at::Tensor scales = read({groups, 1}, at::kFloat, "scales");
        m.push_back((quantized[i].to(at::kFloat).view({groups, group}) * scales).view(matrices[i]).to(options));
      }
    }
  }
  detail::assign_matrices(w, c, m, classifier);
  for (size_t l = 0; l < w.layers.size(); ++l) {
    w.layers[l].attention_norm = attention_norms[l];
    w.layers[l].ffn_norm = ffn_norms[l];
  }
  return checkpoint;
}

// Writes a llama2.c checkpoint: version 1 (fp32) or 2 (Q8_0 in groups of `group_size`), the
// classifier shared when weights.output is the token embedding tensor itself. Written to a
// temporary file renamed into place.
inline void save_llama2c(const std::filesystem::path& path, const models::LlamaConfig& c,
                         const models::LlamaWeights& w, int version, int32_t group_size = 64) {
  if (version != 1 && version != 2) throw std::invalid_argument("version must be 1 or 2, got " + std::to_string(version));
  c.validate();
  const bool shared = w.output.is_same(w.token_embedding);
  std::vector<at::Tensor> matrices{w.token_embedding};
  for (at::Tensor models::LlamaLayerWeights::*field :
       {&models::LlamaLayerWeights::wq, &models::LlamaLayerWeights::wk, &models::LlamaLayerWeights::wv,
        &models::LlamaLayerWeights::wo, &models::LlamaLayerWeights::w1, &models::LlamaLayerWeights::w2,
        &models::LlamaLayerWeights::w3}) {
    for (const auto& layer : w.layers) matrices.push_back(layer.*field);
  }
  if (!shared) matrices.push_back(w.output);
  detail::write_atomically(path, [&](std::ofstream& out) {
    const auto write = [&](const at::Tensor& t, at::ScalarType type) {
      const at::Tensor cpu = t.detach().to(at::kCPU, type).contiguous();
      out.write(static_cast<const char*>(cpu.data_ptr()), static_cast<std::streamsize>(cpu.numel() * cpu.element_size()));
    };
    std::vector<char> header(detail::kLlama2cHeaderBytes, 0);
    const int32_t fields[] = {version, static_cast<int32_t>(c.dim), static_cast<int32_t>(c.hidden_dim),
                              static_cast<int32_t>(c.n_layers), static_cast<int32_t>(c.n_heads),
                              static_cast<int32_t>(c.n_kv_heads), static_cast<int32_t>(c.vocab_size),
                              static_cast<int32_t>(c.max_seq_len)};
    std::memcpy(header.data(), &detail::kLlama2cMagic, 4);
    std::memcpy(header.data() + 4, fields, sizeof(fields));
    header[4 + sizeof(fields)] = shared ? 1 : 0;
    if (version == 2) std::memcpy(header.data() + 5 + sizeof(fields), &group_size, 4);
    out.write(header.data(), static_cast<std::streamsize>(header.size()));
    for (const auto& l : w.layers) write(l.attention_norm, at::kFloat);
    for (const auto& l : w.layers) write(l.ffn_norm, at::kFloat);
    write(w.norm, at::kFloat);
    if (version == 1) {
      for (const auto& m : matrices) write(m, at::kFloat);
    } else {
      std::vector<at::Tensor> scales;
      for (const auto& m : matrices) {
        const at::Tensor groups = m.detach().to(at::kCPU, at::kFloat).reshape({-1, group_size});
        const at::Tensor scale = groups.abs().amax(1, /*keepdim=*/true) / 127.0;
        write(at::round(groups / scale.clamp_min(1e-30)), at::kChar);
        scales.push_back(scale);
      }
      for (const auto& s : scales) write(s, at::kFloat);
    }
  });
}

}  // namespace specdec::io
