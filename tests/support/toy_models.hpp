// Small hand-written models with exactly known behaviour, for tests.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <vector>

#include "specdec/concepts.hpp"

namespace specdec::test {

// A cache that remembers the tokens themselves, row by row; rows may hold different numbers of
// tokens (BatchedKVCache).
class TokenCache {
 public:
  [[nodiscard]] int64_t length() const noexcept {
    int64_t longest = 0;
    for (const auto& row : rows_) longest = std::max(longest, static_cast<int64_t>(row.size()));
    return longest;
  }
  void prune(int64_t n) {
    for (const auto& row : rows_) {
      if (n < 0 || n > static_cast<int64_t>(row.size())) throw std::invalid_argument("TokenCache::prune out of range");
    }
    for (auto& row : rows_) row.resize(row.size() - static_cast<size_t>(n));
    update_lengths();
  }
  // Keeps positions [0, prefix) and then `positions`, in every row.
  void keep(int64_t prefix, std::span<const int64_t> positions) {
    for (auto& row : rows_) {
      std::vector<int64_t> kept(row.begin(), row.begin() + prefix);
      for (const int64_t p : positions) kept.push_back(row[static_cast<size_t>(p)]);
      row = std::move(kept);
    }
    update_lengths();
  }
  // Row i becomes the old row rows[i].
  void reorder(const at::Tensor& rows) {
    const at::Tensor host = rows.to(at::kCPU).contiguous();
    select_rows(std::span<const int64_t>(host.data_ptr<int64_t>(), static_cast<size_t>(host.numel())));
  }
  // BatchedKVCache.
  [[nodiscard]] std::span<const int64_t> row_lengths() const noexcept { return lengths_; }
  [[nodiscard]] bool ragged() const noexcept {
    return std::any_of(lengths_.begin(), lengths_.end(), [&](int64_t l) { return l != lengths_.front(); });
  }
  [[nodiscard]] at::Tensor device_row_lengths() const { return at::tensor(lengths_, at::kLong); }
  void prune_rows(std::span<const int64_t> lengths) {
    if (lengths.size() != rows_.size()) throw std::invalid_argument("TokenCache::prune_rows: one length per row");
    for (size_t r = 0; r < rows_.size(); ++r) {
      if (lengths[r] < 0 || lengths[r] > static_cast<int64_t>(rows_[r].size())) {
        throw std::invalid_argument("TokenCache::prune_rows out of range");
      }
      rows_[r].resize(static_cast<size_t>(lengths[r]));
    }
    update_lengths();
  }
  void select_rows(std::span<const int64_t> rows) {
    if (rows_.empty()) return;  // nothing cached yet
    std::vector<std::vector<int64_t>> kept;
    for (const int64_t r : rows) kept.push_back(rows_.at(static_cast<size_t>(r)));
    rows_ = std::move(kept);
    update_lengths();
  }
  // AppendableKVCache: n empty rows after the others.
  void append_rows(int64_t n) {
    rows_.insert(rows_.end(), static_cast<size_t>(n), std::vector<int64_t>{});
    update_lengths();
  }
  // Appends ids [batch, T] after each row's tokens. Returns the tokens of every row [batch,
  // length()] (rows of equal lengths; shorter rows are padded with 0).
  at::Tensor append(const at::Tensor& ids) {
    const at::Tensor host = ids.to(at::kCPU).contiguous();
    if (rows_.empty()) rows_.resize(static_cast<size_t>(ids.size(0)));
    if (static_cast<int64_t>(rows_.size()) != ids.size(0)) throw std::invalid_argument("TokenCache: batch mismatch");
    const int64_t count = ids.size(1);
    for (size_t r = 0; r < rows_.size(); ++r) {
      const int64_t* data = host.data_ptr<int64_t>() + static_cast<int64_t>(r) * count;
      rows_[r].insert(rows_[r].end(), data, data + count);
    }
    update_lengths();
    at::Tensor all = at::zeros({ids.size(0), length()}, at::kLong);
    for (size_t r = 0; r < rows_.size(); ++r) {
      if (!rows_[r].empty()) {
        all[static_cast<int64_t>(r)].narrow(0, 0, static_cast<int64_t>(rows_[r].size())).copy_(at::tensor(rows_[r], at::kLong));
      }
    }
    return all.to(ids.device());
  }
  // JoinableKVCache: row r holds caches[r]'s tokens; a split row holds row r's.
  static TokenCache join_rows(std::span<const TokenCache* const> caches) {
    TokenCache joined;
    for (const TokenCache* cache : caches) {
      if (cache->rows_.size() > 1) throw std::invalid_argument("TokenCache::join_rows: one-row caches only");
      joined.rows_.push_back(cache->rows_.empty() ? std::vector<int64_t>{} : cache->rows_.front());
    }
    joined.update_lengths();
    return joined;
  }
  [[nodiscard]] TokenCache split_row(int64_t r) const {
    TokenCache row;
    row.rows_.push_back(rows_.at(static_cast<size_t>(r)));
    row.update_lengths();
    return row;
  }
  // The tokens of row r [1, its length].
  [[nodiscard]] at::Tensor row(int64_t r) const {
    return at::tensor(rows_.at(static_cast<size_t>(r)), at::kLong).view({1, -1});
  }

