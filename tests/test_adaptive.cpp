// Adaptive drafting and threshold verification: every draft-length policy keeps greedy output
// equal to autoregressive decoding; EGAG, the success schedule and the confidence stop choose the
// drafts as specified; threshold verification accepts by its rule and is never the default; the
// calibration table. (The sampled-distribution checks are in test_verification.cpp.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "specdec/calibration.hpp"
#include "specdec/generate.hpp"
#include "specdec/models/llama.hpp"
#include "support/expect_invalid.hpp"
#include "support/llama_fixtures.hpp"
#include "support/markov_fixtures.hpp"
#include "support/toy_models.hpp"

// One namespace a file: specdec_tests is compiled as a unity build (tests/CMakeLists.txt).
namespace test_adaptive {

namespace {

using namespace specdec;
using test::expect_invalid;
using test::MarkovModel;
using test::PrefixHashModel;

const std::vector<int64_t> kPrompt{1, 7, 3, 22, 5};

using test::rows_of;
const at::Tensor& target_rows() { return test::markov_target_rows(); }
const at::Tensor& drafter_rows() { return test::markov_drafter_rows(); }

// Normalised entropy and top probability of a row of probabilities, in double precision.
double normalised_entropy(const at::Tensor& row) {
  double h = 0;
  for (int64_t i = 0; i < row.size(0); ++i) {
    const double p = row[i].item<double>() / row.sum().item<double>();
    if (p > 0) h -= p * std::log(p);
  }
  return h / std::log(static_cast<double>(row.size(0)));
}
double top_probability(const at::Tensor& row) { return (row.max() / row.sum()).item<double>(); }

// The policies under test, named for the test output.
struct Variant {
  std::string name;
  SpeculativeOptions options;
};

std::vector<Variant> variants() {
  return {
      {"egag", {.gamma_policy = GammaPolicy::egag, .gamma_min = 1, .gamma_max = 8}},
      {"egag_smoothed", {.gamma_policy = GammaPolicy::egag, .gamma_min = 2, .gamma_max = 6, .egag_ema_beta = 0.6}},
      {"schedule", {.gamma = 3, .gamma_policy = GammaPolicy::schedule, .gamma_min = 1, .gamma_max = 8}},
      {"p_min", {.gamma = 6, .p_min = 0.2}},
      {"entropy_gate", {.gamma = 6, .entropy_gate = 0.55}},
      {"egag_and_p_min", {.gamma_policy = GammaPolicy::egag, .gamma_min = 1, .gamma_max = 8, .p_min = 0.2}},
      {"threshold", {.gamma = 4, .verification = Verification::threshold, .threshold = 0.5}},
      {"threshold_one", {.gamma = 4, .verification = Verification::threshold, .threshold = 1.0}},
  };
}

class GreedyPolicies : public ::testing::TestWithParam<std::tuple<int, bool>> {
 protected:
  SpeculativeOptions options(int64_t max_new_tokens, std::set<int64_t>* gammas) const {
    const auto [index, first_target] = GetParam();
    SpeculativeOptions o = variants()[static_cast<size_t>(index)].options;
    o.max_new_tokens = max_new_tokens;
    o.first_target = first_target;
    o.on_step = [gammas](const StepInfo& step) {
      if (step.gamma > 0) gammas->insert(static_cast<int64_t>(step.drafts.size()));
    };
    return o;
  }
};

TEST_P(GreedyPolicies, PrefixHashModelEqualsAutoregressive) {
  PrefixHashModel target(40, 1);
  PrefixHashModel drafter(40, 1, /*disagree_every=*/3);
  std::set<int64_t> gammas;
  const auto reference = autoregressive_generate(target, kPrompt, {.max_new_tokens = 80});
  const auto result = speculative_generate(drafter, target, kPrompt, options(80, &gammas));
  EXPECT_EQ(result.tokens, reference.tokens);
  EXPECT_GT(result.stats.accepted, 0);
  EXPECT_LT(result.stats.accepted, result.stats.drafted);
  // The policy really varied the drafts (the fixed-gamma threshold variants vary only at the end).
  EXPECT_GE(gammas.size(), 2u);
}

TEST_P(GreedyPolicies, LlamaEqualsAutoregressive) {
  const models::LlamaConfig config = test::small_llama_config();
  const models::LlamaWeights weights = models::LlamaWeights::random(config, 21, at::kDouble);
  models::LlamaModel<StaticKVCache> target(config, weights);
  models::LlamaModel<StaticKVCache> drafter(config, test::perturbed(weights, 0.15, 4));
  std::set<int64_t> gammas;
  const auto reference = autoregressive_generate(target, kPrompt, {.max_new_tokens = 40});
  const auto result = speculative_generate(drafter, target, kPrompt, options(40, &gammas));
  EXPECT_EQ(result.tokens, reference.tokens);
  EXPECT_GT(result.stats.accepted, 0);
  EXPECT_GE(gammas.size(), 2u);
}

INSTANTIATE_TEST_SUITE_P(Variants, GreedyPolicies,
                         ::testing::Combine(::testing::Range(0, static_cast<int>(variants().size())),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return variants()[static_cast<size_t>(std::get<0>(info.param))].name +
                                  (std::get<1>(info.param) ? "_first_target" : "");
                         });

TEST(DraftLength, EgagMapsEntropyToGammaWithinBounds) {
  specdec::detail::DraftLength egag(SpeculativeOptions{.gamma_policy = GammaPolicy::egag, .gamma_min = 2, .gamma_max = 7});
  EXPECT_EQ(egag.limit(100), 7);  // the bound before the entropy is known
  EXPECT_EQ(egag.choose({.entropy = 0.0, .top = 1.0}, 100), 7);
  EXPECT_EQ(egag.choose({.entropy = 1.0, .top = 0.1}, 100), 2);
  EXPECT_EQ(egag.choose({.entropy = 0.5, .top = 0.5}, 100), 5);  // round(7 - 2.5) = round(4.5)
  EXPECT_EQ(egag.choose({.entropy = 0.3, .top = 0.5}, 100), 6);  // round(7 - 1.5)
  EXPECT_EQ(egag.choose({.entropy = 0.0, .top = 1.0}, 3), 3);    // the room left
  for (int i = 0; i <= 100; ++i) {
    const int64_t gamma = egag.choose({.entropy = i / 100.0, .top = 0.5}, 100);
    EXPECT_GE(gamma, 2);
    EXPECT_LE(gamma, 7);
  }
}

TEST(DraftLength, EgagSmoothsWithAnExponentialMovingAverage) {
  constexpr double kBeta = 0.75;
  specdec::detail::DraftLength egag(SpeculativeOptions{.gamma_policy = GammaPolicy::egag, .gamma_min = 1,
                                              .gamma_max = 9, .egag_ema_beta = kBeta});
  EXPECT_TRUE(std::isnan(egag.smoothed_entropy()));
  const std::vector<double> entropies{0.8, 0.0, 0.0, 1.0, 0.2};
  double expected = entropies[0];  // the first observation starts the average
  for (size_t i = 0; i < entropies.size(); ++i) {
    if (i > 0) expected = kBeta * expected + (1 - kBeta) * entropies[i];
    const int64_t gamma = egag.choose({.entropy = entropies[i], .top = 0.5}, 100);
    EXPECT_DOUBLE_EQ(egag.smoothed_entropy(), expected) << i;
    EXPECT_EQ(gamma, std::lround(9 - expected * 8)) << i;
  }
}

TEST(DraftLength, ScheduleAddsTwoAfterFullAcceptanceAndRemovesOneOtherwise) {
  specdec::detail::DraftLength schedule(SpeculativeOptions{.gamma = 3, .gamma_policy = GammaPolicy::schedule,
                                                  .gamma_min = 2, .gamma_max = 8});
  EXPECT_EQ(schedule.limit(100), 3);
  schedule.after(3, 3);
  EXPECT_EQ(schedule.limit(100), 5);
  schedule.after(5, 5);
  EXPECT_EQ(schedule.limit(100), 7);
  schedule.after(7, 7);
  EXPECT_EQ(schedule.limit(100), 8);  // gamma_max
  EXPECT_EQ(schedule.limit(4), 4);    // the room left
  schedule.after(8, 2);
  EXPECT_EQ(schedule.limit(100), 7);
  for (int i = 0; i < 10; ++i) schedule.after(7, 0);
  EXPECT_EQ(schedule.limit(100), 2);  // gamma_min
  // A starting gamma outside the bounds is clamped into them.
  EXPECT_EQ(specdec::detail::DraftLength({.gamma = 20, .gamma_policy = GammaPolicy::schedule, .gamma_max = 6}).limit(100), 6);
}

// End to end on Markov drafters: the drafter's distribution at a step's first draft position is its
// row for the last token of the sequence.
std::vector<StepInfo> record_steps(const at::Tensor& drafter_transitions, SpeculativeOptions options,
                                   std::vector<std::vector<int64_t>>* contexts, int64_t max_new_tokens = 60) {
  MarkovModel target(target_rows());
  MarkovModel drafter(drafter_transitions);
  const std::vector<int64_t> prompt{0};
  std::vector<int64_t> sequence = prompt;
  std::vector<StepInfo> steps;
  options.max_new_tokens = max_new_tokens;
  options.seed = 5;
  options.on_step = [&](const StepInfo& step) {
    contexts->push_back(sequence);
    steps.push_back(step);
    steps.back().drafts = {};
    steps.back().emitted = {};
    sequence.insert(sequence.end(), step.emitted.begin(), step.emitted.end());
  };
  (void)speculative_generate(drafter, target, prompt, options, MultinomialProcessor{});
  return steps;
}

TEST(Egag, NearUniformDrafterDraftsGammaMinAndNearOneHotDrafterGammaMax) {
  const SpeculativeOptions egag{.gamma_policy = GammaPolicy::egag, .gamma_min = 2, .gamma_max = 6};
  std::vector<std::vector<int64_t>> contexts;
  std::vector<std::vector<int64_t>> peaked_contexts;
  const auto uniform = record_steps(at::ones({4, 4}, at::kDouble), egag, &contexts);
  const at::Tensor one_hot = rows_of({{1e-9, 1, 1e-9, 1e-9}, {1e-9, 1e-9, 1, 1e-9}, {1e-9, 1e-9, 1e-9, 1}, {1, 1e-9, 1e-9, 1e-9}});
  const auto peaked = record_steps(one_hot, egag, &peaked_contexts);
  for (const auto* steps : {&uniform, &peaked}) {
    const auto& contexts_of = steps == &uniform ? contexts : peaked_contexts;
    ASSERT_GT(steps->size(), 5u);
    // Every step after the first (the target's own) drafts gamma_min or gamma_max, or fewer
    // when the length limit is nearer.
    for (size_t i = 1; i < steps->size(); ++i) {
      const int64_t room = 60 - static_cast<int64_t>(contexts_of[i].size() - 1) - 1;
      EXPECT_EQ((*steps)[i].gamma, std::min<int64_t>(steps == &uniform ? 2 : 6, room)) << i;
    }
  }
  EXPECT_NEAR(uniform[1].entropy, 1.0, 1e-6);
  EXPECT_NEAR(peaked[1].entropy, 0.0, 1e-6);
}

TEST(Egag, ReportsTheSmoothedEntropyOfTheDrafterAtEachStep) {
  constexpr double kBeta = 0.5;
  // Rows of entropy 0 (nearly), 1, 0.5 and about 0.68.
  const at::Tensor rows = rows_of({{1e-12, 1, 1e-12, 1e-12}, {1, 1, 1, 1}, {.5, 0, .5, 0}, {.7, .1, .1, .1}});
  std::vector<std::vector<int64_t>> contexts;
  const auto steps = record_steps(rows, {.first_target = false, .gamma_policy = GammaPolicy::egag, .gamma_min = 1,
                                         .gamma_max = 8, .egag_ema_beta = kBeta},
                                  &contexts);
  double expected = std::nan("");
  int64_t checked = 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    if (steps[i].gamma == 0) continue;  // the last step, with room for the target's token only
    const double h = normalised_entropy(rows[contexts[i].back()]);
    expected = std::isnan(expected) ? h : kBeta * expected + (1 - kBeta) * h;
    EXPECT_NEAR(steps[i].entropy, expected, 1e-6) << i;
    const int64_t room = 60 - static_cast<int64_t>(contexts[i].size() - 1) - 1;
    EXPECT_EQ(steps[i].gamma, std::min(std::clamp<int64_t>(std::lround(8 - steps[i].entropy * 7), 1, 8), room)) << i;
    ++checked;
  }
  EXPECT_GT(checked, 10);
}

TEST(Schedule, FollowsThePlusTwoMinusOneRuleOverAGeneration) {
  PrefixHashModel target(40, 2);
  PrefixHashModel drafter(40, 2, 4);
  constexpr int64_t kMaxNew = 120;
  int64_t current = 3;
  int64_t generated = 0;
  std::set<int64_t> seen;
  (void)speculative_generate(
      drafter, target, kPrompt,
      {.max_new_tokens = kMaxNew, .on_step = [&](const StepInfo& step) {
         const int64_t room = kMaxNew - generated - 1;
         if (step.step > 0) {  // the first step is the target's own
           EXPECT_EQ(step.gamma, std::min(current, room)) << step.step;
           EXPECT_EQ(static_cast<int64_t>(step.drafts.size()), step.gamma);
           if (!step.drafts.empty()) {
             current = std::clamp<int64_t>(
                 step.accepted == static_cast<int64_t>(step.drafts.size()) ? current + 2 : current - 1, 1, 7);
           }
           seen.insert(step.gamma);
         }
         generated += static_cast<int64_t>(step.emitted.size());
       }, .gamma = 3, .gamma_policy = GammaPolicy::schedule, .gamma_min = 1, .gamma_max = 7});
  EXPECT_GE(seen.size(), 4u);
}

TEST(ConfidenceStop, StopsBeforeTheFirstPositionBelowPMinOrAboveTheEntropyGate) {
  const at::Tensor& rows = drafter_rows();  // top probabilities .4 .4 .7 .25
  for (const bool by_entropy : {false, true}) {
    SpeculativeOptions options{.gamma = 5};
    if (by_entropy) {
      options.entropy_gate = 0.7;  // row entropies about .92 .88 .68 1
    } else {
      options.p_min = 0.5;
    }
    const auto passes = [&](int64_t token) {
      return by_entropy ? normalised_entropy(rows[token]) <= 0.7 : top_probability(rows[token]) >= 0.5;
    };
    MarkovModel target(target_rows());
    MarkovModel drafter(rows);
    std::vector<int64_t> sequence{2};
    int64_t drafting = 0, stopped = 0;
    options.max_new_tokens = 200;
    options.seed = 3;
    options.on_step = [&](const StepInfo& step) {
      int64_t last = sequence.back();
      for (const int64_t draft : step.drafts) {
        EXPECT_TRUE(passes(last)) << "drafted after token " << last;
        last = draft;
      }
      if (static_cast<int64_t>(step.drafts.size()) < step.gamma) {
        EXPECT_FALSE(passes(last)) << "stopped after token " << last;
        ++stopped;
      }
      drafting += step.drafts.empty() ? 0 : 1;
      sequence.insert(sequence.end(), step.emitted.begin(), step.emitted.end());
    };
    const auto result = speculative_generate(drafter, target, std::vector<int64_t>{2}, options, MultinomialProcessor{});
    EXPECT_GT(stopped, 10) << by_entropy;
    EXPECT_GT(drafting, 10) << by_entropy;
    EXPECT_LT(result.stats.drafter_calls, result.stats.steps * 5);
  }
}

TEST(VerifyThreshold, KeepsDraftsWhileTheTargetProbabilityReachesTheThreshold) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1);
  const at::Tensor p = rows_of({{.1, .6, .3, 0}, {.25, .25, .5, 0}, {0, 0, .2, .8}, {0, 0, 0, 1}});
  const at::Tensor drafts = at::tensor(std::vector<int64_t>{1, 0, 3}, at::kLong);
  const GreedyProcessor greedy;
  EXPECT_EQ(verify_threshold(p, drafts, 0.0, greedy, gen).accepted, 3);
  EXPECT_EQ(verify_threshold(p, drafts, 0.25, greedy, gen).accepted, 3);
  const VerifiedStep step = verify_threshold(p, drafts, 0.3, greedy, gen);
  EXPECT_EQ(step.accepted, 1);
  EXPECT_EQ(step.token, 2);  // sampled from p_1: its argmax
  EXPECT_EQ(step.drafts, (std::vector<int64_t>{1, 0, 3}));
  const VerifiedStep none = verify_threshold(p, drafts, 1.5, greedy, gen);
  EXPECT_EQ(none.accepted, 0);
  EXPECT_EQ(none.token, 1);
  expect_invalid([&] { (void)verify_threshold(p, drafts, -0.5, greedy, gen); }, {"threshold", "-0.5"});
  expect_invalid([&] { (void)verify_threshold(p.narrow(0, 0, 3), drafts, 0.5, greedy, gen); },
                 {"target_probs", "gamma + 1 = 4"});
  expect_invalid([&] { (void)verify_threshold(p * NAN, drafts, 0.5, greedy, gen); }, {"NaN or infinity"});
}

