// Small hand-written models with exactly known behaviour, for tests.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <span>
#include <stdexcept>
#include <vector>

#include "specdec/concepts.hpp"

namespace specdec::test {

// A cache that remembers the tokens themselves: [batch, length] int64.
class TokenCache {
 public:
  [[nodiscard]] int64_t length() const noexcept { return tokens_.defined() ? tokens_.size(1) : 0; }
  void prune(int64_t n) {
    if (n < 0 || n > length()) throw std::invalid_argument("TokenCache::prune out of range");
    tokens_ = tokens_.narrow(1, 0, length() - n);
  }
  // Keeps positions [0, prefix) and then `positions`.
  void keep(int64_t prefix, std::span<const int64_t> positions) {
    std::vector<int64_t> index(static_cast<size_t>(prefix));
    for (int64_t i = 0; i < prefix; ++i) index[static_cast<size_t>(i)] = i;
    index.insert(index.end(), positions.begin(), positions.end());
    tokens_ = tokens_.index_select(1, at::tensor(index, at::kLong));
  }
  // Row i becomes the old row rows[i].
  void reorder(const at::Tensor& rows) {
    if (tokens_.defined()) tokens_ = tokens_.index_select(0, rows);
  }
  // Appends ids [batch, T] and returns the whole sequence [batch, length + T].
  at::Tensor append(const at::Tensor& ids) {
    tokens_ = tokens_.defined() ? at::cat({tokens_, ids}, 1) : ids;
    return tokens_;
  }

 private:
  at::Tensor tokens_;
};
static_assert(ReorderableKVCache<TokenCache> && CompactableKVCache<TokenCache>);

// A first-order Markov chain: the logits after token t are log_transitions[t]. Its sequence
// probabilities are products of processor(log_transitions) entries.
class MarkovModel {
 public:
  using cache_type = TokenCache;

  // transitions [V, V], rows are (unnormalised) probabilities; zeros become -inf logits.
  explicit MarkovModel(const at::Tensor& transitions)
      : logits_(transitions.to(at::kDouble).log().to(at::kFloat)) {}

  [[nodiscard]] TokenCache make_cache(int64_t /*batch*/) const { return {}; }
  at::Tensor forward(const at::Tensor& ids, TokenCache& cache) {
    cache.append(ids);
    return logits_.index_select(0, ids.flatten()).view({ids.size(0), ids.size(1), -1});
  }
  // A Markov chain's logits depend on the token alone, so a tree is scored as a sequence.
  at::Tensor forward_tree(const at::Tensor& ids, TokenCache& cache, std::span<const int64_t> parents) {
    if (static_cast<int64_t>(parents.size()) != ids.size(1)) throw std::invalid_argument("parents size");
    return forward(ids, cache);
  }
  [[nodiscard]] int64_t vocab_size() const { return logits_.size(0); }
  [[nodiscard]] at::Device device() const { return logits_.device(); }
  [[nodiscard]] const at::Tensor& logits() const { return logits_; }

 private:
  at::Tensor logits_;
};
static_assert(TreeTarget<MarkovModel>);

// A model whose logits at each position depend on the whole prefix and on the position: a hash of
// (position, token) pairs summed over the prefix picks a row of a random table. A cache pruned by
// one position too many or too few changes every later prediction. Variant `disagree_every` > 0
// adds a second random table to the rows whose hash is a multiple of it: a drafter that agrees
// with the variant-0 target on the other rows.
class PrefixHashModel {
 public:
  using cache_type = TokenCache;
  static constexpr int64_t kTableRows = 997;

  PrefixHashModel(int64_t vocab, uint64_t seed, int64_t disagree_every = 0)
      : disagree_every_(disagree_every) {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    table_ = at::normal(0.0, 3.0, {kTableRows, vocab}, gen, at::TensorOptions(at::kFloat));
    at::Generator noise_gen = at::make_generator<at::CPUGeneratorImpl>(seed + 1000);
    noise_ = at::normal(0.0, 6.0, {kTableRows, vocab}, noise_gen, at::TensorOptions(at::kFloat));
  }

  [[nodiscard]] TokenCache make_cache(int64_t /*batch*/) const { return {}; }
  at::Tensor forward(const at::Tensor& ids, TokenCache& cache) {
    const int64_t count = ids.size(1);
    const at::Tensor all = cache.append(ids);
    const at::Tensor positions = at::arange(1, all.size(1) + 1, at::kLong).view({1, -1});
    const at::Tensor hash = ((all + 7) * (positions * 131 + 17)).cumsum(1).remainder(kTableRows);
    const at::Tensor rows = hash.narrow(1, all.size(1) - count, count);
    at::Tensor logits = table_.index_select(0, rows.flatten());
    if (disagree_every_ > 0) {
      const at::Tensor noisy = (rows.flatten().remainder(disagree_every_) == 0).unsqueeze(1);
      logits = logits + noise_.index_select(0, rows.flatten()) * noisy;
    }
    return logits.view({ids.size(0), count, -1});
  }
  [[nodiscard]] int64_t vocab_size() const { return table_.size(1); }
  [[nodiscard]] at::Device device() const { return table_.device(); }

 private:
  int64_t disagree_every_;
  at::Tensor table_;
  at::Tensor noise_;
};
static_assert(LanguageModel<PrefixHashModel>);

}  // namespace specdec::test
