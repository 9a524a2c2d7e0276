// Drafting with Medusa heads (models/medusa.hpp): chains (MedusaDraftSource) and static trees
// (MedusaTreeSource). Both read the target's final normalised hidden state (FeatureTarget tap L)
// at the last accepted position, which every step hands over in VerifiedDrafts::features; head i
// proposes the token i + 2 places after it. A step that follows no verified step of the same
// generation (a generation's first) drafts nothing: the target's forward then hands the heads
// their first hidden state.
//
// Chains are the heads' top tokens (sampled from their distributions under sampling, so
// verification stays exact). A tree's children are the heads' top-k tokens, deterministic given
// the context, so its verification is the deterministic rule of drafting/model_tree.hpp: the
// output is the target's distribution under any sampling, and autoregressive decoding token for
// token under greedy decoding.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/detail/check.hpp"
#include "specdec/detail/torch_compat.hpp"
#include "specdec/device.hpp"
#include "specdec/draft_source.hpp"
#include "specdec/drafting/dynamic_tree.hpp"
#include "specdec/drafting/model_tree.hpp"
#include "specdec/models/medusa.hpp"
#include "specdec/options.hpp"

namespace specdec {

// What a chain and a tree source of the same heads keep between steps: the target's final hidden
// state at the last accepted position. The heads must outlive it.
class MedusaHeadState {
 public:
  // Throws std::invalid_argument when the heads do not fit the target (hidden size, vocabulary).
  template <FeatureTarget T>
  MedusaHeadState(const models::MedusaHeads& heads, const T& target)
      : heads_(heads), taps_{static_cast<int64_t>(target.num_hidden_layers())} {
    const models::MedusaConfig& c = heads.config();
    if (c.hidden_size != static_cast<int64_t>(target.hidden_size())) {
      detail::throw_invalid_message("medusa: hidden_size = ", c.hidden_size,
                                    " but the target's hidden size is ", target.hidden_size());
    }
    if (c.vocab_size != static_cast<int64_t>(target.vocab_size())) {
      detail::throw_invalid_message("medusa: vocab_size = ", c.vocab_size,
                                    " but the target's vocabulary is ", target.vocab_size());
    }
  }

  [[nodiscard]] const models::MedusaHeads& heads() const noexcept { return heads_; }
  [[nodiscard]] std::span<const int64_t> feature_taps() const noexcept { return taps_; }
  [[nodiscard]] int64_t vocab_size() const noexcept { return heads_.config().vocab_size; }

  // The hidden state the heads continue a sequence of `length` tokens from (the one of the token
  // before its last, the target's own token), on the heads' device; undefined when the last step
  // did not end there.
  [[nodiscard]] at::Tensor hidden_for(size_t length) const {
    if (!hidden_.defined() || hidden_position_ != static_cast<int64_t>(length) - 2) return {};
    return hidden_.to(heads_.device());
  }

  void start() { clear(); }

  void verified(const VerifiedDrafts& verified) {
    if (!verified.features.defined() || verified.features.size(0) == 0) {
      clear();
      return;
    }
    hidden_ = verified.features.select(0, -1);  // a view on the target's device
    hidden_position_ = verified.features_from + verified.features.size(0) - 1;
  }

 private:
  void clear() {
    hidden_ = at::Tensor();
    hidden_position_ = -1;
  }

  const models::MedusaHeads& heads_;
  std::vector<int64_t> taps_;
  at::Tensor hidden_{};  // the final hidden state at hidden_position_
  int64_t hidden_position_ = -1;
};

// Medusa heads as a chain draft source of the step core (see the top of this file). The target
// must be a FeatureTarget of the heads' hidden size and vocabulary; the heads must outlive the
// source.
class MedusaDraftSource {
 public:
  // Throws std::invalid_argument when the heads do not fit the target (hidden size, vocabulary).
  template <FeatureTarget T>
  MedusaDraftSource(const models::MedusaHeads& heads, const T& target) : state_(heads, target) {}

  [[nodiscard]] std::span<const int64_t> feature_taps() const noexcept {
    return state_.feature_taps();
  }
  [[nodiscard]] int64_t vocab_size() const noexcept { return state_.vocab_size(); }

