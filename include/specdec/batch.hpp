// Batched generation: many prompts at once, each row with its own acceptance. A step drafts for
// every active row together, the target scores all rows' drafts in one forward, verification
// decides per row in one tensor expression, and each row keeps only its own accepted prefix:
// its cache rows are pruned to its own length (BatchedKVCache). Rows finish independently and
// leave the batch, so finished requests cost nothing. A step costs one device-to-host copy for
// the whole batch. Drafts come from a drafter model (batched forwards), one shared n-gram storage,
// or a draft source per row (generate_with_batch: EAGLE and Medusa heads, fed their row of the
// target's hidden states). drafting/head_batches.hpp runs one head for all rows on this loop.
//
// Layout: rows are right-ragged. Row r's cached positions are its first row_lengths()[r], new
// tokens of a forward are placed at each row's own positions, and a shorter input is padded at
// its end (padding positions are never visible to real tokens and are pruned after the step).
// Against left padding this keeps every row's positions (RoPE) and cache writes contiguous from
// 0, needs no per-row shift when rows accept different numbers of drafts, and lets a row be
// pruned by moving its length alone; the cost is a per-row key mask over the longest row.
//
// Context limits: a padded forward writes every row's input width after the longest cached row,
// so it must fit under the model's limit as a whole, not only row by row. Each step therefore
// drafts no more than that rectangle leaves (BatchRunner::tail_room): while the longest row is
// within gamma tokens of the target's limit, every row drafts at most what that row has room for
// (a step or two, until it reaches the limit and leaves the batch). A row whose sequence outgrows
// the drafter's limit leaves the drafter's batch and goes on with the target alone, as it would
// alone. Rows stop at the target's limit with StopReason::sequence_limit; no forward is asked for
// more positions than a cache can hold, and the output of every row is what it would be alone.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/detail/check.hpp"
#include "specdec/detail/generation_state.hpp"
#include "specdec/detail/model_runner.hpp"
#include "specdec/detail/torch_compat.hpp"
#include "specdec/device.hpp"
#include "specdec/logits_processor.hpp"
#include "specdec/ngram_storage.hpp"
#include "specdec/options.hpp"
#include "specdec/result.hpp"
#include "specdec/row_processor.hpp"
#include "specdec/step.hpp"

namespace specdec {

// A model that generates batches of rows of different lengths.
template <class M>
concept BatchedLanguageModel = LanguageModel<M> && BatchedKVCache<typename M::cache_type>;

namespace detail {

// Gathers the rows of `logits` [b, width, V] at index[r] + j, j in [0, count): [b, count, V].
inline at::Tensor rows_from(const at::Tensor& logits, const at::Tensor& first, int64_t count) {
  const int64_t b = logits.size(0);
  const at::Tensor index = (first.view({b, 1}) + at::arange(count, first.options()).view({1, count}))
                               .unsqueeze(2)
                               .expand({b, count, logits.size(2)});
  return logits.gather(1, index);
}

// kFiniteDrafter for each of b rows whose drafter side was finite: its q (when drafts were
// sampled) and its drafter_finite flag (when given), as int64 [b].
inline at::Tensor drafter_flags(const at::Tensor& q, int64_t k, const at::Tensor& drafter_finite, int64_t b,
                                const at::Device& device) {
  at::Tensor ok = q.defined() && k > 0 ? at::isfinite(q.sum({1, 2}))
                                       : at::ones({b}, at::TensorOptions().dtype(at::kBool).device(device));
  if (drafter_finite.defined()) ok = ok.logical_and(drafter_finite.to(device));
  return ok.to(at::kLong) * kFiniteDrafter;
}

// Uniforms [b, k] for the acceptance of drafts at positions positions[r] + j: a processor with
// per-row seeds (RowProcessor) draws a seeded row's from its seed and the position, the others'
// (and every row of a processor without seeds) from `gen`.
template <LogitsProcessor P>
at::Tensor accept_uniforms(const P& processor, at::Generator& gen, const at::Tensor& positions, int64_t b, int64_t k,
                           const at::Device& device) {
  if constexpr (requires { processor.seeded(); }) {
    if (processor.seeded()) return processor.uniforms(gen, positions, k, RandomUse::accept).to(device);
  }
  return at::rand({b, k}, gen, at::TensorOptions().dtype(at::kDouble).device(gen.device())).to(device);
}

// One token per row of probs [b, V] for position positions[r] (as accept_uniforms draws).
template <LogitsProcessor P>
at::Tensor sample_rows(const P& processor, const at::Tensor& probs, at::Generator& gen, const at::Tensor& positions,
                       RandomUse use) {
  if constexpr (requires { processor.seeded(); }) {
    if (processor.seeded()) return processor.sample_at(probs, gen, positions, use);
  }
  return processor.sample(probs, gen);
}

// Per-row rejection sampling for a batch, one tensor expression: p [b, k + 1, V], q [b, k, V]
// (undefined: deterministic drafts, q one-hot), drafts int64 [b, k], valid int64 [b] (row r's
// drafts beyond valid[r] are padding and never accepted), drafter_finite bool [b] (whether the
// logits behind row r's deterministic drafts were finite; undefined: all were). Returns int64
// [b, 3 + k]: accepted, token, finite, drafts. positions int64 [b]: the index in row r's sequence
// of its first draft, where the processor has rows with seeds (undefined otherwise).
template <LogitsProcessor P>
at::Tensor verify_batch(const at::Tensor& p, const at::Tensor& q, const at::Tensor& drafts, const at::Tensor& valid,
                        const P& processor, at::Generator& gen, bool skip_sample_adjustment,
                        const at::Tensor& drafter_finite = {}, const at::Tensor& positions = {}) {
  const int64_t b = p.size(0);
  const int64_t k = drafts.size(1);
  const int64_t vocab = p.size(2);
  const auto as_double = at::TensorOptions().dtype(at::kDouble).device(p.device());
  const auto long_options = at::TensorOptions().dtype(at::kLong).device(p.device());
  at::Tensor accepted = at::zeros({b}, long_options);
  if (k > 0) {
    const at::Tensor index = drafts.unsqueeze(2);
    const at::Tensor p_drafted = p.narrow(1, 0, k).gather(2, index).squeeze(2).to(at::kDouble);
    const at::Tensor q_drafted = q.defined() ? q.gather(2, index).squeeze(2).to(at::kDouble) : at::ones({b, k}, as_double);
    const at::Tensor uniforms = accept_uniforms(processor, gen, positions, b, k, p.device());
    const at::Tensor in_range = at::arange(k, long_options).view({1, k}) < valid.view({b, 1});
    accepted = ((uniforms * q_drafted < p_drafted).logical_and(in_range)).to(at::kLong).cumprod(1).sum(1);
  }
  const at::Tensor p_row = rows_from(p, accepted, 1).squeeze(1).to(at::kDouble);  // [b, V]
  at::Tensor next = p_row;
  if (k > 0 && !skip_sample_adjustment) {
    const at::Tensor rejected = (accepted < valid).unsqueeze(1);  // [b, 1]
    const at::Tensor at_row = accepted.clamp_max(k - 1);
    const at::Tensor q_row = q.defined() ? rows_from(q, at_row, 1).squeeze(1).to(at::kDouble)
                                         : at::zeros({b, vocab}, as_double)
                                               .scatter_(1, drafts.gather(1, at_row.view({b, 1})), 1.0);
    const at::Tensor residual = (p_row - q_row * rejected).clamp_min(0.0);
    const at::Tensor mass = residual.sum(1, /*keepdim=*/true);
    next = at::where(mass > 0, residual / mass.clamp_min(1e-300), p_row);
  }
  const at::Tensor token =
      sample_rows(processor, next, gen, positions.defined() ? positions + accepted : positions, RandomUse::sample)
          .view({b, 1});
  const at::Tensor finite = at::isfinite(p.sum({1, 2})).to(at::kLong) * kFiniteTarget +
                            drafter_flags(q, k, drafter_finite, b, p.device());
  return at::cat({accepted.view({b, 1}), token.to(at::kLong), finite.view({b, 1}), drafts}, 1);
}

// verify_batch under greedy decoding, from the target's logits rows [b, k + 1, V] rather than
// their one-hot distributions: draft j of row r is accepted while it equals the first argmax and
// j < valid[r], and the token is the argmax after the accepted drafts. This is what verify_batch
// computes for one-hot p, whatever q; no distribution, uniform or float64 residual is built.
// Non-finite rows (NaN, +inf, or all -inf) are reported as GreedyProcessor's NaN would be.
inline at::Tensor verify_batch_greedy(const at::Tensor& rows, const at::Tensor& q, const at::Tensor& drafts,
                                      const at::Tensor& valid, const at::Tensor& drafter_finite = {}) {
  const int64_t b = rows.size(0);
  const int64_t k = drafts.size(1);
  const at::Tensor best = rows.argmax(2);  // [b, k + 1]
  at::Tensor accepted = at::zeros({b}, best.options());
  if (k > 0) {
    const at::Tensor in_range = at::arange(k, best.options()).view({1, k}) < valid.view({b, 1});
    accepted = best.narrow(1, 0, k).eq(drafts).logical_and(in_range).to(at::kLong).cumprod(1).sum(1);
  }
  const at::Tensor token = best.gather(1, accepted.view({b, 1}));
  const at::Tensor finite = at::isfinite(rows.amax(2)).all(1).to(at::kLong) * kFiniteTarget +
                            drafter_flags(q, k, drafter_finite, b, rows.device());
  return at::cat({accepted.view({b, 1}), token, finite.view({b, 1}), drafts}, 1);
}

// Host tokens of ragged rows as ids [rows, width] on `device`, row i's tokens first, zeros after.
inline at::Tensor padded_ids(const std::vector<std::span<const int64_t>>& rows, int64_t width, const at::Device& device,
                             std::vector<int64_t>& buffer) {
  buffer.assign(rows.size() * static_cast<size_t>(width), 0);
  for (size_t r = 0; r < rows.size(); ++r) std::copy(rows[r].begin(), rows[r].end(), buffer.begin() + static_cast<std::ptrdiff_t>(r * static_cast<size_t>(width)));
  return to_device<int64_t>(buffer, {static_cast<int64_t>(rows.size()), width}, device);
}

// A model and its batched cache, fed only each row's uncached tokens.
template <BatchedLanguageModel M>
class BatchRunner {
 public:
  BatchRunner(M& model, std::string_view role, int64_t batch, ForwardCounters counters)
      : model_(model), role_(role), cache_(model.make_cache(batch)), vocab_(static_cast<int64_t>(model.vocab_size())),
        limit_(sequence_limit(model)), device_(model.device()), counters_(counters),
        lengths_(static_cast<size_t>(batch), 0) {}
  // Adopts `cache`, a batched cache whose row r holds the first lengths[r] positions of row r's
  // sequence (the remote verifier joins its sessions' caches into one: remote/session_batch.hpp).
  BatchRunner(M& model, std::string_view role, typename M::cache_type cache, std::vector<int64_t> lengths,
              ForwardCounters counters)
      : model_(model), role_(role), cache_(std::move(cache)), vocab_(static_cast<int64_t>(model.vocab_size())),
        limit_(sequence_limit(model)), device_(model.device()), counters_(counters), lengths_(std::move(lengths)) {
    if (lengths_.size() != cache_.row_lengths().size()) {
      throw_invalid_message("BatchRunner: ", lengths_.size(), " lengths for a cache of ", cache_.row_lengths().size(),
                            " rows");
    }
  }

