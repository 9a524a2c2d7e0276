// Internals of the generation loop: a model with its cache, fed only what it has not seen yet.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <stdexcept>
#include <string_view>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/detail/check.hpp"
#include "specdec/detail/torch_compat.hpp"
#include "specdec/device.hpp"

namespace specdec::detail {

// The model's max_sequence_length(), or no limit.
template <LanguageModel M>
int64_t sequence_limit(const M& model) {
  if constexpr (HasMaxSequenceLength<M>) {
    return static_cast<int64_t>(model.max_sequence_length());
  } else {
    return std::numeric_limits<int64_t>::max();
  }
}

// The most positions `model` can hold in `cache`: the model's limit, or the cache's capacity where
// it states one and it is smaller (a caller's StaticKVCache preallocated for fewer positions).
template <LanguageModel M>
int64_t sequence_limit(const M& model, const typename M::cache_type& cache) {
  const int64_t limit = sequence_limit(model);
  if constexpr (requires { { cache.capacity() } -> std::convertible_to<int64_t>; }) {
    return std::min(limit, static_cast<int64_t>(cache.capacity()));
  } else {
    return limit;
  }
}

// Checks a model's output: floating-point logits [batch, count, vocab]. Throws
// std::invalid_argument naming the model's role and the call.
inline void check_model_logits(const at::Tensor& logits, int64_t batch, int64_t count, int64_t vocab,
                               std::string_view role, std::string_view call) {
  if (!logits.defined() || logits.dim() != 3 || logits.size(0) != batch || logits.size(1) != count ||
      logits.size(2) != vocab || !at::isFloatingType(logits.scalar_type())) {
    throw_invalid_message(role, call, " must return floating-point logits [", batch, ", ", count, ", ",
                          vocab, "], got ", logits.defined() ? logits.sizes() : at::IntArrayRef{});
  }
}

// Counters a runner adds to; any may be null.
struct ForwardCounters {
  int64_t* calls = nullptr;
  double* seconds = nullptr;
  int64_t* positions = nullptr;  // positions computed (batch rows x new tokens)
};

// A model, its cache and how it is fed. The sequence the model sees is `context ++ tail`: host
// tokens followed by device tokens (drafts); forward() feeds the part not in the cache yet. The
// cache is the runner's own, or the caller's (borrowed: used as it is, never reallocated), and
// lives across generation calls: resume() keeps the cached prefix that still matches.
template <LanguageModel M>
class ModelRunner {
 public:
  using cache_type = typename M::cache_type;

  // A runner with a cache of its own for `batch` rows, made by model.make_cache(batch).
  ModelRunner(M& model, std::string_view role, bool use_cache, ForwardCounters counters = {}, int64_t batch = 1)
      : ModelRunner(model, role, use_cache, counters, batch, nullptr) {}

  // A runner on the caller's cache (which must outlive it).
  ModelRunner(M& model, std::string_view role, cache_type& cache, ForwardCounters counters = {}, int64_t batch = 1)
      : ModelRunner(model, role, true, counters, batch, &cache) {}

  ModelRunner(ModelRunner&&) noexcept = default;
  ModelRunner& operator=(ModelRunner&&) = delete;

  [[nodiscard]] const at::Device& device() const noexcept { return device_; }
  [[nodiscard]] M& model() const noexcept { return model_; }
  [[nodiscard]] const cache_type& cache() const noexcept { return *cache_; }
  [[nodiscard]] int64_t cached() const { return static_cast<int64_t>(cache_->length()); }
  void set_counters(ForwardCounters counters) noexcept { counters_ = counters; }
  void set_use_cache(bool use_cache) noexcept { use_cache_ = use_cache; }

  // Logits [T, vocab] of the T positions of `context ++ tail` that were not cached. tail is int64
  // [1, k] on this model's device or undefined.
  at::Tensor forward(std::span<const int64_t> context, const at::Tensor& tail) {
    cache_type& cache = active_cache();
    const auto known = static_cast<int64_t>(cache.length());
    const auto context_length = static_cast<int64_t>(context.size());
    at::Tensor ids;
    if (known < context_length && device_.is_cpu() && (!tail.defined() || tail.device().is_cpu())) {
      // On the CPU the new context tokens and the tail are written into one tensor.
      const int64_t fresh = context_length - known, extra = tail.defined() ? tail.size(1) : 0;
      ids = at::empty({1, fresh + extra}, at::TensorOptions().dtype(at::kLong));
      int64_t* values = ids.data_ptr<int64_t>();
      std::copy(context.begin() + known, context.end(), values);
      if (extra > 0) {
        const at::Tensor t = tail.to(at::kLong);
        const int64_t* tail_values = t.data_ptr<int64_t>();
        for (int64_t j = 0; j < extra; ++j) values[fresh + j] = tail_values[j * t.stride(1)];
      }
    } else if (known < context_length) {
      ids = to_device_ids(context.subspan(static_cast<size_t>(known)), device_);
      if (tail.defined() && tail.size(1) > 0) ids = at::cat({ids, tail}, 1);
    } else {
      ids = tail.narrow(1, known - context_length, tail.size(1) - (known - context_length));
    }
    return forward_ids(ids, cache, ".forward")[0];
  }

