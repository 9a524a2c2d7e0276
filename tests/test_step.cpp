// The shared generation step: one device-to-host copy per step in every mode (counted), stop
// reasons, stop sequences across step boundaries, a callback that stops generation, a draft
// source of the caller's own, fp16/bf16 activations, and the same on CUDA where one exists.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "specdec/drafting/eagle.hpp"
#include "specdec/drafting/head_batches.hpp"
#include "specdec/drafting/medusa.hpp"
#include "specdec/io/checkpoint.hpp"
#include "specdec/io/eagle.hpp"
#include "specdec/io/medusa.hpp"
#include "specdec/models/eagle.hpp"
#include "specdec/models/llama.hpp"
#include "specdec/models/medusa.hpp"
#include "specdec/specdec.hpp"
#include "support/exact_continuations.hpp"
#include "support/expect_invalid.hpp"
#include "support/head_fixtures.hpp"
#include "support/host_copies.hpp"
#include "support/llama_fixtures.hpp"
#include "support/markov_fixtures.hpp"
#include "support/statistics.hpp"
#include "support/toy_models.hpp"

// One namespace a file: specdec_tests is compiled as a unity build (tests/CMakeLists.txt).
namespace test_step {

namespace {

using namespace specdec;
using test::exact_continuations;
using test::PrefixHashModel;
using test::random_eagle;

const std::vector<int64_t> kPrompt{1, 7, 3, 22, 5};

// The device-to-host copies `run` makes.
using test::copies_during;

// Drafts the continuation in which the last `period` tokens repeat (examples/custom_drafter.cpp).
class RepeatDrafter {
 public:
  explicit RepeatDrafter(int64_t period) : period_(period) {}
  Drafts draft(const DraftRequest& request, const auto& /*processor*/, at::Generator& /*gen*/) {
    const auto length = static_cast<int64_t>(request.sequence.size());
    drafts_.clear();
    for (int64_t i = 0; i < request.gamma && length >= period_; ++i) {
      const int64_t source = length + i - period_;
      drafts_.push_back(source < length ? request.sequence[static_cast<size_t>(source)]
                                        : drafts_[static_cast<size_t>(source - length)]);
    }
    return Drafts::from_host(drafts_, request.device, 1);
  }
  void verified(const VerifiedDrafts& outcome) {
    ++steps_;
    EXPECT_LE(outcome.accepted, outcome.drafted);
  }
  [[nodiscard]] int64_t steps() const { return steps_; }

