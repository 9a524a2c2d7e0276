// Small reference transformers with random weights, for tests.
#pragma once

#include "specdec/models/llama.hpp"

namespace specdec::test {

inline models::LlamaConfig small_llama_config() {
  return models::LlamaConfig{.dim = 32, .hidden_dim = 64, .n_layers = 2, .n_heads = 4,
                             .n_kv_heads = 2, .vocab_size = 48, .max_seq_len = 128};
}

// The weights with Gaussian noise of `noise` standard deviation added to every matrix: a drafter
// that agrees with the original on most, not all, tokens.
inline models::LlamaWeights perturbed(const models::LlamaWeights& weights, double noise,
                                      uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const auto jitter = [&](const at::Tensor& t) {
    return t + at::normal(0.0, noise, t.sizes(), gen, at::TensorOptions(at::kFloat)).to(t.options());
  };
  models::LlamaWeights result = weights;
  result.token_embedding = jitter(weights.token_embedding);
  for (auto& layer : result.layers) {
    layer.wq = jitter(layer.wq);
    layer.wk = jitter(layer.wk);
    layer.wv = jitter(layer.wv);
    layer.wo = jitter(layer.wo);
    layer.w1 = jitter(layer.w1);
    layer.w2 = jitter(layer.w2);
    layer.w3 = jitter(layer.w3);
  }
  result.output = jitter(weights.output);
  return result;
}

}  // namespace specdec::test
