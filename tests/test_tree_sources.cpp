// One conformance suite over every tree source of the drafting room: static trees from a drafter
// model (top-k and sampled children), dynamic trees, the EAGLE and Medusa heads' trees, parallel
// drafters' trees, suffix trees and STAND. Each runs on the same small Llama target and must:
// decode greedily exactly as autoregressive decoding with one device-to-host copy a step, and
// again on the caches it kept;
// take a session's turns up to the context's last position (trees cut to the room left); go on
// with the target alone past its drafter's context; and sample exactly the target's distribution
// (chi-square against every continuation's probability), while the same harness rejects a
// verification that leaves a rejected child in the residual. A new tree source is one Kind below.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <set>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "specdec/drafting/dynamic_tree.hpp"
#include "specdec/drafting/eagle.hpp"
#include "specdec/drafting/medusa.hpp"
#include "specdec/drafting/model_tree.hpp"
#include "specdec/drafting/parallel.hpp"
#include "specdec/drafting/stand.hpp"
#include "specdec/drafting/suffix.hpp"
#include "specdec/generate.hpp"
#include "specdec/models/llama.hpp"
#include "specdec/session.hpp"
#include "support/aten_calls.hpp"
#include "support/exact_continuations.hpp"
#include "support/head_fixtures.hpp"
#include "support/host_copies.hpp"
#include "support/llama_fixtures.hpp"
#include "support/parallel_fixtures.hpp"
#include "support/statistics.hpp"

// One namespace a file: specdec_tests is compiled as a unity build (tests/CMakeLists.txt).
namespace test_tree_sources {

namespace {

using namespace specdec;
using Model = models::LlamaModel<StaticKVCache>;
using Rule = specdec::detail::ModelTreeRule;

// The target every source drafts for, in float64 so that a tree forward and a one-token forward
// pick the same argmax.
struct World {
  models::LlamaConfig config;
  models::LlamaWeights weights;
  Model target;

  World(int64_t vocab, uint64_t seed)
      : config(config_of(vocab)),
        weights(models::LlamaWeights::random(config, seed, at::kDouble)),
        target(config, weights) {}