 private:
  int64_t period_;
  int64_t steps_ = 0;
  std::vector<int64_t> drafts_;
};
static_assert(DraftSource<RepeatDrafter, GreedyProcessor> && DraftSource<RepeatDrafter, MultinomialProcessor>);

struct LlamaPair {
  models::LlamaConfig config = test::small_llama_config();
  models::LlamaWeights weights = models::LlamaWeights::random(config, 21, at::kDouble);
  models::LlamaModel<StaticKVCache> target{config, weights};
  models::LlamaModel<DynamicKVCache> drafter{config, test::perturbed(weights, 0.15, 4)};
};

TEST(HostCopies, ExactlyOnePerStepInEveryMode) {
  LlamaPair m;
  const MultinomialProcessor sampled{1.0};
  const TopKProcessor top_k{5, 0.8};
  NGramStorage storage(3, m.config.vocab_size);
  PromptLookupDrafter lookup;
  ProbabilisticNGramStorage memory(m.config.vocab_size);
  RepeatDrafter repeat(2);
  const std::vector<std::pair<std::string, std::function<GenerationResult()>>> modes{
      {"autoregressive greedy", [&] { return autoregressive_generate(m.target, kPrompt, {.max_new_tokens = 20}); }},
      {"autoregressive sampled",
       [&] { return autoregressive_generate(m.target, kPrompt, {.max_new_tokens = 20, .seed = 1}, sampled); }},
      {"speculative greedy",
       [&] { return speculative_generate(m.drafter, m.target, kPrompt, {.max_new_tokens = 30, .gamma = 4}); }},
      {"speculative sampled",
       [&] {
         return speculative_generate(m.drafter, m.target, kPrompt,
                                     {.max_new_tokens = 30, .seed = 2, .gamma = 4, .first_target = false}, top_k);
       }},
      {"threshold",
       [&] {
         return speculative_generate(m.drafter, m.target, kPrompt,
                                     {.max_new_tokens = 30, .seed = 3, .gamma = 3,
                                      .verification = Verification::threshold, .threshold = 0.1},
                                     sampled);
       }},
      {"schedule",
       [&] {
         return speculative_generate(m.drafter, m.target, kPrompt,
                                     {.max_new_tokens = 30, .gamma = 2, .gamma_policy = GammaPolicy::schedule,
                                      .gamma_max = 6});
       }},
      {"ngram sampled",
       [&] { return ngram_assisted_generate(storage, m.target, kPrompt, {.max_new_tokens = 30, .seed = 4}, sampled); }},
      {"prompt lookup", [&] { return ngram_assisted_generate(lookup, m.target, kPrompt, {.max_new_tokens = 30}); }},
      {"stand greedy", [&] { return stand_generate(memory, m.target, kPrompt, {.max_new_tokens = 30}); }},
      {"stand sampled",
       [&] { return stand_generate(memory, m.target, kPrompt, {.max_new_tokens = 30, .seed = 5}, sampled); }},
      {"custom source", [&] { return generate_with(repeat, m.target, kPrompt, {.max_new_tokens = 30}); }},
  };
  int64_t custom_steps = 0;
  for (const auto& [name, run] : modes) {
    GenerationResult result;
    const int64_t copies = copies_during([&] { result = run(); });
    EXPECT_GT(result.stats.steps, 1) << name;
    EXPECT_EQ(copies, result.stats.steps) << name;
    custom_steps = result.stats.steps;  // the last mode's
  }
  EXPECT_EQ(repeat.steps(), custom_steps);  // every step reached verified(), the first one too
}

TEST(HostCopies, DraftLengthSignalsAreTheDocumentedExtras) {
  LlamaPair m;
  // EGAG reads the drafter's entropy once per drafting step.
  int64_t drafting_steps = 0;
  GenerationResult egag;
  const int64_t egag_copies = copies_during([&] {
    egag = speculative_generate(m.drafter, m.target, kPrompt,
                                {.max_new_tokens = 40, .on_step = [&](const StepInfo& s) { drafting_steps += s.gamma > 0; },
                                 .gamma = 4, .gamma_policy = GammaPolicy::egag, .gamma_max = 6});
  });
  EXPECT_GT(drafting_steps, 2);
  EXPECT_EQ(egag_copies, egag.stats.steps + drafting_steps);
  // The confidence stop reads a signal before every draft, and once more where it stops.
  int64_t signals = 0;
  GenerationResult gated;
  const int64_t gated_copies = copies_during([&] {
    gated = speculative_generate(
        m.drafter, m.target, kPrompt,
        {.max_new_tokens = 40,
         .on_step = [&](const StepInfo& s) {
           if (s.gamma == 0) return;
           const auto drafted = static_cast<int64_t>(s.drafts.size());
           signals += drafted + (drafted < s.gamma ? 1 : 0);
         },
         .gamma = 4, .p_min = 0.5});
  });
  EXPECT_EQ(gated_copies, gated.stats.steps + signals);
}

TEST(HostCopies, OnePerBeamSearchStep) {
  LlamaPair m;
  BeamSearchResult result;
  const int64_t copies =
      copies_during([&] { result = beam_search_generate(m.target, kPrompt, {.max_new_tokens = 12, .num_beams = 3}); });
  EXPECT_EQ(copies, result.stats.steps);
}

// The generated tokens up to and including the first completion of `stop` within them.
std::vector<int64_t> cut_at(const std::vector<int64_t>& tokens, const std::vector<int64_t>& stop) {
  for (size_t end = stop.size(); end <= tokens.size(); ++end) {
    if (std::equal(stop.begin(), stop.end(), tokens.begin() + static_cast<std::ptrdiff_t>(end - stop.size()))) {
      return {tokens.begin(), tokens.begin() + static_cast<std::ptrdiff_t>(end)};
    }
  }
  return tokens;
}

TEST(StopSequences, StopAcrossStepBoundariesAndEndAtTheirLastToken) {
  PrefixHashModel target(40, 1);
  PrefixHashModel drafter(40, 1, /*disagree_every=*/3);
  const auto reference = autoregressive_generate(target, kPrompt, {.max_new_tokens = 60}).tokens;
  for (int64_t gamma : {2, 4, 8}) {
    // Where this gamma's steps begin (in generated tokens).
    std::vector<int64_t> starts;
    const auto record = [&](const StepInfo& s) {
      starts.push_back(s.position - static_cast<int64_t>(kPrompt.size()));
    };
    (void)speculative_generate(drafter, target, kPrompt, {.max_new_tokens = 60, .on_step = record, .gamma = gamma});
    int64_t tested = 0;
    for (const int64_t start : starts) {
      if (start < 2 || start + 1 >= static_cast<int64_t>(reference.size())) continue;
      // Two and three tokens that straddle the boundary between two steps.
      const auto at = [&](int64_t i) { return reference[static_cast<size_t>(i)]; };
      for (const std::vector<int64_t>& stop : {std::vector<int64_t>{at(start - 1), at(start)},
                                               std::vector<int64_t>{at(start - 2), at(start - 1), at(start)},
                                               std::vector<int64_t>{at(start - 1), at(start), at(start + 1)}}) {
        const auto expected = cut_at(reference, stop);
        const auto result = speculative_generate(drafter, target, kPrompt,
                                                 {.max_new_tokens = 60, .stop_sequences = {stop}, .gamma = gamma});
        EXPECT_EQ(result.tokens, expected) << "gamma " << gamma << " boundary " << start;
        EXPECT_EQ(result.stop_reason, StopReason::stop_sequence);
        ++tested;
      }
    }
    EXPECT_GT(tested, 4) << "gamma " << gamma;
  }
}

TEST(StopSequences, MatchOnlyGeneratedTokensInEveryMode) {
  LlamaPair m;
  const auto reference = autoregressive_generate(m.target, kPrompt, {.max_new_tokens = 40}).tokens;
  // The prompt's last token followed by the first generated one: not a match, it starts in the
  // prompt; the generation stops at the pair's first completion within the output, if any.
  const std::vector<int64_t> straddling{kPrompt.back(), reference[0]};
  const std::vector<int64_t> inside{reference[9], reference[10], reference[11]};
  NGramStorage storage(3, m.config.vocab_size);
  ProbabilisticNGramStorage memory(m.config.vocab_size);
  for (const auto& stop : {straddling, inside}) {
    const auto expected = cut_at(reference, stop);
    if (stop == inside) {
      ASSERT_LE(expected.size(), 12u);
    }
    const std::vector<std::vector<int64_t>> stops{stop};
    EXPECT_EQ(autoregressive_generate(m.target, kPrompt, {.max_new_tokens = 40, .stop_sequences = stops}).tokens,
              expected);
    EXPECT_EQ(speculative_generate(m.drafter, m.target, kPrompt, {.max_new_tokens = 40, .stop_sequences = stops}).tokens,
              expected);
    EXPECT_EQ(ngram_assisted_generate(storage, m.target, kPrompt, {.max_new_tokens = 40, .stop_sequences = stops}).tokens,
              expected);
    EXPECT_EQ(stand_generate(memory, m.target, kPrompt, {.max_new_tokens = 40, .stop_sequences = stops}).tokens,
              expected);
  }
}

TEST(StopReasons, EachReasonIsReported) {
  PrefixHashModel target(40, 1);
  PrefixHashModel drafter(40, 1, 3);
  const auto full = speculative_generate(drafter, target, kPrompt, {.max_new_tokens = 30, .gamma = 4});
  EXPECT_EQ(full.stop_reason, StopReason::max_new_tokens);
  EXPECT_EQ(full.tokens.size(), 30u);

  const int64_t end_token = full.tokens[12];
  const auto first_end = std::find(full.tokens.begin(), full.tokens.end(), end_token);
  const auto ended = speculative_generate(drafter, target, kPrompt,
                                          {.max_new_tokens = 30, .eos_token_ids = {end_token}, .gamma = 4});
  EXPECT_EQ(ended.stop_reason, StopReason::end_token);
  EXPECT_EQ(ended.tokens, std::vector<int64_t>(full.tokens.begin(), first_end + 1));

  // The callback stops after the third step: what was emitted so far is returned.
  int64_t emitted = 0;
  const auto stopped = speculative_generate(
      drafter, target, kPrompt,
      {.max_new_tokens = 30, .on_step = [&](const StepInfo& s) {
         emitted += static_cast<int64_t>(s.emitted.size());
         return s.step == 2 ? StepAction::stop : StepAction::proceed;
       }, .gamma = 4});
  EXPECT_EQ(stopped.stop_reason, StopReason::callback);
  EXPECT_EQ(stopped.stats.steps, 3);
  EXPECT_EQ(static_cast<int64_t>(stopped.tokens.size()), emitted);
  EXPECT_EQ(stopped.tokens, std::vector<int64_t>(full.tokens.begin(), full.tokens.begin() + emitted));
  // A callback that stops on the last step does not change the reason.
  EXPECT_EQ(autoregressive_generate(target, kPrompt,
                                    {.max_new_tokens = 1, .on_step = [](const StepInfo&) { return StepAction::stop; }})
                .stop_reason,
            StopReason::max_new_tokens);

  models::LlamaConfig config = test::small_llama_config();
  config.max_seq_len = 16;
  models::LlamaModel<StaticKVCache> short_target(config, models::LlamaWeights::random(config, 8));
  const auto limited = autoregressive_generate(short_target, kPrompt, {.max_new_tokens = 40});
  EXPECT_EQ(limited.stop_reason, StopReason::sequence_limit);
  EXPECT_EQ(limited.tokens.size(), 16u - kPrompt.size());
  EXPECT_EQ(autoregressive_generate(short_target, kPrompt, {.max_new_tokens = 11}).stop_reason,
            StopReason::max_new_tokens);
}

// Counts at the edge of int64 neither overflow nor change the output: max_new_tokens is bounded by
// the context, and the schedule and EGAG policies saturate at gamma_max.
TEST(Limits, ExtremeCountsAreSafe) {
  models::LlamaConfig config = test::small_llama_config();
  config.max_seq_len = 24;
  const models::LlamaWeights weights = models::LlamaWeights::random(config, 8);
  models::LlamaModel<StaticKVCache> target(config, weights), drafter(config, test::perturbed(weights, 0.05, 3));
  constexpr int64_t kHuge = std::numeric_limits<int64_t>::max();
  const auto reference = autoregressive_generate(target, kPrompt, {.max_new_tokens = kHuge});
  EXPECT_EQ(reference.stop_reason, StopReason::sequence_limit);
  EXPECT_EQ(reference.tokens.size(), 24u - kPrompt.size());
  for (const GammaPolicy policy : {GammaPolicy::fixed, GammaPolicy::schedule, GammaPolicy::egag}) {
    const auto result = speculative_generate(
        drafter, target, kPrompt, {.max_new_tokens = kHuge, .gamma = kHuge, .gamma_policy = policy});
    EXPECT_EQ(result.tokens, reference.tokens) << static_cast<int>(policy);
  }
}

// A drafter with a shorter context than the target's drafts what fits and then lets the target
// go on alone: the output is the target's to the target's own limit.
TEST(Limits, AShorterDrafterContextDoesNotCutGenerationShort) {
  models::LlamaConfig config = test::small_llama_config();
  const models::LlamaWeights weights = models::LlamaWeights::random(config, 8);
  models::LlamaModel<StaticKVCache> target(config, weights);
  models::LlamaConfig short_config = config;
  short_config.max_seq_len = 16;
  models::LlamaModel<StaticKVCache> drafter(short_config, weights);
  const auto reference = autoregressive_generate(target, kPrompt, {.max_new_tokens = 40});
  const auto result = speculative_generate(drafter, target, kPrompt, {.max_new_tokens = 40, .gamma = 4});
  EXPECT_EQ(result.tokens, reference.tokens);
  EXPECT_EQ(result.stop_reason, StopReason::max_new_tokens);
  EXPECT_GT(result.stats.accepted, 0) << "the drafter drafted while it fit";
  // A prompt longer than the drafter's context: the target alone, still the target's output.
  const std::vector<int64_t> long_prompt(20, 3);
  EXPECT_EQ(speculative_generate(drafter, target, long_prompt, {.max_new_tokens = 10}).tokens,
            autoregressive_generate(target, long_prompt, {.max_new_tokens = 10}).tokens);
}

TEST(StopSequences, RejectsBadOnesNamingThem) {
  PrefixHashModel target(40, 1);
  test::expect_invalid([&] { (void)autoregressive_generate(target, kPrompt, {.stop_sequences = {{1}, {}}}); },
                       {"stop_sequences[1] must not be empty"});
  test::expect_invalid([&] { (void)autoregressive_generate(target, kPrompt, {.stop_sequences = {{1, 40}}}); },
                       {"stop_sequences[0][1]", "40"});
}

TEST(DraftSource, ACustomSourceIsExactAndRunsTheSharedStep) {
  LlamaPair m;
  const auto reference = autoregressive_generate(m.target, kPrompt, {.max_new_tokens = 40});
  for (int64_t period : {1, 2, 3}) {
    RepeatDrafter repeat(period);
    const auto result = generate_with(repeat, m.target, kPrompt, {.max_new_tokens = 40, .gamma = 3});
    EXPECT_EQ(result.tokens, reference.tokens) << "period " << period;
    EXPECT_GT(result.stats.drafted, 0);
    // Every step but the first target step drafts, and the last when only one token is left.
    EXPECT_GE(result.stats.drafter_calls, result.stats.steps - 2);
    EXPECT_LE(result.stats.drafter_calls, result.stats.steps - 1);
  }
  // A cyclic chain: the repeat drafter's drafts are the target's, so every draft is accepted.
  at::Tensor cycle = at::full({4, 4}, 0.02, at::kDouble);
  for (int64_t t = 0; t < 4; ++t) cycle[t][(t + 1) % 4] = 0.94;
  test::MarkovModel chain(cycle);
  RepeatDrafter repeat(4);
  const auto cyclic = generate_with(repeat, chain, std::vector<int64_t>{0, 1, 2, 3}, {.max_new_tokens = 41, .gamma = 4});
  EXPECT_EQ(cyclic.stats.accepted, cyclic.stats.drafted);
  EXPECT_EQ(cyclic.stats.target_calls, 9);  // 1 + 8 steps of 4 drafts and 1 token
}

TEST(GreedyFastPath, EqualsRejectionSamplingWithGreedyDistributions) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(3);
  at::Generator uniforms = at::make_generator<at::CPUGeneratorImpl>(4);
  const GreedyProcessor greedy;
  for (int64_t trial = 0; trial < 300; ++trial) {
    const int64_t gamma = trial % 6;
    // Logits on a coarse grid, so that ties occur; drafts often equal the argmax.
    at::Tensor logits = at::randint(0, 4, {gamma + 1, 9}, gen, at::TensorOptions(at::kFloat));
    at::Tensor drafts = at::randint(0, 9, {gamma}, gen, at::TensorOptions(at::kLong));
    const at::Tensor best = logits.argmax(1);
    for (int64_t i = 0; i < gamma; ++i) {
      if (at::rand({1}, gen).item<double>() < 0.7) drafts[i] = best[i];
    }
    if (trial % 50 == 7) logits[gamma][2] = NAN;
    const at::Tensor q = greedy(at::randn({gamma, 9}, gen));
    const auto fast = specdec::detail::verify_greedy_pending(logits, q, drafts);
    const at::Tensor host = specdec::detail::to_host(fast.packed);
    if (trial % 50 == 7) {
      EXPECT_THROW((void)specdec::detail::read_step(fast, host.data_ptr<int64_t>()), std::invalid_argument)
          << "a NaN row is reported";
      continue;
    }
    const VerifiedStep expected = verify_drafts(greedy(logits), q, drafts, greedy, uniforms);
    const VerifiedStep got = specdec::detail::read_step(fast, host.data_ptr<int64_t>());
    EXPECT_EQ(got.accepted, expected.accepted) << "trial " << trial;
    EXPECT_EQ(got.token, expected.token) << "trial " << trial;
    EXPECT_EQ(got.drafts, expected.drafts);
  }
}

// The greedy verification decoded by the host (fp32 logits on the CPU) and by ATen (the same
// logits in fp64, the path of other dtypes and devices): the same packed step, ties, non-finite
// rows of every kind (NaN, +inf, only -inf) and a non-finite drafter included.
TEST(GreedyFastPath, HostDecodeEqualsTheAtenDecode) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(11);
  const float inf = std::numeric_limits<float>::infinity();
  int64_t non_finite = 0;
  for (int64_t trial = 0; trial < 200; ++trial) {
    const int64_t gamma = trial % 5;
    at::Tensor logits = at::randint(0, 3, {gamma + 1, 7}, gen, at::TensorOptions(at::kFloat));
    const at::Tensor drafts = at::randint(0, 7, {gamma}, gen, at::TensorOptions(at::kLong));
    const int64_t row = trial % (gamma + 1);
    switch (trial % 7) {
      case 1: logits[row][3] = NAN; break;
      case 2: logits[row][0] = inf; break;
      case 3: logits[row].fill_(-inf); break;
      case 4: logits[row][5] = -inf; break;  // finite: one -inf entry is a zero probability
      default: break;
    }
    at::Tensor drafter_finite;
    if (trial % 3 == 1) drafter_finite = at::scalar_tensor(trial % 6 != 1, at::TensorOptions().dtype(at::kBool));
    const auto host = specdec::detail::verify_greedy_pending(logits, at::Tensor(), drafts, drafter_finite);
    const auto aten = specdec::detail::verify_greedy_pending(logits.to(at::kDouble), at::Tensor(), drafts, drafter_finite);
    ASSERT_EQ(host.size(), aten.size());
    const at::Tensor a = specdec::detail::to_host(host.packed), b = specdec::detail::to_host(aten.packed);
    const int64_t* x = a.data_ptr<int64_t>();
    const int64_t* y = b.data_ptr<int64_t>();
    EXPECT_EQ(x[gamma + 1], y[gamma + 1]) << "finite code, trial " << trial;
    for (int64_t i = 0; i < gamma; ++i) EXPECT_EQ(x[gamma + 2 + i], y[gamma + 2 + i]) << "draft " << i;
    if (x[gamma + 1] != specdec::detail::kFinite) {
      ++non_finite;
      continue;  // the step throws; the argmax of a NaN row is not compared
    }
    for (int64_t i = 0; i <= gamma; ++i) EXPECT_EQ(x[i], y[i]) << "argmax of row " << i << ", trial " << trial;
  }
  EXPECT_GT(non_finite, 50);  // the non-finite kinds were exercised
}

