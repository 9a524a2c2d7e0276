// llama2.c checkpoints: the legacy format (version 0: seven int32 then fp32 weights, a negative
// vocabulary size meaning a separate classifier) and the "ak42" formats with a 256-byte header
// (version 1: fp32; version 2: Q8_0, int8 weights with one fp32 scale per group, dequantized to
// floating point on load). Files are untrusted: the header is validated and the file size must
// be exactly what the header implies before anything is read.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "specdec/io/binary_reader.hpp"
#include "specdec/io/errors.hpp"
#include "specdec/models/llama.hpp"

namespace specdec::io {

struct Llama2cCheckpoint {
  models::LlamaConfig config;
  models::LlamaWeights weights;
  int version = 0;               // 0 legacy, 1 fp32, 2 Q8_0
  bool shared_classifier = true; // the classifier is the token embedding
};

namespace detail {

inline constexpr uint32_t kLlama2cMagic = 0x616b3432;  // "ak42"
inline constexpr uint64_t kLlama2cHeaderBytes = 256;

struct Llama2cHeader {
  int32_t dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len;
};

inline models::LlamaConfig llama2c_config(const std::filesystem::path& path, const Llama2cHeader& h) {
  const std::pair<const char*, int32_t> fields[] = {
      {"dim", h.dim}, {"hidden_dim", h.hidden_dim}, {"n_layers", h.n_layers}, {"n_heads", h.n_heads},
      {"n_kv_heads", h.n_kv_heads}, {"vocab_size", h.vocab_size}, {"seq_len", h.seq_len}};
  for (const auto& [name, value] : fields) {
    if (value < 1 || value > (1 << 24)) throw_format(path, "header field ", name, " = ", value, " is out of range");
  }
  models::LlamaConfig config{.dim = h.dim, .hidden_dim = h.hidden_dim, .n_layers = h.n_layers,
                             .n_heads = h.n_heads, .n_kv_heads = h.n_kv_heads,
                             .vocab_size = h.vocab_size, .max_seq_len = h.seq_len};
  try {
    config.validate();
  } catch (const std::invalid_argument& e) {
    throw_format(path, "invalid header: ", e.what());
  }
  return config;
}

// Shapes of the matrices in file order (version 1 and 2 order: embedding, then per kind all layers).
inline std::vector<std::vector<int64_t>> llama2c_matrices(const models::LlamaConfig& c, bool classifier) {
  std::vector<std::vector<int64_t>> shapes{{c.vocab_size, c.dim}};
  for (const auto& shape : std::vector<std::vector<int64_t>>{{c.dim, c.dim}, {c.kv_dim(), c.dim}, {c.kv_dim(), c.dim},
                                                             {c.dim, c.dim}, {c.hidden_dim, c.dim}, {c.dim, c.hidden_dim},
                                                             {c.hidden_dim, c.dim}}) {
    for (int64_t l = 0; l < c.n_layers; ++l) shapes.push_back(shape);
  }
  if (classifier) shapes.push_back({c.vocab_size, c.dim});
  return shapes;
}

inline uint64_t numel(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (const int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

// Assigns matrices in file order (embedding, wq.., wk.., wv.., wo.., w1.., w2.., w3.., [output]).
inline void assign_matrices(models::LlamaWeights& w, const models::LlamaConfig& c,
                            std::vector<at::Tensor>& m, bool classifier) {
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

inline void require_exact_size(const std::filesystem::path& path, uint64_t expected, uint64_t actual) {
  if (expected != actual) {
    throw_format(path, actual < expected ? "truncated" : "oversized", ": the header implies ", expected,
                 " bytes, the file has ", actual);
  }
}

}  // namespace detail

// Loads a llama2.c checkpoint of version 0, 1 or 2 into weights of `options`.
// Throws FormatError naming the file and the problem.
inline Llama2cCheckpoint load_llama2c(const std::filesystem::path& path,
                                      const at::TensorOptions& options = at::kFloat) {
  detail::BinaryReader reader(path);
  Llama2cCheckpoint checkpoint;
  const auto magic = reader.read<uint32_t>("header");
  if (magic == detail::kLlama2cMagic) {
    checkpoint.version = reader.read<int32_t>("version");
    if (checkpoint.version != 1 && checkpoint.version != 2) {
      detail::throw_format(path, "unsupported llama2.c version ", checkpoint.version, " (1 and 2 are supported)");
    }
  } else {
    reader.seek(0);
  }
  auto header = reader.read<detail::Llama2cHeader>("header");
  int32_t group_size = 0;
  if (checkpoint.version == 0) {
    checkpoint.shared_classifier = header.vocab_size > 0;
    if (header.vocab_size < 0 && header.vocab_size > std::numeric_limits<int32_t>::min()) header.vocab_size = -header.vocab_size;
  } else {
    checkpoint.shared_classifier = reader.read<uint8_t>("shared_classifier flag") != 0;
    if (checkpoint.version == 2) group_size = reader.read<int32_t>("group size");
  }
  const models::LlamaConfig c = detail::llama2c_config(path, header);
  checkpoint.config = c;
  const bool classifier = !checkpoint.shared_classifier;
  const auto matrices = detail::llama2c_matrices(c, classifier);
  const auto L = static_cast<uint64_t>(c.n_layers), D = static_cast<uint64_t>(c.dim);
  const uint64_t norm_floats = 2 * L * D + D;
  uint64_t matrix_floats = 0;
  for (const auto& shape : matrices) matrix_floats += detail::numel(shape);

  models::LlamaWeights& w = checkpoint.weights;
  const auto as_model = [&](at::Tensor t) { return t.to(options); };
  const auto norms = [&](std::vector<at::Tensor>& out, const char* what) {
    for (int64_t l = 0; l < c.n_layers; ++l) out.push_back(as_model(reader.read_tensor({c.dim}, at::kFloat, what)));
  };
  std::vector<at::Tensor> attention_norms, ffn_norms, m;
  if (checkpoint.version == 0) {
    const uint64_t rope_floats = 2 * static_cast<uint64_t>(c.max_seq_len) * static_cast<uint64_t>(c.head_dim() / 2);
    detail::require_exact_size(path, sizeof(detail::Llama2cHeader) + 4 * (norm_floats + matrix_floats + rope_floats),
                               reader.size());
    // Legacy order: embedding, attention norms, wq, wk, wv, wo, ffn norms, w1, w2, w3, norm, RoPE, [output].
    const auto matrix = [&](size_t i) { return as_model(reader.read_tensor(matrices[i], at::kFloat, "weights")); };
    m.push_back(matrix(0));
    norms(attention_norms, "attention norms");
    size_t next = 1;
    for (int kind = 0; kind < 4; ++kind) for (int64_t l = 0; l < c.n_layers; ++l) m.push_back(matrix(next++));
    norms(ffn_norms, "ffn norms");
    for (int kind = 0; kind < 3; ++kind) for (int64_t l = 0; l < c.n_layers; ++l) m.push_back(matrix(next++));
    w.norm = as_model(reader.read_tensor({c.dim}, at::kFloat, "final norm"));
    reader.seek(reader.position() + 4 * rope_floats);
    if (classifier) m.push_back(matrix(next));
  } else {
    reader.seek(detail::kLlama2cHeaderBytes);
    norms(attention_norms, "attention norms");
    norms(ffn_norms, "ffn norms");
    w.norm = as_model(reader.read_tensor({c.dim}, at::kFloat, "final norm"));
    if (checkpoint.version == 1) {
      detail::require_exact_size(path, detail::kLlama2cHeaderBytes + 4 * (norm_floats + matrix_floats), reader.size());
      for (const auto& shape : matrices) m.push_back(as_model(reader.read_tensor(shape, at::kFloat, "weights")));
    } else {
      if (group_size < 1 || group_size > (1 << 20)) detail::throw_format(path, "group size ", group_size, " is out of range");
      const auto group = static_cast<uint64_t>(group_size);
      for (const auto& shape : matrices) {
        if (detail::numel(shape) % group != 0) {
          detail::throw_format(path, "a weight of ", detail::numel(shape), " elements is not a multiple of the group size ", group);
        }
      }
      detail::require_exact_size(path, detail::kLlama2cHeaderBytes + 4 * norm_floats + matrix_floats + 4 * (matrix_floats / group),
                                 reader.size());
      // All int8 values first, then all scales.
      std::vector<at::Tensor> quantized;
      for (const auto& shape : matrices) quantized.push_back(reader.read_tensor(shape, at::kChar, "int8 weights"));
      for (size_t i = 0; i < matrices.size(); ++i) {
        const auto groups = static_cast<int64_t>(detail::numel(matrices[i]) / group);
        const at::Tensor scales = reader.read_tensor({groups, 1}, at::kFloat, "scales");
        m.push_back(as_model((quantized[i].to(at::kFloat).view({groups, group_size}) * scales).view(matrices[i])));
      }
    }
  }
  detail::assign_matrices(w, c, m, classifier);
  for (int64_t l = 0; l < c.n_layers; ++l) {
    w.layers[static_cast<size_t>(l)].attention_norm = attention_norms[static_cast<size_t>(l)];
    w.layers[static_cast<size_t>(l)].ffn_norm = ffn_norms[static_cast<size_t>(l)];
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
  std::filesystem::path temporary = path;
  temporary += ".partial";
  std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
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
  out.close();
  if (!out) throw std::runtime_error("failed writing " + temporary.string());
  std::filesystem::rename(temporary, path);
}

}  // namespace specdec::io
