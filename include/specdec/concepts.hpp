// The concepts through which an inference engine plugs its own models and policies into specdec.
//
// A model owns no hidden sequence state: its key/value cache is an explicit object that the
// generation loop holds, extends through forward() and prunes after a rejected draft. Tensors are
// at::Tensor (torch::Tensor is the same type).
#pragma once

#include <concepts>
#include <cstdint>
#include <optional>
#include <span>

#include "specdec/detail/torch_compat.hpp"

namespace specdec {

// KVCache: the per-sequence state of a LanguageModel, a run of cached positions that the
// generation loop can shorten.
//
// A type C satisfies KVCache if, for `c` a C and `cc` a const C:
//   1. `cc.length()` returns the number of positions the cache holds, convertible to int64_t.
//   2. `c.prune(n)` drops the last n positions, for 0 <= n <= length(); afterwards the cache is in
//      exactly the state it had when it held length() - n positions.
// Not required: a particular storage layout, batch rows of different lengths, copyability.
template <class C>
concept KVCache = requires(C& c, const C& cc, int64_t n) {
  { cc.length() } -> std::convertible_to<int64_t>;
  c.prune(n);
};

// ReorderableKVCache: a KVCache whose batch rows can be reselected, as beam search needs.
//
// A type C satisfies ReorderableKVCache if it satisfies KVCache and `c.reorder(rows)`, for rows
// an int64 tensor [batch], makes row i a copy of the old row rows[i] (rows may repeat).
template <class C>
concept ReorderableKVCache = KVCache<C> && requires(C& c, const at::Tensor& rows) { c.reorder(rows); };

// BatchedKVCache: a KVCache whose batch rows hold different numbers of positions, as batched
// speculative decoding needs (each row keeps its own accepted prefix).
//
// A type C satisfies BatchedKVCache if it satisfies KVCache and, for `c` a C:
//   1. `c.row_lengths()` returns each row's number of positions (one int64_t per batch row, a
//      contiguous range); length() is the longest.
//   2. `c.prune_rows(lengths)`, lengths a std::span<const int64_t> with one entry per row and
//      lengths[r] <= row_lengths()[r], leaves row r holding exactly its first lengths[r] positions.
//   3. `c.select_rows(rows)`, rows a std::span<const int64_t> of row indices, keeps those rows in
//      that order (the batch becomes rows.size(): finished requests leave the batch).
//   4. `c.ragged()` says whether the rows' lengths differ, and `c.device_row_lengths()` returns them
//      as int64 [batch] on the cache's device.
// A model over such a cache places row r's T new tokens at positions row_lengths()[r] + t, writes
// them there, and lets each attend to its own row's positions only; forward() then appends T
// positions to every row.
// Not required: that rows share storage, any particular padding.
template <class C>
concept BatchedKVCache =
    KVCache<C> && requires(C& c, const C& cc, std::span<const int64_t> lengths) {
      { cc.row_lengths() } -> std::convertible_to<std::span<const int64_t>>;
      c.prune_rows(lengths);
      c.select_rows(lengths);
      { cc.ragged() } -> std::convertible_to<bool>;
      { c.device_row_lengths() } -> std::convertible_to<at::Tensor>;
    };

// JoinableKVCache: a BatchedKVCache whose rows can come from separate caches and go back to
// them, as a server needs to verify many sessions (each with a cache of its own) in one forward.
//
// A type C satisfies JoinableKVCache if it satisfies BatchedKVCache and, for `c` a const C:
//   1. `C::join_rows(caches)`, caches a std::span<const C* const> of one-row caches (empty ones
//      included), returns a cache of caches.size() rows in which row r holds exactly the
//      positions of *caches[r] (rows may then be ragged). The caches are left unchanged.
//   2. `c.split_row(r)` returns a one-row cache holding exactly row r's row_lengths()[r]
//      positions; extending it never changes `c`'s other rows.
// Not required: that the joined cache shares storage with its parts (a copy is allowed), nor that
// a split row is independent of `c`'s storage.
template <class C>
concept JoinableKVCache = BatchedKVCache<C> && requires(const C& c, std::span<const C* const> caches, int64_t r) {
  { C::join_rows(caches) } -> std::same_as<C>;
  { c.split_row(r) } -> std::same_as<C>;
};

// AppendableKVCache: a BatchedKVCache that new rows can join, as continuous batching needs (a
// request joins a running batch between two steps, and finished ones leave it by select_rows()).
//
// A type C satisfies AppendableKVCache if it satisfies BatchedKVCache and, for `c` a C,
// `c.append_rows(n)`, n >= 0, adds n rows after the others holding no positions (row_lengths()
// gains n zeros), leaving the other rows' positions unchanged.
// Not required: that appending allocates nothing (StaticKVCache reuses the rows that
// select_rows() freed; DynamicKVCache copies).
// Optional: `c.append_rows_from(source)`, source a const C, appends source's rows with the
// positions they hold. Where a cache has it, an Engine prefills a joining request's prompt in a
// forward of its own and copies it in (both caches here have it); otherwise the prompt is fed in
// the next step's forward, which every running row is then padded to.
template <class C>
concept AppendableKVCache = BatchedKVCache<C> && requires(C& c, int64_t n) { c.append_rows(n); };

// CompactableKVCache: a KVCache that can keep a subset of its newest positions, as tree
// verification needs (the accepted path of a draft tree, the other branches dropped).
//
// A type C satisfies CompactableKVCache if it satisfies KVCache and `c.keep(prefix, positions)`,
// for 0 <= prefix <= length() and `positions` strictly increasing in [prefix, length()), leaves
// the cache holding positions [0, prefix) followed by `positions`, in that order: afterwards it
// is in exactly the state it would have had if only those positions had been appended.
template <class C>
concept CompactableKVCache = KVCache<C> && requires(C& c, int64_t prefix, std::span<const int64_t> positions) {
  c.keep(prefix, positions);
};

// LanguageModel: a causal language model whose sequence state lives in an explicit cache.
//
// A type M satisfies LanguageModel if, for `m` an M, `cm` a const M, `cache` an M::cache_type:
//   1. M::cache_type satisfies KVCache.
//   2. `cm.make_cache(batch)` returns an empty M::cache_type for `batch` rows.
//   3. `m.forward(ids, cache)` takes ids, int64 [batch, T] on cm.device(): the T tokens that
//      follow the cache.length() cached positions. It returns logits [batch, T, vocab] (floating
//      point), row t predicting the token after ids[:, t], and appends T positions to the cache.
//   4. `cm.vocab_size()` is the vocabulary size V; every token id is in [0, V).
//   5. `cm.device()` is the device of the ids it accepts and the logits it returns.
// Optional: `cm.max_sequence_length()`, the most positions the model can attend over; generation
// stops there when the model has it.
// Not required: thread safety, a particular dtype, batch > 1 support beyond what make_cache takes.
template <class M>
concept LanguageModel =
    KVCache<typename M::cache_type> &&
    requires(M& m, const M& cm, const at::Tensor& ids, typename M::cache_type& cache,
             int64_t batch) {
      { cm.make_cache(batch) } -> std::same_as<typename M::cache_type>;
      { m.forward(ids, cache) } -> std::convertible_to<at::Tensor>;
      { cm.vocab_size() } -> std::convertible_to<int64_t>;
      { cm.device() } -> std::convertible_to<at::Device>;
    };

// Target: the model whose output distribution speculative decoding reproduces exactly.
template <class M>
concept Target = LanguageModel<M>;

// TreeTarget: a Target that scores a whole draft tree in one forward (tree attention).
//
// A type M satisfies TreeTarget if it satisfies Target, M::cache_type satisfies
// CompactableKVCache, and for `m` an M, `m.forward_tree(ids, cache, parents)` takes ids int64
// [1, T] and parents, T entries with parents[i] in [-1, i): token i hangs below token parents[i],
// or directly below the cached positions when -1. Token i sits at position cache.length() +
// depth(i) (depth 0 below the cache) and attends to the cached positions, its ancestors and
// itself. It returns logits [1, T, vocab], row i predicting the token after the path to i, and
// appends T positions to the cache in index order. A chain (parents[i] = i - 1) is forward().
template <class M>
concept TreeTarget =
    Target<M> && CompactableKVCache<typename M::cache_type> &&
    requires(M& m, const at::Tensor& ids, typename M::cache_type& cache, std::span<const int64_t> parents) {
      { m.forward_tree(ids, cache, parents) } -> std::convertible_to<at::Tensor>;
    };

// MaskedTreeTarget: a TreeTarget that also takes a tree's layout as device tensors, for trees
// whose shape is decided on the device (dynamic draft trees: no host copy before the target's
// forward).
//
// A type M satisfies MaskedTreeTarget if it satisfies TreeTarget and, for `m` an M,
// `m.forward_with_mask(ids, cache, depth, visible)` takes ids int64 [1, T], depth int64 [T] and
// visible bool [T, T] on the model's device: token i sits at position cache.length() + depth[i]
// and attends to every cached position and to the new tokens j with visible[i][j] (its ancestors
// and itself). It returns logits [1, T, vocab] and appends T positions to the cache in index
// order, as forward_tree() does for the same tree.
template <class M>
concept MaskedTreeTarget =
    TreeTarget<M> && requires(M& m, const at::Tensor& ids, typename M::cache_type& cache, const at::Tensor& depth,
                              const at::Tensor& visible) {
      { m.forward_with_mask(ids, cache, depth, visible) } -> std::convertible_to<at::Tensor>;
    };

// A TreeTarget that keeps a draft tree's earlier rounds in its cache (a drafter growing a dynamic
// tree one round per forward): forward_with_cached_mask(ids [1, T], cache, positions, visible)
// places new token i at position positions[i] (int64 [T]) and lets it see the cache's entries
// before its newest W - T, and of the last W key columns (those W - T entries, then the T new
// tokens) the ones visible[i] marks (bool [T, W]); it returns logits [1, T, vocab] and appends the
// T tokens to the cache. cached_mask_applies(keys) says whether a forward over that many keys may
// run (false where attention reads the keys' positions, e.g. a sliding window shorter than them).
template <class M>
concept CachedMaskTreeModel =
    TreeTarget<M> && requires(M& m, const M& cm, const at::Tensor& t, typename M::cache_type& cache, int64_t keys) {
      { m.forward_with_cached_mask(t, cache, t, t) } -> std::convertible_to<at::Tensor>;
      { cm.cached_mask_applies(keys) } -> std::convertible_to<bool>;
    };

// What a FeatureTarget's forward returns: the logits forward() returns, and the hidden states
// asked for, side by side.
struct TargetOutput {
  at::Tensor logits;    // [batch, T, vocab]
  at::Tensor features;  // [batch, T, taps.size() * hidden_size()]: tap j in columns [j H, (j + 1) H)
};

// FeatureTarget: a Target whose forward can also return hidden states, as feature-level drafters
// (EAGLE-3, EAGLE, Medusa heads) read them.
//
// Hidden states are named as Hugging Face's output_hidden_states numbers them: for a model of L
// decoder layers, tap i < L is the input of decoder layer i (the residual stream before it; tap 0
// is the token embeddings), and tap L the final normalised state the classifier reads. EAGLE-3
// reads taps (2, L / 2, L - 3) by default, EAGLE-1 and Medusa tap L.
//
// A type M satisfies FeatureTarget if it satisfies Target and, for `m` an M, `cm` a const M:
//   1. `cm.hidden_size()` is the width H of a hidden state and `cm.num_hidden_layers()` is L.
//   2. `m.forward_features(ids, cache, taps)`, taps a std::span<const int64_t> of indices in
//      [0, L] (in any order, repeats allowed), does exactly what forward(ids, cache) does, returns
//      its logits unchanged, and the tapped hidden states of every new position as
//      TargetOutput::features, on the model's device. An index outside [0, L] is an
//      std::invalid_argument naming it, before anything is computed. With no taps, features is
//      undefined and the forward costs what forward() costs.
// FeatureTreeTarget: a FeatureTarget and TreeTarget whose `m.forward_tree_features(ids, cache,
// parents, taps)` is forward_tree() with the same features.
// MaskedFeatureTreeTarget: a FeatureTarget and MaskedTreeTarget whose
// `m.forward_with_mask_features(ids, cache, depth, visible, taps)` is forward_with_mask() with the
// same features: what the tree step needs of the target for a tree source that reads the
// target's hidden states (the EAGLE and Medusa heads' trees), checked when the step compiles.
// Not required: features in a particular dtype (the model's own).
template <class M>
concept FeatureTarget =
    Target<M> && requires(M& m, const M& cm, const at::Tensor& ids, typename M::cache_type& cache,
                          std::span<const int64_t> taps) {
      { cm.hidden_size() } -> std::convertible_to<int64_t>;
      { cm.num_hidden_layers() } -> std::convertible_to<int64_t>;
      { m.forward_features(ids, cache, taps) } -> std::same_as<TargetOutput>;
    };

template <class M>
concept FeatureTreeTarget =
    FeatureTarget<M> && TreeTarget<M> &&
    requires(M& m, const at::Tensor& ids, typename M::cache_type& cache, std::span<const int64_t> parents,
             std::span<const int64_t> taps) {
      { m.forward_tree_features(ids, cache, parents, taps) } -> std::same_as<TargetOutput>;
    };

template <class M>
concept MaskedFeatureTreeTarget =
    FeatureTarget<M> && MaskedTreeTarget<M> &&
    requires(M& m, const at::Tensor& ids, typename M::cache_type& cache, const at::Tensor& depth,
             const at::Tensor& visible, std::span<const int64_t> taps) {
      { m.forward_with_mask_features(ids, cache, depth, visible, taps) } -> std::same_as<TargetOutput>;
    };

// Drafter: the cheaper model that proposes draft tokens for the target to verify.
template <class M>
concept Drafter = LanguageModel<M>;

// LogitsProcessor: a sampling policy, turning logits into a distribution and drawing from it.
//
// A type P satisfies LogitsProcessor if, for `p` a const P, `logits` and `probs` tensors
// [..., vocab] and `gen` an at::Generator:
//   1. `p(logits)` returns probabilities of the same shape (floating point, each row sums to 1);
//      it never modifies `logits`.
//   2. `p.sample(probs, gen)` returns int64 indices [..., 1] drawn from `probs` using only `gen`
//      for randomness, so the same generator state gives the same indices.
// Not required: that sample() checks `probs` (the generation loop validates distributions itself).
template <class P>
concept LogitsProcessor = requires(const P& p, const at::Tensor& logits, const at::Tensor& probs,
                                   at::Generator& gen) {
  { p(logits) } -> std::convertible_to<at::Tensor>;
  { p.sample(probs, gen) } -> std::convertible_to<at::Tensor>;
};

// NGramDrafter: a model-free drafter that proposes the next token from statistics of the text
// (seed 000's INgramStorage), learning online.
//
// A type S satisfies NGramDrafter if, for `s` an S, `cs` a const S, and spans of token ids:
//   1. `cs.next_token(tokens)` returns the token it predicts after `tokens`, or nullopt when it
//      knows nothing about their end.
//   2. `s.update(tokens, next)` records that the end of `tokens` was followed by each token of
//      `next` (one observation each).
//   3. `s.initialize(tokens)` learns every n-gram of a whole sequence (the prompt).
// Not required: thread safety, any particular order or memory layout.
template <class S>
concept NGramDrafter = requires(S& s, const S& cs, std::span<const int64_t> tokens,
                                std::span<const int64_t> next) {
  { cs.next_token(tokens) } -> std::convertible_to<std::optional<int64_t>>;
  s.update(tokens, next);
  s.initialize(tokens);
};

// HasMaxSequenceLength: a model that states the most positions it can attend over.
template <class M>
concept HasMaxSequenceLength = requires(const M& cm) {
  { cm.max_sequence_length() } -> std::convertible_to<int64_t>;
};

}  // namespace specdec