// Greedy output with fp16/bf16 activations against fp32, on the bundled pair.
TEST(Dtypes, ReducedPrecisionGreedyOutputAgainstFloat32) {
  const std::string folder = SPECDEC_BUNDLED_MODELS_DIR;
  const auto prompt = std::vector<int64_t>{'d', 'e', 'f', ' ', 'm', 'a', 'i', 'n', '(', ')', ':', '\n'};
  const auto run = [&](at::ScalarType dtype) {
    const auto t = io::load_llama(folder + "/target", dtype);
    const auto d = io::load_llama(folder + "/drafter", dtype);
    models::LlamaModel<StaticKVCache> target(t.config, t.weights);
    models::LlamaModel<StaticKVCache> drafter(d.config, d.weights);
    return speculative_generate(drafter, target, prompt, {.max_new_tokens = 128, .gamma = 4}).tokens;
  };
  const auto reference = run(at::kFloat);
  ASSERT_EQ(reference.size(), 128u);
  const auto bf16 = run(at::kBFloat16);
  int64_t same_prefix = 0;
  while (same_prefix < 128 && bf16[static_cast<size_t>(same_prefix)] == reference[static_cast<size_t>(same_prefix)]) {
    ++same_prefix;
  }
  // bf16 keeps 8 bits of mantissa, so its argmax may leave fp32's where two logits are close;
  // the bar is the first 64 of 128 tokens (measured here: printed below).
  std::cout << "bundled pair, bf16 greedy output equal to fp32 for the first " << same_prefix << " of 128 tokens\n";
  EXPECT_GE(same_prefix, 64);
}

TEST(Dtypes, Float16GreedyOutputAgainstFloat32) {
  try {
    const at::Tensor x = at::ones({2, 2}, at::kHalf);
    (void)at::linear(x, x);
  } catch (const std::exception&) {
    GTEST_SKIP() << "this libtorch has no float16 matrix products on the CPU (1.13 has not, 2.x has)";
  }
  const std::string folder = SPECDEC_BUNDLED_MODELS_DIR;
  const std::vector<int64_t> prompt{'i', 'm', 'p', 'o', 'r', 't', ' '};
  const auto run = [&](at::ScalarType dtype) {
    const auto t = io::load_llama(folder + "/target", dtype);
    models::LlamaModel<StaticKVCache> target(t.config, t.weights);
    return autoregressive_generate(target, prompt, {.max_new_tokens = 128}).tokens;
  };
  const auto reference = run(at::kFloat);
  const auto half = run(at::kHalf);
  int64_t same_prefix = 0;
  while (same_prefix < 128 && half[static_cast<size_t>(same_prefix)] == reference[static_cast<size_t>(same_prefix)]) {
    ++same_prefix;
  }
  EXPECT_GE(same_prefix, 64);
}

// The same checks on every device this machine has: CPU always, CUDA where present.
class OnDevice : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (GetParam() == "cuda" && !at::hasCUDA()) GTEST_SKIP() << "no CUDA device on this machine";
  }
  [[nodiscard]] at::Device device() const { return GetParam() == "cuda" ? at::Device(at::kCUDA) : at::Device(at::kCPU); }
};

TEST_P(OnDevice, GreedyEqualsTheCpuReferenceWithOneCopyPerStep) {
  const models::LlamaConfig config = test::small_llama_config();
  const auto options = at::TensorOptions(at::kDouble).device(device());
  models::LlamaModel<StaticKVCache> target(config, models::LlamaWeights::random(config, 21, options));
  models::LlamaModel<StaticKVCache> drafter(config, test::perturbed(models::LlamaWeights::random(config, 21, options), 0.15, 4));
  models::LlamaModel<StaticKVCache> cpu_target(config, models::LlamaWeights::random(config, 21, at::kDouble));
  const auto reference = autoregressive_generate(cpu_target, kPrompt, {.max_new_tokens = 40});
  GenerationResult result;
  const int64_t copies = copies_during(
      [&] { result = speculative_generate(drafter, target, kPrompt, {.max_new_tokens = 40, .gamma = 4}); });
  EXPECT_EQ(result.tokens, reference.tokens);
  EXPECT_EQ(copies, result.stats.steps);
  ProbabilisticNGramStorage memory(config.vocab_size);
  GenerationResult stand;
  const int64_t stand_copies =
      copies_during([&] { stand = stand_generate(memory, target, kPrompt, {.max_new_tokens = 40}); });
  EXPECT_EQ(stand.tokens, reference.tokens);
  EXPECT_EQ(stand_copies, stand.stats.steps);
}

TEST_P(OnDevice, SampledSpeculativeDecodingIsExact) {
  // Two tokens after the prompt, sampled by speculative decoding between the Markov fixtures:
  // their distribution must be the target chain's, checked by chi-square at a tail of 1e-6.
  test::MarkovModel target(test::markov_target_rows().to(device()));
  test::MarkovModel drafter(test::markov_drafter_rows().to(device()));
  const MultinomialProcessor processor{1.0};
  const at::Tensor p = test::markov_target_rows();
  const std::vector<int64_t> prompt{2};
  std::map<std::pair<int64_t, int64_t>, double> expected;
  for (int64_t a = 0; a < 4; ++a) {
    for (int64_t b = 0; b < 4; ++b) expected[{a, b}] = p[2][a].item<double>() * p[a][b].item<double>();
  }
  constexpr int64_t kSamples = 3000;
  std::map<std::pair<int64_t, int64_t>, int64_t> observed;
  for (int64_t i = 0; i < kSamples; ++i) {
    const auto tokens = speculative_generate(
        drafter, target, prompt,
        {.max_new_tokens = 2, .seed = static_cast<uint64_t>(i), .gamma = 2, .first_target = false}, processor).tokens;
    ++observed[{tokens[0], tokens[1]}];
  }
  const test::ChiSquare fit = test::chi_square(observed, expected, kSamples);
  EXPECT_EQ(fit.outside_support, 0);
  EXPECT_LT(fit.statistic, test::chi_square_quantile(fit.dof, 4.75));
}

TEST_P(OnDevice, SessionsKeepTheCacheAcrossTurns) {
  const models::LlamaConfig config = test::small_llama_config();
  const auto options = at::TensorOptions(at::kDouble).device(device());
  models::LlamaModel<StaticKVCache> target(config, models::LlamaWeights::random(config, 21, options));
  models::LlamaModel<DynamicKVCache> drafter(config, test::perturbed(models::LlamaWeights::random(config, 21, options), 0.15, 4));
  Session session(target);
  ModelDraftSource drafts(drafter);
  session.append(kPrompt);
  const auto first = session.generate(drafts, {.max_new_tokens = 20, .gamma = 3});
  session.append(std::vector<int64_t>{4, 4, 9});
  GenerationResult second;
  const int64_t copies = copies_during([&] { second = session.generate(drafts, {.max_new_tokens = 20, .gamma = 3}); });
  EXPECT_EQ(copies, second.stats.steps);
  EXPECT_EQ(session.cache().length(), session.length() - 1);
  const std::vector<int64_t> conversation(session.tokens().begin(), session.tokens().begin() + session.length() - 20);
  EXPECT_EQ(second.tokens, autoregressive_generate(target, conversation, {.max_new_tokens = 20}).tokens);
  EXPECT_EQ(first.tokens.size(), 20u);
}

INSTANTIATE_TEST_SUITE_P(Devices, OnDevice, ::testing::Values("cpu", "cuda"));

// A draft source that reads the target's hidden states (feature_taps()): drafts come from a
// drafter model, and every verified() records the features the step handed over.
template <class D>
class FeatureRecorder {
 public:
  FeatureRecorder(D& drafter, std::vector<int64_t> taps) : inner_(drafter), taps_(std::move(taps)) {}
  [[nodiscard]] std::span<const int64_t> feature_taps() const { return taps_; }
  void start(std::span<const int64_t> sequence, const SpeculativeOptions& options) { inner_.start(sequence, options); }
  void finish(std::span<const int64_t> sequence) { inner_.finish(sequence); }
  template <LogitsProcessor P>
  Drafts draft(const DraftRequest& request, const P& processor, at::Generator& gen) {
    return inner_.draft(request, processor, gen);
  }
  void verified(const VerifiedDrafts& outcome) {
    inner_.verified(outcome);
    ASSERT_TRUE(outcome.features.defined());
    EXPECT_EQ(outcome.features_from, next_) << "features of a step start where the last ones ended";
    EXPECT_EQ(outcome.features.size(0), outcome.position - outcome.features_from + outcome.accepted);
    next_ = outcome.features_from + outcome.features.size(0);
    rows_.push_back(outcome.features);
  }
  // Every recorded row, in sequence order.
  [[nodiscard]] at::Tensor rows() const { return at::cat(rows_, 0); }

 private:
  ModelDraftSource<D> inner_;
  std::vector<int64_t> taps_;
  int64_t next_ = 0;
  std::vector<at::Tensor> rows_;
};
static_assert(HasFeatureTaps<FeatureRecorder<models::LlamaModel<StaticKVCache>>>);

// The step core hands a feature-reading source the target's hidden states of every position it
// fed, step after step and turn after turn of a session, equal to those of the whole sequence
// from scratch, on the device and within the step's one host copy; the output is unchanged.
TEST(FeatureTaps, TheStepHandsTheSourceEveryFedPositionsHiddenStates) {
  using Model = models::LlamaModel<StaticKVCache>;
  const models::LlamaConfig config = test::small_llama_config();
  const models::LlamaWeights weights = models::LlamaWeights::random(config, 5);
  Model target(config, weights);
  Model reference(config, weights);
  Model drafter(config, test::perturbed(weights, 0.02, 9));
  const std::vector<int64_t> taps{config.n_layers, 0, 1};
  const std::vector<int64_t> prompt{3, 17, 5, 5, 40, 2};
  FeatureRecorder<Model> source(drafter, taps);
  GenerationResult result;
  const int64_t copies = copies_during([&] { result = generate_with(source, target, prompt, {.max_new_tokens = 30, .gamma = 4}); });
  EXPECT_EQ(copies, result.stats.steps);
  const GenerationResult alone = autoregressive_generate(reference, prompt, {.max_new_tokens = 30});
  EXPECT_EQ(result.tokens, alone.tokens);
  EXPECT_GT(result.stats.accepted, 0);
  EXPECT_LT(result.stats.accepted, result.stats.drafted) << "the test should see rejected drafts too";
  std::vector<int64_t> sequence = prompt;
  sequence.insert(sequence.end(), result.tokens.begin(), result.tokens.end());
  auto fresh = reference.make_cache(1);
  const at::Tensor ids = at::tensor(sequence, at::kLong).view({1, -1});
  const at::Tensor expected = reference.forward_features(ids, fresh, taps).features[0];
  const at::Tensor got = source.rows();
  ASSERT_EQ(got.size(0), static_cast<int64_t>(sequence.size()) - 1);  // all but the last token, fed next
  EXPECT_TRUE(at::allclose(got, expected.narrow(0, 0, got.size(0)), 1e-4, 1e-4))
      << (got - expected.narrow(0, 0, got.size(0))).abs().max().item<float>();

  // A session's second turn hands over the positions its first turn did not feed.
  Session<Model> session(target);
  FeatureRecorder<Model> turns(drafter, taps);
  session.append(prompt);
  const GenerationResult first = session.generate(turns, {.max_new_tokens = 12, .gamma = 3});
  session.append(std::vector<int64_t>{7, 8});
  const GenerationResult second = session.generate(turns, {.max_new_tokens = 12, .gamma = 3});
  const std::span<const int64_t> all = session.tokens();
  auto whole = reference.make_cache(1);
  const at::Tensor session_expected =
      reference.forward_features(at::tensor(std::vector<int64_t>(all.begin(), all.end()), at::kLong).view({1, -1}), whole, taps)
          .features[0];
  const at::Tensor session_got = turns.rows();
  ASSERT_EQ(session_got.size(0), static_cast<int64_t>(all.size()) - 1);
  EXPECT_TRUE(at::allclose(session_got, session_expected.narrow(0, 0, session_got.size(0)), 1e-4, 1e-4));
  EXPECT_EQ(first.tokens.size() + second.tokens.size() + prompt.size() + 2, all.size());
}