  [[nodiscard]] const at::Device& device() const noexcept { return device_; }
  [[nodiscard]] std::span<const int64_t> lengths() const noexcept { return lengths_; }
  [[nodiscard]] int64_t limit() const noexcept { return limit_; }
  // The batched cache (row r of it: the r-th sequence's positions, then its padding until prune()).
  [[nodiscard]] typename M::cache_type& cache() noexcept { return cache_; }

  // The most tail tokens a forward of `sequences` can take: its padded input (the widest row of
  // uncached tokens, then the tail) is placed after the longest cached row, and the whole must fit
  // under the model's limit. Negative when not even the uncached tokens fit.
  [[nodiscard]] int64_t tail_room(const std::vector<std::span<const int64_t>>& sequences) const {
    if (limit_ == std::numeric_limits<int64_t>::max()) return limit_;
    int64_t widest = 0;
    for (size_t r = 0; r < sequences.size(); ++r) {
      widest = std::max(widest, static_cast<int64_t>(sequences[r].size()) - lengths_[r]);
    }
    return limit_ - longest() - widest;
  }

  // The longest row the cache holds: where a forward's padded input begins.
  [[nodiscard]] int64_t longest() const noexcept {
    const auto rows = cache_.row_lengths();
    return rows.empty() ? 0 : *std::max_element(rows.begin(), rows.end());
  }

  // Makes every later forward() also tap these hidden states (FeatureTarget), kept as features()
  // until the next forward; empty: none (the default).
  void set_taps(std::span<const int64_t> taps)
    requires FeatureTarget<M>
  {
    taps_.assign(taps.begin(), taps.end());
  }
  // The tapped hidden states of the last forward(), [b, width, taps * hidden] on the device: row
  // r's index j is its sequence position fed_from()[r] + j. Undefined without taps.
  [[nodiscard]] const at::Tensor& features() const noexcept { return features_; }
  // Each row's first position the last forward() fed (the positions it held before).
  [[nodiscard]] std::span<const int64_t> fed_from() const noexcept { return fed_from_; }
  // The tapped states [1, prefix, taps * hidden] of positions 0..prefix - 1 that the last
  // add_row_prefilled() computed; undefined where it computed none (no taps, a one-token prompt,
  // a cache that fed the row with the others).
  [[nodiscard]] const at::Tensor& prefilled_features() const noexcept { return prefilled_features_; }

  // One forward over each row's uncached tokens of `sequences` followed by `tail` [b, k] (device
  // tokens, every row the same count). Returns logits [b, width, V] and, per row, the index of its
  // last uncached token's row (uncached[r] - 1), as int64 [b] on the device.
  std::pair<at::Tensor, at::Tensor> forward(const std::vector<std::span<const int64_t>>& sequences,
                                            const at::Tensor& tail) {
    const auto b = static_cast<int64_t>(sequences.size());
    uncached_rows_.clear();
    uncached_.clear();
    fed_from_.assign(lengths_.begin(), lengths_.end());
    int64_t width = 0;
    for (int64_t r = 0; r < b; ++r) {
      const auto seq = sequences[static_cast<size_t>(r)];
      const int64_t from = lengths_[static_cast<size_t>(r)];
      uncached_rows_.push_back(seq.subspan(static_cast<size_t>(from)));
      uncached_.push_back(static_cast<int64_t>(seq.size()) - from);
      width = std::max(width, uncached_.back());
    }
    const int64_t k = tail.defined() ? tail.size(1) : 0;
    at::Tensor ids = padded_ids(uncached_rows_, width + k, device_, buffer_);
    const at::Tensor last = to_device<int64_t>(uncached_, {b}, device_) - 1;
    if (k > 0) ids.scatter_(1, last.view({b, 1}) + 1 + at::arange(k, last.options()).view({1, k}), tail);
    at::Tensor logits;
    {
      ScopedTimer timer(*counters_.seconds);
      at::NoGradGuard no_grad;
      if constexpr (FeatureTarget<M>) {
        if (!taps_.empty()) {
          TargetOutput out = model_.forward_features(ids, cache_, taps_);
          logits = std::move(out.logits);
          features_ = std::move(out.features);
        } else {
          logits = model_.forward(ids, cache_);
        }
      } else {
        logits = model_.forward(ids, cache_);
      }
    }
    ++*counters_.calls;
    *counters_.positions += b * (width + k);
    check_model_logits(logits, b, width + k, vocab_, role_, ".forward");
    for (int64_t r = 0; r < b; ++r) lengths_[static_cast<size_t>(r)] += uncached_[static_cast<size_t>(r)] + k;
    // The rows hold their padding too until prune(): every row now has the same length.
    return {logits, last};
  }

  // One forward of `tail` [b, k] (device tokens) after every row's cached positions: logits
  // [b, k, V].
  at::Tensor forward_tail(const at::Tensor& tail) {
    const int64_t b = tail.size(0);
    const int64_t k = tail.size(1);
    at::Tensor logits;
    {
      ScopedTimer timer(*counters_.seconds);
      at::NoGradGuard no_grad;
      logits = model_.forward(tail, cache_);
    }
    ++*counters_.calls;
    *counters_.positions += b * k;
    check_model_logits(logits, b, k, vocab_, role_, ".forward");
    for (auto& length : lengths_) length += k;
    return logits;
  }

  // Row r keeps its first lengths[r] positions (at most what it holds).
  void prune(std::span<const int64_t> lengths) {
    for (size_t r = 0; r < lengths.size(); ++r) lengths_[r] = std::min(lengths_[r], lengths[r]);
    std::vector<int64_t> held(cache_.row_lengths().begin(), cache_.row_lengths().end());
    for (size_t r = 0; r < held.size(); ++r) held[r] = std::min(held[r], lengths_[r]);
    cache_.prune_rows(held);
  }

  // Keeps the rows `rows` (the batch shrinks as requests finish).
  void select(std::span<const int64_t> rows) {
    cache_.select_rows(rows);
    lengths_ = pick_rows(lengths_, rows);
  }

  // n rows of no positions join after the others (their whole sequences are fed next).
  void add_rows(int64_t n)
    requires AppendableKVCache<typename M::cache_type>
  {
    cache_.append_rows(n);
    lengths_.insert(lengths_.end(), static_cast<size_t>(n), 0);
  }

