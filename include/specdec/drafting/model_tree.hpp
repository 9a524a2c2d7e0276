// Static draft trees from a drafter model: the drafter proposes a whole tree of a fixed shape
// (a TreeTemplate, e.g. from Medusa-style path lists) instead of one chain, the target scores
// every node in one tree-attention forward, and recursive rejection sampling over siblings picks
// the accepted path, so one early mismatch no longer wastes every later draft.
//
// Children of a node are either its drafter's top-k tokens (deterministic) or tokens drawn from
// the drafter's distribution without replacement (sampled, by Gumbel-top-k), each verified by
// its own exact rule (drafting/tree_verification.hpp): the output is distributed exactly as the
// target's, and under greedy decoding it is autoregressive decoding token for token. The tree's
// tokens never visit the host; the step's one device-to-host copy brings back the verdict.
//
// Why static shapes for sampled children: the exactness of sampled children needs each child's
// inclusion to depend only on its ancestors and earlier siblings. A shape chosen by the drafted
// tokens' scores (a dynamic tree) makes it depend on the child itself, which biases the output.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/detail/check.hpp"
#include "specdec/detail/model_runner.hpp"
#include "specdec/detail/torch_compat.hpp"
#include "specdec/device.hpp"
#include "specdec/draft_source.hpp"
#include "specdec/drafting/tree_verification.hpp"
#include "specdec/logits_processor.hpp"
#include "specdec/options.hpp"
#include "specdec/step.hpp"
#include "specdec/tree.hpp"

namespace specdec {

// How a node's children are drafted.
enum class TreeChildren {
  top_k,    // the drafter's most probable tokens, in order (deterministic; q one-hot)
  sampled,  // drawn from the drafter's distribution without replacement (q matters)
};

// Drafts a static tree from a drafter model per step, for generate_with (a TreeDraftSource):
// level by level, the drafter scores every node of the tree so far in one tree-attention forward
// and each node of the level below takes its rank among its parent's top-k tokens or draws.
// Every level re-feeds the tree above it (a TreeTarget attends to every cached position, so
// nodes of other branches cannot stay cached while a level is scored); the drafter's cache keeps
// the accepted path afterwards. A tree of depth D costs D drafter forwards and one target
// forward per step.
//
// Near the end of the sequence the tree is cut to the levels and nodes that fit (an ordinary
// end, never an error). Under GreedyProcessor the children are always the top-k (a greedy
// drafter has one token with mass).
//
// Requires: D models TreeTarget (tree attention); the drafter's vocabulary equals the target's.
// Throws: std::invalid_argument when the tree does not fit the drafter's context at all, or the
// drafter's logits are not finite.
template <TreeTarget D>
class ModelTreeSource : public detail::VerifiesTree<> {
 public:
  // A source with a cache of its own (use_cache false recomputes the sequence at every forward).
  ModelTreeSource(D& drafter, const TreeTemplate& shape,
                  TreeChildren children = TreeChildren::top_k, bool use_cache = true)
      : runner_(drafter, "drafter", use_cache), shape_(shape), children_(children) {
    const int64_t limit = detail::sequence_limit(drafter, runner_.cache());
    int64_t widest = 0;
    for (int64_t i = 0; i < shape.size(); ++i) widest = std::max(widest, shape.rank(i) + 1);
    if (widest > vocab_size()) {
      detail::throw_invalid_message("shape has a node with ", widest,
                                    " children, more than the drafter's vocab_size ", vocab_size());
    }
    if (shape_.size() >= limit) {
      detail::throw_invalid_message("shape has ", shape_.size(),
                                    " nodes; the drafter's max_sequence_length ", limit,
                                    " leaves no room for a context");
    }
  }

  [[nodiscard]] int64_t vocab_size() const {
    return static_cast<int64_t>(runner_.model().vocab_size());
  }
  [[nodiscard]] TreeChildren children() const noexcept { return children_; }
  [[nodiscard]] const typename D::cache_type& cache() const noexcept { return runner_.cache(); }

  void start(std::span<const int64_t> sequence, const SpeculativeOptions& options) {
    runner_.set_use_cache(options.use_cache);
    runner_.resume(sequence);
  }
  void finish(std::span<const int64_t> sequence) { runner_.record(sequence); }