// Medusa heads on the step core: greedy output equals autoregressive decoding (with drafts made
// and some accepted), one host copy per step, and each draft is a head's top token at the hidden
// state of the last accepted position.
TEST(Medusa, GreedyOutputEqualsAutoregressiveDecoding) {
  using Model = models::LlamaModel<StaticKVCache>;
  const models::LlamaConfig config = test::small_llama_config();
  const models::LlamaWeights weights = models::LlamaWeights::random(config, 5);
  Model target(config, weights);
  Model reference(config, weights);
  const models::MedusaConfig heads_config{.hidden_size = config.dim, .vocab_size = config.vocab_size, .num_heads = 3};
  const models::MedusaHeads heads(heads_config, models::MedusaHeads::random(heads_config, 3));
  MedusaDraftSource source(heads, target);
  const std::vector<int64_t> prompt{3, 17, 5, 5, 40, 2};
  GenerationResult result;
  const int64_t copies = copies_during([&] { result = generate_with(source, target, prompt, {.max_new_tokens = 60, .gamma = 3}); });
  EXPECT_EQ(result.tokens, autoregressive_generate(reference, prompt, {.max_new_tokens = 60}).tokens);
  EXPECT_EQ(copies, result.stats.steps);
  EXPECT_GT(result.stats.drafted, 0);
  EXPECT_LE(result.stats.drafted, 3 * result.stats.steps);
  std::cout << "[ figures  ] medusa heads (random): " << result.stats.drafted << " drafted, " << result.stats.accepted
            << " accepted in " << result.stats.steps << " steps\n";

  // The drafts after a step are the heads' top tokens at the last fed position's hidden state.
  std::vector<int64_t> sequence = prompt;
  sequence.push_back(result.tokens.front());
  auto cache = reference.make_cache(1);
  const std::vector<int64_t> taps{config.n_layers};
  const at::Tensor features =
      reference.forward_features(at::tensor(prompt, at::kLong).view({1, -1}), cache, taps).features[0];
  MedusaDraftSource manual(heads, target);
  manual.start(sequence, {});
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1);
  EXPECT_EQ(manual.draft(DraftRequest{.sequence = sequence, .gamma = 3, .room = 10}, GreedyProcessor{}, gen).size(), 0)
      << "no drafts before a verified step";
  manual.verified(VerifiedDrafts{.sequence = sequence, .position = 6, .features = features, .features_from = 0});
  const Drafts drafts = manual.draft(DraftRequest{.sequence = sequence, .gamma = 2, .room = 10}, GreedyProcessor{}, gen);
  ASSERT_EQ(drafts.size(), 2);
  EXPECT_TRUE(at::equal(drafts.tokens, heads.logits(features[5], 2).argmax(-1)));
  EXPECT_FALSE(at::equal(heads.logits(features[5], 2).argmax(-1), heads.logits(features[4], 2).argmax(-1)))
      << "another position's hidden state would give other drafts: the check above can fail";
  sequence.push_back(7);  // a sequence the hidden state is not the one before the last of
  EXPECT_EQ(manual.draft(DraftRequest{.sequence = sequence, .gamma = 2, .room = 10}, GreedyProcessor{}, gen).size(), 0);

  const models::MedusaConfig wide{.hidden_size = config.dim + 1, .vocab_size = config.vocab_size, .num_heads = 1};
  const models::MedusaHeads misfit(wide, models::MedusaHeads::random(wide, 1));
  test::expect_invalid([&] { MedusaDraftSource refused(misfit, target); }, {"hidden_size = 33"});
  test::expect_invalid([&] { (void)models::MedusaHeads({.hidden_size = 4, .vocab_size = 8, .num_heads = 0}, {}); },
                       {"medusa_num_heads = 0"});
}

// Whether three sampled tokens after a prompt, with Medusa heads drafting from the second step
// on, fit the target's exact distribution by chi-square at a tail of 1e-6: one prompt through
// generate_with, or (`batched`) each of two prompts generated as one batch with the heads drafting
// for both rows at once (medusa_generate_batch).
bool medusa_samples_fit(bool skip_sample_adjustment, bool batched = false) {
  using Model = models::LlamaModel<StaticKVCache>;
  models::LlamaConfig config = test::small_llama_config();
  config.vocab_size = 6;
  const models::LlamaWeights weights = models::LlamaWeights::random(config, 8);
  Model target(config, weights);
  const models::MedusaConfig heads_config{.hidden_size = config.dim, .vocab_size = 6, .num_heads = 2};
  const models::MedusaHeads heads(heads_config, models::MedusaHeads::random(heads_config, 4));
  const MultinomialProcessor processor{2.0};
  std::vector<std::vector<int64_t>> prompts{{1, 4, 2}};
  if (batched) prompts.push_back({5, 0, 3, 3, 1});
  std::vector<std::map<std::vector<int64_t>, double>> expected;
  for (const auto& prompt : prompts) expected.push_back(exact_continuations(target, processor, prompt, 3));
  constexpr int64_t kSamples = 4000;
  std::vector<std::map<std::vector<int64_t>, int64_t>> observed(prompts.size());
  int64_t drafted = 0;
  for (int64_t i = 0; i < kSamples; ++i) {
    const SpeculativeOptions options{.max_new_tokens = 3, .seed = static_cast<uint64_t>(i), .gamma = 2,
                                     .skip_sample_adjustment = skip_sample_adjustment};
    MedusaDraftSource source(heads, target);
    const std::vector<GenerationResult> results =
        batched ? medusa_generate_batch(heads, target, prompts, options, processor)
                : std::vector<GenerationResult>{generate_with(source, target, prompts[0], options, processor)};
    for (size_t r = 0; r < prompts.size(); ++r) {
      ++observed[r][results[r].tokens];
      drafted += results[r].stats.drafted;
    }
  }
  EXPECT_GT(drafted, kSamples / 2 * static_cast<int64_t>(prompts.size())) << "the heads should draft in most generations";
  bool fit = true;
  for (size_t r = 0; r < prompts.size(); ++r) {
    const test::ChiSquare row = test::chi_square(observed[r], expected[r], kSamples);
    fit = fit && row.outside_support == 0 && row.statistic < test::chi_square_quantile(row.dof, 4.75);
  }
  return fit;
}

// Packed weights (an int8 target, a bf16 drafter): three tokens sampled by speculative decoding
// are distributed as the quantized target's own, by chi-square at a tail of 1e-6; the check can
// tell: the drafter's own samples fail it.
TEST(PackedWeights, SampledSpeculativeDecodingIsTheQuantizedTarget) {
  using Model = models::LlamaModel<StaticKVCache>;
  models::LlamaConfig config = test::small_llama_config();
  config.vocab_size = 6;
  const models::LlamaWeights weights = models::LlamaWeights::random(config, 8);
  Model target(config, weights);
  target.quantize_int8();
  Model drafter(config, test::perturbed(weights, 0.3, 5));
  drafter.pack_weights(specdec::detail::WeightFormat::bf16);
  const MultinomialProcessor processor{1.5};
  const std::vector<int64_t> prompt{1, 4, 2};
  const std::map<std::vector<int64_t>, double> expected = exact_continuations(target, processor, prompt, 3);
  constexpr int64_t kSamples = 4000;
  std::map<std::vector<int64_t>, int64_t> speculative, drafter_alone;
  int64_t accepted = 0;
  for (int64_t i = 0; i < kSamples; ++i) {
    const GenerationOptions sampled{.max_new_tokens = 3, .seed = static_cast<uint64_t>(i)};
    const SpeculativeOptions options{
        .max_new_tokens = 3, .seed = static_cast<uint64_t>(i), .gamma = 2, .first_target = false};
    const GenerationResult result = speculative_generate(drafter, target, prompt, options, processor);
    ++speculative[result.tokens];
    accepted += result.stats.accepted;
    ++drafter_alone[autoregressive_generate(drafter, prompt, sampled, processor).tokens];
  }
  EXPECT_GT(accepted, kSamples / 4) << "the drafter should be accepted often";
  const test::ChiSquare fit = test::chi_square(speculative, expected, kSamples);
  EXPECT_EQ(fit.outside_support, 0);
  EXPECT_LT(fit.statistic, test::chi_square_quantile(fit.dof, 4.75));
  const test::ChiSquare power = test::chi_square(drafter_alone, expected, kSamples);
  EXPECT_GT(power.statistic, test::chi_square_quantile(power.dof, 4.75)) << "no power against the drafter's own output";
}

TEST(Medusa, SampledOutputIsDistributedAsTheTarget) {
  EXPECT_TRUE(medusa_samples_fit(/*skip_sample_adjustment=*/false));
  // Power: a verification that samples a rejected position from p instead of the residual fails.
  EXPECT_FALSE(medusa_samples_fit(/*skip_sample_adjustment=*/true));
}

TEST(HeadsInBatches, MedusaForAllRowsSamplesAsTheTarget) {
  EXPECT_TRUE(medusa_samples_fit(/*skip_sample_adjustment=*/false, /*batched=*/true));
  EXPECT_FALSE(medusa_samples_fit(/*skip_sample_adjustment=*/true, /*batched=*/true));
}

// The Medusa heads trained for the bundled target (models/bundled/medusa, made by
// tools/train_medusa.cpp) load from the published layout and draft what the target accepts: on a
// prompt of held-out Python, greedy output equals the target's alone and at least 0.5 drafts per
// step are accepted (random heads accept about 0.01).
TEST(Medusa, TrainedHeadsForTheBundledTargetAreAccepted) {
  using Model = models::LlamaModel<StaticKVCache>;
  const std::string bundled = SPECDEC_BUNDLED_MODELS_DIR;
  const io::LlamaCheckpoint checkpoint = io::load_llama(bundled + "/target");
  Model target(checkpoint.config, checkpoint.weights);
  const models::MedusaHeads heads = io::load_medusa(bundled + "/medusa", target.hidden_size(), target.vocab_size());
  const std::string text = "import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n        return ";
  const std::vector<int64_t> prompt(text.begin(), text.end());
  MedusaDraftSource source(heads, target);
  const GenerationResult result =
      generate_with(source, target, prompt, {.max_new_tokens = 128, .gamma = heads.config().num_heads});
  EXPECT_EQ(result.tokens, autoregressive_generate(target, prompt, {.max_new_tokens = 128}).tokens);
  const double per_step = static_cast<double>(result.stats.accepted) / static_cast<double>(result.stats.steps);
  std::cout << "[ figures  ] bundled Medusa heads: " << per_step << " drafts accepted per step, "
            << static_cast<double>(result.tokens.size()) / static_cast<double>(result.stats.steps) << " tokens per step\n";
  EXPECT_GE(per_step, 0.5);
}


