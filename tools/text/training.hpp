// What the trainers in tools/ share: random training windows of a byte stream, the target's own
// continuations (self-distillation data) and the learning rate schedule (linear warm-up over the
// first 5% of steps, then a cosine down to 10% of the peak). Not a public header.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <numbers>
#include <optional>
#include <stdexcept>
#include <string>
#include <random>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "specdec/batch.hpp"
#include "specdec/generate.hpp"
#include "python_corpus.hpp"

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

// The training text of a trainer's --data: none (the target's own generations only), or a folder
// of Python sources read as bytes, which needs a byte-level target.
inline std::optional<PythonCorpus> corpus_for(const std::string& data, int64_t vocab) {
  if (data == "none") return std::nullopt;
  if (vocab != 256) {
    throw std::invalid_argument("--data reads text as bytes: it needs a byte-level target (vocabulary 256), not " +
                                std::to_string(vocab) + "; use --data none");
  }
  return load_python_corpus(data);
}

// `count` sequences of `length` tokens [count, length]: a prompt (a random 32-token window of
// `stream`, or {bos} without one), then the target's own continuation sampled at `temperature`
// (0: greedy), the rows generated together by autoregressive_generate_batch (padded with bos
// where one ends early).
template <class Model>
at::Tensor continuations(Model& target, const std::vector<uint8_t>* stream, int64_t bos, int64_t count, int64_t length,
                         std::mt19937_64& rng, double temperature = 1.0) {
  const int64_t prompt_length = stream != nullptr ? 32 : 1;
  std::vector<std::vector<int64_t>> prompts(static_cast<size_t>(count), std::vector<int64_t>{bos});
  if (stream != nullptr) {
    const at::Tensor windows = batch_of(*stream, count, prompt_length, rng).first;
    for (int64_t i = 0; i < count; ++i) {
      const int64_t* row = windows[i].data_ptr<int64_t>();
      prompts[static_cast<size_t>(i)].assign(row, row + prompt_length);
    }
  }
  const GenerationOptions options{.max_new_tokens = length - prompt_length, .seed = rng()};
  const std::vector<GenerationResult> results =
      temperature == 0.0 ? autoregressive_generate_batch(target, prompts, options)
                         : autoregressive_generate_batch(target, prompts, options, MultinomialProcessor(temperature));
  at::Tensor rows = at::full({count, length}, bos, at::TensorOptions().dtype(at::kLong));
  for (int64_t i = 0; i < count; ++i) {
    std::vector<int64_t> row = std::move(prompts[static_cast<size_t>(i)]);
    row.insert(row.end(), results[static_cast<size_t>(i)].tokens.begin(), results[static_cast<size_t>(i)].tokens.end());
    std::copy_n(row.begin(), std::min<int64_t>(length, static_cast<int64_t>(row.size())), rows[i].data_ptr<int64_t>());
  }
  return rows;
}

// Prompts for a trainer's held-out measurement: the first 64 bytes of up to `count` held-out
// files, or, without files, bos and 8 tokens the target samples after it with seeds training
// never uses.
template <class Model>
std::vector<std::vector<int64_t>> held_out_prompts(Model& target, const std::vector<std::filesystem::path>* files, int64_t bos,
                                                   int64_t count) {
  std::vector<std::vector<int64_t>> prompts;
  for (int64_t p = 0; p < count; ++p) {
    if (files != nullptr) {
      if (static_cast<size_t>(p) >= files->size()) break;
      std::ifstream in((*files)[static_cast<size_t>(p)], std::ios::binary);
      std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      text.resize(std::min<size_t>(text.size(), 64));
      prompts.emplace_back(text.begin(), text.end());
    } else {
      const auto opening = autoregressive_generate(target, std::vector<int64_t>{bos},
                                                   {.max_new_tokens = 8, .seed = ~uint64_t{0} - static_cast<uint64_t>(p)},
                                                   MultinomialProcessor(1.0));
      prompts.push_back({bos});
      prompts.back().insert(prompts.back().end(), opening.tokens.begin(), opening.tokens.end());
    }
  }
  return prompts;
}

// A trainer's held-out measurement of a draft source (make_source() gives a fresh one per
// prompt): greedy, 128 new tokens, drafts accepted per step, tokens per target call, and whether
// every output equals the target's alone.
struct HeldOut {
  double accepted_per_step = 0;
  double tokens_per_call = 0;
  double drafter_calls_per_step = 0;
  bool identical = true;
};
template <class Model, class MakeSource>
HeldOut measure_held_out(Model& target, const std::vector<std::vector<int64_t>>& prompts, MakeSource make_source,
                         int64_t gamma) {
  int64_t steps = 0, accepted = 0, tokens = 0, calls = 0;
  HeldOut result;
  for (const auto& prompt : prompts) {
    auto source = make_source();
    const auto spec = generate_with(source, target, prompt, {.max_new_tokens = 128, .gamma = gamma});
    result.identical = result.identical && spec.tokens == autoregressive_generate(target, prompt, {.max_new_tokens = 128}).tokens;
    steps += spec.stats.steps;
    accepted += spec.stats.accepted;
    calls += spec.stats.drafter_calls;
    tokens += static_cast<int64_t>(spec.tokens.size());
  }
  result.accepted_per_step = static_cast<double>(accepted) / static_cast<double>(std::max<int64_t>(1, steps));
  result.tokens_per_call = static_cast<double>(tokens) / static_cast<double>(std::max<int64_t>(1, steps));
  result.drafter_calls_per_step = static_cast<double>(calls) / static_cast<double>(std::max<int64_t>(1, steps));
  return result;
}

// Prints a held-out measurement as both trainers report it (the smoke tests match this line).
inline void print_held_out(const HeldOut& held_out, int64_t gamma) {
  std::printf("held-out, greedy, gamma %lld: %.4g drafts accepted per step, %.4g tokens per target call; "
              "output identical to the target alone: %s\n",
              static_cast<long long>(gamma), held_out.accepted_per_step, held_out.tokens_per_call,
              held_out.identical ? "yes" : "NO");
  std::fflush(stdout);
}

inline double learning_rate(int64_t step, int64_t steps, double peak) {
  const int64_t warmup = std::max<int64_t>(1, steps / 20);
  if (step < warmup) return peak * static_cast<double>(step + 1) / static_cast<double>(warmup);
  const double progress = static_cast<double>(step - warmup) / static_cast<double>(std::max<int64_t>(1, steps - warmup));
  return peak * (0.1 + 0.9 * 0.5 * (1.0 + std::cos(std::numbers::pi * progress)));
}

}  // namespace specdec::text
