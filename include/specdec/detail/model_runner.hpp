// Internals of the generation loop: a model with its cache, fed only what it has not seen yet.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <span>
#include <stdexcept>
#include <string_view>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/detail/check.hpp"
#include "specdec/detail/host_tensor.hpp"

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

// A 64-bit seed from the system's entropy source, for runs without options.seed.
inline uint64_t random_seed() { return (uint64_t{std::random_device{}()} << 32) ^ std::random_device{}(); }

inline at::Generator make_generator(std::optional<uint64_t> seed) {
  return at::make_generator<at::CPUGeneratorImpl>(seed ? *seed : random_seed());
}

// Counters a runner adds to.
struct ForwardCounters {
  int64_t* calls;
  double* seconds;
};

// A model, its cache and how it is fed. The sequence the model sees is `context ++ tail`: host
// tokens followed by device tokens (drafts); forward() feeds the part not in the cache yet.
template <LanguageModel M>
class ModelRunner {
 public:
  ModelRunner(M& model, std::string_view role, bool use_cache, ForwardCounters counters)
      : model_(model),
        role_(role),
        use_cache_(use_cache),
        counters_(counters),
        cache_(model.make_cache(1)),
        vocab_(static_cast<int64_t>(model.vocab_size())),
        device_(model.device()) {}

  [[nodiscard]] const at::Device& device() const noexcept { return device_; }

  // Logits [T, vocab] of the T positions of `context ++ tail` that were not cached. tail is int64
  // [1, k] on this model's device or undefined.
  at::Tensor forward(std::span<const int64_t> context, const at::Tensor& tail) {
    if (!use_cache_) cache_ = model_.make_cache(1);
    const auto known = static_cast<int64_t>(cache_.length());
    const auto context_length = static_cast<int64_t>(context.size());
    at::Tensor ids;
    if (known < context_length) {
      ids = host_ids(context.subspan(static_cast<size_t>(known)), device_);
      if (tail.defined() && tail.size(1) > 0) ids = at::cat({ids, tail}, 1);
    } else {
      ids = tail.narrow(1, known - context_length, tail.size(1) - (known - context_length));
    }
    return timed(ids.size(1), ".forward", [&] { return model_.forward(ids, cache_); });
  }

  // Tree verification (TreeTarget): feeds the part of `context` not cached yet as a chain and then
  // the draft tree's tokens, node i below node parents[i] or, for -1, below the context's last
  // token. Returns logits [u + n, vocab]: u rows for the uncached context (the last predicting the
  // tree's first level), then one per node. Sets *uncached = u (>= 1).
  at::Tensor forward_tree(std::span<const int64_t> context, std::span<const int64_t> tokens,
                          std::span<const int64_t> parents, int64_t* uncached)
    requires TreeTarget<M>
  {
    if (!use_cache_) cache_ = model_.make_cache(1);
    const auto known = static_cast<int64_t>(cache_.length());
    const int64_t u = static_cast<int64_t>(context.size()) - known;
    if (u < 1) throw std::logic_error("forward_tree: the context's last token must not be cached yet");
    tree_ids_.assign(context.begin() + known, context.end());
    tree_ids_.insert(tree_ids_.end(), tokens.begin(), tokens.end());
    tree_parents_.resize(tree_ids_.size());
    for (int64_t j = 0; j < u; ++j) tree_parents_[static_cast<size_t>(j)] = j - 1;
    for (size_t k = 0; k < parents.size(); ++k) {
      tree_parents_[static_cast<size_t>(u) + k] = parents[k] < 0 ? u - 1 : u + parents[k];
    }
    const at::Tensor ids = host_ids(tree_ids_, device_);
    *uncached = u;
    return timed(ids.size(1), ".forward_tree", [&] { return model_.forward_tree(ids, cache_, tree_parents_); });
  }

  // After forward_tree: keeps the first `prefix` positions (the context) and the tree nodes
  // `nodes` (increasing indices into the tree's tokens), dropping the other nodes.
  void keep_tree(int64_t prefix, std::span<const int64_t> nodes)
    requires TreeTarget<M>
  {
    if (!use_cache_) return;
    kept_.resize(nodes.size());
    for (size_t i = 0; i < nodes.size(); ++i) kept_[i] = prefix + nodes[i];
    cache_.keep(prefix, kept_);
  }

  // Keeps at most `length` cached positions: the accepted prefix after a verification.
  void truncate(int64_t length) {
    const auto cached = static_cast<int64_t>(cache_.length());
    if (use_cache_ && cached > length) cache_.prune(cached - length);
  }

 private:
  // Runs one forward of `count` tokens without recording a graph (weights may require grad),
  // counts it and its time, and checks and returns its logits [count, vocab].
  template <class Forward>
  at::Tensor timed(int64_t count, const char* call, Forward forward) {
    const auto start = std::chrono::steady_clock::now();
    at::NoGradGuard no_grad;
    const at::Tensor logits = forward();
    *counters_.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ++*counters_.calls;
    return checked(logits, count, call);
  }

  at::Tensor checked(const at::Tensor& logits, int64_t count, const char* call) const {
    if (!logits.defined() || logits.dim() != 3 || logits.size(0) != 1 || logits.size(1) != count ||
        logits.size(2) != vocab_ || !at::isFloatingType(logits.scalar_type())) {
      throw_invalid_message(role_, call, " must return floating-point logits [1, ", count, ", ", vocab_,
                            "], got ", logits.defined() ? logits.sizes() : at::IntArrayRef{});
    }
    return logits[0];
  }

  M& model_;
  std::string_view role_;
  bool use_cache_;
  ForwardCounters counters_;
  typename M::cache_type cache_;
  int64_t vocab_;
  at::Device device_;
  std::vector<int64_t> tree_ids_, tree_parents_, kept_;  // forward_tree / keep_tree buffers
};

}  // namespace specdec::detail