// A draft source that passes everything to `inner` and keeps the q of the last drafts it returned.
template <class S>
struct KeepsQ {
  S& inner;
  at::Tensor q{};
  template <LogitsProcessor P>
  Drafts draft(const DraftRequest& request, const P& processor, at::Generator& gen) {
    Drafts drafts = inner.draft(request, processor, gen);
    q = drafts.probs;
    return drafts;
  }
  void verified(const VerifiedDrafts& verified) { inner.verified(verified); }
  void start(std::span<const int64_t> sequence, const SpeculativeOptions& options) { inner.start(sequence, options); }
  [[nodiscard]] std::span<const int64_t> feature_taps() const { return inner.feature_taps(); }
  [[nodiscard]] int64_t vocab_size() const { return inner.vocab_size(); }
};

// The token after the first rejected draft of a generation whose first token is the target's own
// (first_target), drafted by an EAGLE-3 head from a fixed prompt: the context is then the prompt
// and the first token t, so p (the target's) and q (the head's, as it drew the draft) depend on t
// alone. Chi-square of the (t, token) cells against each t's residual max(0, p - q), and against
// p for power. `skip`: skip_sample_adjustment.
struct FirstRejection {
  test::ChiSquare residual, target;
  int64_t events = 0;
};
FirstRejection eagle_first_rejection(bool skip, int64_t events) {
  using Model = models::LlamaModel<StaticKVCache>;
  models::LlamaConfig config = test::small_llama_config();
  config.vocab_size = 8;
  const models::LlamaWeights weights = models::LlamaWeights::random(config, 12);
  Model target(config, weights), reference(config, weights);
  const models::EagleHead head = random_eagle(config, weights, models::EagleKind::eagle3, 6, 4);
  const std::vector<int64_t> prompt{3, 1, 5, 5, 4, 2};
  const MultinomialProcessor processor(1.0);
  std::map<std::pair<int64_t, int64_t>, int64_t> observed;
  std::map<int64_t, int64_t> firsts;
  std::map<int64_t, std::pair<at::Tensor, at::Tensor>> rows;  // t: (residual, p)
  FirstRejection result;
  for (uint64_t seed = 0; result.events < events && seed < static_cast<uint64_t>(40 * events); ++seed) {
    EagleDraftSource eagle(head, target);
    KeepsQ<EagleDraftSource> source{eagle};
    int64_t first = -1;
    SpeculativeOptions options{.max_new_tokens = 3, .seed = seed, .gamma = 3, .skip_sample_adjustment = skip};
    options.on_step = [&](const StepInfo& step) {
      if (step.step == 0) first = step.token;
      if (step.step == 1 && step.drafts.size() == 1 && step.accepted == 0) {
        if (!rows.contains(first)) {
          std::vector<int64_t> context = prompt;
          context.push_back(first);
          auto cache = reference.make_cache(1);
          const at::Tensor logits = reference.forward(at::tensor(context, at::kLong).view({1, -1}), cache)[0][-1];
          const at::Tensor p = processor(logits).to(at::kDouble);
          const at::Tensor rest = (p - source.q[0].to(at::kDouble)).clamp_min(0.0);
          rows[first] = {rest / rest.sum(), p};
        }
        ++observed[{first, step.token}];
        ++firsts[first];
        ++result.events;
      }
      return StepAction::proceed;
    };
    (void)generate_with(source, target, prompt, options, processor);
  }
  std::map<std::pair<int64_t, int64_t>, double> residual, target_p;
  for (const auto& [first, count] : firsts) {
    const double share = static_cast<double>(count) / static_cast<double>(result.events);
    for (int64_t t = 0; t < config.vocab_size; ++t) {
      residual[{first, t}] = share * rows[first].first[t].item<double>();
      target_p[{first, t}] = share * rows[first].second[t].item<double>();
    }
  }
  result.residual = test::chi_square(observed, residual, result.events);
  result.target = test::chi_square(observed, target_p, result.events);
  // The first tokens' shares are taken from the sample.
  result.residual.dof -= static_cast<int64_t>(firsts.size()) - 1;
  result.target.dof -= static_cast<int64_t>(firsts.size()) - 1;
  return result;
}

// The EAGLE-3 head's first rejection after the target's own first token: its next token follows
// the residual of that context, not p (skip_sample_adjustment's tokens follow p, not the
// residual). A 3-token generation whose outputs do not change with skip_sample_adjustment is
// therefore no sign of p being used: inverse-CDF sampling with the same uniform gives the same
// token from p and from a residual that differs from p only in small entries.
TEST(Eagle, TheFirstRejectionAfterTheTargetsFirstTokenFollowsTheResidual) {
  constexpr int64_t kEvents = 1500;
  constexpr double kZ = 4.75;
  const FirstRejection exact = eagle_first_rejection(false, kEvents);
  ASSERT_EQ(exact.events, kEvents);
  EXPECT_EQ(exact.residual.outside_support, 0) << "a token the residual cannot give";
  EXPECT_LT(exact.residual.statistic, test::chi_square_quantile(exact.residual.dof, kZ));
  EXPECT_GT(exact.target.statistic, test::chi_square_quantile(exact.target.dof, kZ)) << "no power against p";
  const FirstRejection skipped = eagle_first_rejection(true, kEvents);
  EXPECT_LT(skipped.target.statistic, test::chi_square_quantile(skipped.target.dof, kZ));
  EXPECT_GT(skipped.residual.statistic + 1e6 * static_cast<double>(skipped.residual.outside_support),
            test::chi_square_quantile(skipped.residual.dof, kZ));
  std::cout << "[ figures  ] EAGLE-3 head, first rejection after the target's first token (" << kEvents
            << " events): chi-square " << exact.residual.statistic << " under the residual, " << exact.target.statistic
            << " under p (dof " << exact.residual.dof << "); with skip_sample_adjustment " << skipped.target.statistic
            << " under p, " << skipped.residual.statistic << " under the residual and "
            << skipped.residual.outside_support << " tokens outside it\n";
}

// The head's cache must equal one forward of the head over the whole sequence, every position
// reading the target's hidden states computed from scratch.
template <class Model>
void expect_cache_recomputes(const models::EagleHead& head, Model& reference, std::span<const int64_t> sequence,
                             const models::EagleCache& cache) {
  ASSERT_EQ(cache.start(), 0);
  ASSERT_GT(cache.length(), 0);
  ASSERT_LE(cache.length(), static_cast<int64_t>(sequence.size()) - 1);
  const int64_t n = cache.length();
  auto fresh = reference.make_cache(1);
  const at::Tensor ids = at::tensor(std::vector<int64_t>(sequence.begin(), sequence.begin() + n), at::kLong).view({1, -1});
  const at::Tensor features = reference.forward_features(ids, fresh, head.config().feature_layers).features[0];
  models::EagleCache expected;
  const at::Tensor next = at::tensor(std::vector<int64_t>(sequence.begin() + 1, sequence.begin() + n + 1), at::kLong);
  (void)head.forward(next, head.fuse(features), expected);
  EXPECT_TRUE(at::allclose(cache.keys(), expected.keys(), 1e-4, 1e-5)) << (cache.keys() - expected.keys()).abs().max().item<float>();
  EXPECT_TRUE(at::allclose(cache.values(), expected.values(), 1e-4, 1e-5));
}

// EAGLE-3 and EAGLE-1 heads on the step core: greedy output equals autoregressive decoding with
// drafts accepted and rejected, one host copy per step; the head's cache after the generation
// (its draft positions pruned, the accepted ones recomputed from the target's hidden states)
// equals the head run over the whole sequence from scratch; a session's second turn keeps it.
TEST(Eagle, GreedyOutputEqualsAutoregressiveDecodingAndTheCacheRecomputes) {
  using Model = models::LlamaModel<StaticKVCache>;
  models::LlamaConfig config = test::small_llama_config();
  config.vocab_size = 8;
  const models::LlamaWeights weights = models::LlamaWeights::random(config, 12);
  Model target(config, weights);
  Model reference(config, weights);
  const std::vector<int64_t> prompt{3, 1, 5, 5, 4, 2};
  for (const auto kind : {models::EagleKind::eagle3, models::EagleKind::eagle1}) {
    SCOPED_TRACE(models::to_string(kind));
    models::EagleHead head = random_eagle(config, weights, kind, kind == models::EagleKind::eagle3 ? 6 : 8, 4);
    // The ATen forward and drafts made with tensor operations (other devices) give the same output.
    head.use_cpu_kernels(false);
    EagleDraftSource aten(head, target);
    const GenerationResult through_aten = generate_with(aten, target, prompt, {.max_new_tokens = 60, .gamma = 3});
    head.use_cpu_kernels(true);
    EagleDraftSource source(head, target);
    GenerationResult result;
    const int64_t copies =
        copies_during([&] { result = generate_with(source, target, prompt, {.max_new_tokens = 60, .gamma = 3}); });
    EXPECT_EQ(result.tokens, autoregressive_generate(reference, prompt, {.max_new_tokens = 60}).tokens);
    EXPECT_EQ(through_aten.tokens, result.tokens);
    EXPECT_EQ(through_aten.stats.accepted, result.stats.accepted);
    EXPECT_EQ(copies, result.stats.steps);
    EXPECT_GT(result.stats.accepted, 0);
    EXPECT_LT(result.stats.accepted, result.stats.drafted) << "the test should see rejected drafts too";
    std::cout << "[ figures  ] " << models::to_string(kind) << " head (random): " << result.stats.drafted << " drafted, "
              << result.stats.accepted << " accepted in " << result.stats.steps << " steps\n";
    std::vector<int64_t> sequence = prompt;
    sequence.insert(sequence.end(), result.tokens.begin(), result.tokens.end());
    EXPECT_EQ(source.cache().length(), static_cast<int64_t>(sequence.size()) - 1);
    expect_cache_recomputes(head, reference, sequence, source.cache());

    Session<Model> session(target);
    Session<Model> alone(reference);
    EagleDraftSource turns(head, target);
    NoDrafts none;
    for (const std::vector<int64_t>& turn : {prompt, std::vector<int64_t>{7, 0, 6}}) {
      session.append(turn);
      alone.append(turn);
      const GenerationResult got = session.generate(turns, {.max_new_tokens = 15, .gamma = 3});
      EXPECT_EQ(got.tokens, alone.generate(none, {.max_new_tokens = 15}).tokens);
    }
    expect_cache_recomputes(head, reference, session.tokens(), turns.cache());
    EXPECT_EQ(turns.cache().length(), static_cast<int64_t>(session.tokens().size()) - 1);
  }
}