 private:
  void update_lengths() {
    lengths_.clear();
    for (const auto& row : rows_) lengths_.push_back(static_cast<int64_t>(row.size()));
  }
  std::vector<std::vector<int64_t>> rows_;
  std::vector<int64_t> lengths_;
};
static_assert(ReorderableKVCache<TokenCache> && CompactableKVCache<TokenCache> && JoinableKVCache<TokenCache> &&
              AppendableKVCache<TokenCache>);

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
  at::Tensor forward_with_mask(const at::Tensor& ids, TokenCache& cache, const at::Tensor& depth,
                               const at::Tensor& visible) {
    if (depth.numel() != ids.size(1) || visible.size(0) != ids.size(1)) throw std::invalid_argument("mask size");
    return forward(ids, cache);
  }
  [[nodiscard]] int64_t vocab_size() const { return logits_.size(0); }
  [[nodiscard]] at::Device device() const { return logits_.device(); }
  [[nodiscard]] const at::Tensor& logits() const { return logits_; }

 private:
  at::Tensor logits_;
};
static_assert(MaskedTreeTarget<MarkovModel>);

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
    if (cache.ragged()) {  // rows of different lengths: each row on its own
      (void)cache.append(ids);
      std::vector<at::Tensor> rows;
      for (int64_t r = 0; r < ids.size(0); ++r) rows.push_back(logits_of(cache.row(r), count));
      return at::cat(rows, 0);
    }
    return logits_of(cache.append(ids), count);
  }
  [[nodiscard]] int64_t vocab_size() const { return table_.size(1); }
  [[nodiscard]] at::Device device() const { return table_.device(); }

 private:
  // Logits [batch, count, vocab] of the last `count` positions of `all` [batch, length].
  at::Tensor logits_of(const at::Tensor& all, int64_t count) const {
    const at::Tensor positions = at::arange(1, all.size(1) + 1, at::kLong).view({1, -1});
    const at::Tensor hash = ((all + 7) * (positions * 131 + 17)).cumsum(1).remainder(kTableRows);
    const at::Tensor rows = hash.narrow(1, all.size(1) - count, count);
    at::Tensor logits = table_.index_select(0, rows.flatten());
    if (disagree_every_ > 0) {
      const at::Tensor noisy = (rows.flatten().remainder(disagree_every_) == 0).unsqueeze(1);
      logits = logits + noise_.index_select(0, rows.flatten()) * noisy;
    }
    return logits.view({all.size(0), count, -1});
  }

  int64_t disagree_every_;
  at::Tensor table_;
  at::Tensor noise_;
};
static_assert(LanguageModel<PrefixHashModel>);

}  // namespace specdec::test
