// Parsing and validating a llama2.c checkpoint header without reading weights: the legacy format
// (version 0: seven int32, a negative vocabulary size meaning a separate classifier, fp32 weights
// and two RoPE tables) and the "ak42" formats with a 256-byte header (version 1: fp32; version 2:
// Q8_0, int8 weights with one fp32 scale per group). The file size must be exactly what the header
// implies. Plain C++.
#pragma once

#include <cstdint>
#include <filesystem>
#include <limits>
#include <vector>

#include "specdec/io/binary_reader.hpp"
#include "specdec/io/errors.hpp"
#include "specdec/io/limits.hpp"
#include "specdec/models/llama_config.hpp"

namespace specdec::io {

struct Llama2cLayout {
  models::LlamaConfig config{};
  int version = 0;                // 0 legacy, 1 fp32, 2 Q8_0
  bool shared_classifier = true;  // the classifier is the token embedding
  int32_t group_size = 0;         // Q8_0 group size (version 2)
  uint64_t weights_offset = 0;    // where the weights start
};

namespace detail {

inline constexpr uint32_t kLlama2cMagic = 0x616b3432;  // "ak42"
inline constexpr uint64_t kLlama2cHeaderBytes = 256;

struct Llama2cHeader {
  int32_t dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len;
};

// Shapes of the weight matrices in version 1/2 file order: the embedding, then each kind (wq, wk,
// wv, wo, w1, w2, w3) for all layers, then the classifier when it is separate.
// The shapes of one layer's matrices, in file order: wq, wk, wv, wo, w1, w2, w3.
inline std::vector<std::vector<int64_t>> llama2c_layer_matrices(const models::LlamaConfig& c) {
  return {{c.dim, c.dim},        {c.kv_dim(), c.dim},   {c.kv_dim(), c.dim}, {c.dim, c.dim},
          {c.hidden_dim, c.dim}, {c.dim, c.hidden_dim}, {c.hidden_dim, c.dim}};
}

inline std::vector<std::vector<int64_t>> llama2c_matrices(const models::LlamaConfig& c, bool classifier) {
  std::vector<std::vector<int64_t>> shapes{{c.vocab_size, c.dim}};
  for (const auto& shape : llama2c_layer_matrices(c)) {
    for (int64_t l = 0; l < c.n_layers; ++l) shapes.push_back(shape);
  }
  if (classifier) shapes.push_back({c.vocab_size, c.dim});
  return shapes;
}

inline uint64_t element_count(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (const int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

inline void require_exact_size(const std::filesystem::path& path, uint64_t expected, uint64_t actual) {
  if (expected != actual) {
    throw_format(path, actual < expected ? "truncated" : "oversized", ": the header implies ", expected,
                 " bytes, the file has ", actual);
  }
}

}  // namespace detail

// Reads and checks a llama2.c header and the file size it implies; seq_len and vocab_size, which
// no file size bounds, are checked against `limits`.
// Throws FormatError naming the file and the problem.
inline Llama2cLayout parse_llama2c(const std::filesystem::path& path, const LoadLimits& limits = {}) {
  detail::BinaryReader reader(path);
  Llama2cLayout layout;
  const auto magic = reader.read<uint32_t>("header");
  if (magic == detail::kLlama2cMagic) {
    layout.version = reader.read<int32_t>("version");
    if (layout.version != 1 && layout.version != 2) {
      detail::throw_format(path, "unsupported llama2.c version ", layout.version, " (1 and 2 are supported)");
    }
  } else {
    reader.seek(0);
  }
  auto h = reader.read<detail::Llama2cHeader>("header");
  if (layout.version == 0) {
    layout.shared_classifier = h.vocab_size > 0;
    if (h.vocab_size < 0 && h.vocab_size > std::numeric_limits<int32_t>::min()) h.vocab_size = -h.vocab_size;
    layout.weights_offset = sizeof(detail::Llama2cHeader);
  } else {
    layout.shared_classifier = reader.read<uint8_t>("shared_classifier flag") != 0;
    if (layout.version == 2) layout.group_size = reader.read<int32_t>("group size");
    layout.weights_offset = detail::kLlama2cHeaderBytes;
  }
  const std::pair<const char*, int32_t> fields[] = {
      {"dim", h.dim}, {"hidden_dim", h.hidden_dim}, {"n_layers", h.n_layers}, {"n_heads", h.n_heads},
      {"n_kv_heads", h.n_kv_heads}, {"vocab_size", h.vocab_size}, {"seq_len", h.seq_len}};
  for (const auto& [name, value] : fields) {
    if (value < 1 || value > (1 << 24)) detail::throw_format(path, "header field ", name, " = ", value, " is out of range");
  }
  if (h.seq_len > limits.max_sequence_length) {
    detail::throw_format(path, "header field seq_len = ", h.seq_len, " exceeds the limit of ", limits.max_sequence_length,
                         " (LoadLimits::max_sequence_length)");
  }
  if (h.vocab_size > limits.max_vocab_size) {
    detail::throw_format(path, "header field vocab_size = ", h.vocab_size, " exceeds the limit of ",
                         limits.max_vocab_size, " (LoadLimits::max_vocab_size)");
  }
  layout.config = models::LlamaConfig{.dim = h.dim, .hidden_dim = h.hidden_dim, .n_layers = h.n_layers,
                                      .n_heads = h.n_heads, .n_kv_heads = h.n_kv_heads,
                                      .vocab_size = h.vocab_size, .max_seq_len = h.seq_len};
  try {
    layout.config.validate();
  } catch (const std::invalid_argument& e) {
    detail::throw_format(path, "invalid header: ", e.what());
  }
  const models::LlamaConfig& c = layout.config;
  // Sizes from the header alone, without listing every layer's matrices (a 30-byte header may
  // declare 2^24 layers); products of fields up to 2^24 can exceed 64 bits, so they saturate and
  // a saturated size never equals the file's.
  const auto mul = [](uint64_t a, uint64_t b) {
    return b != 0 && a > std::numeric_limits<uint64_t>::max() / b ? std::numeric_limits<uint64_t>::max() : a * b;
  };
  const auto add = [](uint64_t a, uint64_t b) {
    return a > std::numeric_limits<uint64_t>::max() - b ? std::numeric_limits<uint64_t>::max() : a + b;
  };
  const auto L = static_cast<uint64_t>(c.n_layers), D = static_cast<uint64_t>(c.dim);
  const uint64_t embedding = mul(static_cast<uint64_t>(c.vocab_size), D);
  std::vector<uint64_t> sizes{embedding};  // one of each matrix shape
  uint64_t per_layer = 0;
  for (const auto& shape : detail::llama2c_layer_matrices(c)) {
    sizes.push_back(detail::element_count(shape));
    per_layer = add(per_layer, detail::element_count(shape));
  }
  const uint64_t norm_floats = add(mul(2 * L, D), D);
  const uint64_t matrix_floats = add(add(embedding, mul(L, per_layer)), layout.shared_classifier ? 0 : embedding);
  uint64_t expected = layout.weights_offset;
  if (layout.version == 0) {
    const uint64_t rope_floats = 2 * static_cast<uint64_t>(c.max_seq_len) * static_cast<uint64_t>(c.head_dim() / 2);
    expected = add(expected, mul(4, add(add(norm_floats, matrix_floats), rope_floats)));
  } else if (layout.version == 1) {
    expected = add(expected, mul(4, add(norm_floats, matrix_floats)));
  } else {
    if (layout.group_size < 1 || layout.group_size > (1 << 20)) {
      detail::throw_format(path, "group size ", layout.group_size, " is out of range");
    }
    const auto group = static_cast<uint64_t>(layout.group_size);
    for (const uint64_t size : sizes) {
      if (size % group != 0) {
        detail::throw_format(path, "a weight of ", size, " elements is not a multiple of the group size ", group);
      }
    }
    expected = add(add(expected, mul(4, norm_floats)), add(matrix_floats, mul(4, matrix_floats / group)));
  }
  detail::require_exact_size(path, expected, reader.size());
  return layout;
}

}  // namespace specdec::io
