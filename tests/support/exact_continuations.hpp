// The exact distribution of what a target samples after a prompt, by enumerating every
// continuation: the expected cells of the chi-square tests on small vocabularies.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

namespace specdec::test {

// The probability of every sequence of `steps` tokens the target samples after `prompt` through
// `processor` (vocab_size^steps cells).
template <class Model, class P>
std::map<std::vector<int64_t>, double> exact_continuations(Model& target, const P& processor,
                                                           const std::vector<int64_t>& prompt,
                                                           int steps) {
  const int64_t vocab = target.vocab_size();
  std::map<std::vector<int64_t>, double> expected{{{}, 1.0}};
  for (int step = 0; step < steps; ++step) {
    std::map<std::vector<int64_t>, double> longer;
    for (const auto& [prefix, probability] : expected) {
      std::vector<int64_t> sequence = prompt;
      sequence.insert(sequence.end(), prefix.begin(), prefix.end());
      auto cache = target.make_cache(1);
      const at::Tensor logits =
          target.forward(at::tensor(sequence, at::kLong).view({1, -1}), cache)[0];
      const at::Tensor p = processor(logits[-1]).to(at::kDouble);
      for (int64_t token = 0; token < vocab; ++token) {
        std::vector<int64_t> next = prefix;
        next.push_back(token);
        longer[next] = probability * p[token].template item<double>();
      }
    }
    expected = std::move(longer);
  }
  return expected;
}

}  // namespace specdec::test
