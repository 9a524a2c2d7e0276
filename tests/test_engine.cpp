// Continuous batching (engine.hpp) and per-row sampling (row_processor.hpp): greedy requests that
// join at every step offset, leave at different steps, are cancelled or reach the context limit
// each equal their own autoregressive output, with drafter, prompt-lookup and target-only rows
// mixed in one batch; one host copy per step; sampled rows with different parameters in one batch
// each follow their own distribution (chi-square, with the power check that a row judged by its
// neighbour's parameters fails); the pool's admission; bad input that touches no other request;
// RowProcessor against the single-policy processors; caches that rows join and leave.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <vector>

#include "specdec/engine.hpp"
#include "specdec/io/eagle.hpp"
#include "specdec/io/checkpoint.hpp"
#include "specdec/io/medusa.hpp"
#include "specdec/generate.hpp"
#include "specdec/models/llama.hpp"
#include "support/exact_continuations.hpp"
#include "support/expect_invalid.hpp"
#include "support/head_fixtures.hpp"
#include "support/host_copies.hpp"
#include "support/llama_fixtures.hpp"
#include "support/markov_fixtures.hpp"
#include "support/statistics.hpp"
#include "support/toy_models.hpp"

// One namespace a file: specdec_tests is compiled as a unity build (tests/CMakeLists.txt).
namespace test_engine {

namespace {

using namespace specdec;

// Request i: a prompt of (5 i) % 11 + 1 tokens, a budget of 6 + (7 i) % 17 tokens, and one of
// the draft methods with gamma 1..5.
Request request_number(int64_t i, int64_t vocab) {
  Request request;
  for (int64_t t = 0; t < (5 * i) % 11 + 1; ++t) request.prompt.push_back((3 * i + 7 * t + 1) % vocab);
  request.max_new_tokens = 6 + (7 * i) % 17;
  const DraftMethod methods[] = {DraftMethod::drafter, DraftMethod::prompt_lookup, DraftMethod::none};
  request.drafting = methods[i % 3];
  request.gamma = 1 + i % 5;
  return request;
}

// Gathers a step's events: each request's streamed tokens, and its result once it ends (whose
// tokens must be what its events streamed).
void collect(std::vector<EngineEvent> events, std::map<RequestId, std::vector<int64_t>>& streamed,
             std::map<RequestId, GenerationResult>& results) {
  for (EngineEvent& event : events) {
    auto& tokens = streamed[event.id];
    tokens.insert(tokens.end(), event.tokens.begin(), event.tokens.end());
    if (event.result) {
      EXPECT_EQ(tokens, event.result->tokens) << "request " << event.id;
      results.emplace(event.id, std::move(*event.result));
    }
  }
}

// Runs the engine until it is idle. Returns the results by id.
template <class E>
std::map<RequestId, GenerationResult> drain(E& engine, std::map<RequestId, std::vector<int64_t>>& streamed) {
  std::map<RequestId, GenerationResult> results;
  while (!engine.idle()) collect(engine.step(), streamed, results);
  return results;
}

template <class Cache>
void joining_requests_equal_their_own_output(bool adaptive);

template <class Cache>
class EngineLlama : public ::testing::Test {};
using CacheTypes = ::testing::Types<StaticKVCache, DynamicKVCache>;
TYPED_TEST_SUITE(EngineLlama, CacheTypes);

// Requests join at every step offset (one more before each of the first steps, then in bursts),
// with every draft method in the same batch, end tokens and stop sequences on some: each equals
// its own autoregressive output, token for token and in its stop reason.
// With each request's own gamma every step, and with the adaptive draft length (which only
// chooses how much is drafted).
TYPED_TEST(EngineLlama, GreedyRequestsJoiningAtEveryStepEqualTheirOwnOutput) {
  for (const bool adaptive : {false, true}) joining_requests_equal_their_own_output<TypeParam>(adaptive);
}

template <class Cache>
void joining_requests_equal_their_own_output(bool adaptive) {
  SCOPED_TRACE(adaptive ? "adaptive draft length" : "each request's gamma");
  const models::LlamaConfig config = test::small_llama_config();
  const auto weights = models::LlamaWeights::random(config, 21, at::kDouble);
  models::LlamaModel<Cache> target(config, weights);
  models::LlamaModel<Cache> drafter(config, test::perturbed(weights, 0.04, 4));
  Engine engine(drafter, target, {.max_rows = 4, .adaptive_draft_length = adaptive});
  std::map<RequestId, Request> requests;
  std::map<RequestId, std::vector<int64_t>> streamed;
  std::map<RequestId, GenerationResult> results;
  int64_t added = 0;
  for (int64_t step = 0; added < 14 || !engine.idle(); ++step) {
    // Joins: one before each of the first 8 steps, then three at once every fourth step.
    const int64_t joining = step < 8 ? 1 : (step % 4 == 0 ? 3 : 0);
    for (int64_t j = 0; j < joining && added < 14; ++j, ++added) {
      Request request = request_number(added, config.vocab_size);
      if (added % 4 == 1) {  // an end token from its own reference output
        const auto reference = autoregressive_generate(target, request.prompt, {.max_new_tokens = request.max_new_tokens});
        request.eos_token_ids = {reference.tokens[reference.tokens.size() / 2]};
      }
      if (added % 4 == 2) {
        const auto reference = autoregressive_generate(target, request.prompt, {.max_new_tokens = request.max_new_tokens});
        request.stop_sequences = {{reference.tokens[3], reference.tokens[4]}};
      }
      const auto id = engine.add(request);
      ASSERT_TRUE(id.has_value());
      requests.emplace(*id, std::move(request));
    }
    EXPECT_LE(engine.generating(), 4);
    collect(engine.step(), streamed, results);
  }
  ASSERT_EQ(results.size(), 14u);
  int64_t accepted = 0;
  for (const auto& [id, request] : requests) {
    const auto reference = autoregressive_generate(
        target, request.prompt,
        {.max_new_tokens = request.max_new_tokens, .eos_token_ids = request.eos_token_ids,
         .stop_sequences = request.stop_sequences});
    const GenerationResult& result = results.at(id);
    EXPECT_EQ(result.tokens, reference.tokens) << "request " << id << " (" << request.drafting << ")";
    EXPECT_EQ(result.stop_reason, reference.stop_reason) << "request " << id;
    if (request.drafting == DraftMethod::none) {
      EXPECT_EQ(result.stats.drafted, 0) << "request " << id;
    }
    accepted += result.stats.accepted;
  }
  if (!adaptive) {
    EXPECT_GT(accepted, 0);  // drafts were verified and some accepted
  }
}

// Cancelled requests, waiting or generating, leave at once; every other request still equals its
// own output, and a cancelled one's tokens are a prefix of its own.
TEST(EngineGreedy, CancelledRequestsLeaveAndTheOthersAreUnchanged) {
  const models::LlamaConfig config = test::small_llama_config();
  const auto weights = models::LlamaWeights::random(config, 21, at::kDouble);
  models::LlamaModel<StaticKVCache> target(config, weights);
  models::LlamaModel<StaticKVCache> drafter(config, test::perturbed(weights, 0.04, 4));
  Engine engine(drafter, target, {.max_rows = 3});
  std::map<RequestId, Request> requests;
  for (int64_t i = 0; i < 6; ++i) {
    Request request = request_number(i, config.vocab_size);
    request.max_new_tokens = 20;
    const auto id = engine.add(request);
    requests.emplace(*id, std::move(request));
  }
  EXPECT_EQ(engine.state(5), RequestState::waiting);
  const GenerationResult waiting = engine.cancel(5);  // never generated
  EXPECT_TRUE(waiting.tokens.empty());
  EXPECT_EQ(waiting.stop_reason, StopReason::cancelled);
  std::map<RequestId, std::vector<int64_t>> streamed;
  std::map<RequestId, GenerationResult> results;
  for (int step = 0; step < 3; ++step) collect(engine.step(), streamed, results);
  EXPECT_EQ(engine.state(1), RequestState::generating);
  const GenerationResult middle = engine.cancel(1);  // the middle row of three
  EXPECT_EQ(middle.stop_reason, StopReason::cancelled);
  EXPECT_EQ(middle.tokens, streamed[1]);
  EXPECT_FALSE(middle.tokens.empty());
  results.merge(drain(engine, streamed));
  for (const auto& [id, request] : requests) {
    const auto reference = autoregressive_generate(target, request.prompt, {.max_new_tokens = 20}).tokens;
    if (id == 1) {
      EXPECT_EQ(std::vector<int64_t>(reference.begin(), reference.begin() + static_cast<std::ptrdiff_t>(middle.tokens.size())),
                middle.tokens);
    } else if (id != 5) {
      EXPECT_EQ(results.at(id).tokens, reference) << "request " << id;
    }
  }
  test::expect_invalid([&] { static_cast<void>(engine.cancel(1)); }, {"cancel", "id 1"});   // ended
  test::expect_invalid([&] { static_cast<void>(engine.cancel(77)); }, {"cancel", "id 77"}); // unknown
}

// Requests near the target's limit (and past the drafter's) stop there as they would alone; a
// prompt at the limit ends before a step.
TEST(EngineGreedy, RequestsAtTheContextLimitStopAsTheyWouldAlone) {
  models::LlamaConfig config = test::small_llama_config();
  config.max_seq_len = 20;
  const auto weights = models::LlamaWeights::random(config, 21, at::kDouble);
  models::LlamaModel<StaticKVCache> target(config, weights);
  models::LlamaConfig drafter_config = config;
  drafter_config.max_seq_len = 14;
  models::LlamaModel<StaticKVCache> drafter(drafter_config, test::perturbed(weights, 0.04, 4));
  Engine engine(drafter, target, {.max_rows = 4});
  std::map<RequestId, Request> requests;
  for (const int64_t length : {19, 17, 12, 3, 20, 8}) {
    Request request{.prompt = std::vector<int64_t>(static_cast<size_t>(length), 0), .max_new_tokens = 30, .gamma = 4};
    for (int64_t t = 0; t < length; ++t) request.prompt[static_cast<size_t>(t)] = (5 * t + length) % config.vocab_size;
    const auto id = engine.add(request);
    requests.emplace(*id, std::move(request));
  }
  std::map<RequestId, std::vector<int64_t>> streamed;
  const auto results = drain(engine, streamed);
  ASSERT_EQ(results.size(), requests.size());
  for (const auto& [id, request] : requests) {
    const auto reference = autoregressive_generate(target, request.prompt, {.max_new_tokens = 30});
    EXPECT_EQ(results.at(id).tokens, reference.tokens) << "request " << id;
    EXPECT_EQ(results.at(id).stop_reason, StopReason::sequence_limit) << "request " << id;
  }
}

// A step costs one device-to-host copy whatever the mix of draft methods, and the pool admits at
// most max_rows requests at once, queues max_waiting more and refuses the rest.
TEST(EngineGreedy, OneHostCopyPerStepAndThePoolAdmitsInOrder) {
  const models::LlamaConfig config = test::small_llama_config();
  const auto weights = models::LlamaWeights::random(config, 21, at::kDouble);
  models::LlamaModel<StaticKVCache> target(config, weights);
  models::LlamaModel<StaticKVCache> drafter(config, test::perturbed(weights, 0.04, 4));
  Engine engine(drafter, target, {.max_rows = 2, .max_waiting = 3, .adaptive_draft_length = false});
  std::vector<RequestId> ids;
  for (int64_t i = 0; i < 5; ++i) ids.push_back(*engine.add(request_number(i, config.vocab_size)));
  EXPECT_FALSE(engine.add(request_number(5, config.vocab_size)).has_value());  // 2 + 3 are in
  EXPECT_EQ(engine.waiting(), 5);
  int64_t steps = 0;
  std::vector<RequestId> order;
  while (!engine.idle()) {
    std::vector<EngineEvent> events;
    EXPECT_EQ(test::copies_during([&] { events = engine.step(); }), 1) << "step " << steps;
    EXPECT_LE(engine.generating(), 2);
    for (const EngineEvent& event : events) {
      if (std::find(order.begin(), order.end(), event.id) == order.end()) order.push_back(event.id);
    }
    ++steps;
  }
  EXPECT_EQ(order, ids);  // first come, first served
  EXPECT_GT(steps, 0);
}

// Bad input is refused naming the field, and a running request goes on as if nothing happened.
TEST(EngineErrors, BadRequestsAreRefusedAndTouchNoOtherRequest) {
  const models::LlamaConfig config = test::small_llama_config();
  const auto weights = models::LlamaWeights::random(config, 21, at::kDouble);
  models::LlamaModel<StaticKVCache> target(config, weights);
  models::LlamaModel<StaticKVCache> drafter(config, test::perturbed(weights, 0.04, 4));
  Engine engine(drafter, target, {.max_rows = 2});
  const Request good = request_number(3, config.vocab_size);
  const RequestId id = *engine.add(good);
  std::map<RequestId, std::vector<int64_t>> streamed;
  for (EngineEvent& event : engine.step()) streamed[event.id] = event.tokens;
  const auto bad = [&](auto edit, const std::vector<std::string>& fragments) {
    Request request = good;
    edit(request);
    test::expect_invalid([&] { static_cast<void>(engine.add(request)); }, fragments);
  };
  bad([](Request& r) { r.prompt.clear(); }, {"prompt must not be empty"});
  bad([&](Request& r) { r.prompt[0] = config.vocab_size; }, {"prompt", "48"});
  bad([&](Request& r) { r.prompt.assign(static_cast<size_t>(config.max_seq_len + 1), 1); }, {"prompt length 129", "128"});
  bad([](Request& r) { r.max_new_tokens = -1; }, {"max_new_tokens", "-1"});
  bad([](Request& r) { r.sampling.top_p = 1.5; }, {"top_p", "(0, 1]", "1.5"});
  bad([](Request& r) { r.sampling.temperature = -0.5; }, {"temperature", "-0.5"});
  bad([](Request& r) { r.sampling.min_p = 2; }, {"min_p", "2"});
  bad([](Request& r) { r.sampling.top_k = -3; }, {"top_k", "-3"});
  bad([](Request& r) { r.gamma = -1; }, {"gamma", "-1"});
  bad([](Request& r) { r.stop_sequences = {{}}; }, {"stop_sequences[0]"});
  EXPECT_EQ(engine.generating() + engine.waiting(), 1);
  const auto results = drain(engine, streamed);
  EXPECT_EQ(results.at(id).tokens, autoregressive_generate(target, good.prompt, {.max_new_tokens = good.max_new_tokens}).tokens);

  Engine alone(target, {.max_rows = 1});  // no drafter model
  test::expect_invalid([&] { static_cast<void>(alone.add(good)); }, {"drafting", "no drafter"});
  test::expect_invalid([&] { Engine none(target, {.max_rows = 0}); }, {"max_rows", "0"});
  test::expect_invalid([&] { Engine none(target, {.max_waiting = -2}); }, {"max_waiting", "-2"});
  models::LlamaConfig other = config;
  other.vocab_size = 40;
  models::LlamaModel<StaticKVCache> small(other, models::LlamaWeights::random(other, 3, at::kDouble));
  test::expect_invalid([&] { Engine mismatched(small, target, {}); }, {"vocab_size", "48", "40"});
}

// An engine without a drafter: prompt lookup and target-only rows, and a request of no tokens.
TEST(EngineGreedy, WithoutADrafterModel) {
  test::PrefixHashModel target(40, 1);
  Engine engine(target, {.max_rows = 3});
  std::map<RequestId, Request> requests;
  for (int64_t i = 0; i < 7; ++i) {
    Request request = request_number(i, 40);
    request.drafting = i % 2 == 0 ? DraftMethod::prompt_lookup : DraftMethod::none;
    if (i == 4) request.max_new_tokens = 0;
    requests.emplace(*engine.add(request), std::move(request));
  }
  std::map<RequestId, std::vector<int64_t>> streamed;
  const auto results = drain(engine, streamed);
  ASSERT_EQ(results.size(), requests.size());
  for (const auto& [id, request] : requests) {
    EXPECT_EQ(results.at(id).tokens,
              autoregressive_generate(target, request.prompt, {.max_new_tokens = request.max_new_tokens}).tokens)
        << "request " << id;
  }
}

// Prompt-lookup rows draft what prompt lookup drafts for the sequence alone: each request's drafts
// and acceptances equal ngram_assisted_generate's with PromptLookupDrafter, in a batch of three.
TEST(EngineGreedy, PromptLookupRowsDraftAsTheyWouldAlone) {
  test::PrefixHashModel target(12, 1);  // a small vocabulary: the output repeats, lookup finds it
  Engine engine(target, {.max_rows = 3, .adaptive_draft_length = false});
  std::map<RequestId, Request> requests;
  for (int64_t i = 0; i < 3; ++i) {
    Request request = request_number(i, 12);
    request.max_new_tokens = 40;
    request.drafting = DraftMethod::prompt_lookup;
    request.gamma = 3;
    requests.emplace(*engine.add(request), std::move(request));
  }
  std::map<RequestId, std::vector<int64_t>> streamed;
  const auto results = drain(engine, streamed);
  int64_t accepted = 0;
  for (const auto& [id, request] : requests) {
    PromptLookupDrafter lookup;
    const auto alone = ngram_assisted_generate(
        lookup, target, request.prompt,
        {.max_new_tokens = 40, .gamma = 3, .filler_top_k = 1, .stop_if_unknown = true});
    EXPECT_EQ(results.at(id).tokens, alone.tokens) << "request " << id;
    EXPECT_EQ(results.at(id).stats.drafted, alone.stats.drafted) << "request " << id;
    EXPECT_EQ(results.at(id).stats.accepted, alone.stats.accepted) << "request " << id;
    accepted += alone.stats.accepted;
  }
  EXPECT_GT(accepted, 0);
}

// The distribution of `count` tokens after `last` under `processor` on the Markov target.
template <LogitsProcessor P>
std::map<std::vector<int64_t>, double> markov_sequences(const P& processor, int64_t last, int64_t count) {
  return test::sequence_probabilities(processor(test::markov_target_rows().log().to(at::kFloat)), last, count);
}

bool fits(const std::map<std::vector<int64_t>, int64_t>& observed, const std::map<std::vector<int64_t>, double>& expected,
          int64_t samples) {
  const test::ChiSquare fit = test::chi_square(observed, expected, samples);
  return fit.outside_support == 0 && fit.statistic < test::chi_square_quantile(fit.dof, 4.75);
}

// Two sampled requests with different parameters share every step (drafted by the Markov drafter,
// whose q differs from the target's p): each row's three tokens follow its own parameters'
// distribution, and each fails its neighbour's (the test can tell the rows' parameters apart).
// `seeded` rows draw from seeds of their own (sample i: seeds 2 i and 2 i + 1), the others from
// the engine's generator.
void sampled_rows_follow_their_own_distribution(bool first_seeded, bool second_seeded) {
  SCOPED_TRACE(::testing::Message() << "seeds: " << first_seeded << ", " << second_seeded);
  test::MarkovModel target(test::markov_target_rows());
  test::MarkovModel drafter(test::markov_drafter_rows());
  const std::vector<int64_t> prompts[] = {{0}, {2, 1}};
  constexpr int64_t kSamples = 3000;
  std::map<std::vector<int64_t>, int64_t> observed[2];
  for (int64_t i = 0; i < kSamples; ++i) {
    SamplingParams plain{.temperature = 1.0};
    SamplingParams filtered{.temperature = 0.7, .top_k = 3, .top_p = 0.9};
    if (first_seeded) plain.seed = static_cast<uint64_t>(2 * i);
    if (second_seeded) filtered.seed = static_cast<uint64_t>(2 * i + 1);
    Engine engine(drafter, target, {.max_rows = 2, .seed = static_cast<uint64_t>(i)});
    const RequestId a = *engine.add({.prompt = prompts[0], .max_new_tokens = 3, .sampling = plain, .gamma = 2});
    const RequestId b = *engine.add({.prompt = prompts[1], .max_new_tokens = 3, .sampling = filtered, .gamma = 2});
    std::map<RequestId, std::vector<int64_t>> streamed;
    auto results = drain(engine, streamed);
    ++observed[0][results.at(a).tokens];
    ++observed[1][results.at(b).tokens];
  }
  const auto plain_expected = [&](int64_t last) { return markov_sequences(MultinomialProcessor(1.0), last, 3); };
  const auto filtered_expected = [&](int64_t last) { return markov_sequences(TopKNucleusProcessor(3, 0.9, 0.7), last, 3); };
  EXPECT_TRUE(fits(observed[0], plain_expected(0), kSamples));
  EXPECT_TRUE(fits(observed[1], filtered_expected(1), kSamples));
  // Power: each row judged by its neighbour's parameters fails.
  EXPECT_FALSE(fits(observed[0], filtered_expected(0), kSamples));
  EXPECT_FALSE(fits(observed[1], plain_expected(1), kSamples));
}

TEST(EngineSampling, RowsWithDifferentParametersEachFollowTheirOwnDistribution) {
  sampled_rows_follow_their_own_distribution(false, false);
}

// Seeded rows, beside a row without a seed and beside another seeded row.
TEST(EngineSampling, SeededRowsFollowTheirOwnDistribution) {
  sampled_rows_follow_their_own_distribution(true, false);
  sampled_rows_follow_their_own_distribution(true, true);
}

// A seeded request's tokens depend on its seed, prompt, parameters and drafts only: alone, or
// beside sampled requests that join, leave and are cancelled around it, with drafts from the
// drafter, from prompt lookup or none (each request's own gamma every step), it emits the same
// tokens; another seed emits others.
TEST(EngineSampling, ASeededRequestIgnoresTheRequestsAroundIt) {
  const models::LlamaConfig config = test::small_llama_config();
  const auto weights = models::LlamaWeights::random(config, 21, at::kDouble);
  models::LlamaModel<StaticKVCache> target(config, weights);
  models::LlamaModel<StaticKVCache> drafter(config, test::perturbed(weights, 0.04, 4));
  for (const DraftMethod method : {DraftMethod::drafter, DraftMethod::prompt_lookup, DraftMethod::none}) {
    SCOPED_TRACE(::testing::Message() << method);
    const auto seeded = [&](uint64_t seed) {
      return Request{.prompt = {1, 5, 9, 5, 9, 2}, .max_new_tokens = 24,
                     .sampling = {.temperature = 1.0, .top_k = 12, .seed = seed}, .drafting = method, .gamma = 3};
    };
    const auto alone = [&](uint64_t seed) {
      Engine engine(drafter, target, {.max_rows = 4, .seed = 1, .adaptive_draft_length = false});
      const RequestId id = *engine.add(seeded(seed));
      std::map<RequestId, std::vector<int64_t>> streamed;
      return drain(engine, streamed).at(id).tokens;
    };
    Engine engine(drafter, target, {.max_rows = 4, .seed = 2, .adaptive_draft_length = false});
    const auto neighbour = [&](int64_t i) {
      Request request = request_number(i, config.vocab_size);
      request.sampling = {.temperature = 0.9, .top_p = 0.9};
      return *engine.add(request);
    };
    std::map<RequestId, std::vector<int64_t>> streamed;
    std::map<RequestId, GenerationResult> results;
    neighbour(0);
    const RequestId cancelled = neighbour(1);
    collect(engine.step(), streamed, results);
    const RequestId id = *engine.add(seeded(99));
    for (int64_t i = 2; i < 6; ++i) {
      neighbour(i);
      collect(engine.step(), streamed, results);
      if (i == 3 && !results.contains(cancelled)) static_cast<void>(engine.cancel(cancelled));
    }
    while (!engine.idle()) collect(engine.step(), streamed, results);
    const std::vector<int64_t> first = alone(99);
    EXPECT_EQ(results.at(id).tokens, first);
    EXPECT_EQ(alone(99), first);
    EXPECT_NE(alone(100), first);
  }
}

// The draft-length rule on costs it is told: a forward whose cost is fixed and free drafts draft
// the most; a forward whose cost is its positions drafts nothing; expensive drafts pay only with
// high acceptance; a row's cap and a row that drafts nothing are respected.
TEST(EngineDraftLength, TheCostModelChoosesWhatPays) {
  const auto model = [](double fixed, double per_position, double per_column) {
    specdec::detail::DraftCostModel costs;
    for (const int64_t positions : {4, 8, 12, 16, 24}) {
      costs.observe_target(positions, fixed + per_position * static_cast<double>(positions));
      costs.observe_drafting(2, 0, 2 * per_column);
    }
    return costs;
  };
  const std::vector<double> sure{0.9, 0.9}, unsure{0.2, 0.2};
  const std::vector<int64_t> caps{6, 6};
  const specdec::detail::DraftCostModel memory_bound = model(1.0, 0.001, 0.01);
  EXPECT_NEAR(memory_bound.fixed_seconds(), 1.0, 1e-9);
  EXPECT_NEAR(memory_bound.seconds_per_position(), 0.001, 1e-9);
  EXPECT_NEAR(memory_bound.seconds_per_column(), 0.01, 1e-9);
  EXPECT_EQ(memory_bound.choose(sure, caps, 2), 6);
  EXPECT_EQ(memory_bound.choose(sure, std::vector<int64_t>{3, 2}, 2), 3);
  EXPECT_EQ(model(0.0, 0.1, 0.0).choose(sure, caps, 2), 0);         // cost grows with every position
  EXPECT_EQ(model(1.0, 0.0, 1.0).choose(unsure, caps, 2), 0);       // drafts cost a forward each
  EXPECT_GT(model(1.0, 0.0, 0.05).choose(unsure, caps, 2), 0);      // cheap drafts pay a little
  EXPECT_EQ(model(1.0, 0.0, 0.0).choose(sure, std::vector<int64_t>{0, 0}, 2), 0);
  EXPECT_EQ(specdec::detail::DraftCostModel{}.choose(unsure, caps, 2), 6);  // nothing measured: draft, to measure
  // The rest of a step counts as the forwards do: a step overhead the size of the forward
  // makes drafts that cost a third of it pay.
  specdec::detail::DraftCostModel overhead = model(1.0, 0.0, 0.35);
  EXPECT_EQ(overhead.choose(std::vector<double>{0.3, 0.3}, caps, 2), 0);
  for (int i = 0; i < 20; ++i) overhead.observe_overhead(i % 2 == 0, 1.0);
  EXPECT_NEAR(overhead.overhead_seconds(true), 1.0, 1e-9);
  EXPECT_GT(overhead.choose(std::vector<double>{0.3, 0.3}, caps, 2), 0);
}

// The drafting's cost is split between its columns and its positions: a first draft that feeds
// the drafter a whole prompt (or the tokens of target-only steps) charges those positions, not
// the columns, so one more column is priced at what it costs.
TEST(EngineDraftLength, CatchUpPositionsDoNotInflateTheCostOfAColumn) {
  specdec::detail::DraftCostModel costs;
  const double per_column = 0.002, per_position = 0.0001;
  for (int step = 0; step < 40; ++step) {
    const int64_t columns = 1 + step % 4;
    const int64_t positions = 2 * (columns + 1) + (step % 5 == 0 ? 60 : 0);  // 2 rows, a prompt now and then
    costs.observe_drafting(columns, positions, per_column * static_cast<double>(columns) +
                                                   per_position * static_cast<double>(positions));
  }
  EXPECT_NEAR(costs.seconds_per_column(), per_column, 1e-9);
  EXPECT_NEAR(costs.seconds_per_drafter_position(), per_position, 1e-9);
  // Host drafting (no positions): all in the column.
  specdec::detail::DraftCostModel host;
  for (int step = 0; step < 5; ++step) host.observe_drafting(3, 0, 0.003);
  EXPECT_NEAR(host.seconds_per_column(), 0.001, 1e-12);
  EXPECT_DOUBLE_EQ(host.seconds_per_drafter_position(), 0.0);
}

// While k stays 0, a one-column step is drafted once what it is predicted to cost beyond a
// target-only step, the drafters' catch-up included, is at most kExploreShare of the target-only
// time since the last draft: a catch-up of c positions waits in proportion to one column plus c.
// Explorations after which drafting still does not pay halve the share.
TEST(EngineDraftLength, ExploringCostsAtMostItsShareOfTheTargetOnlyTime) {
  specdec::detail::DraftCostModel costs;
  const double fixed = 1e-3, per_position = 1e-5, per_column = 2e-4, per_drafter_position = 1e-5;
  for (int step = 0; step < 40; ++step) {
    const int64_t positions = 4 * (1 + step % 3);
    costs.observe_target(positions, fixed + per_position * static_cast<double>(positions));
    const int64_t columns = 1 + step % 4;
    const int64_t drafter_positions = 4 * (columns + 1) + (step % 5 == 0 ? 200 : 0);
    costs.observe_drafting(columns, drafter_positions,
                           per_column * static_cast<double>(columns) +
                               per_drafter_position * static_cast<double>(drafter_positions));
    costs.observe_overhead(step % 2 == 0, 1e-4);
  }
  const double share = specdec::detail::DraftCostModel::kExploreShare;
  EXPECT_DOUBLE_EQ(costs.explore_share(), share);
  // Beyond a target-only step of 4 rows, all drafting with the drafter: 4 more target positions,
  // one column, 8 drafter positions, then the catch-up.
  const auto extra = [&](int64_t catch_up) {
    return 4 * per_position + per_column + per_drafter_position * static_cast<double>(8 + catch_up);
  };
  for (const int64_t catch_up : {int64_t{0}, int64_t{100}, int64_t{1000}}) {
    SCOPED_TRACE(catch_up);
    const double needed = extra(catch_up) / share;
    specdec::detail::DraftCostModel probe = costs;
    EXPECT_FALSE(probe.explore(0.98 * needed, 4, 4, catch_up));
    EXPECT_TRUE(probe.explore(1.02 * needed, 4, 4, catch_up));
  }
  // Host drafting (no drafter rows): the catch-up costs nothing.
  specdec::detail::DraftCostModel host = costs;
  EXPECT_TRUE(host.explore(1.02 * (4 * per_position + per_column) / share, 4, 0, 0));
  // Each exploration halves the next one's share, down to kExploreShare / 2^kExploreBackoff, until
  // a step drafts by choice.
  const int64_t backoff = specdec::detail::DraftCostModel::kExploreBackoff;
  for (int64_t futile = 0; futile <= backoff + 2; ++futile) {
    SCOPED_TRACE(futile);
    const double halved = share / static_cast<double>(int64_t{1} << std::min(futile, backoff));
    EXPECT_DOUBLE_EQ(costs.explore_share(), halved);
    const double needed = extra(100) / halved;
    EXPECT_FALSE(costs.explore(0.98 * needed, 4, 4, 100));
    costs.chose(0);  // target-only steps change nothing
    EXPECT_TRUE(costs.explore(1.02 * needed, 4, 4, 100));
  }
  costs.chose(2);
  EXPECT_DOUBLE_EQ(costs.explore_share(), share);
  EXPECT_TRUE(costs.explore(1.02 * extra(100) / share, 4, 4, 100));
}

// Stalls only ever add time: the first call's setup and a preempted step. The first observation
// of each kind is dropped and later ones count at most kOutlier times the fit's prediction, so a
// stall does not inflate the fixed cost until drafting looks cheap beside it: a drafter whose
// drafts are rarely accepted stays off.
TEST(EngineDraftLength, AStallDoesNotMakeDraftingLookCheap) {
  const double fixed = 1e-3, per_position = 1e-5, per_column = 5e-4;
  specdec::detail::DraftCostModel costs;
  costs.observe_target(2, 50 * fixed);  // the first forward's setup: dropped
  costs.observe_drafting(1, 4, 50 * per_column);
  costs.observe_overhead(false, 1.0);
  costs.observe_overhead(true, 1.0);
  for (int step = 0; step < 10; ++step) {
    const int64_t positions = 2 * (1 + step % 2);
    costs.observe_target(positions, fixed + per_position * static_cast<double>(positions));
    costs.observe_drafting(1 + step % 2, 4, per_column * (1 + step % 2));
    costs.observe_overhead(step % 2 == 0, 1e-5);
  }
  EXPECT_NEAR(costs.fixed_seconds(), fixed, 1e-9);
  EXPECT_NEAR(costs.overhead_seconds(false), 1e-5, 1e-12);
  const std::vector<double> useless{0.1, 0.1};
  const std::vector<int64_t> caps{4, 4};
  EXPECT_EQ(costs.choose(useless, caps, 2), 0);
  costs.observe_target(2, 100 * fixed);  // preempted
  EXPECT_LT(costs.fixed_seconds(), 1.5 * fixed);  // unbounded: about 12 times
  EXPECT_EQ(costs.choose(useless, caps, 2), 0);
  // A lasting change is followed: the forward became five times dearer (beyond kOutlier).
  for (int step = 0; step < 200; ++step) {
    const int64_t positions = 2 * (1 + step % 2);
    costs.observe_target(positions, 5 * (fixed + per_position * static_cast<double>(positions)));
  }
  EXPECT_NEAR(costs.fixed_seconds(), 5 * fixed, 0.05 * fixed);
}

// The drafter's catch-up, what the exploration rule prices: the positions its next first forward
// computes beyond two a row, every member padded to the widest uncached input; rows that do not
// draft with it cost nothing.
TEST(EngineDraftLength, CatchUpPositionsAreTheMembersPaddedToTheWidestBacklog) {
  const models::LlamaConfig config = test::small_llama_config();
  models::LlamaModel<StaticKVCache> drafter(config, models::LlamaWeights::random(config, 5, at::kDouble));
  specdec::detail::ModelBatchDrafts<models::LlamaModel<StaticKVCache>> drafts(drafter, 4);
  drafts.select({});
  const std::vector<int64_t> first{1, 2, 3, 4, 5}, second{6, 7, 8, 9, 10, 11, 12, 13}, other{1, 1, 1, 1, 1, 1, 1, 1, 1};
  drafts.join(true, first);    // caches its prompt but the last token
  drafts.join(true, second);
  drafts.join(false, other);   // never drafts
  std::vector<int64_t> grown = first;
  grown.insert(grown.end(), {7, 7, 7});  // three target-only steps later
  const std::vector<std::span<const int64_t>> sequences{grown, second, other};
  EXPECT_EQ(drafts.catch_up_positions(sequences), 2 * (4 - 2));
  // A member that joined empty is fed its whole sequence at its first draft.
  drafts.join(true, {});
  const std::vector<int64_t> fourth{3, 3, 3, 3, 3, 3, 3};
  const std::vector<std::span<const int64_t>> with_empty{grown, second, other, fourth};
  EXPECT_EQ(drafts.catch_up_positions(with_empty), 3 * (7 - 2));
}

// The lazily fed EAGLE head's catch-up: the states its members kept, every row of the head's
// batch padded to the widest; a row that does not draft from it keeps nothing.
TEST(EngineDraftLength, ALazyHeadsCatchUpIsTheStatesItsMembersKept) {
  const models::LlamaConfig config = test::small_llama_config();
  const models::LlamaWeights weights = models::LlamaWeights::random(config, 8);
  const models::LlamaModel<StaticKVCache> target(config, weights);
  const models::EagleHead head = test::random_eagle(config, weights, models::EagleKind::eagle3, 4, 6);
  specdec::detail::EagleBatchDrafts drafts(head, target, 0, /*lazy=*/true);
  const int64_t width = 3 * config.dim;  // three tapped layers
  const std::vector<int64_t> prompt{1, 2, 3, 4, 5, 6, 7};
  drafts.join(true, prompt, at::zeros({1, 6, width}));  // the prefill's states of 6 positions
  drafts.join(false, prompt, {});
  drafts.join(true, prompt, at::zeros({1, 2, width}));
  EXPECT_EQ(drafts.catch_up_positions(), 3 * (6 - 2));
}

// A request's acceptance: its own decayed counts, starting from the engine's pooled estimate
// scaled to a few steps' weight, so that its own drafts soon outweigh the start.
TEST(EngineDraftLength, AcceptanceStartsFromThePoolAndFollowsTheRequest) {
  specdec::detail::AcceptanceEstimate acceptance;
  EXPECT_DOUBLE_EQ(acceptance.alpha(), 0.5);
  for (int i = 0; i < 20; ++i) acceptance.observe(4, 4);
  EXPECT_GT(acceptance.alpha(), 0.95);
  for (int i = 0; i < 40; ++i) acceptance.observe(4, 0);
  EXPECT_LT(acceptance.alpha(), 0.2);
  specdec::detail::AcceptanceEstimate pooled(specdec::detail::AcceptanceEstimate::kPooledDecay);
  for (int i = 0; i < 200; ++i) pooled.observe(5, 4);  // 4 of 5 accepted: 4 / (4 + 1) tested
  EXPECT_NEAR(pooled.alpha(), 0.8, 0.01);
  specdec::detail::AcceptanceEstimate joined;
  joined.start_from(pooled);
  EXPECT_NEAR(joined.alpha(), (0.8 * specdec::detail::AcceptanceEstimate::kStartWeight + 1) /
                                  (specdec::detail::AcceptanceEstimate::kStartWeight + 2), 1e-9);
  for (int i = 0; i < 6; ++i) joined.observe(4, 0);  // this request's drafter does badly
  EXPECT_LT(joined.alpha(), 0.5);
}

// A drafter that never agrees with the target: after it is measured, the engine drafts nothing
// but its exploration steps (one column after kExploreEvery steps, then less often), and the
// output is unchanged.
TEST(EngineDraftLength, AUselessDrafterIsTurnedOff) {
  const models::LlamaConfig config = test::small_llama_config();
  models::LlamaModel<StaticKVCache> target(config, models::LlamaWeights::random(config, 21, at::kDouble));
  models::LlamaModel<StaticKVCache> drafter(config, models::LlamaWeights::random(config, 5, at::kDouble));
  Engine engine(drafter, target, {.max_rows = 2});
  Request request = request_number(0, config.vocab_size);
  request.max_new_tokens = 90;
  request.gamma = 5;
  ASSERT_TRUE(engine.add(request).has_value());
  int64_t steps = 0, drafting_steps = 0;
  std::optional<GenerationResult> result;
  while (!engine.idle()) {
    for (EngineEvent& event : engine.step()) {
      if (event.result) result = std::move(event.result);
    }
    if (++steps > 8 && engine.costs().draft_length > 0) ++drafting_steps;
  }
  ASSERT_TRUE(result.has_value());
  EXPECT_EQ(result->tokens, autoregressive_generate(target, request.prompt, {.max_new_tokens = 90}).tokens);
  EXPECT_LE(drafting_steps, steps / specdec::detail::DraftCostModel::kExploreEvery + 1) << steps << " steps";
  EXPECT_LT(result->stats.accepted, result->stats.drafted);
}

// RowProcessor's row r equals the single-policy processor of row r's parameters, in one batch.
// --- Heads as per-request draft methods -------------------------------------------------------

// The bundled target with its trained EAGLE-3 head and Medusa heads: requests drafting from each
// head, the drafter, prompt lookup or nothing join one engine at different steps. Every greedy
// request equals autoregressive decoding, and each head request drafts and accepts exactly what
// the same head does for it alone (eagle_generate_batch, medusa_generate_batch): its head saw the
// whole prompt (the prefill's hidden states) and only its own row. A seeded sampled head request
// emits the same tokens alone and in the crowd.
TEST(EngineHeads, HeadRequestsDraftAsTheyWouldAloneBesideTheOtherMethods) {
  using Model = models::LlamaModel<StaticKVCache>;
  const std::string bundled = SPECDEC_BUNDLED_MODELS_DIR;
  const auto t = io::load_llama(bundled + "/target");
  const auto d = io::load_llama(bundled + "/drafter");
  Model target(t.config, t.weights), drafter(d.config, d.weights);
  const models::EagleHead eagle = io::load_eagle(bundled + "/eagle3", io::EagleTarget::of(target));
  const models::MedusaHeads medusa = io::load_medusa(bundled + "/medusa", target.hidden_size(), target.vocab_size());
  const std::vector<std::string> texts{"import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n        return ",
                                       "class Stack(object):\n    def __init__(self):\n        self.",
                                       "for i in range(10):\n    print(", "def main(argv):\n    parser = "};
  const DraftMethod methods[] = {DraftMethod::eagle, DraftMethod::medusa, DraftMethod::drafter,
                                 DraftMethod::prompt_lookup, DraftMethod::none, DraftMethod::eagle,
                                 DraftMethod::medusa};
  constexpr int64_t kTokens = 40, kGamma = 3;
  Engine engine(drafter, target, {.max_rows = 4, .adaptive_draft_length = false, .eagle = &eagle, .medusa = &medusa});
  std::map<RequestId, Request> requests;
  std::map<RequestId, std::vector<int64_t>> streamed;
  std::map<RequestId, GenerationResult> results;
  for (size_t i = 0; i < std::size(methods) || !engine.idle(); ++i) {
    if (i < std::size(methods)) {
      const std::string& text = texts[i % texts.size()];
      Request request{.prompt = std::vector<int64_t>(text.begin(), text.end()), .max_new_tokens = kTokens,
                      .drafting = methods[i], .gamma = kGamma};
      requests.emplace(*engine.add(request), request);
    }
    collect(engine.step(), streamed, results);
  }
  int64_t head_accepted = 0;
  for (const auto& [id, request] : requests) {
    SCOPED_TRACE(::testing::Message() << "request " << id << " (" << request.drafting << ")");
    const GenerationResult& result = results.at(id);
    EXPECT_EQ(result.tokens, autoregressive_generate(target, request.prompt, {.max_new_tokens = kTokens}).tokens);
    if (request.drafting != DraftMethod::eagle && request.drafting != DraftMethod::medusa) continue;
    const std::vector<std::vector<int64_t>> prompt{request.prompt};
    const SpeculativeOptions options{.max_new_tokens = kTokens, .gamma = kGamma};
    const GenerationResult alone = request.drafting == DraftMethod::eagle
                                       ? eagle_generate_batch(eagle, target, prompt, options).front()
                                       : medusa_generate_batch(medusa, target, prompt, options).front();
    EXPECT_EQ(result.stats.drafted, alone.stats.drafted);
    EXPECT_EQ(result.stats.accepted, alone.stats.accepted);
    head_accepted += result.stats.accepted;
  }
  EXPECT_GT(head_accepted, 20) << "the trained heads should be accepted";
  // A seeded, sampled EAGLE request: alone, and beside requests of every method.
  const std::string text = texts[1];
  const Request seeded{.prompt = std::vector<int64_t>(text.begin(), text.end()), .max_new_tokens = 24,
                       .sampling = {.temperature = 0.8, .top_k = 20, .seed = 5}, .drafting = DraftMethod::eagle,
                       .gamma = kGamma};
  const EngineOptions options{.max_rows = 4, .adaptive_draft_length = false, .eagle = &eagle, .medusa = &medusa};
  Engine lone(drafter, target, options);
  const RequestId lone_id = *lone.add(seeded);
  std::map<RequestId, std::vector<int64_t>> lone_streamed;
  const auto lone_tokens = drain(lone, lone_streamed).at(lone_id).tokens;
  Engine crowd(drafter, target, options);
  for (const DraftMethod method : {DraftMethod::medusa, DraftMethod::drafter}) {
    static_cast<void>(crowd.add({.prompt = {100, 101, 102}, .max_new_tokens = 16,
                                 .sampling = {.temperature = 1.0}, .drafting = method}));
  }
  std::map<RequestId, std::vector<int64_t>> crowd_streamed;
  std::map<RequestId, GenerationResult> crowd_results;
  collect(crowd.step(), crowd_streamed, crowd_results);
  const RequestId crowd_id = *crowd.add(seeded);
  while (!crowd.idle()) collect(crowd.step(), crowd_streamed, crowd_results);
  EXPECT_EQ(crowd_results.at(crowd_id).tokens, lone_tokens);
  EXPECT_GT(crowd_results.at(crowd_id).stats.drafted, 0);
}

// Sampled requests drafting from an EAGLE head and from Medusa heads, with different parameters,
// beside a drafter row, in one batch: each row's three tokens follow its own target distribution
// (chi-square), and each fails its neighbour's.
TEST(EngineHeads, SampledHeadRowsEachFollowTheirOwnDistribution) {
  using Model = models::LlamaModel<StaticKVCache>;
  models::LlamaConfig config = test::small_llama_config();
  config.vocab_size = 6;
  const models::LlamaWeights weights = models::LlamaWeights::random(config, 8);
  Model target(config, weights);
  Model drafter(config, test::perturbed(weights, 0.3, 2));
  const models::EagleHead eagle = test::random_eagle(config, weights, models::EagleKind::eagle3, 4, 6);
  const models::MedusaConfig heads_config{.hidden_size = config.dim, .vocab_size = config.vocab_size, .num_heads = 2};
  const models::MedusaHeads medusa(heads_config, models::MedusaHeads::random(heads_config, 3));
  const SamplingParams hot{.temperature = 2.0}, filtered{.temperature = 0.8, .top_k = 3};
  const std::vector<std::vector<int64_t>> prompts{{1, 4, 2}, {5, 0, 3, 3, 1}};
  // The single-policy processors of the two parameter sets.
  const auto expected = [&](const SamplingParams& p, size_t r) {
    return p.top_k > 0 ? test::exact_continuations(target, TopKNucleusProcessor(p.top_k, 1.0, p.temperature), prompts[r], 3)
                       : test::exact_continuations(target, MultinomialProcessor(p.temperature), prompts[r], 3);
  };
  constexpr int64_t kSamples = 4000;
  std::map<std::vector<int64_t>, int64_t> observed[2];
  int64_t drafted[2] = {0, 0};
  for (int64_t i = 0; i < kSamples; ++i) {
    Engine engine(drafter, target,
                  {.max_rows = 3, .seed = static_cast<uint64_t>(i), .adaptive_draft_length = false, .eagle = &eagle,
                   .medusa = &medusa});
    SamplingParams seeded = filtered;
    seeded.seed = static_cast<uint64_t>(i);  // the Medusa row draws from its own seed
    const RequestId a = *engine.add({.prompt = prompts[0], .max_new_tokens = 3, .sampling = hot,
                                     .drafting = DraftMethod::eagle, .gamma = 2});
    const RequestId b = *engine.add({.prompt = prompts[1], .max_new_tokens = 3, .sampling = seeded,
                                     .drafting = DraftMethod::medusa, .gamma = 2});
    static_cast<void>(engine.add({.prompt = {2, 2}, .max_new_tokens = 3, .sampling = hot, .gamma = 2}));
    std::map<RequestId, std::vector<int64_t>> streamed;
    auto results = drain(engine, streamed);
    ++observed[0][results.at(a).tokens];
    ++observed[1][results.at(b).tokens];
    drafted[0] += results.at(a).stats.drafted;
    drafted[1] += results.at(b).stats.drafted;
  }
  EXPECT_GT(drafted[0], kSamples / 2);
  EXPECT_GT(drafted[1], kSamples / 2);
  EXPECT_TRUE(fits(observed[0], expected(hot, 0), kSamples));
  EXPECT_TRUE(fits(observed[1], expected(filtered, 1), kSamples));
  EXPECT_FALSE(fits(observed[0], expected(filtered, 0), kSamples));
  EXPECT_FALSE(fits(observed[1], expected(hot, 1), kSamples));
}

// A request for a head the engine does not have is refused, naming the option.
TEST(EngineHeads, ARequestForAMissingHeadIsRefused) {
  const models::LlamaConfig config = test::small_llama_config();
  const auto weights = models::LlamaWeights::random(config, 21);
  models::LlamaModel<StaticKVCache> target(config, weights);
  Engine engine(target, {.max_rows = 2});
  test::expect_invalid([&] { (void)engine.add({.prompt = {1, 2}, .drafting = DraftMethod::eagle}); },
                       {"request.drafting is eagle", "EngineOptions::eagle"});
  test::expect_invalid([&] { (void)engine.add({.prompt = {1, 2}, .drafting = DraftMethod::medusa}); },
                       {"request.drafting is medusa", "EngineOptions::medusa"});
  EXPECT_TRUE(engine.idle());
}

// The tensor mixer computes the host's, over the whole 32-bit range.
TEST(RowProcessorSeeds, TheTensorMixerEqualsTheHostOne) {
  std::vector<int64_t> values = {0, 1, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000LL, 0xFFFFFFFFLL};
  uint64_t x = 12345;
  for (int i = 0; i < 2000; ++i) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    values.push_back(static_cast<int64_t>(x >> 32));
  }
  const at::Tensor mixed = specdec::detail::mix32(at::tensor(values, at::kLong));
  for (size_t i = 0; i < values.size(); ++i) {
    ASSERT_EQ(mixed[static_cast<int64_t>(i)].item<int64_t>(), specdec::detail::mix32(static_cast<uint32_t>(values[i])))
        << "value " << values[i];
  }
}

// A seeded row's uniforms are a function of its seed and the position alone (not of its row, its
// neighbours or the call), uniform on [0, 1) and uncorrelated from one position to the next; an
// unseeded row's come from the generator.
TEST(RowProcessorSeeds, KeyedUniformsAreUniformAndDependOnSeedAndPositionOnly) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(3);
  constexpr int64_t kSeeds = 100, kPositions = 200;
  std::vector<SamplingParams> rows;
  for (int64_t s = 0; s < kSeeds; ++s) rows.push_back({.temperature = 1.0, .seed = static_cast<uint64_t>(s)});
  const RowProcessor processor(rows, at::Device(at::kCPU));
  const at::Tensor zero = at::zeros({kSeeds}, at::kLong);
  const at::Tensor u = processor.uniforms(gen, zero, kPositions, RandomUse::accept);
  ASSERT_EQ(u.sizes(), (std::vector<int64_t>{kSeeds, kPositions}));
  // 20 equal bins: chi-square with 19 degrees of freedom.
  const at::Tensor bins = (u * 20).floor().to(at::kLong).flatten().bincount({}, 20).to(at::kDouble);
  const double expected = static_cast<double>(kSeeds * kPositions) / 20;
  const double statistic = ((bins - expected).pow(2) / expected).sum().item<double>();
  EXPECT_LT(statistic, test::chi_square_quantile(19, 4.75));
  EXPECT_GE(u.min().item<double>(), 0.0);
  EXPECT_LT(u.max().item<double>(), 1.0);
  const at::Tensor centred = u - 0.5;
  const double lag = (centred.narrow(1, 0, kPositions - 1) * centred.narrow(1, 1, kPositions - 1)).mean().item<double>();
  EXPECT_LT(std::abs(lag / centred.pow(2).mean().item<double>()), 0.03);
  // Other purposes draw other numbers at the same positions, uncorrelated with these.
  const at::Tensor drafted = processor.uniforms(gen, zero, kPositions, RandomUse::draft) - 0.5;
  EXPECT_LT(std::abs((centred * drafted).mean().item<double>() / centred.pow(2).mean().item<double>()), 0.03);
  // Row 5 of the batch, moved to row 0 of a batch with an unseeded row, at positions 10..19.
  const RowProcessor moved(std::vector<SamplingParams>{rows[5], {.temperature = 1.0}}, at::Device(at::kCPU));
  const at::Tensor at_ten = at::full({2}, 10, at::kLong);
  const at::Tensor a = moved.uniforms(gen, at_ten, 10, RandomUse::accept);
  const at::Tensor b = moved.uniforms(gen, at_ten, 10, RandomUse::accept);
  EXPECT_TRUE(at::equal(a[0], u[5].narrow(0, 10, 10)));
  EXPECT_TRUE(at::equal(b[0], a[0]));
  EXPECT_FALSE(at::equal(b[1], a[1]));  // the unseeded row drew from the generator twice
  // Sampling at those uniforms; plain sample() refuses a seeded row.
  const at::Tensor probs = at::full({2, 4}, 0.25, at::kDouble);
  EXPECT_TRUE(at::equal(moved.sample_at(probs, gen, at_ten, RandomUse::sample)[0],
                        moved.sample_at(probs, gen, at_ten, RandomUse::sample)[0]));
  EXPECT_THROW(static_cast<void>(moved.sample(probs, gen)), std::logic_error);
}

