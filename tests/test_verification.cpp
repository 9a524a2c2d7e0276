// The verification core and the exactness of the output distribution under sampling.
//
// Distributions are checked with a chi-square test at a false-failure rate of about 1e-6, counting
// any sample outside the support as a failure; each test also shows that the same harness rejects
// a deliberately biased variant (skip_sample_adjustment), so it has the power to see a bias.
#include <gtest/gtest.h>

#include <map>
#include <vector>

#include "specdec/generate.hpp"
#include "specdec/verification.hpp"
#include "specdec/draft_source.hpp"
#include "support/markov_fixtures.hpp"
#include "support/statistics.hpp"
#include "support/toy_models.hpp"

// One namespace a file: specdec_tests is compiled as a unity build (tests/CMakeLists.txt).
namespace test_verification {

namespace {

using namespace specdec;
constexpr double kZ = 4.75;  // normal quantile of a 1e-6 tail

using test::rows_of;

TEST(VerifyDrafts, GreedyAcceptsTheLeadingMatchesAndCorrectsTheFirstMismatch) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1);
  // Target argmax per position: 2, 0, 3, 1.
  const at::Tensor logits = rows_of({{0, 1, 5, 2}, {4, 1, 0, 0}, {0, 0, 1, 2}, {0, 3, 1, 0}});
  const GreedyProcessor greedy;
  const at::Tensor p = greedy(logits);
  const auto check = [&](std::vector<int64_t> drafts, int64_t accepted, int64_t token) {
    const auto d = at::tensor(drafts, at::kLong);
    const at::Tensor q = greedy(at::one_hot(d, 4).to(at::kDouble));
    const VerifiedStep step = verify_drafts(p, q, d, greedy, gen);
    EXPECT_EQ(step.accepted, accepted);
    EXPECT_EQ(step.token, token);
    EXPECT_EQ(step.drafts, drafts);
    const VerifiedStep deterministic = verify_drafts(p, at::Tensor(), d, greedy, gen);
    EXPECT_EQ(deterministic.accepted, accepted);
    EXPECT_EQ(deterministic.token, token);
  };
  check({2, 0, 3}, 3, 1);
  check({2, 0, 1}, 2, 3);
  check({1, 0, 3}, 0, 2);
  check({2, 3, 3}, 1, 0);
}

TEST(VerifyDrafts, WithoutDraftsSamplesTheTarget) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(2);
  const VerifiedStep step = verify_drafts(rows_of({{0, 0, 1, 0}}), at::Tensor(),
                                          at::empty({0}, at::kLong), MultinomialProcessor{}, gen);
  EXPECT_EQ(step.accepted, 0);
  EXPECT_EQ(step.token, 2);
}

TEST(VerifyDrafts, RejectsMismatchedShapesAndNonFiniteDistributions) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(3);
  const GreedyProcessor greedy;
  const at::Tensor drafts = at::tensor({1, 2}, at::kLong);
  EXPECT_THROW((void)verify_drafts(at::ones({2, 4}) / 4, at::Tensor(), drafts, greedy, gen),
               std::invalid_argument);
  EXPECT_THROW((void)verify_drafts(at::ones({3, 4}) / 4, at::ones({2, 5}) / 5, drafts, greedy, gen),
               std::invalid_argument);
  EXPECT_THROW((void)verify_drafts(at::ones({3, 4}) / 4, at::Tensor(), drafts.to(at::kInt), greedy, gen),
               std::invalid_argument);
  at::Tensor nan = at::ones({3, 4}) / 4;
  nan[2][1] = NAN;
  EXPECT_THROW((void)verify_drafts(nan, at::Tensor(), drafts, greedy, gen), std::invalid_argument);
  EXPECT_THROW((void)verify_drafts(at::ones({3, 4}) / 4, nan.narrow(0, 1, 2), drafts, greedy, gen),
               std::invalid_argument);
}

// Emitted-token distribution of verify_drafts when the target's distribution is the same P at
// every position: every emitted token must be distributed as P.
test::ChiSquare first_token_fit(const at::Tensor& target, const at::Tensor& draft, bool one_hot_drafts,
                          bool skip_adjustment, int64_t samples) {
  const int64_t gamma = 3;
  const MultinomialProcessor processor;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(17);
  const at::Tensor p = target.expand({gamma + 1, target.size(0)}).contiguous();
  const at::Tensor q = draft.expand({gamma, draft.size(0)}).contiguous();
  std::map<int64_t, int64_t> observed;
  for (int64_t i = 0; i < samples; ++i) {
    // One-hot drafts: always draft token 0 (a deterministic drafter such as an n-gram table).
    const at::Tensor drafts = one_hot_drafts ? at::zeros({gamma}, at::kLong)
                                             : processor.sample(q, gen).view({gamma});
    const VerifiedStep step =
        verify_drafts(p, one_hot_drafts ? at::Tensor() : q, drafts, processor, gen,
                      {.skip_sample_adjustment = skip_adjustment});
    ++observed[step.accepted > 0 ? step.drafts[0] : step.token];
  }
  std::map<int64_t, double> expected;
  for (int64_t v = 0; v < target.size(0); ++v) expected[v] = target[v].item<double>();
  return test::chi_square(observed, expected, samples);
}

