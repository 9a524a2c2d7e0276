// CUDA graphs for the decoding step (cuda_graph.hpp): the static-shape forward against the usual
// one, the caches it leaves, and the static-shape step against greedy autoregressive decoding.
// The step runs eagerly on the CPU (the computation a graph records) and replayed from a graph on
// CUDA, where a GPU and a CUDA build of libtorch exist (skipped otherwise, saying why).
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "specdec/models/llama.hpp"
#include "specdec/specdec.hpp"
#include "support/llama_fixtures.hpp"

// One namespace a file: specdec_tests is compiled as a unity build (tests/CMakeLists.txt).
namespace test_cuda_graph {

namespace {

using namespace specdec;
using models::LlamaConfig;
using models::LlamaModel;
using models::LlamaWeights;

LlamaConfig config(int64_t sliding_window = 0) {
  LlamaConfig c = test::small_llama_config();
  c.sliding_window = sliding_window;
  return c;
}

at::Tensor ids_of(std::vector<int64_t> tokens, const at::Device& device = at::kCPU) {
  const auto n = static_cast<int64_t>(tokens.size());
  return at::tensor(tokens, at::TensorOptions().dtype(at::kLong)).view({1, n}).to(device);
}

at::Tensor positions(int64_t first, int64_t count, const at::Device& device = at::kCPU) {
  return at::arange(first, first + count, at::TensorOptions().dtype(at::kLong).device(device));
}

const std::vector<int64_t> kSequence{1, 7, 3, 22, 5, 9, 14, 2, 31, 8, 40, 11, 6, 19, 27, 3};

class StaticForward : public ::testing::TestWithParam<int64_t> {};  // the sliding window (0: none)

// forward_at over tokens after a prefix equals forward() over them (the same logits within
// float32 rounding), including a first token written again where it is already cached.
TEST_P(StaticForward, ForwardAtEqualsForward) {
  const LlamaConfig c = config(GetParam());
  const LlamaWeights weights = LlamaWeights::random(c, 3);
  LlamaModel<StaticKVCache> model(c, weights);
  auto usual = model.make_cache(1);
  const at::Tensor expected = model.forward(ids_of(kSequence), usual)[0];

  auto cache = model.make_cache(1);
  cache.zero_unwritten();
  (void)model.forward(ids_of({kSequence.begin(), kSequence.begin() + 10}), cache);
  ASSERT_EQ(cache.length(), 10);
  // Positions 9 .. 13: position 9 is cached already and is written again.
  const at::Tensor got = model.forward_at(ids_of({kSequence.begin() + 9, kSequence.begin() + 14}), cache, positions(9, 5))[0];
  EXPECT_EQ(cache.length(), 10) << "forward_at must leave the length to the caller";
  EXPECT_TRUE(at::allclose(got, expected.narrow(0, 9, 5), 1e-5, 1e-5))
      << (got - expected.narrow(0, 9, 5)).abs().max().item<double>();
  // Committed, the cache continues like the usual one: the next tokens' logits agree.
  cache.commit(4);
  const at::Tensor next = model.forward(ids_of({kSequence.begin() + 14, kSequence.end()}), cache)[0];
  EXPECT_TRUE(at::allclose(next, expected.narrow(0, 14, 2), 1e-5, 1e-5));
}

// Keys and values written by forward_at and then pruned equal those of recomputing the kept
// prefix from scratch.
TEST_P(StaticForward, CacheAfterPruningEqualsRecomputing) {
  const LlamaConfig c = config(GetParam());
  LlamaModel<StaticKVCache> model(c, LlamaWeights::random(c, 4));
  auto cache = model.make_cache(1);
  cache.zero_unwritten();
  (void)model.forward(ids_of({kSequence.begin(), kSequence.begin() + 6}), cache);
  (void)model.forward_at(ids_of({kSequence.begin() + 6, kSequence.begin() + 12}), cache, positions(6, 6));
  cache.commit(6);
  cache.prune(3);  // keep 9 positions
  auto fresh = model.make_cache(1);
  (void)model.forward(ids_of({kSequence.begin(), kSequence.begin() + 9}), fresh);
  ASSERT_EQ(cache.length(), fresh.length());
  for (int64_t layer = 0; layer < c.n_layers; ++layer) {
    EXPECT_TRUE(at::allclose(cache.keys(layer), fresh.keys(layer), 1e-5, 1e-5)) << "layer " << layer;
    EXPECT_TRUE(at::allclose(cache.values(layer), fresh.values(layer), 1e-5, 1e-5)) << "layer " << layer;
  }
}

INSTANTIATE_TEST_SUITE_P(Windows, StaticForward, ::testing::Values(0, 4));

TEST(StaticForward, RefusesBadPositions) {
  const LlamaConfig c = config();
  LlamaModel<StaticKVCache> model(c, LlamaWeights::random(c, 5));
  auto cache = model.make_cache(1);
  EXPECT_THROW((void)model.forward_at(ids_of({1, 2}), cache, positions(0, 3)), std::invalid_argument);
  EXPECT_THROW((void)model.forward_at(ids_of({1, 2}), cache, positions(0, 2).to(at::kInt)), std::invalid_argument);
  EXPECT_THROW((void)model.forward_at(at::ones({2, 2}, at::kLong), cache, positions(0, 2)), std::invalid_argument);
}

static_assert(StaticForwardModel<LlamaModel<StaticKVCache>>);
static_assert(!StaticForwardModel<LlamaModel<DynamicKVCache>>);

// A target and a drafter that agrees with it on most tokens (its weights perturbed).
struct Pair {
  LlamaConfig c;
  LlamaModel<StaticKVCache> target;
  LlamaModel<StaticKVCache> drafter;
  Pair(const LlamaConfig& config, const at::TensorOptions& options, uint64_t seed)
      : c(config),
        target(config, LlamaWeights::random(config, seed, options)),
        drafter(config, test::perturbed(LlamaWeights::random(config, seed, options), 0.05, seed + 1)) {}
};

SpeculativeOptions greedy_options(int64_t gamma, int64_t max_new_tokens, bool graph) {
  return {.max_new_tokens = max_new_tokens, .eos_token_ids = {}, .gamma = gamma, .cuda_graph = graph};
}

// On the CPU the static-shape step runs eagerly: its greedy output equals autoregressive decoding
// token for token, it drafts and accepts what the usual step does, and it costs one copy a step.
TEST(StaticChain, GreedyEqualsAutoregressiveDecoding) {
  Pair pair(config(), at::kFloat, 11);
  const std::vector<int64_t> prompt(kSequence.begin(), kSequence.begin() + 5);
  const auto reference = autoregressive_generate(pair.target, prompt, {.max_new_tokens = 60, .eos_token_ids = {}});
  for (const int64_t gamma : {1, 2, 3, 5, 8}) {
    SCOPED_TRACE("gamma " + std::to_string(gamma));
    const auto usual = speculative_generate(pair.drafter, pair.target, prompt, greedy_options(gamma, 60, false));
    const int64_t before = device_to_host_copies();
    const auto graphed = speculative_generate(pair.drafter, pair.target, prompt, greedy_options(gamma, 60, true));
    const int64_t copies = device_to_host_copies() - before;
    EXPECT_EQ(graphed.tokens, reference.tokens);
    EXPECT_GT(graphed.stats.graph_steps, graphed.stats.steps / 2) << "the static-shape step hardly ran";
    EXPECT_EQ(usual.stats.graph_steps, 0);
    EXPECT_EQ(graphed.stats.accepted, usual.stats.accepted);
    EXPECT_EQ(graphed.stats.drafted, usual.stats.drafted);
    EXPECT_EQ(graphed.stats.target_calls, usual.stats.target_calls);
    EXPECT_EQ(copies, graphed.stats.steps);
  }
}

// Near the context limit the steps that no longer fit run eagerly; the generation ends at the
// limit as the usual one does.
TEST(StaticChain, StepsNearTheLimitRunEagerly) {
  LlamaConfig c = config();
  c.max_seq_len = 40;
  Pair pair(c, at::kFloat, 12);
  const std::vector<int64_t> prompt(kSequence.begin(), kSequence.begin() + 5);
  const auto reference = autoregressive_generate(pair.target, prompt, {.max_new_tokens = 100, .eos_token_ids = {}});
  const auto graphed = speculative_generate(pair.drafter, pair.target, prompt, greedy_options(6, 100, true));
  EXPECT_EQ(graphed.tokens, reference.tokens);
  EXPECT_EQ(graphed.stop_reason, StopReason::sequence_limit);
  EXPECT_GT(graphed.stats.graph_steps, 0);
  EXPECT_LT(graphed.stats.graph_steps, graphed.stats.steps);
}

// A session's turns reuse both caches across the static-shape steps.
TEST(StaticChain, SessionTurnsEqualOneGeneration) {
  Pair pair(config(), at::kFloat, 13);
  const std::vector<int64_t> prompt(kSequence.begin(), kSequence.begin() + 5);
  const auto whole = autoregressive_generate(pair.target, prompt, {.max_new_tokens = 50, .eos_token_ids = {}});
  Session session(pair.target);
  ModelDraftSource drafts(pair.drafter);
  session.append(prompt);
  std::vector<int64_t> tokens = session.generate(drafts, greedy_options(4, 20, true)).tokens;
  const auto more = session.generate(drafts, greedy_options(4, 30, true));
  tokens.insert(tokens.end(), more.tokens.begin(), more.tokens.end());
  EXPECT_EQ(tokens, whole.tokens);
  EXPECT_GT(more.stats.graph_steps, 0);
}

// What the graph does not cover runs as before: sampling, and the draft-length policies.
TEST(StaticChain, SamplingAndAdaptiveGammaRunTheUsualStep) {
  Pair pair(config(), at::kFloat, 14);
  const std::vector<int64_t> prompt(kSequence.begin(), kSequence.begin() + 5);
  SpeculativeOptions sampled{.max_new_tokens = 30, .eos_token_ids = {}, .seed = 5, .gamma = 4};
  const auto usual = speculative_generate(pair.drafter, pair.target, prompt, sampled, MultinomialProcessor(1.0));
  sampled.cuda_graph = true;
  const auto graphed = speculative_generate(pair.drafter, pair.target, prompt, sampled, MultinomialProcessor(1.0));
  EXPECT_EQ(graphed.tokens, usual.tokens);
  EXPECT_EQ(graphed.stats.graph_steps, 0);
  const auto adaptive = speculative_generate(
      pair.drafter, pair.target, prompt,
      {.max_new_tokens = 30, .eos_token_ids = {}, .gamma = 4, .gamma_policy = GammaPolicy::schedule, .cuda_graph = true});
  EXPECT_EQ(adaptive.stats.graph_steps, 0);
}

// ---- CUDA ----------------------------------------------------------------------------------

// Replayed from a graph, greedy output equals the eager steps' and autoregressive decoding's,
// with one copy per step, in float32 and bfloat16.
TEST(CudaGraph, ReplayedStepsEqualEagerSteps) {
  if (!built_with_cuda()) GTEST_SKIP() << "libtorch " << torch_version() << " was built without CUDA";
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device on this machine";
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(std::string(c10::toString(dtype)));
    Pair pair(config(), at::TensorOptions(dtype).device(at::kCUDA), 21);
    const std::vector<int64_t> prompt(kSequence.begin(), kSequence.begin() + 5);
    const auto reference = autoregressive_generate(pair.target, prompt, {.max_new_tokens = 60, .eos_token_ids = {}});
    for (const int64_t gamma : {1, 4, 7}) {
      SCOPED_TRACE("gamma " + std::to_string(gamma));
      const auto eager = speculative_generate(pair.drafter, pair.target, prompt, greedy_options(gamma, 60, false));
      const int64_t before = device_to_host_copies();
      const auto graphed = speculative_generate(pair.drafter, pair.target, prompt, greedy_options(gamma, 60, true));
      EXPECT_EQ(device_to_host_copies() - before, graphed.stats.steps);
      EXPECT_EQ(graphed.tokens, eager.tokens);
      if (dtype == at::kFloat) {
        EXPECT_EQ(graphed.tokens, reference.tokens);
      }
      EXPECT_GT(graphed.stats.graph_steps, 0);
    }
  }
}

}  // namespace

}  // namespace test_cuda_graph
