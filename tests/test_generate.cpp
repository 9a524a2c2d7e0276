// Generation: greedy speculative decoding equals autoregressive decoding token for token, caches
// hold exactly the accepted prefix, end tokens and length limits, seeds, stats and bad input.
#include <gtest/gtest.h>

#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>

#include "specdec/generate.hpp"
#include "specdec/threads.hpp"
#include "specdec/models/llama.hpp"
#include "support/expect_invalid.hpp"
#include "support/llama_fixtures.hpp"
#include "support/toy_models.hpp"

// One namespace a file: specdec_tests is compiled as a unity build (tests/CMakeLists.txt).
namespace test_generate {

namespace {

using namespace specdec;
using test::expect_invalid;
using test::PrefixHashModel;

const std::vector<int64_t> kPrompt{1, 7, 3, 22, 5};

// gamma x use_cache x first_target
class GreedySpeculative : public ::testing::TestWithParam<std::tuple<int64_t, bool, bool>> {
 protected:
  SpeculativeOptions options(int64_t max_new_tokens) const {
    const auto [gamma, use_cache, first_target] = GetParam();
    return SpeculativeOptions{.max_new_tokens = max_new_tokens, .use_cache = use_cache,
                              .gamma = gamma, .first_target = first_target};
  }
};

TEST_P(GreedySpeculative, PrefixHashModelEqualsAutoregressive) {
  PrefixHashModel target(40, 1);
  PrefixHashModel drafter(40, 1, /*disagree_every=*/3);
  const auto reference = autoregressive_generate(target, kPrompt, {.max_new_tokens = 60});
  const auto result = speculative_generate(drafter, target, kPrompt, options(60));
  EXPECT_EQ(result.tokens, reference.tokens);
  // Both branches ran: some drafts accepted, some rejected.
  EXPECT_GT(result.stats.accepted, 0);
  EXPECT_LT(result.stats.accepted, result.stats.drafted);
}

TEST_P(GreedySpeculative, LlamaEqualsAutoregressiveWithBothCacheTypes) {
  const models::LlamaConfig config = test::small_llama_config();
  const models::LlamaWeights weights = models::LlamaWeights::random(config, 21, at::kDouble);
  models::LlamaModel<DynamicKVCache> target(config, weights);
  models::LlamaModel<StaticKVCache> static_target(config, weights);
  models::LlamaModel<StaticKVCache> drafter(config, test::perturbed(weights, 0.15, 4));
  models::LlamaModel<DynamicKVCache> dynamic_drafter(config, test::perturbed(weights, 0.15, 4));
  const auto reference = autoregressive_generate(target, kPrompt, {.max_new_tokens = 40});
  const auto with_static_drafter = speculative_generate(drafter, target, kPrompt, options(40));
  const auto with_static_target = speculative_generate(dynamic_drafter, static_target, kPrompt, options(40));
  EXPECT_EQ(with_static_drafter.tokens, reference.tokens);
  EXPECT_EQ(with_static_target.tokens, reference.tokens);
  EXPECT_GT(with_static_drafter.stats.accepted, 0);
  EXPECT_LT(with_static_drafter.stats.accepted, with_static_drafter.stats.drafted);
}

INSTANTIATE_TEST_SUITE_P(GammaCacheFirstTarget, GreedySpeculative,
                         ::testing::Combine(::testing::Range<int64_t>(1, 9), ::testing::Bool(),
                                            ::testing::Bool()));

// Records, at every forward, the step it belongs to and the tokens its cache held.
class RecordingModel {
 public:
  using cache_type = test::TokenCache;
  struct Forward {
    int64_t step;
    std::vector<int64_t> cached;
  };
  RecordingModel(int64_t vocab, uint64_t seed, int64_t disagree_every, const int64_t& step)
      : model_(vocab, seed, disagree_every), step_(step) {}
  [[nodiscard]] cache_type make_cache(int64_t batch) const { return model_.make_cache(batch); }
  at::Tensor forward(const at::Tensor& ids, cache_type& cache) {
    std::vector<int64_t> cached;
    if (cache.length() > 0) {
      const at::Tensor all = cache.append(at::empty({1, 0}, at::kLong));
      cached.assign(all.data_ptr<int64_t>(), all.data_ptr<int64_t>() + all.numel());
    }
    forwards_.push_back({step_, cached});
    return model_.forward(ids, cache);
  }
  [[nodiscard]] int64_t vocab_size() const { return model_.vocab_size(); }
  [[nodiscard]] at::Device device() const { return model_.device(); }
  const std::vector<Forward>& forwards() const { return forwards_; }