// Whether three sampled tokens after a prompt, an EAGLE-3 head drafting over a draft vocabulary
// of 4 of the target's 6 ids, fit the target's exact distribution by chi-square at a tail of 1e-6:
// one prompt through generate_with, or (`batched`) each of two prompts generated as one batch
// with a head per row, or (`one_head`) with one head drafting for both rows (eagle_generate_batch).
bool eagle_samples_fit(bool skip_sample_adjustment, bool batched = false, bool one_head = false) {
  using Model = models::LlamaModel<StaticKVCache>;
  models::LlamaConfig config = test::small_llama_config();
  config.vocab_size = 6;
  const models::LlamaWeights weights = models::LlamaWeights::random(config, 8);
  Model target(config, weights);
  const models::EagleHead head = random_eagle(config, weights, models::EagleKind::eagle3, 4, 6);
  const MultinomialProcessor processor{2.0};
  std::vector<std::vector<int64_t>> prompts{{1, 4, 2}};
  if (batched) prompts.push_back({5, 0, 3, 3, 1});
  std::vector<std::map<std::vector<int64_t>, double>> expected;
  for (const auto& prompt : prompts) expected.push_back(exact_continuations(target, processor, prompt, 3));
  constexpr int64_t kSamples = 4000;
  std::vector<std::map<std::vector<int64_t>, int64_t>> observed(prompts.size());
  int64_t drafted = 0;
  std::vector<EagleDraftSource> sources;
  for (size_t r = 0; r < prompts.size(); ++r) sources.emplace_back(head, target);
  for (int64_t i = 0; i < kSamples; ++i) {
    const SpeculativeOptions options{.max_new_tokens = 3, .seed = static_cast<uint64_t>(i), .gamma = 2,
                                     .skip_sample_adjustment = skip_sample_adjustment};
    const std::vector<GenerationResult> results =
        one_head  ? eagle_generate_batch(head, target, prompts, options, processor)
        : batched ? generate_with_batch(std::span(sources), target, prompts, options, processor)
                  : std::vector<GenerationResult>{generate_with(sources[0], target, prompts[0], options, processor)};
    for (size_t r = 0; r < prompts.size(); ++r) {
      ++observed[r][results[r].tokens];
      drafted += results[r].stats.drafted;
    }
  }
  EXPECT_GT(drafted, kSamples / 2 * static_cast<int64_t>(prompts.size())) << "the head should draft in most generations";
  bool fit = true;
  for (size_t r = 0; r < prompts.size(); ++r) {
    const test::ChiSquare row = test::chi_square(observed[r], expected[r], kSamples);
    fit = fit && row.outside_support == 0 && row.statistic < test::chi_square_quantile(row.dof, 4.75);
  }
  return fit;
}

TEST(Eagle, SampledOutputIsDistributedAsTheTarget) {
  EXPECT_TRUE(eagle_samples_fit(/*skip_sample_adjustment=*/false));
  // Power: a verification that samples a rejected position from p instead of the residual fails.
  EXPECT_FALSE(eagle_samples_fit(/*skip_sample_adjustment=*/true));
}

// The CPU fp32 head's fused loops compute what its ATen forward computes: a prefill of 7
// positions, then three single positions, for EAGLE-3 (both residual orders) and EAGLE-1.
TEST(Eagle, CpuKernelsEqualTheAtenForward) {
  const models::LlamaConfig config = test::small_llama_config();
  const models::LlamaWeights weights = models::LlamaWeights::random(config, 21);
  for (const int variant : {0, 1, 2}) {
    SCOPED_TRACE(variant);
    models::EagleConfig c{.kind = variant == 2 ? models::EagleKind::eagle1 : models::EagleKind::eagle3,
                          .layer = config, .target_hidden_size = config.dim,
                          .draft_vocab_size = variant == 2 ? config.vocab_size : 30,
                          .feature_layers = variant == 2 ? std::vector<int64_t>{2} : std::vector<int64_t>{0, 1, 2},
                          .norm_before_residual = variant == 1};
    models::EagleHead head(c, models::EagleHead::random(c, weights.token_embedding, weights.output, 9));
    at::manual_seed(variant);
    const at::Tensor features = at::randn({7, c.fc_inputs() == 2 * config.dim ? config.dim : c.fc_inputs()});
    const at::Tensor ids = at::randint(0, config.vocab_size, {7}, at::kLong);
    std::vector<at::Tensor> outputs[2];
    models::EagleCache caches[2];
    for (const bool fused : {true, false}) {
      head.use_cpu_kernels(fused);
      ASSERT_EQ(head.uses_cpu_kernels(), fused);
      models::EagleCache& cache = caches[fused ? 0 : 1];
      at::Tensor out = head.forward(ids, head.fuse(features), cache);
      outputs[fused ? 0 : 1].push_back(head.logits(out));
      for (int64_t i = 0; i < 3; ++i) {
        out = head.forward(at::tensor({(5 * i + 3) % config.vocab_size}, at::kLong), out.narrow(0, out.size(0) - 1, 1), cache);
        outputs[fused ? 0 : 1].push_back(head.logits(out));
      }
    }
    for (size_t i = 0; i < outputs[0].size(); ++i) {
      EXPECT_TRUE(at::allclose(outputs[0][i], outputs[1][i], 1e-4, 1e-4))
          << i << ": " << (outputs[0][i] - outputs[1][i]).abs().max().item<float>();
    }
    EXPECT_TRUE(at::allclose(caches[0].keys(), caches[1].keys(), 1e-5, 1e-5));
    EXPECT_TRUE(at::allclose(caches[0].values(), caches[1].values(), 1e-5, 1e-5));
  }
}

// Runs `check(head, width)` for EAGLE-3 and EAGLE-1 heads (random, seeded by `seed`), through the
// ATen pass and through the CPU loops; width: what head.fuse() takes per position.
template <class Check>
void for_each_batched_head(const models::LlamaConfig& config, const models::LlamaWeights& weights, uint64_t seed,
                           Check&& check) {
  for (const auto& [kind, fused] : {std::pair{models::EagleKind::eagle3, false}, std::pair{models::EagleKind::eagle1, false},
                                     std::pair{models::EagleKind::eagle3, true}, std::pair{models::EagleKind::eagle1, true}}) {
    SCOPED_TRACE(std::string(models::to_string(kind)) + (fused ? " fused" : " aten"));
    models::EagleHead head = random_eagle(config, weights, kind, kind == models::EagleKind::eagle3 ? 30 : 48, seed);
    head.use_cpu_kernels(fused);
    check(head, head.config().kind == models::EagleKind::eagle3 ? head.config().fc_inputs() : config.dim);
  }
}

// A head's batched forward over a batch cache equals its forward row by row: rows of different
// lengths (one starting at a later position, one empty), ragged counts with padding, rows cut
// back between forwards, a row feeding nothing, and rows selected out, for EAGLE-3 and EAGLE-1,
// in one ATen pass and through the CPU loops row by row.
TEST(Eagle, BatchedForwardEqualsEachRowAlone) {
  const models::LlamaConfig config = test::small_llama_config();
  const models::LlamaWeights weights = models::LlamaWeights::random(config, 21);
  for_each_batched_head(config, weights, 5, [&](models::EagleHead& head, int64_t width) {
    std::vector<models::EagleCache> alone(3);
    models::EagleBatchCache batch(3);
    alone[1].reset(4);
    batch.reset(1, 4);
    at::manual_seed(3);
    // Rounds of (counts per row, cut-back position per row or -1).
    const std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> rounds{
        {{5, 2, 0}, {-1, -1, -1}}, {{1, 3, 2}, {-1, -1, -1}}, {{2, 1, 1}, {3, 5, -1}}, {{0, 2, 3}, {-1, -1, 0}}};
    for (size_t round = 0; round < rounds.size(); ++round) {
      SCOPED_TRACE(round);
      const auto& [counts, cuts] = rounds[round];
      for (int64_t r = 0; r < 3; ++r) {
        if (cuts[static_cast<size_t>(r)] < 0) continue;
        alone[static_cast<size_t>(r)].truncate(cuts[static_cast<size_t>(r)]);
        batch.truncate(r, cuts[static_cast<size_t>(r)]);
      }
      const int64_t t = *std::max_element(counts.begin(), counts.end());
      const at::Tensor ids = at::randint(0, config.vocab_size, {3, t}, at::kLong);
      const at::Tensor hidden = head.fuse(at::randn({3, t, width}));
      const at::Tensor outputs = head.forward_rows(ids, hidden, batch, counts);
      for (int64_t r = 0; r < 3; ++r) {
        const int64_t n = counts[static_cast<size_t>(r)];
        if (n > 0) {
          const at::Tensor expected = head.forward(ids[r].narrow(0, 0, n), hidden[r].narrow(0, 0, n), alone[static_cast<size_t>(r)]);
          EXPECT_TRUE(at::allclose(outputs[r].narrow(0, 0, n), expected, 1e-4, 1e-5)) << r;
        }
        ASSERT_EQ(batch.start(r), alone[static_cast<size_t>(r)].start());
        ASSERT_EQ(batch.length(r), alone[static_cast<size_t>(r)].length());
        if (batch.length(r) > 0) {
          EXPECT_TRUE(at::allclose(batch.keys(r), alone[static_cast<size_t>(r)].keys(), 1e-5, 1e-6)) << r;
          EXPECT_TRUE(at::allclose(batch.values(r), alone[static_cast<size_t>(r)].values(), 1e-5, 1e-6)) << r;
        }
      }
    }
    // Rows selected out keep the others' entries, in the new order.
    batch.select(std::vector<int64_t>{2, 0});
    ASSERT_EQ(batch.rows(), 2);
    EXPECT_EQ(batch.end(0), alone[2].end());
    EXPECT_TRUE(at::allclose(batch.keys(0), alone[2].keys(), 1e-5, 1e-6));
    EXPECT_TRUE(at::allclose(batch.keys(1), alone[0].keys(), 1e-5, 1e-6));
    test::expect_invalid([&] { batch.truncate(1, alone[0].end() + 1); }, {"position = ", "of row 1"});
    test::expect_invalid([&] { (void)head.forward_rows(at::zeros({3, 1}, at::kLong), at::zeros({3, 1, config.dim}), batch, std::vector<int64_t>{1, 1, 1}); },
                         {"ids must be [2, T]"});
    test::expect_invalid([&] { (void)head.forward_rows(at::zeros({2, 1}, at::kLong), at::zeros({2, 1, config.dim}), batch, std::vector<int64_t>{1, 2}); },
                         {"counts[1] = 2"});
  });
}

// Rows join a batched head cache into free rows of its buffers and leave by moving the rows
// after them up in place: the buffers are not reallocated, the entries every row keeps are its
// own, and a reused row's stale entries never reach a forward (each row's outputs equal its head
// fed alone, through the ATen pass and the CPU loops).
TEST(Eagle, BatchRowsJoinAndLeaveInPlace) {
  const models::LlamaConfig config = test::small_llama_config();
  const models::LlamaWeights weights = models::LlamaWeights::random(config, 23);
  for_each_batched_head(config, weights, 7, [&](models::EagleHead& head, int64_t width) {
    at::manual_seed(5);
    std::vector<models::EagleCache> alone(3);
    models::EagleBatchCache batch(3);
    // One forward of counts[r] new tokens per row, each row checked against its head alone.
    const auto round = [&](const std::vector<int64_t>& counts) {
      const auto b = static_cast<int64_t>(counts.size());
      const int64_t t = *std::max_element(counts.begin(), counts.end());
      const at::Tensor ids = at::randint(0, config.vocab_size, {b, t}, at::kLong);
      const at::Tensor hidden = head.fuse(at::randn({b, t, width}));
      const at::Tensor outputs = head.forward_rows(ids, hidden, batch, counts);
      for (int64_t r = 0; r < b; ++r) {
        const int64_t n = counts[static_cast<size_t>(r)];
        if (n == 0) continue;
        models::EagleCache& own = alone[static_cast<size_t>(r)];
        const at::Tensor expected = head.forward(ids[r].narrow(0, 0, n), hidden[r].narrow(0, 0, n), own);
        EXPECT_TRUE(at::allclose(outputs[r].narrow(0, 0, n), expected, 1e-4, 1e-5)) << "row " << r;
        ASSERT_EQ(batch.end(r), own.end()) << r;
        EXPECT_TRUE(at::allclose(batch.keys(r), own.keys(), 1e-5, 1e-6)) << r;
        EXPECT_TRUE(at::allclose(batch.values(r), own.values(), 1e-5, 1e-6)) << r;
      }
    };
    round({6, 3, 9});
    round({2, 4, 1});
    // A row fed on its own joins.
    models::EagleBatchCache single(1);
    alone.emplace_back();
    {
      const at::Tensor ids = at::randint(0, config.vocab_size, {1, 5}, at::kLong);
      const at::Tensor hidden = head.fuse(at::randn({1, 5, width}));
      static_cast<void>(head.forward_rows(ids, hidden, single, std::vector<int64_t>{5}));
      static_cast<void>(head.forward(ids[0], hidden[0], alone.back()));
    }
    batch.append_rows_from(single);
    ASSERT_EQ(batch.rows(), 4);
    EXPECT_TRUE(at::allclose(batch.keys(3), alone[3].keys(), 1e-5, 1e-6));
    round({1, 2, 1, 3});
    // Row 0 leaves: the rows after it move up within the same buffers.
    const void* buffer = batch.key_buffer().data_ptr();
    const int64_t capacity = batch.row_capacity();
    batch.select(std::vector<int64_t>{1, 2, 3});
    alone.erase(alone.begin());
    EXPECT_EQ(batch.key_buffer().data_ptr(), buffer);
    EXPECT_EQ(batch.row_capacity(), capacity);
    ASSERT_EQ(batch.rows(), 3);
    for (int64_t r = 0; r < 3; ++r) EXPECT_TRUE(at::allclose(batch.keys(r), alone[static_cast<size_t>(r)].keys(), 1e-5, 1e-6)) << r;
    // An empty row joins into the free row, whose stale entries (row 3's before the move) must
    // not reach its forward.
    batch.append_rows_from(models::EagleBatchCache(1));
    alone.emplace_back();
    EXPECT_EQ(batch.key_buffer().data_ptr(), buffer);
    EXPECT_EQ(batch.length(3), 0);
    round({2, 1, 3, 4});
    round({1, 1, 1, 2});
    // Another order gathers the rows.
    batch.select(std::vector<int64_t>{3, 1});
    alone = {std::move(alone[3]), std::move(alone[1])};
    round({2, 3});
    test::expect_invalid([&] { batch.select(std::vector<int64_t>{0, 2}); }, {"row = 2", "[0, 2)"});
  });
}

