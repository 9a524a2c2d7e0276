// Drafting with an EAGLE head (models/eagle.hpp, EAGLE-1 or EAGLE-3): chains (EagleDraftSource)
// and dynamic trees (EagleTreeSource, EAGLE-2's procedure, drafting/dynamic_tree.hpp). The
// target must model FeatureTarget; for trees also MaskedFeatureTreeTarget, since the tree's
// layout is on the device and the head reads the target's hidden states at the accepted path
// (LlamaModel models both).
//
// After each step the head runs over the positions the step verified, reading the target's hidden
// states there (VerifiedDrafts::features, on the device), so that its cache holds exactly the
// positions the target confirmed; the next step's drafts continue from the last of them, each
// draft position reading the head's output at the one before. The cache lives across
// generations: a generation that continues the sequence the cache was made from (a Session's next
// turn) keeps it up to where the two agree. A step that follows no verified step at the
// sequence's end (a generation's first, after a gap) drafts nothing: the target's forward then
// hands the head its first hidden states.
//
// Chain drafts are the head's top tokens (greedy), or sampled from its distribution spread over
// the target vocabulary (sampling), so verification stays exact. A tree's children are the head's
// top-k tokens, deterministic given the context, so its verification is the deterministic rule of
// drafting/model_tree.hpp: the output is the target's distribution under any sampling, and
// autoregressive decoding token for token under greedy decoding. In batches (generate_with_batch)
// each row has its own source, fed its row of the target's hidden states; eagle_generate_batch
// (drafting/head_batches.hpp) runs one head for all rows instead.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/detail/check.hpp"
#include "specdec/detail/model_runner.hpp"
#include "specdec/detail/torch_compat.hpp"
#include "specdec/device.hpp"
#include "specdec/draft_source.hpp"
#include "specdec/drafting/dynamic_tree.hpp"
#include "specdec/logits_processor.hpp"
#include "specdec/models/eagle.hpp"
#include "specdec/options.hpp"
#include "specdec/verification.hpp"

namespace specdec {

// What a chain and a tree source of the same head keep between steps: the head's cache of the
// positions the target verified, the tokens those positions read, and the head's output at the
// last of them. The head must outlive it.
class EagleHeadState {
 public:
  // Throws std::invalid_argument when the head does not fit the target (hidden size, vocabulary,
  // feature layers).
  template <FeatureTarget T>
  EagleHeadState(const models::EagleHead& head, const T& target) : head_(head) {
    const models::EagleConfig& c = head.config();
    const auto layers = static_cast<int64_t>(target.num_hidden_layers());
    if (c.target_hidden_size != static_cast<int64_t>(target.hidden_size())) {
      detail::throw_invalid_message(models::to_string(c.kind),
                                    ": target_hidden_size = ", c.target_hidden_size,
                                    " but the target's hidden size is ", target.hidden_size());
    }
    if (c.vocab_size() != static_cast<int64_t>(target.vocab_size())) {
      detail::throw_invalid_message(models::to_string(c.kind), ": vocab_size = ", c.vocab_size(),
                                    " but the target's vocabulary is ", target.vocab_size());
    }
    for (size_t i = 0; i < c.feature_layers.size(); ++i) {
      if (c.feature_layers[i] > layers) {
        detail::throw_invalid_message(models::to_string(c.kind), ": feature_layers[", i,
                                      "] = ", c.feature_layers[i], " but the target has ", layers,
                                      " layers (hidden states 0 to ", layers, ")");
      }
    }
  }

  [[nodiscard]] const models::EagleHead& head() const noexcept { return head_; }
  [[nodiscard]] models::EagleCache& cache() noexcept { return cache_; }
  [[nodiscard]] const models::EagleCache& cache() const noexcept { return cache_; }
  [[nodiscard]] std::span<const int64_t> feature_taps() const noexcept {
    return head_.config().feature_layers;
  }
  [[nodiscard]] int64_t vocab_size() const noexcept { return head_.config().vocab_size(); }

  // The head's output ([1, H]) that drafts continue a sequence of `length` tokens from: the one at
  // the position before its last token. Undefined when the last step did not end there.
  [[nodiscard]] at::Tensor last_for(size_t length) const {
    if (!last_.defined() || cache_.end() + 1 != static_cast<int64_t>(length)) return {};
    return last_;
  }

  // Keeps the cache's positions whose tokens `sequence` repeats (position p read tokens up to
  // p + 1).
  void start(std::span<const int64_t> sequence) {
    const auto agree = static_cast<int64_t>(
        std::mismatch(seen_.begin(), seen_.end(), sequence.begin(), sequence.end()).first -
        seen_.begin());
    const int64_t keep = std::min(cache_.end(), agree - 1);
    if (keep < cache_.start()) {
      cache_.reset(0);
    } else {
      cache_.truncate(keep);
    }
    seen_.resize(static_cast<size_t>(std::min<int64_t>(agree, static_cast<int64_t>(seen_.size()))));
    last_ = at::Tensor();
  }