  // Makes every later forward() also tap these hidden states (FeatureTarget), kept as features()
  // until the next forward; empty: none (the default).
  void set_taps(std::span<const int64_t> taps)
    requires FeatureTarget<M>
  {
    taps_.assign(taps.begin(), taps.end());
  }
  // The tapped hidden states of the last forward's first row, [T, taps * hidden] on the device;
  // undefined without taps.
  [[nodiscard]] const at::Tensor& features() const noexcept { return features_; }

  // Logits [batch, T, vocab] of ids [batch, T] on this model's device, appended to the cache.
  at::Tensor forward_batch(const at::Tensor& ids) { return forward_ids(ids, active_cache(), ".forward"); }

  // Tree verification (TreeTarget): feeds the part of `context` not cached yet as a chain and then
  // the draft tree's tokens, node i below node parents[i] or, for -1, below the context's last
  // token. Returns logits [u + n, vocab]: u rows for the uncached context (the last predicting the
  // tree's first level), then one per node. Sets *uncached = u (>= 1).
  at::Tensor forward_tree(std::span<const int64_t> context, std::span<const int64_t> tokens,
                          std::span<const int64_t> parents, int64_t* uncached)
    requires TreeTarget<M>
  {
    cache_type& cache = active_cache();
    const auto known = static_cast<int64_t>(cache.length());
    const int64_t u = static_cast<int64_t>(context.size()) - known;
    if (u < 1) throw std::logic_error("forward_tree: the context's last token must not be cached yet");
    tree_ids_.assign(context.begin() + known, context.end());
    tree_ids_.insert(tree_ids_.end(), tokens.begin(), tokens.end());
    tree_parents_.resize(tree_ids_.size());
    for (int64_t j = 0; j < u; ++j) tree_parents_[static_cast<size_t>(j)] = j - 1;
    for (size_t k = 0; k < parents.size(); ++k) {
      tree_parents_[static_cast<size_t>(u) + k] = parents[k] < 0 ? u - 1 : u + parents[k];
    }
    const at::Tensor ids = to_device_ids(tree_ids_, device_);
    *uncached = u;
    return timed(ids.size(1), ".forward_tree", [&] { return model_.forward_tree(ids, cache, tree_parents_); })[0];
  }

  // forward_tree() with the nodes' tokens on the device: `ids` int64 [n] on this model's device
  // (undefined: no nodes). The context may be wholly cached (u = 0: the nodes' roots hang below
  // the last cached position), which a drafter growing a tree level by level relies on.
  at::Tensor forward_tree(std::span<const int64_t> context, const at::Tensor& ids, std::span<const int64_t> parents,
                          int64_t* uncached)
    requires TreeTarget<M>
  {
    cache_type& cache = active_cache();
    const auto known = static_cast<int64_t>(cache.length());
    const int64_t u = static_cast<int64_t>(context.size()) - known;
    const int64_t n = ids.defined() ? ids.numel() : 0;
    if (u < 0 || u + n < 1) throw std::logic_error("forward_tree: nothing to feed, or more cached than the context");
    if (static_cast<int64_t>(parents.size()) != n) throw std::logic_error("forward_tree: one parent per node");
    tree_parents_.resize(static_cast<size_t>(u + n));
    for (int64_t j = 0; j < u; ++j) tree_parents_[static_cast<size_t>(j)] = j - 1;
    for (int64_t k = 0; k < n; ++k) {
      const int64_t parent = parents[static_cast<size_t>(k)];
      tree_parents_[static_cast<size_t>(u + k)] = parent < 0 ? u - 1 : u + parent;
    }
    at::Tensor all;
    if (u > 0) all = to_device_ids(context.subspan(static_cast<size_t>(known)), device_);
    if (n > 0) all = u > 0 ? at::cat({all, ids.view({1, n})}, 1) : ids.view({1, n});
    *uncached = u;
    return timed(u + n, ".forward_tree", [&] { return model_.forward_tree(all, cache, tree_parents_); })[0];
  }

