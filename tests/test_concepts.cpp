// Each concept against one archetype that models it and one type that fails per clause.
#include <gtest/gtest.h>

#include "specdec/concepts.hpp"
#include "specdec/kv_cache.hpp"
#include "specdec/logits_processor.hpp"

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

}  // namespace
