// A parallel drafter's weights for tests: a Llama's with a mask row added.
#pragma once

#include <cstdint>

#include "specdec/models/llama.hpp"

namespace specdec::test {

// The weights with one more token row (embedding and classifier) drawn at random: a parallel
// drafter's mask row, after the target's vocabulary.
inline models::LlamaWeights with_mask_row(const models::LlamaWeights& w, uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const auto row = [&](const at::Tensor& t) {
    return at::cat({t, at::normal(0.0, 0.5, {1, t.size(1)}, gen, at::TensorOptions(at::kFloat)).to(t.options())});
  };
  models::LlamaWeights out = w;
  out.token_embedding = row(w.token_embedding);
  out.output = row(w.output);
  return out;
}

}  // namespace specdec::test
