// Parallel drafting (drafting/parallel.hpp, io/parallel_drafter.hpp): every draft of a step from
// one forward of a drafter fed mask tokens. Greedy output equals autoregressive decoding for
// every gamma, with either kind of mask token, at both models' context limits and across session
// turns and batches, with one device-to-host copy and one drafter forward a step; the drafter's
// cache keeps only verified positions (drafts with a cache equal those recomputed without one);
// sampled output is the target's (chi-square, and the same harness rejects a wrong q); bad
// options and checkpoints are refused naming the field. Static trees from the same forward (top-k
// per position) are exact too, and a chain-shaped tree is the chain.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "specdec/batch.hpp"
#include "specdec/drafting/parallel.hpp"
#include "specdec/generate.hpp"
#include "specdec/io/parallel_drafter.hpp"
#include "specdec/models/llama.hpp"
#include "specdec/session.hpp"
#include "support/exact_continuations.hpp"
#include "support/expect_invalid.hpp"
#include "support/host_copies.hpp"
#include "support/llama_fixtures.hpp"
#include "support/parallel_fixtures.hpp"
#include "support/statistics.hpp"

// One namespace a file: specdec_tests is compiled as a unity build (tests/CMakeLists.txt).
namespace test_parallel_drafting {

namespace {

using namespace specdec;
using Model = models::LlamaModel<StaticKVCache>;

using test::with_mask_row;

// A float64 target and a parallel drafter: the target's weights with noise, and either a mask row
// added (mask id = the target's vocabulary) or a mask id inside the shared vocabulary.
struct Pair {
  models::LlamaConfig config, drafter_config;
  models::LlamaWeights weights;
  Model target;
  Model drafter;
  ParallelDraftOptions options;

  Pair(int64_t vocab, bool added_row, uint64_t seed, int64_t drafter_context = 0)
      : config(config_of(vocab)),
        drafter_config(drafter_of(config, added_row, drafter_context)),
        weights(models::LlamaWeights::random(config, seed, at::kDouble)),
        target(config, weights),
        drafter(drafter_config, added_row ? with_mask_row(test::perturbed(weights, 0.14, 4), 9)
                                          : test::perturbed(weights, 0.14, 4)),
        options{.mask_token = added_row ? vocab : vocab - 1, .vocab_size = vocab} {}

