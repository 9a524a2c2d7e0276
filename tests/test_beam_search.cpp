// Beam search: greedy with one beam, the exact best sequence when nothing is pruned, never worse
// than greedy, cache reordering, and bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "specdec/beam_search.hpp"
#include "specdec/generate.hpp"
#include "specdec/models/llama.hpp"
#include "support/llama_fixtures.hpp"
#include "support/toy_models.hpp"

// One namespace a file: specdec_tests is compiled as a unity build (tests/CMakeLists.txt).
namespace test_beam_search {

namespace {

using namespace specdec;
constexpr int64_t kEos = 3;

at::Tensor chain(std::vector<std::vector<double>> rows) {
  std::vector<at::Tensor> tensors;
  for (auto& row : rows) tensors.push_back(at::tensor(row, at::kDouble));
  return at::stack(tensors);
}

// Markov chains over {0, 1, 2, EOS = 3}.
std::vector<at::Tensor> chains() {
  return {chain({{.5, .3, .1, .1}, {.1, .2, .3, .4}, {.05, .05, .6, .3}, {.25, .25, .25, .25}}),
          chain({{.35, .33, .02, .3}, {.3, .3, .3, .1}, {.7, .1, .1, .1}, {.25, .25, .25, .25}}),
          chain({{.4, .35, .2, .05}, {.2, .2, .2, .4}, {.3, .3, .3, .1}, {.25, .25, .25, .25}})};
}

double score_of(const at::Tensor& log_probs, int64_t first, const std::vector<int64_t>& tokens, double alpha);

struct Scored {
  std::vector<int64_t> tokens;
  double score;
};

// Every sequence of at most `length` tokens after `first` (ending at EOS or at the limit), scored
// log-probability / length^alpha, best first.
Scored enumerate_best(const at::Tensor& log_probs, int64_t first, int64_t length, double alpha) {
  Scored best{{}, -INFINITY};
  std::vector<int64_t> sequence;
  std::function<void(int64_t, double)> visit = [&](int64_t last, double lp) {
    for (int64_t t = 0; t < 4; ++t) {
      sequence.push_back(t);
      const double next = lp + log_probs[last][t].item<double>();
      if (t == kEos || static_cast<int64_t>(sequence.size()) == length) {
        const double score = next / std::pow(static_cast<double>(sequence.size()), alpha);
        if (score > best.score + 1e-12) best = {sequence, score};
      } else {
        visit(t, next);
      }
      sequence.pop_back();
    }
  };
  visit(first, 0.0);
  return best;
}

double score_of(const at::Tensor& log_probs, int64_t first, const std::vector<int64_t>& tokens, double alpha) {
  double lp = 0;
  int64_t last = first;
  for (const int64_t t : tokens) {
    lp += log_probs[last][t].item<double>();
    last = t;
  }
  return lp / std::pow(static_cast<double>(tokens.size()), alpha);
}

TEST(BeamSearch, OneBeamIsGreedy) {
  test::PrefixHashModel model(40, 3);
  const std::vector<int64_t> prompt{1, 2, 3};
  for (const std::vector<int64_t>& eos : {std::vector<int64_t>{}, std::vector<int64_t>{7, 11}}) {
    const auto greedy = autoregressive_generate(model, prompt, {.max_new_tokens = 30, .eos_token_ids = eos});
    for (int64_t top_k : {1, 5}) {
      const auto beam = beam_search_generate(
          model, prompt, {.max_new_tokens = 30, .eos_token_ids = eos, .num_beams = 1, .top_k = top_k, .alpha = 0.0});
      EXPECT_EQ(beam.tokens, greedy.tokens);
    }
  }
}

TEST(BeamSearch, FindsTheExactBestSequenceWhenNothingIsPruned) {
  for (const at::Tensor& transitions : chains()) {
    test::MarkovModel model(transitions);
    const at::Tensor log_probs = model.logits().to(at::kDouble).log_softmax(-1);
    for (double alpha : {0.0, 0.5, 1.0, 2.0}) {
      const auto expected = enumerate_best(log_probs, 0, 4, alpha);
      const auto result = beam_search_generate(
          model, std::vector<int64_t>{0},
          {.max_new_tokens = 4, .eos_token_ids = {kEos}, .num_beams = 256, .top_k = 4, .alpha = alpha});
      // The best score (a tie may pick another sequence of equal score).
      ASSERT_FALSE(result.n_best.empty());
      EXPECT_NEAR(score_of(log_probs, 0, result.tokens, alpha), expected.score, 1e-9) << "alpha " << alpha;
      EXPECT_NEAR(result.n_best.front().score, expected.score, 1e-9);
      for (size_t i = 1; i < result.n_best.size(); ++i) {
        EXPECT_GE(result.n_best[i - 1].score, result.n_best[i].score);
      }
    }
  }
}

TEST(BeamSearch, FewerBeamsNeverScoreBelowGreedy) {
  for (const at::Tensor& transitions : chains()) {
    test::MarkovModel model(transitions);
    const at::Tensor log_probs = model.logits().to(at::kDouble).log_softmax(-1);
    for (double alpha : {0.0, 1.0}) {
      const auto greedy = autoregressive_generate(model, std::vector<int64_t>{0},
                                                  {.max_new_tokens = 6, .eos_token_ids = {kEos}});
      const double greedy_score = score_of(log_probs, 0, greedy.tokens, alpha);
      for (int64_t beams : {2, 3, 4}) {
        const auto result = beam_search_generate(
            model, std::vector<int64_t>{0},
            {.max_new_tokens = 6, .eos_token_ids = {kEos}, .num_beams = beams, .top_k = 4, .alpha = alpha});
        EXPECT_GE(result.n_best.front().score, greedy_score - 1e-12) << beams << " beams, alpha " << alpha;
        EXPECT_NEAR(result.n_best.front().score, score_of(log_probs, 0, result.tokens, alpha), 1e-9);
      }
    }
  }
}

TEST(BeamSearch, MinLengthSuppressesEndTokens) {
  test::MarkovModel model(chains()[0]);
  const auto result = beam_search_generate(
      model, std::vector<int64_t>{1}, {.max_new_tokens = 8, .eos_token_ids = {kEos}, .num_beams = 3, .min_length = 4});
  for (const auto& h : result.n_best) {
    const auto eos_at = std::find(h.tokens.begin(), h.tokens.end(), kEos);
    EXPECT_GE(eos_at - h.tokens.begin(), 4);
  }
}

template <class C>
class BeamSearchCache : public ::testing::Test {};
using Caches = ::testing::Types<DynamicKVCache, StaticKVCache>;
TYPED_TEST_SUITE(BeamSearchCache, Caches);

TYPED_TEST(BeamSearchCache, ReorderedRowsContinueLikeAFreshForward) {
  const models::LlamaConfig config = test::small_llama_config();
  models::LlamaModel<TypeParam> model(config, models::LlamaWeights::random(config, 12, at::kDouble));
  const std::vector<std::vector<int64_t>> rows{{1, 2, 3, 4}, {5, 6, 7, 8}, {9, 10, 11, 12}};
  auto cache = model.make_cache(3);
  std::vector<at::Tensor> stacked;
  for (const auto& r : rows) stacked.push_back(at::tensor(r, at::kLong));
  (void)model.forward(at::stack(stacked), cache);
  cache.reorder(at::tensor({2, 0, 0}, at::kLong));
  const at::Tensor next = model.forward(at::tensor({20, 21, 22}, at::kLong).view({3, 1}), cache);
  const std::vector<std::vector<int64_t>> expected_rows{{9, 10, 11, 12, 20}, {1, 2, 3, 4, 21}, {1, 2, 3, 4, 22}};
  for (size_t i = 0; i < 3; ++i) {
    auto fresh = model.make_cache(1);
    const at::Tensor reference = model.forward(at::tensor(expected_rows[i], at::kLong).view({1, -1}), fresh);
    EXPECT_TRUE(at::allclose(next[static_cast<int64_t>(i)][0], reference[0][4], 1e-9, 1e-9)) << "row " << i;
  }
}

TYPED_TEST(BeamSearchCache, CachedSearchEqualsRecomputedSearch) {
  const models::LlamaConfig config = test::small_llama_config();
  models::LlamaModel<TypeParam> model(config, models::LlamaWeights::random(config, 13, at::kDouble));
  const std::vector<int64_t> prompt{4, 8, 15, 16};
  const BeamSearchOptions options{.max_new_tokens = 12, .eos_token_ids = {0, 1}, .num_beams = 4, .top_k = 3};
  auto uncached_options = options;
  uncached_options.use_cache = false;
  const auto cached = beam_search_generate(model, prompt, options);
  const auto uncached = beam_search_generate(model, prompt, uncached_options);
  ASSERT_EQ(cached.n_best.size(), uncached.n_best.size());
  for (size_t i = 0; i < cached.n_best.size(); ++i) {
    EXPECT_EQ(cached.n_best[i].tokens, uncached.n_best[i].tokens);
    EXPECT_NEAR(cached.n_best[i].score, uncached.n_best[i].score, 1e-9);
  }
  EXPECT_EQ(cached.stats.target_calls, cached.stats.steps);
  EXPECT_GT(cached.tokens_scored, 0);
}

TEST(BeamSearch, RejectsBadInputNamingIt) {
  test::PrefixHashModel model(40, 3);
  const std::vector<int64_t> prompt{1, 2};
  const auto expect = [&](const BeamSearchOptions& options, const std::string& fragment) {
    try {
      (void)beam_search_generate(model, prompt, options);
      FAIL() << "accepted " << fragment;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  expect({.num_beams = 0}, "num_beams must be >= 1, got 0");
  expect({.top_k = 0}, "top_k must be >= 1, got 0");
  expect({.alpha = -0.5}, "alpha must be >= 0, got -0.5");
  expect({.min_length = -1}, "min_length must be >= 0, got -1");
  expect({.max_new_tokens = -2}, "max_new_tokens must be >= 0, got -2");
  expect({.eos_token_ids = {40}}, "eos_token_ids[0]");
}

}  // namespace

}  // namespace test_beam_search
