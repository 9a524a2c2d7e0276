// STAND (seed 004; Song et al. 2025, arXiv 2506.04708): model-free speculative decoding from a
// memory of the target's own next-token distributions (ProbabilisticNGramStorage). Each step
// draws a whole draft tree from the memory, shaped by a TreeTemplate, scores every node in one
// tree-attention forward of the target, and accepts a path by recursive rejection sampling
// (Jeon et al. 2024, arXiv 2402.14160), so the output is distributed exactly as the target's (token
// for token equal to autoregressive decoding under greedy decoding). The memory learns the
// target's distribution at every verified position and is shared across calls: the more
// trajectories of one prompt have been sampled, the better it drafts.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <span>
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
#include "specdec/step.hpp"
#include "specdec/tree.hpp"

namespace specdec {

// Options of stand_generate. The common fields come first, as in every options struct.
struct StandOptions {
  int64_t max_new_tokens = 40;           // most tokens to generate (>= 0)
  std::vector<int64_t> eos_token_ids{};  // tokens that end generation (kept in the output)
  std::vector<std::vector<int64_t>> stop_sequences{};  // token sequences that end generation when
                                         // generated (kept in the output)
  std::optional<uint64_t> seed{};        // seed of the sampling and drafting randomness
  bool use_cache = true;                 // false recomputes the whole sequence at every forward
  StepCallback on_step{};                // called after every step; drafts = the accepted path and
                                         // the first rejected sibling after it, gamma = tree size
  TreeTemplate tree = TreeTemplate::default_tree();  // the shape bound of every draft tree
  int64_t max_depth = 0;                 // deepest draft (>= 0); 0: the template's depth
  bool stochastic = true;                // children drawn by Gumbel-top-k from the memory's
                                         // distribution (STAND); false: its most probable tokens
  bool learn = true;                     // update the memory from the target's distributions at
                                         // verified positions (the prompt's included)
  std::vector<int64_t>* node_acceptances = nullptr;  // when set: one counter per template node
                                         // (resized to tree.size() if empty), incremented for each
                                         // accepted draft, for TreeTemplate::learned()
};

namespace detail {

// Biased variants of the tree verification, for tests that must tell them from the exact one.
enum class TreeVerification { exact, with_replacement, skip_residual };

inline constexpr int64_t kStandTop = ProbabilisticNGramStorage::kTopTokens;

// A draft tree drawn from the memory. Position 0 is the root (the sequence's last token);
// position k + 1 is draft node k. Nodes are created breadth-first, so the children of a position
// are the consecutive nodes first_child .. first_child + children - 1, in draw order.
struct DraftTree {
  // What a position's children were drawn from: q over q_size tokens, renormalised.
  struct Position {
    int64_t first_child = 0;
    int64_t children = 0;
    int64_t q_size = 0;
    std::array<int64_t, kStandTop> q_tokens{};
    std::array<double, kStandTop> q_probs{};
  };
  std::vector<int64_t> tokens{}, parents{}, template_nodes{}, depth{};  // per draft node
  std::vector<Position> positions{};                                    // root, then one per node
  int64_t lookups = 0;

  [[nodiscard]] int64_t nodes() const noexcept { return static_cast<int64_t>(tokens.size()); }
  void clear() {
    tokens.clear();
    parents.clear();
    template_nodes.clear();
    depth.clear();
    positions.assign(1, Position{});
    lookups = 0;
  }
};

// Draws draft trees from the memory (host side, plain integers; buffers are reused across steps).
class TreeDrafter {
 public:
  TreeDrafter(const ProbabilisticNGramStorage& memory, const TreeTemplate& shape, bool stochastic, uint64_t seed)
      : memory_(memory), shape_(shape), stochastic_(stochastic), rng_(seed) {}

  std::mt19937_64& rng() noexcept { return rng_; }