  static models::LlamaConfig config_of(int64_t vocab) {
    models::LlamaConfig c = test::small_llama_config();
    c.vocab_size = vocab;
    return c;
  }
};

// The vocabulary of the sampled tests: every continuation of three tokens is enumerated.
constexpr int64_t kSampledVocab = 6;

// A source verified by a biased rule (a rejected child left in the residual, so that it may be
// drawn after all; sampled children treated as drawn with replacement; their residual taken as
// if they were deterministic): the chi-square harness must reject each.
template <class Source, Rule rule>
class BiasedRule : public Source {
 public:
  using Source::Source;
  template <LogitsProcessor P>
  at::Tensor score_tree(const at::Tensor& logits, int64_t uncached, const P& processor,
                        at::Generator& gen) {
    return this->score(logits, uncached, processor, gen, rule);
  }
};
template <class Source, Rule rule>
using Verified = std::conditional_t<rule == Rule::exact, Source, BiasedRule<Source, rule>>;

// A drafter model: the target's weights with noise, right often and wrong often enough that
// second choices are accepted; its context `context` positions (0: the target's).
struct DrafterParts {
  Model drafter;
  DrafterParts(const World& w, int64_t context)
      : drafter(with_context(w.config, context), test::perturbed(w.weights, 0.14, 4)) {}
  static models::LlamaConfig with_context(models::LlamaConfig c, int64_t context) {
    if (context > 0) c.max_seq_len = context;
    return c;
  }
};

// --- The kinds: how each source is made -------------------------------------------------------
//
// Each kind names the world of its greedy tests (a vocabulary and a weight seed) where its
// drafts are accepted often enough to see acceptances; the sampled tests run on a vocabulary of
// 6 (every continuation of three tokens enumerated).
struct Kind {
  static constexpr int64_t greedy_vocab = 8;
  static constexpr uint64_t greedy_seed = 12;
};

// Static trees from a drafter model, with its top-k tokens or its draws as children.
template <TreeChildren children>
struct StaticTree : Kind {
  static constexpr bool has_drafter_context = true;
  static constexpr bool samples_children = children == TreeChildren::sampled;
  using Parts = DrafterParts;
  template <Rule rule>
  static auto make(Parts& parts, World& /*world*/) {
    return Verified<ModelTreeSource<Model>, rule>(
        parts.drafter, TreeTemplate::from_paths({{0}, {1}, {2}, {0, 0}, {0, 1}, {1, 0}, {0, 0, 0}}),
        children);
  }
};
using StaticTopK = StaticTree<TreeChildren::top_k>;
using StaticSampled = StaticTree<TreeChildren::sampled>;

struct Dynamic : Kind {
  static constexpr bool has_drafter_context = true;
  static constexpr bool samples_children = false;
  using Parts = DrafterParts;
  template <Rule rule>
  static auto make(Parts& parts, World& /*world*/) {
    return Verified<DynamicTreeSource<Model>, rule>(
        parts.drafter, DynamicTreeOptions{.depth = 3, .top_k = 2, .total_tokens = 6});
  }
};

struct EagleTree : Kind {
  static constexpr bool has_drafter_context = false;
  static constexpr bool samples_children = false;
  struct Parts {
    models::EagleHead head;
    // EAGLE-3 over a draft vocabulary of all but two of the target's tokens.
    Parts(const World& w, int64_t /*context*/)
        : head(test::random_eagle(w.config, w.weights, models::EagleKind::eagle3,
                                  w.config.vocab_size - 2, w.config.vocab_size == 6 ? 6 : 4)) {}
  };
  template <Rule rule>
  static auto make(Parts& parts, World& world) {
    return Verified<EagleTreeSource, rule>(
        parts.head, world.target, DynamicTreeOptions{.depth = 3, .top_k = 2, .total_tokens = 6});
  }
};

struct MedusaTree : Kind {
  static constexpr int64_t greedy_vocab = 48;
  static constexpr uint64_t greedy_seed = 5;
  static constexpr bool has_drafter_context = false;
  static constexpr bool samples_children = false;
  struct Parts {
    models::MedusaConfig config;
    models::MedusaHeads heads;
    Parts(const World& w, int64_t /*context*/)
        : config{.hidden_size = w.config.dim,
                 .vocab_size = w.config.vocab_size,
                 .num_heads = w.config.vocab_size == 6 ? 2 : 3},
          heads(config, models::MedusaHeads::random(config, w.config.vocab_size == 6 ? 4 : 3,
                                                    at::kDouble)) {}
  };
  template <Rule rule>
  static auto make(Parts& parts, World& world) {
    return Verified<MedusaTreeSource, rule>(
        parts.heads, world.target,
        TreeTemplate::from_paths({{0}, {1}, {2}, {0, 0}, {0, 1}, {1, 0}, {2, 0}}));
  }
};

// Static trees from one forward of a parallel drafter: the target's weights with noise and a
// mask row.
struct ParallelTree : Kind {
  static constexpr bool has_drafter_context = true;
  static constexpr bool samples_children = false;
  struct Parts {
    Model drafter;
    Parts(const World& w, int64_t context)
        : drafter(with_mask(DrafterParts::with_context(w.config, context)),
                  test::with_mask_row(test::perturbed(w.weights, 0.14, 4), 9)) {}
    static models::LlamaConfig with_mask(models::LlamaConfig c) {
      ++c.vocab_size;
      return c;
    }
  };
  template <Rule rule>
  static auto make(Parts& parts, World& world) {
    const int64_t vocab = world.config.vocab_size;
    return Verified<ParallelTreeSource<Model>, rule>(
        parts.drafter, ParallelDraftOptions{.mask_token = vocab, .vocab_size = vocab},
        TreeTemplate::from_paths({{0}, {1}, {2}, {0, 0}, {0, 1}, {1, 0}, {0, 0, 0}}));
  }
};

struct SuffixTree : Kind {
  static constexpr bool has_drafter_context = false;
  static constexpr bool samples_children = false;
  // Earlier responses: random texts over the vocabulary, so that contexts have several followers.
  struct Parts {
    SuffixCache cache;
    Parts(const World& w, int64_t /*context*/) : cache(w.config.vocab_size) {
      std::mt19937 random(11);
      std::uniform_int_distribution<int64_t> token(0, w.config.vocab_size - 1);
      for (int text = 0; text < 8; ++text) {
        std::vector<int64_t> tokens(40);
        for (int64_t& t : tokens) t = token(random);
        cache.add(tokens);
      }
    }
  };
  template <Rule rule>
  static auto make(Parts& parts, World& /*world*/) {
    return Verified<SuffixTreeSource, rule>(parts.cache, SuffixDraftRule{.min_token_prob = 0.0});
  }
};

// STAND verifies on the host with its own walk, which has biased variants of its own.
struct Stand : Kind {
  static constexpr bool has_drafter_context = false;
  static constexpr bool samples_children = true;
  // A memory of the next token after each token, unlike the target's. It learns the target's
  // distributions in the greedy tests, where its drafts then get accepted; in the sampled test it
  // stays fixed (learning over thousands of generations would pull it to the target's and leave
  // the biased rules too little to be caught by).
  struct Parts {
    ProbabilisticNGramStorage memory;
    StandOptions options{.seed = 7, .tree = TreeTemplate::full(2, 3)};  // the source reads it
    Parts(const World& w, int64_t /*context*/) : memory(w.config.vocab_size, 1) {
      const int64_t v = w.config.vocab_size;
      options.learn = v != kSampledVocab;
      for (int64_t t = 0; t < v; ++t) {
        const std::vector<int64_t> context{t}, next{(t + 1) % v, (t + 2) % v, (t + 3) % v};
        const std::vector<float> probabilities{0.6F, 0.3F, 0.1F};
        memory.update(context, next, probabilities);
      }
    }
  };
  template <Rule rule>
  static auto make(Parts& parts, World& world) {
    using specdec::detail::TreeVerification;
    static_assert(rule != Rule::residual_ignores_q, "STAND has no such variant");
    return specdec::detail::StandDraftSource(
        parts.memory, parts.options,
        rule == Rule::exact              ? TreeVerification::exact
        : rule == Rule::with_replacement ? TreeVerification::with_replacement
                                         : TreeVerification::skip_residual,
        specdec::detail::sequence_limit(world.target), world.config.vocab_size);
  }
};

template <class Kind>
class TreeSources : public testing::Test {};
using Kinds =
    testing::Types<StaticTopK, StaticSampled, Dynamic, EagleTree, MedusaTree, ParallelTree, SuffixTree, Stand>;
struct KindNames {
  template <class Kind>
  static std::string GetName(int) {
    if constexpr (std::is_same_v<Kind, StaticTopK>) return "StaticTopK";
    if constexpr (std::is_same_v<Kind, StaticSampled>) return "StaticSampled";
    if constexpr (std::is_same_v<Kind, Dynamic>) return "Dynamic";
    if constexpr (std::is_same_v<Kind, EagleTree>) return "EagleTree";
    if constexpr (std::is_same_v<Kind, MedusaTree>) return "MedusaTree";
    if constexpr (std::is_same_v<Kind, ParallelTree>) return "ParallelTree";
    if constexpr (std::is_same_v<Kind, SuffixTree>) return "SuffixTree";
    return "Stand";
  }
};
TYPED_TEST_SUITE(TreeSources, Kinds, KindNames);

const std::vector<int64_t> kPrompt{1, 7, 3, 2, 5, 1, 7};

using test::copies_during;

// Greedy decoding through the source's trees is autoregressive decoding, with and without the
// caches, and every step costs one device-to-host copy; a second generation from the caches the
// source kept is too.
TYPED_TEST(TreeSources, GreedyEqualsAutoregressiveWithOneCopyAStep) {
  World world(TypeParam::greedy_vocab, TypeParam::greedy_seed);
  typename TypeParam::Parts parts(world, 0);
  const auto reference = autoregressive_generate(world.target, kPrompt, {.max_new_tokens = 40});
  int64_t accepted = 0;
  for (const bool use_cache : {true, false}) {
    auto source = TypeParam::template make<Rule::exact>(parts, world);
    for (int run = 0; run < 2; ++run) {
      GenerationResult result;
      const int64_t copies = copies_during([&] {
        result = generate_with(source, world.target, kPrompt,
                               {.max_new_tokens = 40, .use_cache = use_cache});
      });
      EXPECT_EQ(result.tokens, reference.tokens) << "use_cache " << use_cache << ", run " << run;
      EXPECT_EQ(copies, result.stats.steps);
      EXPECT_EQ(result.stats.target_calls, result.stats.steps);
      accepted += result.stats.accepted;
    }
  }
  EXPECT_GT(accepted, 0) << "trees were accepted into, not only drafted";
}

// A session's turns up to the context's last position: the trees are cut to the room left, an
// ordinary end, and the output is autoregressive decoding's to the last token.
TYPED_TEST(TreeSources, SessionTurnsRunToTheContextLimitCut) {
  World world(TypeParam::greedy_vocab, TypeParam::greedy_seed);
  typename TypeParam::Parts parts(world, 0);
  const int64_t limit = world.config.max_seq_len;
  const auto reference = autoregressive_generate(world.target, kPrompt, {.max_new_tokens = limit});
  auto source = TypeParam::template make<Rule::exact>(parts, world);
  Session session(world.target);
  session.append(kPrompt);
  const auto first = session.generate(source, {.max_new_tokens = 10});
  GenerationResult rest;
  const int64_t copies =
      copies_during([&] { rest = session.generate(source, {.max_new_tokens = limit}); });
  std::vector<int64_t> joined = first.tokens;
  joined.insert(joined.end(), rest.tokens.begin(), rest.tokens.end());
  EXPECT_EQ(joined, reference.tokens);
  EXPECT_EQ(rest.stop_reason, StopReason::sequence_limit);
  EXPECT_EQ(copies, rest.stats.steps);
}

// A prompt longer than a drafter's context: the target goes on alone, as with a chain; a prompt
// that fits drafts until the sequence outgrows the drafter. (Sources without a drafter context
// take a prompt that fills most of the target's.)
TYPED_TEST(TreeSources, APromptPastTheDrafterContextGoesOnWithTheTargetAlone) {
  World world(TypeParam::greedy_vocab, TypeParam::greedy_seed);
  constexpr int64_t kDrafterContext = 16;
  typename TypeParam::Parts parts(world, kDrafterContext);
  const int64_t long_prompt =
      TypeParam::has_drafter_context ? kDrafterContext + 4 : world.config.max_seq_len - 30;
  for (const int64_t length : {long_prompt, int64_t{6}}) {
    std::vector<int64_t> prompt(static_cast<size_t>(length));
    for (int64_t i = 0; i < length; ++i) prompt[static_cast<size_t>(i)] = (i * 3 + 1) % 8;
    const auto reference = autoregressive_generate(world.target, prompt, {.max_new_tokens = 24});
    auto source = TypeParam::template make<Rule::exact>(parts, world);
    const auto result = generate_with(source, world.target, prompt, {.max_new_tokens = 24});
    EXPECT_EQ(result.tokens, reference.tokens) << length;
    if (TypeParam::has_drafter_context && length > kDrafterContext) {
      EXPECT_EQ(result.stats.drafter_calls, 0) << "the drafter cannot hold the prompt";
    }
    if (TypeParam::has_drafter_context && length < kDrafterContext) {
      EXPECT_GT(result.stats.drafted, 0) << "the drafter drafted while it fit";
    }
  }
}

// Sampled output: three tokens after a prompt, over 4000 seeds, against the exact probability of
// every continuation (chi-square at a tail of 1e-6). The same harness, over 6000 seeds, rejects
// the biased rules.
template <class Kind, Rule rule, class P>
test::ChiSquare sampled_fit(const P& processor, int64_t* drafted, int64_t* accepted) {
  World world(kSampledVocab, 8);
  typename Kind::Parts parts(world, 0);
  auto source = Kind::template make<rule>(parts, world);
  const std::vector<int64_t> prompt{1, 4, 2};
  const auto expected = test::exact_continuations(world.target, processor, prompt, 3);
  // The biased rules get more samples: their bias is one of degree (Medusa's random heads rank
  // tokens the target rarely gives, so few of their children are rejected with much mass).
  const int64_t kSamples = rule == Rule::exact ? 4000 : 6000;
  std::map<std::vector<int64_t>, int64_t> observed;
  for (int64_t i = 0; i < kSamples; ++i) {
    const GenerationResult result =
        generate_with(source, world.target, prompt,
                      {.max_new_tokens = 3, .seed = static_cast<uint64_t>(i)}, processor);
    ++observed[result.tokens];
    *drafted += result.stats.drafted;
    *accepted += result.stats.accepted;
  }
  return test::chi_square(observed, expected, kSamples);
}

TYPED_TEST(TreeSources, SampledOutputIsTheTargetsAndTheHarnessHasPower) {
  const MultinomialProcessor processor{2.0};
  int64_t drafted = 0, accepted = 0;
  const auto exact = sampled_fit<TypeParam, Rule::exact>(processor, &drafted, &accepted);
  EXPECT_EQ(exact.outside_support, 0);
  EXPECT_LT(exact.statistic, test::chi_square_quantile(exact.dof, 4.75));
  EXPECT_GT(drafted, 4000) << "trees were drafted";
  EXPECT_GT(accepted, 100) << "and accepted into";
  if constexpr (TypeParam::samples_children) {
    // Children drawn through a top-k processor: q is the processed distribution.
    int64_t ignored = 0;
    const auto top_k = sampled_fit<TypeParam, Rule::exact>(TopKProcessor{3}, &ignored, &ignored);
    EXPECT_EQ(top_k.outside_support, 0);
    EXPECT_LT(top_k.statistic, test::chi_square_quantile(top_k.dof, 4.75));
  }
  int64_t ignored = 0;
  const auto biased = sampled_fit<TypeParam, Rule::no_residual>(processor, &ignored, &ignored);
  EXPECT_GT(biased.statistic, test::chi_square_quantile(biased.dof, 4.75));
  if constexpr (TypeParam::samples_children) {
    const auto replaced = sampled_fit<TypeParam, Rule::with_replacement>(processor, &ignored, &ignored);
    EXPECT_GT(replaced.statistic, test::chi_square_quantile(replaced.dof, 4.75));
  }
  if constexpr (std::is_same_v<TypeParam, StaticSampled>) {
    const auto ignores_q =
        sampled_fit<TypeParam, Rule::residual_ignores_q>(processor, &ignored, &ignored);
    EXPECT_GT(ignores_q.statistic, test::chi_square_quantile(ignores_q.dof, 4.75));
  }
}

// A drafter model that keeps a dynamic tree's rounds in its cache (CachedMaskTreeModel: one
// forward of top_k tokens per round) grows the trees that feeding each round's paths again grows
// (what it does without a cache): step for step the same drafts and acceptance, for the ATen
// forward (float64) and the CPU loops (float32; a frontier of 10 goes through batched products).
TEST(DynamicTrees, RoundsKeptInTheCacheGrowTheTreesOfPathsFedAgain) {
  models::LlamaConfig config = test::small_llama_config();
  const std::vector<int64_t> prompt{1, 7, 3, 22, 5, 1, 7};
  for (const auto dtype : {at::kDouble, at::kFloat}) {
    const models::LlamaWeights weights = models::LlamaWeights::random(config, 12, dtype);
    Model target(config, weights);
    Model drafter(config, test::perturbed(weights, 0.14, 4));
    for (const DynamicTreeOptions options : {DynamicTreeOptions{.depth = 4, .top_k = 3, .total_tokens = 10},
                                             DynamicTreeOptions{.depth = 3, .top_k = 10, .total_tokens = 24}}) {
      SCOPED_TRACE(::testing::Message() << dtype << " " << options);
      std::vector<std::vector<int64_t>> steps[2];
      int64_t drafter_calls[2] = {0, 0};
      std::vector<int64_t> tokens[2];
      for (const bool use_cache : {true, false}) {
        auto& into = steps[use_cache ? 0 : 1];
        DynamicTreeSource<Model> source(drafter, options);
        const GenerationResult result = generate_with(
            source, target, prompt,
            {.max_new_tokens = 30,
             .use_cache = use_cache,
             .on_step = [&into](const StepInfo& step) {
               std::vector<int64_t> seen(step.drafts.begin(), step.drafts.end());
               seen.push_back(step.accepted);
               into.push_back(std::move(seen));
             }});
        drafter_calls[use_cache ? 0 : 1] = result.stats.drafter_calls;
        tokens[use_cache ? 0 : 1] = result.tokens;
      }
      EXPECT_EQ(steps[0], steps[1]);
      EXPECT_EQ(tokens[0], tokens[1]);
      EXPECT_EQ(tokens[0], autoregressive_generate(target, prompt, {.max_new_tokens = 30}).tokens);
      EXPECT_EQ(drafter_calls[0], drafter_calls[1]) << "one forward per round either way";
    }
  }
}

// Logits for a path of tokens, the same whenever the path is the same: V values from a generator
// seeded by the path (continuous, so that no two candidates' scores tie).
std::vector<double> logits_of_path(const std::vector<int64_t>& path, int64_t vocab) {
  uint64_t seed = 1469598103934665603ull;
  for (const int64_t t : path) seed = (seed ^ static_cast<uint64_t>(t + 1)) * 1099511628211ull;
  std::mt19937_64 random(seed);
  std::normal_distribution<double> normal(0.0, 2.0);
  std::vector<double> row(static_cast<size_t>(vocab));
  for (double& x : row) x = normal(random);
  return row;
}

std::vector<double> log_softmax_of(std::vector<double> row) {
  const double top = *std::max_element(row.begin(), row.end());
  double sum = 0.0;
  for (const double x : row) sum += std::exp(x - top);
  for (double& x : row) x = x - top - std::log(sum);
  return row;
}

// A dynamic tree grown over logits_of_path: the drafter the rounds call is a function of each
// frontier node's path, which the test follows through parent_rows. Returns the tree's nodes as
// paths, root to node, after checking that parents come before their children.
std::set<std::vector<int64_t>> device_tree(const DynamicTreeOptions& options, int64_t vocab,
                                           int64_t n) {
  const int64_t k = options.top_k;
  const auto row_tensor = [&](const std::vector<std::vector<int64_t>>& paths) {
    std::vector<double> values;
    for (const auto& path : paths) {
      const auto row = logits_of_path(path, vocab);
      values.insert(values.end(), row.begin(), row.end());
    }
    return at::tensor(values, at::kDouble).view({static_cast<int64_t>(paths.size()), vocab});
  };
  std::vector<std::vector<int64_t>> frontier;
  specdec::detail::DeviceDraftTree tree;
  tree.build(row_tensor({{}}), options.depth, options, n,
             [&](int64_t /*round*/, const at::Tensor& tokens, const at::Tensor& parent_rows) {
               std::vector<std::vector<int64_t>> next;
               for (int64_t i = 0; i < k; ++i) {
                 std::vector<int64_t> path =
                     frontier.empty() ? std::vector<int64_t>{} : frontier[static_cast<size_t>(parent_rows[i].item<int64_t>())];
                 path.push_back(tokens[i].item<int64_t>());
                 next.push_back(std::move(path));
               }
               frontier = std::move(next);
               return row_tensor(frontier);
             });
  const TreeDrafts drafts = tree.drafts(at::kCPU, 0);
  std::vector<std::vector<int64_t>> paths;
  std::set<std::vector<int64_t>> nodes;
  for (int64_t i = 0; i < drafts.ids.numel(); ++i) {
    const int64_t parent = drafts.device_parents[i].item<int64_t>();
    EXPECT_LT(parent, i) << "parents come before their children";
    std::vector<int64_t> path = parent < 0 ? std::vector<int64_t>{} : paths[static_cast<size_t>(parent)];
    path.push_back(drafts.ids[i].item<int64_t>());
    nodes.insert(path);
    paths.push_back(std::move(path));
  }
  return nodes;
}

// EAGLE-2's selection on the host, in plain C++: each round the frontier's top_k children by the
// drafter's log-probability, scored by their paths' sums; the top_k best of them the next
// frontier; the n best candidates of all rounds the tree.
std::set<std::vector<int64_t>> host_tree(const DynamicTreeOptions& options, int64_t vocab,
                                         int64_t n) {
  struct Candidate {
    std::vector<int64_t> path;
    double score;
  };
  const auto children = [&](const Candidate& parent) {
    const auto lp = log_softmax_of(logits_of_path(parent.path, vocab));
    std::vector<int64_t> order(static_cast<size_t>(vocab));
    for (int64_t t = 0; t < vocab; ++t) order[static_cast<size_t>(t)] = t;
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return lp[static_cast<size_t>(a)] > lp[static_cast<size_t>(b)]; });
    std::vector<Candidate> out;
    for (int64_t j = 0; j < options.top_k; ++j) {
      Candidate c{parent.path, parent.score + lp[static_cast<size_t>(order[static_cast<size_t>(j)])]};
      c.path.push_back(order[static_cast<size_t>(j)]);
      out.push_back(std::move(c));
    }
    return out;
  };
  const auto by_score = [](const Candidate& a, const Candidate& b) { return a.score > b.score; };
  std::vector<Candidate> all = children(Candidate{{}, 0.0});
  std::vector<Candidate> frontier = all;
  for (int64_t round = 2; round <= options.depth; ++round) {
    std::vector<Candidate> round_candidates;
    for (const Candidate& node : frontier) {
      for (Candidate& c : children(node)) round_candidates.push_back(std::move(c));
    }
    all.insert(all.end(), round_candidates.begin(), round_candidates.end());
    std::sort(round_candidates.begin(), round_candidates.end(), by_score);
    round_candidates.resize(static_cast<size_t>(options.top_k));
    frontier = std::move(round_candidates);
  }
  std::stable_sort(all.begin(), all.end(), by_score);
  std::set<std::vector<int64_t>> nodes;
  for (int64_t i = 0; i < n; ++i) nodes.insert(all[static_cast<size_t>(i)].path);
  return nodes;
}

