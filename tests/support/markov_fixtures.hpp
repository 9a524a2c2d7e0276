// The Markov chains of the distribution tests: a target and a drafter over 4 tokens whose rows
// differ in entropy and top probability, so that acceptances, rejections and residuals all occur;
// and a repetitive chain for the model-free drafters.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <vector>

namespace specdec::test {

// A [rows, columns] double tensor from nested rows.
inline at::Tensor rows_of(std::vector<std::vector<double>> rows) {
  std::vector<at::Tensor> tensors;
  for (auto& row : rows) tensors.push_back(at::tensor(row, at::kDouble));
  return at::stack(tensors);
}

inline const at::Tensor& markov_target_rows() {
  static const at::Tensor t = rows_of({{.1, .2, .3, .4}, {.4, .3, .2, .1}, {.2, .3, .26, .24}, {.12, .5, .08, .3}});
  return t;
}

inline const at::Tensor& markov_drafter_rows() {
  static const at::Tensor t = rows_of({{.4, .3, .2, .1}, {.1, .1, .4, .4}, {.7, .1, .1, .1}, {.25, .25, .25, .25}});
  return t;
}

// A [vocab, vocab] chain whose rows put 0.7 on (t + 1) mod vocab and spread the rest evenly: its
// greedy output is one long cycle, which model-free drafters learn.
inline at::Tensor pattern_chain(int64_t vocab) {
  at::Tensor t = at::full({vocab, vocab}, 0.3 / static_cast<double>(vocab - 1), at::kDouble);
  for (int64_t i = 0; i < vocab; ++i) t[i][(i + 1) % vocab] = 0.7;
  return t;
}

// The probability of every sequence of `count` tokens after token `last` under the chain
// p [V, V] (row t: the distribution after t); sequences of probability 0 are left out.
inline std::map<std::vector<int64_t>, double> sequence_probabilities(const at::Tensor& p, int64_t last, int64_t count) {
  const at::Tensor rows = p.to(at::kDouble).contiguous();
  std::map<std::vector<int64_t>, double> expected{{{}, 1.0}};
  for (int64_t step = 0; step < count; ++step) {
    std::map<std::vector<int64_t>, double> longer;
    for (const auto& [prefix, probability] : expected) {
      const int64_t from = prefix.empty() ? last : prefix.back();
      for (int64_t token = 0; token < rows.size(1); ++token) {
        const double next = rows[from][token].item<double>();
        if (next == 0.0) continue;
        std::vector<int64_t> sequence = prefix;
        sequence.push_back(token);
        longer[sequence] = probability * next;
      }
    }
    expected = std::move(longer);
  }
  return expected;
}

}  // namespace specdec::test