  // A row joins after the others with all but the last token of `sequence` prefilled by a forward
  // of its own (one row, in a scratch cache kept for the next), then copied into the batch's
  // cache: the batch's next forward feeds it one token, as the others, rather than every row
  // being padded to its prompt. Where the cache cannot take rows from another
  // (append_rows_from), the row joins empty (add_rows) and is prefilled with the others.
  // With taps (set_taps), the prefill's tapped states are prefilled_features() until the next
  // add_row_prefilled().
  void add_row_prefilled(std::span<const int64_t> sequence)
    requires AppendableKVCache<typename M::cache_type>
  {
    const auto prefix = static_cast<int64_t>(sequence.size()) - 1;
    prefilled_features_ = at::Tensor();
    if constexpr (requires(typename M::cache_type& c, const typename M::cache_type& from) { c.append_rows_from(from); }) {
      if (prefix > 0) {
        if (!scratch_) {
          scratch_.emplace(model_.make_cache(1));
        } else {
          scratch_->prune(scratch_->length());
        }
        const at::Tensor ids = to_device<int64_t>(sequence.first(static_cast<size_t>(prefix)), {1, prefix}, device_);
        {
          ScopedTimer timer(*counters_.seconds);
          at::NoGradGuard no_grad;
          if constexpr (FeatureTarget<M>) {
            if (!taps_.empty()) {
              prefilled_features_ = model_.forward_features(ids, *scratch_, taps_).features;
            } else {
              static_cast<void>(model_.forward(ids, *scratch_));
            }
          } else {
            static_cast<void>(model_.forward(ids, *scratch_));
          }
        }
        ++*counters_.calls;
        *counters_.positions += prefix;
        cache_.append_rows_from(*scratch_);
        lengths_.push_back(prefix);
        return;
      }
    }
    add_rows(1);
  }

 private:
  M& model_;
  std::string_view role_;
  typename M::cache_type cache_;
  int64_t vocab_;
  int64_t limit_;  // the model's max_sequence_length(), or no limit
  at::Device device_;
  ForwardCounters counters_;
  std::vector<int64_t> lengths_;  // positions each row holds that belong to its sequence
  std::vector<std::span<const int64_t>> uncached_rows_;
  std::vector<int64_t> uncached_, buffer_;
  std::vector<int64_t> taps_, fed_from_;  // set_taps(), fed_from()
  at::Tensor features_;                   // features()
  at::Tensor prefilled_features_;         // prefilled_features()
  std::optional<typename M::cache_type> scratch_;  // add_row_prefilled()'s one-row cache
};

// Drafts of a batch step: tokens [b, k], their q [b, k, V] (or undefined), valid [b] drafts per
// row (host), and finite bool [b]: whether the logits behind each row's deterministic drafts were
// finite (undefined: nothing to check).
struct BatchDrafts {
  at::Tensor tokens{};
  at::Tensor probs{};
  std::vector<int64_t> valid{};
  at::Tensor finite{};
};

// What a batch step decided, for the drafting to learn from; index i is the step's i-th row.
struct BatchStep {
  std::span<const std::span<const int64_t>> sequences{};  // each row's sequence after the step
  std::span<const int64_t> positions{};  // each row's length before it (its first draft's position)
  std::span<const int64_t> drafted{};    // drafts verified per row
  std::span<const int64_t> accepted{};   // leading drafts accepted per row
  std::span<const int64_t> kept{};       // positions each row keeps cached (positions + accepted)
  std::span<const uint8_t> finished{};   // rows that finished with this step (1) and leave
  // The target's tapped hidden states (when the drafting asked for feature_taps()), on its device:
  // [b, width, taps * hidden], row i's index j at sequence position features_from[i] + j; rows
  // hold every position the step fed them up to their last accepted draft, then padding.
  at::Tensor features{};
  std::span<const int64_t> features_from{};
};

// One row of a running batch: the sequence it generates (prompt first), its stopping rules and
// the most drafts a step verifies for it.
struct BatchRow {
  int64_t tag = 0;  // the caller's name for the row: a prompt's index, a request's id
  std::unique_ptr<std::vector<int64_t>> sequence{};  // null where it generates onto the caller's
  std::unique_ptr<GenerationState> state{};
  int64_t gamma = 0;     // drafts per step; 0: the target alone
  bool stepped = false;  // whether it took a step (first_target keeps drafts from its first)
};

// What a row did in a step: where its new tokens begin and, when it finished, its result.
struct RowOutcome {
  int64_t tag = 0;
  int64_t position = 0;  // the row's length before the step: its new tokens follow
  int64_t drafted = 0;   // drafts the target verified for it
  int64_t accepted = 0;  // of which it accepted (leading)
  std::optional<GenerationResult> result{};
  // BatchCore::step_rows: why the row's verification failed (the row then took no step).
  std::exception_ptr error{};
};

// What a step cost, for a draft-length rule to learn from.
struct StepCost {
  int64_t columns = 0;           // drafts per row the step verified (the widest row's)
  int64_t positions = 0;         // positions the target's forward computed (rows x width)
  double target_seconds = 0;     // the target's forward
  double drafter_seconds = 0;    // the drafting, and what it learned after the step
};

// The step of batched generation, for rows that join and leave between steps (the one step
// that batch generation, the Engine and the remote verifier's joined forwards share). Drafting: draft(active rows' sequences, rooms, k,
// processor, gen, stats) -> BatchDrafts of at most k drafts per row (rooms[i] <= k: what row i
// can verify; fewer columns where the drafter's own context allows fewer), after(BatchStep)
// after every step, select(rows) when rows leave; with feature_taps(), the target's forwards tap
// them and the steps hand them on. A step with no drafts is target-only (autoregressive
// decoding, a first target step). `limit` is the target's: rows stop there.
template <BatchedLanguageModel T>
class BatchCore {
 public:
  // The target's cache starts with `rows` rows (make_cache(rows)), which add() fills in order;
  // rows beyond them are appended (AppendableKVCache).
  BatchCore(T& target, int64_t rows, int64_t limit, std::optional<uint64_t> seed)
      : target_(target),
        runner_(target, "target", rows,
                {.calls = &shared_.target_calls, .seconds = &shared_.target_seconds,
                 .positions = &shared_.target_positions}),
        limit_(limit),
        gen_(make_generator(seed, target.device())) {}
  // A batch over `cache`, whose row r holds the first cached[r] positions of the r-th row add()
  // adds (the remote verifier's sessions, their caches joined: remote/session_batch.hpp).
  BatchCore(T& target, typename T::cache_type cache, std::vector<int64_t> cached, int64_t limit)
      : target_(target),
        runner_(target, "target", std::move(cache), std::move(cached),
                {.calls = &shared_.target_calls, .seconds = &shared_.target_seconds,
                 .positions = &shared_.target_positions}),
        limit_(limit),
        gen_(make_generator(0, target.device())) {}

  // Gives back every row of the target's cache before the first add() (an engine starts empty,
  // its cache allocated for the rows it will hold).
  void release_rows() {
    if (!rows_.empty()) throw std::logic_error("BatchCore::release_rows: rows have joined");
    runner_.select({});
  }

  [[nodiscard]] std::span<const BatchRow> rows() const noexcept { return rows_; }
  [[nodiscard]] bool empty() const noexcept { return rows_.empty(); }
  [[nodiscard]] at::Generator& generator() noexcept { return gen_; }
  // Counts of the forwards the rows shared (each row's stats count them whole).
  [[nodiscard]] const GenerationStats& shared() const noexcept { return shared_; }
  // The target's batched cache: row i holds rows()[i]'s positions.
  [[nodiscard]] typename T::cache_type& cache() noexcept { return runner_.cache(); }
  // The target's tapped states of the prompt that the last add() prefilled alone (see
  // BatchRunner::prefilled_features).
  [[nodiscard]] at::Tensor prefilled_features() const { return prefilled_ ? runner_.prefilled_features() : at::Tensor(); }

  template <class Drafting>
  void set_taps(const Drafting& drafting) {
    if constexpr (requires { drafting.feature_taps(); }) {
      static_assert(FeatureTarget<T>, "a draft source with feature_taps() needs a target that models FeatureTarget");
      runner_.set_taps(drafting.feature_taps());
    }
  }

  // Whether a row of `prompt` tokens would fit the next forward beside the others: its whole
  // prompt is fed with them, after the longest cached row.
  [[nodiscard]] bool fits(std::span<const int64_t> prompt) {
    views_.clear();
    for (const BatchRow& row : rows_) views_.push_back(row.state->sequence());
    if (runner_.tail_room(views_) < 0) return false;
    if (limit_ == std::numeric_limits<int64_t>::max()) return true;
    return runner_.longest() + static_cast<int64_t>(prompt.size()) <= limit_;
  }

