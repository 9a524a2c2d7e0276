// Heads in batches, one head forward for all rows: eagle_generate_batch and
// medusa_generate_batch. The target verifies every row's drafts in one forward per step, as in
// generate_with_batch; here the head also drafts for every row at once.
//
//   EAGLE (-1 and -3): the rows' head caches live in one EagleBatchCache (models/eagle.hpp), each
//   row's entries from slot 0 of its own row, so rows of different lengths need no padding in the
//   cache. A step drafts gamma tokens for every row with gamma - 1 batched head forwards of one
//   position per row (the first draft reads the head's output at each row's last verified
//   position); after verification, one batched forward feeds every row's head the target's
//   hidden states at the positions that row verified (ragged: each row keeps its own count of
//   entries, padding positions are written past its length and never read). A step costs gamma
//   head forwards whatever the batch, where one source per row (generate_with_batch) costs
//   gamma * rows.
//   Medusa: the heads read each row's final hidden state at its last accepted position; one pass
//   of each head over all rows' hidden states drafts a step.
//
// The drafts are those each row's EagleDraftSource or MedusaDraftSource would propose alone (the
// same head on the same verified positions; the batched products may round differently in the
// last bits), drawn from the head's distribution under sampling, so verification is exact: greedy
// rows equal autoregressive decoding token for token, and sampled rows are distributed as the
// target's. One device-to-host copy per step for the whole batch. Each call starts the heads'
// caches afresh (a batch has no sessions to continue).
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <limits>
#include <span>
#include <type_traits>
#include <vector>

#include "specdec/batch.hpp"
#include "specdec/concepts.hpp"
#include "specdec/detail/check.hpp"
#include "specdec/device.hpp"
#include "specdec/drafting/eagle.hpp"
#include "specdec/drafting/medusa.hpp"
#include "specdec/logits_processor.hpp"
#include "specdec/models/eagle.hpp"
#include "specdec/models/medusa.hpp"
#include "specdec/options.hpp"

namespace specdec {
namespace detail {

// The drafts' finiteness per row [B] (bool): every one of row i's first valid[i] maxima [B, width]
// is finite.
inline at::Tensor finite_rows(const at::Tensor& maxima, std::span<const int64_t> valid) {
  const int64_t b = maxima.size(0), width = maxima.size(1);
  const at::Tensor counts = to_device<int64_t>(valid, {b, 1}, maxima.device());
  const at::Tensor used =
      at::arange(width, at::TensorOptions(at::kLong).device(maxima.device())).view({1, width}) <
      counts;
  return at::isfinite(maxima).logical_or(used.logical_not()).all(-1);
}

// Drafts of no tokens but their counts: row i may draft rooms[i] (at most `most`) where
// drafts(i), none elsewhere.
template <class Drafts>
BatchDrafts draft_counts(std::span<const int64_t> rooms, int64_t most, Drafts&& drafts) {
  BatchDrafts result{.valid = std::vector<int64_t>(rooms.size(), 0)};
  for (size_t i = 0; i < rooms.size(); ++i) {
    if (drafts(i)) result.valid[i] = std::clamp<int64_t>(rooms[i], 0, most);
  }
  return result;
}

// Row i's position `index[i]` of x [B, T, ...]: [B, ...].
inline at::Tensor pick_positions(const at::Tensor& x, std::span<const int64_t> index) {
  const int64_t b = x.size(0), t = x.size(1);
  std::vector<int64_t> flat(index.size());
  for (size_t i = 0; i < index.size(); ++i) flat[i] = static_cast<int64_t>(i) * t + index[i];
  return x.flatten(0, 1).index_select(0, to_device<int64_t>(flat, {b}, x.device()));
}

// The rows `rows` of x (undefined stays undefined).
inline at::Tensor pick_tensor_rows(const at::Tensor& x, std::span<const int64_t> rows) {
  if (!x.defined()) return x;
  return x.index_select(0,
                        to_device<int64_t>(rows, {static_cast<int64_t>(rows.size())}, x.device()));
}

// Where the processor has rows with seeds (RowProcessor), each row's sequence length as int64 [b]
// on `device`: the position of its first draft, where its draws are keyed. Undefined otherwise.
template <LogitsProcessor P>
at::Tensor draft_positions(const P& processor, const std::vector<std::span<const int64_t>>& sequences,
                           const at::Device& device) {
  if constexpr (requires { processor.seeded(); }) {
    if (processor.seeded()) {
      std::vector<int64_t> lengths;
      for (const auto& sequence : sequences) lengths.push_back(static_cast<int64_t>(sequence.size()));
      return to_device<int64_t>(lengths, {static_cast<int64_t>(lengths.size())}, device);
    }
  }
  return {};
}

// The distributions of logits [b, width, V] as [b * width, V]: a processor with parameters per
// row (RowProcessor) applies row i's to its width positions; the others apply theirs to all.
template <LogitsProcessor P>
at::Tensor rows_apply(const P& processor, const at::Tensor& logits) {
  if constexpr (requires { processor.seeded(); }) {
    return processor(logits).flatten(0, 1);
  } else {
    return processor(logits.flatten(0, 1));
  }
}

// How many of the step's fed positions row i keeps for its head: those up to its last accepted
// draft, within its sequence (a stop may have cut the step's tokens short; position p reads the
// token at p + 1).
inline int64_t verified_count(const BatchStep& step, size_t i) {
  const int64_t from = step.features_from[i];
  return std::min(step.positions[i] - from + step.accepted[i],
                  static_cast<int64_t>(step.sequences[i].size()) - 1 - from);
}

// The drafting of run_batch from one EAGLE head for all rows (see the top of this file).
class EagleBatchDrafts {
 public:
  // `lazy`: the target's states each step verified are kept per row and fed to the head only
  // when the row next drafts (one forward for everything it missed), so steps that draft nothing
  // cost the head nothing; otherwise they are fed after every step.
  template <FeatureTarget T>
  EagleBatchDrafts(const models::EagleHead& head, const T& target, int64_t rows, bool lazy = false)
      : head_(head), device_(target.device()), cache_(rows), ready_(static_cast<size_t>(rows), 0),
        members_(static_cast<size_t>(rows), 1), pending_(static_cast<size_t>(rows)), lazy_(lazy) {
    const EagleHeadState fits(head, target);  // throws where the head does not fit the target
  }

