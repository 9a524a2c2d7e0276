// Random EAGLE heads for a test target: they share the target's embedding and classifier, so
// their drafts are accepted often enough for the tests to see acceptances and rejections.
#pragma once

#include <cstdint>
#include <vector>

#include "specdec/models/eagle.hpp"
#include "specdec/models/llama.hpp"

namespace specdec::test {

// A random EAGLE head of `kind` for a target of `config` (EAGLE-3 reading its hidden states 0, 1
// and 2 over a draft vocabulary of `draft_vocab` ids).
inline models::EagleHead random_eagle(const models::LlamaConfig& config,
                                      const models::LlamaWeights& weights, models::EagleKind kind,
                                      int64_t draft_vocab, uint64_t seed) {
  models::EagleConfig c{.kind = kind,
                        .layer = config,
                        .target_hidden_size = config.dim,
                        .draft_vocab_size = draft_vocab,
                        .feature_layers = kind == models::EagleKind::eagle3
                                              ? std::vector<int64_t>{0, 1, 2}
                                              : std::vector<int64_t>{config.n_layers}};
  c.layer.hidden_dim = 48;
  return models::EagleHead(
      c, models::EagleHead::random(c, weights.token_embedding, weights.output, seed));
}

}  // namespace specdec::test