  // A new row after the others, generating after `prompt` under `options` (its own end tokens,
  // stop sequences, max_new_tokens and callback). Returns its result instead where it ends
  // before a step (max_new_tokens 0, a prompt at the limit): such a row is never added.
  // `prefill_alone`: a row appended to the cache has its prompt prefilled by a forward of its own
  // (BatchRunner::add_row_prefilled), not in the next step's forward beside the others.
  template <class Options>
  std::optional<GenerationResult> add(int64_t tag, std::span<const int64_t> prompt, const Options& options,
                                      int64_t gamma, bool prefill_alone = false) {
    auto owned = std::make_unique<std::vector<int64_t>>(prompt.begin(), prompt.end());
    std::vector<int64_t>& sequence = *owned;
    return join(BatchRow{.tag = tag, .sequence = std::move(owned), .gamma = gamma}, sequence, options, prefill_alone);
  }
  // add() onto the caller's `sequence`, which must outlive the row: the row's tokens are appended
  // to it in place, nothing is copied (the remote verifier's sessions: remote/session_batch.hpp).
  template <class Options>
  std::optional<GenerationResult> add_onto(int64_t tag, std::vector<int64_t>& sequence, const Options& options,
                                           int64_t gamma) {
    return join(BatchRow{.tag = tag, .gamma = gamma}, sequence, options, /*prefill_alone=*/false);
  }

  // Keeps the rows `keep` (indices into rows(), increasing); the others leave without a result.
  template <class Drafting>
  void keep(std::span<const int64_t> rows, Drafting& drafting) {
    std::vector<BatchRow> kept;
    for (const int64_t i : rows) kept.push_back(std::move(rows_[static_cast<size_t>(i)]));
    rows_ = std::move(kept);
    runner_.select(rows);
    drafting.select(rows);
  }

  // Row i's result as it stands (for a row that leaves unfinished: the caller then drops it).
  [[nodiscard]] GenerationResult result_of(size_t i) { return std::move(*rows_[i].state).finish(); }

  // One step of every row: drafts, one target forward, verification, one host copy. Appends an
  // outcome per row to `out`; rows that finish leave the batch.
  // At most `draft_limit` drafts per row (a draft-length rule's choice; each row's gamma caps its
  // own). Returns what the step cost.
  template <class Drafting, LogitsProcessor P>
  StepCost step(Drafting& drafting, const P& processor, bool first_target, bool skip_sample_adjustment,
                std::vector<RowOutcome>& out, int64_t draft_limit = std::numeric_limits<int64_t>::max()) {
    BatchVerification<P> verification{*this, processor, skip_sample_adjustment};
    return run_step(drafting, processor, first_target, out, draft_limit, verification);
  }

  // One step of every row as step() takes it, each row verified apart:
  // verify(i, rows, drafts) -> PendingStep, for row i's logits rows [d + 1, V] and its d drafts
  // (int64 [d], on the target's device), with the row's own processor, generator and mode
  // (verify_chain). The whole step still costs one host copy. A row whose verdict the host
  // refuses (read_step: std::invalid_argument, a draft its q makes impossible) takes no step: its
  // outcome holds the error, its sequence stays as it was and its cache keeps it. Drafting is as
  // step()'s, under no processor (the drafts must come from elsewhere: the remote verifier's
  // clients).
  template <class Drafting, class Verify>
  StepCost step_rows(Drafting& drafting, Verify&& verify, std::vector<RowOutcome>& out) {
    RowVerification<Verify> verification{std::forward<Verify>(verify)};
    return run_step(drafting, GreedyProcessor{}, /*first_target=*/false, out, std::numeric_limits<int64_t>::max(),
                    verification);
  }

 private:
  // A row's verdict, read on the host: its accepted drafts and the target's token, or the error
  // that stops it.
  struct Verdict {
    int64_t accepted = 0;
    int64_t token = 0;
    std::span<const int64_t> drafts{};
    std::exception_ptr error{};
  };

  // Every row verified at once under the step's processor (verify_batch): a non-finite row fails
  // the whole step.
  template <LogitsProcessor P>
  struct BatchVerification {
    BatchCore& core;
    const P& processor;
    bool skip_sample_adjustment = false;
    int64_t stride = 0;
    at::Tensor target_rows{};

    at::Tensor packed(const at::Tensor& rows, const at::Tensor& q, const at::Tensor& drafts,
                      std::span<const int64_t> valid, const at::Tensor& drafter_finite) {
      stride = 3 + drafts.size(1);
      target_rows = rows;
      const at::Tensor valid_rows = to_device<int64_t>(valid, {rows.size(0)}, core.target_.device());
      return core.verify(rows, q, drafts, valid_rows, drafter_finite, processor, skip_sample_adjustment);
    }
    void read(const int64_t* values, std::vector<Verdict>& verdicts) const {
      const auto b = target_rows.size(0);
      for (int64_t i = 0; i < b; ++i) {
        if (values[i * stride + 2] != kFinite) {
          throw_step_non_finite("speculative_generate_batch", values[i * stride + 2], target_rows);
        }
      }
      for (int64_t i = 0; i < b; ++i) {
        const int64_t* row = values + i * stride;
        verdicts.push_back({.accepted = row[0], .token = row[1], .drafts = {row + 3, static_cast<size_t>(stride - 3)}});
      }
    }
  };

  // Each row verified apart (step_rows).
  template <class Verify>
  struct RowVerification {
    Verify verify;
    std::vector<PendingStep> pending{};
    std::vector<at::Tensor> rows{};
    std::vector<VerifiedStep> steps{};

    at::Tensor packed(const at::Tensor& target_rows, const at::Tensor& /*q*/, const at::Tensor& drafts,
                      std::span<const int64_t> valid, const at::Tensor& /*drafter_finite*/) {
      std::vector<at::Tensor> parts;
      for (int64_t i = 0; i < target_rows.size(0); ++i) {
        const int64_t d = valid[static_cast<size_t>(i)];
        rows.push_back(target_rows[i].narrow(0, 0, d + 1));
        pending.push_back(verify(i, rows.back(), drafts[i].narrow(0, 0, d)));
        parts.push_back(pending.back().packed);
      }
      return at::cat(parts);
    }
    void read(const int64_t* values, std::vector<Verdict>& verdicts) {
      steps.reserve(pending.size());  // the verdicts' drafts point into the steps
      for (size_t i = 0; i < pending.size(); ++i) {
        try {
          steps.push_back(read_step(pending[i], values, rows[i]));
          verdicts.push_back({.accepted = steps.back().accepted, .token = steps.back().token, .drafts = steps.back().drafts});
        } catch (const std::invalid_argument&) {
          steps.emplace_back();
          verdicts.push_back({.error = std::current_exception()});
        }
        values += pending[i].size();
      }
    }
  };

  // add() and add_onto(): `row` generates onto `sequence` (its own, or the caller's).
  template <class Options>
  std::optional<GenerationResult> join(BatchRow row, std::vector<int64_t>& sequence, const Options& options,
                                       bool prefill_alone) {
    row.state = std::make_unique<GenerationState>(sequence, options, limit_);
    row.state->set_row(row.tag);
    prefilled_ = false;
    if (row.state->finished()) return std::move(*row.state).finish();
    if (rows_.size() == runner_.lengths().size()) {
      if constexpr (AppendableKVCache<typename T::cache_type>) {
        if (prefill_alone) {
          runner_.add_row_prefilled(sequence);
          prefilled_ = true;
        } else {
          runner_.add_rows(1);
        }
      } else {
        throw std::logic_error("BatchCore::add: the target's cache holds no free row and cannot append one");
      }
    }
    rows_.push_back(std::move(row));
    return std::nullopt;
  }

