// The Markov chains of the distribution tests: a target and a drafter over 4 tokens whose rows
// differ in entropy and top probability, so that acceptances, rejections and residuals all occur.
#pragma once

#include <ATen/ATen.h>

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

}  // namespace specdec::test