  // Drops the step's draft entries and feeds the head the target's states at the verified
  // positions.
  void verified(const VerifiedDrafts& verified) {
    last_ = at::Tensor();
    const int64_t from = verified.features_from;
    // Positions [from, from + n) read tokens up to from + n, which the sequence must hold (a
    // stop may have cut the step's tokens short).
    const int64_t n = verified.features.defined()
                          ? std::min(verified.features.size(0),
                                     static_cast<int64_t>(verified.sequence.size()) - 1 - from)
                          : 0;
    if (n <= 0) {
      cache_.reset(0);
      seen_.clear();
      return;
    }
    if (from < cache_.start() || from > cache_.end()) {
      cache_.reset(from);  // a gap: the head starts over at `from`
    } else {
      cache_.truncate(from);  // drops the draft positions
    }
    const std::span<const int64_t> next =
        verified.sequence.subspan(static_cast<size_t>(from + 1), static_cast<size_t>(n));
    const at::Tensor ids = detail::to_device<int64_t>(next, {n}, head_.device());
    const at::Tensor outputs =
        head_.forward(ids, head_.fuse(verified.features.narrow(0, 0, n)), cache_);
    last_ = outputs.narrow(0, n - 1, 1);
    // seen_ already holds the sequence up to `from` (the cache's positions before it read those
    // tokens): only the step's new tokens are appended, not the whole sequence.
    const auto agreed = static_cast<size_t>(from + 1);
    if (seen_.size() > agreed) seen_.resize(agreed);
    seen_.insert(seen_.end(), verified.sequence.begin() + static_cast<std::ptrdiff_t>(seen_.size()),
                 verified.sequence.begin() + from + n + 1);
  }

 private:
  const models::EagleHead& head_;
  models::EagleCache cache_;
  std::vector<int64_t> seen_;  // the tokens the cache's positions read
  at::Tensor last_{};  // [1, H]: the layer's output at cache_.end() - 1, after a verified step
};

// An EAGLE head as a chain draft source of the step core (see the top of this file). The target
// must be a FeatureTarget whose hidden size, vocabulary and layer count fit the head; the head must
// outlive the source.
class EagleDraftSource {
 public:
  // Throws std::invalid_argument when the head does not fit the target (hidden size, vocabulary,
  // feature layers).
  template <FeatureTarget T>
  EagleDraftSource(const models::EagleHead& head, const T& target) : state_(head, target) {}

  [[nodiscard]] std::span<const int64_t> feature_taps() const noexcept {
    return state_.feature_taps();
  }
  [[nodiscard]] int64_t vocab_size() const noexcept { return state_.vocab_size(); }
  [[nodiscard]] const models::EagleCache& cache() const noexcept { return state_.cache(); }

  void start(std::span<const int64_t> sequence, const SpeculativeOptions& /*options*/) {
    state_.start(sequence);
  }

  template <LogitsProcessor P>
  Drafts draft(const DraftRequest& request, const P& processor, at::Generator& gen) {
    const at::Tensor last = state_.last_for(request.sequence.size());
    if (!last.defined()) return {};
    const int64_t k = std::min(request.gamma, request.room);
    if (k <= 0) return {};
    const models::EagleHead& head = state_.head();
    if constexpr (std::is_same_v<P, GreedyProcessor>) {
      if (head.uses_cpu_kernels() && last.device().is_cpu() && last.scalar_type() == at::kFloat) {
        return draft_on_host(last, k);
      }
    }
    Drafts drafts{.calls = k};
    std::vector<at::Tensor> tokens, rows;
    at::Tensor out = last;
    for (int64_t i = 0; i < k; ++i) {
      if (i > 0) out = head.forward(tokens.back(), out, state_.cache());
      const at::Tensor logits = head.logits(out);  // [1, draft_vocab]
      if constexpr (std::is_same_v<P, GreedyProcessor>) {
        tokens.push_back(head.to_target(logits.argmax(-1)));
        rows.push_back(logits.amax(-1));
      } else {
        const at::Tensor q = processor(head.target_logits(logits));
        tokens.push_back(processor.sample(q, gen).view({1}).to(head.device()));
        rows.push_back(q);
      }
    }
    drafts.tokens = at::cat(tokens);
    if constexpr (std::is_same_v<P, GreedyProcessor>) {
      drafts.finite = at::isfinite(at::cat(rows)).all();
    } else {
      drafts.probs = at::cat(rows, 0);
    }
    return drafts;
  }

  void verified(const VerifiedDrafts& verified) { state_.verified(verified); }