  template <class Drafting, LogitsProcessor P, class Verification>
  StepCost run_step(Drafting& drafting, const P& processor, bool first_target, std::vector<RowOutcome>& out,
                    int64_t draft_limit, Verification& verification) {
    const c10::InferenceMode inference;  // no autograd in the loop (see run_generation)
    const auto b = static_cast<int64_t>(rows_.size());
    if (b == 0) return {};
    const GenerationStats before = shared_;
    views_.clear();
    positions_.clear();
    rooms_.clear();
    int64_t k = 0;
    for (const BatchRow& row : rows_) {
      views_.push_back(row.state->sequence());
      positions_.push_back(row.state->length());
      const int64_t room = row.state->room() - 1;
      const bool held_back = !row.stepped && first_target;
      rooms_.push_back(held_back ? 0 : std::max<int64_t>(0, std::min({row.gamma, room, draft_limit})));
      k = std::max(k, rooms_.back());
    }
    // The target's padded forward must fit too (see the top of this file).
    const int64_t fits = std::max<int64_t>(0, runner_.tail_room(views_));
    if (k > fits) {
      k = fits;
      for (auto& room : rooms_) room = std::min(room, fits);
    }
    BatchDrafts drafts;
    const double drafter_before = shared_.drafter_seconds;
    if (k > 0) {
      ScopedTimer timer(shared_.drafter_seconds);
      drafts = drafting.draft(views_, rooms_, k, processor, gen_, shared_);
      // A drafter near its own limit drafts fewer.
      k = drafts.tokens.defined() ? drafts.tokens.size(1) : 0;
    }
    for (int64_t i = 0; i < b; ++i) {
      const int64_t made = k > 0 ? drafts.valid[static_cast<size_t>(i)] : 0;
      rooms_[static_cast<size_t>(i)] = std::min(rooms_[static_cast<size_t>(i)], made);
    }
    const double target_before = shared_.target_seconds;
    const int64_t calls_before = shared_.target_calls;
    const auto [logits, last] = runner_.forward(views_, k > 0 ? drafts.tokens : at::Tensor());
    const at::Tensor target_rows = rows_from(logits, last, k + 1);
    const at::Tensor draft_tokens =
        k > 0 ? drafts.tokens : at::empty({b, 0}, at::TensorOptions().dtype(at::kLong).device(target_.device()));
    const at::Tensor q = k > 0 ? drafts.probs : at::Tensor();
    const at::Tensor host = to_host(verification.packed(target_rows, q, draft_tokens, rooms_, drafts.finite));
    verdicts_.clear();
    verification.read(host.data_ptr<int64_t>(), verdicts_);
    prune_to_.clear();
    accepted_.clear();
    finished_.clear();
    for (int64_t i = 0; i < b; ++i) {
      const Verdict& verdict = verdicts_[static_cast<size_t>(i)];
      BatchRow& batch_row = rows_[static_cast<size_t>(i)];
      GenerationState& state = *batch_row.state;
      GenerationStats& stats = state.stats();
      // The shared forwards, counted whole in every row that took part.
      stats.target_calls += shared_.target_calls - calls_before;
      stats.target_seconds += shared_.target_seconds - target_before;
      stats.drafter_seconds += shared_.drafter_seconds - drafter_before;
      stats.drafter_calls += k > 0 ? drafts.valid[static_cast<size_t>(i)] : 0;
      prune_to_.push_back(positions_[static_cast<size_t>(i)] + verdict.accepted);
      accepted_.push_back(verdict.accepted);
      if (!verdict.error) {
        const int64_t made = rooms_[static_cast<size_t>(i)];
        EmittedStep emitted{.drafts = verdict.drafts.first(static_cast<size_t>(made)),
                            .accepted = verdict.accepted,
                            .token = verdict.token};
        if (k > 0) emitted.gamma = made;
        state.emit(emitted);
        batch_row.stepped = true;
      }
      finished_.push_back(state.finished() ? 1 : 0);
    }
    runner_.prune(prune_to_);
    views_.clear();
    for (const BatchRow& row : rows_) views_.push_back(row.state->sequence());
    {
      // What the drafting learns from the step is drafter time, in every row that took part.
      const double before = shared_.drafter_seconds;
      {
        ScopedTimer timer(shared_.drafter_seconds);
        drafting.after(BatchStep{.sequences = views_,
                                 .positions = positions_,
                                 .drafted = rooms_,
                                 .accepted = accepted_,
                                 .kept = prune_to_,
                                 .finished = finished_,
                                 .features = runner_.features(),
                                 .features_from = runner_.fed_from()});
      }
      for (BatchRow& row : rows_) row.state->stats().drafter_seconds += shared_.drafter_seconds - before;
    }
    // Finished rows leave the batch.
    local_keep_.clear();
    for (int64_t i = 0; i < b; ++i) {
      BatchRow& row = rows_[static_cast<size_t>(i)];
      RowOutcome outcome{.tag = row.tag,
                         .position = positions_[static_cast<size_t>(i)],
                         .drafted = rooms_[static_cast<size_t>(i)],
                         .accepted = accepted_[static_cast<size_t>(i)],
                         .error = verdicts_[static_cast<size_t>(i)].error};
      if (row.state->finished()) {
        outcome.result = std::move(*row.state).finish();
      } else {
        local_keep_.push_back(i);
      }
      out.push_back(std::move(outcome));
    }
    if (local_keep_.size() != rows_.size()) keep(std::span<const int64_t>(local_keep_), drafting);
    return StepCost{.columns = k,
                    .positions = shared_.target_positions - before.target_positions,
                    .target_seconds = shared_.target_seconds - before.target_seconds,
                    .drafter_seconds = shared_.drafter_seconds - before.drafter_seconds};
  }

  template <LogitsProcessor P>
  at::Tensor verify(const at::Tensor& target_rows, const at::Tensor& q, const at::Tensor& drafts, const at::Tensor& valid,
                    const at::Tensor& drafter_finite, const P& processor, bool skip_sample_adjustment) {
    if constexpr (std::is_same_v<P, GreedyProcessor>) {
      return verify_batch_greedy(target_rows, q, drafts, valid, drafter_finite);
    } else {
      // A processor whose every row is greedy (RowProcessor) verifies as GreedyProcessor does.
      if constexpr (requires { processor.greedy(); }) {
        if (processor.greedy()) return verify_batch_greedy(target_rows, q, drafts, valid, drafter_finite);
      }
      at::Tensor positions;
      if constexpr (requires { processor.seeded(); }) {
        if (processor.seeded()) positions = to_device<int64_t>(positions_, {target_rows.size(0)}, target_.device());
      }
      return verify_batch(processor(target_rows), q, drafts, valid, processor, gen_, skip_sample_adjustment,
                          drafter_finite, positions);
    }
  }
  T& target_;
  GenerationStats shared_;  // the forwards every row took part in: calls and times
  BatchRunner<T> runner_;
  int64_t limit_;
  at::Generator gen_;
  bool prefilled_ = false;  // whether the last add() prefilled its row alone
  std::vector<BatchRow> rows_;
  std::vector<std::span<const int64_t>> views_;
  std::vector<int64_t> positions_, rooms_, prune_to_, accepted_, local_keep_;
  std::vector<uint8_t> finished_;
  std::vector<Verdict> verdicts_;
};

// Generation of a fixed batch: every prompt joins before the first step, and the steps run until
// every row has finished. Returns one result per prompt, in order.
template <BatchedLanguageModel T, class Drafting, LogitsProcessor P>
std::vector<GenerationResult> run_batch(T& target, std::span<const std::vector<int64_t>> prompts,
                                        const SpeculativeOptions& options, const P& processor, Drafting& drafting,
                                        int64_t limit, bool draft) {
  const auto batch = static_cast<int64_t>(prompts.size());
  std::vector<GenerationResult> results(static_cast<size_t>(batch));
  // Rows that end before the first step (max_new_tokens 0, a prompt at the limit) never join.
  std::vector<int64_t> joining;
  for (int64_t r = 0; r < batch; ++r) {
    const auto& prompt = prompts[static_cast<size_t>(r)];
    if (std::min(options.max_new_tokens, limit - static_cast<int64_t>(prompt.size())) > 0) {
      joining.push_back(r);
      continue;
    }
    std::vector<int64_t> sequence = prompt;
    GenerationState state(sequence, options, limit);
    if constexpr (requires { drafting.finished_before_start(r, std::span<const int64_t>{}); }) {
      drafting.finished_before_start(r, std::span<const int64_t>(prompt));
    }
    results[static_cast<size_t>(r)] = std::move(state).finish();
  }
  if (joining.empty()) return results;
  if (joining.size() != static_cast<size_t>(batch)) drafting.select(joining);
  BatchCore<T> core(target, static_cast<int64_t>(joining.size()), limit, options.seed);
  for (const int64_t r : joining) {
    // Never finished here (checked above).
    static_cast<void>(core.add(r, prompts[static_cast<size_t>(r)], options, draft ? options.gamma : 0));
  }
  core.set_taps(drafting);
  std::vector<RowOutcome> outcomes;
  while (!core.empty()) {
    outcomes.clear();
    core.step(drafting, processor, options.first_target, options.skip_sample_adjustment, outcomes);
    for (RowOutcome& outcome : outcomes) {
      if (outcome.result) results[static_cast<size_t>(outcome.tag)] = std::move(*outcome.result);
    }
  }
  return results;
}

// No drafts: autoregressive decoding of a batch.
struct NoBatchDrafts {
  template <LogitsProcessor P>
  BatchDrafts draft(const std::vector<std::span<const int64_t>>&, std::span<const int64_t>, int64_t, const P&,
                    at::Generator&, GenerationStats&) {
    return {};
  }
  void after(const BatchStep&) {}
  void select(std::span<const int64_t>) {}
};

// The processor of `rows` of a batch of `batch` rows: the processor itself, or, where it holds
// parameters per row (RowProcessor), those rows' own.
template <LogitsProcessor P>
P rows_processor(const P& processor, std::span<const int64_t> rows, int64_t batch) {
  if constexpr (requires { { processor.rows(rows) } -> std::same_as<P>; }) {
    if (static_cast<int64_t>(rows.size()) != batch) return processor.rows(rows);
  }
  return processor;
}

// A drafter model over the batch: k tokens per row, sampled row by row in batched forwards.
// A row whose sequence no longer fits the drafter's context leaves the drafter's batch (its cache
// row is dropped) and drafts nothing from then on: the target goes on with it alone.
template <BatchedLanguageModel D>
class ModelBatchDrafts {
 public:
  ModelBatchDrafts(D& drafter, int64_t batch)
      : runner_(drafter, "drafter", batch, {.calls = &calls_, .seconds = &seconds_, .positions = &positions_}),
        row_of_(static_cast<size_t>(batch)) {
    for (int64_t r = 0; r < batch; ++r) row_of_[static_cast<size_t>(r)] = r;
  }

