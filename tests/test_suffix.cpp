// Suffix decoding: the tree's counts against brute-force counting, the walk's anchoring, length
// and confidence rules, greedy equality with autoregressive decoding (generations, sessions,
// batches), exact sampled distributions (with a check that the test has power), the cache's
// bounds, eviction and files.
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <fstream>
#include <map>
#include <random>

#include "specdec/batch.hpp"
#include "specdec/drafting/suffix.hpp"
#include "specdec/generate.hpp"
#include "specdec/io/errors.hpp"
#include "specdec/session.hpp"
#include "support/expect_invalid.hpp"
#include "support/llama_fixtures.hpp"
#include "support/markov_fixtures.hpp"
#include "support/statistics.hpp"
#include "support/toy_models.hpp"

// One namespace a file: specdec_tests is compiled as a unity build (tests/CMakeLists.txt).
namespace test_suffix {

namespace {

using namespace specdec;
using Tokens = std::vector<int64_t>;
using specdec::detail::SuffixTrie;

// The node of `substring` in `trie`, walked from the root, or kNone.
uint32_t find(const SuffixTrie& trie, const Tokens& substring) {
  uint32_t at = 0;
  for (const int64_t token : substring) {
    at = trie.child(at, token);
    if (at == SuffixTrie::kNone) return at;
  }
  return at;
}

Tokens random_text(size_t length, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int64_t> pick(0, vocab - 1);
  Tokens text(length);
  for (auto& t : text) t = pick(rng);
  return text;
}

// Counting by brute force over texts (no substring spans two texts).
struct BruteCounts {
  std::map<Tokens, int64_t> counts, continued;
  std::map<Tokens, std::map<int64_t, int64_t>> followers;