  // A row joins after the others (continuous batching). A `member` drafts from the head: given
  // `features`, the target's tapped states [1, n, taps * hidden] at positions 0..n-1 of
  // `sequence` (n < sequence.size(), a prompt prefilled on its own), its head is fed them (now,
  // or at its first draft when lazy), so it drafts from the whole prompt; without, its head starts
  // at the first positions a step feeds it. Other rows never draft here and feed the head nothing.
  void join(bool member, std::span<const int64_t> sequence = {}, const at::Tensor& features = {}) {
    cache_.append_rows_from(models::EagleBatchCache(1));
    members_.push_back(member ? 1 : 0);
    ready_.push_back(0);
    pending_.emplace_back();
    if (last_.defined()) last_ = at::cat({last_, at::zeros({1, last_.size(1)}, last_.options())});
    if (!member || !features.defined() || features.size(1) == 0) return;
    const int64_t n = features.size(1);
    if (features.dim() != 3 || features.size(0) != 1 || n >= static_cast<int64_t>(sequence.size())) {
      throw_invalid_message("EagleBatchDrafts::join: features must be [1, n, F] with n < ", sequence.size(), ", got ",
                            features.sizes());
    }
    pending_.back() = Pending{.from = 0, .count = n, .chunks = {Chunk{.block = keep_block(features.clone()), .row = 0, .count = n}}};
    if (!lazy_) {
      std::vector<std::span<const int64_t>> sequences(pending_.size());
      sequences.back() = sequence;
      catch_up(sequences, [&](size_t row) { return row + 1 == pending_.size(); });
    }
  }

  [[nodiscard]] std::span<const int64_t> feature_taps() const noexcept {
    return head_.config().feature_layers;
  }
  [[nodiscard]] const models::EagleBatchCache& cache() const noexcept { return cache_; }
  // The positions the head's forwards computed so far (rows times width, padding included).
  [[nodiscard]] int64_t positions() const noexcept { return positions_; }
  // The rows that draft from the head.
  [[nodiscard]] int64_t members() const noexcept {
    return static_cast<int64_t>(std::count(members_.begin(), members_.end(), uint8_t{1}));
  }
  // The positions the head's next draft computes to take in the states its members kept (lazy),
  // beyond the two a row brings after a drafting step: every row is padded to the widest.
  [[nodiscard]] int64_t catch_up_positions() const noexcept {
    int64_t widest = 0;
    for (size_t row = 0; row < pending_.size(); ++row) {
      if (members_[row] != 0) widest = std::max(widest, pending_[row].count);
    }
    return static_cast<int64_t>(pending_.size()) * std::max<int64_t>(0, widest - 2);
  }