TEST(VerifyDrafts, EmittedTokensFollowTheTargetForSampledAndDeterministicDrafts) {
  const at::Tensor target = at::tensor({0.1, 0.4, 0.3, 0.2, 0.0}, at::kDouble);
  const at::Tensor draft = at::tensor({0.5, 0.1, 0.1, 0.1, 0.2}, at::kDouble);
  for (bool one_hot : {false, true}) {
    const auto exact = first_token_fit(target, draft, one_hot, false, 20000);
    EXPECT_EQ(exact.outside_support, 0);
    EXPECT_LT(exact.statistic, test::chi_square_quantile(exact.dof, kZ)) << "one_hot " << one_hot;
    // Power: sampling a rejected position from p instead of the residual over-weights the draft
    // (for a one-hot draft P(d) becomes p(2 - p), the bias of seed 000's loop).
    const auto biased = first_token_fit(target, draft, one_hot, true, 20000);
    EXPECT_GT(biased.statistic, test::chi_square_quantile(biased.dof, kZ)) << "one_hot " << one_hot;
  }
}

// End to end: speculative_generate on Markov chains whose sequence probabilities are exact.

// Samples 3-token sequences with `options` (max_new_tokens, seed and first_target are set here).
template <class P>
test::ChiSquare sequence_fit(const P& processor, SpeculativeOptions options, int64_t samples) {
  test::MarkovModel target(test::markov_target_rows());
  test::MarkovModel drafter(test::markov_drafter_rows());
  const std::vector<int64_t> prompt{0};
  constexpr int64_t kLength = 3;
  std::map<std::vector<int64_t>, int64_t> observed;
  for (int64_t i = 0; i < samples; ++i) {
    options.max_new_tokens = kLength;
    options.seed = static_cast<uint64_t>(1000 + i);
    options.first_target = false;
    const auto result = speculative_generate(drafter, target, prompt, options, processor);
    ++observed[result.tokens];
  }
  // Exact: the product of the processed transition probabilities along the sequence.
  const at::Tensor step = processor(target.logits()).to(at::kDouble);
  std::map<std::vector<int64_t>, double> expected;
  for (int64_t a = 0; a < 4; ++a) {
    for (int64_t b = 0; b < 4; ++b) {
      for (int64_t c = 0; c < 4; ++c) {
        expected[{a, b, c}] =
            (step[0][a] * step[a][b] * step[b][c]).template item<double>();
      }
    }
  }
  return test::chi_square(observed, expected, samples);
}

template <class P>
void expect_exact_and_detectable(const P& processor) {
  constexpr int64_t kSamples = 8000;
  for (int64_t gamma : {1, 2}) {
    const auto exact = sequence_fit(processor, {.gamma = gamma}, kSamples);
    EXPECT_EQ(exact.outside_support, 0) << processor << " gamma " << gamma;
    EXPECT_GE(exact.min_expected, 5.0);
    EXPECT_LT(exact.statistic, test::chi_square_quantile(exact.dof, kZ))
        << processor << " gamma " << gamma;
  }
  const auto biased = sequence_fit(processor, {.gamma = 2, .skip_sample_adjustment = true}, kSamples);
  EXPECT_GT(biased.statistic, test::chi_square_quantile(biased.dof, kZ)) << processor;
}

TEST(SpeculativeDistribution, MultinomialEqualsTarget) { expect_exact_and_detectable(MultinomialProcessor{1.0}); }
TEST(SpeculativeDistribution, TopKEqualsTarget) { expect_exact_and_detectable(TopKProcessor{2}); }
TEST(SpeculativeDistribution, NucleusEqualsTarget) { expect_exact_and_detectable(NucleusProcessor{0.85}); }
TEST(SpeculativeDistribution, TopKNucleusAtTemperatureEqualsTarget) {
  expect_exact_and_detectable(TopKNucleusProcessor(3, 0.9, 0.7));
}

// Every draft-length policy keeps the output exact: EGAG (drafter rows have entropies .92 to 1),
// the success schedule and the confidence stop each change how much is drafted per step.
TEST(SpeculativeDistribution, DraftLengthPoliciesKeepTheTargetsDistribution) {
  constexpr int64_t kSamples = 8000;
  const std::vector<std::pair<const char*, SpeculativeOptions>> policies{
      {"egag", {.gamma_policy = GammaPolicy::egag, .gamma_min = 1, .gamma_max = 3, .egag_ema_beta = 0.3}},
      {"schedule", {.gamma = 1, .gamma_policy = GammaPolicy::schedule, .gamma_min = 1, .gamma_max = 3}},
      {"p_min", {.gamma = 3, .p_min = 0.5}},
  };
  for (const auto& [name, options] : policies) {
    for (const bool top_k : {false, true}) {
      const auto fit = top_k ? sequence_fit(TopKProcessor{3}, options, kSamples)
                             : sequence_fit(MultinomialProcessor{}, options, kSamples);
      EXPECT_EQ(fit.outside_support, 0) << name;
      EXPECT_LT(fit.statistic, test::chi_square_quantile(fit.dof, kZ)) << name << " top_k " << top_k;
    }
  }
  // The harness sees the bias of the same policies without the residual correction.
  auto biased = policies[0].second;
  biased.skip_sample_adjustment = true;
  const auto fit = sequence_fit(MultinomialProcessor{}, biased, kSamples);
  EXPECT_GT(fit.statistic, test::chi_square_quantile(fit.dof, kZ));
}