  // A tree of at most `budget` nodes, at most `max_depth` deep, below the end of `sequence`.
  // Positions are expanded in creation order, which is breadth-first.
  void draw(std::span<const int64_t> sequence, int64_t max_depth, int64_t budget, DraftTree& tree) {
    tree.clear();
    for (int64_t position = 0; position <= tree.nodes(); ++position) {
      const auto node = static_cast<size_t>(position - 1);
      const int64_t depth = position == 0 ? 0 : tree.depth[node];
      const auto slots = shape_.children(position == 0 ? -1 : tree.template_nodes[node]);
      if (slots.empty() || depth >= max_depth || tree.nodes() >= budget) continue;
      context_of(sequence, tree, position);
      const ProbabilisticNGramStorage::Entry* entry = memory_.find(context_);
      ++tree.lookups;
      if (entry == nullptr) continue;
      // q: the stored distribution renormalised over its tokens of positive probability.
      DraftTree::Position& here = tree.positions[static_cast<size_t>(position)];
      double mass = 0;
      for (uint32_t i = 0; i < entry->size; ++i) {
        if (entry->probabilities[i] > 0.0F) {
          here.q_tokens[static_cast<size_t>(here.q_size)] = entry->tokens[i];
          here.q_probs[static_cast<size_t>(here.q_size)] = entry->probabilities[i];
          mass += entry->probabilities[i];
          ++here.q_size;
        }
      }
      if (here.q_size == 0) continue;
      for (int64_t i = 0; i < here.q_size; ++i) here.q_probs[static_cast<size_t>(i)] /= mass;
      // Draw order: Gumbel-top-k on log q (sampling without replacement), or q's own order.
      std::array<int64_t, kStandTop> order{};
      for (int64_t i = 0; i < here.q_size; ++i) order[static_cast<size_t>(i)] = i;
      if (stochastic_) {
        std::array<double, kStandTop> keys{};
        for (int64_t i = 0; i < here.q_size; ++i) {
          const double u = std::max(uniform_(rng_), std::numeric_limits<double>::min());
          keys[static_cast<size_t>(i)] = std::log(here.q_probs[static_cast<size_t>(i)]) - std::log(-std::log(u));
        }
        std::sort(order.begin(), order.begin() + here.q_size,
                  [&](int64_t a, int64_t b) { return keys[static_cast<size_t>(a)] > keys[static_cast<size_t>(b)]; });
      }
      here.first_child = tree.nodes();
      here.children = std::min({static_cast<int64_t>(slots.size()), here.q_size, budget - tree.nodes()});
      for (int64_t j = 0; j < here.children; ++j) {
        tree.tokens.push_back(here.q_tokens[static_cast<size_t>(order[static_cast<size_t>(j)])]);
        tree.parents.push_back(position - 1);
        tree.template_nodes.push_back(slots[static_cast<size_t>(j)]);
        tree.depth.push_back(depth + 1);
      }
      // Only now grow positions: `here` refers into it.
      tree.positions.resize(static_cast<size_t>(tree.nodes()) + 1);
    }
  }

 private:
  // context_ <- the last max_context tokens of sequence ++ (the path to `position`).
  void context_of(std::span<const int64_t> sequence, const DraftTree& tree, int64_t position) {
    const int64_t want = memory_.max_context();
    path_.clear();
    for (int64_t p = position; p > 0 && static_cast<int64_t>(path_.size()) < want;
         p = tree.parents[static_cast<size_t>(p - 1)] + 1) {
      path_.push_back(tree.tokens[static_cast<size_t>(p - 1)]);
    }
    const int64_t from_sequence = std::min<int64_t>(want - static_cast<int64_t>(path_.size()),
                                                    static_cast<int64_t>(sequence.size()));
    context_.assign(sequence.end() - from_sequence, sequence.end());
    context_.insert(context_.end(), path_.rbegin(), path_.rend());
  }