  // One round of a tree kept in the cache (CachedMaskTreeModel): nodes `ids` int64 [n] on the
  // device at `positions` (int64 [n]), seeing the cached entries before the newest W - n and,
  // of the last W key columns, those `visible` (bool [n, W]) marks. Returns logits [n, V].
  at::Tensor forward_cached_mask(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& visible)
    requires CachedMaskTreeModel<M>
  {
    cache_type& cache = active_cache();
    const int64_t n = ids.numel();
    return timed(n, ".forward_tree",
                 [&] { return model_.forward_with_cached_mask(ids.view({1, n}), cache, positions, visible); })[0];
  }

  // forward_tree() for a tree laid out on the device (MaskedTreeTarget): nodes `ids` int64 [n],
  // node i below node parents[i] (int64 [n], parents[i] < i) or, for -1, below the context's last
  // token; no node deeper than max_depth. Depths and visibility are built on the device by
  // following parent pointers max_depth times: nothing is read back.
  at::Tensor forward_tree(std::span<const int64_t> context, const at::Tensor& ids, const at::Tensor& parents,
                          int64_t max_depth, int64_t* uncached)
    requires MaskedTreeTarget<M>
  {
    cache_type& cache = active_cache();
    const auto known = static_cast<int64_t>(cache.length());
    const int64_t u = static_cast<int64_t>(context.size()) - known;
    const int64_t n = ids.numel();
    if (u < 1) throw std::logic_error("forward_tree: the context's last token must not be cached yet");
    const auto longs = at::TensorOptions().dtype(at::kLong).device(device_);
    const at::Tensor up = parents.to(device_);
    // Node depths (1 below the root) and ancestors, max_depth hops up.
    at::Tensor node_depth = at::ones({n}, longs);
    at::Tensor ancestors = at::zeros({n, n}, longs.dtype(at::kBool));
    at::Tensor current = at::arange(n, longs);
    for (int64_t k = 0; k < max_depth && n > 0; ++k) {
      ancestors.scatter_(1, current.view({n, 1}), true);
      const at::Tensor parent = up.index_select(0, current);
      node_depth = node_depth + (k + 1 < max_depth ? parent.ge(0).to(at::kLong) : at::zeros_like(parent));
      current = at::where(parent.ge(0), parent, current);
    }
    const at::Tensor context_visible = at::ones({u, u}, longs.dtype(at::kBool)).tril();
    const at::Tensor visible = at::cat({at::cat({context_visible, at::zeros({u, n}, longs.dtype(at::kBool))}, 1),
                                        at::cat({at::ones({n, u}, longs.dtype(at::kBool)), ancestors}, 1)});
    const at::Tensor depth = at::cat({at::arange(u, longs), node_depth + (u - 1)});
    const at::Tensor all = at::cat({to_device_ids(context.subspan(static_cast<size_t>(known)), device_), ids.view({1, n})}, 1);
    *uncached = u;
    if constexpr (requires { model_.forward_with_mask_features(all, cache, depth, visible, taps_); }) {
      if (!taps_.empty()) {
        return timed(u + n, ".forward_tree", [&] {
          TargetOutput out = model_.forward_with_mask_features(all, cache, depth, visible, taps_);
          features_ = out.features[0];
          return std::move(out.logits);
        })[0];
      }
    }
    if (!taps_.empty()) throw std::invalid_argument("a feature drafter's tree needs forward_with_mask_features");
    return timed(u + n, ".forward_tree", [&] { return model_.forward_with_mask(all, cache, depth, visible); })[0];
  }

  // After forward_tree: keeps the first `prefix` positions (the context) and the tree nodes
  // `nodes` (increasing indices into the tree's tokens), dropping the other nodes.
  void keep_tree(int64_t prefix, std::span<const int64_t> nodes)
    requires TreeTarget<M>
  {
    if (!use_cache_) return;
    kept_.resize(nodes.size());
    for (size_t i = 0; i < nodes.size(); ++i) kept_[i] = prefix + nodes[i];
    cache_->keep(prefix, kept_);
  }

  // The cache itself, for a forward the runner does not make (a static-shape step writes it
  // through forward_at() and then says with hold() how much of it is valid).
  [[nodiscard]] cache_type& writable_cache() noexcept { return *cache_; }
  [[nodiscard]] bool uses_cache() const noexcept { return use_cache_; }