// Threshold verification above 1 accepts nothing: every token is sampled from the target, so the
// distribution is exact; at 0.3 it is lossy, and the harness sees it.
TEST(SpeculativeDistribution, ThresholdVerificationIsExactOnlyWhenItAcceptsNothing) {
  constexpr int64_t kSamples = 8000;
  const auto none = sequence_fit(MultinomialProcessor{}, {.gamma = 2, .verification = Verification::threshold,
                                                           .threshold = 1.01}, kSamples);
  EXPECT_EQ(none.outside_support, 0);
  EXPECT_LT(none.statistic, test::chi_square_quantile(none.dof, kZ));
  const auto lossy = sequence_fit(MultinomialProcessor{}, {.gamma = 2, .verification = Verification::threshold,
                                                            .threshold = 0.3}, kSamples);
  EXPECT_GT(lossy.statistic, test::chi_square_quantile(lossy.dof, kZ));
}

}  // namespace
namespace {

// The first drafting step comes after the target's own first token (first_target): a rejection
// there is followed by a token from the residual max(0, p - q) of the context's row, like any
// other rejection; skip_sample_adjustment takes it from p instead. Pinned by a chi-square of that
// position, given the rejection, against the residual (and, for power, against p).
template <class Source>
test::ChiSquare first_rejection_fit(Source make_source, bool skip, bool against_p, int64_t samples) {
  test::MarkovModel target(test::markov_target_rows());
  const at::Tensor p = test::markov_target_rows(), q = test::markov_drafter_rows();
  std::map<std::pair<int64_t, int64_t>, int64_t> observed;
  std::map<int64_t, int64_t> contexts;
  int64_t rejections = 0;
  for (int64_t i = 0; i < samples; ++i) {
    auto source = make_source();
    int64_t previous = -1;
    SpeculativeOptions options{.max_new_tokens = 3, .seed = static_cast<uint64_t>(7000 + i), .gamma = 4,
                               .skip_sample_adjustment = skip};
    options.on_step = [&](const StepInfo& step) {
      if (step.step == 1 && !step.drafts.empty() && step.accepted == 0) {
        ++observed[{previous, step.token}];
        ++contexts[previous];
        ++rejections;
      }
      previous = step.emitted.empty() ? previous : step.emitted.back();
      return StepAction::proceed;
    };
    (void)generate_with(source, target, std::vector<int64_t>{0}, options, MultinomialProcessor(1.0));
  }
  std::map<std::pair<int64_t, int64_t>, double> expected;
  for (const auto& [context, count] : contexts) {
    const at::Tensor row = against_p ? p[context] : (p[context] - q[context]).clamp_min(0.0);
    const at::Tensor next = row / row.sum();
    for (int64_t t = 0; t < 4; ++t) {
      expected[{context, t}] = static_cast<double>(count) / static_cast<double>(rejections) * next[t].item<double>();
    }
  }
  auto fit = test::chi_square(observed, expected, rejections);
  fit.dof -= static_cast<int64_t>(contexts.size()) - 1;  // the contexts' shares are taken from the sample
  return fit;
}

TEST(SpeculativeDistribution, TheFirstRejectionAfterTheTargetsFirstTokenIsSampledFromTheResidual) {
  test::MarkovModel drafter(test::markov_drafter_rows());
  const auto chain = [&] { return ModelDraftSource(drafter); };
  constexpr int64_t kSamples = 12000;
  const auto exact = first_rejection_fit(chain, false, false, kSamples);
  EXPECT_EQ(exact.outside_support, 0);
  EXPECT_LT(exact.statistic, test::chi_square_quantile(exact.dof, kZ));
  // Power: the same position against p fails, and skip_sample_adjustment's samples fit p.
  const auto against_p = first_rejection_fit(chain, false, true, kSamples);
  EXPECT_GT(against_p.statistic, test::chi_square_quantile(against_p.dof, kZ));
  const auto skipped = first_rejection_fit(chain, true, true, kSamples);
  EXPECT_LT(skipped.statistic, test::chi_square_quantile(skipped.dof, kZ));
  std::cout << "[ figures  ] first rejection after the target's first token: chi-square " << exact.statistic
            << " against the residual, " << against_p.statistic << " against p (dof " << exact.dof
            << "); skip_sample_adjustment " << skipped.statistic << " against p\n";
}

}  // namespace

}  // namespace test_verification
