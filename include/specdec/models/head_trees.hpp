// Draft trees from feature-level drafters: EAGLE heads grow dynamic trees (EAGLE-2's procedure,
// dynamic_tree.hpp), Medusa heads fill static trees given as paths (Medusa's tree choices). Both
// are TreeDraftSources for generate_with and sessions; the target must model FeatureTarget and
// MaskedTreeTarget with forward_with_mask_features (LlamaModel does), since the tree's layout is
// on the device and the head reads the target's hidden states at the accepted path.
//
// Children are the head's top-k tokens, deterministic given the context, so verification is the
// deterministic rule of model_tree.hpp: the output is the target's distribution under any
// sampling, and under greedy decoding autoregressive decoding token for token. A step that
// follows no verified step (a generation's first) drafts no tree: the target's forward then
// hands the head its first hidden states.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/detail/check.hpp"
#include "specdec/device.hpp"
#include "specdec/draft_source.hpp"
#include "specdec/dynamic_tree.hpp"
#include "specdec/logits_processor.hpp"
#include "specdec/model_tree.hpp"
#include "specdec/models/eagle.hpp"
#include "specdec/models/medusa.hpp"
#include "specdec/options.hpp"
#include "specdec/step.hpp"
#include "specdec/tree.hpp"

namespace specdec::detail {

// Throws std::invalid_argument when a tree of `nodes` draft nodes cannot follow even one token in
// the target's context of `limit` positions (a tree that merely outgrows the room left near the
// end is cut instead: an ordinary end).
inline void check_tree_fits_target(int64_t nodes, std::string_view name, int64_t limit) {
  if (nodes >= limit) {
    throw_invalid_message(name, " is ", nodes, "; the target's max_sequence_length ", limit,
                          " leaves no room for a context");
  }
}

}  // namespace specdec::detail

namespace specdec::models {

// Dynamic draft trees from an EAGLE head (EAGLE-1 or EAGLE-3). Round r runs the head once over
// the top_k frontier nodes, each at its own position, attending to the head's cache of verified
// positions and to its own ancestors among the draft positions of the rounds before (kept in the
// head's cache for the step, hidden from other branches by the mask). A tree of depth D costs
// D - 1 head forwards of top_k tokens after the first row. The verified step then feeds the head
// the target's hidden states at the accepted path, as EagleDraftSource does.
class EagleTreeSource : public specdec::detail::DeviceTreeVerifier {
 public:
  // Throws std::invalid_argument when the head does not fit the target, or an option is out of
  // range (top_k above the head's draft vocabulary, total_tokens leaving no room for a context
  // in the target's max_sequence_length).
  template <FeatureTarget T>
  EagleTreeSource(const EagleHead& head, const T& target, const DynamicTreeOptions& options = {})
      : chain_(head, target), options_(options) {
    detail::check_dynamic_tree_options(options, head.config().kind == EagleKind::eagle3
                                                    ? head.config().draft_vocab_size
                                                    : head.config().vocab_size());
    detail::check_tree_fits_target(options.total_tokens, "total_tokens",
                                   detail::sequence_limit(target));
  }

  [[nodiscard]] std::span<const int64_t> feature_taps() const noexcept {
    return chain_.feature_taps();
  }
  [[nodiscard]] int64_t vocab_size() const noexcept { return chain_.vocab_size(); }
  [[nodiscard]] const DynamicTreeOptions& options() const noexcept { return options_; }
  [[nodiscard]] const EagleCache& cache() const noexcept { return chain_.cache(); }

  void start(std::span<const int64_t> sequence, const SpeculativeOptions& options) {
    chain_.start(sequence, options);
  }

  TreeDrafts draft_tree(const DraftRequest& request) {
    const EagleHead& head = chain_.head_;
    EagleCache& cache = chain_.cache_;
    const int64_t k = options_.top_k;
    const int64_t depth = std::min(options_.depth, request.room);
    const int64_t n = std::min(
        {options_.total_tokens, detail::DeviceDraftTree::candidates(depth, k), request.capacity});
    // The head's last output must be the one at the position before the sequence's last token.
    if (n <= 0 || !chain_.last_.defined() ||
        cache.end() + 1 != static_cast<int64_t>(request.sequence.size())) {
      tree_.clear(k, request.device);
      return tree_.drafts(request.device, 0);
    }
    const int64_t context = cache.length();  // the verified entries; draft entries follow
    const int64_t base = cache.end();        // the head position of a depth-1 node
    const auto longs = at::TensorOptions().dtype(at::kLong).device(head.device());
    at::Tensor outputs = chain_.last_;  // the outputs of the frontier's parents, by row
    at::Tensor lineage;  // [k, draft entries]: each frontier node's ancestors and itself
    int64_t calls = 1;
    tree_.build(
        head.target_logits(head.logits(chain_.last_)), depth, options_, n,
        [&](int64_t round, const at::Tensor& paths, const at::Tensor& parent_rows) {
          const at::Tensor own = at::eye(k, longs.dtype(at::kBool));
          lineage = round == 2 ? own : at::cat({lineage.index_select(0, parent_rows), own}, 1);
          const at::Tensor visible = at::cat({at::ones({k, context}, own.options()), lineage}, 1);
          const at::Tensor tokens = paths.select(1, paths.size(1) - 1).contiguous();
          outputs = head.forward_masked(tokens, outputs.index_select(0, parent_rows), cache,
                                        at::full({k}, base + round - 2, longs), visible);
          ++calls;
          return head.target_logits(head.logits(outputs));
        });
    return tree_.drafts(request.device, calls);
  }

