// STAND: the probabilistic n-gram memory, tree templates, tree attention, and stand_generate —
// greedy output equal to autoregressive decoding, and under sampling exactly the target's
// distribution (chi-square), with biased tree verifications detected by the same harness.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <filesystem>
#include <iostream>
#include <fstream>
#include <map>
#include <set>
#include <vector>

#include "specdec/drafting/dynamic_tree.hpp"
#include "specdec/drafting/model_tree.hpp"
#include "specdec/drafting/stand.hpp"
#include "specdec/generate.hpp"
#include "specdec/io/checkpoint.hpp"
#include "specdec/io/tokenizer.hpp"
#include "specdec/models/llama.hpp"
#include "specdec/session.hpp"
#include "support/expect_invalid.hpp"
#include "support/llama_fixtures.hpp"
#include "support/markov_fixtures.hpp"
#include "support/shared_files.hpp"
#include "support/statistics.hpp"
#include "support/toy_models.hpp"

// One namespace a file: specdec_tests is compiled as a unity build (tests/CMakeLists.txt).
namespace test_stand {

namespace {

using namespace specdec;
using test::expect_invalid;
constexpr double kZ = 4.75;  // normal quantile of a 1e-6 tail

void observe(ProbabilisticNGramStorage& memory, std::vector<int64_t> context, std::vector<int64_t> tokens,
             std::vector<float> probabilities) {
  memory.update(context, tokens, probabilities);
}

std::map<int64_t, double> as_map(const ProbabilisticNGramStorage::Entry& entry) {
  std::map<int64_t, double> m;
  for (uint32_t i = 0; i < entry.size; ++i) m[entry.tokens[i]] = entry.probabilities[i];
  return m;
}

TEST(ProbabilisticNGramStorage, MergesObservationsAsTheRunningMean) {
  // Seed 004's example: "I am" followed by (Bob .7, Mary .2, Tom .05), then (Bob .3, Mary .6, Sue .05).
  enum : int64_t { I = 1, am = 2, Bob = 10, Mary = 11, Tom = 12, Sue = 13 };
  ProbabilisticNGramStorage memory(100, 3);
  observe(memory, {I, am}, {Bob, Mary, Tom}, {.7F, .2F, .05F});
  observe(memory, {I, am}, {Bob, Mary, Sue}, {.3F, .6F, .05F});
  const auto* entry = memory.find_exact(std::vector<int64_t>{I, am});
  ASSERT_NE(entry, nullptr);
  EXPECT_EQ(entry->observations, 2u);
  const auto m = as_map(*entry);
  ASSERT_EQ(m.size(), 4u);
  EXPECT_NEAR(m.at(Bob), 0.5, 1e-6);
  EXPECT_NEAR(m.at(Mary), 0.4, 1e-6);
  EXPECT_NEAR(m.at(Tom), 0.025, 1e-6);
  EXPECT_NEAR(m.at(Sue), 0.025, 1e-6);
  EXPECT_EQ(entry->tokens[0], Bob);  // most probable first
  // A third observation weighs 1/3: Bob .5 * 2/3 + .9 / 3 = .6333.
  observe(memory, {I, am}, {Bob}, {.9F});
  EXPECT_NEAR(memory.find_exact(std::vector<int64_t>{I, am})->probability(Bob), 0.5 * 2 / 3 + 0.3, 1e-6);
  EXPECT_NEAR(memory.find_exact(std::vector<int64_t>{I, am})->probability(Mary), 0.4 * 2 / 3, 1e-6);
  // Every context length up to max_context is updated: "am" alone too.
  EXPECT_NE(memory.find_exact(std::vector<int64_t>{am}), nullptr);
  EXPECT_EQ(memory.size(), 2u);
}

TEST(ProbabilisticNGramStorage, KeepsTheTenMostProbableTokens) {
  ProbabilisticNGramStorage memory(100, 1);
  std::vector<int64_t> tokens;
  std::vector<float> probabilities;
  for (int64_t t = 0; t < 12; ++t) {
    tokens.push_back(t);
    probabilities.push_back(0.01F * static_cast<float>(t + 1));  // 0.01 .. 0.12
  }
  observe(memory, {50}, tokens, probabilities);
  const auto* entry = memory.find_exact(std::vector<int64_t>{50});
  ASSERT_EQ(entry->size, 10u);
  EXPECT_EQ(as_map(*entry).count(0), 0u);  // 0.01 and 0.02 are dropped
  EXPECT_EQ(as_map(*entry).count(1), 0u);
  EXPECT_NEAR(entry->probabilities[0], 0.12, 1e-6);
  // A new token of high probability pushes out the least probable after the merge.
  observe(memory, {50}, {99}, {0.9F});
  const auto m = as_map(*memory.find_exact(std::vector<int64_t>{50}));
  EXPECT_EQ(m.size(), 10u);
  EXPECT_NEAR(m.at(99), 0.45, 1e-6);
  EXPECT_EQ(m.count(2), 0u);  // 0.03 / 2 was the least
  EXPECT_NEAR(m.at(11), 0.06, 1e-6);
}

TEST(ProbabilisticNGramStorage, LooksUpTheLongestKnownContext) {
  ProbabilisticNGramStorage memory(50, 3);
  observe(memory, {1, 2, 3}, {7}, {1.0F});
  observe(memory, {9, 3}, {8}, {1.0F});
  // (1 2 3) is known: its own distribution, not the merged one of "3".
  EXPECT_EQ(memory.find(std::vector<int64_t>{5, 1, 2, 3})->tokens[0], 7);
  EXPECT_NEAR(memory.find(std::vector<int64_t>{1, 2, 3})->probability(8), 0.0, 1e-12);
  // (4 2 3) is not, (2 3) is: learned from the first observation.
  EXPECT_EQ(memory.find(std::vector<int64_t>{4, 2, 3})->tokens[0], 7);
  // Only "3" is known for (6 3): both observations merged.
  const auto* backed_off = memory.find(std::vector<int64_t>{6, 3});
  EXPECT_EQ(backed_off->observations, 2u);
  EXPECT_NEAR(backed_off->probability(7), 0.5, 1e-6);
  EXPECT_EQ(memory.find(std::vector<int64_t>{4}), nullptr);
}

TEST(ProbabilisticNGramStorage, SavesLoadsAndMerges) {
  const auto path = std::filesystem::temp_directory_path() / "specdec_probabilistic.storage";
  ProbabilisticNGramStorage memory(300, 2);
  observe(memory, {1, 2}, {3, 4}, {.6F, .3F});
  observe(memory, {5, 2}, {4, 6}, {.5F, .5F});
  EXPECT_GT(memory.memory_bytes(), 0u);
  memory.save(path);
  const auto loaded = ProbabilisticNGramStorage::load(path);
  EXPECT_EQ(loaded.size(), memory.size());
  EXPECT_EQ(loaded.max_context(), 2);
  EXPECT_EQ(as_map(*loaded.find_exact(std::vector<int64_t>{2})), as_map(*memory.find_exact(std::vector<int64_t>{2})));

  // Merging weighs by observations: "2" has 2 observations here, 1 in other.
  ProbabilisticNGramStorage other(300, 2);
  observe(other, {7, 2}, {3}, {1.0F});
  memory.merge(other);
  const auto* merged = memory.find_exact(std::vector<int64_t>{2});
  EXPECT_EQ(merged->observations, 3u);
  EXPECT_NEAR(merged->probability(3), (0.3 * 2 + 1.0) / 3, 1e-6);
  EXPECT_NE(memory.find_exact(std::vector<int64_t>{7, 2}), nullptr);

  // Corrupt files are refused with a message naming the file.
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  const auto write = [&](const std::string& content) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << content;
  };
  write(bytes.substr(0, bytes.size() - 3));
  EXPECT_THROW((void)ProbabilisticNGramStorage::load(path), io::FormatError);
  // Every flipped bit after the version fails the checksum.
  for (size_t i = 12; i < bytes.size() - 16; i += 7) {
    std::string flipped = bytes;
    flipped[i] = static_cast<char>(flipped[i] ^ (1 << (i % 8)));
    write(flipped);
    try {
      (void)ProbabilisticNGramStorage::load(path);
      FAIL() << "loaded a file with byte " << i << " changed";
    } catch (const io::FormatError& e) {
      EXPECT_NE(std::string(e.what()).find("checksum mismatch"), std::string::npos) << e.what();
    }
  }
  // A version 1 file (no checksum) with a probability out of range: the parser refuses it.
  std::string bad_probability = bytes.substr(0, bytes.size() - 16);
  bad_probability[8] = 1;
  write(bad_probability);
  EXPECT_NO_THROW((void)ProbabilisticNGramStorage::load(path));
  const float two = 2.0F;
  std::memcpy(bad_probability.data() + 32 + 16 + 8 + 4, &two, sizeof(two));  // first entry's first probability
  write(bad_probability);
  EXPECT_THROW((void)ProbabilisticNGramStorage::load(path), io::FormatError);
  write("SDNGRAM");
  EXPECT_THROW((void)ProbabilisticNGramStorage::load(path), io::FormatError);
  std::filesystem::remove(path);