TEST(RowProcessor, EachRowEqualsItsSinglePolicyProcessor) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const at::Tensor logits = at::randn({6, 3, 50}, gen, at::TensorOptions(at::kFloat)) * 3;
  const std::vector<SamplingParams> rows{{.temperature = 0.0},
                                         {.temperature = 1.0},
                                         {.temperature = 0.6, .top_k = 5},
                                         {.temperature = 1.3, .top_p = 0.8},
                                         {.temperature = 0.9, .top_k = 10, .top_p = 0.7},
                                         {.temperature = 1.0, .top_k = 80}};
  const RowProcessor processor(rows, at::kCPU);
  const at::Tensor probs = processor(logits);
  const at::Tensor expected[] = {GreedyProcessor{}(logits[0]),
                                 MultinomialProcessor(1.0)(logits[1]),
                                 TopKProcessor(5, 0.6)(logits[2]),
                                 NucleusProcessor(0.8, 1.3)(logits[3]),
                                 TopKNucleusProcessor(10, 0.7, 0.9)(logits[4]),
                                 MultinomialProcessor(1.0)(logits[5])};
  for (int64_t r = 0; r < 6; ++r) {
    EXPECT_TRUE(at::allclose(probs[r], expected[r], 1e-5, 1e-7)) << "row " << r << " " << rows[static_cast<size_t>(r)];
    EXPECT_TRUE(at::equal(probs[r] > 0, expected[r] > 0)) << "row " << r;
  }
  EXPECT_FALSE(processor.greedy());
  EXPECT_TRUE(RowProcessor(std::vector<SamplingParams>(2), at::kCPU).greedy());
  // A subset keeps its rows' parameters.
  const std::vector<int64_t> picked{4, 2};
  const at::Tensor subset = processor.rows(picked)(at::stack({logits[4], logits[2]}));
  EXPECT_TRUE(at::allclose(subset[0], expected[4], 1e-5, 1e-7));
  EXPECT_TRUE(at::allclose(subset[1], expected[2], 1e-5, 1e-7));
}