  const ProbabilisticNGramStorage& memory_;
  const TreeTemplate& shape_;
  bool stochastic_;
  std::mt19937_64 rng_;
  std::uniform_real_distribution<double> uniform_{0.0, 1.0};
  std::vector<int64_t> path_, context_;
};

// What the host needs of the target for one tree: at each position, p at q's tokens, the mass of
// p outside them and a token sampled from p restricted to outside them.
struct TreeTargetView {
  std::span<const double> at_q{};            // [positions, kStandTop]
  std::span<const double> outside_mass{};    // [positions]
  std::span<const double> outside_sample{};  // [positions]
};

// The accepted path of a verified tree and the token sampled after it.
struct TreeWalk {
  std::vector<int64_t> path{};  // accepted draft nodes, root to leaf
  int64_t token = 0;
  int64_t rejected = -1;      // the first rejected child at the last position, -1 if none
};

// Recursive rejection sampling down the tree (exact for children drawn without replacement, and
// for deterministic children as one-hot drafts): at a position with target distribution r = p and
// draft distribution q, for each child x in draw order accept with probability
// min(1, r(x) / q_j(x)) and descend; otherwise r <- normalise(max(r - q_j, 0)) and (sampling
// without replacement) x leaves q. q_j is q without the earlier children, renormalised, or
// one-hot at x for deterministic children. With no child accepted, the token is drawn from r.
// r differs from p only on q's tokens, so the host tracks those and the mass outside them.
inline void walk_tree(const DraftTree& tree, const TreeTargetView& target, bool stochastic, std::mt19937_64& rng,
                      TreeWalk& walk, TreeVerification variant = TreeVerification::exact) {
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  walk.path.clear();
  walk.rejected = -1;
  int64_t position = 0;
  while (true) {
    const auto pos = static_cast<size_t>(position);
    const DraftTree::Position& here = tree.positions[pos];
    const int64_t s = here.q_size;
    std::array<double, kStandTop> r{};
    std::array<double, kStandTop> q = here.q_probs;
    double inside = 0;
    for (int64_t i = 0; i < s; ++i) {
      r[static_cast<size_t>(i)] = target.at_q[pos * kStandTop + static_cast<size_t>(i)];
      inside += r[static_cast<size_t>(i)];
    }
    const double outside = std::max(0.0, target.outside_mass[pos]);
    double total = outside + inside;
    int64_t accepted = -1;
    for (int64_t child = here.first_child; child < here.first_child + here.children; ++child) {
      const int64_t token = tree.tokens[static_cast<size_t>(child)];
      int64_t x = 0;
      while (here.q_tokens[static_cast<size_t>(x)] != token) ++x;
      std::array<double, kStandTop> qj{};
      if (!stochastic) {
        qj[static_cast<size_t>(x)] = 1.0;
      } else {
        double mass = 0;
        for (int64_t i = 0; i < s; ++i) mass += q[static_cast<size_t>(i)];
        for (int64_t i = 0; i < s; ++i) qj[static_cast<size_t>(i)] = mass > 0 ? q[static_cast<size_t>(i)] / mass : 0.0;
      }
      const double ratio = total > 0 ? r[static_cast<size_t>(x)] / total / qj[static_cast<size_t>(x)] : 0.0;
      if (uniform(rng) < ratio) {
        accepted = child;
        break;
      }
      if (walk.rejected < 0) walk.rejected = child;
      if (variant != TreeVerification::skip_residual) {
        std::array<double, kStandTop> next = r;
        double next_inside = 0;
        for (int64_t i = 0; i < s; ++i) {
          next[static_cast<size_t>(i)] = std::max(0.0, r[static_cast<size_t>(i)] - qj[static_cast<size_t>(i)] * total);
          next_inside += next[static_cast<size_t>(i)];
        }
        if (outside + next_inside > 0) {  // r == q_j exactly cannot reject; guard rounding
          r = next;
          inside = next_inside;
          total = outside + inside;
        }
      }
      if (stochastic && variant != TreeVerification::with_replacement) q[static_cast<size_t>(x)] = 0.0;
    }
    if (accepted >= 0) {
      walk.path.push_back(accepted);
      walk.rejected = -1;
      position = accepted + 1;
      continue;
    }
    // Sample from r: one of q's tokens with probability inside / total, else from outside them.
    double u = uniform(rng) * total;
    walk.token = static_cast<int64_t>(target.outside_sample[pos]);
    if (u < inside) {
      for (int64_t i = 0; i < s; ++i) {
        if (u < r[static_cast<size_t>(i)] || i == s - 1) {
          walk.token = here.q_tokens[static_cast<size_t>(i)];
          break;
        }
        u -= r[static_cast<size_t>(i)];
      }
    }
    return;
  }
}

// STAND as a TreeDraftSource of the shared step (step.hpp): draws trees from the memory, asks the
// target's device for what the host walk needs (p at q's tokens, the mass outside them, a token
// sampled outside them and, to learn from, the top tokens of every verified row), walks the tree
// and teaches the memory the target's distributions at the verified positions.
class StandDraftSource {
 public:
  StandDraftSource(ProbabilisticNGramStorage& memory, const StandOptions& options, TreeVerification variant,
                   int64_t limit, int64_t vocab)
      : memory_(memory),
        options_(options),
        variant_(variant),
        limit_(limit),
        top_(std::min(kStandTop, vocab)),
        max_depth_(options.max_depth > 0 ? options.max_depth : options.tree.max_depth()),
        // Drafting and the host walk draw from their own stream, derived from the seed.
        drafter_(memory, options.tree, options.stochastic,
                 options.seed ? *options.seed * 0x9E3779B97F4A7C15ULL + 1 : random_seed()) {}