  // After positions up to `length` were written outside forward(): the cache holds exactly its
  // first `length` positions (committing the written ones, or dropping those past it).
  void hold(int64_t length) {
    const int64_t held = cached();
    if (length > held) {
      cache_->commit(length - held);
    } else {
      truncate(length);
    }
  }

  // Keeps at most `length` cached positions: the accepted prefix after a verification.
  void truncate(int64_t length) {
    const auto held = cached();
    if (use_cache_ && held > length) cache_->prune(held - length);
  }

  // Reorders the cache's batch rows (beam search): row i becomes old row rows[i]; rows int64
  // [batch] on this model's device.
  void reorder(const at::Tensor& rows)
    requires ReorderableKVCache<cache_type>
  {
    if (use_cache_) cache_->reorder(rows);
  }

  // Before a generation over `sequence`: keeps the cached positions whose tokens still match it
  // (what the last record() saw, up to the first difference) and drops the rest. The last token
  // is never kept: the next forward predicts from it (a session rolled back to a length its
  // cache covers computes that token again).
  void resume(std::span<const int64_t> sequence) {
    size_t same = 0;
    const size_t limit = std::min(history_.size(), sequence.empty() ? 0 : sequence.size() - 1);
    while (same < limit && history_[same] == sequence[same]) ++same;
    truncate(static_cast<int64_t>(same));
  }

  // After a generation over `sequence`: remembers which tokens the cached positions hold.
  void record(std::span<const int64_t> sequence) {
    const auto held = static_cast<size_t>(std::min<int64_t>(cached(), static_cast<int64_t>(sequence.size())));
    truncate(static_cast<int64_t>(held));
    history_.assign(sequence.begin(), sequence.begin() + static_cast<std::ptrdiff_t>(held));
  }

 private:
  ModelRunner(M& model, std::string_view role, bool use_cache, ForwardCounters counters, int64_t batch,
              cache_type* borrowed)
      : model_(model),
        role_(role),
        use_cache_(use_cache),
        counters_(counters),
        batch_(batch),
        owned_(borrowed == nullptr ? std::make_unique<cache_type>(model.make_cache(batch)) : nullptr),
        cache_(borrowed == nullptr ? owned_.get() : borrowed),
        vocab_(static_cast<int64_t>(model.vocab_size())),
        device_(model.device()) {}

  // The cache a forward extends: the runner's, or a fresh one each time without caching.
  cache_type& active_cache() {
    if (use_cache_) return *cache_;
    scratch_ = std::make_unique<cache_type>(model_.make_cache(batch_));
    return *scratch_;
  }

  at::Tensor forward_ids(const at::Tensor& ids, cache_type& cache, const char* call) {
    if constexpr (FeatureTarget<M>) {
      if (!taps_.empty()) {
        return timed(ids.size(1), call, [&] {
          TargetOutput out = model_.forward_features(ids, cache, taps_);
          features_ = out.features[0];
          return std::move(out.logits);
        });
      }
    }
    return timed(ids.size(1), call, [&] { return model_.forward(ids, cache); });
  }

  // Runs one forward of `count` tokens per row without recording a graph (weights may require
  // grad), counts it and its time, and checks and returns its logits [batch, count, vocab].
  template <class Forward>
  at::Tensor timed(int64_t count, const char* call, Forward forward) {
    at::Tensor logits;
    {
      double elapsed = 0;
      {
        ScopedTimer timer(elapsed);
        at::NoGradGuard no_grad;
        logits = forward();
      }
      if (counters_.seconds != nullptr) *counters_.seconds += elapsed;
    }
    if (counters_.calls != nullptr) ++*counters_.calls;
    if (counters_.positions != nullptr) *counters_.positions += batch_ * count;
    check_model_logits(logits, batch_, count, vocab_, role_, call);
    return logits;
  }

  M& model_;
  std::string_view role_;
  bool use_cache_;
  ForwardCounters counters_;
  int64_t batch_;
  std::unique_ptr<cache_type> owned_;    // the runner's own cache; null when borrowed
  cache_type* cache_;                    // the cache generation extends
  std::unique_ptr<cache_type> scratch_;  // without caching: the cache of the last forward
  int64_t vocab_;
  at::Device device_;
  std::vector<int64_t> history_;         // tokens of the cached positions at the last record()
  std::vector<int64_t> tree_ids_, tree_parents_, kept_;  // forward_tree / keep_tree buffers
  std::vector<int64_t> taps_;            // set_taps()
  at::Tensor features_;                  // features()
};

}  // namespace specdec::detail
