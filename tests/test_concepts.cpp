// Each concept against one archetype that models it and one type that fails per clause.
#include <gtest/gtest.h>

#include "specdec/concepts.hpp"
#include "specdec/draft_source.hpp"
#include "specdec/kv_cache.hpp"
#include "specdec/logits_processor.hpp"
#include "specdec/step.hpp"
#include "support/toy_models.hpp"

// One namespace a file: specdec_tests is compiled as a unity build (tests/CMakeLists.txt).
namespace test_concepts {

namespace {

using specdec::KVCache;
using specdec::LanguageModel;
using specdec::LogitsProcessor;

struct CacheArchetype {
  int64_t length() const { return 0; }
  void prune(int64_t) {}
};
struct CacheWithoutLength {
  void prune(int64_t) {}
};
struct CacheWithoutPrune {
  int64_t length() const { return 0; }
};
struct CacheWithNonConstLength {
  int64_t length() { return 0; }
  void prune(int64_t) {}
};

TEST(Concepts, KVCacheClauses) {
  static_assert(KVCache<CacheArchetype>);
  static_assert(KVCache<specdec::DynamicKVCache>);
  static_assert(KVCache<specdec::StaticKVCache>);
  static_assert(!KVCache<CacheWithoutLength>);
  static_assert(!KVCache<CacheWithoutPrune>);
  static_assert(!KVCache<CacheWithNonConstLength>);
  SUCCEED();
}

struct ModelArchetype {
  using cache_type = CacheArchetype;
  cache_type make_cache(int64_t) const { return {}; }
  at::Tensor forward(const at::Tensor& ids, cache_type&) { return ids; }
  int64_t vocab_size() const { return 1; }
  at::Device device() const { return at::kCPU; }
};
struct ModelWithBadCache : ModelArchetype {
  using cache_type = CacheWithoutPrune;
  cache_type make_cache(int64_t) const { return {}; }
  at::Tensor forward(const at::Tensor& ids, cache_type&) { return ids; }
};
struct ModelWithWrongMakeCache : ModelArchetype {
  int make_cache(int64_t) const { return 0; }
};
struct ModelWithoutForward {
  using cache_type = CacheArchetype;
  cache_type make_cache(int64_t) const { return {}; }
  int64_t vocab_size() const { return 1; }
  at::Device device() const { return at::kCPU; }
};
struct ModelWithoutVocabSize {
  using cache_type = CacheArchetype;
  cache_type make_cache(int64_t) const { return {}; }
  at::Tensor forward(const at::Tensor& ids, cache_type&) { return ids; }
  at::Device device() const { return at::kCPU; }
};
struct ModelWithoutDevice {
  using cache_type = CacheArchetype;
  cache_type make_cache(int64_t) const { return {}; }
  at::Tensor forward(const at::Tensor& ids, cache_type&) { return ids; }
  int64_t vocab_size() const { return 1; }
};
struct ModelWithoutCacheType {
  int make_cache(int64_t) const { return 0; }
};

TEST(Concepts, LanguageModelClauses) {
  static_assert(LanguageModel<ModelArchetype>);
  static_assert(specdec::Target<ModelArchetype> && specdec::Drafter<ModelArchetype>);
  static_assert(!LanguageModel<ModelWithBadCache>);
  static_assert(!LanguageModel<ModelWithWrongMakeCache>);
  static_assert(!LanguageModel<ModelWithoutForward>);
  static_assert(!LanguageModel<ModelWithoutVocabSize>);
  static_assert(!LanguageModel<ModelWithoutDevice>);
  static_assert(!LanguageModel<ModelWithoutCacheType>);
  static_assert(!specdec::HasMaxSequenceLength<ModelArchetype>);
  // A tree target without hidden states cannot serve the heads' trees, and the step says so
  // when it compiles.
  static_assert(specdec::MaskedTreeTarget<specdec::test::MarkovModel>);
  static_assert(!specdec::MaskedFeatureTreeTarget<specdec::test::MarkovModel>);
  SUCCEED();
}

struct ProcessorArchetype {
  at::Tensor operator()(const at::Tensor& logits) const { return logits; }
  at::Tensor sample(const at::Tensor& probs, at::Generator&) const { return probs; }
};
struct ProcessorWithoutSample {
  at::Tensor operator()(const at::Tensor& logits) const { return logits; }
};
struct ProcessorWithoutCall {
  at::Tensor sample(const at::Tensor& probs, at::Generator&) const { return probs; }
};
struct ProcessorWithMutatingCall {
  at::Tensor operator()(const at::Tensor& logits) { return logits; }
  at::Tensor sample(const at::Tensor& probs, at::Generator&) const { return probs; }
};

TEST(Concepts, LogitsProcessorClauses) {
  static_assert(LogitsProcessor<ProcessorArchetype>);
  static_assert(LogitsProcessor<specdec::GreedyProcessor>);
  static_assert(!LogitsProcessor<ProcessorWithoutSample>);
  static_assert(!LogitsProcessor<ProcessorWithoutCall>);
  static_assert(!LogitsProcessor<ProcessorWithMutatingCall>);
  SUCCEED();
}

// A draft source with every optional hook, counting the calls the step makes to them.
struct HookedSource {
  int64_t starts = 0, finishes = 0, top_k_seen = 0;
  template <specdec::LogitsProcessor P>
  specdec::Drafts draft(const specdec::DraftRequest& request, const P&, at::Generator&) {
    const std::vector<int64_t> tokens(static_cast<size_t>(request.gamma), request.sequence.back());
    return specdec::Drafts::from_host(tokens, request.device);
  }
  void verified(const specdec::VerifiedDrafts& verified) { top_k_seen += verified.top_k; }
  void start(std::span<const int64_t>, const specdec::SpeculativeOptions&) { ++starts; }
  void finish(std::span<const int64_t>) { ++finishes; }
  [[nodiscard]] int64_t target_top_k() const { return 2; }
  [[nodiscard]] int64_t vocab_size() const { return 40; }
  [[nodiscard]] int64_t max_sequence_length() const { return 12; }
};
// The same hooks misspelled or mistyped: each is a member the step never calls.
struct MisspelledSource {
  int64_t starts = 0, finishes = 0;
  template <specdec::LogitsProcessor P>
  specdec::Drafts draft(const specdec::DraftRequest&, const P&, at::Generator&) { return {}; }
  void verified(const specdec::VerifiedDrafts&) {}
  void strat(std::span<const int64_t>, const specdec::SpeculativeOptions&) { ++starts; }
  void finish(const std::vector<int64_t>&) { ++finishes; }  // a span does not convert to a vector
  [[nodiscard]] std::string target_top_k() const { return "2"; }
  [[nodiscard]] int64_t vocab_size() { return 40; }  // not const
};

TEST(Concepts, DraftSourceHooksAreCheckedAndCalledExactlyWhenTheirConceptsHold) {
  static_assert(specdec::DraftSource<HookedSource, specdec::GreedyProcessor>);
  static_assert(specdec::HasStartHook<HookedSource> && specdec::HasFinishHook<HookedSource> &&
                specdec::HasTargetTopK<HookedSource> && specdec::HasVocabSize<HookedSource> &&
                specdec::HasMaxSequenceLength<HookedSource>);
  static_assert(specdec::DraftSource<MisspelledSource, specdec::GreedyProcessor>);
  static_assert(!specdec::HasStartHook<MisspelledSource> && !specdec::HasFinishHook<MisspelledSource> &&
                !specdec::HasTargetTopK<MisspelledSource> && !specdec::HasVocabSize<MisspelledSource> &&
                !specdec::HasMaxSequenceLength<MisspelledSource>);
  specdec::test::PrefixHashModel target(40, 1);
  const std::vector<int64_t> prompt{1, 2, 3};
  HookedSource hooked;
  // max_sequence_length() 12: a step after `position` tokens drafts at most 12 - position + 1
  // (feeding the source up to 12 positions), and nothing once the sequence is longer.
  int64_t past_the_limit = 0;
  const auto check = [&](const specdec::StepInfo& step) {
    EXPECT_LE(static_cast<int64_t>(step.drafts.size()), std::max<int64_t>(0, 12 - step.position + 1)) << step.position;
    if (step.position > 12) past_the_limit += static_cast<int64_t>(step.drafts.size()) + 1;
  };
  const auto result = specdec::generate_with(hooked, target, prompt, {.max_new_tokens = 20, .on_step = check, .gamma = 4});
  EXPECT_EQ(hooked.starts, 1);
  EXPECT_EQ(hooked.finishes, 1);
  EXPECT_EQ(hooked.top_k_seen, 2 * result.stats.steps);
  EXPECT_GT(past_the_limit, 0);
  MisspelledSource misspelled;
  (void)specdec::generate_with(misspelled, target, prompt, {.max_new_tokens = 5, .gamma = 4});
  EXPECT_EQ(misspelled.starts, 0);
  EXPECT_EQ(misspelled.finishes, 0);
  specdec::test::PrefixHashModel other_vocabulary(30, 1);
  EXPECT_THROW((void)specdec::generate_with(hooked, other_vocabulary, prompt), std::invalid_argument);
}

}  // namespace

}  // namespace test_concepts
