// Batched generation with per-row acceptance: greedy rows equal their single-sequence output for
// batches of 1..8 with mixed prompt lengths and gamma 1..8, on the prefix-hash toy model and on
// Llama with both cache types; sampled rows are exactly the target's distribution (with a power
// check); one host copy per step for the whole batch; rows that finish leave the batch; bad input.
// Rows near the target's and the drafter's context limits, and the other places where a batch or a
// tree meets a limit (STAND trees, beam search, sessions whose turn crosses the drafter's limit).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "specdec/batch.hpp"
#include "specdec/beam_search.hpp"
#include "specdec/drafting/stand.hpp"
#include "specdec/generate.hpp"
#include "specdec/models/llama.hpp"
#include "specdec/remote/forward_queue.hpp"
#include "specdec/remote/session_batch.hpp"
#include "specdec/session.hpp"
#include "support/expect_invalid.hpp"
#include "support/host_copies.hpp"
#include "support/llama_fixtures.hpp"
#include "support/markov_fixtures.hpp"
#include "support/statistics.hpp"
#include "support/toy_models.hpp"

// One namespace a file: specdec_tests is compiled as a unity build (tests/CMakeLists.txt).
namespace test_batch {

namespace {

using namespace specdec;
using test::PrefixHashModel;

// `count` prompts of lengths 1, 4, 7, ... (mod 13) + 1 with varied tokens.
std::vector<std::vector<int64_t>> mixed_prompts(int64_t count, int64_t vocab) {
  std::vector<std::vector<int64_t>> prompts;
  for (int64_t r = 0; r < count; ++r) {
    std::vector<int64_t> prompt;
    for (int64_t i = 0; i < (3 * r) % 13 + 1; ++i) prompt.push_back((7 * r + 5 * i + 3) % vocab);
    prompts.push_back(prompt);
  }
  return prompts;
}

TEST(BatchGreedy, PrefixHashRowsEqualTheirSingleSequenceOutput) {
  PrefixHashModel target(40, 1);
  PrefixHashModel drafter(40, 1, /*disagree_every=*/3);
  for (int64_t batch : {1, 2, 5, 8}) {
    const auto prompts = mixed_prompts(batch, 40);
    std::vector<std::vector<int64_t>> reference;
    for (const auto& prompt : prompts) {
      reference.push_back(autoregressive_generate(target, prompt, {.max_new_tokens = 20 + 3 * static_cast<int64_t>(reference.size())}).tokens);
    }
    for (int64_t gamma = 1; gamma <= 8; ++gamma) {
      // Rows with different max_new_tokens would need per-row options: use the longest and cut.
      const auto results = speculative_generate_batch(drafter, target, prompts, {.max_new_tokens = 20, .gamma = gamma});
      ASSERT_EQ(results.size(), prompts.size());
      int64_t accepted = 0, drafted = 0;
      for (size_t r = 0; r < prompts.size(); ++r) {
        EXPECT_EQ(results[r].tokens, std::vector<int64_t>(reference[r].begin(), reference[r].begin() + 20))
            << "batch " << batch << " gamma " << gamma << " row " << r;
        accepted += results[r].stats.accepted;
        drafted += results[r].stats.drafted;
      }
      EXPECT_GT(accepted, 0);
      EXPECT_LT(accepted, drafted);
    }
    const auto autoregressive = autoregressive_generate_batch(target, prompts, {.max_new_tokens = 20});
    for (size_t r = 0; r < prompts.size(); ++r) {
      EXPECT_EQ(autoregressive[r].tokens, std::vector<int64_t>(reference[r].begin(), reference[r].begin() + 20));
    }
  }
}

template <class Cache>
class BatchLlama : public ::testing::Test {};
using CacheTypes = ::testing::Types<StaticKVCache, DynamicKVCache>;
TYPED_TEST_SUITE(BatchLlama, CacheTypes);

TYPED_TEST(BatchLlama, RowsEqualTheirSingleSequenceOutput) {
  const models::LlamaConfig config = test::small_llama_config();
  const auto weights = models::LlamaWeights::random(config, 21, at::kDouble);
  models::LlamaModel<TypeParam> target(config, weights);
  models::LlamaModel<TypeParam> drafter(config, test::perturbed(weights, 0.04, 4));
  for (int64_t batch : {1, 3, 8}) {
    const auto prompts = mixed_prompts(batch, config.vocab_size);
    std::vector<GenerationResult> single;
    for (const auto& prompt : prompts) single.push_back(autoregressive_generate(target, prompt, {.max_new_tokens = 24}));
    for (int64_t gamma = 1; gamma <= 8; ++gamma) {
      const auto results = speculative_generate_batch(drafter, target, prompts, {.max_new_tokens = 24, .gamma = gamma});
      int64_t accepted = 0, drafted = 0;
      for (size_t r = 0; r < prompts.size(); ++r) {
        EXPECT_EQ(results[r].tokens, single[r].tokens) << "batch " << batch << " gamma " << gamma << " row " << r;
        accepted += results[r].stats.accepted;
        drafted += results[r].stats.drafted;
        // Each row's own acceptance is the single-sequence one: the same drafts, the same verdicts.
        const auto alone = speculative_generate(drafter, target, prompts[r], {.max_new_tokens = 24, .gamma = gamma});
        EXPECT_EQ(results[r].stats.accepted, alone.stats.accepted) << "row " << r;
      }
      EXPECT_GT(accepted, 0);
      EXPECT_LT(accepted, drafted);
    }
    const auto autoregressive = autoregressive_generate_batch(target, prompts, {.max_new_tokens = 24});
    for (size_t r = 0; r < prompts.size(); ++r) EXPECT_EQ(autoregressive[r].tokens, single[r].tokens);
  }
}

TEST(BatchGreedy, RowsFinishIndependentlyAndLeaveTheBatch) {
  PrefixHashModel target(40, 1);
  PrefixHashModel drafter(40, 1, 3);
  const auto prompts = mixed_prompts(4, 40);
  // Row 1 ends early at an end token; the others run to max_new_tokens.
  const auto row1 = autoregressive_generate(target, prompts[1], {.max_new_tokens = 30}).tokens;
  const int64_t end_token = row1[5];
  const auto results = speculative_generate_batch(drafter, target, prompts,
                                                  {.max_new_tokens = 30, .eos_token_ids = {end_token}, .gamma = 4});
  for (size_t r = 0; r < prompts.size(); ++r) {
    const auto alone = autoregressive_generate(target, prompts[r], {.max_new_tokens = 30, .eos_token_ids = {end_token}});
    EXPECT_EQ(results[r].tokens, alone.tokens) << "row " << r;
    EXPECT_EQ(results[r].stop_reason, alone.stop_reason) << "row " << r;
  }
  EXPECT_EQ(results[1].stop_reason, StopReason::end_token);
  // A finished row takes part in no later forward.
  EXPECT_LT(results[1].stats.target_calls, results[0].stats.target_calls);
}

TEST(BatchGreedy, NGramRowsEqualAutoregressive) {
  PrefixHashModel target(12, 3);
  const auto prompts = mixed_prompts(5, 12);
  NGramStorage storage(3, 12);
  const auto results = ngram_assisted_generate_batch(storage, target, prompts,
                                                     {.max_new_tokens = 30, .gamma = 4, .filler_top_k = 1});
  int64_t accepted = 0;
  for (size_t r = 0; r < prompts.size(); ++r) {
    EXPECT_EQ(results[r].tokens, autoregressive_generate(target, prompts[r], {.max_new_tokens = 30}).tokens);
    accepted += results[r].stats.accepted;
  }
  EXPECT_GT(accepted, 0);
  // Confident drafting in a batch: each row stops its own draft where the counts are not confident.
  NGramStorage confident(3, 12);
  const NGramDraftRule rule{.min_share = 0.9, .min_context = 2};
  const auto stopped = ngram_assisted_generate_batch(
      confident, target, prompts, {.max_new_tokens = 30, .gamma = 4, .filler_top_k = 1, .draft_rule = rule});
  int64_t drafted = 0, drafted_neutral = 0;
  for (size_t r = 0; r < prompts.size(); ++r) {
    EXPECT_EQ(stopped[r].tokens, results[r].tokens) << r;
    drafted += stopped[r].stats.drafted;
    drafted_neutral += results[r].stats.drafted;
  }
  EXPECT_LT(drafted, drafted_neutral);
  PromptLookupDrafter lookup;
  EXPECT_THROW((void)ngram_assisted_generate_batch(lookup, target, prompts, {.filler_top_k = 1, .draft_rule = rule}),
               std::invalid_argument);
}

// The greedy batch verification from logits against rejection sampling on the one-hot
// distributions, with ties, padded rows, one-hot and absent q, and NaN rows reported.
TEST(BatchGreedy, FastVerificationEqualsRejectionSamplingWithOneHotDistributions) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
  at::Generator uniforms = at::make_generator<at::CPUGeneratorImpl>(6);
  const GreedyProcessor greedy;
  for (int64_t trial = 0; trial < 100; ++trial) {
    const int64_t b = 1 + trial % 4, k = trial % 5;
    at::Tensor logits = at::randint(0, 3, {b, k + 1, 7}, gen, at::TensorOptions(at::kFloat));
    at::Tensor drafts = at::randint(0, 7, {b, k}, gen, at::TensorOptions(at::kLong));
    if (k > 0) {  // drafts mostly the argmax, so that rows accept several
      const at::Tensor best = logits.narrow(1, 0, k).argmax(2);
      drafts = at::where(at::rand({b, k}, gen) < 0.7, best, drafts);
    }
    const at::Tensor valid = at::randint(0, k + 1, {b}, gen, at::TensorOptions(at::kLong));
    const at::Tensor q = trial % 2 == 0 ? at::Tensor() : greedy(at::randn({b, k, 7}, gen));
    const bool nan = trial % 25 == 3;
    if (nan) logits[b - 1][k][1] = NAN;
    const at::Tensor fast = specdec::detail::verify_batch_greedy(logits, q, drafts, valid);
    const at::Tensor exact = specdec::detail::verify_batch(greedy(logits), q, drafts, valid, greedy, uniforms, false);
    ASSERT_EQ(fast.sizes(), exact.sizes());
    for (int64_t r = 0; r < b; ++r) {
      EXPECT_EQ(fast[r][2].item<int64_t>(), exact[r][2].item<int64_t>()) << "finite code, trial " << trial << " row " << r;
      if (nan && r == b - 1) {
        EXPECT_NE(fast[r][2].item<int64_t>(), specdec::detail::kFinite);
        continue;
      }
      EXPECT_TRUE(fast[r].equal(exact[r])) << "trial " << trial << " row " << r << ": " << fast[r] << " vs " << exact[r];
    }
  }
}

TEST(BatchHostCopies, OnePerStepForTheWholeBatch) {
  const models::LlamaConfig config = test::small_llama_config();
  const auto weights = models::LlamaWeights::random(config, 21, at::kDouble);
  models::LlamaModel<StaticKVCache> target(config, weights);
  models::LlamaModel<StaticKVCache> drafter(config, test::perturbed(weights, 0.04, 4));
  const auto prompts = mixed_prompts(6, config.vocab_size);
  int64_t steps = 0;
  const auto count = [&](const StepInfo& info) { steps = std::max(steps, info.step + 1); };
  const int64_t before = device_to_host_copies();
  const auto results = speculative_generate_batch(drafter, target, prompts,
                                                  {.max_new_tokens = 20, .on_step = count, .gamma = 4});
  // Every row takes part in every step until it finishes; all finish at max_new_tokens, the
  // longest-running row's steps are the batch's steps.
  int64_t batch_steps = 0;
  for (const auto& result : results) batch_steps = std::max(batch_steps, result.stats.steps);
  EXPECT_EQ(device_to_host_copies() - before, batch_steps);
  EXPECT_EQ(steps, batch_steps);
}

// Whether `observed` (how often each sequence of `count` tokens followed `last`, out of `samples`)
// fits the Markov target's distribution by chi-square at a tail of 1e-6.
bool fits_markov_target(const std::map<std::vector<int64_t>, int64_t>& observed, int64_t last, int64_t count,
                        int64_t samples) {
  const auto expected = test::sequence_probabilities(test::markov_target_rows(), last, count);
  const test::ChiSquare fit = test::chi_square(observed, expected, samples);
  return fit.outside_support == 0 && fit.statistic < test::chi_square_quantile(fit.dof, 4.75);
}

// Samples 2 tokens after prompts {0} and {2, 1} in batches, row by row, and checks each row's
// distribution against the Markov target's by chi-square at a tail of 1e-6. Returns whether
// every row passed.
bool rows_pass_chi_square(bool skip_sample_adjustment) {
  test::MarkovModel target(test::markov_target_rows());
  test::MarkovModel drafter(test::markov_drafter_rows());
  const std::vector<std::vector<int64_t>> prompts{{0}, {2, 1}};
  const MultinomialProcessor processor{1.0};
  constexpr int64_t kSamples = 2500;
  std::vector<std::map<std::vector<int64_t>, int64_t>> observed(prompts.size());
  for (int64_t i = 0; i < kSamples; ++i) {
    const auto results = speculative_generate_batch(
        drafter, target, prompts,
        {.max_new_tokens = 2, .seed = static_cast<uint64_t>(i), .gamma = 2, .first_target = false,
         .skip_sample_adjustment = skip_sample_adjustment},
        processor);
    for (size_t r = 0; r < prompts.size(); ++r) ++observed[r][results[r].tokens];
  }
  bool pass = true;
  for (size_t r = 0; r < prompts.size(); ++r) pass = fits_markov_target(observed[r], prompts[r].back(), 2, kSamples) && pass;
  return pass;
}

TEST(BatchSampling, EveryRowIsDistributedAsTheTarget) {
  EXPECT_TRUE(rows_pass_chi_square(/*skip_sample_adjustment=*/false));
  // Power: rows that sample a rejected position from p instead of their own residual fail.
  EXPECT_FALSE(rows_pass_chi_square(/*skip_sample_adjustment=*/true));
}

// A Markov model with a context limit: max_sequence_length() states it, and a forward that would
// hold more positions than it throws as a real model's does (so a batch that asks for padding past
// a row's limit fails here too).
class LimitedMarkov : public test::MarkovModel {
 public:
  LimitedMarkov(const at::Tensor& transitions, int64_t limit) : MarkovModel(transitions), limit_(limit) {}
  [[nodiscard]] int64_t max_sequence_length() const { return limit_; }
  at::Tensor forward(const at::Tensor& ids, test::TokenCache& cache) {
    if (cache.length() + ids.size(1) > limit_) {
      throw std::invalid_argument("cache length " + std::to_string(cache.length()) + " + " +
                                  std::to_string(ids.size(1)) + " new tokens exceeds the limit " + std::to_string(limit_));
    }
    return MarkovModel::forward(ids, cache);
  }