// min-p on a hand-made distribution: tokens below min_p times the top probability are dropped.
TEST(RowProcessor, MinPKeepsTokensNearTheTopProbability) {
  const at::Tensor p = at::tensor({0.5, 0.3, 0.12, 0.08}, at::kDouble).log().to(at::kFloat).view({1, 4});
  const auto with = [&](double min_p) {
    const std::vector<SamplingParams> rows{{.temperature = 1.0, .min_p = min_p}};
    return RowProcessor(rows, at::kCPU)(p).to(at::kDouble).view({4});
  };
  // 0.25 x 0.5 = 0.125: 0.12 and 0.08 go; 0.5 and 0.3 renormalised.
  EXPECT_TRUE(at::allclose(with(0.25), at::tensor({0.625, 0.375, 0.0, 0.0}, at::kDouble), 1e-6, 1e-9));
  // 0.2 x 0.5 = 0.1: only 0.08 goes.
  EXPECT_TRUE(at::allclose(with(0.2), at::tensor({0.5, 0.3, 0.12, 0.0}, at::kDouble) / 0.92, 1e-6, 1e-9));
  EXPECT_TRUE(at::allclose(with(0.0), at::tensor({0.5, 0.3, 0.12, 0.08}, at::kDouble), 1e-6, 1e-9));
  EXPECT_TRUE(at::allclose(with(1.0), at::tensor({1.0, 0.0, 0.0, 0.0}, at::kDouble), 1e-6, 1e-9));
}