// Acceptance of threshold verification on the Markov pair, summed over a fixed seed set.
GenerationStats threshold_run(double threshold) {
  MarkovModel target(target_rows());
  MarkovModel drafter(drafter_rows());
  GenerationStats sum;
  for (uint64_t seed = 0; seed < 30; ++seed) {
    const auto r = speculative_generate(
        drafter, target, std::vector<int64_t>{static_cast<int64_t>(seed % 4)},
        {.max_new_tokens = 40, .seed = seed, .gamma = 4, .verification = Verification::threshold,
         .threshold = threshold},
        MultinomialProcessor{});
    sum.drafted += r.stats.drafted;
    sum.accepted += r.stats.accepted;
  }
  return sum;
}

TEST(ThresholdVerification, ZeroAcceptsEveryDraftAndAboveOneAcceptsNone) {
  for (const double threshold : {0.0, 1.5}) {
    MarkovModel target(target_rows());
    MarkovModel drafter(drafter_rows());
    int64_t steps = 0;
    (void)speculative_generate(
        drafter, target, std::vector<int64_t>{0},
        {.max_new_tokens = 60, .seed = 9, .on_step = [&](const StepInfo& step) {
           EXPECT_EQ(step.accepted, threshold == 0.0 ? static_cast<int64_t>(step.drafts.size()) : 0);
           ++steps;
         }, .gamma = 3, .verification = Verification::threshold, .threshold = threshold},
        MultinomialProcessor{});
    EXPECT_GT(steps, 10);
  }
}