  TreeDrafts draft_tree(const DraftRequest& request) {
    length_ = static_cast<int64_t>(request.sequence.size());
    const int64_t budget = std::min(options_.tree.size(), limit_ == std::numeric_limits<int64_t>::max()
                                                              ? options_.tree.size()
                                                              : limit_ - length_);
    drafter_.draw(request.sequence, std::min(max_depth_, request.room), budget, tree_);
    return TreeDrafts{.tokens = tree_.tokens, .parents = tree_.parents, .calls = tree_.lookups};
  }

  template <LogitsProcessor P>
  at::Tensor score_tree(const at::Tensor& logits, int64_t uncached, const P& processor, at::Generator& gen) {
    const int64_t u = uncached;
    const int64_t n = tree_.nodes();
    u_ = u;
    first_context_ = length_ - u;  // position of logits row 0
    learn_from_ = options_.learn ? std::clamp<int64_t>(learned_until_ - first_context_, 0, u - 1) : u - 1;
    const at::Tensor p = processor(logits.narrow(0, learn_from_, u + n - learn_from_));
    const at::Tensor tree_p = p.narrow(0, u - 1 - learn_from_, n + 1);

    // q's tokens at every position, padded with its first token; token 0 where q is empty, which
    // has_q marks so that nothing is masked there.
    q_index_buffer_.assign(static_cast<size_t>((n + 1) * kStandTop), 0);
    has_q_buffer_.assign(static_cast<size_t>(n + 1), 0.0);
    for (int64_t pos = 0; pos <= n; ++pos) {
      const DraftTree::Position& here = tree_.positions[static_cast<size_t>(pos)];
      if (here.q_size == 0) continue;
      has_q_buffer_[static_cast<size_t>(pos)] = 1.0;
      for (int64_t i = 0; i < kStandTop; ++i) {
        q_index_buffer_[static_cast<size_t>(pos * kStandTop + i)] = here.q_tokens[static_cast<size_t>(i < here.q_size ? i : 0)];
      }
    }
    const at::Device device = logits.device();
    const at::Tensor q_index = to_device<int64_t>(q_index_buffer_, {n + 1, kStandTop}, device);
    const at::Tensor has_q = to_device<double>(has_q_buffer_, {n + 1, 1}, device).to(tree_p.scalar_type());
    const at::Tensor p_at_index = tree_p.gather(1, q_index);
    const at::Tensor at_q = p_at_index * has_q;
    // p with q's tokens zeroed (rows without q write their own values back), its mass, and a token
    // drawn from it: the part of r no rejection changes.
    const at::Tensor outside = tree_p.scatter(1, q_index, p_at_index - at_q);
    const at::Tensor outside_mass = outside.sum(1, /*keepdim=*/true);
    const at::Tensor outside_sample =
        processor.sample(at::where(outside_mass > 0, outside / outside_mass.clamp_min(1e-30), tree_p), gen);
    std::vector<at::Tensor> parts{at_q.to(at::kDouble).flatten(), outside_mass.to(at::kDouble).flatten(),
                                  outside_sample.to(at::kDouble).flatten(),
                                  at::isfinite(p.sum()).to(at::kDouble).view({1})};
    if (options_.learn) {
      const auto [values, indices] = p.topk(top_, -1);
      parts.push_back(values.to(at::kDouble).flatten());
      parts.push_back(indices.to(at::kDouble).flatten());
    }
    return at::cat(parts);
  }