  template <LogitsProcessor P>
  BatchDrafts draft(const std::vector<std::span<const int64_t>>& sequences,
                    std::span<const int64_t> rooms, int64_t /*k*/, const P& processor,
                    at::Generator& gen, GenerationStats& /*shared*/) {
    const auto b = static_cast<int64_t>(sequences.size());
    // Rows about to draft first take in what they missed.
    catch_up(sequences, [&](size_t row) { return rooms[row] > 0; });
    // A row drafts where its head's last output is at the position before its last token.
    BatchDrafts result = draft_counts(rooms, std::numeric_limits<int64_t>::max(), [&](size_t row) {
      return ready_[row] != 0 && cache_.end(static_cast<int64_t>(row)) + 1 ==
                                     static_cast<int64_t>(sequences[row].size());
    });
    const int64_t width =
        result.valid.empty() ? 0 : *std::max_element(result.valid.begin(), result.valid.end());
    if (width == 0) return result;
    std::vector<at::Tensor> tokens, rows;
    std::vector<int64_t> counts(static_cast<size_t>(b));
    const at::Tensor positions = draft_positions(processor, sequences, head_.device());
    at::Tensor out = last_;  // [B, H]
    for (int64_t j = 0; j < width; ++j) {
      if (j > 0) {  // the rows that draft a j-th token keep the entry of the (j - 1)-th
        for (size_t i = 0; i < counts.size(); ++i) counts[i] = result.valid[i] > j ? 1 : 0;
        out = head_
                  .forward_rows(tokens.back().to(head_.device()).view({b, 1}), out.unsqueeze(1),
                                cache_, counts)
                  .squeeze(1);
        positions_ += b;
      }
      const at::Tensor logits = head_.logits(out);  // [B, draft_vocab]
      if constexpr (std::is_same_v<P, GreedyProcessor>) {
        tokens.push_back(head_.to_target(logits.argmax(-1)));
        rows.push_back(logits.amax(-1));
      } else {
        const at::Tensor q = processor(head_.target_logits(logits));  // [B, V]
        tokens.push_back(sample_rows(processor, q, gen, positions.defined() ? positions + j : positions,
                                     RandomUse::draft)
                             .view({b}));
        rows.push_back(q);
      }
    }
    result.tokens = at::stack(tokens, 1).to(device_);
    if constexpr (std::is_same_v<P, GreedyProcessor>) {
      result.finite = finite_rows(at::stack(rows, 1), result.valid).to(device_);
    } else {
      result.probs = at::stack(rows, 1).to(device_);
    }
    return result;
  }

  // Drops the step's draft entries and takes the target's states at the positions each row
  // verified: fed to the head now in one forward, or kept for the row's next draft (lazy).
  void after(const BatchStep& step) {
    const auto b = static_cast<int64_t>(step.sequences.size());
    // The step's states are kept once for all rows: copied where they wait for a later step (a
    // target may reuse its buffers), as they are where this step feeds them.
    int64_t block = -1, widest = 0;
    for (int64_t i = 0; i < b; ++i) {
      const auto row = static_cast<size_t>(i);
      if (members_[row] != 0) widest = std::max(widest, verified_count(step, row));
    }
    if (widest > 0) {
      const at::Tensor states = step.features.narrow(1, 0, widest);
      block = keep_block(lazy_ ? states.clone() : states);
    }
    for (int64_t i = 0; i < b; ++i) {
      const auto row = static_cast<size_t>(i);
      const int64_t from = step.features_from[row];
      const int64_t n = members_[row] != 0 ? std::max<int64_t>(verified_count(step, row), 0) : 0;
      Pending& pending = pending_[row];
      ready_[row] = 0;
      if (n == 0) {
        cache_.reset(i, 0);
        pending = {};
        continue;
      }
      if (pending.count > 0 && from != pending.from + pending.count) {
        pending = {};  // not where the kept states end: the row's head starts over at `from`
        cache_.reset(i, from);
      } else if (pending.count == 0) {
        if (from < cache_.start(i) || from > cache_.end(i)) {
          cache_.reset(i, from);  // a gap: the row's head starts over at `from`
        } else {
          cache_.truncate(i, from);  // drops the draft entries
        }
        pending.from = from;
      }
      pending.chunks.push_back(Chunk{.block = block, .row = i, .count = n});
      pending.count += n;
    }
    if (!lazy_) catch_up(step.sequences, [](size_t) { return true; });
    release_blocks();
  }