// The device's frontiers, selection and numbering choose the tree EAGLE-2's procedure chooses.
TEST(DynamicTrees, TheDeviceSelectionIsTheProcedureOnTheHost) {
  for (const auto& [options, n] : std::vector<std::pair<DynamicTreeOptions, int64_t>>{
           {{.depth = 1, .top_k = 3}, 2},
           {{.depth = 2, .top_k = 2}, 6},
           {{.depth = 4, .top_k = 3}, 9},
           {{.depth = 5, .top_k = 4}, 16},
           {{.depth = 6, .top_k = 2}, 11},
           {{.depth = 3, .top_k = 5}, 55}}) {
    SCOPED_TRACE(::testing::Message() << options << " n=" << n);
    const auto got = device_tree(options, 13, n);
    EXPECT_EQ(got.size(), static_cast<size_t>(n));
    EXPECT_EQ(got, host_tree(options, 13, n));
  }
}

// A drafter whose logits are not finite in any round (NaN, +inf, a row of only -inf) makes the
// step throw; -inf entries beside finite ones are zero probabilities, not an error.
TEST(DynamicTrees, NonFiniteDrafterLogitsInAnyRoundAreReported) {
  const float inf = std::numeric_limits<float>::infinity();
  const DynamicTreeOptions options{.depth = 4, .top_k = 3};
  const int64_t vocab = 9, n = 12;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
  for (int64_t spoil_round = 1; spoil_round <= options.depth; ++spoil_round) {
    for (int kind = 0; kind < 4; ++kind) {
      SCOPED_TRACE(::testing::Message() << "round " << spoil_round << ", kind " << kind);
      const auto spoil = [&](at::Tensor logits, int64_t round) {
        if (round != spoil_round) return logits;
        const int64_t row = logits.size(0) - 1;
        switch (kind) {
          case 0: logits[row][4] = NAN; break;
          case 1: logits[row][7] = inf; break;
          case 2: logits[row].fill_(-inf); break;
          default: logits[row].narrow(0, 0, 5).fill_(-inf); break;  // finite: zero probabilities
        }
        return logits;
      };
      specdec::detail::DeviceDraftTree tree;
      tree.build(spoil(at::randn({1, vocab}, gen), 1), options.depth, options, n,
                 [&](int64_t round, const at::Tensor& /*tokens*/, const at::Tensor& /*parent_rows*/) {
                   return spoil(at::randn({options.top_k, vocab}, gen), round);
                 });
      const at::Tensor values =
          specdec::detail::to_host(tree.score(at::randn({1 + n, vocab}, gen), 1, GreedyProcessor(), gen, Rule::exact));
      if (kind == 3) {
        EXPECT_NO_THROW((void)tree.walk(values.data_ptr<double>()));
      } else {
        EXPECT_THROW((void)tree.walk(values.data_ptr<double>()), std::invalid_argument);
      }
    }
  }
}