TEST(RowProcessor, BadParametersNameTheRowAndTheField) {
  const std::vector<SamplingParams> rows{{.temperature = 1.0}, {.temperature = 1.0, .top_p = 0.0}};
  test::expect_invalid([&] { RowProcessor(rows, at::kCPU); }, {"rows[1]", "top_p", "(0, 1]"});
  const RowProcessor two(std::vector<SamplingParams>(2, SamplingParams{.temperature = 1.0}), at::kCPU);
  test::expect_invalid([&] { static_cast<void>(two(at::zeros({3, 5}))); }, {"logits", "[2, ..., vocab]"});
}

// Rows that leave a StaticKVCache free their slots in place; rows that join reuse them with no
// allocation and hold nothing; the kept rows' positions are unchanged. DynamicKVCache the same,
// by copies.
template <class Cache>
class AppendableCache : public ::testing::Test {};
TYPED_TEST_SUITE(AppendableCache, CacheTypes);

TYPED_TEST(AppendableCache, RowsLeaveAndJoinKeepingTheOthersPositions) {
  const models::LlamaConfig config = test::small_llama_config();
  models::LlamaModel<TypeParam> model(config, models::LlamaWeights::random(config, 21, at::kDouble));
  TypeParam cache = model.make_cache(3);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1);
  const at::Tensor ids = at::randint(config.vocab_size, {3, 6}, gen, at::TensorOptions(at::kLong));
  static_cast<void>(model.forward(ids, cache));
  const std::vector<int64_t> lengths{6, 4, 5};
  cache.prune_rows(lengths);
  const at::Tensor row2 = cache.keys(0)[2].narrow(1, 0, 5).clone();
  const void* address = nullptr;
  if constexpr (std::is_same_v<TypeParam, StaticKVCache>) address = cache.storage_address();
  cache.select_rows(std::vector<int64_t>{0, 2});
  cache.append_rows(1);
  if constexpr (std::is_same_v<TypeParam, StaticKVCache>) {
    EXPECT_EQ(cache.storage_address(), address);  // the freed slot, reused in place
  }
  cache.append_rows(1);  // beyond the slots allocated: a StaticKVCache grows
  EXPECT_EQ(std::vector<int64_t>(cache.row_lengths().begin(), cache.row_lengths().end()), (std::vector<int64_t>{6, 5, 0, 0}));
  EXPECT_TRUE(at::equal(cache.keys(0)[1].narrow(1, 0, 5), row2));
  // The joined rows compute what a fresh cache computes for their tokens.
  const at::Tensor next = at::randint(config.vocab_size, {4, 3}, gen, at::TensorOptions(at::kLong));
  const at::Tensor logits = model.forward(next, cache);
  TypeParam fresh = model.make_cache(1);
  const at::Tensor alone = model.forward(next.narrow(0, 2, 1), fresh);
  EXPECT_TRUE(at::allclose(logits.narrow(0, 2, 1), alone, 1e-9, 1e-9));
}