TEST(ThresholdVerification, AcceptanceDecreasesWithTheThreshold) {
  // The target's probabilities take the values .08 .1 .12 .2 .24 .26 .3 .4 .5; each interval of
  // the grid holds some of them, so each step up removes acceptances.
  double previous = 1.1;
  for (const double threshold : {0.0, 0.09, 0.15, 0.22, 0.28, 0.35, 0.45, 0.6}) {
    const double rate = threshold_run(threshold).acceptance_rate();
    EXPECT_LT(rate, previous) << threshold;
    previous = rate;
  }
  EXPECT_EQ(previous, 0.0);
}

TEST(ThresholdVerification, IsNeverTheDefault) {
  EXPECT_EQ(SpeculativeOptions{}.verification, Verification::rejection);
  EXPECT_EQ(SpeculativeOptions{}.gamma_policy, GammaPolicy::fixed);
  EXPECT_EQ(SpeculativeOptions{}.p_min, 0.0);
  EXPECT_EQ(SpeculativeOptions{}.entropy_gate, 1.0);
  EXPECT_EQ(SpeculativeOptions{}.threshold, 0.25);
}

TEST(Calibration, TabulatesEveryThresholdAndPicksTheClosestAcceptance) {
  MarkovModel target(target_rows());
  MarkovModel drafter(drafter_rows());
  const std::vector<std::vector<int64_t>> prompts{{0}, {1}, {2, 3}};
  const std::vector<double> grid{0.05, 0.15, 0.25, 0.35, 0.45};
  const auto result = calibrate_threshold(drafter, target, prompts, {.max_new_tokens = 50, .seed = 4, .gamma = 3},
                                          {.thresholds = grid, .target_acceptance = 0.5}, MultinomialProcessor{});
  ASSERT_EQ(result.points.size(), grid.size());
  double best_distance = 2;
  double best = -1;
  for (size_t i = 0; i < grid.size(); ++i) {
    const CalibrationPoint& point = result.points[i];
    EXPECT_EQ(point.threshold, grid[i]);
    EXPECT_EQ(point.stats.generated, 150);
    EXPECT_GT(point.seconds(), 0.0);
    // Each row is threshold verification at that threshold over every prompt, with the seed.
    GenerationStats direct;
    for (const auto& prompt : prompts) {
      direct += speculative_generate(drafter, target, prompt,
                                     {.max_new_tokens = 50, .seed = 4, .gamma = 3,
                                      .verification = Verification::threshold, .threshold = grid[i]},
                                     MultinomialProcessor{})
                    .stats;
    }
    EXPECT_EQ(point.stats.accepted, direct.accepted) << grid[i];
    EXPECT_EQ(point.stats.drafted, direct.drafted) << grid[i];
    EXPECT_DOUBLE_EQ(point.tokens_per_target_call(), direct.tokens_per_target_call());
    if (i > 0) {
      EXPECT_LT(point.acceptance_rate(), result.points[i - 1].acceptance_rate());
    }
    if (std::abs(point.acceptance_rate() - 0.5) < best_distance) {
      best_distance = std::abs(point.acceptance_rate() - 0.5);
      best = point.threshold;
    }
  }
  EXPECT_EQ(result.best_threshold, best);

  const std::vector<std::vector<int64_t>> none;
  expect_invalid([&] { (void)calibrate_threshold(drafter, target, none); }, {"prompts", "empty"});
  expect_invalid([&] { (void)calibrate_threshold(drafter, target, prompts, {}, {.thresholds = {}}); },
                 {"thresholds", "empty"});
  expect_invalid([&] { (void)calibrate_threshold(drafter, target, prompts, {}, {.thresholds = {0.2, -1}}); },
                 {"thresholds[1]", "-1"});
  expect_invalid([&] { (void)calibrate_threshold(drafter, target, prompts, {}, {.target_acceptance = 1.5}); },
                 {"target_acceptance", "1.5"});
}

