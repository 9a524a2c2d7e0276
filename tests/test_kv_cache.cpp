// KV caches: append, commit, prune, reorder, capacity and argument checks on both cache types.
#include <gtest/gtest.h>

#include "specdec/kv_cache.hpp"

// One namespace a file: specdec_tests is compiled as a unity build (tests/CMakeLists.txt).
namespace test_kv_cache {

namespace {

using namespace specdec;

constexpr int64_t kLayers = 2, kBatch = 2, kHeads = 3, kHeadDim = 4, kCapacity = 16;

template <class C>
C make_cache();
template <>
DynamicKVCache make_cache() { return DynamicKVCache(kLayers); }
template <>
StaticKVCache make_cache() {
  return StaticKVCache({.num_layers = kLayers, .batch = kBatch, .kv_heads = kHeads,
                        .capacity = kCapacity, .head_dim = kHeadDim},
                       at::kFloat);
}

// Distinct values per (layer, position): entries [batch, heads, count, head_dim].
at::Tensor entries(int64_t layer, int64_t first_position, int64_t count, double offset = 0) {
  return (at::arange(first_position, first_position + count, at::kFloat) + 100.0 * layer + offset)
      .view({1, 1, count, 1})
      .expand({kBatch, kHeads, count, kHeadDim})
      .contiguous() +
      at::arange(kBatch, at::kFloat).view({kBatch, 1, 1, 1}) * 1000.0;
}

template <class C>
void append(C& cache, int64_t count, double offset = 0) {
  const int64_t first = cache.length();
  for (int64_t layer = 0; layer < kLayers; ++layer) {
    const auto [k, v] = cache.update(layer, entries(layer, first, count, offset),
                                     entries(layer, first, count, offset) * -1.0);
    EXPECT_EQ(k.size(2), first + count);
    EXPECT_EQ(v.size(2), first + count);
  }
  cache.commit(count);
}

template <class C>
class EveryCache : public ::testing::Test {};
using Caches = ::testing::Types<DynamicKVCache, StaticKVCache>;
TYPED_TEST_SUITE(EveryCache, Caches);

TYPED_TEST(EveryCache, AppendsAndReturnsAllPositions) {
  TypeParam cache = make_cache<TypeParam>();
  EXPECT_EQ(cache.length(), 0);
  append(cache, 3);
  append(cache, 2);
  EXPECT_EQ(cache.length(), 5);
  for (int64_t layer = 0; layer < kLayers; ++layer) {
    EXPECT_TRUE(at::equal(cache.keys(layer), entries(layer, 0, 5)));
    EXPECT_TRUE(at::equal(cache.values(layer), entries(layer, 0, 5) * -1.0));
  }
}

TYPED_TEST(EveryCache, PruneThenAppendEqualsAppendingOnlyTheKeptPrefix) {
  TypeParam cache = make_cache<TypeParam>();
  append(cache, 6, /*offset=*/0.5);  // positions 0..5, later 4 of them replaced
  cache.prune(4);
  EXPECT_EQ(cache.length(), 2);
  append(cache, 3);
  TypeParam reference = make_cache<TypeParam>();
  append(reference, 2, 0.5);
  append(reference, 3);
  for (int64_t layer = 0; layer < kLayers; ++layer) {
    EXPECT_TRUE(at::equal(cache.keys(layer), reference.keys(layer)));
    EXPECT_TRUE(at::equal(cache.values(layer), reference.values(layer)));
  }
  prune_cache(cache, 5);
  EXPECT_EQ(cache.length(), 0);
}

TYPED_TEST(EveryCache, UncommittedUpdatesAreDiscarded) {
  TypeParam cache = make_cache<TypeParam>();
  append(cache, 2);
  (void)cache.update(0, entries(0, 2, 3, 9.0), entries(0, 2, 3, 9.0));  // a forward that failed
  append(cache, 1);
  EXPECT_EQ(cache.length(), 3);
  EXPECT_TRUE(at::equal(cache.keys(0), entries(0, 0, 3)));
}

TYPED_TEST(EveryCache, ReordersBatchRows) {
  TypeParam cache = make_cache<TypeParam>();
  append(cache, 3);
  const at::Tensor before = cache.keys(1).clone();
  cache.reorder(at::tensor({1, 0}, at::kLong));
  EXPECT_TRUE(at::equal(cache.keys(1)[0], before[1]));
  EXPECT_TRUE(at::equal(cache.keys(1)[1], before[0]));
  cache.reorder(at::tensor({1, 1}, at::kLong));
  EXPECT_TRUE(at::equal(cache.keys(1)[0], before[0]));
  EXPECT_TRUE(at::equal(cache.keys(1)[1], before[0]));
  EXPECT_THROW(cache.reorder(at::tensor({0, 2}, at::kLong)), std::invalid_argument);
}

// When the longest row leaves the batch, the cache ends where the longest kept row does: the next
// positions follow that row, not the row that left (batched generation relies on it when a longer
// request finishes first).
TYPED_TEST(EveryCache, SelectingRowsEndsTheCacheAtTheLongestKeptRow) {
  TypeParam cache = make_cache<TypeParam>();
  append(cache, 6);
  cache.prune_rows(std::vector<int64_t>{2, 5});
  ASSERT_TRUE(cache.ragged());
  cache.select_rows(std::vector<int64_t>{0});
  EXPECT_EQ(cache.length(), 2);
  EXPECT_FALSE(cache.ragged());
  EXPECT_EQ(cache.keys(1).size(2), 2);
  const auto [k, v] = cache.update(1, entries(1, 2, 1).narrow(0, 0, 1), entries(1, 2, 1).narrow(0, 0, 1));
  EXPECT_EQ(k.size(2), 3) << "the new position follows the kept row's two";
  EXPECT_TRUE(at::equal(k[0].narrow(1, 0, 2), entries(1, 0, 2)[0]));
}

TYPED_TEST(EveryCache, RejectsBadArguments) {
  TypeParam cache = make_cache<TypeParam>();
  append(cache, 2);
  EXPECT_THROW(cache.prune(3), std::invalid_argument);
  EXPECT_THROW(cache.prune(-1), std::invalid_argument);
  EXPECT_THROW(prune_cache(cache, 3), std::invalid_argument);
  EXPECT_THROW((void)cache.update(kLayers, entries(0, 0, 1), entries(0, 0, 1)), std::invalid_argument);
  EXPECT_THROW((void)cache.update(0, entries(0, 0, 1), entries(0, 0, 2)), std::invalid_argument);
  EXPECT_THROW((void)cache.update(0, at::zeros({kBatch, kHeads + 1, 1, kHeadDim}),
                                  at::zeros({kBatch, kHeads + 1, 1, kHeadDim})),
               std::invalid_argument);
  EXPECT_EQ(cache.length(), 2);
  try {
    cache.prune(7);
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("7"), std::string::npos) << e.what();
  }
}

TEST(StaticKVCache, WritesInPlaceWithoutAllocating) {
  StaticKVCache cache = make_cache<StaticKVCache>();
  append(cache, 2);
  const void* storage = cache.keys(0).data_ptr();
  append(cache, 3);
  cache.prune(4);
  append(cache, 1);
  EXPECT_EQ(cache.keys(0).data_ptr(), storage);
  EXPECT_EQ(cache.length(), 2);
}

// update_stacked writes keys and values given as one tensor where update takes two: same
// storage, same views, same checks.
TEST(StaticKVCache, StackedUpdateEqualsUpdate) {
  StaticKVCache stacked = make_cache<StaticKVCache>();
  StaticKVCache separate = make_cache<StaticKVCache>();
  append(stacked, 2);
  append(separate, 2);
  for (int64_t layer = 0; layer < kLayers; ++layer) {
    const at::Tensor keys = entries(layer, 2, 3, 5.0), values = entries(layer, 2, 3, 7.0);
    const auto [k, v] = stacked.update_stacked(layer, at::stack({keys, values}));
    const auto [k_ref, v_ref] = separate.update(layer, keys, values);
    EXPECT_TRUE(at::equal(k, k_ref) && at::equal(v, v_ref)) << layer;
  }
  stacked.commit(3);
  separate.commit(3);
  for (int64_t layer = 0; layer < kLayers; ++layer) {
    EXPECT_TRUE(at::equal(stacked.keys(layer), separate.keys(layer)) && at::equal(stacked.values(layer), separate.values(layer)));
    EXPECT_FALSE(at::equal(stacked.keys(layer), stacked.values(layer)));  // keys and values landed apart
  }
  EXPECT_THROW((void)stacked.update_stacked(0, entries(0, 0, 1)), std::invalid_argument);
  EXPECT_THROW((void)stacked.update_stacked(kLayers, at::stack({entries(0, 0, 1), entries(0, 0, 1)})), std::invalid_argument);
  EXPECT_THROW((void)stacked.update_stacked(0, at::stack({entries(0, 0, kCapacity), entries(0, 0, kCapacity)})),
               std::length_error);
  EXPECT_EQ(stacked.length(), 5);
}

// update_stacked of new rows in the layouts a forward hands over (keys and values of a token side
// by side in one row, a last dimension that is not contiguous, a double tensor), after rows
// left the batch (the storage a view of its slots), equals update of the same values.
TEST(StaticKVCache, StackedUpdateReadsEveryLayoutOfTheNewRows) {
  StaticKVCache stacked = make_cache<StaticKVCache>();
  StaticKVCache separate = make_cache<StaticKVCache>();
  append(stacked, 3);
  append(separate, 3);
  const std::vector<int64_t> first{0};  // rows leave: each cache keeps row 0 in place
  stacked.select_rows(first);
  separate.select_rows(first);
  int64_t written = 0;
  for (int variant = 0; variant < 3; ++variant) {
    for (int64_t layer = 0; layer < kLayers; ++layer) {
      const at::Tensor keys = entries(layer, 3 + written, 2, 5.0 + variant).narrow(0, 0, 1);
      const at::Tensor values = entries(layer, 3 + written, 2, 9.0 + variant).narrow(0, 0, 1);
      at::Tensor both;
      if (variant == 0) {
        both = at::stack({keys, values}, 3).permute({3, 0, 1, 2, 4});  // [2, 1, H, T, D], rows side by side
      } else if (variant == 1) {
        both = at::stack({keys, values}).transpose(3, 4).contiguous().transpose(3, 4);  // last dim strided
      } else {
        both = at::stack({keys, values}).to(at::kDouble);
      }
      ASSERT_EQ(both.sizes(), (std::vector<int64_t>{2, 1, kHeads, 2, kHeadDim}));
      const auto [k, v] = stacked.update_stacked(layer, both);
      const auto [k_ref, v_ref] = separate.update(layer, keys, values);
      EXPECT_TRUE(at::equal(k, k_ref) && at::equal(v, v_ref)) << "variant " << variant << ", layer " << layer;
    }
    stacked.commit(2);
    separate.commit(2);
    written += 2;
  }
  for (int64_t layer = 0; layer < kLayers; ++layer) {
    EXPECT_TRUE(at::equal(stacked.keys(layer), separate.keys(layer)) && at::equal(stacked.values(layer), separate.values(layer)));
  }
  EXPECT_EQ(stacked.length(), 9);
}

TEST(StaticKVCache, ThrowsWhenCapacityIsExceeded) {
  StaticKVCache cache = make_cache<StaticKVCache>();
  append(cache, kCapacity - 1);
  EXPECT_THROW((void)cache.update(0, entries(0, 0, 2), entries(0, 0, 2)), std::length_error);
  EXPECT_EQ(cache.length(), kCapacity - 1);
}

TEST(StaticKVCache, RejectsBadShape) {
  EXPECT_THROW(StaticKVCache({.capacity = 0}, at::kFloat), std::invalid_argument);
  EXPECT_THROW(StaticKVCache({.num_layers = -1}, at::kFloat), std::invalid_argument);
  EXPECT_THROW(DynamicKVCache(0), std::invalid_argument);
}

}  // namespace

}  // namespace test_kv_cache