// A row prefilled in a cache of its own joins with its positions (append_rows_from): longer than
// every running row (the others then see zeros they never attend to) or shorter; afterwards each
// row computes what its own sequence computes alone, through the fp64 forward and the fp32 CPU
// loops. A source of another shape is refused, naming both.
TYPED_TEST(AppendableCache, RowsPrefilledAloneJoinWithTheirPositions) {
  const models::LlamaConfig config = test::small_llama_config();
  for (const at::ScalarType dtype : {at::kDouble, at::kFloat}) {
    models::LlamaModel<TypeParam> model(config, models::LlamaWeights::random(config, 21, dtype));
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(3);
    const auto tokens = [&](int64_t rows, int64_t count) {
      return at::randint(config.vocab_size, {rows, count}, gen, at::TensorOptions(at::kLong));
    };
    TypeParam cache = model.make_cache(2);
    const at::Tensor running = tokens(2, 5);
    static_cast<void>(model.forward(running, cache));
    cache.prune_rows(std::vector<int64_t>{5, 3});
    std::vector<at::Tensor> sequences{running[0], running[1].narrow(0, 0, 3)};
    for (const int64_t length : {9, 2}) {  // longer than both running rows, then shorter
      const at::Tensor prompt = tokens(1, length);
      TypeParam alone = model.make_cache(1);
      static_cast<void>(model.forward(prompt, alone));
      cache.append_rows_from(alone);
      sequences.push_back(prompt[0]);
    }
    EXPECT_EQ(std::vector<int64_t>(cache.row_lengths().begin(), cache.row_lengths().end()),
              (std::vector<int64_t>{5, 3, 9, 2}));
    const at::Tensor next = tokens(4, 2);
    const at::Tensor logits = model.forward(next, cache);
    for (int64_t r = 0; r < 4; ++r) {
      TypeParam fresh = model.make_cache(1);
      const at::Tensor whole = at::cat({sequences[static_cast<size_t>(r)], next[r]}).view({1, -1});
      const at::Tensor expected = model.forward(whole, fresh)[0].narrow(0, whole.size(1) - 2, 2);
      const double tolerance = dtype == at::kDouble ? 1e-9 : 1e-4;
      EXPECT_TRUE(at::allclose(logits[r], expected, tolerance, tolerance)) << "row " << r << " in " << dtype;
    }
  }
  models::LlamaConfig other = config;
  other.n_layers = config.n_layers + 1;
  models::LlamaModel<TypeParam> deeper(other, models::LlamaWeights::random(other, 2, at::kDouble));
  models::LlamaModel<TypeParam> model(config, models::LlamaWeights::random(config, 21, at::kDouble));
  TypeParam cache = model.make_cache(1);
  TypeParam source = deeper.make_cache(1);
  static_cast<void>(deeper.forward(at::zeros({1, 2}, at::kLong), source));
  test::expect_invalid([&] { cache.append_rows_from(source); }, {"append_rows_from", "layers"});
}

