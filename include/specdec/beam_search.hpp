// Beam search: the baseline for tasks that want the most probable sequence (translation,
// summarisation) rather than a sample. All beams run as one batch through the target, and the
// target's cache rows are reordered when beams are reselected.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/detail/check.hpp"
#include "specdec/detail/generation_state.hpp"
#include "specdec/detail/model_runner.hpp"
#include "specdec/detail/torch_compat.hpp"
#include "specdec/device.hpp"
#include "specdec/result.hpp"

namespace specdec {

// Options of beam_search_generate (seed 002's beam_search_generate).
struct BeamSearchOptions {
  int64_t max_new_tokens = 40;           // most tokens a hypothesis generates (>= 0)
  std::vector<int64_t> eos_token_ids{};  // tokens that finish a hypothesis (kept in it)
  bool use_cache = true;                 // false recomputes every beam's whole sequence each step
  int64_t num_beams = 4;                 // hypotheses kept per step (>= 1)
  int64_t top_k = 4;                     // candidates taken from each beam per step (>= 1)
  int64_t min_length = 0;                // end tokens are suppressed before this many new tokens
  double alpha = 1.0;                    // length penalty: score = log-probability / length^alpha
                                         // (>= 0; 0 ranks by log-probability alone)
};

struct BeamHypothesis {
  std::vector<int64_t> tokens{};  // generated tokens (prompt excluded), an end token included
  double log_probability = 0;     // sum of the target's log-probabilities of the tokens
  double score = 0;               // log_probability / tokens.size()^alpha
  bool finished = false;          // ended with an end token (false: stopped at the length limit)
};

struct BeamSearchResult {
  std::vector<int64_t> tokens{};         // the best hypothesis' tokens
  std::vector<BeamHypothesis> n_best{};  // at most num_beams hypotheses, best score first
  GenerationStats stats{};               // target_calls, steps, generated (best hypothesis), times
  int64_t tokens_scored = 0;             // tokens fed through the target, all beams together
};

// Beam search over `target` from `prompt`.
//
// Requires: prompt non-empty with ids in [0, vocab); num_beams >= 1, top_k >= 1, alpha >= 0,
//   max_new_tokens >= 0, min_length >= 0; end tokens in [0, vocab).
// Returns: the n-best hypotheses by length-penalised score. The search stops when no live beam
//   can still beat the worst of num_beams finished hypotheses, so with num_beams and top_k large
//   enough to keep every candidate it returns the exact best sequence.
// Throws: std::invalid_argument naming the parameter and value; whatever the model throws.
template <class T>
  requires Target<T> && ReorderableKVCache<typename T::cache_type>
[[nodiscard]] BeamSearchResult beam_search_generate(T& target, std::span<const int64_t> prompt,
                                                    const BeamSearchOptions& options = {}) {
  const auto vocab = static_cast<int64_t>(target.vocab_size());
  if (options.num_beams < 1) detail::throw_invalid("num_beams", "be >= 1", options.num_beams);
  if (options.top_k < 1) detail::throw_invalid("top_k", "be >= 1", options.top_k);
  if (!(options.alpha >= 0.0)) detail::throw_invalid("alpha", "be >= 0", options.alpha);
  if (options.min_length < 0) detail::throw_invalid("min_length", "be >= 0", options.min_length);
  const int64_t limit = detail::sequence_limit(target);
  detail::check_common(options, prompt, vocab, limit);
  const auto start_time = std::chrono::steady_clock::now();

  const int64_t beams = options.num_beams;
  const int64_t k = std::min(options.top_k, vocab);
  const int64_t max_new = std::min(options.max_new_tokens, limit - static_cast<int64_t>(prompt.size()));
  const auto& eos = options.eos_token_ids;
  const auto is_eos = [&](int64_t t) { return std::find(eos.begin(), eos.end(), t) != eos.end(); };
  const auto score_of = [&](double log_probability, size_t length) {
    return length == 0 ? log_probability : log_probability / std::pow(static_cast<double>(length), options.alpha);
  };
  const double kDead = -std::numeric_limits<double>::infinity();

  BeamSearchResult result;
  GenerationStats& stats = result.stats;
  const at::Device device = target.device();
  detail::ModelRunner<T> runner(target, "target", options.use_cache,
                                {.calls = &stats.target_calls, .seconds = &stats.target_seconds,
                                 .positions = &stats.target_positions},
                                beams);
  const at::Tensor eos_ids = detail::to_device<int64_t>(eos, {static_cast<int64_t>(eos.size())}, device);

  // Live beams: tokens so far and log-probability; one live beam at the start, the others dead.
  std::vector<std::vector<int64_t>> live(static_cast<size_t>(beams));
  std::vector<double> live_log_probability(static_cast<size_t>(beams), kDead);
  live_log_probability[0] = 0;
  std::vector<BeamHypothesis> finished;
  const auto worst_kept = [&] {
    return static_cast<int64_t>(finished.size()) < beams ? kDead : finished.back().score;
  };
  const auto keep_finished = [&](BeamHypothesis h) {
    finished.insert(std::upper_bound(finished.begin(), finished.end(), h,
                                     [](const auto& a, const auto& b) { return a.score > b.score; }),
                    std::move(h));
    if (static_cast<int64_t>(finished.size()) > beams) finished.pop_back();
  };

  // Every beam starts as the prompt: one prompt row repeated.
  at::Tensor ids = detail::to_device_ids(prompt, device).expand({beams, static_cast<int64_t>(prompt.size())}).contiguous();
  std::vector<int64_t> rows;
  for (int64_t step = 0; step < max_new; ++step) {
    if (!options.use_cache) {
      rows.clear();
      for (const auto& beam : live) {
        rows.insert(rows.end(), prompt.begin(), prompt.end());
        rows.insert(rows.end(), beam.begin(), beam.end());
      }
      ids = detail::to_device<int64_t>(rows, {beams, static_cast<int64_t>(rows.size()) / beams}, device);
    }
    const at::Tensor logits = runner.forward_batch(ids);
    at::Tensor log_probs = logits.select(1, logits.size(1) - 1).to(at::kDouble).log_softmax(-1);
    if (step < options.min_length && !eos.empty()) log_probs.index_fill_(1, eos_ids, kDead);
    // One device-to-host copy: the top-k of every beam, and whether the best of each is valid.
    const auto [top_values, top_tokens] = log_probs.topk(k, -1);
    const at::Tensor best = top_values.select(1, 0);
    const at::Tensor valid = at::isfinite(best).logical_or(best == kDead).all().to(at::kDouble).view({1});
    const at::Tensor host = detail::to_host(at::cat({top_values.flatten(), top_tokens.to(at::kDouble).flatten(), valid}));
    const double* values = host.data_ptr<double>();
    const double* top = values + beams * k;
    if (values[2 * beams * k] == 0.0) detail::throw_non_finite("beam_search_generate", "target", /*logits_finite=*/false);
    struct Candidate {
      double log_probability{};
      int64_t beam{};
      int64_t token{};
    };
    std::vector<Candidate> candidates;
    for (int64_t b = 0; b < beams; ++b) {
      if (live_log_probability[static_cast<size_t>(b)] == kDead) continue;
      for (int64_t j = 0; j < k; ++j) {
        const double lp = values[b * k + j];
        if (lp == kDead) continue;
        candidates.push_back({live_log_probability[static_cast<size_t>(b)] + lp, b, static_cast<int64_t>(top[b * k + j])});
      }
    }
    std::stable_sort(candidates.begin(), candidates.end(),
                     [](const Candidate& a, const Candidate& b) { return a.log_probability > b.log_probability; });
    std::vector<std::vector<int64_t>> next(static_cast<size_t>(beams));
    std::vector<double> next_log_probability(static_cast<size_t>(beams), kDead);
    std::vector<int64_t> parents(static_cast<size_t>(beams), 0), tokens(static_cast<size_t>(beams), 0);
    int64_t filled = 0;
    for (const Candidate& c : candidates) {
      if (filled == beams) break;
      std::vector<int64_t> sequence = live[static_cast<size_t>(c.beam)];
      sequence.push_back(c.token);
      if (is_eos(c.token)) {
        const double score = score_of(c.log_probability, sequence.size());
        if (score > worst_kept()) keep_finished({std::move(sequence), c.log_probability, score, true});
        continue;
      }
      parents[static_cast<size_t>(filled)] = c.beam;
      tokens[static_cast<size_t>(filled)] = c.token;
      next_log_probability[static_cast<size_t>(filled)] = c.log_probability;
      next[static_cast<size_t>(filled)] = std::move(sequence);
      ++filled;
    }
    ++stats.steps;
    if (filled == 0) {  // every candidate finished: no beam lives on
      live_log_probability.assign(live_log_probability.size(), kDead);
      break;
    }
    // Dead rows copy the first live beam so that every row stays a valid sequence of one length.
    for (int64_t b = filled; b < beams; ++b) {
      parents[static_cast<size_t>(b)] = parents[0];
      tokens[static_cast<size_t>(b)] = tokens[0];
      next[static_cast<size_t>(b)] = next[0];
    }
    live = std::move(next);
    live_log_probability = std::move(next_log_probability);
    // Stop when no live beam can beat the worst kept hypothesis: log-probabilities only fall, and
    // with alpha >= 0 a score is at best log_probability / max_length^alpha.
    const double best_live = *std::max_element(live_log_probability.begin(), live_log_probability.end());
    if (score_of(best_live, static_cast<size_t>(max_new)) <= worst_kept() || step + 1 == max_new) break;
    if (options.use_cache) {
      std::vector<int64_t> identity(static_cast<size_t>(beams));
      std::iota(identity.begin(), identity.end(), 0);
      if (parents != identity) runner.reorder(at::from_blob(parents.data(), {beams}, at::kLong));  // checked, one upload
      ids = detail::to_device<int64_t>(tokens, {beams, 1}, device);
    }
  }
  for (size_t b = 0; b < live.size(); ++b) {
    if (live_log_probability[b] == kDead) continue;
    const double score = score_of(live_log_probability[b], live[b].size());
    if (score > worst_kept()) keep_finished({live[b], live_log_probability[b], score, false});
  }
  result.n_best = std::move(finished);
  if (!result.n_best.empty()) result.tokens = result.n_best.front().tokens;
  stats.generated = static_cast<int64_t>(result.tokens.size());
  stats.total_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_time).count();
  result.tokens_scored = stats.target_positions;
  return result;
}

}  // namespace specdec