 private:
  test::PrefixHashModel model_;
  const int64_t& step_;
  std::vector<Forward> forwards_;
};

TEST(SpeculativeGenerate, CachesHoldExactlyTheAcceptedPrefixAtEveryStep) {
  int64_t step = 0;
  std::vector<int64_t> length_before_step{static_cast<int64_t>(kPrompt.size())};
  RecordingModel target(40, 1, 0, step);
  RecordingModel drafter(40, 1, 3, step);
  const auto result = speculative_generate(
      drafter, target, kPrompt,
      {.max_new_tokens = 50,
       .on_step = [&](const StepInfo& info) {
         ++step;
         length_before_step.push_back(info.position + static_cast<int64_t>(info.emitted.size()));
       },
       .gamma = 4});
  std::vector<int64_t> sequence = kPrompt;
  sequence.insert(sequence.end(), result.tokens.begin(), result.tokens.end());
  ASSERT_LT(result.stats.accepted, result.stats.drafted);
  ASSERT_EQ(static_cast<int64_t>(target.forwards().size()), result.stats.steps);
  // The target runs once per step; its cache holds every token of the sequence but the last one
  // sampled: the accepted prefix, nothing pruned too much or too little.
  for (const auto& forward : target.forwards()) {
    const int64_t length = length_before_step[static_cast<size_t>(forward.step)];
    if (forward.step == 0) continue;
    EXPECT_EQ(static_cast<int64_t>(forward.cached.size()), length - 1) << "step " << forward.step;
    EXPECT_TRUE(std::equal(forward.cached.begin(), forward.cached.end(), sequence.begin()))
        << "step " << forward.step;
  }
  // The drafter's first forward of a step sees a cache that is a prefix of the sequence.
  int64_t checked = 0;
  for (size_t i = 0; i < drafter.forwards().size(); ++i) {
    const auto& forward = drafter.forwards()[i];
    if (i > 0 && drafter.forwards()[i - 1].step == forward.step) continue;
    EXPECT_LE(static_cast<int64_t>(forward.cached.size()),
              length_before_step[static_cast<size_t>(forward.step)]);
    EXPECT_TRUE(std::equal(forward.cached.begin(), forward.cached.end(), sequence.begin()))
        << "step " << forward.step;
    checked += forward.cached.empty() ? 0 : 1;
  }
  EXPECT_GT(checked, 5);
}

TEST(SpeculativeGenerate, CacheOnAndOffDraftAndAcceptTheSame) {
  PrefixHashModel target(40, 2);
  PrefixHashModel drafter(40, 2, 4);
  for (int64_t gamma : {1, 3, 6}) {
    const auto cached = speculative_generate(drafter, target, kPrompt, {.max_new_tokens = 40, .gamma = gamma});
    const auto uncached = speculative_generate(drafter, target, kPrompt,
                                               {.max_new_tokens = 40, .use_cache = false, .gamma = gamma});
    EXPECT_EQ(cached.tokens, uncached.tokens);
    EXPECT_EQ(cached.stats.drafted, uncached.stats.drafted);
    EXPECT_EQ(cached.stats.accepted, uncached.stats.accepted);
    EXPECT_EQ(cached.stats.target_calls, uncached.stats.target_calls);
  }
}

TEST(SpeculativeGenerate, EndTokenInsideAnAcceptedRunEndsGenerationThere) {
  PrefixHashModel target(40, 3);
  // The drafter is the target: every draft is accepted, so runs of gamma + 1 tokens are emitted.
  const auto free_run = autoregressive_generate(target, kPrompt, {.max_new_tokens = 30});
  // An end token at output position 4: the first target step emits position 0, the next step
  // emits positions 1..6 with position 4 in the middle of the accepted drafts.
  const int64_t eos = free_run.tokens[4];
  const auto first = std::find(free_run.tokens.begin(), free_run.tokens.end(), eos);
  const auto expected_length = static_cast<size_t>(first - free_run.tokens.begin()) + 1;
  ASSERT_GE(expected_length, 2u);

  const auto reference = autoregressive_generate(target, kPrompt, {.max_new_tokens = 30, .eos_token_ids = {eos}});
  bool ended_inside_drafts = false;
  const auto result = speculative_generate(
      target, target, kPrompt,
      {.max_new_tokens = 30, .eos_token_ids = {eos},
       .on_step = [&](const StepInfo& step) {
         if (!step.emitted.empty() && step.emitted.back() == eos && step.accepted > 0 &&
             step.emitted.size() <= static_cast<size_t>(step.accepted)) {
           ended_inside_drafts = true;
         }
       },
       .gamma = 5});
  EXPECT_EQ(reference.tokens.size(), expected_length);
  EXPECT_EQ(result.tokens, reference.tokens);
  EXPECT_TRUE(ended_inside_drafts || expected_length == 1u);
}

TEST(SpeculativeGenerate, NeverExceedsMaxNewTokens) {
  PrefixHashModel target(40, 4);
  PrefixHashModel drafter(40, 4, 5);
  for (int64_t max_new : {0, 1, 2, 3, 7, 16}) {
    for (int64_t gamma : {1, 4, 8}) {
      for (bool first_target : {true, false}) {
        const auto result = speculative_generate(
            drafter, target, kPrompt,
            {.max_new_tokens = max_new, .gamma = gamma, .first_target = first_target});
        EXPECT_EQ(static_cast<int64_t>(result.tokens.size()), max_new);
        EXPECT_EQ(result.stats.generated, max_new);
      }
    }
  }
  const auto none = autoregressive_generate(target, kPrompt, {.max_new_tokens = 0});
  EXPECT_TRUE(none.tokens.empty());
  EXPECT_EQ(none.stats.target_calls, 0);
}

TEST(SpeculativeGenerate, StopsAtTheModelsMaxSequenceLength) {
  models::LlamaConfig config = test::small_llama_config();
  config.max_seq_len = 16;
  const auto weights = models::LlamaWeights::random(config, 8, at::kDouble);
  models::LlamaModel<StaticKVCache> target(config, weights);
  models::LlamaModel<StaticKVCache> drafter(config, weights);
  const auto reference = autoregressive_generate(target, kPrompt, {.max_new_tokens = 40});
  EXPECT_EQ(reference.tokens.size(), 16u - kPrompt.size());
  for (int64_t gamma : {1, 5, 8}) {
    const auto result = speculative_generate(drafter, target, kPrompt, {.max_new_tokens = 40, .gamma = gamma});
    EXPECT_EQ(result.tokens, reference.tokens);
  }
  EXPECT_THROW((void)autoregressive_generate(target, std::vector<int64_t>(17, 1)), std::invalid_argument);
}

TEST(SpeculativeGenerate, SameSeedSameOutputUnderSampling) {
  PrefixHashModel target(40, 5);
  PrefixHashModel drafter(40, 5, 2);
  const MultinomialProcessor processor{1.0};
  const auto run = [&](uint64_t seed) {
    return speculative_generate(drafter, target, kPrompt, {.max_new_tokens = 40, .seed = seed, .gamma = 4},
                                processor)
        .tokens;
  };
  EXPECT_EQ(run(9), run(9));
  EXPECT_NE(run(9), run(10));
  const auto ar = [&](uint64_t seed) {
    return autoregressive_generate(target, kPrompt, {.max_new_tokens = 40, .seed = seed}, processor).tokens;
  };
  EXPECT_EQ(ar(3), ar(3));
}

TEST(SpeculativeGenerate, StatsAndStepCallbackAgree) {
  PrefixHashModel target(40, 6);
  PrefixHashModel drafter(40, 6, 3);
  std::vector<int64_t> streamed;
  int64_t drafted = 0, accepted = 0, steps = 0;
  const auto result = speculative_generate(
      drafter, target, kPrompt,
      {.max_new_tokens = 45, .on_step = [&](const StepInfo& step) {
         EXPECT_EQ(step.step, steps++);
         EXPECT_EQ(step.position, static_cast<int64_t>(kPrompt.size() + streamed.size()));
         EXPECT_LE(step.accepted, static_cast<int64_t>(step.drafts.size()));
         EXPECT_TRUE(std::equal(step.drafts.begin(), step.drafts.begin() + step.accepted,
                                step.emitted.begin()));
         EXPECT_EQ(step.emitted.back(), step.token);
         drafted += static_cast<int64_t>(step.drafts.size());
         accepted += step.accepted;
         streamed.insert(streamed.end(), step.emitted.begin(), step.emitted.end());
       }, .gamma = 3});
  EXPECT_EQ(streamed, result.tokens);
  EXPECT_EQ(result.stats.drafted, drafted);
  EXPECT_EQ(result.stats.accepted, accepted);
  EXPECT_EQ(result.stats.steps, steps);
  EXPECT_EQ(result.stats.target_calls, steps);
  EXPECT_EQ(result.stats.drafter_calls, drafted);
  EXPECT_DOUBLE_EQ(result.stats.acceptance_rate(), static_cast<double>(accepted) / drafted);
  EXPECT_GT(result.stats.tokens_per_target_call(), 1.0);
  EXPECT_GE(result.stats.total_seconds, result.stats.target_seconds + result.stats.drafter_seconds);
  EXPECT_EQ(GenerationStats{}.acceptance_rate(), 0.0);
}

TEST(SpeculativeGenerate, RejectsBadInputNamingIt) {
  PrefixHashModel target(40, 1);
  PrefixHashModel drafter(40, 1, 3);
  PrefixHashModel small(30, 1);
  const std::vector<int64_t> empty;
  expect_invalid([&] { (void)speculative_generate(drafter, target, empty); }, {"prompt", "empty"});
  expect_invalid([&] { (void)autoregressive_generate(target, empty); }, {"prompt", "empty"});
  expect_invalid([&] { (void)speculative_generate(drafter, target, std::vector<int64_t>{1, 40}); },
                 {"prompt[1]", "40"});
  expect_invalid([&] { (void)speculative_generate(drafter, target, std::vector<int64_t>{-2}); },
                 {"prompt[0]", "-2"});
  expect_invalid([&] { (void)speculative_generate(drafter, target, kPrompt, {.gamma = 0}); },
                 {"gamma", "0"});
  expect_invalid([&] { (void)speculative_generate(drafter, target, kPrompt, {.max_new_tokens = -1}); },
                 {"max_new_tokens", "-1"});
  expect_invalid([&] { (void)autoregressive_generate(target, kPrompt, {.max_new_tokens = -3}); },
                 {"max_new_tokens", "-3"});
  expect_invalid([&] { (void)speculative_generate(drafter, target, kPrompt, {.eos_token_ids = {2, 99}}); },
                 {"eos_token_ids[1]", "99"});
  expect_invalid([&] { (void)speculative_generate(small, target, kPrompt); },
                 {"drafter.vocab_size()", "30", "40"});
}

// A model that returns what it is told to: non-finite logits, a wrong shape, or an exception.
class FaultyModel {
 public:
  using cache_type = test::TokenCache;
  enum class Fault { kNaN, kInfinity, kWrongShape, kThrows };
  explicit FaultyModel(Fault fault) : fault_(fault) {}
  [[nodiscard]] cache_type make_cache(int64_t) const { return {}; }
  at::Tensor forward(const at::Tensor& ids, cache_type& cache) {
    cache.append(ids);
    at::Tensor logits = at::zeros({1, ids.size(1), 8});
    switch (fault_) {
      case Fault::kNaN: return logits.fill_(NAN);
      case Fault::kInfinity: return logits.index_fill_(2, at::tensor({3}, at::kLong), INFINITY);
      case Fault::kWrongShape: return at::zeros({1, ids.size(1), 7});
      case Fault::kThrows: throw std::runtime_error("device lost");
    }
    return logits;
  }
  [[nodiscard]] int64_t vocab_size() const { return 8; }
  [[nodiscard]] at::Device device() const { return at::kCPU; }