  void select(std::span<const int64_t> rows) {
    cache_.select(rows);
    ready_ = pick_rows(ready_, rows);
    members_ = pick_rows(members_, rows);
    std::vector<Pending> pending;
    for (const int64_t r : rows) pending.push_back(std::move(pending_[static_cast<size_t>(r)]));
    pending_ = std::move(pending);
    last_ = pick_tensor_rows(last_, rows);
    release_blocks();
  }

 private:
  // States kept for the heads: the first `count` positions of row `row` of block `block`.
  struct Chunk {
    int64_t block = 0;
    int64_t row = 0;
    int64_t count = 0;
  };
  // The target's states kept for a row's head: positions [from, from + count), in chunks.
  struct Pending {
    int64_t from = 0;
    int64_t count = 0;
    std::vector<Chunk> chunks{};
  };

  // Keeps `states` [rows, n, taps * hidden] (a step's, or a joining prompt's) as a block; returns
  // its number.
  int64_t keep_block(at::Tensor states) {
    blocks_.push_back(std::move(states));
    return first_block_ + static_cast<int64_t>(blocks_.size()) - 1;
  }
  // Drops the blocks before the first one a row still reads.
  void release_blocks() {
    int64_t first = first_block_ + static_cast<int64_t>(blocks_.size());
    for (const Pending& pending : pending_) {
      if (!pending.chunks.empty()) first = std::min(first, pending.chunks.front().block);
    }
    while (first_block_ < first) {
      blocks_.pop_front();
      ++first_block_;
    }
  }

  // Feeds the head of every row where want(row) holds what it kept, in one forward (position p
  // reads the token at p + 1 of the row's sequence); those rows are then ready to draft.
  template <class Want>
  void catch_up(std::span<const std::span<const int64_t>> sequences, Want&& want) {
    const auto b = static_cast<int64_t>(pending_.size());
    std::vector<int64_t> counts(static_cast<size_t>(b), 0), lasts(static_cast<size_t>(b), 0);
    int64_t width = 0;
    for (size_t row = 0; row < pending_.size(); ++row) {
      if (pending_[row].count == 0 || !want(row)) continue;
      counts[row] = pending_[row].count;
      lasts[row] = counts[row] - 1;
      width = std::max(width, counts[row]);
    }
    if (width == 0) return;
    ids_.assign(static_cast<size_t>(b * width), 0);
    // Every kept block flattened into one [positions + 1, F] table (its last row zeros, the
    // padding), and each fed row's positions gathered from it in one index_select.
    std::vector<at::Tensor> parts;
    std::vector<int64_t> offsets;  // each block's first row in the table
    int64_t rows_so_far = 0;
    for (const at::Tensor& states : blocks_) {
      offsets.push_back(rows_so_far);
      parts.push_back(states.reshape({-1, states.size(2)}));
      rows_so_far += parts.back().size(0);
    }
    parts.push_back(at::zeros({1, blocks_.front().size(2)}, blocks_.front().options()));
    gather_.assign(static_cast<size_t>(b * width), rows_so_far);
    std::vector<uint8_t> fed(static_cast<size_t>(b), 0);
    for (size_t row = 0; row < pending_.size(); ++row) {
      if (counts[row] == 0) continue;
      const Pending& pending = pending_[row];
      int64_t t = 0;
      for (const Chunk& chunk : pending.chunks) {
        const at::Tensor& states = blocks_[static_cast<size_t>(chunk.block - first_block_)];
        const int64_t base = offsets[static_cast<size_t>(chunk.block - first_block_)] + chunk.row * states.size(1);
        for (int64_t j = 0; j < chunk.count; ++j, ++t) gather_[row * static_cast<size_t>(width) + static_cast<size_t>(t)] = base + j;
      }
      for (t = 0; t < counts[row]; ++t) {
        ids_[row * static_cast<size_t>(width) + static_cast<size_t>(t)] =
            sequences[row][static_cast<size_t>(pending.from + 1 + t)];
      }
      fed[row] = 1;
    }
    const at::Tensor table = at::cat(parts);
    const at::Tensor states =
        table.index_select(0, to_device<int64_t>(gather_, {b * width}, table.device())).view({b, width, table.size(1)});
    const at::Tensor ids = to_device<int64_t>(ids_, {b, width}, head_.device());
    const at::Tensor outputs = head_.forward_rows(ids, head_.fuse(states), cache_, counts);
    positions_ += b * width;
    const at::Tensor picked = pick_positions(outputs, lasts);
    const at::Tensor mask = to_device<uint8_t>(fed, {b, 1}, picked.device()).to(at::kBool);
    last_ = last_.defined() ? at::where(mask, picked, last_.to(picked.scalar_type())) : picked;
    for (size_t row = 0; row < pending_.size(); ++row) {
      if (fed[row] == 0) continue;
      pending_[row] = {};
      ready_[row] = 1;
    }
  }