  static models::LlamaConfig config_of(int64_t vocab) {
    models::LlamaConfig c = test::small_llama_config();
    c.vocab_size = vocab;
    return c;
  }
  static models::LlamaConfig drafter_of(models::LlamaConfig c, bool added_row, int64_t context) {
    if (added_row) ++c.vocab_size;
    if (context > 0) c.max_seq_len = context;
    return c;
  }
};

const std::vector<int64_t> kPrompt{1, 7, 3, 2, 5, 1, 7};

using test::copies_during;

TEST(ParallelDrafting, GreedyEqualsAutoregressiveForEveryGammaWithOneForwardAndOneCopyAStep) {
  for (const bool added_row : {true, false}) {
    Pair pair(8, added_row, 12);
    const auto reference = autoregressive_generate(pair.target, kPrompt, {.max_new_tokens = 40});
    for (int64_t gamma = 1; gamma <= 8; ++gamma) {
      SCOPED_TRACE(::testing::Message() << "added row " << added_row << ", gamma " << gamma);
      ParallelDraftSource<Model> source(pair.drafter, pair.options);
      int64_t accepted = 0;
      for (int run = 0; run < 2; ++run) {  // the second from the cache the first left
        GenerationResult result;
        const int64_t copies = copies_during([&] {
          result = generate_with(source, pair.target, kPrompt, {.max_new_tokens = 40, .gamma = gamma});
        });
        EXPECT_EQ(result.tokens, reference.tokens);
        EXPECT_EQ(copies, result.stats.steps);
        // The first step's token is the target's alone (first_target); every later step drafts.
        EXPECT_EQ(result.stats.drafter_calls, result.stats.steps - 1) << "one drafter forward a step";
        EXPECT_LE(result.stats.drafted, gamma * result.stats.drafter_calls);
        EXPECT_GT(result.stats.drafted, 0);
        for (const int64_t token : result.tokens) EXPECT_NE(token, pair.options.mask_token);
        accepted += result.stats.accepted;
      }
      if (gamma > 1) {
        EXPECT_GT(accepted, 0) << "drafts were accepted";
      }
    }
  }
}

// The drafter's cache holds the verified sequence only: each step's drafts with the cache equal
// those of a drafter that recomputes everything (no cache), step for step, on the ATen forward
// (float64) and the CPU loops (float32, whose greedy drafts are read on the host).
TEST(ParallelDrafting, TheCacheKeepsOnlyVerifiedPositions) {
  for (const auto dtype : {at::kDouble, at::kFloat}) {
    const models::LlamaConfig config = Pair::config_of(8);
    const models::LlamaWeights weights = models::LlamaWeights::random(config, 12, dtype);
    Model target(config, weights);
    Model drafter(Pair::drafter_of(config, true, 0), with_mask_row(test::perturbed(weights, 0.14, 4), 9));
    std::vector<std::vector<int64_t>> steps[2];
    for (const bool use_cache : {true, false}) {
      auto& into = steps[use_cache ? 0 : 1];
      ParallelDraftSource<Model> source(drafter, {.mask_token = 8, .vocab_size = 8});
      (void)generate_with(source, target, kPrompt,
                          {.max_new_tokens = 40,
                           .use_cache = use_cache,
                           .on_step = [&into](const StepInfo& step) {
                             std::vector<int64_t> seen(step.drafts.begin(), step.drafts.end());
                             seen.push_back(step.accepted);
                             into.push_back(std::move(seen));
                           },
                           .gamma = 4});
    }
    EXPECT_EQ(steps[0], steps[1]) << dtype;
    EXPECT_FALSE(steps[0].empty());
  }
}

// Sessions: turns continue from the caches, to the target's last position (an ordinary end).
TEST(ParallelDrafting, SessionTurnsRunToTheTargetsLimit) {
  Pair pair(8, true, 12);
  const int64_t limit = pair.config.max_seq_len;
  const auto reference = autoregressive_generate(pair.target, kPrompt, {.max_new_tokens = limit});
  ParallelDraftSource<Model> source(pair.drafter, pair.options);
  Session session(pair.target);
  session.append(kPrompt);
  const auto first = session.generate(source, {.max_new_tokens = 10, .gamma = 5});
  GenerationResult rest;
  const int64_t copies = copies_during([&] { rest = session.generate(source, {.max_new_tokens = limit, .gamma = 5}); });
  std::vector<int64_t> joined = first.tokens;
  joined.insert(joined.end(), rest.tokens.begin(), rest.tokens.end());
  EXPECT_EQ(joined, reference.tokens);
  EXPECT_EQ(rest.stop_reason, StopReason::sequence_limit);
  EXPECT_EQ(copies, rest.stats.steps);
}

// A drafter of 16 positions: its drafts shrink to what fits (the sequence and gamma - 1 masks),
// then the target goes on alone; a prompt longer than it never runs it.
TEST(ParallelDrafting, PastTheDrafterContextTheTargetGoesOnAlone) {
  Pair pair(8, true, 12, /*drafter_context=*/16);
  for (const int64_t length : {int64_t{20}, int64_t{6}}) {
    std::vector<int64_t> prompt(static_cast<size_t>(length));
    for (int64_t i = 0; i < length; ++i) prompt[static_cast<size_t>(i)] = (i * 3 + 1) % 8;
    const auto reference = autoregressive_generate(pair.target, prompt, {.max_new_tokens = 24});
    ParallelDraftSource<Model> source(pair.drafter, pair.options);
    const auto result = generate_with(source, pair.target, prompt, {.max_new_tokens = 24, .gamma = 6});
    EXPECT_EQ(result.tokens, reference.tokens) << length;
    if (length > 16) {
      EXPECT_EQ(result.stats.drafter_calls, 0);
    } else {
      EXPECT_GT(result.stats.drafted, 0);
      EXPECT_LT(result.stats.drafter_calls, result.stats.steps) << "the target went on alone";
    }
  }
}

// Batches of sources: one ParallelDraftSource per row.
TEST(ParallelDrafting, BatchRowsEqualTheirOwnAutoregressiveDecoding) {
  Pair pair(8, true, 12);
  const std::vector<std::vector<int64_t>> prompts{{1, 7, 3}, {2, 5, 1, 7, 4, 4}, {6}};
  std::vector<ParallelDraftSource<Model>> sources;
  for (size_t r = 0; r < prompts.size(); ++r) sources.emplace_back(pair.drafter, pair.options);
  const auto results = generate_with_batch(std::span(sources), pair.target, std::span(prompts),
                                           {.max_new_tokens = 30, .gamma = 4});
  ASSERT_EQ(results.size(), prompts.size());
  for (size_t r = 0; r < prompts.size(); ++r) {
    EXPECT_EQ(results[r].tokens, autoregressive_generate(pair.target, prompts[r], {.max_new_tokens = 30}).tokens) << r;
  }
}

// EGAG and the confidence stop cut the step's drafts from the rows of the one forward; the output
// stays the target's.
TEST(ParallelDrafting, DraftLengthPoliciesCutTheRowsOfOneForward) {
  Pair pair(8, true, 12);
  const auto reference = autoregressive_generate(pair.target, kPrompt, {.max_new_tokens = 40});
  for (const SpeculativeOptions& options :
       {SpeculativeOptions{.max_new_tokens = 40, .gamma = 6, .gamma_policy = GammaPolicy::egag, .gamma_min = 1},
        SpeculativeOptions{.max_new_tokens = 40, .gamma = 6, .p_min = 0.4},
        SpeculativeOptions{.max_new_tokens = 40, .gamma = 2, .gamma_policy = GammaPolicy::schedule, .gamma_max = 7}}) {
    ParallelDraftSource<Model> source(pair.drafter, pair.options);
    const auto result = generate_with(source, pair.target, kPrompt, options);
    EXPECT_EQ(result.tokens, reference.tokens);
    EXPECT_EQ(result.stats.drafter_calls, result.stats.steps - 1) << "one drafter forward a step after the first";
    EXPECT_LT(result.stats.drafted, 6 * result.stats.drafter_calls) << "some steps drafted fewer";
  }
}

// A source whose q is not the distribution its drafts were drawn from: sharpened (q^3,
// renormalised), as a drafter that forgot its temperature would report it.
class WrongQ : public ParallelDraftSource<Model> {
 public:
  using ParallelDraftSource<Model>::ParallelDraftSource;
  template <LogitsProcessor P>
  Drafts draft(const DraftRequest& request, const P& processor, at::Generator& gen) {
    Drafts drafts = ParallelDraftSource<Model>::draft(request, processor, gen);
    if (drafts.probs.defined()) {
      const at::Tensor sharp = drafts.probs.pow(3);
      drafts.probs = sharp / sharp.sum(-1, /*keepdim=*/true);
    }
    return drafts;
  }
};

// Three tokens after a prompt over 4000 seeds against the exact probability of every continuation
// (chi-square at a tail of 1e-6); the harness rejects the wrong q.
template <class Source>
test::ChiSquare sampled_fit(int64_t* drafted, int64_t* accepted) {
  Pair pair(6, true, 8);
  const MultinomialProcessor processor{2.0};
  Source source(pair.drafter, pair.options);
  const std::vector<int64_t> prompt{1, 4, 2};
  const auto expected = test::exact_continuations(pair.target, processor, prompt, 3);
  constexpr int64_t kSamples = 4000;
  std::map<std::vector<int64_t>, int64_t> observed;
  for (int64_t i = 0; i < kSamples; ++i) {
    const GenerationResult result = generate_with(
        source, pair.target, prompt, {.max_new_tokens = 3, .seed = static_cast<uint64_t>(i), .gamma = 3}, processor);
    ++observed[result.tokens];
    *drafted += result.stats.drafted;
    *accepted += result.stats.accepted;
  }
  return test::chi_square(observed, expected, kSamples);
}

TEST(ParallelDrafting, SampledOutputIsTheTargetsAndAWrongQFails) {
  int64_t drafted = 0, accepted = 0;
  const auto exact = sampled_fit<ParallelDraftSource<Model>>(&drafted, &accepted);
  EXPECT_EQ(exact.outside_support, 0);
  EXPECT_LT(exact.statistic, test::chi_square_quantile(exact.dof, 4.75));
  EXPECT_GT(accepted, 1000) << "drafts were accepted (" << drafted << " drafted)";
  int64_t ignored = 0;
  const auto wrong = sampled_fit<WrongQ>(&ignored, &ignored);
  EXPECT_GT(wrong.statistic, test::chi_square_quantile(wrong.dof, 4.75));
}

TEST(ParallelDrafting, BadOptionsAreRefusedNamingTheField) {
  Pair pair(8, true, 12);
  test::expect_invalid([&] { (void)ParallelDraftSource<Model>(pair.drafter, {.mask_token = 9, .vocab_size = 8}); },
                       {"mask_token must be in [0, 9)"});
  test::expect_invalid([&] { (void)ParallelDraftSource<Model>(pair.drafter, {.mask_token = -1, .vocab_size = 8}); },
                       {"mask_token"});
  test::expect_invalid([&] { (void)ParallelDraftSource<Model>(pair.drafter, {.mask_token = 3, .vocab_size = 8}); },
                       {"mask_token must be 8"});
  test::expect_invalid([&] { (void)ParallelDraftSource<Model>(pair.drafter, {.mask_token = 8, .vocab_size = 7}); },
                       {"vocab_size must be the drafter's vocabulary 9 or one less"});
  // A drafter for another target: generate_with checks the source's vocabulary against the target's.
  Pair other(12, true, 3);
  ParallelDraftSource<Model> source(pair.drafter, pair.options);
  EXPECT_THROW((void)generate_with(source, other.target, kPrompt, {.max_new_tokens = 4}), std::invalid_argument);
}

// A tree shaped as a chain drafts what the chain source drafts, step for step (both from the one
// forward); wider trees decode greedily as autoregressive decoding with one drafter forward and
// one host copy a step, for either kind of mask token. (Trees from parallel drafters also run the
// conformance suite of tests/test_tree_sources.cpp.)
TEST(ParallelTrees, AChainShapedTreeIsTheChainAndWiderTreesAreExact) {
  for (const bool added_row : {true, false}) {
    SCOPED_TRACE(::testing::Message() << "added row " << added_row);
    Pair pair(8, added_row, 12);
    const auto record = [](std::vector<std::vector<int64_t>>& into) {
      return [&into](const StepInfo& step) {  // the accepted drafts and the step's own token
        std::vector<int64_t> seen(step.drafts.begin(), step.drafts.begin() + step.accepted);
        seen.push_back(step.token);
        into.push_back(std::move(seen));
      };
    };
    std::vector<std::vector<int64_t>> chain_steps, tree_steps;
    ParallelDraftSource<Model> chain(pair.drafter, pair.options);
    ParallelTreeSource<Model> chain_tree(pair.drafter, pair.options, TreeTemplate::chain(4));
    const auto a = generate_with(chain, pair.target, kPrompt,
                                 {.max_new_tokens = 40, .on_step = record(chain_steps), .gamma = 4, .first_target = false});
    const auto b = generate_with(chain_tree, pair.target, kPrompt, {.max_new_tokens = 40, .on_step = record(tree_steps)});
    EXPECT_EQ(chain_steps, tree_steps);
    EXPECT_EQ(a.tokens, b.tokens);

    const auto reference = autoregressive_generate(pair.target, kPrompt, {.max_new_tokens = 40});
    for (const TreeTemplate& shape : {TreeTemplate::full(3, 2), TreeTemplate::from_paths({{0}, {1}, {0, 0}, {0, 1}, {1, 0}, {0, 0, 0}, {0, 0, 0, 0}})}) {
      ParallelTreeSource<Model> source(pair.drafter, pair.options, shape);
      GenerationResult result;
      const int64_t copies = copies_during([&] { result = generate_with(source, pair.target, kPrompt, {.max_new_tokens = 40}); });
      EXPECT_EQ(result.tokens, reference.tokens);
      EXPECT_EQ(copies, result.stats.steps);
      // One drafter forward a step; a last step with one token of room left drafts nothing.
      EXPECT_LE(result.stats.drafter_calls, result.stats.steps);
      EXPECT_GE(result.stats.drafter_calls, result.stats.steps - 1);
      EXPECT_GT(result.stats.accepted, 0);
      for (const int64_t token : result.tokens) EXPECT_NE(token, pair.options.mask_token);
    }
  }
}

TEST(ParallelTrees, AShapeWiderThanTheProposableIdsIsRefused) {
  Pair added(8, true, 12), inside(8, false, 12);
  test::expect_invalid([&] { (void)ParallelTreeSource<Model>(added.drafter, added.options, TreeTemplate::full(9, 1)); },
                       {"shape has a node with 9 children, more than the 8 ids a draft may be"});
  test::expect_invalid([&] { (void)ParallelTreeSource<Model>(inside.drafter, inside.options, TreeTemplate::full(8, 1)); },
                       {"shape has a node with 8 children, more than the 7 ids a draft may be"});
  test::expect_invalid([&] { (void)ParallelTreeSource<Model>(added.drafter, {.mask_token = 3, .vocab_size = 8}, TreeTemplate::chain(2)); },
                       {"mask_token must be 8"});
  (void)ParallelTreeSource<Model>(inside.drafter, inside.options, TreeTemplate::full(7, 1));
}

std::filesystem::path scratch_folder(const std::string& name) {
  const auto folder = std::filesystem::temp_directory_path() / ("specdec_parallel_" + name);
  std::filesystem::remove_all(folder);
  return folder;
}

// A saved drafter loads back with its mask token and the same logits; its configuration is
// checked field by field.
TEST(ParallelDrafterCheckpoint, SavesAndLoadsAndRefusesBadConfigurations) {
  Pair pair(8, true, 12);
  const auto folder = scratch_folder("roundtrip");
  const models::LlamaWeights weights = with_mask_row(test::perturbed(pair.weights, 0.14, 4), 9);
  io::save_parallel_drafter(folder, pair.drafter_config, weights, 8, at::kDouble);
  const io::ParallelDrafterCheckpoint loaded = io::load_parallel_drafter(folder, at::kDouble);
  EXPECT_EQ(loaded.mask_token, 8);
  EXPECT_EQ(loaded.config.vocab_size, 9);
  Model reloaded(loaded.config, loaded.weights);
  const at::Tensor ids = at::tensor(std::vector<int64_t>{1, 4, 8, 8, 8}, at::kLong).view({1, 5});
  auto a = pair.drafter.make_cache(1), b = reloaded.make_cache(1);
  EXPECT_TRUE(at::allclose(pair.drafter.forward(ids, a), reloaded.forward(ids, b), 0.0, 1e-12));

  const auto rewrite = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json config = nlohmann::json::parse(std::ifstream(folder / "config.json"));
    edit(config);
    std::ofstream(folder / "config.json") << config.dump();
  };
  const auto expect_format = [&](const std::string& fragment) {
    try {
      (void)io::load_parallel_drafter(folder, at::kDouble);
      ADD_FAILURE() << "loaded; expected an error with " << fragment;
    } catch (const io::FormatError& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  rewrite([](nlohmann::json& c) { c.erase("pard_token"); });
  expect_format("missing key 'pard_token'");
  rewrite([](nlohmann::json& c) { c["pard_token"] = 9; });
  expect_format("pard_token = 9 is outside [0, 8]");
  rewrite([](nlohmann::json& c) { c["pard_token"] = "8"; });
  expect_format("pard_token");
  rewrite([](nlohmann::json& c) {
    c["pard_token"] = 8;
    c["spd_type"] = "eagle";
  });
  expect_format("spd_type \"eagle\" is not a parallel drafter's");
  std::filesystem::remove_all(folder);
}

}  // namespace

}  // namespace test_parallel_drafting