  BruteCounts(const std::vector<Tokens>& texts, int64_t depth) {
    for (const Tokens& text : texts) {
      for (size_t i = 0; i < text.size(); ++i) {
        for (size_t length = 1; length <= static_cast<size_t>(depth) && i + length <= text.size(); ++length) {
          const Tokens s(text.begin() + static_cast<long>(i), text.begin() + static_cast<long>(i + length));
          ++counts[s];
          if (i + length < text.size() && length < static_cast<size_t>(depth)) {
            ++continued[s];
            ++followers[s][text[i + length]];
          }
        }
      }
    }
  }
  [[nodiscard]] int64_t count(const Tokens& s) const {
    const auto it = counts.find(s);
    return it == counts.end() ? 0 : it->second;
  }
};

// The nodes are exactly the substrings of up to max_depth tokens that are one token long or
// extend a substring seen at least twice, each linked to its substring less the first token.
// Each counts its occurrences; one seen twice or more also how often a token followed it and its
// most frequent follower (smallest token on a tie), and one seen once points just past its
// occurrence in the kept text. All against brute force, over several texts.
TEST(SuffixTrie, NodesAndCountsEqualBruteForceCounting) {
  for (const uint32_t seed : {1u, 2u, 3u, 4u}) {
    const int64_t depth = 5;
    const std::vector<Tokens> texts{random_text(300, 3, seed), random_text(40, 3, seed + 10),
                                    Tokens{1, 1, 1, 1, 1, 1, 2, 1, 1, 1}, random_text(200, 2, seed + 20)};
    SuffixTrie trie(depth);
    SuffixTrie::Path path;
    for (const Tokens& text : texts) {
      trie.begin_text(path);
      for (const int64_t t : text) trie.extend(path, t);
      // The path after a text: its suffixes as far as they are nodes, by length.
      for (size_t length = 1; length < path.size(); ++length) {
        EXPECT_EQ(path[length], find(trie, Tokens(text.end() - static_cast<long>(length), text.end())));
      }
    }
    const BruteCounts brute(texts, depth);
    size_t nodes = 1;
    for (const auto& [s, count] : brute.counts) {
      const uint32_t at = find(trie, s);
      const bool made = s.size() == 1 || brute.count(Tokens(s.begin(), s.end() - 1)) >= 2;
      ASSERT_EQ(at != SuffixTrie::kNone, made) << ::testing::PrintToString(s) << " seed " << seed;
      if (!made) continue;
      ++nodes;
      const auto& node = trie.node(at);
      EXPECT_EQ(node.count, count);
      EXPECT_EQ(node.link, s.size() == 1 ? 0u : find(trie, Tokens(s.begin() + 1, s.end()))) << ::testing::PrintToString(s);
      if (count == 1) {  // seen once: just past its occurrence, the kept text goes on as it did
        ASSERT_GE(node.end, s.size());
        for (size_t k = 0; k < s.size(); ++k) EXPECT_EQ(trie.token_at(node.end - s.size() + k), s[k]);
        EXPECT_EQ(node.best, SuffixTrie::kNone);
        continue;
      }
      EXPECT_EQ(node.continued, brute.continued.count(s) ? brute.continued.at(s) : 0) << ::testing::PrintToString(s);
      if (!brute.followers.count(s)) {
        EXPECT_EQ(node.best, SuffixTrie::kNone);
      } else {
        int64_t best = -1, most = 0;
        for (const auto& [token, n] : brute.followers.at(s)) {
          if (n > most) best = token, most = n;
        }
        ASSERT_NE(node.best, SuffixTrie::kNone);
        EXPECT_EQ(trie.node(node.best).token, best);
      }
    }
    EXPECT_EQ(trie.nodes(), nodes);  // nothing else, nothing deeper than max_depth
  }
}

// A text the tree does not hold: its position is its longest suffix that is a node (the shorter
// ones down the links), and the longest suffix found in the kept text past it.
TEST(SuffixTrie, PositionMatchesTheLongestSuffixFoundInTheKeptText) {
  const int64_t depth = 8;
  const std::vector<Tokens> texts{random_text(400, 4, 5), random_text(100, 4, 6)};
  SuffixTrie trie(depth);
  SuffixTrie::Path path;
  for (const Tokens& text : texts) {
    trie.begin_text(path);
    for (const int64_t t : text) trie.extend(path, t);
  }
  const BruteCounts brute(texts, depth);
  const Tokens query = random_text(300, 4, 7);
  SuffixTrie::Position position;
  for (size_t i = 0; i < query.size(); ++i) {
    trie.follow(position, query[i]);
    // The longest suffix of the query (up to depth - 1 tokens) found in the texts.
    int64_t longest = 0;
    for (int64_t length = 1; length < depth && static_cast<size_t>(length) <= i + 1; ++length) {
      if (brute.count(Tokens(query.begin() + static_cast<long>(i + 1) - length, query.begin() + static_cast<long>(i + 1))) == 0) break;
      longest = length;
    }
    const int64_t found = std::max<int64_t>(position.depth, position.end == SuffixTrie::kNone ? 0 : position.length);
    EXPECT_LE(found, longest) << i;
    // The node: the longest suffix (up to depth - 1 tokens) that is one; down its links, the
    // shorter suffixes.
    const auto suffix = [&](int64_t length) {
      return Tokens(query.begin() + static_cast<long>(i + 1) - length, query.begin() + static_cast<long>(i + 1));
    };
    int64_t deepest = 0;
    while (deepest + 1 < depth && static_cast<size_t>(deepest + 1) <= i + 1 &&
           find(trie, suffix(deepest + 1)) != SuffixTrie::kNone) {
      ++deepest;
    }
    ASSERT_EQ(position.depth, deepest) << i;
    uint32_t at = position.node;
    for (int64_t length = deepest; length >= 1; --length, at = trie.node(at).link) {
      EXPECT_EQ(at, find(trie, suffix(length))) << i << " length " << length;
    }
    EXPECT_EQ(at, 0u);
    if (position.end != SuffixTrie::kNone) {  // the matched text is really there
      for (int64_t k = 1; k <= position.length; ++k) {
        EXPECT_EQ(trie.token_at(position.end - static_cast<uint32_t>(k)), query[i + 1 - static_cast<size_t>(k)]);
      }
    }
  }
}

struct Learned {
  SuffixTrie trie;
  SuffixTrie::Position position;  // of the text itself
};

Learned learned(const Tokens& text, int64_t depth) {
  Learned out{SuffixTrie(depth), {}};
  SuffixTrie::Path path{0};
  for (const int64_t t : text) out.trie.extend(path, t);
  out.position = SuffixTrie::position_at(path);
  return out;
}

specdec::detail::SuffixWalk walk(const Learned& l, const SuffixDraftRule& rule, int64_t cap) {
  specdec::detail::SuffixWalk out;
  specdec::detail::walk_suffixes(l.trie, l.position, rule.walk(), cap, out);
  return out;
}

TEST(SuffixWalk, AnchorsOnTheLongestFollowedSuffixAndSizesTheDraftByIt) {
  // "5 1 2 3 4" then "9 2 3 7", "9 2 3 7": after "... 1 2 3" the longest followed suffix is
  // "1 2 3" (followed by 4 once), not "2 3" (followed by 7 twice).
  const Tokens text{5, 1, 2, 3, 4, 9, 2, 3, 7, 9, 2, 3, 7, 0, 1, 2, 3};
  const Learned trie = learned(text, 8);
  const auto drafted = walk(trie, {.max_spec_factor = 1.0, .min_token_prob = 0.0}, 16);
  EXPECT_EQ(drafted.match, 3);
  EXPECT_EQ(drafted.tokens, (Tokens{4, 9, 2}));  // at most 1.0 * 3 tokens
  // Half the match's length, and the cap.
  EXPECT_EQ(walk(trie, {.max_spec_factor = 0.5, .min_token_prob = 0.0}, 16).tokens, (Tokens{4}));
  EXPECT_EQ(walk(trie, {.max_spec_factor = 4.0, .min_token_prob = 0.0}, 2).tokens, (Tokens{4, 9}));
  // An offset below zero drafts nothing from a short match.
  EXPECT_TRUE(walk(trie, {.max_spec_offset = -3.0, .min_token_prob = 0.0}, 16).tokens.empty());
  // min_match 4: "1 2 3" is too short, and no longer suffix was followed.
  EXPECT_TRUE(walk(trie, {.min_token_prob = 0.0, .min_match = 4}, 16).tokens.empty());
}

TEST(SuffixWalk, StopsWhereThePathsProbabilityFallsBelowTheRule) {
  // After "1": 2 twice and 3 once (2/3); after "1 2": 8 once, 9 once (1/2 each, 8 the smaller).
  const Tokens text{1, 2, 8, 1, 2, 9, 1, 3, 0, 1};
  const Learned trie = learned(text, 4);
  const auto all = walk(trie, {.max_spec_factor = 10.0, .min_token_prob = 0.0}, 3);
  EXPECT_EQ(all.tokens, (Tokens{2, 8, 1}));
  EXPECT_NEAR(all.score, 2.0 / 3.0 + 1.0 / 3.0 + 1.0 / 3.0, 1e-12);
  EXPECT_EQ(walk(trie, {.max_spec_factor = 10.0, .min_token_prob = 0.5}, 3).tokens, (Tokens{2}));
  EXPECT_EQ(walk(trie, {.max_spec_factor = 10.0, .min_token_prob = 0.7}, 3).tokens, (Tokens{}));
}

// A long repeated span drafts on past the tree's depth: the walk re-anchors on shorter suffixes.
TEST(SuffixWalk, ReanchorsPastTheTreesDepth) {
  Tokens span;
  for (int64_t i = 0; i < 20; ++i) span.push_back(10 + i);
  Tokens text = span;
  text.push_back(1);
  text.insert(text.end(), span.begin(), span.begin() + 3);
  const Learned trie = learned(text, 4);
  const auto drafted = walk(trie, {.max_spec_factor = 100.0, .min_token_prob = 0.0}, 12);
  EXPECT_EQ(drafted.match, 3);
  EXPECT_EQ(drafted.tokens, Tokens(span.begin() + 3, span.begin() + 15));
}

TEST(SuffixGenerate, GreedyEqualsAutoregressive) {
  test::PrefixHashModel target(12, 5);
  const Tokens prompt{1, 2, 3, 4, 1, 2, 3, 4, 5, 1, 2};
  const auto reference = autoregressive_generate(target, prompt, {.max_new_tokens = 60});
  int64_t drafted = 0;
  for (const int64_t gamma : {1, 3, 8, 16}) {
    for (const SuffixDraftRule& rule : {SuffixDraftRule{}, SuffixDraftRule{.max_depth = 3, .max_spec_factor = 4.0,
                                                                            .min_token_prob = 0.0}}) {
      SuffixCache cache(12);
      for (int round = 0; round < 2; ++round) {  // the second round also drafts from the first's response
        const auto result = suffix_generate(cache, target, prompt,
                                            {.max_new_tokens = 60, .gamma = gamma, .rule = rule,
                                             .first_target = gamma % 2 == 0});
        EXPECT_EQ(result.tokens, reference.tokens) << gamma << " " << rule;
        drafted += result.stats.drafted;
      }
      EXPECT_EQ(cache.responses(), 2);
    }
  }
  EXPECT_GT(drafted, 0);
}

TEST(SuffixGenerate, RepeatedTextCutsTargetCallsAndTheCacheCarriesResponses) {
  test::MarkovModel target(test::pattern_chain(8));
  SuffixCache cache(8);
  const auto first = suffix_generate(cache, target, Tokens{0, 1, 2, 3}, {.max_new_tokens = 64, .gamma = 8});
  EXPECT_GT(first.stats.acceptance_rate(), 0.6);
  EXPECT_GT(first.stats.tokens_per_target_call(), 3.0);
  EXPECT_EQ(cache.responses(), 1);
  EXPECT_EQ(cache.tokens(), 64);
  // A request with only the cache to go on (a prompt of one token) drafts from the response.
  SuffixDraftSource source(cache);
  const auto second = generate_with(source, target, Tokens{5}, {.max_new_tokens = 32, .gamma = 8});
  EXPECT_EQ(second.tokens, autoregressive_generate(target, Tokens{5}, {.max_new_tokens = 32}).tokens);
  EXPECT_GT(source.drafts_from_cache(), 0);
  EXPECT_EQ(cache.responses(), 2);
}

TEST(SuffixGenerate, SessionTurnsAndBatchRowsEqualAutoregressive) {
  test::PrefixHashModel target(12, 7);
  SuffixCache cache(12);
  // A session: each turn's text feeds the same request tree; the output equals one
  // autoregressive generation per turn over the whole conversation.
  Session<test::PrefixHashModel> session(target);
  Session<test::PrefixHashModel> reference(target);
  SuffixDraftSource source(cache);
  for (const Tokens& turn : {Tokens{1, 2, 3, 1, 2}, Tokens{4, 1, 2, 3}, Tokens{1, 2, 3, 4, 1}}) {
    session.append(turn);
    reference.append(turn);
    const auto got = session.generate(source, {.max_new_tokens = 20, .gamma = 6});
    EXPECT_EQ(got.tokens, reference.generate({.max_new_tokens = 20}).tokens);
  }
  EXPECT_EQ(cache.responses(), 3);
  // A rollback and another turn: what the source learned is no longer the conversation's start,
  // so it starts its tree afresh, and stays exact.
  session.rollback(7);
  reference.rollback(7);
  session.append(Tokens{2, 3, 1, 2});
  reference.append(Tokens{2, 3, 1, 2});
  EXPECT_EQ(session.generate(source, {.max_new_tokens = 20, .gamma = 6}).tokens,
            reference.generate({.max_new_tokens = 20}).tokens);
  EXPECT_EQ(source.request_tree().text().size(), static_cast<size_t>(session.length()));
  // A batch: one source per row over the same cache.
  const std::vector<Tokens> prompts{{1, 2, 3, 1, 2}, {7, 7, 7}, {3, 4, 3, 4, 3}};
  std::vector<SuffixDraftSource> sources;
  for (size_t r = 0; r < prompts.size(); ++r) sources.emplace_back(cache);
  const auto rows = generate_with_batch(std::span<SuffixDraftSource>(sources), target,
                                        std::span<const Tokens>(prompts), {.max_new_tokens = 24, .gamma = 6});
  for (size_t r = 0; r < prompts.size(); ++r) {
    EXPECT_EQ(rows[r].tokens, autoregressive_generate(target, prompts[r], {.max_new_tokens = 24}).tokens) << r;
  }
}

TEST(SuffixGenerate, RejectsBadOptionsNamingThem) {
  test::MarkovModel target(test::pattern_chain(8));
  SuffixCache cache(8);
  const Tokens prompt{1, 2};
  const auto expect = [&](const SuffixDecodingOptions& options, const std::vector<std::string>& fragments) {
    test::expect_invalid([&] { (void)suffix_generate(cache, target, prompt, options); }, fragments);
  };
  expect({.gamma = 0}, {"gamma", "0"});
  expect({.rule = {.max_depth = 1}}, {"suffix.max_depth", "1"});
  expect({.rule = {.max_depth = 4096}}, {"suffix.max_depth", "4096"});
  expect({.rule = {.max_spec_factor = -1.0}}, {"suffix.max_spec_factor", "-1"});
  expect({.rule = {.max_spec_offset = std::numeric_limits<double>::infinity()}}, {"suffix.max_spec_offset", "inf"});
  expect({.rule = {.min_token_prob = 1.5}}, {"suffix.min_token_prob", "1.5"});
  expect({.rule = {.min_match = 0}}, {"suffix.min_match", "0"});
  test::expect_invalid([&] { (void)suffix_generate(cache, target, Tokens{9}); }, {"prompt", "9"});
  SuffixCache other(9);
  test::expect_invalid([&] { (void)suffix_generate(other, target, prompt); }, {"cache.vocab_size()", "9"});
  test::expect_invalid([] { SuffixCache bad(8, {.max_depth = 0}); }, {"cache.max_depth", "0"});
  test::expect_invalid([] { SuffixCache bad(8, {.max_responses = 0}); }, {"cache.max_responses", "0"});
  test::expect_invalid([] { SuffixCache bad(8, {.max_bytes = 1000}); }, {"cache.max_bytes", "1000"});
  test::expect_invalid([] { SuffixCache bad(0); }, {"vocab_size", "0"});
  test::PrefixHashModel no_trees(8, 3);  // not a TreeTarget
  test::expect_invalid([&] { (void)suffix_generate(cache, no_trees, prompt, {.tree = true}); }, {"tree", "TreeTarget"});
  test::expect_invalid([&] { cache.add(Tokens{1, 8}); }, {"response[1]", "8"});
  EXPECT_EQ(cache.responses(), 0);  // nothing half added
}

// Sampling: the output is the target's distribution. The biased sampler (keep the draft when a
// sample from p equals it, else sample p again: P(draft) = p(2 - p)) must fail the same test.
const at::Tensor& noisy_chain() {
  static const at::Tensor t = at::tensor({.1, .5, .2, .2, .15, .15, .5, .2, .2, .2, .1, .5, .5, .2, .2, .1},
                                         at::kDouble).view({4, 4});
  return t;
}

// The chance of each three tokens after token 0 under the chain `probs` [4, 4].
std::map<Tokens, double> three_tokens_after_zero(const at::Tensor& probs) {
  std::map<Tokens, double> expected;
  for (int64_t a = 0; a < 4; ++a) {
    for (int64_t b = 0; b < 4; ++b) {
      for (int64_t c = 0; c < 4; ++c) expected[{a, b, c}] = (probs[0][a] * probs[a][b] * probs[b][c]).item<double>();
    }
  }
  return expected;
}

Tokens biased_generate(const at::Tensor& probs, const Tokens& prompt, at::Generator& gen) {
  Tokens sequence = prompt;
  while (sequence.size() < prompt.size() + 3) {
    const auto drafted = walk(learned(sequence, 8), {.min_token_prob = 0.0}, 1);
    const at::Tensor row = probs[sequence.back()].unsqueeze(0);
    int64_t x = MultinomialProcessor{1.0}.sample(row, gen).item<int64_t>();
    if (!drafted.tokens.empty() && x != drafted.tokens[0]) x = MultinomialProcessor{1.0}.sample(row, gen).item<int64_t>();
    sequence.push_back(x);
  }
  return Tokens(sequence.begin() + static_cast<long>(prompt.size()), sequence.end());
}

test::ChiSquare fit(bool biased, int64_t samples) {
  test::MarkovModel target(noisy_chain());
  const Tokens prompt{0, 1, 2, 3, 0, 1, 2, 3, 0};
  const MultinomialProcessor processor{1.0};
  const at::Tensor probs = processor(target.logits()).to(at::kDouble);
  std::map<Tokens, int64_t> observed;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
  SuffixCache cache(4);
  for (int64_t i = 0; i < samples; ++i) {
    const Tokens tokens =
        biased ? biased_generate(probs, prompt, gen)
               : suffix_generate(cache, target, prompt,
                                 {.max_new_tokens = 3, .seed = static_cast<uint64_t>(i), .gamma = 3,
                                  .rule = {.min_token_prob = 0.0}, .first_target = false},
                                 processor)
                     .tokens;
    ++observed[tokens];
  }
  return test::chi_square(observed, three_tokens_after_zero(probs), samples);
}

TEST(SuffixDistribution, MultinomialEqualsTargetAndTheTestHasPower) {
  const auto exact = fit(false, 8000);
  EXPECT_EQ(exact.outside_support, 0);
  EXPECT_LT(exact.statistic, test::chi_square_quantile(exact.dof, 4.75));
  const auto biased = fit(true, 8000);
  EXPECT_GT(biased.statistic, test::chi_square_quantile(biased.dof, 4.75));
}

// --- Trees ----------------------------------------------------------------------------------

// A tree grows best first: its nodes are the most probable paths below the anchor, a path's
// probability the product of its tokens' shares of their contexts' followers. Against brute
// force over random texts of small vocabularies (much branching), with a trie deeper than the
// text (no depth cap) and no re-anchoring.
TEST(SuffixTree, HoldsTheMostProbablePathsBelowTheAnchorAgainstBruteForce) {
  using specdec::detail::SuffixTreeDraft;
  int64_t branched = 0;
  for (uint32_t seed = 0; seed < 40; ++seed) {
    const Tokens text = random_text(60 + seed, 2 + seed % 3, seed);
    const int64_t depth = 128;
    const Learned l = learned(text, depth);
    const BruteCounts brute({text}, depth);
    const double min_prob = seed % 2 == 0 ? 0.0 : 0.08;
    const int64_t nodes = 1 + seed % 14, max_depth = 1 + seed % 5;
    const SuffixDraftRule rule{.max_spec_factor = 100.0, .min_token_prob = min_prob};
    specdec::detail::SuffixTreeGrower grower(/*max_reanchors=*/0);
    SuffixTreeDraft tree;
    grower.grow(l.trie, l.position, rule.walk(), nodes, max_depth, tree);
    // The anchor: the text's longest suffix that was followed before.
    Tokens anchor;
    for (size_t length = text.size() - 1; length >= 1; --length) {
      const Tokens suffix(text.end() - static_cast<long>(length), text.end());
      if (brute.continued.contains(suffix)) {
        anchor = suffix;
        break;
      }
    }
    ASSERT_FALSE(anchor.empty()) << seed;
    EXPECT_EQ(tree.match, static_cast<int64_t>(anchor.size())) << seed;
    // Every path below the anchor, by brute force, with its probability.
    std::vector<double> all;
    const std::function<void(const Tokens&, double, int64_t)> expand = [&](const Tokens& context, double p, int64_t d) {
      if (d == max_depth || !brute.followers.contains(context)) return;
      for (const auto& [token, count] : brute.followers.at(context)) {
        const double q = p * static_cast<double>(count) / static_cast<double>(brute.continued.at(context));
        if (q < min_prob) continue;
        all.push_back(q);
        Tokens next = context;
        next.push_back(token);
        expand(next, q, d + 1);
      }
    };
    expand(anchor, 1.0, 0);
    std::sort(all.rbegin(), all.rend());
    // The tree's nodes: a valid layout whose paths' brute-force probabilities are the top ones.
    ASSERT_EQ(tree.size(), std::min<int64_t>(nodes, static_cast<int64_t>(all.size()))) << seed;
    std::vector<double> mine;
    std::map<int64_t, int64_t> children;
    double score = 0.0;
    for (int64_t i = 0; i < tree.size(); ++i) {
      const int64_t parent = tree.parents[static_cast<size_t>(i)];
      ASSERT_LT(parent, i);
      EXPECT_EQ(tree.ranks[static_cast<size_t>(i)], children[parent]++) << seed << " node " << i;
      Tokens path;
      for (int64_t j = i; j >= 0; j = tree.parents[static_cast<size_t>(j)]) path.insert(path.begin(), tree.tokens[static_cast<size_t>(j)]);
      EXPECT_LE(static_cast<int64_t>(path.size()), tree.depth);
      Tokens context = anchor;
      double p = 1.0;
      for (const int64_t token : path) {
        ASSERT_TRUE(brute.followers.contains(context) && brute.followers.at(context).contains(token)) << seed;
        p *= static_cast<double>(brute.followers.at(context).at(token)) / static_cast<double>(brute.continued.at(context));
        context.push_back(token);
      }
      mine.push_back(p);
      score += p;
    }
    EXPECT_LE(tree.depth, max_depth);
    std::sort(mine.rbegin(), mine.rend());
    for (size_t i = 0; i < mine.size(); ++i) EXPECT_NEAR(mine[i], all[i], 1e-12) << seed << " node " << i;
    EXPECT_NEAR(tree.score, score, 1e-9) << seed;
    branched += std::any_of(children.begin(), children.end(), [](const auto& c) { return c.second > 1; }) ? 1 : 0;
  }
  EXPECT_GT(branched, 5);  // the trees did branch
}

// A span seen twice grows on past the trie's depth (where its nodes have no children), re-anchoring
// as the chain walk does; its one branch is the chain's draft.
TEST(SuffixTree, ReanchorsPastTheTriesDepthLikeTheChain) {
  Tokens span;
  for (int64_t i = 0; i < 20; ++i) span.push_back(10 + i);
  Tokens text = span;
  text.push_back(1);
  text.insert(text.end(), span.begin(), span.end());
  text.push_back(2);
  text.insert(text.end(), span.begin(), span.begin() + 3);
  const Learned trie = learned(text, 4);
  EXPECT_EQ(walk(trie, {.max_spec_factor = 100.0, .min_token_prob = 0.0}, 12).tokens,
            Tokens(span.begin() + 3, span.begin() + 15));
  specdec::detail::SuffixTreeDraft tree;
  specdec::detail::SuffixTreeGrower().grow(trie.trie, trie.position, {.max_spec_factor = 100.0, .min_token_prob = 0.0},
                                          12, 12, tree);
  EXPECT_EQ(tree.tokens, Tokens(span.begin() + 3, span.begin() + 15));
  EXPECT_EQ(tree.depth, 12);
  specdec::detail::SuffixTreeDraft capped;
  specdec::detail::SuffixTreeGrower(0).grow(trie.trie, trie.position, {.max_spec_factor = 100.0, .min_token_prob = 0.0},
                                           12, 12, capped);
  EXPECT_LT(capped.size(), 12);  // without re-anchoring it stops at the trie's depth
}

TEST(SuffixTreeGenerate, GreedyEqualsAutoregressiveOnATransformerAndInSessions) {
  const models::LlamaConfig config = test::small_llama_config();
  models::LlamaModel<StaticKVCache> target(config, models::LlamaWeights::random(config, 33, at::kDouble));
  const Tokens prompt{1, 7, 3, 22, 5, 1, 7, 3, 9, 1, 7};
  const auto reference = autoregressive_generate(target, prompt, {.max_new_tokens = 48});
  int64_t accepted = 0;
  for (const int64_t gamma : {1, 4, 16}) {
    SuffixCache cache(config.vocab_size);
    for (int round = 0; round < 2; ++round) {  // the second round also drafts from the first's response
      const auto result = suffix_generate(cache, target, prompt,
                                          {.max_new_tokens = 48, .gamma = gamma, .rule = {.min_token_prob = 0.0},
                                           .first_target = round == 0, .tree = true});
      EXPECT_EQ(result.tokens, reference.tokens) << gamma << " round " << round;
      accepted += result.stats.accepted;
    }
  }
  EXPECT_GT(accepted, 20);
  // A session whose turns feed one tree source.
  SuffixCache cache(config.vocab_size);
  SuffixTreeSource source(cache);
  Session<models::LlamaModel<StaticKVCache>> session(target);
  Session<models::LlamaModel<StaticKVCache>> plain(target);
  for (const Tokens& turn : {Tokens{1, 7, 3}, Tokens{22, 5, 1, 7}, Tokens{3, 9, 1}}) {
    session.append(turn);
    plain.append(turn);
    EXPECT_EQ(session.generate(source, {.max_new_tokens = 16, .gamma = 8}).tokens,
              plain.generate({.max_new_tokens = 16}).tokens);
  }
  EXPECT_EQ(cache.responses(), 3);
}

// Over the whole context, with a repetitive prompt (trees are cut to the room that is left): the
// output is the target's to the last position, and every step costs one device-to-host copy.
TEST(SuffixTreeGenerate, RunsToTheContextLimitWithOneCopyAStep) {
  const models::LlamaConfig config = test::small_llama_config();
  models::LlamaModel<StaticKVCache> target(config, models::LlamaWeights::random(config, 35, at::kDouble));
  Tokens prompt;
  for (int64_t i = 0; i < 40; ++i) prompt.push_back(1 + i % 5);
  const int64_t limit = config.max_seq_len;
  const auto reference = autoregressive_generate(target, prompt, {.max_new_tokens = limit});
  for (const bool tree : {false, true}) {
    SuffixCache cache(config.vocab_size);
    cache.add(reference.tokens);  // the cache knows the answer: long drafts up to the limit
    const int64_t before = device_to_host_copies();
    const auto result = suffix_generate(cache, target, prompt,
                                        {.max_new_tokens = limit, .gamma = 16, .rule = {.max_spec_factor = 4.0},
                                         .tree = tree});
    EXPECT_EQ(device_to_host_copies() - before, result.stats.target_calls) << tree;
    EXPECT_EQ(result.tokens, reference.tokens) << tree;
    EXPECT_EQ(result.stop_reason, StopReason::sequence_limit) << tree;
    EXPECT_GT(result.stats.tokens_per_target_call(), 4.0) << tree;
  }
}

// Where the cache says a context went one way twice and another way once, and the target takes
// the rarer way, the chain drafts the common one and is cut at once; the tree holds both.
TEST(SuffixTreeGenerate, ABranchTheChainMissesIsAccepted) {
  // The target: 0 -> 1 -> 2 -> 3 -> 7 -> 8 -> 9 -> 0 (first order, greedy).
  at::Tensor rows = at::full({12, 12}, 1e-4, at::kFloat);
  const std::vector<std::pair<int64_t, int64_t>> next{{0, 1}, {1, 2}, {2, 3}, {3, 7}, {7, 8}, {8, 9}, {9, 0},
                                                      {4, 5}, {5, 6}, {6, 0}, {10, 0}, {11, 0}};
  for (const auto& [from, to] : next) rows[from][to] = 1.0;
  test::MarkovModel target(rows);
  const auto run = [&](bool tree) {
    SuffixCache cache(12);
    cache.add(Tokens{1, 2, 3, 4, 5, 6});
    cache.add(Tokens{1, 2, 3, 4, 5, 6});
    cache.add(Tokens{1, 2, 3, 7, 8, 9});
    return suffix_generate(cache, target, Tokens{11, 1, 2},
                           {.max_new_tokens = 8, .gamma = 8, .rule = {.max_spec_factor = 4.0}, .first_target = false,
                            .tree = tree});
  };
  const auto chain = run(false);
  const auto tree = run(true);
  EXPECT_EQ(tree.tokens, chain.tokens);
  EXPECT_EQ(tree.tokens, (Tokens{3, 7, 8, 9, 0, 1, 2, 3}));
  EXPECT_LT(tree.stats.target_calls, chain.stats.target_calls);
  EXPECT_GT(tree.stats.accepted, chain.stats.accepted);
}

class TempPath {
 public:
  explicit TempPath(const std::string& name)
      : path_(std::filesystem::temp_directory_path() / ("specdec_suffix_" + name + "_" + std::to_string(::getpid()))) {}
  ~TempPath() { std::filesystem::remove(path_); }
  [[nodiscard]] const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

TEST(SuffixCache, SavesAndLoadsWhatItHolds) {
  SuffixCache cache(50, {.max_depth = 6, .max_responses = 10});
  const Tokens a = random_text(200, 50, 1), b = random_text(100, 50, 2);
  cache.add(a);
  cache.add(b);
  TempPath file("round_trip");
  cache.save(file.path());
  const SuffixCache loaded = SuffixCache::load(file.path(), 50);
  EXPECT_EQ(loaded.responses(), 2);
  EXPECT_EQ(loaded.tokens(), 300);
  EXPECT_EQ(loaded.limits().max_depth, 6);
  EXPECT_EQ(loaded.limits().max_responses, 10);
  EXPECT_EQ(loaded.trie().nodes(), cache.trie().nodes());
  const Tokens context(a.begin(), a.begin() + 50);
  const SuffixDraftRule rule{.max_spec_factor = 8.0, .min_token_prob = 0.0};
  specdec::detail::SuffixWalk mine, theirs;
  specdec::detail::walk_suffixes(cache.trie(), cache.trie().position_of(context), rule.walk(), 10, mine);
  specdec::detail::walk_suffixes(loaded.trie(), loaded.trie().position_of(context), rule.walk(), 10, theirs);
  EXPECT_EQ(mine.tokens, Tokens(a.begin() + 50, a.begin() + 60));
  EXPECT_EQ(theirs.tokens, mine.tokens);
}

TEST(SuffixCache, RefusesCorruptTruncatedAndForeignFilesNamingThem) {
  SuffixCache cache(50);
  cache.add(random_text(64, 50, 3));
  TempPath file("corrupt");
  cache.save(file.path());
  std::string bytes;
  {
    std::ifstream in(file.path(), std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  const auto rewrite = [&](const std::string& content) {
    std::ofstream(file.path(), std::ios::binary | std::ios::trunc) << content;
  };
  const auto expect_format = [&](const std::string& fragment, std::optional<int64_t> vocab = {}) {
    try {
      (void)SuffixCache::load(file.path(), vocab);
      ADD_FAILURE() << "loaded: " << fragment;
    } catch (const io::FormatError& e) {
      EXPECT_NE(std::string(e.what()).find(file.path().string()), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  std::string flipped = bytes;
  flipped[40] = static_cast<char>(flipped[40] ^ 1);
  rewrite(flipped);
  expect_format("checksum");
  rewrite(bytes.substr(0, bytes.size() - 9));
  expect_format("");
  std::string foreign = bytes;
  foreign.replace(0, 8, "NOTSUFFX");
  rewrite(foreign);
  expect_format("bad magic");
  rewrite(bytes);
  expect_format("vocab_size 50, expected 32000", 32000);
  EXPECT_EQ(SuffixCache::load(file.path(), 50).tokens(), 64);
}

// A million tokens through a cache of 8 MiB: its memory stays under the bound after every add,
// the oldest responses go, and the newest still draft.
// A source made per request takes the arrays the last one left in the cache, forgets that one's
// text, and drafts as a new tree would; a source may outlive its cache.
TEST(SuffixCache, ASourceMadePerRequestTakesTheArraysTheLastOneLeft) {
  SuffixCache cache(6);
  cache.add(random_text(80, 3, 3));
  const Tokens first = random_text(400, 3, 4);
  size_t left = 0;
  {
    SuffixDraftSource a(cache);
    a.start(first, {});
    left = a.memory_bytes();
  }
  SuffixDraftSource reused(cache);
  SuffixCache same = cache;  // the spare is taken: a source of the copy starts a new tree
  SuffixDraftSource fresh(same);
  const Tokens text = random_text(200, 3, 5);
  reused.start(Tokens(text.begin(), text.begin() + 3), {});
  fresh.start(Tokens(text.begin(), text.begin() + 3), {});
  EXPECT_EQ(reused.memory_bytes(), left);
  EXPECT_LT(fresh.memory_bytes(), left);
  EXPECT_EQ(reused.request_tree().text().size(), 3u);
  for (size_t end = 3; end <= text.size(); end += 7) {
    const std::span<const int64_t> so_far(text.data(), end);
    const Tokens mine(reused.propose(so_far, 8).begin(), reused.propose(so_far, 8).end());
    const std::span<const int64_t> theirs = fresh.propose(so_far, 8);
    EXPECT_EQ(mine, Tokens(theirs.begin(), theirs.end())) << end;
  }
  auto short_lived = std::make_unique<SuffixCache>(6);
  auto source = std::make_unique<SuffixDraftSource>(*short_lived);
  source->start(first, {});
  short_lived.reset();
  source.reset();  // gives its arrays to the spare slot, not to the cache that is gone
}

TEST(SuffixCache, StaysUnderItsMemoryBoundOverAMillionTokens) {
  const int64_t bound = int64_t{8} << 20;
  SuffixCache cache(32000, {.max_depth = 8, .max_bytes = bound});
  size_t most = 0;
  Tokens last;
  for (uint32_t i = 0; i < 1000; ++i) {
    last = random_text(1000, 32000, 100 + i);
    cache.add(last);
    most = std::max(most, cache.memory_bytes());
    ASSERT_LE(cache.memory_bytes(), static_cast<size_t>(bound)) << "after response " << i;
  }
  std::cout << "suffix cache over 1,000,000 tokens, bound " << bound << " bytes: at most " << most
            << " bytes, " << cache.responses() << " responses (" << cache.tokens() << " tokens) kept, "
            << cache.evicted() << " evicted\n";
  EXPECT_GT(cache.evicted(), 0);
  const Tokens context(last.begin(), last.begin() + 20);
  specdec::detail::SuffixWalk drafted;
  specdec::detail::walk_suffixes(cache.trie(), cache.trie().position_of(context),
                        SuffixDraftRule{.max_spec_factor = 2.0, .min_token_prob = 0.0}.walk(), 8, drafted);
  EXPECT_EQ(drafted.tokens, Tokens(last.begin() + 20, last.begin() + 28));
  // The response bound, likewise.
  SuffixCache few(10, {.max_responses = 4});
  for (int64_t i = 0; i < 9; ++i) few.add(Tokens{i % 10, (i + 1) % 10});
  EXPECT_LE(few.responses(), 4);
}

}  // namespace

}  // namespace test_suffix