  expect_invalid([&] { observe(memory, {1}, {300}, {0.5F}); }, {"tokens[0]", "300"});
  expect_invalid([&] { observe(memory, {1}, {3, 3}, {0.5F, 0.2F}); }, {"tokens[1]", "repeats"});
  expect_invalid([&] { observe(memory, {1}, {3}, {1.5F}); }, {"probabilities[0]", "1.5"});
  expect_invalid([&] { observe(memory, {}, {3}, {0.5F}); }, {"context", "empty"});
  expect_invalid([] { ProbabilisticNGramStorage(32000, 9); }, {"max_context", "[1, 8]", "9"});
  expect_invalid([&] { memory.merge(ProbabilisticNGramStorage(300, 3)); }, {"merge", "max_context"});
}

TEST(TreeAttention, DepthAndVisibilityFollowTheParents) {
  const std::vector<int64_t> parents{-1, 0, 0, 1, -1};
  const TreeAttention t = tree_attention(parents, 5);
  EXPECT_EQ(std::vector<int64_t>(t.depth.data_ptr<int64_t>(), t.depth.data_ptr<int64_t>() + 5),
            (std::vector<int64_t>{0, 1, 1, 2, 0}));
  const at::Tensor expected = at::tensor(std::vector<int64_t>{1, 0, 0, 0, 0,  //
                                                              1, 1, 0, 0, 0,  //
                                                              1, 0, 1, 0, 0,  //
                                                              1, 1, 0, 1, 0,  //
                                                              0, 0, 0, 0, 1})
                                  .view({5, 5})
                                  .to(at::kBool);
  EXPECT_TRUE(at::equal(t.visible, expected));
  expect_invalid([] { (void)tree_attention(std::vector<int64_t>{-1, 1}, 2); }, {"parents[1]", "1"});
  expect_invalid([] { (void)tree_attention(std::vector<int64_t>{-1}, 2); }, {"parents", "2"});
}

// Every node's ancestors come first, and the template is closed under ancestors by construction.
void expect_well_formed(const TreeTemplate& t) {
  for (int64_t i = 0; i < t.size(); ++i) {
    EXPECT_LT(t.parent(i), i);
    EXPECT_EQ(t.depth(i), t.parent(i) < 0 ? 1 : t.depth(t.parent(i)) + 1);
  }
}

TEST(TreeTemplate, ShapesAreBoundedAsAsked) {
  const TreeTemplate chain = TreeTemplate::chain(5);
  EXPECT_EQ(chain.size(), 5);
  EXPECT_EQ(chain.max_depth(), 5);
  const TreeTemplate full = TreeTemplate::full(5, 4);
  EXPECT_EQ(full.size(), 5 + 25 + 125 + 625);
  EXPECT_EQ(full.children(-1).size(), 5u);
  expect_well_formed(full);
  const TreeTemplate tree = TreeTemplate::default_tree();
  EXPECT_EQ(tree.size(), 64);
  EXPECT_LE(tree.max_depth(), 12);
  expect_well_formed(tree);
  // Deep along the most likely path: the rank-0 chain is the deepest branch.
  int64_t node = tree.children(-1)[0], depth = 1;
  while (!tree.children(node).empty()) node = tree.children(node)[0], ++depth;
  EXPECT_EQ(depth, tree.max_depth());
  EXPECT_GT(tree.children(-1).size(), 2u);  // and wide at the top
  const TreeTemplate shallow = TreeTemplate::default_tree(16, 3);
  EXPECT_EQ(shallow.size(), 16);
  EXPECT_EQ(shallow.max_depth(), 3);
  expect_well_formed(shallow);
  // best_first with one rank is a chain.
  const std::vector<double> one{0.5};
  EXPECT_EQ(TreeTemplate::best_first(6, one).max_depth(), 6);
  expect_invalid([] { (void)TreeTemplate(std::vector<int64_t>{0}); }, {"parents[0]", "0"});
  expect_invalid([] { (void)TreeTemplate::chain(0); }, {"depth", "0"});
  const std::vector<double> bad{0.5, 1.5};
  expect_invalid([&] { (void)TreeTemplate::best_first(4, bad); }, {"rank_acceptance[1]", "1.5"});
}

TEST(TreeTemplate, LearnedTemplateKeepsTheMostAcceptedNodesClosedUnderAncestors) {
  const TreeTemplate full = TreeTemplate::full(3, 3);  // 39 nodes
  std::vector<int64_t> counts(static_cast<size_t>(full.size()), 0);
  // Node 0's subtree is accepted often; a deep node under node 2 is accepted more than its parent
  // would suggest, which must not bring it in without its ancestors.
  const int64_t deep = full.children(full.children(2)[1])[0];
  counts[0] = 100;
  counts[static_cast<size_t>(full.children(0)[0])] = 80;
  counts[static_cast<size_t>(full.children(0)[1])] = 30;
  counts[static_cast<size_t>(deep)] = 90;
  counts[2] = 5;
  counts[static_cast<size_t>(full.children(2)[1])] = 1;
  for (const int64_t k : {1, 3, 5, 8}) {
    const TreeTemplate learned = full.learned(counts, k);
    EXPECT_EQ(learned.size(), k);
    expect_well_formed(learned);
  }
  // With 3 nodes: 0, its rank-0 child and rank-1 child (100, 80, 30) — not the deep one.
  const TreeTemplate three = full.learned(counts, 3);
  EXPECT_EQ(std::vector<int64_t>(three.parents().begin(), three.parents().end()), (std::vector<int64_t>{-1, 0, 0}));
  // With 6: node 2 (5), then its child (1), then the deep node (90) only after both.
  const TreeTemplate six = full.learned(counts, 6);
  EXPECT_EQ(six.max_depth(), 3);
  expect_invalid([&] { (void)full.learned(counts, 40); }, {"nodes", "40"});
  expect_invalid([&] { (void)full.learned(std::vector<int64_t>(3, 0), 2); }, {"accepted_counts", "3"});
}

// --- Exactness --------------------------------------------------------------------------------

using test::rows_of;
const at::Tensor& target_rows() { return test::markov_target_rows(); }
// The memory's distributions: the drafter's, different from the target's, so rejections and
// residuals matter.
const at::Tensor& memory_rows() { return test::markov_drafter_rows(); }

ProbabilisticNGramStorage markov_memory() {
  ProbabilisticNGramStorage memory(4, 1);
  for (int64_t t = 0; t < 4; ++t) {
    std::vector<float> probabilities;
    for (int64_t v = 0; v < 4; ++v) probabilities.push_back(static_cast<float>(memory_rows()[t][v].item<double>()));
    observe(memory, {t}, {0, 1, 2, 3}, probabilities);
  }
  return memory;
}

// Three children at the root, two below each, one below those.
TreeTemplate small_tree() { return TreeTemplate({-1, -1, -1, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6, 7, 8}); }

// The fit of three tokens generated after prompt {0} to the Markov target's distribution under
// `processor`: `generate(seed)` runs one generation. Adds the accepted drafts to *accepted.
template <class P, class Generate>
test::ChiSquare markov_fit(const P& processor, int64_t samples, uint64_t first_seed, Generate generate,
                           int64_t* accepted = nullptr) {
  std::map<std::vector<int64_t>, int64_t> observed;
  for (int64_t i = 0; i < samples; ++i) {
    const GenerationResult result = generate(first_seed + static_cast<uint64_t>(i));
    ++observed[result.tokens];
    if (accepted != nullptr) *accepted += result.stats.accepted;
  }
  const at::Tensor step = processor(test::MarkovModel(target_rows()).logits()).to(at::kDouble);
  std::map<std::vector<int64_t>, double> expected;
  for (int64_t a = 0; a < 4; ++a) {
    for (int64_t b = 0; b < 4; ++b) {
      for (int64_t c = 0; c < 4; ++c) {
        expected[{a, b, c}] = (step[0][a] * step[a][b] * step[b][c]).template item<double>();
      }
    }
  }
  return test::chi_square(observed, expected, samples);
}

template <class P>
test::ChiSquare stand_fit(const P& processor, bool stochastic, specdec::detail::TreeVerification variant, int64_t samples,
                          int64_t* accepted = nullptr) {
  test::MarkovModel target(target_rows());
  ProbabilisticNGramStorage memory = markov_memory();
  StandOptions options{.max_new_tokens = 3, .tree = small_tree(), .stochastic = stochastic, .learn = false};
  return markov_fit(processor, samples, 5000, [&](uint64_t seed) {
    options.seed = seed;
    return specdec::detail::stand_generate_impl(memory, target, std::vector<int64_t>{0}, options, processor, variant);
  }, accepted);
}

template <class P>
void expect_exact(const P& processor, bool stochastic) {
  constexpr int64_t kSamples = 8000;
  int64_t accepted = 0;
  const auto fit = stand_fit(processor, stochastic, specdec::detail::TreeVerification::exact, kSamples, &accepted);
  EXPECT_EQ(fit.outside_support, 0) << processor;
  EXPECT_GE(fit.min_expected, 5.0);
  EXPECT_LT(fit.statistic, test::chi_square_quantile(fit.dof, kZ)) << processor << " stochastic " << stochastic;
  EXPECT_GT(accepted, kSamples / 2);  // trees were accepted into, not just sampled past
}

TEST(StandDistribution, GumbelTreesEqualTheTargetUnderMultinomialAndTopK) {
  expect_exact(MultinomialProcessor{}, true);
  expect_exact(TopKProcessor{3}, true);
}

TEST(StandDistribution, DeterministicTreesEqualTheTarget) { expect_exact(MultinomialProcessor{}, false); }

TEST(StandDistribution, TheHarnessDetectsSiblingsVerifiedWithReplacementOrWithoutResidual) {
  constexpr int64_t kSamples = 8000;
  for (const auto variant : {specdec::detail::TreeVerification::with_replacement, specdec::detail::TreeVerification::skip_residual}) {
    const auto fit = stand_fit(MultinomialProcessor{}, true, variant, kSamples);
    EXPECT_GT(fit.statistic, test::chi_square_quantile(fit.dof, kZ)) << static_cast<int>(variant);
  }
}

// --- Greedy equality and generation -------------------------------------------------------------

const std::vector<int64_t> kPrompt{1, 7, 3, 22, 5};

template <class Cache>
void expect_greedy_equal(bool use_cache, bool stochastic) {
  const models::LlamaConfig config = test::small_llama_config();
  const models::LlamaWeights weights = models::LlamaWeights::random(config, 21, at::kDouble);
  models::LlamaModel<Cache> target(config, weights);
  models::LlamaModel<Cache> other(config, test::perturbed(weights, 0.3, 4));
  const auto reference = autoregressive_generate(target, kPrompt, {.max_new_tokens = 40});
  // A memory of a different model's greedy choices: some drafts right, some wrong.
  ProbabilisticNGramStorage memory(config.vocab_size, 3);
  (void)stand_generate(memory, other, kPrompt, {.max_new_tokens = 40});
  const StandOptions options{.max_new_tokens = 40, .use_cache = use_cache, .stochastic = stochastic};
  const auto first = stand_generate(memory, target, kPrompt, options);
  EXPECT_EQ(first.tokens, reference.tokens);
  EXPECT_GT(first.stats.accepted, 0);
  // The second trajectory drafts from what the first one taught the memory.
  const auto second = stand_generate(memory, target, kPrompt, options);
  EXPECT_EQ(second.tokens, reference.tokens);
  EXPECT_GT(second.stats.tokens_per_target_call(), first.stats.tokens_per_target_call());
}

TEST(StandGenerate, GreedyEqualsAutoregressiveWithBothCachesWithAndWithoutCaching) {
  for (const bool stochastic : {true, false}) {
    expect_greedy_equal<DynamicKVCache>(true, stochastic);
    expect_greedy_equal<StaticKVCache>(true, stochastic);
    expect_greedy_equal<StaticKVCache>(false, stochastic);
  }
}

TEST(StandGenerate, CountsAcceptedTemplateNodesAndRespectsMaxDepth) {
  const models::LlamaConfig config = test::small_llama_config();
  models::LlamaModel<StaticKVCache> target(config, models::LlamaWeights::random(config, 21, at::kDouble));
  ProbabilisticNGramStorage memory(config.vocab_size, 3);
  std::vector<int64_t> counts;
  int64_t longest = 0;
  StandOptions options{.max_new_tokens = 40, .on_step = [&](const StepInfo& step) {
                         longest = std::max(longest, step.accepted);
                         EXPECT_LE(step.gamma, 64);
                       }, .max_depth = 3, .node_acceptances = &counts};
  const auto runs = stand_generate_trajectories(memory, target, kPrompt, 3, options);
  ASSERT_EQ(runs.size(), 3u);
  EXPECT_EQ(runs[1].tokens, runs[0].tokens);
  EXPECT_EQ(longest, 3);
  ASSERT_EQ(static_cast<int64_t>(counts.size()), options.tree.size());
  int64_t total = 0;
  for (const int64_t c : counts) total += c;
  EXPECT_EQ(total, runs[0].stats.accepted + runs[1].stats.accepted + runs[2].stats.accepted);
  // Only nodes within depth 3 were ever accepted; a learned template keeps them.
  for (int64_t i = 0; i < options.tree.size(); ++i) {
    if (options.tree.depth(i) > 3) {
      EXPECT_EQ(counts[static_cast<size_t>(i)], 0);
    }
  }
  const auto positive = std::count_if(counts.begin(), counts.end(), [](int64_t c) { return c > 0; });
  ASSERT_GE(positive, 3);
  const TreeTemplate learned = options.tree.learned(counts, positive);
  EXPECT_EQ(learned.size(), positive);
  EXPECT_EQ(learned.max_depth(), 3);
}

TEST(StandGenerate, EndTokenInsideAnAcceptedPathEndsGeneration) {
  // Greedy runs 0 -> 1 -> 2 -> 3 -> 0 -> ...; once the memory knows it, one tree holds the cycle.
  test::MarkovModel target(rows_of({{.1, .6, .2, .1}, {.1, .1, .6, .2}, {.2, .1, .1, .6}, {.6, .2, .1, .1}}));
  ProbabilisticNGramStorage memory(4, 2);
  const std::vector<int64_t> prompt{0};
  const auto taught = stand_generate(memory, target, prompt, {.max_new_tokens = 12});
  EXPECT_EQ(taught.tokens, (std::vector<int64_t>{1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0}));
  const auto result = stand_generate(memory, target, prompt, {.max_new_tokens = 12, .eos_token_ids = {0}});
  EXPECT_EQ(result.tokens, (std::vector<int64_t>{1, 2, 3, 0}));
  EXPECT_EQ(result.stats.target_calls, 1);
}

TEST(StandGenerate, RejectsBadInputNamingIt) {
  test::MarkovModel target(target_rows());
  ProbabilisticNGramStorage memory(4, 2);
  ProbabilisticNGramStorage wrong(5, 2);
  const std::vector<int64_t> prompt{0};
  expect_invalid([&] { (void)stand_generate(wrong, target, prompt); }, {"memory.vocab_size()", "4", "5"});
  expect_invalid([&] { (void)stand_generate(memory, target, prompt, {.max_depth = -1}); }, {"max_depth", "-1"});
  std::vector<int64_t> counts(3, 0);
  expect_invalid([&] { (void)stand_generate(memory, target, prompt, {.node_acceptances = &counts}); },
                 {"node_acceptances", "3"});
  expect_invalid([&] { (void)stand_generate_trajectories(memory, target, prompt, 0); }, {"trajectories", "0"});
  expect_invalid([&] { (void)stand_generate(memory, target, std::vector<int64_t>{9}); }, {"prompt[0]", "9"});
}

TEST(StandGenerate, StoriesGreedyEqualsAutoregressiveAndDraftsFromSharedMemory) {
  SPECDEC_REQUIRE_MODEL(path, "stories260K/stories260K.bin");
  SPECDEC_REQUIRE_MODEL(tokenizer_path, "stories260K/tok512.bin");
  const auto checkpoint = io::load_llama(path);
  models::LlamaModel<StaticKVCache> target(checkpoint.config, checkpoint.weights);
  const auto prompt = io::Llama2cTokenizer::load(tokenizer_path, 512).encode("Once upon a time");
  const auto reference = autoregressive_generate(target, prompt, {.max_new_tokens = 100});
  ProbabilisticNGramStorage memory(target.vocab_size(), 3);
  const auto runs = stand_generate_trajectories(memory, target, prompt, 2, {.max_new_tokens = 100});
  EXPECT_EQ(runs[0].tokens, reference.tokens);
  EXPECT_EQ(runs[1].tokens, reference.tokens);
  std::cout << "stories260K STAND greedy: " << runs[0].stats.tokens_per_target_call() << " then "
            << runs[1].stats.tokens_per_target_call() << " tokens per target call\n";
  EXPECT_GT(runs[1].stats.tokens_per_target_call(), 3.0);
}

// --- Static trees from a drafter model (drafting/model_tree.hpp) -----------------------------------------

TEST(TreeTemplate, FromPathsNumbersBreadthFirstAndRejectsBadPaths) {
  const TreeTemplate tree = TreeTemplate::from_paths({{0, 0}, {1}, {0}, {0, 1}, {0, 0, 0}, {1, 0}});
  // Breadth-first: {0}, {1}, {0,0}, {0,1}, {1,0}, {0,0,0}.
  EXPECT_EQ(std::vector<int64_t>(tree.parents().begin(), tree.parents().end()),
            (std::vector<int64_t>{-1, -1, 0, 0, 1, 2}));
  EXPECT_EQ(tree.rank(3), 1);
  EXPECT_EQ(tree.max_depth(), 3);
  expect_invalid([] { (void)TreeTemplate::from_paths({}); }, {"paths", "empty"});
  expect_invalid([] { (void)TreeTemplate::from_paths({{0}, {}}); }, {"paths[1]", "empty"});
  expect_invalid([] { (void)TreeTemplate::from_paths({{0}, {0, -2}}); }, {"paths[1]", "-2"});
  expect_invalid([] { (void)TreeTemplate::from_paths({{0}, {0}}); }, {"paths[1]", "twice"});
  expect_invalid([] { (void)TreeTemplate::from_paths({{0}, {1, 0}}); }, {"paths[1]", "prefix"});
  expect_invalid([] { (void)TreeTemplate::from_paths({{0}, {2}}); }, {"paths[1]", "rank 2", "rank 1"});
}

// The tree sources' shared properties (greedy equality, one copy a step, sessions to the context
// limit, prompts past the drafter's context, the sampled distribution) are one typed suite,
// tests/test_tree_sources.cpp. Here: dynamic caches, and what trees buy over chains.
template <class Cache>
void expect_trees_exact_and_accepted() {
  const models::LlamaConfig config = test::small_llama_config();
  const models::LlamaWeights weights = models::LlamaWeights::random(config, 21, at::kDouble);
  models::LlamaModel<Cache> target(config, weights);
  // A drafter right often enough, and wrong often enough that second choices are accepted.
  models::LlamaModel<Cache> drafter(config, test::perturbed(weights, 0.14, 4));
  const auto reference = autoregressive_generate(target, kPrompt, {.max_new_tokens = 40});
  const TreeTemplate shape = TreeTemplate::from_paths({{0}, {1}, {0, 0}, {0, 1}, {1, 0}, {0, 0, 0}, {0, 0, 0, 0}});
  for (const TreeChildren children : {TreeChildren::top_k, TreeChildren::sampled}) {
    ModelTreeSource source(drafter, shape, children);
    const auto result = generate_with(source, target, kPrompt, {.max_new_tokens = 40});
    EXPECT_EQ(result.tokens, reference.tokens);
    // Its chain of the same depth makes 1.43 tokens per target call.
    EXPECT_GT(result.stats.tokens_per_target_call(), 1.9);
  }
  DynamicTreeSource dynamic(drafter);
  const auto result = generate_with(dynamic, target, kPrompt, {.max_new_tokens = 40});
  EXPECT_EQ(result.tokens, reference.tokens);
  // The chain of depth 4 makes 1.43 tokens per target call, the static tree of 7 nodes 2.1.
  EXPECT_GT(result.stats.tokens_per_target_call(), 2.5);
  std::cout << "dynamic tree: " << result.stats.tokens_per_target_call() << " tokens per target call\n";
}

TEST(ModelTreeGenerate, BothCachesStayExactAndTreesAcceptMoreThanChains) {
  expect_trees_exact_and_accepted<DynamicKVCache>();
  expect_trees_exact_and_accepted<StaticKVCache>();
}

TEST(ModelTreeGenerate, RejectsBadInputNamingIt) {
  test::MarkovModel target(target_rows());
  test::MarkovModel drafter(memory_rows());
  expect_invalid([&] { ModelTreeSource source(drafter, TreeTemplate::full(5, 1)); }, {"shape", "5 children", "4"});
  test::MarkovModel wide(test::rows_of({{.5, .5, 0, 0, 0}, {.5, .5, 0, 0, 0}, {.5, .5, 0, 0, 0}, {.5, .5, 0, 0, 0},
                                        {.5, .5, 0, 0, 0}}));
  ModelTreeSource other(wide, TreeTemplate::chain(2));
  expect_invalid([&] { (void)generate_with(other, target, std::vector<int64_t>{0}); }, {"vocab_size", "4", "5"});
  const models::LlamaConfig config = test::small_llama_config();
  models::LlamaModel<DynamicKVCache> small(config, models::LlamaWeights::random(config, 21, at::kDouble));
  expect_invalid([&] { ModelTreeSource source(small, TreeTemplate::full(2, 7)); }, {"shape", "254", "max_sequence_length"});
}

// --- Dynamic trees from a drafter model (drafting/dynamic_tree.hpp) ---------------------------------------

// Scores at another temperature shape other trees (ScoreTemperatureShapesTheTree below) from the
// same top-k children: still the target's distribution.
TEST(DynamicTreeDistribution, AnotherScoreTemperatureStaysExact) {
  constexpr int64_t kSamples = 6000;
  test::MarkovModel target(target_rows());
  test::MarkovModel drafter(memory_rows());
  DynamicTreeSource source(drafter, {.depth = 3, .top_k = 2, .total_tokens = 6, .score_temperature = 0.25});
  int64_t accepted = 0;
  const MultinomialProcessor processor;
  const auto fit = markov_fit(processor, kSamples, 7000, [&](uint64_t seed) {
    return generate_with(source, target, std::vector<int64_t>{0}, {.max_new_tokens = 3, .seed = seed}, processor);
  }, &accepted);
  EXPECT_EQ(fit.outside_support, 0);
  EXPECT_LT(fit.statistic, test::chi_square_quantile(fit.dof, kZ));
  EXPECT_GT(accepted, kSamples / 2);
}

// score_temperature moves the tree's nodes between depth and breadth, and greedy output stays
// autoregressive decoding's at every value.
TEST(DynamicTreeGenerate, ScoreTemperatureShapesTheTree) {
  const models::LlamaConfig config = test::small_llama_config();
  const models::LlamaWeights weights = models::LlamaWeights::random(config, 21, at::kDouble);
  models::LlamaModel<StaticKVCache> target(config, weights);
  models::LlamaModel<StaticKVCache> drafter(config, test::perturbed(weights, 0.14, 4));
  const auto depth_at = [&](double temperature) {
    DynamicTreeSource source(drafter, {.depth = 6, .top_k = 3, .total_tokens = 6, .score_temperature = temperature});
    source.start(kPrompt, {});
    const TreeDrafts drafts = source.draft_tree(DraftRequest{.sequence = kPrompt, .gamma = 1, .room = 30});
    const at::Tensor parents = drafts.device_parents.cpu();
    std::vector<int64_t> depth;  // parents precede their children
    for (int64_t i = 0; i < parents.numel(); ++i) {
      const int64_t parent = parents[i].item<int64_t>();
      depth.push_back(parent < 0 ? 1 : depth.at(static_cast<size_t>(parent)) + 1);
    }
    EXPECT_EQ(depth.size(), 6u);
    return std::ranges::max(depth);
  };
  // Near 0 the drafter is certain: the six nodes are its greedy chain. Far above 1 every path of a
  // depth scores alike: three children of the root, three below them.
  EXPECT_EQ(depth_at(1e-3), 6);
  EXPECT_EQ(depth_at(1e3), 2);
  const auto reference = autoregressive_generate(target, kPrompt, {.max_new_tokens = 40});
  for (const double temperature : {0.3, 3.0}) {
    DynamicTreeSource source(drafter, {.score_temperature = temperature});
    EXPECT_EQ(generate_with(source, target, kPrompt, {.max_new_tokens = 40}).tokens, reference.tokens) << temperature;
  }
}

// A dynamic tree of one child per node is the drafter's chain: the same drafts, step for step
// (a tree step reports its accepted path and first rejected child: a chain's drafts up to its
// first rejected one).
TEST(DynamicTreeGenerate, OneChildPerNodeDraftsTheChain) {
  const models::LlamaConfig config = test::small_llama_config();
  const models::LlamaWeights weights = models::LlamaWeights::random(config, 21, at::kDouble);
  models::LlamaModel<StaticKVCache> target(config, weights);
  models::LlamaModel<StaticKVCache> drafter(config, test::perturbed(weights, 0.14, 4));
  std::vector<std::vector<int64_t>> chain_drafts, tree_drafts;
  const auto record = [](std::vector<std::vector<int64_t>>& into) {
    return [&into](const StepInfo& step) {
      const auto shown = std::min<size_t>(step.drafts.size(), static_cast<size_t>(step.accepted + 1));
      into.emplace_back(step.drafts.begin(), step.drafts.begin() + static_cast<std::ptrdiff_t>(shown));
    };
  };
  ModelDraftSource chain(drafter);
  // Trees draft from the first step; so does the chain without first_target.
  (void)generate_with(chain, target, kPrompt,
                      {.max_new_tokens = 40, .on_step = record(chain_drafts), .gamma = 4, .first_target = false});
  DynamicTreeSource tree(drafter, {.depth = 4, .top_k = 1, .total_tokens = 4});
  (void)generate_with(tree, target, kPrompt, {.max_new_tokens = 40, .on_step = record(tree_drafts)});
  EXPECT_EQ(tree_drafts, chain_drafts);
  EXPECT_GT(chain_drafts.size(), 5u);
}

TEST(DynamicTreeGenerate, RejectsBadOptionsNamingThem) {
  test::MarkovModel drafter(memory_rows());
  expect_invalid([&] { DynamicTreeSource source(drafter, {.depth = 0}); }, {"depth", "0"});
  expect_invalid([&] { DynamicTreeSource source(drafter, {.top_k = 0}); }, {"top_k", "0"});
  expect_invalid([&] { DynamicTreeSource source(drafter, {.total_tokens = 0}); }, {"total_tokens", "0"});
  expect_invalid([&] { DynamicTreeSource source(drafter, {.top_k = 5}); }, {"top_k", "4", "5"});
  for (const double bad : {0.0, -1.0, std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()}) {
    expect_invalid([&] { DynamicTreeSource source(drafter, {.score_temperature = bad}); }, {"score_temperature"});
  }
  // Rounds that cannot fit the drafter's context beside one token: top_k (depth - 1) >= 128.
  const models::LlamaConfig config = test::small_llama_config();
  models::LlamaModel<StaticKVCache> small(config, models::LlamaWeights::random(config, 21, at::kDouble));
  expect_invalid([&] { DynamicTreeSource source(small, {.depth = 65, .top_k = 2}); },
                 {"depth 65", "top_k 2", "max_sequence_length 128"});
  EXPECT_NO_THROW(DynamicTreeSource(small, {.depth = 64, .top_k = 2}));
}

}  // namespace

}  // namespace test_stand