  template <LogitsProcessor P>
  BatchDrafts draft(const std::vector<std::span<const int64_t>>& sequences, std::span<const int64_t> /*rooms*/,
                    int64_t k, const P& processor, at::Generator& gen, GenerationStats& /*shared*/) {
    const auto b = static_cast<int64_t>(sequences.size());
    leave_where_full(sequences);
    members_.clear();
    member_sequences_.clear();
    int64_t longest = 0;
    for (int64_t i = 0; i < b; ++i) {
      if (row_of_[static_cast<size_t>(i)] < 0) continue;
      members_.push_back(i);
      member_sequences_.push_back(sequences[static_cast<size_t>(i)]);
      longest = std::max(longest, static_cast<int64_t>(sequences[static_cast<size_t>(i)].size()));
    }
    // Drafting k tokens feeds the longest row k - 1 positions past its sequence.
    if (runner_.limit() != std::numeric_limits<int64_t>::max()) k = std::min(k, runner_.limit() - longest + 1);
    if (members_.empty() || k <= 0) return BatchDrafts{.tokens = {}, .probs = {}, .valid = std::vector<int64_t>(static_cast<size_t>(b), 0)};
    const auto m = static_cast<int64_t>(members_.size());
    const P member_processor = rows_processor(processor, members_, b);
    // Where rows have seeds, column j of member i drafts position |sequence| + j.
    at::Tensor positions;
    if constexpr (requires { member_processor.seeded(); }) {
      if (member_processor.seeded()) {
        lengths_.clear();
        for (const auto& sequence : member_sequences_) lengths_.push_back(static_cast<int64_t>(sequence.size()));
        positions = to_device<int64_t>(lengths_, {m}, runner_.device());
      }
    }
    std::vector<at::Tensor> tokens, probs;
    at::Tensor next;
    for (int64_t j = 0; j < k; ++j) {
      at::Tensor last_logits;
      if (j == 0) {
        const auto [logits, last] = runner_.forward(member_sequences_, at::Tensor());
        last_logits = rows_from(logits, last, 1).squeeze(1);
        // The padding after shorter rows' inputs is no part of them.
        lengths_.clear();
        for (const auto& s : member_sequences_) lengths_.push_back(static_cast<int64_t>(s.size()));
        runner_.prune(lengths_);
      } else {
        last_logits = runner_.forward_tail(next).select(1, 0);
      }
      const at::Tensor q = member_processor(last_logits);  // [m, V]
      next = sample_rows(member_processor, q, gen, positions.defined() ? positions + j : positions, RandomUse::draft)
                 .view({m, 1});
      tokens.push_back(next);
      probs.push_back(q.unsqueeze(1));
    }
    BatchDrafts result{at::cat(tokens, 1), at::cat(probs, 1), std::vector<int64_t>(static_cast<size_t>(b), 0)};
    for (const int64_t i : members_) result.valid[static_cast<size_t>(i)] = k;
    if (m < b) {  // rows without drafts: padding tokens and zero q, never accepted (valid 0)
      const at::Tensor index = to_device<int64_t>(members_, {m}, result.tokens.device());
      result.tokens = at::zeros({b, k}, result.tokens.options()).index_copy_(0, index, result.tokens);
      result.probs = at::zeros({b, k, result.probs.size(2)}, result.probs.options()).index_copy_(0, index, result.probs);
    }
    return result;
  }

  void after(const BatchStep& step) {
    lengths_.clear();
    for (size_t i = 0; i < row_of_.size(); ++i) {
      if (row_of_[i] >= 0) lengths_.push_back(step.kept[i]);
    }
    if (!lengths_.empty()) runner_.prune(lengths_);
  }

  // The batch keeps the rows `rows`; the drafter keeps those of them it still drafts for.
  void select(std::span<const int64_t> rows) {
    std::vector<int64_t> row_of;
    kept_.clear();
    for (const int64_t i : rows) {
      const int64_t row = row_of_[static_cast<size_t>(i)];
      row_of.push_back(row < 0 ? -1 : static_cast<int64_t>(kept_.size()));
      if (row >= 0) kept_.push_back(row);
    }
    if (kept_.size() != runner_.lengths().size()) runner_.select(kept_);
    row_of_ = std::move(row_of);
  }

  // The positions the drafter's forwards computed so far (padded rows times tokens), and the
  // batch rows it drafts for now.
  [[nodiscard]] int64_t positions() const noexcept { return positions_; }
  [[nodiscard]] int64_t members() const noexcept {
    return static_cast<int64_t>(std::count_if(row_of_.begin(), row_of_.end(), [](int64_t row) { return row >= 0; }));
  }
  // The positions its next draft's first forward computes for `sequences` beyond the two a row
  // brings after a drafting step (what target-only steps emitted, a prompt fed at a first draft):
  // every member is padded to the widest.
  [[nodiscard]] int64_t catch_up_positions(const std::vector<std::span<const int64_t>>& sequences) const {
    const auto cached = runner_.lengths();
    int64_t members = 0, widest = 0;
    for (size_t i = 0; i < row_of_.size(); ++i) {
      if (row_of_[i] < 0) continue;
      ++members;
      widest = std::max(widest, static_cast<int64_t>(sequences[i].size()) - cached[static_cast<size_t>(row_of_[i])]);
    }
    return members * std::max<int64_t>(0, widest - 2);
  }

  // A row joins the batch after the others (continuous batching): with `drafts`, it drafts from
  // the drafter, its `prompt` prefilled now by a drafter forward of its own where the drafter's
  // cache allows (BatchRunner::add_row_prefilled), else fed whole at its first draft; otherwise
  // it never drafts.
  void join(bool drafts, std::span<const int64_t> prompt = {})
    requires AppendableKVCache<typename D::cache_type>
  {
    // A prompt past the drafter's limit never drafts (leave_where_full would take it out).
    if (!drafts || static_cast<int64_t>(prompt.size()) > runner_.limit()) {
      row_of_.push_back(-1);
      return;
    }
    row_of_.push_back(static_cast<int64_t>(runner_.lengths().size()));
    runner_.add_row_prefilled(prompt);  // timed and counted as drafter forwards
  }

 private:
  // Rows leave the drafter's batch where the drafter cannot take them: a sequence longer than its
  // limit, or, while the first forward's padded input (the longest cached row plus the widest
  // uncached input) would not fit, the row with the longest cache (the one nearest the limit).
  void leave_where_full(const std::vector<std::span<const int64_t>>& sequences) {
    const int64_t limit = runner_.limit();
    if (limit == std::numeric_limits<int64_t>::max()) return;
    const auto cached = runner_.lengths();
    bool changed = false;
    for (size_t i = 0; i < row_of_.size(); ++i) {
      if (row_of_[i] >= 0 && static_cast<int64_t>(sequences[i].size()) > limit) {
        row_of_[i] = -1;
        changed = true;
      }
    }
    while (true) {
      int64_t longest = 0, widest = 0;
      size_t nearest = row_of_.size();
      for (size_t i = 0; i < row_of_.size(); ++i) {
        const int64_t row = row_of_[i];
        if (row < 0) continue;
        const int64_t held = cached[static_cast<size_t>(row)];
        widest = std::max(widest, static_cast<int64_t>(sequences[i].size()) - held);
        if (nearest == row_of_.size() || held > longest) {
          longest = held;
          nearest = i;
        }
      }
      if (nearest == row_of_.size() || longest + widest <= limit) break;
      row_of_[nearest] = -1;
      changed = true;
    }
    if (!changed) return;
    kept_.clear();
    int64_t next = 0;
    for (auto& row : row_of_) {
      if (row < 0) continue;
      kept_.push_back(row);
      row = next++;
    }
    runner_.select(kept_);
  }