  const models::EagleHead& head_;
  at::Device device_;
  models::EagleBatchCache cache_;
  std::vector<uint8_t> ready_;    // rows whose last_ is the head's output at their cache's end - 1
  std::vector<uint8_t> members_;  // rows that draft from the head (1); the others feed it nothing
  std::vector<Pending> pending_;  // each row's states not yet fed to its head
  std::deque<at::Tensor> blocks_;  // the states they read, by block number from first_block_
  int64_t first_block_ = 0;
  bool lazy_ = false;
  int64_t positions_ = 0;
  at::Tensor last_{};             // [B, H]
  std::vector<int64_t> ids_, gather_;
};

// The drafting of run_batch from Medusa heads for all rows (see the top of this file).
class MedusaBatchDrafts {
 public:
  template <FeatureTarget T>
  MedusaBatchDrafts(const models::MedusaHeads& heads, const T& target, int64_t rows)
      : heads_(heads),
        device_(target.device()),
        taps_{static_cast<int64_t>(target.num_hidden_layers())},
        positions_(static_cast<size_t>(rows), -1),
        members_(static_cast<size_t>(rows), 1) {
    const MedusaHeadState fits(heads, target);  // throws where the heads do not fit the target
  }

  // A row joins after the others (continuous batching); a `member` drafts from the heads once a
  // step has given it a hidden state.
  void join(bool member) {
    members_.push_back(member ? 1 : 0);
    positions_.push_back(-1);
    if (hidden_.defined()) hidden_ = at::cat({hidden_, at::zeros({1, hidden_.size(1)}, hidden_.options())});
  }

  [[nodiscard]] std::span<const int64_t> feature_taps() const noexcept { return taps_; }

  template <LogitsProcessor P>
  BatchDrafts draft(const std::vector<std::span<const int64_t>>& sequences,
                    std::span<const int64_t> rooms, int64_t /*k*/, const P& processor,
                    at::Generator& gen, GenerationStats& /*shared*/) {
    const auto b = static_cast<int64_t>(sequences.size());
    // A row drafts where its hidden state is the one of the token before its last.
    BatchDrafts result = draft_counts(rooms, heads_.config().num_heads, [&](size_t row) {
      return positions_[row] >= 0 &&
             positions_[row] == static_cast<int64_t>(sequences[row].size()) - 2;
    });
    const int64_t width =
        result.valid.empty() ? 0 : *std::max_element(result.valid.begin(), result.valid.end());
    if (width == 0) return result;
    const at::Tensor logits =
        heads_.logits_rows(hidden_.to(heads_.device()), width);  // [B, width, V]
    const int64_t vocab = logits.size(2);
    if constexpr (std::is_same_v<P, GreedyProcessor>) {
      result.tokens = logits.argmax(-1).to(device_);
      result.finite = finite_rows(logits.amax(-1), result.valid).to(device_);
    } else {
      const at::Tensor positions = draft_positions(processor, sequences, heads_.device());
      if (positions.defined()) {  // per-row parameters and seeds: row i's own, column by column
        const at::Tensor q = processor(logits);  // [B, width, V]
        std::vector<at::Tensor> tokens;
        for (int64_t j = 0; j < width; ++j) {
          tokens.push_back(sample_rows(processor, q.select(1, j), gen, positions + j, RandomUse::draft).view({b}));
        }
        result.tokens = at::stack(tokens, 1).to(device_);
        result.probs = q.to(device_);
      } else {
        const at::Tensor q = rows_apply(processor, logits);  // [B * width, V]
        result.tokens = processor.sample(q, gen).view({b, width}).to(device_);
        result.probs = q.view({b, width, vocab}).to(device_);
      }
    }
    return result;
  }

