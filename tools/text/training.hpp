// What the trainers in tools/ share: random training windows of a byte stream and the learning
// rate schedule (linear warm-up over the first 5% of steps, then a cosine down to 10% of the
// peak). Not a public header.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <random>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

namespace specdec::text {

// Random windows of `length + 1` bytes: inputs and next-byte targets, [batch, length] each.
inline std::pair<at::Tensor, at::Tensor> batch_of(const std::vector<uint8_t>& stream, int64_t batch, int64_t length,
                                                  std::mt19937_64& rng) {
  std::uniform_int_distribution<size_t> start(0, stream.size() - static_cast<size_t>(length) - 2);
  at::Tensor window = at::empty({batch, length + 1}, at::kLong);
  auto* data = window.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    const size_t s = start(rng);
    for (int64_t t = 0; t <= length; ++t) data[b * (length + 1) + t] = stream[s + static_cast<size_t>(t)];
  }
  return {window.narrow(1, 0, length).contiguous(), window.narrow(1, 1, length).contiguous()};
}

inline double learning_rate(int64_t step, int64_t steps, double peak) {
  const int64_t warmup = std::max<int64_t>(1, steps / 20);
  if (step < warmup) return peak * static_cast<double>(step + 1) / static_cast<double>(warmup);
  const double progress = static_cast<double>(step - warmup) / static_cast<double>(std::max<int64_t>(1, steps - warmup));
  return peak * (0.1 + 0.9 * 0.5 * (1.0 + std::cos(std::numbers::pi * progress)));
}

}  // namespace specdec::text