  int64_t calls_ = 0, positions_ = 0;
  double seconds_ = 0;  // the loop times draft() as a whole
  BatchRunner<D> runner_;
  std::vector<int64_t> row_of_;  // each batch row's drafter row, -1 once it left the drafter
  std::vector<int64_t> members_, lengths_, kept_;
  std::vector<std::span<const int64_t>> member_sequences_;
};

// N-gram drafts per row from one shared storage (host work on plain integers); the storage learns
// every row's emitted tokens.
template <NGramDrafter S>
class NGramBatchDrafts {
 public:
  NGramBatchDrafts(S& storage, int64_t batch, const at::Device& device, bool stop_if_unknown, NGramDraftRule rule)
      : storage_(storage), device_(device), stop_if_unknown_(stop_if_unknown), rule_(rule),
        learned_(static_cast<size_t>(batch), 0) {
    check_draft_rule<S>(rule);
  }

  void start(std::span<const std::vector<int64_t>> prompts) {
    for (size_t r = 0; r < prompts.size(); ++r) {
      storage_.initialize(prompts[r]);
      learned_[r] = prompts[r].size();
    }
  }

  template <LogitsProcessor P>
  BatchDrafts draft(const std::vector<std::span<const int64_t>>& sequences, std::span<const int64_t> /*rooms*/,
                    int64_t k, const P&, at::Generator&, GenerationStats&) {
    const auto b = static_cast<int64_t>(sequences.size());
    BatchDrafts result;
    buffer_.assign(static_cast<size_t>(b * k), 0);
    for (int64_t r = 0; r < b; ++r) {
      context_.assign(sequences[static_cast<size_t>(r)].begin(), sequences[static_cast<size_t>(r)].end());
      int64_t calls = 0;
      result.valid.push_back(draft_ngrams(storage_, context_, std::span(buffer_).subspan(static_cast<size_t>(r * k), static_cast<size_t>(k)),
                                          rule_, stop_if_unknown_, calls));
    }
    result.tokens = to_device<int64_t>(buffer_, {b, k}, device_);
    return result;
  }

  void after(const BatchStep& step) {
    for (size_t r = 0; r < step.sequences.size(); ++r) {
      const auto sequence = step.sequences[r];
      for (size_t position = learned_[r]; position < sequence.size(); ++position) {
        storage_.update(sequence.first(position), sequence.subspan(position, 1));
      }
      learned_[r] = sequence.size();
    }
  }
  void select(std::span<const int64_t> rows) { learned_ = pick_rows(learned_, rows); }

 private:
  S& storage_;
  at::Device device_;
  bool stop_if_unknown_;
  NGramDraftRule rule_;
  std::vector<size_t> learned_;
  std::vector<int64_t> buffer_, context_;
};

// Draft sources over a batch, one per row: row i's drafts come from its own source, which keeps
// its own state (an EAGLE head's cache, a drafter's), learns each step's outcome as in
// generate_with, and, with feature_taps(), reads its row of the target's hidden states. Sources
// draft one after another; their drafts are padded into one [b, k] block.
template <class S>
class SourceBatchDrafts {
 public:
  SourceBatchDrafts(std::span<S> sources, const at::Device& device, int64_t vocab)
      : sources_(sources), device_(device), vocab_(vocab), rows_(sources.size()) {
    for (size_t r = 0; r < rows_.size(); ++r) rows_[r] = static_cast<int64_t>(r);
    if constexpr (HasFeatureTaps<S>) {
      const auto first = sources_.front().feature_taps();
      taps_.assign(first.begin(), first.end());
      for (size_t r = 1; r < sources_.size(); ++r) {
        const auto taps = sources_[r].feature_taps();
        if (!std::equal(taps.begin(), taps.end(), taps_.begin(), taps_.end())) {
          throw_invalid_message("sources[", r, "].feature_taps() must equal sources[0]'s: one target forward serves "
                                "every row");
        }
      }
    }
    for (size_t r = 0; r < sources_.size(); ++r) {
      if (source_top_k(sources_[r]) > 0) {
        throw_invalid_message("sources[", r, "].target_top_k() = ", source_top_k(sources_[r]),
                              ": batch generation hands no target top-k to a source (it must be 0)");
      }
    }
  }

  [[nodiscard]] std::span<const int64_t> feature_taps() const noexcept
    requires HasFeatureTaps<S>
  {
    return taps_;
  }

  void start(std::span<const std::vector<int64_t>> prompts, const SpeculativeOptions& options) {
    if constexpr (HasStartHook<S>) {
      for (size_t r = 0; r < prompts.size(); ++r) sources_[r].start(prompts[r], options);
    }
  }

  template <LogitsProcessor P>
  BatchDrafts draft(const std::vector<std::span<const int64_t>>& sequences, std::span<const int64_t> rooms, int64_t /*k*/,
                    const P& processor, at::Generator& gen, GenerationStats& /*shared*/) {
    const auto b = static_cast<int64_t>(sequences.size());
    drafts_.clear();
    BatchDrafts result{.valid = std::vector<int64_t>(static_cast<size_t>(b), 0)};
    int64_t width = 0;
    bool any_probs = false, any_finite = false;
    for (int64_t i = 0; i < b; ++i) {
      S& source = sources_[static_cast<size_t>(rows_[static_cast<size_t>(i)])];
      const auto sequence = sequences[static_cast<size_t>(i)];
      const int64_t room =
          std::min(rooms[static_cast<size_t>(i)], source_room(source, static_cast<int64_t>(sequence.size())));
      Drafts drafts;
      if (room > 0) {
        drafts = source.draft(DraftRequest{.sequence = sequence, .gamma = room, .room = room, .device = device_},
                              processor, gen);
      }
      if (drafts.size() > room) {
        throw_invalid_message("sources[", rows_[static_cast<size_t>(i)], "] proposed ", drafts.size(),
                              " drafts, more than room = ", room);
      }
      result.valid[static_cast<size_t>(i)] = drafts.size();
      width = std::max(width, drafts.size());
      any_probs = any_probs || (drafts.size() > 0 && drafts.probs.defined());
      any_finite = any_finite || (drafts.size() > 0 && drafts.finite.defined());
      drafts_.push_back(std::move(drafts));
    }
    if (width == 0) return result;
    const auto long_options = at::TensorOptions().dtype(at::kLong).device(device_);
    result.tokens = at::zeros({b, width}, long_options);
    if (any_probs) result.probs = at::zeros({b, width, vocab_}, at::TensorOptions().dtype(at::kFloat).device(device_));
    std::vector<at::Tensor> finite;
    for (int64_t i = 0; i < b; ++i) {
      const Drafts& drafts = drafts_[static_cast<size_t>(i)];
      const int64_t n = drafts.size();
      if (n > 0) {
        const at::Tensor tokens = drafts.tokens.to(device_).view({n});
        result.tokens.select(0, i).narrow(0, 0, n).copy_(tokens);
        if (any_probs) {
          at::Tensor q = result.probs.select(0, i).narrow(0, 0, n);
          if (drafts.probs.defined()) {
            q.copy_(drafts.probs.to(device_).view({n, vocab_}));
          } else {  // deterministic drafts: q is one-hot at each
            q.scatter_(1, tokens.view({n, 1}), 1.0);
          }
        }
      }
      if (any_finite) {
        finite.push_back(n > 0 && drafts.finite.defined()
                             ? drafts.finite.to(device_).view({})
                             : at::ones({}, at::TensorOptions().dtype(at::kBool).device(device_)));
      }
    }
    if (any_finite) result.finite = at::stack(finite);
    return result;
  }

  void after(const BatchStep& step) {
    for (size_t i = 0; i < step.sequences.size(); ++i) {
      S& source = sources_[static_cast<size_t>(rows_[i])];
      VerifiedDrafts verified{.sequence = step.sequences[i],
                              .position = step.positions[i],
                              .drafted = step.drafted[i],
                              .accepted = step.accepted[i]};
      if constexpr (HasFeatureTaps<S>) {
        // The row's positions from features_from up to its last accepted draft.
        verified.features_from = step.features_from[i];
        verified.features = step.features.select(0, static_cast<int64_t>(i))
                                .narrow(0, 0, step.positions[i] - step.features_from[i] + step.accepted[i]);
      }
      source.verified(verified);
      if constexpr (HasFinishHook<S>) {
        if (step.finished[i] != 0) source.finish(step.sequences[i]);
      }
    }
  }

  // Row `row` (of the prompts) ended before the first step: its source's finish hook still runs,
  // as generate_with runs it.
  void finished_before_start(int64_t row, std::span<const int64_t> sequence) {
    if constexpr (HasFinishHook<S>) sources_[static_cast<size_t>(row)].finish(sequence);
  }

  void select(std::span<const int64_t> rows) { rows_ = pick_rows(rows_, rows); }