// A head that does not fit its target, or whose weights do not fit its config, is refused with
// the field and value named, before any generation.
TEST(Eagle, HeadsThatDoNotFitAreRefused) {
  using Model = models::LlamaModel<StaticKVCache>;
  const models::LlamaConfig config = test::small_llama_config();
  const models::LlamaWeights weights = models::LlamaWeights::random(config, 3);
  Model target(config, weights);
  models::EagleConfig c{.kind = models::EagleKind::eagle3, .layer = config, .target_hidden_size = config.dim,
                        .draft_vocab_size = 40, .feature_layers = {0, 1, 3}};
  const models::EagleHead deep(c, models::EagleHead::random(c, weights.token_embedding, weights.output, 1));
  test::expect_invalid([&] { EagleDraftSource s(deep, target); }, {"feature_layers[2] = 3", "2 layers"});
  c.feature_layers = {0, 1, 2};
  models::EagleWeights w = models::EagleHead::random(c, weights.token_embedding, weights.output, 1);
  w.d2t[5] = 100;
  test::expect_invalid([&] { (void)models::EagleHead(c, w); }, {"d2t[5]", "outside the target vocabulary"});
  w = models::EagleHead::random(c, weights.token_embedding, weights.output, 1);
  w.fc = w.fc.narrow(1, 0, 2 * config.dim);
  test::expect_invalid([&] { (void)models::EagleHead(c, w); }, {"fc must be a [32, 96]", "[32, 64]"});
  c.draft_vocab_size = 0;
  test::expect_invalid([&] { c.validate(); }, {"draft_vocab_size = 0"});
  c.draft_vocab_size = 40;
  c.layer.vocab_size = 64;
  models::LlamaWeights wide = models::LlamaWeights::random(c.layer, 1);
  const models::EagleHead other(c, models::EagleHead::random(c, wide.token_embedding, wide.output, 1));
  test::expect_invalid([&] { EagleDraftSource s(other, target); }, {"vocab_size = 64", "48"});
  test::expect_invalid([&] { (void)models::EagleConfig::eagle3_default_layers(2); }, {"2 layers"});
}


// Heads in batches: each row drafts with its own head source (EAGLE-3, EAGLE-1, Medusa), fed its
// row of one batched target forward's hidden states. Rows of different lengths, one of which
// stops at the target's limit and leaves the batch, each give exactly autoregressive decoding's
// tokens; each EAGLE head's cache equals the head run over its row from scratch. Without the row
// near the limit (whose last steps let every row draft only what it has room for), each row
// drafts and accepts exactly what it does alone.
TEST(HeadsInBatches, GreedyRowsEqualAutoregressiveDecodingAndEachRowAlone) {
  using Model = models::LlamaModel<StaticKVCache>;
  models::LlamaConfig config = test::small_llama_config();
  config.vocab_size = 8;
  const models::LlamaWeights weights = models::LlamaWeights::random(config, 12);
  Model target(config, weights);
  Model reference(config, weights);
  std::vector<int64_t> near_limit(static_cast<size_t>(config.max_seq_len - 20), 0);
  for (size_t i = 0; i < near_limit.size(); ++i) near_limit[i] = static_cast<int64_t>((i * 5 + 1) % 8);
  const std::vector<std::vector<int64_t>> prompts{{3, 1, 5, 5, 4, 2}, near_limit, {6, 2}, {1, 7, 7, 0, 3, 2, 4, 4, 5}};
  const SpeculativeOptions options{.max_new_tokens = 40, .gamma = 3};
  // The rows but the one near the limit, batched on their own.
  const std::vector<std::vector<int64_t>> short_rows{prompts[0], prompts[2], prompts[3]};
  // Checks a batch of all prompts (`results`), one of the short rows (`short_results`) and each
  // row alone.
  const auto check_rows = [&](const std::vector<GenerationResult>& results, const std::vector<GenerationResult>& short_results,
                              const std::vector<GenerationResult>& alone) {
    ASSERT_EQ(results.size(), prompts.size());
    ASSERT_EQ(short_results.size(), short_rows.size());
    int64_t drafted = 0, accepted = 0;
    for (size_t r = 0; r < prompts.size(); ++r) {
      SCOPED_TRACE(r);
      EXPECT_EQ(results[r].tokens, autoregressive_generate(reference, prompts[r], {.max_new_tokens = 40}).tokens);
      EXPECT_EQ(results[r].tokens, alone[r].tokens);
      drafted += results[r].stats.drafted;
      accepted += results[r].stats.accepted;
    }
    for (size_t i = 0; i < short_rows.size(); ++i) {
      SCOPED_TRACE(i);
      const GenerationResult& single = alone[i == 0 ? 0 : i + 1];
      EXPECT_EQ(short_results[i].tokens, single.tokens);
      EXPECT_EQ(short_results[i].stats.accepted, single.stats.accepted);
      EXPECT_EQ(short_results[i].stats.drafted, single.stats.drafted);
    }
    EXPECT_EQ(results[1].stop_reason, StopReason::sequence_limit);
    EXPECT_EQ(results[0].stop_reason, StopReason::max_new_tokens);
    EXPECT_GT(accepted, 0);
    EXPECT_LT(accepted, drafted) << "the test should see rejected drafts too";
  };
  for (const auto kind : {models::EagleKind::eagle3, models::EagleKind::eagle1}) {
    SCOPED_TRACE(models::to_string(kind));
    const models::EagleHead head = random_eagle(config, weights, kind, kind == models::EagleKind::eagle3 ? 6 : 8, 4);
    std::vector<EagleDraftSource> sources, singles;
    std::vector<GenerationResult> alone;
    for (size_t r = 0; r < prompts.size(); ++r) {
      sources.emplace_back(head, target);
      singles.emplace_back(head, reference);
      alone.push_back(generate_with(singles.back(), reference, prompts[r], options));
    }
    std::vector<GenerationResult> results;
    const int64_t copies =
        copies_during([&] { results = generate_with_batch(std::span(sources), target, prompts, options); });
    int64_t steps = 0;  // the batch's steps: those of its longest-running row
    for (const GenerationResult& result : results) steps = std::max(steps, result.stats.steps);
    EXPECT_EQ(copies, steps) << "one host copy per batch step";
    std::vector<EagleDraftSource> short_sources;
    for (size_t i = 0; i < short_rows.size(); ++i) short_sources.emplace_back(head, target);
    check_rows(results, generate_with_batch(std::span(short_sources), target, short_rows, options), alone);
    for (size_t r = 0; r < prompts.size(); ++r) {
      std::vector<int64_t> sequence = prompts[r];
      sequence.insert(sequence.end(), results[r].tokens.begin(), results[r].tokens.end());
      expect_cache_recomputes(head, reference, sequence, sources[r].cache());
    }
    // One head drafting for every row in batched forwards: the same rows, drafts and acceptance.
    SCOPED_TRACE("eagle_generate_batch");
    std::vector<GenerationResult> batched;
    const int64_t batched_copies = copies_during([&] { batched = eagle_generate_batch(head, target, prompts, options); });
    check_rows(batched, eagle_generate_batch(head, target, short_rows, options), alone);
    steps = 0;
    for (size_t r = 0; r < batched.size(); ++r) {
      steps = std::max(steps, batched[r].stats.steps);
      EXPECT_EQ(batched[r].stats.drafted, results[r].stats.drafted) << r;
      EXPECT_EQ(batched[r].stats.accepted, results[r].stats.accepted) << r;
    }
    EXPECT_EQ(batched_copies, steps) << "one host copy per batch step";
  }
  const models::MedusaConfig heads_config{.hidden_size = config.dim, .vocab_size = config.vocab_size, .num_heads = 3};
  const models::MedusaHeads heads(heads_config, models::MedusaHeads::random(heads_config, 3));
  std::vector<MedusaDraftSource> medusa, short_medusa;
  std::vector<GenerationResult> alone;
  for (size_t r = 0; r < prompts.size(); ++r) {
    medusa.emplace_back(heads, target);
    if (r < short_rows.size()) short_medusa.emplace_back(heads, target);
    MedusaDraftSource single(heads, reference);
    alone.push_back(generate_with(single, reference, prompts[r], options));
  }
  {
    SCOPED_TRACE("medusa");
    check_rows(generate_with_batch(std::span(medusa), target, prompts, options),
               generate_with_batch(std::span(short_medusa), target, short_rows, options), alone);
  }
  {
    SCOPED_TRACE("medusa_generate_batch");
    std::vector<GenerationResult> batched;
    const int64_t copies = copies_during([&] { batched = medusa_generate_batch(heads, target, prompts, options); });
    check_rows(batched, medusa_generate_batch(heads, target, short_rows, options), alone);
    int64_t steps = 0;
    for (const GenerationResult& result : batched) steps = std::max(steps, result.stats.steps);
    EXPECT_EQ(copies, steps) << "one host copy per batch step";
  }

  // Bad input names the parameter.
  std::vector<EagleDraftSource> two;
  const models::EagleHead head = random_eagle(config, weights, models::EagleKind::eagle3, 6, 4);
  two.emplace_back(head, target);
  test::expect_invalid([&] { (void)generate_with_batch(std::span(two), target, prompts, options); },
                       {"sources.size() must equal prompts.size() = 4", "got 1"});
  const models::EagleHead eagle1 = random_eagle(config, weights, models::EagleKind::eagle1, 8, 4);
  two.emplace_back(eagle1, target);
  test::expect_invalid(
      [&] { (void)generate_with_batch(std::span(two), target, std::span(prompts).first(2), options); },
      {"sources[1].feature_taps() must equal sources[0]'s"});
  SpeculativeOptions adaptive = options;
  adaptive.gamma_policy = GammaPolicy::egag;
  test::expect_invalid([&] { (void)generate_with_batch(std::span(two).first(1), target, std::span(prompts).first(1), adaptive); },
                       {"gamma_policy must be fixed"});
}