  void start(std::span<const int64_t> /*sequence*/, const SpeculativeOptions& /*options*/) {
    state_.start();
  }

  template <LogitsProcessor P>
  Drafts draft(const DraftRequest& request, const P& processor, at::Generator& gen) {
    const at::Tensor hidden = state_.hidden_for(request.sequence.size());
    if (!hidden.defined()) return {};
    const models::MedusaHeads& heads = state_.heads();
    const int64_t k = std::min({request.gamma, request.room, heads.config().num_heads});
    if (k <= 0) return {};
    const at::Tensor logits = heads.logits(hidden, k);
    Drafts drafts{.calls = 1};
    if constexpr (std::is_same_v<P, GreedyProcessor>) {
      drafts.tokens = logits.argmax(-1);
      drafts.finite = at::isfinite(logits.amax(-1)).all();
    } else {
      drafts.probs = processor(logits);
      drafts.tokens = processor.sample(drafts.probs, gen).view({k});
    }
    return drafts;
  }

  void verified(const VerifiedDrafts& verified) { state_.verified(verified); }

 private:
  MedusaHeadState state_;
};
static_assert(HasFeatureTaps<MedusaDraftSource>);

// Static draft trees from Medusa heads: node (r_1, ..., r_d) of the tree (TreeTemplate, e.g.
// TreeTemplate::from_paths of Medusa's choices) is the rank-r_d token of head d, all heads read
// at the target's last verified hidden state: one heads' forward per step. The tree must be at
// most as deep as there are heads. The target must also model MaskedFeatureTreeTarget.
class MedusaTreeSource : public detail::DeviceTreeVerifier {
 public:
  // Throws std::invalid_argument when the heads do not fit the target, the tree is deeper than
  // the heads or leaves no room for a context in the target's max_sequence_length, or a node's
  // rank is not below the vocabulary.
  template <FeatureTarget T>
  MedusaTreeSource(const models::MedusaHeads& heads, const T& target, const TreeTemplate& shape)
      : state_(heads, target), tree_shape_(shape) {
    const detail::BreadthFirstTree& levels = tree_shape_.shape();
    if (levels.max_depth() > heads.config().num_heads) {
      detail::throw_invalid_message("shape is ", levels.max_depth(), " deep but there are only ",
                                    heads.config().num_heads, " Medusa heads");
    }
    detail::check_tree_fits_target(levels.size(), "shape's node count",
                                   detail::sequence_limit(target));
    if (tree_shape_.width() > heads.config().vocab_size) {
      detail::throw_invalid_message("shape has a node with ", tree_shape_.width(),
                                    " children, more than the vocab_size ",
                                    heads.config().vocab_size);
    }
  }

  [[nodiscard]] std::span<const int64_t> feature_taps() const noexcept {
    return state_.feature_taps();
  }
  [[nodiscard]] int64_t vocab_size() const noexcept { return state_.vocab_size(); }

  void start(std::span<const int64_t> /*sequence*/, const SpeculativeOptions& /*options*/) {
    state_.start();
  }

  TreeDrafts draft_tree(const DraftRequest& request) {
    const detail::BreadthFirstTree& levels = tree_shape_.shape();
    const int64_t n = std::min(levels.within(std::max<int64_t>(0, request.room)), request.capacity);
    const at::Tensor hidden = state_.hidden_for(request.sequence.size());
    if (n <= 0 || !hidden.defined()) {
      tree_.clear(1, request.device);
      return tree_.drafts(request.device, 0);
    }
    tree_shape_.assign(tree_, state_.heads().logits(hidden, levels.depth(n - 1)), n, request.device);
    return tree_.drafts(request.device, 1);
  }

  // Keeps the target's hidden state at the last accepted position for the next tree.
  void verified_tree(const VerifiedDrafts& verified) { state_.verified(verified); }

 private:
  MedusaHeadState state_;
  detail::RankedLevelTree tree_shape_;
};
static_assert(TreeDraftSource<MedusaTreeSource, GreedyProcessor> &&
              HasFeatureTaps<MedusaTreeSource>);

}  // namespace specdec