 private:
  Fault fault_;
};

TEST(SpeculativeGenerate, ReportsFaultyModelsClearly) {
  const std::vector<int64_t> prompt{1, 2};
  for (auto fault : {FaultyModel::Fault::kNaN, FaultyModel::Fault::kInfinity}) {
    FaultyModel target(fault);
    expect_invalid([&] { (void)autoregressive_generate(target, prompt); }, {"NaN or infinity"});
    expect_invalid([&] { (void)autoregressive_generate(target, prompt, {.seed = 1}, MultinomialProcessor{}); },
                   {"NaN or infinity"});
  }
  FaultyModel wrong_shape(FaultyModel::Fault::kWrongShape);
  expect_invalid([&] { (void)autoregressive_generate(wrong_shape, prompt); }, {"target.forward", "[1, 2, 7]"});
  FaultyModel nan_drafter(FaultyModel::Fault::kNaN);
  PrefixHashModel target(8, 1);
  expect_invalid([&] { (void)speculative_generate(nan_drafter, target, prompt, {.first_target = false}); },
                 {"NaN or infinity"});
  FaultyModel throwing(FaultyModel::Fault::kThrows);
  EXPECT_THROW((void)speculative_generate(throwing, target, prompt), std::runtime_error);
}

// Greedy drafts are deterministic: the source builds no one-hot q, only the finiteness of the
// logits behind them; sampled drafts carry their q.
TEST(ModelDraftSource, GreedyDraftsCarryNoDistributions) {
  PrefixHashModel drafter(8, 3);
  ModelDraftSource source(drafter);
  const std::vector<int64_t> sequence{1, 2, 3};
  source.start(sequence, {.gamma = 4});
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1);
  const Drafts greedy = source.draft({.sequence = sequence, .gamma = 4, .room = 4}, GreedyProcessor{}, gen);
  ASSERT_EQ(greedy.size(), 4);
  EXPECT_FALSE(greedy.probs.defined());
  ASSERT_TRUE(greedy.finite.defined());
  EXPECT_TRUE(greedy.finite.item<bool>());
  // The drafts are the drafter's greedy continuation.
  std::vector<int64_t> expected = sequence;
  for (int i = 0; i < 4; ++i) {
    auto cache = drafter.make_cache(1);
    const at::Tensor logits = drafter.forward(at::tensor(expected, at::kLong).view({1, -1}), cache);
    expected.push_back(logits[0][-1].argmax().item<int64_t>());
  }
  for (int64_t i = 0; i < 4; ++i) EXPECT_EQ(greedy.tokens[i].item<int64_t>(), expected[static_cast<size_t>(3 + i)]) << i;
  const std::vector<int64_t> after{1, 2, 3, 5};  // no draft accepted, the target's token 5 emitted
  source.verified({.sequence = after, .position = 3, .drafted = 4, .accepted = 0});
  const Drafts sampled = source.draft({.sequence = after, .gamma = 2, .room = 2}, MultinomialProcessor{}, gen);
  ASSERT_TRUE(sampled.probs.defined());
  EXPECT_EQ(sampled.probs.sizes(), (at::IntArrayRef{2, 8}));
  EXPECT_FALSE(sampled.finite.defined());
}

// Non-finite values are blamed on the right model, and on the temperature when the logits are
// finite.
TEST(SpeculativeGenerate, NamesTheModelOrTheTemperatureForNonFiniteDistributions) {
  const std::vector<int64_t> prompt{1, 2};
  FaultyModel nan_target(FaultyModel::Fault::kNaN);
  expect_invalid([&] { (void)autoregressive_generate(nan_target, prompt); },
                 {"the target model's logits contain NaN or infinity"});
  expect_invalid([&] { (void)autoregressive_generate(nan_target, prompt, {}, MultinomialProcessor{}); },
                 {"the target model's logits contain NaN or infinity"});
  FaultyModel nan_drafter(FaultyModel::Fault::kNaN);
  PrefixHashModel target(8, 1);
  expect_invalid([&] { (void)speculative_generate(nan_drafter, target, prompt, {.first_target = false}); },
                 {"the drafter"});
  expect_invalid([&] { (void)speculative_generate(nan_drafter, target, prompt, {.first_target = false},
                                                  MultinomialProcessor{}); },
                 {"the drafter's distribution contains NaN or infinity"});
  // Finite logits divided by a temperature of 1e-300 overflow: the temperature is named.
  expect_invalid([&] { (void)autoregressive_generate(target, prompt, {}, MultinomialProcessor{1e-300}); },
                 {"the target's logits are finite", "temperature is too small"});
}

// set_threads sets libtorch's pool and the loaded BLAS's pool together (OpenBLAS here).
TEST(Threads, OneSettingForTorchAndTheLoadedBlas) {
  const ThreadSettings before = thread_settings();
  for (const int n : {2, 1}) {
    const ThreadSettings after = set_threads(n);
    EXPECT_EQ(after.torch, n);
    if (after.blas) {
      EXPECT_EQ(*after.blas, n) << after.blas_name;
      // OpenBLAS names the kernels it chose, and the printed settings show them.
      if (after.blas_name == "openblas") {
        EXPECT_FALSE(after.blas_core.empty());
        std::ostringstream printed;
        printed << after;
        EXPECT_NE(printed.str().find("(" + after.blas_core + ")"), std::string::npos) << printed.str();
      }
    } else {
      std::cout << "no BLAS thread setting found in this process: only libtorch's pool was set\n";
    }
  }
  EXPECT_EQ(thread_settings().torch, 1);
  expect_invalid([] { (void)set_threads(0); }, {"threads", "0"});
  // The cores this process may use: at least one, at most the hardware's.
  EXPECT_GE(available_cores(), 1);
  if (std::thread::hardware_concurrency() > 0) {
    EXPECT_LE(available_cores(), static_cast<int>(std::thread::hardware_concurrency()));
  }
  (void)set_threads(before.torch);
  if (before.blas) {
    EXPECT_EQ(*thread_settings().blas, before.torch);
  }
}

TEST(SpeculativeGenerate, DrafterOnCpuTargetOnCuda) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device on this machine";
  const models::LlamaConfig config = test::small_llama_config();
  const auto weights = models::LlamaWeights::random(config, 21, at::kDouble);
  models::LlamaModel<StaticKVCache> drafter(config, test::perturbed(weights, 0.15, 4));
  models::LlamaModel<StaticKVCache> target(config, models::LlamaWeights::random(config, 21, at::TensorOptions(at::kDouble).device(at::kCUDA)));
  const auto reference = autoregressive_generate(target, kPrompt, {.max_new_tokens = 30});
  const auto result = speculative_generate(drafter, target, kPrompt, {.max_new_tokens = 30, .gamma = 4});
  EXPECT_EQ(result.tokens, reference.tokens);
}

}  // namespace

}  // namespace test_generate