// A model draft source that counts its start and finish hooks and keeps what it was finished with.
template <class D>
class HookCounter {
 public:
  explicit HookCounter(D& drafter) : inner_(drafter) {}
  void start(std::span<const int64_t> sequence, const SpeculativeOptions& options) {
    ++starts;
    inner_.start(sequence, options);
  }
  void finish(std::span<const int64_t> sequence) {
    ++finishes;
    finished.assign(sequence.begin(), sequence.end());
    inner_.finish(sequence);
  }
  template <LogitsProcessor P>
  Drafts draft(const DraftRequest& request, const P& processor, at::Generator& gen) {
    return inner_.draft(request, processor, gen);
  }
  void verified(const VerifiedDrafts& outcome) { inner_.verified(outcome); }

  int starts = 0;
  int finishes = 0;
  std::vector<int64_t> finished;

 private:
  ModelDraftSource<D> inner_;
};

// In a batch every row's source is started once and finished once with its row's whole sequence,
// as generate_with does it: also a row that ends before the first step (a prompt at the target's
// limit) and every row of a batch asked for no tokens.
TEST(SourcesInBatches, EveryRowsStartAndFinishHooksRunOnce) {
  using Model = models::LlamaModel<StaticKVCache>;
  const models::LlamaConfig config = test::small_llama_config();
  const models::LlamaWeights weights = models::LlamaWeights::random(config, 5);
  Model target(config, weights);
  Model drafter(config, test::perturbed(weights, 0.02, 9));
  const std::vector<int64_t> at_limit(static_cast<size_t>(config.max_seq_len), 3);
  const std::vector<std::vector<int64_t>> prompts{{3, 17, 5}, at_limit, {6, 2, 9, 9}};
  for (const int64_t new_tokens : {12, 0}) {
    SCOPED_TRACE(new_tokens);
    std::vector<HookCounter<Model>> sources;
    sources.reserve(prompts.size());
    for (size_t r = 0; r < prompts.size(); ++r) sources.emplace_back(drafter);
    const std::vector<GenerationResult> results =
        generate_with_batch(std::span(sources), target, prompts, {.max_new_tokens = new_tokens, .gamma = 3});
    ASSERT_EQ(results.size(), prompts.size());
    for (size_t r = 0; r < prompts.size(); ++r) {
      SCOPED_TRACE(r);
      EXPECT_EQ(sources[r].starts, 1);
      EXPECT_EQ(sources[r].finishes, 1);
      std::vector<int64_t> sequence = prompts[r];
      sequence.insert(sequence.end(), results[r].tokens.begin(), results[r].tokens.end());
      EXPECT_EQ(sources[r].finished, sequence);
    }
    EXPECT_TRUE(results[1].tokens.empty());
    EXPECT_EQ(results[0].tokens.size(), static_cast<size_t>(new_tokens));
    if (new_tokens > 0) {
      EXPECT_EQ(results[1].stop_reason, StopReason::sequence_limit);
    }
  }
}

TEST(HeadsInBatches, SampledRowsAreDistributedAsTheTarget) {
  EXPECT_TRUE(eagle_samples_fit(/*skip_sample_adjustment=*/false, /*batched=*/true));
  // Power: a verification that samples a rejected position from p instead of the residual fails.
  EXPECT_FALSE(eagle_samples_fit(/*skip_sample_adjustment=*/true, /*batched=*/true));
}

TEST(HeadsInBatches, OneHeadForAllRowsSamplesAsTheTarget) {
  EXPECT_TRUE(eagle_samples_fit(/*skip_sample_adjustment=*/false, /*batched=*/true, /*one_head=*/true));
  EXPECT_FALSE(eagle_samples_fit(/*skip_sample_adjustment=*/true, /*batched=*/true, /*one_head=*/true));
}

// --- Draft trees from heads (drafting/eagle.hpp, drafting/medusa.hpp) ---------------------------------------------

// EAGLE-3 and EAGLE-1 heads growing dynamic trees: greedy output equals autoregressive decoding,
// one host copy per step, trees drafted and accepted into, and the head's cache after the
// generation (the trees' draft entries dropped, the accepted path recomputed from the target's
// hidden states) equals the head run over the whole sequence from scratch.
TEST(HeadTrees, EagleTreesGreedyEqualAutoregressiveAndTheCacheRecomputes) {
  using Model = models::LlamaModel<StaticKVCache>;
  models::LlamaConfig config = test::small_llama_config();
  config.vocab_size = 8;
  const models::LlamaWeights weights = models::LlamaWeights::random(config, 12);
  Model target(config, weights);
  Model reference(config, weights);
  const std::vector<int64_t> prompt{3, 1, 5, 5, 4, 2};
  const auto expected = autoregressive_generate(reference, prompt, {.max_new_tokens = 60}).tokens;
  for (const auto kind : {models::EagleKind::eagle3, models::EagleKind::eagle1}) {
    SCOPED_TRACE(models::to_string(kind));
    const models::EagleHead head = random_eagle(config, weights, kind, kind == models::EagleKind::eagle3 ? 6 : 8, 4);
    EagleDraftSource chain(head, target);
    const GenerationResult chained = generate_with(chain, target, prompt, {.max_new_tokens = 60, .gamma = 3});
    EagleTreeSource source(head, target, {.depth = 3, .top_k = 3, .total_tokens = 8});
    GenerationResult result;
    const int64_t copies = copies_during([&] { result = generate_with(source, target, prompt, {.max_new_tokens = 60}); });
    EXPECT_EQ(result.tokens, expected);
    EXPECT_EQ(copies, result.stats.steps);
    EXPECT_GT(result.stats.accepted, chained.stats.accepted) << "a tree of 8 accepts more than a chain of 3";
    std::cout << "[ figures  ] " << models::to_string(kind) << " head (random), tree of 8: " << result.stats.accepted
              << " accepted in " << result.stats.steps << " steps; chain of 3: " << chained.stats.accepted << " in "
              << chained.stats.steps << "\n";
    std::vector<int64_t> sequence = prompt;
    sequence.insert(sequence.end(), result.tokens.begin(), result.tokens.end());
    EXPECT_EQ(source.cache().length(), static_cast<int64_t>(sequence.size()) - 1);
    expect_cache_recomputes(head, reference, sequence, source.cache());
    // A session's second turn keeps the head's cache and stays exact.
    Session<Model> session(target);
    Session<Model> alone(reference);
    EagleTreeSource turns(head, target, {.depth = 3, .top_k = 2, .total_tokens = 5});
    NoDrafts none;
    for (const std::vector<int64_t>& turn : {prompt, std::vector<int64_t>{7, 0, 6}}) {
      session.append(turn);
      alone.append(turn);
      EXPECT_EQ(session.generate(turns, {.max_new_tokens = 15}).tokens, alone.generate(none, {.max_new_tokens = 15}).tokens);
    }
    expect_cache_recomputes(head, reference, session.tokens(), turns.cache());
  }
  // A tree of one child per node is the chain: the same drafts, step for step, which checks the
  // positions, hidden states and masks of deep nodes.
  for (const auto kind : {models::EagleKind::eagle3, models::EagleKind::eagle1}) {
    models::EagleHead head = random_eagle(config, weights, kind, kind == models::EagleKind::eagle3 ? 6 : 8, 4);
    head.use_cpu_kernels(false);
    std::vector<std::vector<int64_t>> chain_drafts, tree_drafts;
    // A tree step reports its accepted path and the first rejected child: a chain's drafts up to
    // its first rejected one.
    const auto record = [](std::vector<std::vector<int64_t>>& into) {
      return [&into](const StepInfo& step) {
        const auto shown = std::min<size_t>(step.drafts.size(), static_cast<size_t>(step.accepted + 1));
        into.emplace_back(step.drafts.begin(), step.drafts.begin() + static_cast<std::ptrdiff_t>(shown));
      };
    };
    EagleDraftSource chain(head, target);
    (void)generate_with(chain, target, prompt, {.max_new_tokens = 40, .on_step = record(chain_drafts), .gamma = 5});
    EagleTreeSource tree(head, target, {.depth = 5, .top_k = 1, .total_tokens = 5});
    (void)generate_with(tree, target, prompt, {.max_new_tokens = 40, .on_step = record(tree_drafts)});
    EXPECT_EQ(tree_drafts, chain_drafts) << models::to_string(kind);
  }
  const models::EagleHead head = random_eagle(config, weights, models::EagleKind::eagle3, 6, 4);
  test::expect_invalid([&] { EagleTreeSource source(head, target, {.top_k = 7}); }, {"top_k", "6", "7"});
  test::expect_invalid([&] { EagleTreeSource source(head, target, {.depth = 0}); }, {"depth", "0"});
  // A tree that cannot follow one token in the target's context is refused; one that can is cut
  // near the end instead.
  test::expect_invalid([&] { EagleTreeSource source(head, target, {.total_tokens = config.max_seq_len}); },
                       {"total_tokens", "128", "max_sequence_length"});
  EXPECT_NO_THROW(EagleTreeSource(head, target, {.total_tokens = config.max_seq_len - 1}));
}

// Medusa heads filling a static tree: greedy output equals autoregressive decoding, one host copy
// per step; the tree's nodes are the heads' ranked tokens; shapes deeper than the heads are refused.
TEST(HeadTrees, MedusaTreesGreedyEqualAutoregressive) {
  using Model = models::LlamaModel<StaticKVCache>;
  const models::LlamaConfig config = test::small_llama_config();
  const models::LlamaWeights weights = models::LlamaWeights::random(config, 5);
  Model target(config, weights);
  Model reference(config, weights);
  const models::MedusaConfig heads_config{.hidden_size = config.dim, .vocab_size = config.vocab_size, .num_heads = 3};
  const models::MedusaHeads heads(heads_config, models::MedusaHeads::random(heads_config, 3));
  const std::vector<int64_t> prompt{3, 17, 5, 5, 40, 2};
  MedusaDraftSource chain(heads, target);
  const GenerationResult chained = generate_with(chain, target, prompt, {.max_new_tokens = 60, .gamma = 3});
  MedusaTreeSource source(heads, target,
                                  TreeTemplate::from_paths({{0}, {1}, {2}, {3}, {0, 0}, {0, 1}, {1, 0}, {2, 0}, {0, 0, 0}}));
  GenerationResult result;
  const int64_t copies = copies_during([&] { result = generate_with(source, target, prompt, {.max_new_tokens = 60}); });
  EXPECT_EQ(result.tokens, autoregressive_generate(reference, prompt, {.max_new_tokens = 60}).tokens);
  EXPECT_EQ(copies, result.stats.steps);
  EXPECT_GT(result.stats.accepted, chained.stats.accepted) << "four first choices accept more than one";
  std::cout << "[ figures  ] medusa heads (random), tree of 9: " << result.stats.accepted << " accepted in "
            << result.stats.steps << " steps; chain of 3: " << chained.stats.accepted << " in " << chained.stats.steps << "\n";
  test::expect_invalid([&] { MedusaTreeSource deep(heads, target, TreeTemplate::chain(4)); },
                       {"4 deep", "3 Medusa heads"});
  test::expect_invalid([&] { MedusaTreeSource wide(heads, target, TreeTemplate::full(12, 2)); },
                       {"node count", "156", "max_sequence_length 128"});
}

}  // namespace

}  // namespace test_step