 private:
  // draft() under greedy decoding with the head's CPU loops: the same drafts, each the first
  // maximum of its logits row read by the host, without an ATen call per draft.
  Drafts draft_on_host(const at::Tensor& last, int64_t k) {
    const models::EagleHead& head = state_.head();
    std::vector<int64_t> tokens(static_cast<size_t>(k));
    bool finite = true;
    at::Tensor id = at::empty({1}, at::kLong);
    at::Tensor out = last;
    for (int64_t i = 0; i < k; ++i) {
      if (i > 0) {
        id.data_ptr<int64_t>()[0] = tokens[static_cast<size_t>(i - 1)];
        out = head.forward(id, out, state_.cache());
      }
      const at::Tensor logits = head.logits(out);
      const detail::RowMax best = detail::row_max(logits.data_ptr<float>(), logits.size(1), 1);
      tokens[static_cast<size_t>(i)] = head.target_id(best.index);
      finite = finite && best.finite;
    }
    Drafts drafts = Drafts::from_host(tokens, at::kCPU, k);
    if (!finite) drafts.finite = at::zeros({}, at::kBool);
    return drafts;
  }

  EagleHeadState state_;
};
static_assert(HasFeatureTaps<EagleDraftSource> && HasStartHook<EagleDraftSource>);

// Dynamic draft trees from an EAGLE head. Round r runs the head once over the top_k frontier
// nodes, each at its own position, attending to the head's cache of verified positions and to its
// own ancestors among the draft positions of the rounds before (kept in the head's cache for the
// step, hidden from other branches by the mask). A tree of depth D costs D - 1 head forwards of
// top_k tokens after the first row. The verified step then feeds the head the target's hidden
// states at the accepted path, as the chain source does.
class EagleTreeSource : public detail::DeviceTreeVerifier {
 public:
  // Throws std::invalid_argument when the head does not fit the target, or an option is out of
  // range (top_k above the head's draft vocabulary, total_tokens leaving no room for a context
  // in the target's max_sequence_length).
  template <FeatureTarget T>
  EagleTreeSource(const models::EagleHead& head, const T& target,
                  const DynamicTreeOptions& options = {})
      : state_(head, target), options_(options) {
    detail::check_dynamic_tree_options(options, head.config().kind == models::EagleKind::eagle3
                                                    ? head.config().draft_vocab_size
                                                    : head.config().vocab_size());
    detail::check_tree_fits_target(options.total_tokens, "total_tokens",
                                   detail::sequence_limit(target));
  }

  [[nodiscard]] std::span<const int64_t> feature_taps() const noexcept {
    return state_.feature_taps();
  }
  [[nodiscard]] int64_t vocab_size() const noexcept { return state_.vocab_size(); }
  [[nodiscard]] const DynamicTreeOptions& options() const noexcept { return options_; }
  [[nodiscard]] const models::EagleCache& cache() const noexcept { return state_.cache(); }

  void start(std::span<const int64_t> sequence, const SpeculativeOptions& /*options*/) {
    state_.start(sequence);
  }

  TreeDrafts draft_tree(const DraftRequest& request) {
    const models::EagleHead& head = state_.head();
    models::EagleCache& cache = state_.cache();
    const int64_t k = options_.top_k;
    const int64_t depth = std::min(options_.depth, request.room);
    const int64_t n = std::min(
        {options_.total_tokens, detail::DeviceDraftTree::candidates(depth, k), request.capacity});
    const at::Tensor last = state_.last_for(request.sequence.size());
    if (n <= 0 || !last.defined()) {
      tree_.clear(k, request.device);
      return tree_.drafts(request.device, 0);
    }
    const int64_t context = cache.length();  // the verified entries; draft entries follow
    const int64_t base = cache.end();        // the head position of a depth-1 node
    const auto longs = at::TensorOptions().dtype(at::kLong).device(head.device());
    at::Tensor outputs = last;  // the outputs of the frontier's parents, by row
    at::Tensor lineage;         // [k, draft entries]: each frontier node's ancestors and itself
    int64_t calls = 1;
    const at::Tensor own = at::eye(k, longs.dtype(at::kBool));
    const at::Tensor verified = at::ones({k, context}, own.options());
    tree_.build(
        head.target_logits(head.logits(last)), depth, options_, n,
        [&](int64_t round, const at::Tensor& tokens, const at::Tensor& parent_rows) {
          lineage = round == 2 ? own : at::cat({lineage.index_select(0, parent_rows), own}, 1);
          const at::Tensor visible = at::cat({verified, lineage}, 1);
          outputs = head.forward_masked(tokens, outputs.index_select(0, parent_rows), cache,
                                        at::full({k}, base + round - 2, longs), visible);
          ++calls;
          return head.target_logits(head.logits(outputs));
        });
    return tree_.drafts(request.device, calls);
  }

  // Drops the step's draft entries and feeds the head the target's states at the accepted path.
  void verified_tree(const VerifiedDrafts& verified) { state_.verified(verified); }

 private:
  EagleHeadState state_;
  DynamicTreeOptions options_;
};
static_assert(TreeDraftSource<EagleTreeSource, GreedyProcessor> && HasFeatureTaps<EagleTreeSource>);

}  // namespace specdec