TEST(StepMetrics, PerStepTimesAddUpToTheStatsAndAveragesAreReported) {
  PrefixHashModel target(40, 6);
  PrefixHashModel drafter(40, 6, 3);
  double target_seconds = 0, drafter_seconds = 0;
  int64_t gamma_sum = 0;
  const auto result = speculative_generate(
      drafter, target, kPrompt,
      {.max_new_tokens = 50, .on_step = [&](const StepInfo& step) {
         target_seconds += step.target_seconds;
         drafter_seconds += step.drafter_seconds;
         gamma_sum += step.gamma;
         EXPECT_GE(step.target_seconds, 0.0);
       }, .gamma = 4});
  const GenerationStats& s = result.stats;
  EXPECT_NEAR(target_seconds, s.target_seconds, 1e-9);
  EXPECT_NEAR(drafter_seconds, s.drafter_seconds, 1e-9);
  EXPECT_EQ(gamma_sum, s.drafted);  // fixed gamma, no confidence stop: every planned draft made
  EXPECT_DOUBLE_EQ(s.drafts_per_step(), static_cast<double>(s.drafted) / static_cast<double>(s.steps));
  EXPECT_DOUBLE_EQ(s.accepted_per_step(), static_cast<double>(s.accepted) / static_cast<double>(s.steps));
  EXPECT_DOUBLE_EQ(s.drafter_calls_per_token(), static_cast<double>(s.drafter_calls) / 50.0);
  EXPECT_EQ(GenerationStats{}.drafts_per_step(), 0.0);
}