 private:
  int64_t limit_;
};

// Rows at different distances from the target's limit (and the drafter's): greedy rows equal
// their single-sequence output and stop reason at gamma 1..8, with both cache types; a row past
// the drafter's limit goes on with the target alone; the batch keeps one host copy per step.
TYPED_TEST(BatchLlama, RowsNearTheContextLimitsEqualTheirSingleSequenceOutput) {
  models::LlamaConfig config = test::small_llama_config();
  config.max_seq_len = 40;
  const auto weights = models::LlamaWeights::random(config, 21, at::kDouble);
  models::LlamaModel<TypeParam> target(config, weights);
  for (const int64_t drafter_limit : {int64_t{40}, int64_t{27}}) {
    models::LlamaConfig drafter_config = config;
    drafter_config.max_seq_len = drafter_limit;
    models::LlamaModel<TypeParam> drafter(drafter_config, test::perturbed(weights, 0.04, 4));
    for (int64_t gamma = 1; gamma <= 8; ++gamma) {
      std::vector<int64_t> lengths{39, 5, 38, 40 - gamma - 1, 3};
      if (drafter_limit < 40) {
        for (const int64_t l : {drafter_limit - 1, drafter_limit, drafter_limit + 1, drafter_limit - gamma - 1}) lengths.push_back(l);
      }
      std::vector<std::vector<int64_t>> prompts;
      for (size_t r = 0; r < lengths.size(); ++r) {
        std::vector<int64_t> prompt;
        for (int64_t i = 0; i < lengths[r]; ++i) prompt.push_back((11 * static_cast<int64_t>(r) + 5 * i + 3) % config.vocab_size);
        prompts.push_back(prompt);
      }
      const SpeculativeOptions options{.max_new_tokens = 64, .gamma = gamma};
      const int64_t copies = device_to_host_copies();
      const auto results = speculative_generate_batch(drafter, target, prompts, options);
      const int64_t batch_copies = device_to_host_copies() - copies;
      ASSERT_EQ(results.size(), prompts.size());
      int64_t batch_steps = 0;
      for (size_t r = 0; r < prompts.size(); ++r) {
        const auto alone = speculative_generate(drafter, target, prompts[r], options);
        EXPECT_EQ(results[r].tokens, alone.tokens) << "drafter limit " << drafter_limit << " gamma " << gamma << " row " << r;
        EXPECT_EQ(results[r].stop_reason, StopReason::sequence_limit) << "row " << r;
        EXPECT_EQ(static_cast<int64_t>(prompts[r].size() + results[r].tokens.size()), 40) << "row " << r;
        batch_steps = std::max(batch_steps, results[r].stats.steps);
      }
      EXPECT_EQ(batch_copies, batch_steps) << "drafter limit " << drafter_limit << " gamma " << gamma;
      const auto autoregressive = autoregressive_generate_batch(target, prompts, {.max_new_tokens = 64});
      for (size_t r = 0; r < prompts.size(); ++r) EXPECT_EQ(autoregressive[r].tokens, results[r].tokens) << "row " << r;
    }
  }
}

// The model-free sources near the target's limit: n-gram storage and prompt lookup.
TYPED_TEST(BatchLlama, NGramRowsNearTheLimitEqualTheirSingleSequenceOutput) {
  models::LlamaConfig config = test::small_llama_config();
  config.max_seq_len = 40;
  models::LlamaModel<TypeParam> target(config, models::LlamaWeights::random(config, 21, at::kDouble));
  for (int64_t gamma = 1; gamma <= 8; ++gamma) {
    std::vector<std::vector<int64_t>> prompts;
    for (const int64_t length : {int64_t{39}, int64_t{4}, int64_t{38}, 40 - gamma - 1, int64_t{12}}) {
      std::vector<int64_t> prompt;  // a repeating pattern, so that lookups find drafts
      for (int64_t i = 0; i < length; ++i) prompt.push_back((3 * (i % 5) + length) % config.vocab_size);
      prompts.push_back(prompt);
    }
    const NGramAssistedOptions options{.max_new_tokens = 64, .gamma = gamma, .filler_top_k = 1};
    NGramStorage storage(3, config.vocab_size);
    const auto results = ngram_assisted_generate_batch(storage, target, prompts, options);
    PromptLookupDrafter lookup;
    const auto looked_up = ngram_assisted_generate_batch(lookup, target, prompts, options);
    for (size_t r = 0; r < prompts.size(); ++r) {
      const auto alone = autoregressive_generate(target, prompts[r], {.max_new_tokens = 64});
      EXPECT_EQ(results[r].tokens, alone.tokens) << "gamma " << gamma << " row " << r;
      EXPECT_EQ(results[r].stop_reason, StopReason::sequence_limit) << "row " << r;
      EXPECT_EQ(looked_up[r].tokens, alone.tokens) << "prompt lookup, gamma " << gamma << " row " << r;
      EXPECT_EQ(looked_up[r].stop_reason, StopReason::sequence_limit) << "row " << r;
    }
  }
}

// Sampled rows at the target's limit - 1 and - 2, past and at the drafter's, and a short one: each
// row's tokens are distributed as the target's (chi-square at a tail of 1e-6). Returns whether
// every row passed.
bool rows_near_the_limit_pass_chi_square(bool skip_sample_adjustment) {
  constexpr int64_t kLimit = 8, kDrafterLimit = 5;
  LimitedMarkov target(test::markov_target_rows(), kLimit);
  LimitedMarkov drafter(test::markov_drafter_rows(), kDrafterLimit);
  // Rows: past the drafter's limit (2 tokens, target alone), 1 from the target's limit (1 token),
  // at the drafter's limit, 1 below it, and a short one (2 tokens each).
  const std::vector<std::vector<int64_t>> prompts{{0, 1, 2, 3, 0, 1}, {2, 1, 0, 3, 2, 1, 0}, {1, 2, 3, 0, 2}, {3, 3, 1, 0}, {0}};
  const MultinomialProcessor processor{1.0};
  constexpr int64_t kSamples = 2500;
  std::vector<std::map<std::vector<int64_t>, int64_t>> observed(prompts.size());
  for (int64_t i = 0; i < kSamples; ++i) {
    const auto results = speculative_generate_batch(
        drafter, target, prompts,
        {.max_new_tokens = 2, .seed = static_cast<uint64_t>(i), .gamma = 3, .first_target = false,
         .skip_sample_adjustment = skip_sample_adjustment},
        processor);
    for (size_t r = 0; r < prompts.size(); ++r) ++observed[r][results[r].tokens];
  }
  bool pass = true;
  for (size_t r = 0; r < prompts.size(); ++r) {
    const int64_t count = std::min<int64_t>(2, kLimit - static_cast<int64_t>(prompts[r].size()));
    pass = fits_markov_target(observed[r], prompts[r].back(), count, kSamples) && pass;
  }
  return pass;
}

TEST(BatchSampling, RowsNearTheContextLimitsAreDistributedAsTheTarget) {
  EXPECT_TRUE(rows_near_the_limit_pass_chi_square(/*skip_sample_adjustment=*/false));
  // Power: rows that sample a rejected position from p instead of their own residual fail.
  EXPECT_FALSE(rows_near_the_limit_pass_chi_square(/*skip_sample_adjustment=*/true));
}

// Caches of separate sessions joined into one batch: each row's logits and cache equal what its
// own cache gives for the same tokens, the split rows go on as working caches, and the parts are
// left unchanged (what the verification server's batched forward relies on).
TYPED_TEST(BatchLlama, JoinedCachesScoreEachRowAsItsOwnCache) {
  const models::LlamaConfig config = test::small_llama_config();
  models::LlamaModel<TypeParam> model(config, models::LlamaWeights::random(config, 33, at::kDouble));
  const auto ids = [](const std::vector<int64_t>& tokens) {
    return at::tensor(tokens, at::kLong).view({1, static_cast<int64_t>(tokens.size())});
  };
  // Cached prefixes of 5, 9 and 0 tokens; then 3, 1 and 4 new tokens (the widest row sets the width).
  const std::vector<std::vector<int64_t>> prefixes = {{1, 2, 3, 4, 5}, {9, 8, 7, 6, 5, 4, 3, 2, 1}, {}};
  const std::vector<std::vector<int64_t>> added = {{6, 7, 8}, {10}, {11, 12, 13, 14}};
  std::vector<TypeParam> own, parts;
  for (size_t r = 0; r < prefixes.size(); ++r) {
    own.push_back(model.make_cache(1));
    if (!prefixes[r].empty()) (void)model.forward(ids(prefixes[r]), own.back());
    parts.push_back(model.make_cache(1));
    if (!prefixes[r].empty()) (void)model.forward(ids(prefixes[r]), parts.back());
  }
  std::vector<const TypeParam*> pointers;
  for (const auto& part : parts) pointers.push_back(&part);
  TypeParam joined = TypeParam::join_rows(pointers);
  EXPECT_EQ(std::vector<int64_t>(joined.row_lengths().begin(), joined.row_lengths().end()), (std::vector<int64_t>{5, 9, 0}));
  at::Tensor padded = at::zeros({3, 4}, at::kLong);
  for (size_t r = 0; r < added.size(); ++r) {
    padded[static_cast<int64_t>(r)].narrow(0, 0, static_cast<int64_t>(added[r].size())).copy_(at::tensor(added[r], at::kLong));
  }
  const at::Tensor logits = model.forward(padded, joined);
  for (size_t r = 0; r < added.size(); ++r) {
    const auto row = static_cast<int64_t>(r);
    const auto count = static_cast<int64_t>(added[r].size());
    EXPECT_EQ(parts[r].length(), static_cast<int64_t>(prefixes[r].size())) << "a part changed, row " << r;
    const at::Tensor expected = model.forward(ids(added[r]), own[r]);
    EXPECT_TRUE(at::allclose(logits[row].narrow(0, 0, count), expected[0], 1e-9, 1e-9)) << "row " << r;
    TypeParam split = joined.split_row(row);
    ASSERT_EQ(split.length(), static_cast<int64_t>(prefixes[r].size()) + 4);
    split.prune(4 - count);  // the padding after the row's own tokens
    ASSERT_EQ(split.length(), own[r].length());
    for (int64_t layer = 0; layer < config.n_layers; ++layer) {
      EXPECT_TRUE(at::allclose(split.keys(layer), own[r].keys(layer), 1e-9, 1e-9)) << "row " << r << " layer " << layer;
      EXPECT_TRUE(at::allclose(split.values(layer), own[r].values(layer), 1e-9, 1e-9)) << "row " << r << " layer " << layer;
    }
    if constexpr (requires { joined.split_row_into(row, split); }) {
      // The same row copied into a cache that held something else (another row's positions, more
      // of them than this row has): it holds this row's positions alone, as the split row does.
      TypeParam into = joined.split_row((row + 1) % 3);
      (void)model.forward(ids({3, 3, 3, 3, 3, 3, 3}), into);
      joined.split_row_into(row, into);
      into.prune(4 - count);
      ASSERT_EQ(into.length(), own[r].length());
      EXPECT_EQ(std::vector<int64_t>(into.row_lengths().begin(), into.row_lengths().end()),
                std::vector<int64_t>{own[r].length()});
      for (int64_t layer = 0; layer < config.n_layers; ++layer) {
        EXPECT_TRUE(at::equal(into.keys(layer), split.keys(layer))) << "row " << r << " layer " << layer;
        EXPECT_TRUE(at::equal(into.values(layer), split.values(layer))) << "row " << r << " layer " << layer;
      }
      EXPECT_TRUE(at::allclose(model.forward(ids({15}), into), model.forward(ids({15}), own[r]), 1e-9, 1e-9))
          << "row " << r;
      (void)model.forward(ids({15}), split);
    } else {
      // The split row is a working cache of its own: one more token scores as on the row's own cache.
      EXPECT_TRUE(at::allclose(model.forward(ids({15}), split), model.forward(ids({15}), own[r]), 1e-9, 1e-9)) << "row " << r;
    }
  }
  if constexpr (requires(TypeParam& c) { joined.split_row_into(0, c); }) {
    TypeParam two_rows = model.make_cache(2);
    test::expect_invalid([&] { joined.split_row_into(3, two_rows); }, {"split_row", "[0, 3)", "3"});
    test::expect_invalid([&] { joined.split_row_into(0, two_rows); }, {"split_row_into", "one row", "got 2 rows"});
    TypeParam small(StaticKVCacheShape{.num_layers = config.n_layers, .batch = 1, .kv_heads = config.n_kv_heads,
                                       .capacity = 4, .head_dim = config.head_dim()},
                    at::TensorOptions().dtype(at::kDouble));
    test::expect_invalid([&] { joined.split_row_into(1, small); }, {"split_row_into", "capacity >= 13", "capacity 4"});
    TypeParam floats(StaticKVCacheShape{.num_layers = config.n_layers, .batch = 1, .kv_heads = config.n_kv_heads,
                                        .capacity = 64, .head_dim = config.head_dim()},
                     at::TensorOptions().dtype(at::kFloat));
    test::expect_invalid([&] { joined.split_row_into(1, floats); }, {"split_row_into", "into holds float", "this cache double"});
  }
  test::expect_invalid([&] { (void)TypeParam::join_rows(std::span<const TypeParam* const>()); }, {"join_rows", "none"});
  TypeParam two = model.make_cache(2);
  (void)model.forward(at::ones({2, 2}, at::kLong), two);
  const std::vector<const TypeParam*> with_two = {pointers[0], &two};
  test::expect_invalid([&] { (void)TypeParam::join_rows(with_two); }, {"caches[1]", "2 rows"});
  test::expect_invalid([&] { (void)joined.split_row(3); }, {"split_row", "[0, 3)", "3"});
}

TEST(BatchInput, RejectsBadInputNamingTheRow) {
  PrefixHashModel target(40, 1);
  PrefixHashModel drafter(40, 1, 3);
  PrefixHashModel other(30, 1);
  const std::vector<std::vector<int64_t>> none;
  test::expect_invalid([&] { (void)speculative_generate_batch(drafter, target, none); }, {"prompts must not be empty"});
  test::expect_invalid([&] { (void)speculative_generate_batch(drafter, target, std::vector<std::vector<int64_t>>{{1}, {}}); },
                       {"prompts[1]", "prompt must not be empty"});
  test::expect_invalid([&] { (void)autoregressive_generate_batch(target, std::vector<std::vector<int64_t>>{{1}, {2, 45}}); },
                       {"prompts[1]", "prompt[1]", "45"});
  test::expect_invalid([&] { (void)speculative_generate_batch(other, target, std::vector<std::vector<int64_t>>{{1}}); },
                       {"drafter.vocab_size()", "40", "30"});
  test::expect_invalid(
      [&] {
        (void)speculative_generate_batch(drafter, target, std::vector<std::vector<int64_t>>{{1}},
                                         {.gamma_policy = GammaPolicy::egag});
      },
      {"gamma_policy must be fixed"});
  models::LlamaConfig config = test::small_llama_config();
  config.max_seq_len = 8;
  models::LlamaModel<StaticKVCache> short_target(config, models::LlamaWeights::random(config, 2));
  test::expect_invalid(
      [&] { (void)autoregressive_generate_batch(short_target, std::vector<std::vector<int64_t>>{{1}, std::vector<int64_t>(9, 1)}); },
      {"prompts[1]", "max_sequence_length 8"});
}

// --- Other places a tree or a batch of beams meets a context limit ---------------------------------

// A Llama target of 40 positions and prompts ending 1, 2, 3 and 9 positions before it.
models::LlamaConfig limited_config() {
  models::LlamaConfig config = test::small_llama_config();
  config.max_seq_len = 40;
  return config;
}
std::vector<int64_t> limited_prompt(int64_t length, int64_t seed) {
  std::vector<int64_t> prompt;
  for (int64_t i = 0; i < length; ++i) prompt.push_back((3 * (i % 4) + seed) % 48);  // repeats: STAND drafts
  return prompt;
}

// STAND trees whose budget runs into the limit: the tree is cut to the room left, the output is
// the autoregressive one and ends with sequence_limit.
TYPED_TEST(BatchLlama, StandTreesNearTheLimitEqualAutoregressive) {
  const models::LlamaConfig config = limited_config();
  models::LlamaModel<TypeParam> target(config, models::LlamaWeights::random(config, 21, at::kDouble));
  for (const int64_t length : {39, 38, 37, 31, 20}) {
    const auto prompt = limited_prompt(length, length);
    const auto reference = autoregressive_generate(target, prompt, {.max_new_tokens = 64});
    ProbabilisticNGramStorage memory(config.vocab_size, 3);
    (void)stand_generate(memory, target, limited_prompt(30, length), {.max_new_tokens = 64});  // teach it
    for (const bool use_cache : {true, false}) {
      const auto result = stand_generate(memory, target, prompt, {.max_new_tokens = 64, .use_cache = use_cache});
      EXPECT_EQ(result.tokens, reference.tokens) << "prompt " << length;
      EXPECT_EQ(result.stop_reason, StopReason::sequence_limit) << "prompt " << length;
    }
  }
}

// Beam search from prompts 1..3 positions before the limit: every hypothesis stops there.
TYPED_TEST(BatchLlama, BeamSearchNearTheLimitStopsThere) {
  const models::LlamaConfig config = limited_config();
  models::LlamaModel<TypeParam> target(config, models::LlamaWeights::random(config, 21, at::kDouble));
  for (const int64_t length : {39, 38, 37, 36}) {
    const auto prompt = limited_prompt(length, length);
    const auto greedy = autoregressive_generate(target, prompt, {.max_new_tokens = 64});
    const auto one = beam_search_generate(target, prompt, {.max_new_tokens = 64, .num_beams = 1, .top_k = 3, .alpha = 0.0});
    EXPECT_EQ(one.tokens, greedy.tokens) << "prompt " << length;
    const auto four = beam_search_generate(target, prompt, {.max_new_tokens = 64, .num_beams = 4, .top_k = 4});
    ASSERT_FALSE(four.n_best.empty());
    for (const auto& hypothesis : four.n_best) {
      EXPECT_EQ(static_cast<int64_t>(hypothesis.tokens.size()), 40 - length) << "prompt " << length;
    }
  }
}

// A session whose second turn crosses the drafter's limit and whose third reaches the target's:
// the drafter stops drafting past its own limit, the target goes on to its own, a turn at the
// limit generates nothing and says why, and a turn that would not fit is refused unchanged.
TYPED_TEST(BatchLlama, SessionTurnsAcrossBothLimitsEqualAutoregressive) {
  const models::LlamaConfig config = limited_config();
  const auto weights = models::LlamaWeights::random(config, 21, at::kDouble);
  models::LlamaModel<TypeParam> target(config, weights);
  models::LlamaConfig drafter_config = config;
  drafter_config.max_seq_len = 27;
  models::LlamaModel<TypeParam> drafter(drafter_config, test::perturbed(weights, 0.04, 4));
  for (int64_t gamma = 1; gamma <= 8; gamma += 3) {
    Session<models::LlamaModel<TypeParam>> session(target);
    ModelDraftSource<models::LlamaModel<TypeParam>> source(drafter);
    std::vector<int64_t> all = limited_prompt(18, 5);
    session.append(all);
    const auto first = session.generate(source, {.max_new_tokens = 6, .gamma = gamma});
    all.insert(all.end(), first.tokens.begin(), first.tokens.end());
    const std::vector<int64_t> turn = limited_prompt(4, 9);  // 28 tokens: past the drafter's 27
    session.append(turn);
    all.insert(all.end(), turn.begin(), turn.end());
    const auto second = session.generate(source, {.max_new_tokens = 64, .gamma = gamma});
    std::vector<int64_t> expected = autoregressive_generate(target, all, {.max_new_tokens = 64}).tokens;
    EXPECT_EQ(second.tokens, expected) << "gamma " << gamma;
    EXPECT_EQ(second.stop_reason, StopReason::sequence_limit);
    EXPECT_EQ(session.length(), 40);
    const auto third = session.generate(source, {.max_new_tokens = 4, .gamma = gamma});
    EXPECT_TRUE(third.tokens.empty());
    EXPECT_EQ(third.stop_reason, StopReason::sequence_limit);
    test::expect_invalid([&] { session.append(std::vector<int64_t>{1}); }, {"max_sequence_length 40"});
    EXPECT_EQ(session.length(), 40);
  }
}

// The remote verifier's batching without gRPC (remote/session_batch.hpp): sessions with caches of
// their own, each step with the client's drafts, q and seed, served by one SessionBatcher.
namespace session_batch {

using Model = models::LlamaModel<StaticKVCache>;
using Step = remote::SessionStep<Model>;

// A session of the server's kind: its own one-row cache, the prompt prefilled but for its last
// token (which the first step feeds), its processor.
struct FakeSession {
  std::unique_ptr<StaticKVCache> cache;
  std::optional<Session<Model>> session;
  remote::AnyProcessor processor;
  Verification verification = Verification::rejection;
  FakeSession(Model& target, std::span<const int64_t> prompt, remote::AnyProcessor p,
              Verification mode = Verification::rejection)
      : cache(std::make_unique<StaticKVCache>(target.make_cache(1))), processor(std::move(p)), verification(mode) {
    session.emplace(target, *cache);
    session->append(prompt);
    session->prefill();
  }
  // A step of `drafts` (with q, or none) under the step seed `seed`, as the server prepares one.
  [[nodiscard]] Step step(std::vector<int64_t> drafts, at::Tensor q = {}, uint64_t seed = 0) {
    const auto k = static_cast<int64_t>(drafts.size());
    return Step{.session = &*session, .cache = cache.get(), .processor = &processor, .drafts = std::move(drafts),
                .q = std::move(q),
                .options = {.max_new_tokens = k + 1,
                            .seed = seed,
                            .gamma = std::max<int64_t>(k, 1),
                            .first_target = false,
                            .verification = verification,
                            .threshold = 0.05}};
  }
};

// q [k, V] of a drafter that puts weight `weight` on each drafted token and spreads the rest.
at::Tensor q_for(std::span<const int64_t> drafts, int64_t vocab, double weight) {
  at::Tensor q = at::full({static_cast<int64_t>(drafts.size()), vocab}, (1 - weight) / static_cast<double>(vocab - 1),
                          at::kFloat);
  for (size_t i = 0; i < drafts.size(); ++i) q[static_cast<int64_t>(i)][drafts[i]] = weight;
  return q;
}

// Rounds of steps for sessions of mixed prompts, greedy and sampled (one by threshold
// verification), with 0 to 6 drafts (the target's own continuation with every third round's last
// draft wrong) and one session rolled back by a token now and then: served joined by one batcher
// and each alone by another, every step's outcome and every session's tokens are the same, the
// joined rounds take one forward and one device-to-host copy each, each session's cache comes back
// holding what it would alone, and the greedy sessions end with their autoregressive output.
TEST(SessionBatcher, JoinedStepsEqualEachSessionServedAlone) {
  const models::LlamaConfig config = test::small_llama_config();
  const auto weights = models::LlamaWeights::random(config, 21, at::kDouble);
  Model target(config, weights), alone_target(config, weights), reference(config, weights);
  const auto prompts = mixed_prompts(6, config.vocab_size);
  const std::vector<remote::AnyProcessor> processors{GreedyProcessor{},      MultinomialProcessor{0.8},
                                                     GreedyProcessor{},      TopKProcessor{5, 1.2},
                                                     NucleusProcessor{0.9}, MultinomialProcessor{1.0}};
  const auto mode = [](size_t r) { return r == 5 ? Verification::threshold : Verification::rejection; };
  std::vector<FakeSession> joined, alone;
  for (size_t r = 0; r < prompts.size(); ++r) {
    joined.emplace_back(target, prompts[r], processors[r], mode(r));
    alone.emplace_back(alone_target, prompts[r], processors[r], mode(r));
  }
  remote::SessionBatcher<Model> batcher(target), single(alone_target);
  int64_t accepted = 0, drafted = 0;
  for (int64_t round = 0; round < 12; ++round) {
    std::vector<Step> steps, lone;
    for (size_t r = 0; r < prompts.size(); ++r) {
      if (r == 2 && round % 4 == 3) {  // the client went back a token: the row computes it again
        joined[r].session->rollback(joined[r].session->length() - 1);
        alone[r].session->rollback(alone[r].session->length() - 1);
      }
      const auto k = static_cast<int64_t>((round + 2 * static_cast<int64_t>(r)) % 7);
      std::vector<int64_t> drafts =
          autoregressive_generate(reference, joined[r].session->tokens(), {.max_new_tokens = std::max<int64_t>(k, 1)}).tokens;
      drafts.resize(static_cast<size_t>(k));
      if (k > 0 && round % 3 == 0) drafts.back() = (drafts.back() + 1) % config.vocab_size;
      const bool greedy = std::holds_alternative<GreedyProcessor>(processors[r]);
      const at::Tensor q = greedy || k == 0 || r == 5 ? at::Tensor() : q_for(drafts, config.vocab_size, 0.6);
      const auto seed = static_cast<uint64_t>(1000 * round + static_cast<int64_t>(r));
      steps.push_back(joined[r].step(drafts, q, seed));
      lone.push_back(alone[r].step(drafts, q, seed));
      drafted += k;
    }
    std::vector<Step*> batch;
    for (Step& step : steps) batch.push_back(&step);
    const int64_t forwards = batcher.forwards();
    EXPECT_EQ(test::copies_during([&] { batcher.run(batch); }), 1) << "round " << round;
    EXPECT_EQ(batcher.forwards() - forwards, 1) << "round " << round;
    for (size_t r = 0; r < steps.size(); ++r) {
      single.run(std::span<Step* const>(std::vector<Step*>{&lone[r]}));
      ASSERT_EQ(steps[r].error, remote::StepError::none) << steps[r].message;
      ASSERT_EQ(lone[r].error, remote::StepError::none) << lone[r].message;
      EXPECT_EQ(steps[r].accepted, lone[r].accepted) << "round " << round << " session " << r;
      EXPECT_EQ(steps[r].token, lone[r].token) << "round " << round << " session " << r;
      EXPECT_EQ(std::vector<int64_t>(joined[r].session->tokens().begin(), joined[r].session->tokens().end()),
                std::vector<int64_t>(alone[r].session->tokens().begin(), alone[r].session->tokens().end()));
      // The joined row's cache came back holding every token but the target's, as alone.
      ASSERT_EQ(joined[r].cache->length(), joined[r].session->length() - 1) << "round " << round << " session " << r;
      ASSERT_EQ(alone[r].cache->length(), joined[r].cache->length()) << "round " << round << " session " << r;
      EXPECT_TRUE(at::allclose(joined[r].cache->keys(0), alone[r].cache->keys(0), 1e-9, 1e-9))
          << "round " << round << " session " << r;
      accepted += steps[r].accepted;
    }
  }
  EXPECT_GT(accepted, drafted / 4);
  EXPECT_LT(accepted, drafted);
  for (size_t r = 0; r < prompts.size(); ++r) {
    if (!std::holds_alternative<GreedyProcessor>(processors[r])) continue;
    const auto tokens = joined[r].session->tokens();
    const auto generated = static_cast<int64_t>(tokens.size() - prompts[r].size());
    EXPECT_EQ(std::vector<int64_t>(tokens.begin() + static_cast<std::ptrdiff_t>(prompts[r].size()), tokens.end()),
              autoregressive_generate(reference, prompts[r], {.max_new_tokens = generated}).tokens)
        << "session " << r;
  }
}

// Two steps whose joined forward would pass the target's limit (one session 3 tokens from it, one
// short with 8 drafts): the one nearest the limit is served alone first, then the others; each gets
// its own autoregressive continuation. A third step that fits beside the short one joins it.
TEST(SessionBatcher, StepsThatWouldPassTheLimitTogetherAreServedApart) {
  models::LlamaConfig config = test::small_llama_config();
  config.max_seq_len = 40;
  const auto weights = models::LlamaWeights::random(config, 5, at::kDouble);
  Model target(config, weights), reference(config, weights);
  std::vector<int64_t> near(33), short_prompt{3, 1, 4}, other{2, 7};
  for (size_t i = 0; i < near.size(); ++i) near[i] = static_cast<int64_t>((5 * i + 1) % 48);
  const auto next = [&](const std::vector<int64_t>& prompt, int64_t n) {
    return autoregressive_generate(reference, prompt, {.max_new_tokens = n}).tokens;
  };
  const auto near_next = next(near, 4), short_next = next(short_prompt, 9), other_next = next(other, 3);
  FakeSession a(target, near, GreedyProcessor{}), b(target, short_prompt, GreedyProcessor{}), c(target, other, GreedyProcessor{});
  // 33 + 3 + 1 = 37 tokens for a; the joined input would be 9 wide after a's 32 cached positions.
  Step sa = a.step({near_next.begin(), near_next.begin() + 3}), sb = b.step({short_next.begin(), short_next.begin() + 8}),
       sc = c.step({other_next.begin(), other_next.begin() + 2});
  remote::SessionBatcher<Model> batcher(target);
  batcher.run(std::vector<Step*>{&sa, &sb, &sc});
  EXPECT_EQ(batcher.forwards(), 2);
  for (const Step* step : {&sa, &sb, &sc}) ASSERT_EQ(step->error, remote::StepError::none) << step->message;
  EXPECT_EQ(sa.accepted, 3);
  EXPECT_EQ(sa.token, near_next[3]);
  EXPECT_EQ(sb.accepted, 8);
  EXPECT_EQ(sb.token, short_next[8]);
  EXPECT_EQ(sc.accepted, 2);
  EXPECT_EQ(sc.token, other_next[2]);
  EXPECT_EQ(a.session->length(), 37);
  // The padded input is the widest row of uncached tokens, then the most drafts: a session that
  // appended 4 tokens (5 uncached, no drafts) after 29 cached positions and a short one with 8
  // drafts would need 29 + 5 + 8 = 42 positions, so they too are served apart.
  std::vector<int64_t> turn(near.begin(), near.begin() + 30), more{9, 8, 7, 6};
  FakeSession d(target, turn, GreedyProcessor{}), e(target, short_prompt, GreedyProcessor{});
  d.session->append(more);
  std::vector<int64_t> context = turn;
  context.insert(context.end(), more.begin(), more.end());
  Step sd = d.step({}), se = e.step({short_next.begin(), short_next.begin() + 8});
  batcher.run(std::vector<Step*>{&sd, &se});
  EXPECT_EQ(batcher.forwards(), 4);
  ASSERT_EQ(sd.error, remote::StepError::none) << sd.message;
  ASSERT_EQ(se.error, remote::StepError::none) << se.message;
  EXPECT_EQ(sd.token, next(context, 1).front());
  EXPECT_EQ(se.accepted, 8);
}

// A joined step that takes its session to the target's limit (its row leaves the batch inside the
// step) still gets its outcome, and its session keeps a cache that holds what it says: rolled back
// by the client, its next step joined with another continues its autoregressive output.
TEST(SessionBatcher, AJoinedStepThatReachesTheLimitLeavesItsSessionConsistent) {
  models::LlamaConfig config = test::small_llama_config();
  config.max_seq_len = 40;
  const auto weights = models::LlamaWeights::random(config, 9, at::kDouble);
  Model target(config, weights), reference(config, weights);
  std::vector<int64_t> near(36), other{2, 7};
  for (size_t i = 0; i < near.size(); ++i) near[i] = static_cast<int64_t>((3 * i + 2) % 48);
  const auto next = [&](const std::vector<int64_t>& prompt, int64_t n) {
    return autoregressive_generate(reference, prompt, {.max_new_tokens = n}).tokens;
  };
  const auto near_next = next(near, 4), other_next = next(other, 6);
  FakeSession a(target, near, GreedyProcessor{}), b(target, other, GreedyProcessor{});
  Step sa = a.step({near_next.begin(), near_next.begin() + 3}), sb = b.step({other_next.begin(), other_next.begin() + 2});
  const auto served = [](const Step& step, int64_t accepted, int64_t token) {
    ASSERT_EQ(step.error, remote::StepError::none) << step.message;
    EXPECT_EQ(step.accepted, accepted);
    EXPECT_EQ(step.token, token);
  };
  remote::SessionBatcher<Model> batcher(target);
  batcher.run(std::vector<Step*>{&sa, &sb});
  EXPECT_EQ(batcher.forwards(), 1);
  served(sa, 3, near_next[3]);
  served(sb, 2, other_next[2]);
  EXPECT_EQ(a.session->length(), 40);
  a.session->rollback(38);
  Step again = a.step({near_next[2]}), more = b.step({other_next[3]});
  batcher.run(std::vector<Step*>{&again, &more});
  EXPECT_EQ(batcher.forwards(), 2);
  served(again, 1, near_next[3]);
  served(more, 1, other_next[4]);
}

// A step whose q holds NaN fails alone, naming the drafter's distribution; the steps beside it
// are served and its session stays as it was, its cache ready for the next step.
TEST(SessionBatcher, ABadQFailsOnlyItsOwnStep) {
  const models::LlamaConfig config = test::small_llama_config();
  const auto weights = models::LlamaWeights::random(config, 8, at::kDouble);
  Model target(config, weights), reference(config, weights);
  const std::vector<int64_t> p{1, 2, 3}, r{4, 5};
  FakeSession good(target, p, MultinomialProcessor{1.0}), bad(target, r, MultinomialProcessor{1.0});
  const std::vector<int64_t> drafts{6, 7};
  at::Tensor broken = q_for(drafts, config.vocab_size, 0.5);
  broken[1][3] = std::numeric_limits<float>::quiet_NaN();
  Step ok = good.step(drafts, q_for(drafts, config.vocab_size, 0.5), 11), wrong = bad.step(drafts, broken, 12);
  remote::SessionBatcher<Model> batcher(target);
  batcher.run(std::vector<Step*>{&ok, &wrong});
  EXPECT_EQ(ok.error, remote::StepError::none) << ok.message;
  EXPECT_EQ(wrong.error, remote::StepError::invalid);
  EXPECT_NE(wrong.message.find("drafter's distribution"), std::string::npos) << wrong.message;
  EXPECT_EQ(bad.session->length(), 2);
  // The failed session goes on: its next step is what a fresh session of its tokens gets.
  FakeSession fresh(reference, r, MultinomialProcessor{1.0});
  Step next = bad.step({}, {}, 13), expected = fresh.step({}, {}, 13);
  batcher.run(std::vector<Step*>{&next});
  remote::SessionBatcher<Model>(reference).run(std::vector<Step*>{&expected});
  ASSERT_EQ(next.error, remote::StepError::none) << next.message;
  EXPECT_EQ(next.token, expected.token);
  EXPECT_EQ(bad.session->length(), 3);
}

}  // namespace session_batch

// The remote verifier's queue (remote::ForwardQueue), driven by threads that stand for the
// server's handlers, with jobs that are numbers: what each round served, in order.
namespace forward_queue {

struct Job {
  int id = 0;
};
using Queue = remote::ForwardQueue<Job>;

// The rounds a queue served ("t3": task 3 alone; "v1 v2": verifications 1 and 2 in one round;
// "stop"), and a gate: a round that serves job `held` waits until release().
class Log {
 public:
  explicit Log(int held = -1) : held_(held) {}

