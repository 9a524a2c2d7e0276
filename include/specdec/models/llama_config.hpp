// The hyperparameters of a Llama-family model, and check_tensor_parallel (whether they split over
// N ranks). Plain values, no tensors: the checkpoint parsers use it without libtorch.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <utility>

#include "specdec/detail/check.hpp"

namespace specdec::models {

// Rotary-embedding frequency scaling for contexts longer than the model was trained on.
struct RopeScaling {
  enum class Type { none, linear, llama3 };
  Type type = Type::none;
  double factor = 1.0;                        // linear, llama3: frequencies divided by this (>= 1)
  double low_freq_factor = 1.0;               // llama3: wavelengths above original / low are scaled
  double high_freq_factor = 4.0;              // llama3: wavelengths below original / high are kept
  int64_t original_max_position_embeddings = 8192;  // llama3: the pre-training context

  void validate() const {
    if (type == Type::none) return;
    if (!(factor >= 1.0)) detail::throw_invalid("RopeScaling::factor", "be >= 1", factor);
    if (type == Type::llama3) {
      if (!(low_freq_factor > 0.0)) detail::throw_invalid("RopeScaling::low_freq_factor", "be > 0", low_freq_factor);
      if (!(high_freq_factor > low_freq_factor)) {
        detail::throw_invalid("RopeScaling::high_freq_factor", "be > low_freq_factor", high_freq_factor);
      }
      if (original_max_position_embeddings < 1) {
        detail::throw_invalid("RopeScaling::original_max_position_embeddings", "be >= 1",
                              original_max_position_embeddings);
      }
    }
  }
  friend std::ostream& operator<<(std::ostream& out, Type type) {
    return out << (type == Type::none ? "none" : type == Type::linear ? "linear" : "llama3");
  }
};

struct LlamaConfig {
  int64_t dim = 64;             // model width
  int64_t hidden_dim = 172;     // feed-forward width
  int64_t n_layers = 5;         // decoder layers
  int64_t n_heads = 8;          // query heads
  int64_t n_kv_heads = 4;       // key/value heads (grouped-query attention); divides n_heads
  int64_t vocab_size = 512;     // vocabulary size
  int64_t max_seq_len = 512;    // most positions; also the StaticKVCache capacity by default
  double rope_theta = 10000.0;  // rotary embedding base
  double norm_eps = 1e-5;       // RMSNorm epsilon
  RopeScaling rope_scaling{};   // none: the frequencies rope_theta gives (Llama 3.1/3.2: llama3)
  int64_t sliding_window = 0;   // > 0: position i attends to positions (i - sliding_window, i]
                                // only (Mistral); 0: to every earlier position
  bool qkv_bias = false;        // q, k and v projections have biases (Qwen2, Llama attention_bias)
  bool o_bias = false;          // the output projection has a bias (Llama attention_bias)

  [[nodiscard]] int64_t head_dim() const noexcept { return dim / n_heads; }
  [[nodiscard]] int64_t kv_dim() const noexcept { return head_dim() * n_kv_heads; }

  // Throws std::invalid_argument naming the first field that is out of range.
  void validate() const {
    const std::pair<const char*, int64_t> positive[] = {
        {"dim", dim},           {"hidden_dim", hidden_dim}, {"n_layers", n_layers},
        {"n_heads", n_heads},   {"n_kv_heads", n_kv_heads}, {"vocab_size", vocab_size},
        {"max_seq_len", max_seq_len}};
    for (const auto& [name, value] : positive) {
      if (value < 1) detail::throw_invalid(std::string("LlamaConfig::") + name, "be >= 1", value);
    }
    if (dim % n_heads != 0) {
      detail::throw_invalid_message("LlamaConfig::dim (", dim, ") must be divisible by n_heads (",
                                    n_heads, ")");
    }
    if (head_dim() % 2 != 0) {
      detail::throw_invalid("LlamaConfig head_dim (dim / n_heads)", "be even for rotary embeddings",
                            head_dim());
    }
    if (n_heads % n_kv_heads != 0) {
      detail::throw_invalid_message("LlamaConfig::n_heads (", n_heads,
                                    ") must be divisible by n_kv_heads (", n_kv_heads, ")");
    }
    if (!(rope_theta > 0.0)) detail::throw_invalid("LlamaConfig::rope_theta", "be > 0", rope_theta);
    if (!(norm_eps > 0.0)) detail::throw_invalid("LlamaConfig::norm_eps", "be > 0", norm_eps);
    if (sliding_window < 0) detail::throw_invalid("LlamaConfig::sliding_window", "be >= 0", sliding_window);
    rope_scaling.validate();
  }

  friend std::ostream& operator<<(std::ostream& out, const LlamaConfig& c) {
    return out << "LlamaConfig{dim=" << c.dim << ", hidden_dim=" << c.hidden_dim
               << ", n_layers=" << c.n_layers << ", n_heads=" << c.n_heads
               << ", n_kv_heads=" << c.n_kv_heads << ", vocab_size=" << c.vocab_size
               << ", max_seq_len=" << c.max_seq_len << ", rope_scaling=" << c.rope_scaling.type
               << ", sliding_window=" << c.sliding_window << ", qkv_bias=" << c.qkv_bias << "}";
  }
};

}  // namespace specdec::models

namespace specdec {

// Throws std::invalid_argument, before any weight is read, when `config` cannot be split over
// `world_size` ranks: the query heads, the key/value heads and the feed-forward width must each
// divide by it (every rank holds whole heads).
inline void check_tensor_parallel(const models::LlamaConfig& config, int64_t world_size) {
  if (world_size < 1) detail::throw_invalid("world_size", "be >= 1", world_size);
  const std::pair<const char*, int64_t> split[] = {
      {"n_heads", config.n_heads}, {"n_kv_heads", config.n_kv_heads}, {"hidden_dim", config.hidden_dim}};
  for (const auto& [name, value] : split) {
    if (value % world_size != 0) {
      detail::throw_invalid_message("LlamaConfig::", name, " (", value, ") does not divide by the world size (",
                                    world_size, "): a model split over ", world_size,
                                    " ranks needs whole heads and equal feed-forward slices on every rank");
    }
  }
}

}  // namespace specdec
