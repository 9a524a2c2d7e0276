// Batched generation with per-row acceptance: greedy rows equal their single-sequence output for
// batches of 1..8 with mixed prompt lengths and gamma 1..8, on the prefix-hash toy model and on
// Llama with both cache types; sampled rows are exactly the target's distribution (with a power
// check); one host copy per step for the whole batch; rows that finish leave the batch; bad input.
#include <gtest/gtest.h>

#include <map>
#include <vector>

#include "specdec/batch.hpp"
#include "specdec/generate.hpp"
#include "specdec/models/llama.hpp"
#include "support/expect_invalid.hpp"
#include "support/llama_fixtures.hpp"
#include "support/markov_fixtures.hpp"
#include "support/statistics.hpp"
#include "support/toy_models.hpp"

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

// Samples 2 tokens after prompts {0} and {2, 1} in batches, row by row, and checks each row's
// distribution against the Markov target's by chi-square at a tail of 1e-6. Returns whether
// every row passed.
bool rows_pass_chi_square(bool skip_sample_adjustment) {
  test::MarkovModel target(test::markov_target_rows());
  test::MarkovModel drafter(test::markov_drafter_rows());
  const at::Tensor p = test::markov_target_rows();
  const std::vector<std::vector<int64_t>> prompts{{0}, {2, 1}};
  const MultinomialProcessor processor{1.0};
  constexpr int64_t kSamples = 2500;
  std::vector<std::map<std::pair<int64_t, int64_t>, int64_t>> observed(prompts.size());
  for (int64_t i = 0; i < kSamples; ++i) {
    const auto results = speculative_generate_batch(
        drafter, target, prompts,
        {.max_new_tokens = 2, .seed = static_cast<uint64_t>(i), .gamma = 2, .first_target = false,
         .skip_sample_adjustment = skip_sample_adjustment},
        processor);
    for (size_t r = 0; r < prompts.size(); ++r) ++observed[r][{results[r].tokens[0], results[r].tokens[1]}];
  }
  bool pass = true;
  for (size_t r = 0; r < prompts.size(); ++r) {
    const int64_t last = prompts[r].back();
    std::map<std::pair<int64_t, int64_t>, double> expected;
    for (int64_t a = 0; a < 4; ++a) {
      for (int64_t b = 0; b < 4; ++b) expected[{a, b}] = p[last][a].item<double>() * p[a][b].item<double>();
    }
    const test::ChiSquare fit = test::chi_square(observed[r], expected, kSamples);
    pass = pass && fit.outside_support == 0 && fit.statistic < test::chi_square_quantile(fit.dof, 4.75);
  }
  return pass;
}

TEST(BatchSampling, EveryRowIsDistributedAsTheTarget) {
  EXPECT_TRUE(rows_pass_chi_square(/*skip_sample_adjustment=*/false));
  // Power: rows that sample a rejected position from p instead of their own residual fail.
  EXPECT_FALSE(rows_pass_chi_square(/*skip_sample_adjustment=*/true));
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
    // The split row is a working cache of its own: one more token scores as on the row's own cache.
    EXPECT_TRUE(at::allclose(model.forward(ids({15}), split), model.forward(ids({15}), own[r]), 1e-9, 1e-9)) << "row " << r;
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

}  // namespace