  // Keeps each row's final hidden state at its last accepted position.
  void after(const BatchStep& step) {
    const auto b = static_cast<int64_t>(step.sequences.size());
    std::vector<int64_t> lasts(static_cast<size_t>(b));
    bool any = false;
    for (size_t i = 0; i < lasts.size(); ++i) {
      const int64_t n = members_[i] != 0 ? step.positions[i] - step.features_from[i] + step.accepted[i] : 0;
      lasts[i] = std::max<int64_t>(n - 1, 0);
      positions_[i] = n > 0 ? step.features_from[i] + n - 1 : -1;
      any = any || n > 0;
    }
    if (!any) return;
    hidden_ = pick_positions(step.features, lasts);
    if (std::any_of(positions_.begin(), positions_.end(), [](int64_t p) { return p < 0; })) {
      // Rows without a hidden state read zeros (their drafts are never used, but a sampler
      // refuses NaN).
      std::vector<uint8_t> none;
      for (const int64_t p : positions_) none.push_back(p < 0 ? 1 : 0);
      hidden_ = hidden_.masked_fill(
          to_device<uint8_t>(none, {b, 1}, hidden_.device()).to(at::kBool), 0.0);
    }
  }

  void select(std::span<const int64_t> rows) {
    positions_ = pick_rows(positions_, rows);
    members_ = pick_rows(members_, rows);
    hidden_ = pick_tensor_rows(hidden_, rows);
  }

 private:
  const models::MedusaHeads& heads_;
  at::Device device_;
  std::vector<int64_t> taps_;
  std::vector<int64_t> positions_;  // each row's hidden state's position (-1: none)
  std::vector<uint8_t> members_;    // rows that draft from the heads (1)
  at::Tensor hidden_{};             // [B, hidden]
};

// The batch generation of eagle_generate_batch and medusa_generate_batch: the options checked, then
// run_batch with Drafts(heads, target, rows).
template <class Drafts, class Heads, class T, class P>
std::vector<GenerationResult> run_heads_batch(const Heads& heads, T& target,
                                              std::span<const std::vector<int64_t>> prompts,
                                              const SpeculativeOptions& options,
                                              const P& processor) {
  check_batch_options(options);
  const int64_t limit = sequence_limit(target);
  check_batch(options, prompts, static_cast<int64_t>(target.vocab_size()), limit);
  Drafts drafts(heads, target, static_cast<int64_t>(prompts.size()));
  return run_batch(target, prompts, options, processor, drafts, limit, /*draft=*/true);
}

}  // namespace detail

// Speculative decoding of a batch with one EAGLE head (EAGLE-1 or EAGLE-3) drafting for every row
// in batched head forwards (see the top of this file). Greedy output equals each row's
// autoregressive decoding token for token; sampled output is distributed exactly as the target's,
// row by row.
//
// Requires: the target models FeatureTarget and fits the head (hidden size, vocabulary, feature
//   layers); options as speculative_generate_batch (a fixed gamma, rejection verification).
// Returns: one GenerationResult per prompt, in order.
// Throws: std::invalid_argument naming the parameter, or the row and its problem.
template <Target T, LogitsProcessor P = GreedyProcessor>
  requires BatchedLanguageModel<T> && FeatureTarget<T>
[[nodiscard]] std::vector<GenerationResult> eagle_generate_batch(
    const models::EagleHead& head, T& target, std::span<const std::vector<int64_t>> prompts,
    const SpeculativeOptions& options = {}, const P& processor = {}) {
  return detail::run_heads_batch<detail::EagleBatchDrafts>(head, target, prompts, options,
                                                           processor);
}

// Speculative decoding of a batch with Medusa heads drafting for every row in one pass of each
// head (see the top of this file); exact as eagle_generate_batch.
//
// Requires: the target models FeatureTarget and fits the heads (hidden size, vocabulary); options
//   as speculative_generate_batch. A step drafts at most as many tokens as there are heads.
// Returns: one GenerationResult per prompt, in order.
// Throws: std::invalid_argument naming the parameter, or the row and its problem.
template <Target T, LogitsProcessor P = GreedyProcessor>
  requires BatchedLanguageModel<T> && FeatureTarget<T>
[[nodiscard]] std::vector<GenerationResult> medusa_generate_batch(
    const models::MedusaHeads& heads, T& target, std::span<const std::vector<int64_t>> prompts,
    const SpeculativeOptions& options = {}, const P& processor = {}) {
  return detail::run_heads_batch<detail::MedusaBatchDrafts>(heads, target, prompts, options,
                                                            processor);
}

}  // namespace specdec