  // Drops the step's draft entries and feeds the head the target's states at the accepted path.
  void verified_tree(const VerifiedDrafts& verified) { chain_.verified(verified); }

 private:
  EagleDraftSource chain_;  // the head's cache across steps, as chain drafting keeps it
  DynamicTreeOptions options_;
};
static_assert(TreeDraftSource<EagleTreeSource, GreedyProcessor> && HasFeatureTaps<EagleTreeSource>);

// Static draft trees from Medusa heads: node (r_1, ..., r_d) of the tree (TreeTemplate, e.g.
// TreeTemplate::from_paths of Medusa's choices) is the rank-r_d token of head d, all heads read
// at the target's last verified hidden state: one heads' forward per step. The tree must be at
// most as deep as there are heads.
class MedusaTreeSource : public specdec::detail::DeviceTreeVerifier {
 public:
  // Throws std::invalid_argument when the heads do not fit the target, the tree is deeper than
  // the heads or leaves no room for a context in the target's max_sequence_length, or a node's
  // rank is not below the vocabulary.
  template <FeatureTarget T>
  MedusaTreeSource(const MedusaHeads& heads, const T& target, const TreeTemplate& shape)
      : chain_(heads, target), shape_(shape) {
    if (shape_.max_depth() > heads.config().num_heads) {
      detail::throw_invalid_message("shape is ", shape_.max_depth(), " deep but there are only ",
                                    heads.config().num_heads, " Medusa heads");
    }
    detail::check_tree_fits_target(shape_.size(), "shape's node count",
                                   detail::sequence_limit(target));
    for (int64_t i = 0; i < shape_.size(); ++i) width_ = std::max(width_, shape_.rank(i) + 1);
    if (width_ > heads.config().vocab_size) {
      detail::throw_invalid_message("shape has a node with ", width_,
                                    " children, more than the vocab_size ",
                                    heads.config().vocab_size);
    }
  }

  [[nodiscard]] std::span<const int64_t> feature_taps() const noexcept {
    return chain_.feature_taps();
  }
  [[nodiscard]] int64_t vocab_size() const noexcept { return chain_.vocab_size(); }

  void start(std::span<const int64_t> sequence, const SpeculativeOptions& options) {
    chain_.start(sequence, options);
  }

  TreeDrafts draft_tree(const DraftRequest& request) {
    const MedusaHeads& heads = chain_.heads_;
    const int64_t n = std::min(shape_.within(std::max<int64_t>(0, request.room)), request.capacity);
    if (n <= 0 || !chain_.hidden_.defined() ||
        chain_.hidden_position_ != static_cast<int64_t>(request.sequence.size()) - 2) {
      tree_.clear(1, request.device);
      return tree_.drafts(request.device, 0);
    }
    const int64_t depth = shape_.depth(n - 1);
    const at::Tensor logits = heads.logits(chain_.hidden_.to(heads.device()), depth);  // [depth, V]
    const at::Tensor top = std::get<1>(logits.topk(width_, -1)).flatten();  // [depth * width]
    pick_.resize(static_cast<size_t>(n));
    ranks_.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      ranks_[static_cast<size_t>(i)] = shape_.rank(i);
      pick_[static_cast<size_t>(i)] = (shape_.depth(i) - 1) * width_ + shape_.rank(i);
    }
    const at::Tensor ids =
        top.index_select(0, detail::to_device<int64_t>(pick_, {n}, top.device()));
    tree_.assign(ids.to(request.device), shape_.parents(n), ranks_, depth);
    tree_.check_finite(logits);
    return tree_.drafts(request.device, 1);
  }

  // Keeps the target's hidden state at the last accepted position for the next tree.
  void verified_tree(const VerifiedDrafts& verified) { chain_.verified(verified); }

 private:
  MedusaDraftSource chain_;
  detail::BreadthFirstTree shape_;
  int64_t width_ = 1;
  std::vector<int64_t> pick_, ranks_;
};
static_assert(TreeDraftSource<MedusaTreeSource, GreedyProcessor> &&
              HasFeatureTaps<MedusaTreeSource>);

}  // namespace specdec::models