// The library's own work in a dynamic tree step, counted in ATen calls (each a few microseconds
// of dispatch on a CPU, whatever the tensor's size): growing the tree costs a fixed handful per
// round and verifying it a fixed handful per step, whatever the width. (The drafter's and the
// target's forwards are not part of it: the rounds' logits here are made before counting.)
TEST(DynamicTrees, TheLibrarysOwnWorkIsAFewAtenCallsPerRound) {
  const int64_t vocab = 64;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(9);
  const auto count = [&](int64_t depth, int64_t top_k, int64_t n, int64_t* verify_calls) {
    const DynamicTreeOptions options{.depth = depth, .top_k = top_k};
    std::vector<at::Tensor> rounds;
    for (int64_t r = 0; r <= depth; ++r) rounds.push_back(at::randn({r == 0 ? 1 : top_k, vocab}, gen));
    const at::Tensor target = at::randn({1 + n, vocab}, gen);
    specdec::detail::DeviceDraftTree tree;
    int64_t calls = 0;
    for (int repeat = 0; repeat < 2; ++repeat) {  // the second build finds the shape's constants kept
      test::AtenCallCounter counter;
      tree.build(rounds[0], depth, options, n,
                 [&](int64_t round, const at::Tensor& /*tokens*/, const at::Tensor& /*parent_rows*/) {
                   return rounds[static_cast<size_t>(round - 1)];
                 });
      calls = test::AtenCallCounter::calls();
    }
    {
      test::AtenCallCounter counter;
      (void)tree.score(target, 1, GreedyProcessor(), gen, Rule::exact);
      *verify_calls = test::AtenCallCounter::calls();
    }
    return calls;
  };
  int64_t verify_5 = 0, verify_6 = 0, verify_wide = 0;
  const int64_t depth_5 = count(5, 4, 16, &verify_5);
  const int64_t depth_6 = count(6, 4, 16, &verify_6);
  (void)count(3, 10, 24, &verify_wide);
  std::cout << "dynamic tree, top_k 4, 16 nodes: " << depth_5 << " ATen calls to grow 5 rounds, "
            << depth_6 - depth_5 << " per round, " << verify_5 << " to verify (" << verify_wide
            << " for top_k 10)\n";
  EXPECT_GT(depth_6 - depth_5, 0) << "the counter sees the calls";
  EXPECT_LE(depth_6 - depth_5, 12) << "ATen calls per round";
  EXPECT_LE(depth_5, 75) << "ATen calls to grow a tree of 5 rounds";
  EXPECT_LE(verify_5, 8) << "ATen calls to verify a tree greedily";
  EXPECT_LE(verify_wide, verify_5 + 2) << "verification does not grow with the children per node";
}