 private:
  std::span<S> sources_;
  at::Device device_;
  int64_t vocab_;
  std::vector<int64_t> rows_;  // each batch row's source
  std::vector<int64_t> taps_;
  std::vector<Drafts> drafts_;
};

// Validates a batch: non-empty, every row valid (the message names the row).
template <class Options>
void check_batch(const Options& options, std::span<const std::vector<int64_t>> prompts, int64_t vocab, int64_t limit) {
  if (prompts.empty()) throw std::invalid_argument("prompts must not be empty");
  if (options.max_new_tokens < 0) throw_invalid("max_new_tokens", "be >= 0", options.max_new_tokens);
  for (size_t r = 0; r < prompts.size(); ++r) {
    try {
      check_common(options, prompts[r], vocab, limit);
    } catch (const std::invalid_argument& e) {
      throw_invalid_message("prompts[", r, "]: ", e.what());
    }
  }
}

inline void check_batch_options(const SpeculativeOptions& options) {
  check_draft_length_options(options);
  if (options.gamma_policy != GammaPolicy::fixed || options.p_min > 0.0 || options.entropy_gate < 1.0) {
    throw std::invalid_argument(
        "batch generation drafts a fixed gamma: gamma_policy must be fixed, p_min 0 and entropy_gate 1");
  }
  if (options.verification != Verification::rejection) {
    throw std::invalid_argument("batch generation verifies by rejection sampling: verification must be rejection");
  }
  if (!options.use_cache) throw std::invalid_argument("batch generation needs use_cache = true");
}

}  // namespace detail

// Autoregressive decoding of a batch: every active row samples one token per batched forward.
//
// Requires: prompts non-empty, each row valid as for autoregressive_generate. Returns: one
// GenerationResult per prompt, in order, each with its own tokens, stop reason and stats
// (target_calls counts the batched forwards the row took part in).
// Throws: std::invalid_argument naming the row ("prompts[2]: prompt must not be empty").
template <Target T, LogitsProcessor P = GreedyProcessor>
  requires BatchedLanguageModel<T>
[[nodiscard]] std::vector<GenerationResult> autoregressive_generate_batch(T& target,
                                                                          std::span<const std::vector<int64_t>> prompts,
                                                                          const GenerationOptions& options = {},
                                                                          const P& processor = {}) {
  const int64_t limit = detail::sequence_limit(target);
  detail::check_batch(options, prompts, static_cast<int64_t>(target.vocab_size()), limit);
  const SpeculativeOptions step = detail::step_options(options);
  detail::NoBatchDrafts none;
  return detail::run_batch(target, prompts, step, processor, none, limit, /*draft=*/false);
}

// Speculative decoding of a batch with per-row acceptance: the drafter drafts gamma tokens for
// every active row in batched forwards, the target verifies all rows in one forward, and each row
// keeps its own accepted prefix. Greedy output equals each row's speculative_generate (and
// autoregressive_generate) output token for token; sampled output is distributed exactly as the
// target's, row by row.
//
// Requires: as speculative_generate, for every row; a fixed gamma (gamma_policy fixed, no
//   confidence stop), rejection verification and use_cache. Both models' caches model
//   BatchedKVCache (StaticKVCache and DynamicKVCache do).
// Returns: one GenerationResult per prompt, in order. Rows stop at the target's limit
//   (sequence_limit); a row longer than the drafter's limit goes on with the target alone, as in
//   speculative_generate.
// Throws: std::invalid_argument naming the parameter, or the row and its problem.
template <Drafter D, Target T, LogitsProcessor P = GreedyProcessor>
  requires BatchedLanguageModel<D> && BatchedLanguageModel<T>
[[nodiscard]] std::vector<GenerationResult> speculative_generate_batch(D& drafter, T& target,
                                                                       std::span<const std::vector<int64_t>> prompts,
                                                                       const SpeculativeOptions& options = {},
                                                                       const P& processor = {}) {
  const auto vocab = static_cast<int64_t>(target.vocab_size());
  if (static_cast<int64_t>(drafter.vocab_size()) != vocab) {
    detail::throw_invalid_message("drafter.vocab_size() must equal target.vocab_size() = ", vocab, ", got ",
                                  drafter.vocab_size());
  }
  detail::check_batch_options(options);
  // The target's limit: a row past the drafter's goes on with the target alone.
  const int64_t limit = detail::sequence_limit(target);
  detail::check_batch(options, prompts, vocab, limit);
  detail::ModelBatchDrafts<D> drafts(drafter, static_cast<int64_t>(prompts.size()));
  return detail::run_batch(target, prompts, options, processor, drafts, limit, /*draft=*/true);
}

// Speculative decoding of a batch from draft sources, one per row: sources[r] drafts for
// prompts[r] and keeps its own state across the steps (an EAGLE or Medusa head its cache, fed its
// row of the target's hidden states; a drafter its KV cache; an n-gram source its tables), learning
// each step's outcome as in generate_with. The target verifies every row's drafts in one forward
// per step. Greedy output equals each row's generate_with (and autoregressive_generate) output
// token for token; sampled output is distributed exactly as the target's, row by row. The sources
// draft one row after another (a head's forwards are per row; its cost grows with the batch:
// eagle_generate_batch and medusa_generate_batch, drafting/head_batches.hpp, draft for all rows in
// one head forward per draft position).
//
// Requires: sources.size() == prompts.size(); each source models DraftSource<S, P>, with the
//   target's vocabulary where it says, the same feature_taps() for all (the target then models
//   FeatureTarget) and no target_top_k(); options as speculative_generate_batch.
// Returns: one GenerationResult per prompt, in order.
// Throws: std::invalid_argument naming the parameter, or the row and its problem.
template <Target T, class S, LogitsProcessor P = GreedyProcessor>
  requires BatchedLanguageModel<T> && DraftSource<S, P>
[[nodiscard]] std::vector<GenerationResult> generate_with_batch(std::span<S> sources, T& target,
                                                                std::span<const std::vector<int64_t>> prompts,
                                                                const SpeculativeOptions& options = {},
                                                                const P& processor = {}) {
  const auto vocab = static_cast<int64_t>(target.vocab_size());
  if (sources.size() != prompts.size()) {
    detail::throw_invalid_message("sources.size() must equal prompts.size() = ", prompts.size(), ", got ",
                                  sources.size());
  }
  detail::check_batch_options(options);
  for (size_t r = 0; r < sources.size(); ++r) {
    try {
      detail::check_source(sources[r], vocab, options);
    } catch (const std::invalid_argument& e) {
      detail::throw_invalid_message("sources[", r, "]: ", e.what());
    }
  }
  const int64_t limit = detail::sequence_limit(target);
  detail::check_batch(options, prompts, vocab, limit);
  detail::SourceBatchDrafts<S> drafts(sources, target.device(), vocab);
  drafts.start(prompts, options);
  return detail::run_batch(target, prompts, options, processor, drafts, limit, /*draft=*/true);
}

// Draft trees (STAND, ModelTreeSource) are not batched: a batch verifies one chain per row.
// Serving engines switch trees off above batch 1 too: a tree multiplies the positions every row
// feeds the target, and once the batch fills the device, those extra positions cost what they
// save. This overload only turns the constraint failure into a readable compile-time message.
template <Target T, class S, LogitsProcessor P = GreedyProcessor>
  requires BatchedLanguageModel<T> && TreeDraftSource<S, P> && (!DraftSource<S, P>)
std::vector<GenerationResult> generate_with_batch(std::span<S> /*sources*/, T& /*target*/,
                                                  std::span<const std::vector<int64_t>> /*prompts*/,
                                                  const SpeculativeOptions& /*options*/ = {}, const P& /*processor*/ = {}) {
  static_assert(!TreeDraftSource<S, P>,
                "generate_with_batch verifies one chain of drafts per row: draft trees run one sequence at a time "
                "(generate_with or a Session)");
  return {};
}

// N-gram assisted decoding of a batch: one storage shared by the rows (it learns every row's
// prompt and output, so rows that share text draft for each other), drafts per row, one target
// forward per step for the whole batch. Exact as ngram_assisted_generate. The target's top-k
// filler is not taught in batches (filler_top_k must be 1).
template <NGramDrafter S, Target T, LogitsProcessor P = GreedyProcessor>
  requires BatchedLanguageModel<T>
[[nodiscard]] std::vector<GenerationResult> ngram_assisted_generate_batch(S& storage, T& target,
                                                                          std::span<const std::vector<int64_t>> prompts,
                                                                          const NGramAssistedOptions& options = {},
                                                                          const P& processor = {}) {
  if (options.gamma < 1) detail::throw_invalid("gamma", "be >= 1", options.gamma);
  if (options.filler_top_k != 1) {
    detail::throw_invalid("filler_top_k", "be 1 in batch generation (the filler is taught by ngram_assisted_generate)",
                          options.filler_top_k);
  }
  const int64_t limit = detail::sequence_limit(target);
  detail::check_batch(options, prompts, static_cast<int64_t>(target.vocab_size()), limit);
  detail::NGramBatchDrafts<S> drafts(storage, static_cast<int64_t>(prompts.size()), target.device(),
                                     options.stop_if_unknown, options.draft_rule);
  drafts.start(prompts);
  return detail::run_batch(target, prompts, detail::step_options(options), processor, drafts, limit, /*draft=*/true);
}

}  // namespace specdec
