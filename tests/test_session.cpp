// Sessions: the target's and drafter's caches live across calls, a new turn is prefilled alone,
// output equals a fresh generation over the whole conversation, rollback, the caller's own cache
// used as it is, and bad input.
#include <gtest/gtest.h>

#include <vector>

#include "specdec/models/llama.hpp"
#include "specdec/specdec.hpp"
#include "support/expect_invalid.hpp"
#include "support/llama_fixtures.hpp"
#include "support/toy_models.hpp"

// One namespace a file: specdec_tests is compiled as a unity build (tests/CMakeLists.txt).
namespace test_session {

namespace {

using namespace specdec;

const std::vector<int64_t> kFirstTurn{1, 7, 3, 22, 5};
const std::vector<int64_t> kSecondTurn{9, 9, 2, 30};

std::vector<int64_t> concat(std::span<const int64_t> a, std::span<const int64_t> b) {
  std::vector<int64_t> out(a.begin(), a.end());
  out.insert(out.end(), b.begin(), b.end());
  return out;
}

template <class Cache>
struct Models {
  models::LlamaConfig config = test::small_llama_config();
  models::LlamaWeights weights = models::LlamaWeights::random(config, 21, at::kDouble);
  models::LlamaModel<Cache> target{config, weights};
  models::LlamaModel<Cache> drafter{config, test::perturbed(weights, 0.04, 4)};
  models::LlamaModel<Cache> twin{config, weights};  // a drafter that always agrees
};

template <class Cache>
class SessionTest : public ::testing::Test {};
using CacheTypes = ::testing::Types<StaticKVCache, DynamicKVCache>;
TYPED_TEST_SUITE(SessionTest, CacheTypes);

TYPED_TEST(SessionTest, SecondTurnPrefillsOnlyItsOwnTokens) {
  Models<TypeParam> m;
  Session session(m.target);
  session.append(kFirstTurn);
  const auto first = session.generate({.max_new_tokens = 15});
  EXPECT_EQ(session.cache().length(), session.length() - 1);
  EXPECT_EQ(first.tokens, autoregressive_generate(m.target, kFirstTurn, {.max_new_tokens = 15}).tokens);
  session.append(kSecondTurn);
  const auto second = session.generate({.max_new_tokens = 15});
  EXPECT_EQ(session.cache().length(), session.length() - 1);
  const auto conversation = concat(concat(kFirstTurn, first.tokens), kSecondTurn);
  const auto fresh = autoregressive_generate(m.target, conversation, {.max_new_tokens = 15});
  EXPECT_EQ(second.tokens, fresh.tokens);
  // Over both turns the target computes every position but the last once; a fresh call pays the
  // whole conversation again.
  EXPECT_EQ(first.stats.target_positions + second.stats.target_positions, session.length() - 1);
  EXPECT_EQ(second.stats.target_positions, static_cast<int64_t>(kSecondTurn.size()) + 15);
  EXPECT_EQ(fresh.stats.target_positions, static_cast<int64_t>(conversation.size()) + 14);
}

TYPED_TEST(SessionTest, SpeculativeTurnsEqualFreshGenerationsAndReuseTheDrafterCache) {
  Models<TypeParam> m;
  Session session(m.target);
  ModelDraftSource drafts(m.drafter);
  session.append(kFirstTurn);
  const SpeculativeOptions options{.max_new_tokens = 24, .gamma = 4};
  const auto first = session.generate(drafts, options);
  EXPECT_EQ(first.tokens, speculative_generate(m.drafter, m.target, kFirstTurn, options).tokens);
  EXPECT_LE(drafts.cache().length(), session.length());
  session.append(kSecondTurn);
  const auto second = session.generate(drafts, options);
  const auto conversation = concat(concat(kFirstTurn, first.tokens), kSecondTurn);
  const auto fresh = speculative_generate(m.drafter, m.target, conversation, options);
  EXPECT_EQ(second.tokens, fresh.tokens);
  // The same drafts were made and accepted: the reused caches are the recomputed ones.
  EXPECT_EQ(second.stats.drafted, fresh.stats.drafted);
  EXPECT_EQ(second.stats.accepted, fresh.stats.accepted);
  EXPECT_GT(second.stats.accepted, 0);
  EXPECT_LT(second.stats.accepted, second.stats.drafted);
  EXPECT_LT(second.stats.target_positions, fresh.stats.target_positions);
}

TYPED_TEST(SessionTest, ATwinDrafterIsAcceptedEverywhereAcrossTurns) {
  // Any misalignment of the drafter's cache with the conversation would show as a rejection.
  Models<TypeParam> m;
  Session session(m.target);
  ModelDraftSource drafts(m.twin);
  for (const auto& turn : {kFirstTurn, kSecondTurn, std::vector<int64_t>{3}}) {
    session.append(turn);
    const auto result = session.generate(drafts, {.max_new_tokens = 17, .gamma = 4});
    EXPECT_GT(result.stats.drafted, 10);
    EXPECT_EQ(result.stats.accepted, result.stats.drafted);
    // The drafter has seen the conversation up to its last draft, at most all but its last token.
    EXPECT_GE(drafts.cache().length(), session.length() - 5);
    EXPECT_LE(drafts.cache().length(), session.length() - 1);
  }
}

TYPED_TEST(SessionTest, RollbackThenNewTokensMatchAFreshGeneration) {
  Models<TypeParam> m;
  Session session(m.target);
  ModelDraftSource drafts(m.drafter);
  session.append(kFirstTurn);
  (void)session.generate(drafts, {.max_new_tokens = 20, .gamma = 3});
  session.rollback(8);  // keep the turn and 3 generated tokens, drop the rest
  EXPECT_EQ(session.length(), 8);
  EXPECT_LE(session.cache().length(), 8);
  session.append(std::vector<int64_t>{11, 12});
  const std::vector<int64_t> edited(session.tokens().begin(), session.tokens().end());
  const auto regenerated = session.generate(drafts, {.max_new_tokens = 20, .gamma = 3});
  const auto fresh = speculative_generate(m.drafter, m.target, edited, {.max_new_tokens = 20, .gamma = 3});
  EXPECT_EQ(regenerated.tokens, fresh.tokens);
  EXPECT_EQ(regenerated.stats.accepted, fresh.stats.accepted);
  // A rollback that keeps the length but changes a token is found too: the drafter's cache is
  // checked against the tokens, not only their number.
  session.rollback(6);
  session.append(std::vector<int64_t>{edited[6] == 1 ? 2 : 1});
  const std::vector<int64_t> changed(session.tokens().begin(), session.tokens().end());
  EXPECT_EQ(session.generate(drafts, {.max_new_tokens = 10, .gamma = 3}).tokens,
            autoregressive_generate(m.target, changed, {.max_new_tokens = 10}).tokens);
}

// Between calls the cache holds every token but the last. A rollback by one token leaves the
// cache covering the whole session: the next generation computes the last token again instead of
// predicting from nothing, for the target's cache and the drafter's.
TYPED_TEST(SessionTest, RollbackIntoTheCachedPrefixRecomputesTheLastToken) {
  Models<TypeParam> m;
  Session session(m.target);
  ModelDraftSource drafts(m.drafter);
  session.append(kFirstTurn);
  (void)session.generate(drafts, {.max_new_tokens = 12, .gamma = 3});
  ASSERT_EQ(session.cache().length(), session.length() - 1);
  session.rollback(session.length() - 1);
  EXPECT_EQ(session.cache().length(), session.length());
  const std::vector<int64_t> kept(session.tokens().begin(), session.tokens().end());
  EXPECT_EQ(session.generate(drafts, {.max_new_tokens = 10, .gamma = 3}).tokens,
            autoregressive_generate(m.target, kept, {.max_new_tokens = 10}).tokens);
  session.rollback(session.length() - 1);
  const std::vector<int64_t> again(session.tokens().begin(), session.tokens().end());
  EXPECT_EQ(session.generate({.max_new_tokens = 5}).tokens, autoregressive_generate(m.target, again, {.max_new_tokens = 5}).tokens);
}

TYPED_TEST(SessionTest, PrefillComputesTheTurnBeforeGeneration) {
  Models<TypeParam> m;
  Session session(m.target);
  session.append(kFirstTurn);
  EXPECT_EQ(session.prefill(), static_cast<int64_t>(kFirstTurn.size()) - 1);
  EXPECT_EQ(session.prefill(), 0);
  const auto result = session.generate({.max_new_tokens = 10});
  EXPECT_EQ(result.stats.target_positions, 10);  // the turn's last token, then 9 generated ones
  EXPECT_EQ(result.tokens, autoregressive_generate(m.target, kFirstTurn, {.max_new_tokens = 10}).tokens);
}

TEST(Session, UsesTheCallersCacheAsItIs) {
  Models<StaticKVCache> m;
  StaticKVCache cache = m.target.make_cache(1, 96);  // the engine's preallocated cache
  Session session(m.target, cache);
  session.append(kFirstTurn);
  const auto first = session.generate({.max_new_tokens = 12});
  const void* storage = cache.keys(0).data_ptr();
  session.append(kSecondTurn);
  (void)session.generate({.max_new_tokens = 12});
  EXPECT_EQ(cache.length(), session.length() - 1);
  EXPECT_EQ(cache.keys(0).data_ptr(), storage);
  EXPECT_EQ(first.tokens, autoregressive_generate(m.target, kFirstTurn, {.max_new_tokens = 12}).tokens);

  // A second session picks up the cache with the tokens it holds and computes nothing again.
  const std::vector<int64_t> held(session.tokens().begin(), session.tokens().end() - 1);
  Session resumed(m.target, cache, held);
  resumed.append(std::vector<int64_t>{session.tokens().back(), 4});
  const auto next = resumed.generate({.max_new_tokens = 5});
  EXPECT_EQ(next.stats.target_positions, 2 + 4);
  const std::vector<int64_t> all(resumed.tokens().begin(), resumed.tokens().end() - 5);
  EXPECT_EQ(next.tokens, autoregressive_generate(m.target, all, {.max_new_tokens = 5}).tokens);
}

// A caller's cache smaller than the model's context (128) is the session's limit: generation
// ends there with sequence_limit, a turn that would not fit is refused unchanged, and a drafter
// on a caller's cache smaller still stops drafting at its end while the target goes on.
TEST(Session, ACallersCacheSmallerThanTheContextIsTheLimit) {
  Models<StaticKVCache> m;
  StaticKVCache cache = m.target.make_cache(1, 30);
  Session session(m.target, cache);
  session.append(kFirstTurn);
  const auto first = session.generate({.max_new_tokens = 64});
  EXPECT_EQ(first.stop_reason, StopReason::sequence_limit);
  EXPECT_EQ(first.tokens, autoregressive_generate(m.target, kFirstTurn, {.max_new_tokens = 25}).tokens);
  EXPECT_EQ(session.length(), 30);
  test::expect_invalid([&] { session.append(std::vector<int64_t>{1}); }, {"capacity 30"});
  EXPECT_EQ(session.length(), 30);

  StaticKVCache target_cache = m.target.make_cache(1, 40);
  StaticKVCache drafter_cache = m.drafter.make_cache(1, 20);
  Session drafted(m.target, target_cache);
  ModelDraftSource source(m.drafter, drafter_cache);
  drafted.append(kFirstTurn);
  const auto result = drafted.generate(source, {.max_new_tokens = 64, .gamma = 4});
  EXPECT_EQ(result.stop_reason, StopReason::sequence_limit);
  EXPECT_EQ(result.tokens, autoregressive_generate(m.target, kFirstTurn, {.max_new_tokens = 35}).tokens);
  EXPECT_GT(result.stats.accepted, 0);
  EXPECT_LE(drafter_cache.length(), 20);
}

TEST(Session, NGramDraftsLearnAcrossTurnsAndStayExact) {
  Models<StaticKVCache> m;
  NGramStorage storage(3, m.config.vocab_size);
  NGramDraftSource drafts(storage);
  Session session(m.target);
  session.append(kFirstTurn);
  const auto first = session.generate(drafts, {.max_new_tokens = 20});
  session.append(kSecondTurn);
  const auto second = session.generate(drafts, {.max_new_tokens = 20});
  EXPECT_EQ(first.tokens, autoregressive_generate(m.target, kFirstTurn, {.max_new_tokens = 20}).tokens);
  const auto conversation = concat(concat(kFirstTurn, first.tokens), kSecondTurn);
  EXPECT_EQ(second.tokens, autoregressive_generate(m.target, conversation, {.max_new_tokens = 20}).tokens);
  EXPECT_GT(storage.size(), 0);
}

TEST(Session, RejectsBadInputAndStaysUnchanged) {
  Models<StaticKVCache> m;
  Session session(m.target);
  test::expect_invalid([&] { (void)session.generate(); }, {"prompt must not be empty"});
  session.append(kFirstTurn);
  test::expect_invalid([&] { session.append(std::vector<int64_t>{3, 48}); }, {"tokens[1]", "48"});
  test::expect_invalid([&] { session.append(std::vector<int64_t>(124, 1)); }, {"max_sequence_length 128"});
  test::expect_invalid([&] { session.rollback(6); }, {"rollback length", "6"});
  test::expect_invalid([&] { session.rollback(-1); }, {"rollback length", "-1"});
  EXPECT_EQ(session.length(), 5);
  StaticKVCache cache = m.target.make_cache(1);
  test::expect_invalid([&] { Session bad(m.target, cache, kFirstTurn); }, {"cached_tokens", "0"});
  models::LlamaConfig other = m.config;
  other.vocab_size = 40;
  models::LlamaModel<StaticKVCache> small_drafter(other, models::LlamaWeights::random(other, 3));
  ModelDraftSource drafts(small_drafter);
  test::expect_invalid([&] { (void)session.generate(drafts); }, {"drafter.vocab_size()", "48", "40"});
}

}  // namespace

}  // namespace test_session