// GreedyProcessor under another type: TreeVerifier::score takes its general path for it (one-hot
// distributions, uniforms, the residual), which its greedy shortcut must reproduce exactly.
struct OneHotProcessor {
  at::Tensor operator()(const at::Tensor& logits) const { return GreedyProcessor()(logits); }
  at::Tensor sample(const at::Tensor& probs, at::Generator& gen) const { return GreedyProcessor().sample(probs, gen); }
};

// The greedy shortcut of tree verification gives the values of the general rules on one-hot
// distributions, under every rule, for deterministic children and for children drawn from q (some
// not drawable), with ties among the target's logits, on the host (fp32 logits) and through ATen
// (fp64 logits, as on a device); a row that is not finite is reported either way. On the host it
// is a handful of ATen calls where the general path makes dozens.
TEST(TreeVerification, GreedyScoresAreTheGeneralRulesOnOneHotDistributions) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(21);
  std::mt19937_64 random(21);
  const int64_t vocab = 7, uncached = 3;
  const std::vector<int64_t> parents{-1, -1, -1, 0, 0, 1, 3, 3, 6};
  const auto n = static_cast<int64_t>(parents.size());
  const int64_t width = 3;
  at::Tensor children = at::full({n + 1, width}, -1, at::kLong);
  std::vector<int64_t> used(static_cast<size_t>(n + 1), 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t position = parents[static_cast<size_t>(i)] + 1;
    children[position][used[static_cast<size_t>(position)]++] = i;
  }
  int64_t accepted = 0;
  for (int trial = 0; trial < 40; ++trial) {
    SCOPED_TRACE(::testing::Message() << "trial " << trial);
    // Siblings are distinct tokens; the logits are small integers (many ties), and a position's
    // largest is often one of its children.
    at::Tensor ids = at::empty({n}, at::kLong);
    for (int64_t position = 0; position <= n; ++position) {
      const at::Tensor tokens = at::randperm(vocab, gen, at::TensorOptions().dtype(at::kLong));
      for (int64_t j = 0; j < width; ++j) {
        const int64_t node = children[position][j].item<int64_t>();
        if (node >= 0) ids[node] = tokens[j];
      }
    }
    at::Tensor logits = at::randint(0, 3, {uncached + n, vocab}, gen, at::TensorOptions().dtype(at::kFloat));
    for (int64_t position = 0; position <= n; ++position) {
      const int64_t node = children[position][static_cast<int64_t>(random() % width)].item<int64_t>();
      if (node >= 0 && random() % 2 == 0) logits[uncached - 1 + position][ids[node].item<int64_t>()] = 3.0;
    }
    const bool spoiled = trial % 8 == 7;
    if (spoiled) logits[uncached + static_cast<int64_t>(random() % n)][2] = NAN;
    specdec::detail::TreeVerifier tree;
    tree.start();
    tree.set(ids, children);
    if (trial % 2 == 1) {
      const at::Tensor drawable = at::rand({n}, gen) < 0.7;
      tree.set_sampled(drawable, at::softmax(at::randn({n + 1, vocab}, gen), 1));
    }
    for (const at::ScalarType dtype : {at::kFloat, at::kDouble}) {
      for (const Rule rule : {Rule::exact, Rule::residual_ignores_q, Rule::with_replacement, Rule::no_residual}) {
        const at::Tensor input = logits.to(dtype);
        const at::Tensor fast = tree.score(input, uncached, GreedyProcessor(), gen, rule);
        const at::Tensor general = tree.score(input, uncached, OneHotProcessor(), gen, rule);
        ASSERT_EQ(fast.sizes(), general.sizes());
        const int64_t finite_at = fast.numel() - 2;
        EXPECT_EQ(fast[finite_at].item<double>(), spoiled ? 0.0 : 1.0);
        EXPECT_EQ(general[finite_at].item<double>(), spoiled ? 0.0 : 1.0);
        if (spoiled) continue;  // the tokens of a row that is not finite mean nothing
        EXPECT_TRUE(at::equal(fast, general)) << "dtype " << dtype << ", rule " << static_cast<int>(rule) << "\n"
                                              << fast << "\n" << general;
        accepted += fast.narrow(0, 0, (n + 1) * width).sum().item<int64_t>();
      }
    }
  }
  EXPECT_GT(accepted, 100) << "the trees see acceptances";
  // Counted on the host path.
  at::Tensor logits = at::randn({uncached + n, vocab}, gen);
  at::Tensor ids = at::randint(0, vocab, {n}, gen, at::TensorOptions().dtype(at::kLong));
  specdec::detail::TreeVerifier tree;
  tree.start();
  tree.set(ids, children);
  int64_t greedy_calls = 0, general_calls = 0;
  {
    test::AtenCallCounter counter;
    (void)tree.score(logits, uncached, GreedyProcessor(), gen, Rule::exact);
    greedy_calls = test::AtenCallCounter::calls();
  }
  {
    test::AtenCallCounter counter;
    (void)tree.score(logits, uncached, OneHotProcessor(), gen, Rule::exact);
    general_calls = test::AtenCallCounter::calls();
  }
  int64_t device_calls = 0;
  {
    const at::Tensor wide = logits.to(at::kDouble);  // not read on the host: the device's way
    test::AtenCallCounter counter;
    (void)tree.score(wide, uncached, GreedyProcessor(), gen, Rule::exact);
    device_calls = test::AtenCallCounter::calls();
  }
  std::cout << "greedy tree verification: " << greedy_calls << " ATen calls on the host, " << device_calls
            << " on a device (general rule: " << general_calls << ")\n";
  EXPECT_LT(device_calls, general_calls);
  EXPECT_LE(greedy_calls, 10);
  EXPECT_GT(general_calls, greedy_calls);
}

}  // namespace

}  // namespace test_tree_sources