TEST(AdaptiveOptions, RejectsBadValuesNamingThem) {
  PrefixHashModel target(40, 1);
  PrefixHashModel drafter(40, 1, 3);
  const auto run = [&](SpeculativeOptions options) {
    return [&target, &drafter, options] { (void)speculative_generate(drafter, target, kPrompt, options); };
  };
  expect_invalid(run({.gamma_min = 0}), {"gamma_min", "0"});
  expect_invalid(run({.gamma = 4, .gamma_min = 5}), {"gamma_max", "gamma_min = 5", "4"});
  expect_invalid(run({.gamma_min = 3, .gamma_max = 2}), {"gamma_max", "2"});
  expect_invalid(run({.egag_ema_beta = 1.0}), {"egag_ema_beta", "1"});
  expect_invalid(run({.egag_ema_beta = -0.5}), {"egag_ema_beta", "-0.5"});
  expect_invalid(run({.p_min = 1.5}), {"p_min", "1.5"});
  expect_invalid(run({.entropy_gate = -0.1}), {"entropy_gate", "-0.1"});
  expect_invalid(run({.threshold = -1}), {"threshold", "-1"});
  expect_invalid(run({.threshold = NAN}), {"threshold", "nan"});
  expect_invalid(run({.gamma_policy = static_cast<GammaPolicy>(7)}), {"gamma_policy", "7"});
  expect_invalid(run({.verification = static_cast<Verification>(9)}), {"verification", "9"});
}

}  // namespace

}  // namespace test_adaptive