  Queue::Rounds rounds() {
    return {.task = [this](Job& job) { record("t" + std::to_string(job.id), job.id); },
            .verify =
                [this](std::span<Job* const> jobs) {
                  std::string round;
                  for (const Job* job : jobs) round += (round.empty() ? "v" : " v") + std::to_string(job->id);
                  bool hold = false;
                  for (const Job* job : jobs) hold = hold || job->id == held_;
                  record(round, hold ? held_ : -1);
                },
            .stop = [this] { record("stop", -1); }};
  }

  // Returns once the held round has started.
  void wait_held() {
    std::unique_lock lock(mutex_);
    ASSERT_TRUE(changed_.wait_for(lock, std::chrono::seconds(30), [&] { return holding_; }));
  }
  void release() {
    const std::lock_guard lock(mutex_);
    released_ = true;
    changed_.notify_all();
  }
  std::vector<std::string> served() {
    const std::lock_guard lock(mutex_);
    return served_;
  }

 private:
  void record(const std::string& round, int id) {
    std::unique_lock lock(mutex_);
    served_.push_back(round);
    if (id != held_ || id < 0) return;
    holding_ = true;
    changed_.notify_all();
    changed_.wait(lock, [&] { return released_; });
  }

  int held_;
  std::mutex mutex_;
  std::condition_variable changed_;
  bool holding_ = false, released_ = false;
  std::vector<std::string> served_;
};

// Returns once `queue` has `count` jobs waiting (handed over, not yet in a round).
void wait_waiting(const Queue& queue, size_t count) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (queue.waiting() != count) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << queue.waiting() << " waiting, not " << count;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// Jobs numbered 0 .. count - 1.
std::vector<Job> numbered(int count) {
  std::vector<Job> jobs(static_cast<size_t>(count));
  for (int i = 0; i < count; ++i) jobs[static_cast<size_t>(i)].id = i;
  return jobs;
}

// Hands `job` to `queue` from a thread of its own, as a server's handler does.
std::thread hand_over(Queue& queue, Job& job, bool task = false) {
  return std::thread([&queue, &job, task] { task ? queue.task(job) : queue.verify(job); });
}

TEST(ForwardQueue, ARoundTakesWhatQueuedDuringTheOneBefore) {
  Log log(/*held=*/0);
  Queue queue({.max_batch = 3}, log.rounds());
  std::vector<Job> jobs = numbered(6);
  std::vector<std::thread> threads;
  threads.push_back(hand_over(queue, jobs[0]));
  log.wait_held();  // the model is busy: what comes now waits for the next round
  for (size_t i = 1; i < 6; ++i) {
    threads.push_back(hand_over(queue, jobs[i]));
    wait_waiting(queue, i);  // in this order
  }
  log.release();
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(log.served(), (std::vector<std::string>{"v0", "v1 v2 v3", "v4 v5"}));
  const remote::ForwardQueueStats stats = queue.stats();
  EXPECT_EQ(stats.verifications, 6);
  EXPECT_EQ(stats.forwards, 3);
  EXPECT_EQ(stats.largest_batch, 3);
  EXPECT_EQ(stats.tasks, 0);
  EXPECT_EQ(queue.waiting(), 0U);
}

TEST(ForwardQueue, TasksRunAloneOneARoundBeforeTheVerifications) {
  Log log(/*held=*/0);
  Queue queue({.max_batch = 16}, log.rounds());
  std::vector<Job> jobs = numbered(5);
  std::vector<std::thread> threads;
  threads.push_back(hand_over(queue, jobs[0]));
  log.wait_held();
  threads.push_back(hand_over(queue, jobs[1]));
  wait_waiting(queue, 1);
  threads.push_back(hand_over(queue, jobs[2]));
  wait_waiting(queue, 2);
  threads.push_back(hand_over(queue, jobs[3], /*task=*/true));
  wait_waiting(queue, 3);
  threads.push_back(hand_over(queue, jobs[4], /*task=*/true));
  wait_waiting(queue, 4);
  log.release();
  for (auto& thread : threads) thread.join();
  // The oldest task, then every waiting verification in one round, then the next task.
  EXPECT_EQ(log.served(), (std::vector<std::string>{"v0", "t3", "v1 v2", "t4"}));
  EXPECT_EQ(queue.stats().tasks, 2);
  EXPECT_EQ(queue.stats().forwards, 2);
}

TEST(ForwardQueue, ABatchDelayWaitsForMoreAndServesTasksMeanwhile) {
  Log log;
  // A delay no test waits out: the round must start when the third verification arrives.
  Queue queue({.max_batch = 3, .batch_delay = std::chrono::seconds(60)}, log.rounds());
  std::vector<Job> jobs = numbered(4);
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  threads.push_back(hand_over(queue, jobs[0]));
  wait_waiting(queue, 1);
  queue.task(jobs[1]);  // served while verification 0 waits for company
  EXPECT_EQ(log.served(), (std::vector<std::string>{"t1"}));
  EXPECT_EQ(queue.waiting(), 1U);
  threads.push_back(hand_over(queue, jobs[2]));
  wait_waiting(queue, 2);
  queue.verify(jobs[3]);
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(log.served(), (std::vector<std::string>{"t1", "v0 v2 v3"}));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
}

TEST(ForwardQueue, StopServesWhatWaitsThenEndsAndRefusesMore) {
  Log log(/*held=*/0);
  auto queue = std::make_unique<Queue>(remote::ForwardQueueOptions{.max_batch = 2}, log.rounds());
  std::vector<Job> jobs = numbered(4);
  std::vector<std::thread> threads;
  threads.push_back(hand_over(*queue, jobs[0]));
  log.wait_held();
  threads.push_back(hand_over(*queue, jobs[1]));
  wait_waiting(*queue, 1);
  threads.push_back(hand_over(*queue, jobs[2], /*task=*/true));
  wait_waiting(*queue, 2);
  std::thread stopper([&] { queue->stop(); });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!queue->stopping()) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::atomic<bool> refused{false};
  std::thread late([&] {
    try {
      queue->verify(jobs[3]);
    } catch (const std::logic_error&) {
      refused = true;  // at once, never queued
    }
  });
  log.release();
  stopper.join();
  late.join();
  for (auto& thread : threads) thread.join();
  EXPECT_TRUE(refused.load());
  EXPECT_EQ(log.served(), (std::vector<std::string>{"v0", "t2", "v1", "stop"}));
  queue->stop();  // idempotent
  queue.reset();
  EXPECT_EQ(log.served().size(), 4U);
}

TEST(ForwardQueue, AHandlerMayStopItsQueue) {
  std::unique_ptr<Queue> queue;
  Queue::Rounds rounds{.task = [](Job&) {},
                       .verify =
                           [&](std::span<Job* const> jobs) {
                             if (jobs.front()->id == 9) queue->stop();  // on the queue's thread
                           }};
  queue = std::make_unique<Queue>(remote::ForwardQueueOptions{}, rounds);
  Job job{9}, late{10};
  queue->verify(job);
  EXPECT_TRUE(queue->stopping());
  EXPECT_THROW(queue->verify(late), std::logic_error);
  queue.reset();  // joins the thread the handler could not
}

TEST(ForwardQueue, AHandlerThatThrowsFailsOnlyTheWorkOfItsRound) {
  Queue::Rounds rounds{.task =
                           [](Job& job) {
                             if (job.id == 1) throw std::runtime_error("prefill 1 failed");
                           },
                       .verify =
                           [](std::span<Job* const> jobs) {
                             if (jobs.front()->id == 2) throw std::runtime_error("forward of 2 failed");
                           }};
  Queue queue({.max_batch = 1}, rounds);
  Job task{1}, ok_task{4}, failing{2}, ok{3};
  // `give` (a task or a verification) rethrows what the handler threw for its round.
  const auto expect_rethrown = [](const auto& give, const char* message) {
    try {
      give();
      ADD_FAILURE() << "no exception; expected: " << message;
    } catch (const std::runtime_error& e) {
      EXPECT_STREQ(e.what(), message);
    }
  };
  expect_rethrown([&] { queue.task(task); }, "prefill 1 failed");
  EXPECT_NO_THROW(queue.task(ok_task));
  expect_rethrown([&] { queue.verify(failing); }, "forward of 2 failed");
  EXPECT_NO_THROW(queue.verify(ok));
  EXPECT_EQ(queue.stats().tasks, 2);
  EXPECT_EQ(queue.stats().verifications, 2);
}

TEST(ForwardQueue, AnIdleQueueBeatsAtItsHeartbeat) {
  std::atomic<int> beats{0};
  Log log;
  Queue::Rounds rounds = log.rounds();
  rounds.idle = [&] { ++beats; };
  Queue queue({.heartbeat = std::chrono::milliseconds(1)}, rounds);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (beats.load() < 3) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  Job job{7};
  queue.verify(job);  // beating does not keep work waiting
  queue.stop();
  EXPECT_EQ(log.served(), (std::vector<std::string>{"v7", "stop"}));
}

TEST(ForwardQueue, BadOptionsAreRefusedNamingTheField) {
  Log log;
  using remote::ForwardQueueOptions;
  test::expect_invalid([&] { Queue({.max_batch = 0}, log.rounds()); }, {"max_batch", "0"});
  test::expect_invalid([&] { Queue({.batch_delay = std::chrono::microseconds(-5)}, log.rounds()); },
                       {"batch_delay", "-5"});
  test::expect_invalid([&] { Queue({.heartbeat = std::chrono::milliseconds(0)}, log.rounds()); }, {"heartbeat", "0"});
  Queue::Rounds no_verify = log.rounds();
  no_verify.verify = nullptr;
  test::expect_invalid([&] { Queue({}, no_verify); }, {"verify"});
  test::expect_invalid([&] { Queue({.heartbeat = std::chrono::milliseconds(5)}, log.rounds()); }, {"idle"});
}

}  // namespace forward_queue

}  // namespace

}  // namespace test_batch