// A request that joins is prefilled by a forward of its own: the running rows' forward stays one
// token wide rather than being padded to the joining prompt (the step's positions count it).
TEST(EngineGreedy, AJoiningPromptIsPrefilledApartFromTheRunningRows) {
  const models::LlamaConfig config = test::small_llama_config();
  models::LlamaModel<StaticKVCache> target(config, models::LlamaWeights::random(config, 21, at::kDouble));
  Engine engine(target, {.max_rows = 4});
  Request first = request_number(0, config.vocab_size);
  first.max_new_tokens = 12;
  first.drafting = DraftMethod::none;
  ASSERT_TRUE(engine.add(first).has_value());
  std::map<RequestId, std::vector<int64_t>> streamed;
  std::map<RequestId, GenerationResult> results;
  collect(engine.step(), streamed, results);
  collect(engine.step(), streamed, results);
  Request second = request_number(1, config.vocab_size);
  second.prompt.resize(20, 3);
  second.max_new_tokens = 6;
  second.drafting = DraftMethod::none;
  ASSERT_TRUE(engine.add(second).has_value());
  const int64_t before = engine.stats().target_positions;
  std::vector<EngineEvent> events = engine.step();
  ASSERT_EQ(events.size(), 2U);
  // The prompt's first 19 tokens alone, then one token for each of the two rows.
  EXPECT_EQ(engine.stats().target_positions - before, 19 + 2);
  collect(std::move(events), streamed, results);
  while (!engine.idle()) collect(engine.step(), streamed, results);
  EXPECT_EQ(results.at(0).tokens, autoregressive_generate(target, first.prompt, {.max_new_tokens = 12}).tokens);
  EXPECT_EQ(results.at(1).tokens, autoregressive_generate(target, second.prompt, {.max_new_tokens = 6}).tokens);
}

}  // namespace

}  // namespace test_engine