  // Drafts the tree below request.sequence: at most request.room levels, request.capacity nodes.
  // Sampled children are drawn through `processor` with `gen`.
  template <LogitsProcessor P>
  TreeDrafts draft_tree(const DraftRequest& request, const P& processor, at::Generator& gen) {
    length_ = static_cast<int64_t>(request.sequence.size());
    const int64_t drafter_room = detail::sequence_limit(runner_.model(), runner_.cache()) - length_;
    int64_t n = shape_.within(std::max<int64_t>(0, request.room));
    n = std::clamp<int64_t>(std::min({n, request.capacity, drafter_room}), 0, shape_.size());
    if (drafter_room < 1) n = 0;  // the context alone fills the drafter: the target goes on alone
    n_ = n;
    fed_ = 0;
    ranks_.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) ranks_[static_cast<size_t>(i)] = shape_.rank(i);
    const std::span<const int64_t> parents = shape_.parents(n);
    layout_.build(parents, ranks_);
    calls_ = 0;
    const at::Device device = runner_.device();
    const auto longs = at::TensorOptions().dtype(at::kLong).device(device);
    ids_ = at::empty({0}, longs);
    valid_ = at::ones({n}, longs.dtype(at::kBool));
    q_rows_.clear();
    tree_.start();
    if (n == 0) {  // nothing to draft: no drafter forward (the context may not even fit it)
      return finish_tree<P>(request, parents);
    }
    // Level 0: the context (what the drafter has not seen of it); its last row is the root's.
    int64_t uncached = 0;
    at::Tensor level_logits = drafter_forward(request.sequence, at::Tensor(), {}, &uncached);
    level_logits = level_logits.narrow(0, level_logits.size(0) - 1, 1);
    int64_t level_begin = -1, level_end = 0;  // positions of the level above, as nodes (root: -1)
    for (int64_t depth = 1; level_end < n; ++depth) {
      const int64_t begin = level_end;
      const int64_t end = std::min(n, shape_.within(depth));
      // Children of the level above: the top-k or draws of each of its positions.
      int64_t width = 0;
      for (int64_t i = begin; i < end; ++i) width = std::max(width, shape_.rank(i) + 1);
      const at::Tensor candidates = children_of(level_logits, width, sampling<P>(), processor, gen);
      // Node i of this level is candidate (parent - first parent of the level, rank).
      pick_.resize(static_cast<size_t>(end - begin));
      const int64_t first_parent = level_begin < 0 ? -1 : level_begin;
      for (int64_t i = begin; i < end; ++i) {
        pick_[static_cast<size_t>(i - begin)] =
            (parents[static_cast<size_t>(i)] - first_parent) * width + shape_.rank(i);
      }
      const at::Tensor pick = detail::to_device<int64_t>(pick_, {end - begin}, device);
      ids_ = at::cat({ids_, candidates.flatten().index_select(0, pick)});
      if (drawn_valid_.defined())
        valid_.narrow(0, begin, end - begin).copy_(drawn_valid_.flatten().index_select(0, pick));
      level_begin = begin;
      level_end = end;
      if (end >= n) break;
      // The next level's parents: score this level (and the tree above it) with the drafter.
      runner_.truncate(length_);
      const at::Tensor logits =
          drafter_forward(request.sequence, ids_, shape_.parents(end), &uncached);
      fed_ = end;
      level_logits = logits.narrow(0, uncached + begin, end - begin);
    }
    return finish_tree<P>(request, parents);
  }

  // Keeps in the drafter's cache the context and the accepted nodes it scored.
  void verified_tree(std::span<const int64_t> /*sequence*/, int64_t position) {
    kept_.clear();
    for (const int64_t node : tree_.path()) {
      if (node >= fed_) break;
      kept_.push_back(node);
    }
    // A step that drafted nothing fed the drafter nothing: it may hold less than `position`.
    if (kept_.empty()) {
      runner_.truncate(position);
    } else {
      runner_.keep_tree(position, kept_);
    }
  }

 private:
  template <class P>
  [[nodiscard]] bool sampling() const {
    return children_ == TreeChildren::sampled && !std::is_same_v<P, GreedyProcessor>;
  }

  // Hands the drafted tree to the verifier (its layout on the drafter's device) and to the step.
  template <class P>
  TreeDrafts finish_tree(const DraftRequest& request, std::span<const int64_t> parents) {
    const int64_t n = n_;
    tree_.set(ids_, detail::to_device<int64_t>(layout_.children,
                                               {n + 1, std::max<int64_t>(layout_.width, 1)},
                                               runner_.device()));
    if (n > 0 && sampling<P>()) tree_.set_sampled(valid_, position_q(n));
    return TreeDrafts{.parents = parents, .calls = calls_, .ids = ids_.to(request.device)};
  }

  at::Tensor drafter_forward(std::span<const int64_t> context, const at::Tensor& ids,
                             std::span<const int64_t> parents, int64_t* uncached) {
    ++calls_;
    const at::Tensor logits = runner_.forward_tree(context, ids, parents, uncached);
    return logits;
  }

  // The children of each row of `logits` [parents, V]: [parents, width] tokens, the top-k or
  // (sampled) drawn without replacement from processor(logits).
  template <LogitsProcessor P>
  at::Tensor children_of(const at::Tensor& logits, int64_t width, bool sampled, const P& processor,
                         at::Generator& gen) {
    tree_.check_finite(logits);
    drawn_valid_ = at::Tensor();
    if (!sampled) return std::get<1>(logits.topk(width, -1));
    const at::Tensor q = processor(logits);
    q_rows_.push_back(q);
    // Gumbel-top-k: the order of log q + Gumbel noise is a draw without replacement.
    const at::Tensor u =
        at::rand(q.sizes(), gen, q.options()).clamp_min(std::numeric_limits<float>::min());
    const at::Tensor keys = q.log() - (-u.log()).log();
    const auto [values, tokens] = keys.topk(width, -1);
    drawn_valid_ = values.isfinite();
    return tokens;
  }

  // q at every position, [n + 1, V]: the drafter's distribution the position's children were
  // drawn from (zeros at leaves).
  at::Tensor position_q(int64_t n) {
    int64_t have = 0;
    for (const at::Tensor& level : q_rows_) have += level.size(0);
    std::vector<at::Tensor> rows = q_rows_;
    if (have < n + 1)
      rows.push_back(at::zeros({n + 1 - have, vocab_size()}, q_rows_.front().options()));
    return at::cat(rows).narrow(0, 0, n + 1);
  }

  detail::ModelRunner<D> runner_;
  detail::BreadthFirstTree shape_;
  TreeChildren children_;
  detail::TreeLayout layout_;
  std::vector<int64_t> ranks_, pick_, kept_;
  std::vector<at::Tensor> q_rows_;
  at::Tensor ids_, valid_, drawn_valid_;
  int64_t length_ = 0, n_ = 0, fed_ = 0, calls_ = 0;
};

}  // namespace specdec