  // Reads the host copy of score_tree's tensor; `values` stays valid until verified_tree returns.
  TreeVerdict walk_tree(const double* values) {
    values_ = values;
    const auto positions = static_cast<size_t>(tree_.nodes() + 1);
    if (values[positions * (kStandTop + 2)] == 0.0) throw_non_finite("stand_generate", "target");
    const TreeTargetView view{{values, positions * kStandTop},
                              {values + positions * kStandTop, positions},
                              {values + positions * (kStandTop + 1), positions}};
    detail::walk_tree(tree_, view, options_.stochastic, drafter_.rng(), walk_, variant_);
    emitted_drafts_.clear();
    for (const int64_t node : walk_.path) emitted_drafts_.push_back(tree_.tokens[static_cast<size_t>(node)]);
    if (walk_.rejected >= 0) emitted_drafts_.push_back(tree_.tokens[static_cast<size_t>(walk_.rejected)]);
    if (options_.node_acceptances != nullptr) {
      for (const int64_t node : walk_.path) {
        ++(*options_.node_acceptances)[static_cast<size_t>(tree_.template_nodes[static_cast<size_t>(node)])];
      }
    }
    return TreeVerdict{.path = walk_.path, .drafts = emitted_drafts_, .token = walk_.token};
  }

  // Teaches the memory the target's distributions at the verified positions not learned yet.
  void verified_tree(std::span<const int64_t> sequence, int64_t /*position*/) {
    if (!options_.learn) return;
    const int64_t n = tree_.nodes();
    const auto positions = n + 1;
    const int64_t u = u_;
    const double* values = values_ + positions * (kStandTop + 2) + 1;
    const double* indices = values + (u + n - learn_from_) * top_;
    const auto learn_row = [&](int64_t row, int64_t position) {  // row of p; position it predicts after
      if (position >= static_cast<int64_t>(sequence.size())) return;
      observed_tokens_.resize(static_cast<size_t>(top_));
      std::array<float, kStandTop> probabilities{};
      for (int64_t i = 0; i < top_; ++i) {
        observed_tokens_[static_cast<size_t>(i)] = static_cast<int64_t>(indices[row * top_ + i]);
        probabilities[static_cast<size_t>(i)] = static_cast<float>(values[row * top_ + i]);
      }
      memory_.update(sequence.first(static_cast<size_t>(position + 1)), observed_tokens_,
                     std::span<const float>(probabilities.data(), static_cast<size_t>(top_)));
    };
    for (int64_t row = 0; row < u - learn_from_; ++row) learn_row(row, first_context_ + learn_from_ + row);
    const auto accepted = static_cast<int64_t>(walk_.path.size());
    for (int64_t d = 0; d < accepted; ++d) {
      learn_row(u - learn_from_ + walk_.path[static_cast<size_t>(d)], length_ + d);
    }
    learned_until_ = length_ + accepted;
  }

 private:
  ProbabilisticNGramStorage& memory_;
  const StandOptions& options_;
  TreeVerification variant_;
  int64_t limit_;
  int64_t top_;
  int64_t max_depth_;
  TreeDrafter drafter_;
  DraftTree tree_;
  TreeWalk walk_;
  std::vector<int64_t> emitted_drafts_, q_index_buffer_, observed_tokens_;
  std::vector<double> has_q_buffer_;
  const double* values_ = nullptr;
  int64_t length_ = 0, u_ = 0, first_context_ = 0, learn_from_ = 0;
  int64_t learned_until_ = 0;  // positions whose next-token distribution the memory has seen
};

template <TreeTarget T, LogitsProcessor P>
GenerationResult stand_generate_impl(ProbabilisticNGramStorage& memory, T& target, std::span<const int64_t> prompt,
                                     const StandOptions& options, const P& processor, TreeVerification variant) {
  const auto vocab = static_cast<int64_t>(target.vocab_size());
  if (memory.vocab_size() != vocab) {
    throw_invalid_message("memory.vocab_size() must equal target.vocab_size() = ", vocab, ", got ",
                          memory.vocab_size());
  }
  if (options.max_depth < 0) throw_invalid("max_depth", "be >= 0", options.max_depth);
  std::vector<int64_t>* acceptances = options.node_acceptances;
  if (acceptances != nullptr) {
    if (acceptances->empty()) acceptances->assign(static_cast<size_t>(options.tree.size()), 0);
    if (static_cast<int64_t>(acceptances->size()) != options.tree.size()) {
      throw_invalid_message("node_acceptances must be empty or have tree.size() = ", options.tree.size(),
                            " entries, got ", acceptances->size());
    }
  }
  const int64_t limit = sequence_limit(target);
  check_common(options, prompt, vocab, limit);
  std::vector<int64_t> sequence(prompt.begin(), prompt.end());
  ModelRunner<T> runner(target, "target", options.use_cache);
  StandDraftSource source(memory, options, variant, limit, vocab);
  return run_generation(runner, sequence, source, step_options(options), processor, limit, /*draft=*/true);
}

}  // namespace detail

// STAND: drafts trees from `memory` and verifies them exactly in one target forward per step.
//
// Requires: memory.vocab_size() == target.vocab_size(); everything autoregressive_generate
//   requires; options.max_depth >= 0; options.node_acceptances empty or of tree.size() entries.
// Returns: as autoregressive_generate. stats.drafted counts tree nodes verified, accepted the
//   drafts accepted, drafter_calls memory look-ups; tokens_per_target_call() is the mean
//   acceptance length + 1.
// Throws: std::invalid_argument naming the parameter and value; whatever the model throws.
template <TreeTarget T, LogitsProcessor P = GreedyProcessor>
[[nodiscard]] GenerationResult stand_generate(ProbabilisticNGramStorage& memory, T& target,
                                              std::span<const int64_t> prompt, const StandOptions& options = {},
                                              const P& processor = {}) {
  return detail::stand_generate_impl(memory, target, prompt, options, processor, detail::TreeVerification::exact);
}

// Samples `trajectories` generations of one prompt, one after another, sharing `memory`: the
// test-time-scaling use STAND is made for. Trajectory i uses seed options.seed + i when a seed
// is set.
template <TreeTarget T, LogitsProcessor P = GreedyProcessor>
[[nodiscard]] std::vector<GenerationResult> stand_generate_trajectories(ProbabilisticNGramStorage& memory, T& target,
                                                                        std::span<const int64_t> prompt,
                                                                        int64_t trajectories,
                                                                        const StandOptions& options = {},
                                                                        const P& processor = {}) {
  if (trajectories < 1) detail::throw_invalid("trajectories", "be >= 1", trajectories);
  std::vector<GenerationResult> results;
  results.reserve(static_cast<size_t>(trajectories));
  StandOptions run = options;
  for (int64_t i = 0; i < trajectories; ++i) {
    if (options.seed) run.seed = *options.seed + static_cast<uint64_t>(i);
    results.push_back(stand_generate(memory, target, prompt, run, processor));
  }
  return results;
}

}  // namespace specdec
