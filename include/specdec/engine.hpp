// Continuous batching: a serving engine's scheduler drives speculative decoding one step at a
// time, with requests that join and leave between steps, each with its own sampling parameters,
// end tokens, stop sequences, token budget, draft method and draft length.
//
//   specdec::Engine engine(drafter, target, {.max_rows = 8});
//   const auto id = engine.add({.prompt = tokens, .max_new_tokens = 64, .sampling = {.temperature = 0.7}});
//   while (!engine.idle()) {
//     for (const specdec::EngineEvent& event : engine.step()) { /* stream event.tokens */ }
//   }
//
// A step is batch generation's step (batch.hpp, the one implementation both share): the rows
// that draft with the drafter model draft together in batched forwards, the rows that draft with
// the engine's EAGLE head or Medusa heads (EngineOptions::eagle, medusa) in batched head forwards
// fed the target's tapped hidden states, prompt-lookup rows draft on the host; the target
// verifies every row's drafts in one forward, each row keeps its own accepted prefix, and the
// whole step costs one device-to-host copy. Sampling parameters are per-row tensors
// (RowProcessor): one forward and one verification whatever the mix.
//
// The pool: the target's cache (and the drafter's) holds max_rows rows, allocated once
// (StaticKVCache: rows that finish free their slots, rows that join reuse them, nothing is
// allocated per step). A request added while max_rows are generating waits in a first-in,
// first-out queue of at most max_waiting; beyond that add() refuses it (returns nullopt) and
// changes nothing. A waiting request joins at the first step where a row is free and its prompt
// fits under the target's limit. Its prompt is prefilled by a forward of its own, one row in a
// scratch cache copied into its slot (AppendableKVCache's append_rows_from), so the step's shared
// forward feeds it one token beside the other rows' drafts: a shared forward is padded to its
// widest row, and a long prompt there would make every row compute its width. A cache type
// without append_rows_from has the prompt fed whole in that shared forward instead.
//
// Draft length: each step drafts, for every row, at most the k that the engine's cost model
// says gives the batch the most tokens per second, from what it measured: each request's
// acceptance, the target forward's fixed cost and cost per position, the drafting's cost per
// column and per drafter position, the rest of a step (detail/draft_cost.hpp has the model).
// Each request's gamma caps it; k falls to 0 (the rows decode with the target alone, the drafter
// does not run) when speculation does not pay; drafters that fell behind meanwhile catch up
// when drafting would pay again (a smaller batch), and one drafting column now and then, at
// most a small share of the target-only time (smaller while explorations find that drafting
// still does not pay), keeps the estimates current.
// A joining request's acceptance starts from the engine's pooled estimate for its draft method.
// EngineOptions::adaptive_draft_length = false drafts every request's own gamma every step
// instead.
//
// Exactness: under greedy decoding every request's tokens equal its own speculative_generate
// (and autoregressive_generate) output, whatever joins, leaves or is cancelled around it; a
// sampled request's tokens are distributed as its target distribution under its own parameters.
// The draft method and gamma of a request change only what is drafted, never the output.
//
// Randomness: a request with a seed (SamplingParams::seed) draws every random number from its
// seed and the position it decides (row_processor.hpp), so its tokens depend on its seed, prompt,
// parameters and drafts only, whatever shares its steps; with the adaptive draft length its drafts
// depend on what the engine measured, so a seeded request is reproducible under a fixed draft
// length (adaptive_draft_length = false, or gamma 0). Requests without a seed draw from one
// generator, seeded by EngineOptions::seed, whose draws depend on the whole batch (their
// distribution does not).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <deque>
#include <limits>
#include <optional>
#include <span>
#include <stdexcept>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "specdec/batch.hpp"
#include "specdec/concepts.hpp"
#include "specdec/detail/check.hpp"
#include "specdec/detail/draft_cost.hpp"
#include "specdec/drafting/head_batches.hpp"
#include "specdec/ngram_storage.hpp"
#include "specdec/options.hpp"
#include "specdec/result.hpp"
#include "specdec/row_processor.hpp"

namespace specdec {

// Where a request's drafts come from.
enum class DraftMethod {
  none,           // no drafts: the target alone, one token per step
  drafter,        // the engine's drafter model (batched with the other rows that use it)
  prompt_lookup,  // the request's own text (PromptLookupDrafter: n-grams of up to 3 tokens)
  eagle,          // the engine's EAGLE head (EngineOptions::eagle), batched
  medusa,         // the engine's Medusa heads (EngineOptions::medusa), batched
};

inline std::ostream& operator<<(std::ostream& out, DraftMethod method) {
  switch (method) {
    case DraftMethod::none: return out << "none";
    case DraftMethod::drafter: return out << "drafter";
    case DraftMethod::prompt_lookup: return out << "prompt_lookup";
    case DraftMethod::eagle: return out << "eagle";
    case DraftMethod::medusa: return out << "medusa";
  }
  return out << "unknown";
}

// A request: what to generate after `prompt`, and how.
struct Request {
  std::vector<int64_t> prompt{};         // token ids (non-empty, each in [0, vocab))
  int64_t max_new_tokens = 40;           // most tokens to generate (>= 0)
  std::vector<int64_t> eos_token_ids{};  // tokens that end the request (kept in its output)
  std::vector<std::vector<int64_t>> stop_sequences{};  // token sequences that end it (kept)
  SamplingParams sampling{};             // its own sampling (default: greedy)
  DraftMethod drafting = DraftMethod::drafter;  // drafter, eagle and medusa where the engine
                                                // has them; none and prompt_lookup always
  int64_t gamma = 4;                     // most drafts per step (>= 0; 0 drafts nothing; Medusa
                                         // drafts at most one per head)
};

using RequestId = int64_t;

// What a step did for one request.
struct EngineEvent {
  RequestId id = 0;
  std::vector<int64_t> tokens{};             // the tokens the step appended to its output
  std::optional<GenerationResult> result{};  // set when the request ended with this step: its
                                             // whole output, stats and stop reason
};

// Options of an Engine.
struct EngineOptions {
  int64_t max_rows = 8;             // requests generating at once: the rows of the caches (>= 1)
  int64_t max_waiting = 1024;       // requests queued beyond those (>= 0); add() refuses more
  std::optional<uint64_t> seed{};   // seed of the generator of the requests without a seed of
                                    // their own; unset: nondeterministic
  bool adaptive_draft_length = true;  // each step drafts what the cost model says pays, up to
                                      // each request's gamma, down to 0 (detail/draft_cost.hpp);
                                      // false: every request drafts its own gamma every step
  // Heads the requests may draft from (DraftMethod::eagle, DraftMethod::medusa), kept by the
  // caller for the engine's life. With either, the target models FeatureTarget and every target
  // forward taps the hidden states they read.
  const models::EagleHead* eagle = nullptr;
  const models::MedusaHeads* medusa = nullptr;
};

// The engine's cost model as it stands (detail/draft_cost.hpp): a step of b rows and k > 0
// drafts each, m of the rows drafting with the drafter model, is predicted to cost
//   fixed_seconds + seconds_per_position b (k + 1) + seconds_per_column k
//     + seconds_per_drafter_position m (k + 1) + overhead_seconds[1]
// and a step without drafts fixed_seconds + seconds_per_position b + overhead_seconds[0].
struct EngineCosts {
  double fixed_seconds = 0;
  double seconds_per_position = 0;
  double seconds_per_column = 0;
  double seconds_per_drafter_position = 0;
  double overhead_seconds[2]{};
  int64_t draft_length = 0;  // the last step's k
  double explore_share = 0;  // the most the next exploring column may cost, as a share of the
                             // target-only time before it (halved by each futile exploration)
};

// Where a request stands.
enum class RequestState {
  waiting,     // queued: it joins at a step where a row is free and its prompt fits
  generating,  // in the batch
};

namespace detail {

// One [b, W] block of drafts from the parts each draft method made (row i's drafts come from the
// part of methods[i]; every part has valid 0 at the other rows). q: each part's own where it has
// one, one-hot at the deterministic parts' drafts; finite: each part's where it has one.
struct DraftPart {
  DraftMethod method = DraftMethod::none;
  BatchDrafts drafts{};
};

inline BatchDrafts merge_drafts(std::vector<DraftPart>& parts, std::span<const DraftMethod> methods, int64_t vocab,
                                const at::Device& device) {
  const auto b = static_cast<int64_t>(methods.size());
  BatchDrafts result{.valid = std::vector<int64_t>(static_cast<size_t>(b), 0)};
  int64_t width = 0;
  DraftPart* only = nullptr;
  int64_t with_tokens = 0;
  for (DraftPart& part : parts) {
    for (int64_t i = 0; i < b; ++i) {
      if (methods[static_cast<size_t>(i)] == part.method) {
        result.valid[static_cast<size_t>(i)] = part.drafts.valid[static_cast<size_t>(i)];
        width = std::max(width, result.valid[static_cast<size_t>(i)]);
      }
    }
    if (part.drafts.tokens.defined()) {
      ++with_tokens;
      only = &part;
    }
  }
  if (width == 0) return result;
  if (with_tokens == 1) {  // one method drafted: its block as it is
    only->drafts.valid = std::move(result.valid);
    return std::move(only->drafts);
  }
  const auto fit = [&](const at::Tensor& t) {  // [b, w, ...] to [b, width, ...]
    if (t.size(1) >= width) return t.narrow(1, 0, width);
    auto shape = t.sizes().vec();
    shape[1] = width - t.size(1);
    return at::cat({t, at::zeros(shape, t.options())}, 1);
  };
  const auto rows_of = [&](DraftMethod method) {
    std::vector<uint8_t> mask(static_cast<size_t>(b), 0);
    for (int64_t i = 0; i < b; ++i) mask[static_cast<size_t>(i)] = methods[static_cast<size_t>(i)] == method ? 1 : 0;
    return to_device<uint8_t>(mask, {b}, device).to(at::kBool);
  };
  at::Tensor tokens = at::zeros({b, width}, at::TensorOptions().dtype(at::kLong).device(device));
  std::vector<at::Tensor> masks;
  bool any_probs = false, any_finite = false;
  for (const DraftPart& part : parts) {
    masks.push_back(part.drafts.tokens.defined() ? rows_of(part.method) : at::Tensor());
    if (!part.drafts.tokens.defined()) continue;
    tokens = at::where(masks.back().view({b, 1}), fit(part.drafts.tokens), tokens);
    any_probs = any_probs || part.drafts.probs.defined();
    any_finite = any_finite || part.drafts.finite.defined();
  }
  result.tokens = tokens.contiguous();
  if (any_probs) {
    // One-hot at every draft, then each sampled part's q at its rows.
    at::Tensor q = at::zeros({b, width, vocab}, at::TensorOptions().dtype(at::kFloat).device(device))
                       .scatter_(2, result.tokens.unsqueeze(2), 1.0);
    for (size_t p = 0; p < parts.size(); ++p) {
      if (!parts[p].drafts.probs.defined()) continue;
      q = at::where(masks[p].view({b, 1, 1}), fit(parts[p].drafts.probs).to(q.scalar_type()), q);
    }
    result.probs = q;
  }
  if (any_finite) {
    at::Tensor finite = at::ones({b}, at::TensorOptions().dtype(at::kBool).device(device));
    for (size_t p = 0; p < parts.size(); ++p) {
      if (!parts[p].drafts.finite.defined()) continue;
      finite = at::where(masks[p], parts[p].drafts.finite.to(device), finite);
    }
    result.finite = finite;
  }
  return result;
}

// The drafting of an Engine's batch: each row's DraftMethod; the drafter model's rows batched
// together (ModelBatchDrafts), the EAGLE head's rows in batched head forwards (EagleBatchDrafts),
// the Medusa rows in one pass of the heads (MedusaBatchDrafts), prompt-lookup rows drafted on the
// host; one [b, k] block of drafts (merge_drafts). With heads, every target forward taps the
// hidden states they read (feature_taps(): the EAGLE head's layers, then the final layer).
template <class D, class T>
class EngineDrafts {
 public:
  EngineDrafts(D* drafter, T& target, int64_t max_rows, const models::EagleHead* eagle,
               const models::MedusaHeads* medusa)
      : device_(target.device()), vocab_(static_cast<int64_t>(target.vocab_size())) {
    if constexpr (!std::is_void_v<D>) {
      model_.emplace(*drafter, max_rows);
      model_->select({});
    }
    if constexpr (FeatureTarget<T>) {
      hidden_ = static_cast<int64_t>(target.hidden_size());
      if (eagle != nullptr) {
        eagle_.emplace(*eagle, target, 0, /*lazy=*/true);  // steps without drafts cost the head nothing
        const auto layers = eagle_->feature_taps();
        taps_.assign(layers.begin(), layers.end());
        eagle_taps_ = static_cast<int64_t>(taps_.size());
      }
      if (medusa != nullptr) {
        medusa_.emplace(*medusa, target, 0);
        const int64_t last = medusa_->feature_taps().front();
        const auto found = std::find(taps_.begin(), taps_.end(), last);
        medusa_tap_ = found - taps_.begin();
        if (found == taps_.end()) taps_.push_back(last);
      }
    } else if (eagle != nullptr || medusa != nullptr) {
      throw std::invalid_argument(
          "EngineOptions: heads (eagle, medusa) read the target's hidden states: the target must model FeatureTarget");
    }
  }

  [[nodiscard]] std::span<const int64_t> feature_taps() const noexcept
    requires FeatureTarget<T>
  {
    return taps_;
  }
  [[nodiscard]] bool has(DraftMethod method) const noexcept {
    switch (method) {
      case DraftMethod::drafter: return !std::is_void_v<D>;
      case DraftMethod::eagle: return eagle_.has_value();
      case DraftMethod::medusa: return medusa_.has_value();
      default: return true;
    }
  }

  // A row of `prompt` joins after the others, drafting by `method`. `drafter_prompt`: what the
  // drafter model prefills now (empty: fed at its first draft). `features`: the target's tapped
  // states of the prompt's positions but the last (BatchCore::prefilled_features), for a head.
  void join(DraftMethod method, std::span<const int64_t> prompt, std::span<const int64_t> drafter_prompt,
            const at::Tensor& features) {
    methods_.push_back(method);
    contexts_.emplace_back();
    drafted_.push_back(0);
    if constexpr (!std::is_void_v<D>) model_->join(method == DraftMethod::drafter, drafter_prompt);
    if (eagle_) {
      const bool member = method == DraftMethod::eagle;
      eagle_->join(member, prompt, member && features.defined() ? eagle_features(features) : at::Tensor());
    }
    if (medusa_) medusa_->join(method == DraftMethod::medusa);
  }

  template <LogitsProcessor P>
  BatchDrafts draft(const std::vector<std::span<const int64_t>>& sequences, std::span<const int64_t> rooms, int64_t k,
                    const P& processor, at::Generator& gen, GenerationStats& shared) {
    parts_.clear();
    if constexpr (!std::is_void_v<D>) {
      if (uses(DraftMethod::drafter)) {
        parts_.push_back({DraftMethod::drafter, model_->draft(sequences, rooms, k, processor, gen, shared)});
      }
    }
    if (eagle_ && uses(DraftMethod::eagle)) {
      parts_.push_back({DraftMethod::eagle, eagle_->draft(sequences, rooms_of(DraftMethod::eagle, rooms), k, processor,
                                                           gen, shared)});
    }
    if (medusa_ && uses(DraftMethod::medusa)) {
      parts_.push_back({DraftMethod::medusa, medusa_->draft(sequences, rooms_of(DraftMethod::medusa, rooms), k,
                                                             processor, gen, shared)});
    }
    if (uses(DraftMethod::prompt_lookup)) parts_.push_back({DraftMethod::prompt_lookup, lookup(sequences, rooms, k)});
    return merge_drafts(parts_, methods_, vocab_, device_);
  }

  void after(const BatchStep& step) {
    if constexpr (!std::is_void_v<D>) model_->after(step);
    if (eagle_) {
      BatchStep mine = step;
      if (step.features.defined()) mine.features = eagle_features(step.features);
      eagle_->after(mine);
    }
    if (medusa_) {
      BatchStep mine = step;
      if (step.features.defined()) mine.features = step.features.narrow(2, medusa_tap_ * hidden_, hidden_);
      medusa_->after(mine);
    }
  }

  // The positions the drafter model and the EAGLE head computed so far, and the rows drafting
  // with them (the cost model prices both per position: a catch-up is no column's cost).
  [[nodiscard]] int64_t model_positions() const noexcept {
    int64_t positions = eagle_ ? eagle_->positions() : 0;
    if constexpr (!std::is_void_v<D>) positions += model_->positions();
    return positions;
  }
  [[nodiscard]] int64_t model_rows() const noexcept {
    int64_t rows = eagle_ ? eagle_->members() : 0;
    if constexpr (!std::is_void_v<D>) rows += model_->members();
    return rows;
  }
  // The positions the drafter model and the EAGLE head would compute beyond a drafting step's
  // usual to draft now for rows of `sequences`: their catch-up on what they have not seen.
  [[nodiscard]] int64_t catch_up_positions(const std::vector<std::span<const int64_t>>& sequences) const {
    int64_t positions = eagle_ ? eagle_->catch_up_positions() : 0;
    if constexpr (!std::is_void_v<D>) positions += model_->catch_up_positions(sequences);
    return positions;
  }

  void select(std::span<const int64_t> rows) {
    methods_ = pick_rows(methods_, rows);
    drafted_ = pick_rows(drafted_, rows);
    std::vector<std::vector<int64_t>> contexts;
    for (const int64_t r : rows) contexts.push_back(std::move(contexts_[static_cast<size_t>(r)]));
    contexts_ = std::move(contexts);
    if constexpr (!std::is_void_v<D>) model_->select(rows);
    if (eagle_) eagle_->select(rows);
    if (medusa_) medusa_->select(rows);
  }

 private:
  template <class M>
  struct ModelOf {
    using type = ModelBatchDrafts<M>;
  };
  template <class M>
    requires std::is_void_v<M>
  struct ModelOf<M> {
    using type = int;  // no drafter model
  };
  using Model = typename ModelOf<D>::type;

  [[nodiscard]] bool uses(DraftMethod method) const {
    return std::find(methods_.begin(), methods_.end(), method) != methods_.end();
  }
  // The rooms of the rows drafting by `method`, 0 at the others.
  std::span<const int64_t> rooms_of(DraftMethod method, std::span<const int64_t> rooms) {
    method_rooms_.assign(rooms.begin(), rooms.end());
    for (size_t i = 0; i < methods_.size(); ++i) {
      if (methods_[i] != method) method_rooms_[i] = 0;
    }
    return method_rooms_;
  }
  [[nodiscard]] at::Tensor eagle_features(const at::Tensor& features) const {
    return features.narrow(2, 0, eagle_taps_ * hidden_);
  }

  // Prompt lookup, row by row on the host.
  BatchDrafts lookup(const std::vector<std::span<const int64_t>>& sequences, std::span<const int64_t> rooms, int64_t k) {
    const auto b = static_cast<int64_t>(sequences.size());
    buffer_.assign(static_cast<size_t>(b * k), 0);
    BatchDrafts result{.valid = std::vector<int64_t>(static_cast<size_t>(b), 0)};
    int64_t width = 0;
    for (int64_t i = 0; i < b; ++i) {
      const auto r = static_cast<size_t>(i);
      if (methods_[r] != DraftMethod::prompt_lookup || rooms[r] == 0) continue;
      // The row's context is its sequence followed by its last drafts: brought up to date by
      // dropping those and appending what was emitted since, so no step copies the sequence.
      const auto sequence = sequences[r];
      std::vector<int64_t>& context = contexts_[r];
      context.resize(std::min(context.size() - drafted_[r], sequence.size()));
      context.insert(context.end(), sequence.begin() + static_cast<std::ptrdiff_t>(context.size()), sequence.end());
      int64_t calls = 0;
      const auto out = std::span(buffer_).subspan(static_cast<size_t>(i * k), static_cast<size_t>(rooms[r]));
      const int64_t made = draft_ngrams(lookup_, context, out, NGramDraftRule{}, /*stop_if_unknown=*/true, calls);
      drafted_[r] = static_cast<size_t>(made);
      result.valid[r] = made;
      width = std::max(width, made);
    }
    if (width > 0) result.tokens = to_device<int64_t>(buffer_, {b, k}, device_).narrow(1, 0, width).contiguous();
    return result;
  }

  at::Device device_;
  int64_t vocab_;
  std::optional<Model> model_;
  std::optional<EagleBatchDrafts> eagle_;
  std::optional<MedusaBatchDrafts> medusa_;
  std::vector<int64_t> taps_;  // the target's hidden states the heads read
  int64_t hidden_ = 0, eagle_taps_ = 0, medusa_tap_ = 0;
  std::vector<DraftMethod> methods_;            // each batch row's
  std::vector<std::vector<int64_t>> contexts_;  // prompt lookup: each row's sequence and last drafts
  std::vector<size_t> drafted_;                 // the drafts at the end of each row's context
  PromptLookupDrafter lookup_{};
  std::vector<int64_t> buffer_, method_rooms_;
  std::vector<DraftPart> parts_;
};

}  // namespace detail

// Continuous batching over a target and, optionally, a drafter model (see the top of this file).
// T (and D) model BatchedLanguageModel with caches that model AppendableKVCache.
template <class T, class D = void>
  requires BatchedLanguageModel<T> && AppendableKVCache<typename T::cache_type>
class Engine {
 public:
  // An engine without a drafter model: requests draft by prompt lookup or not at all.
  // Requires options.max_rows >= 1, options.max_waiting >= 0.
  // Throws: std::invalid_argument naming the option.
  Engine(T& target, const EngineOptions& options)
    requires std::is_void_v<D>
      : Engine(nullptr, target, options) {}

  // An engine whose requests may draft with `drafter` (DraftMethod::drafter), batched together.
  // Requires: the drafter's vocabulary equals the target's; its cache models AppendableKVCache.
  // Throws: std::invalid_argument naming the option or the vocabulary sizes.
  template <class Drafter = D>
    requires(!std::is_void_v<Drafter>) && BatchedLanguageModel<Drafter> &&
            AppendableKVCache<typename Drafter::cache_type>
  Engine(Drafter& drafter, T& target, const EngineOptions& options) : Engine(&drafter, target, options) {}

  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues a request: it joins the batch at the next step where a row is free and its prompt
  // fits (see the top of this file). Returns its id, or nullopt where max_rows requests are
  // generating and max_waiting wait already (nothing changes then).
  // Requires: a non-empty prompt of tokens in [0, vocab), no longer than the target's
  //   max_sequence_length(); end tokens and stop sequences in [0, vocab); max_new_tokens >= 0;
  //   valid sampling (SamplingParams::validate); gamma >= 0; DraftMethod::drafter only with a
  //   drafter model.
  // Throws: std::invalid_argument naming the field and the value ("request.sampling: top_p must
  //   be in (0, 1], got 1.5"); no other request is touched.
  [[nodiscard]] std::optional<RequestId> add(Request request) {
    check(request);
    if (static_cast<int64_t>(queue_.size()) + static_cast<int64_t>(core_.rows().size()) >=
        options_.max_rows + options_.max_waiting) {
      return std::nullopt;
    }
    const RequestId id = next_id_++;
    requests_.emplace(id, Entry{.state = RequestState::waiting,
                                .prompt_length = static_cast<int64_t>(request.prompt.size()),
                                .sampling = request.sampling,
                                .options = generation_options(request),
                                .gamma = request.drafting == DraftMethod::none ? 0 : request.gamma,
                                .drafting = request.drafting});
    queue_.push_back({id, std::move(request)});
    return id;
  }

  // One step: waiting requests join where they can, then every generating request takes one
  // verification step. Returns an event for every request the step touched: its new tokens and,
  // for those that ended (an end token, a stop sequence, max_new_tokens, the target's limit),
  // their results. Nothing to do (idle()): returns no events.
  [[nodiscard]] std::vector<EngineEvent> step() {
    std::vector<EngineEvent> events;
    admit(events);
    if (core_.empty()) return events;
    outcomes_.clear();
    const int64_t k = draft_length();
    // A forward wider than the widest draft step prefilled a prompt (detail/draft_cost.hpp).
    int64_t widest = 1;
    for (const detail::BatchRow& row : core_.rows()) widest = std::max(widest, requests_.at(row.tag).gamma + 1);
    const int64_t decode_positions = widest * static_cast<int64_t>(core_.rows().size());
    const int64_t drafter_positions = drafts_.model_positions();
    double seconds = 0;
    detail::StepCost cost;
    {
      const detail::ScopedTimer timer(seconds);
      cost = core_.step(drafts_, processor_, /*first_target=*/true, /*skip_sample_adjustment=*/false, outcomes_, k);
    }
    observe(cost, cost.positions > decode_positions, drafts_.model_positions() - drafter_positions, seconds);
    last_draft_length_ = cost.columns;
    steps_without_drafts_ = cost.columns > 0 ? 0 : steps_without_drafts_ + 1;
    seconds_without_drafts_ = cost.columns > 0 ? 0.0 : seconds_without_drafts_ + seconds;
    size_t kept = 0;
    const auto rows = core_.rows();
    bool left = false;
    for (detail::RowOutcome& outcome : outcomes_) {
      EngineEvent event{.id = outcome.tag};
      Entry& entry = requests_.at(outcome.tag);
      entry.acceptance.observe(outcome.drafted, outcome.accepted);
      pooled(entry.drafting).observe(outcome.drafted, outcome.accepted);
      const int64_t prompt_length = entry.prompt_length;
      if (outcome.result) {
        const auto& tokens = outcome.result->tokens;
        event.tokens.assign(tokens.begin() + (outcome.position - prompt_length), tokens.end());
        event.result = std::move(outcome.result);
        requests_.erase(outcome.tag);
        left = true;
      } else {
        const auto sequence = rows[kept++].state->sequence();
        event.tokens.assign(sequence.begin() + outcome.position, sequence.end());
      }
      events.push_back(std::move(event));
    }
    if (left) rebuild_processor();
    return events;
  }

  // Ends a request now, waiting or generating (between steps). Returns its result: the tokens it
  // generated, its stats, StopReason::cancelled. Its row is free for the next step.
  // Throws: std::invalid_argument for an id that is unknown or already ended.
  GenerationResult cancel(RequestId id) {
    const auto found = requests_.find(id);
    if (found == requests_.end()) {
      detail::throw_invalid_message("cancel: no request has id ", id, " (unknown, or it has ended)");
    }
    GenerationResult result{.stop_reason = StopReason::cancelled};
    if (found->second.state == RequestState::waiting) {
      queue_.erase(std::find_if(queue_.begin(), queue_.end(), [&](const Waiting& w) { return w.id == id; }));
    } else {
      const auto rows = core_.rows();
      std::vector<int64_t> keep;
      size_t row = 0;
      for (size_t i = 0; i < rows.size(); ++i) {
        if (rows[i].tag == id) {
          row = i;
        } else {
          keep.push_back(static_cast<int64_t>(i));
        }
      }
      result = core_.result_of(row);
      result.stop_reason = StopReason::cancelled;
      core_.keep(keep, drafts_);
      rebuild_processor();
    }
    requests_.erase(found);
    return result;
  }

  // Whether nothing is generating or waiting.
  [[nodiscard]] bool idle() const noexcept { return core_.empty() && queue_.empty(); }
  [[nodiscard]] int64_t generating() const noexcept { return static_cast<int64_t>(core_.rows().size()); }
  [[nodiscard]] int64_t waiting() const noexcept { return static_cast<int64_t>(queue_.size()); }
  // Where request `id` stands; nullopt once it has ended (or was never added).
  [[nodiscard]] std::optional<RequestState> state(RequestId id) const {
    const auto found = requests_.find(id);
    return found == requests_.end() ? std::nullopt : std::optional(found->second.state);
  }
  // The forwards the batch shared: target calls and seconds, drafter seconds.
  [[nodiscard]] const GenerationStats& stats() const noexcept { return core_.shared(); }
  [[nodiscard]] const EngineOptions& options() const noexcept { return options_; }
  // The draft-length rule's cost model and its last choice.
  [[nodiscard]] EngineCosts costs() const noexcept {
    return {.fixed_seconds = costs_.fixed_seconds(),
            .seconds_per_position = costs_.seconds_per_position(),
            .seconds_per_column = costs_.seconds_per_column(),
            .seconds_per_drafter_position = costs_.seconds_per_drafter_position(),
            .overhead_seconds = {costs_.overhead_seconds(false), costs_.overhead_seconds(true)},
            .draft_length = last_draft_length_,
            .explore_share = costs_.explore_share()};
  }

 private:
  struct Entry {
    RequestState state = RequestState::waiting;
    int64_t prompt_length = 0;
    SamplingParams sampling{};
    GenerationOptions options{};  // its row's stopping rules read them (an unordered_map's
                                  // elements stay where they are while others come and go)
    int64_t gamma = 0;            // its most drafts per step (0: none)
    DraftMethod drafting = DraftMethod::none;
    detail::AcceptanceEstimate acceptance{};
  };
  struct Waiting {
    RequestId id = 0;
    Request request{};
  };
  using DrafterPointer = std::conditional_t<std::is_void_v<D>, void*, D*>;

  Engine(DrafterPointer drafter, T& target, const EngineOptions& options)
      : options_(check_options(options)),
        target_(target),
        vocab_(static_cast<int64_t>(target.vocab_size())),
        limit_(detail::sequence_limit(target)),
        core_(target, options.max_rows, limit_, options.seed),
        drafts_(drafter, target, options.max_rows, options.eagle, options.medusa) {
    if constexpr (!std::is_void_v<D>) {
      if (static_cast<int64_t>(drafter->vocab_size()) != vocab_) {
        detail::throw_invalid_message("drafter.vocab_size() must equal target.vocab_size() = ", vocab_, ", got ",
                                      drafter->vocab_size());
      }
    }
    core_.release_rows();
    core_.set_taps(drafts_);
  }

  static const EngineOptions& check_options(const EngineOptions& options) {
    if (options.max_rows < 1) detail::throw_invalid("max_rows", "be >= 1", options.max_rows);
    if (options.max_waiting < 0) detail::throw_invalid("max_waiting", "be >= 0", options.max_waiting);
    return options;
  }

  void check(const Request& request) const {
    try {
      detail::check_common(generation_options(request), request.prompt, vocab_, limit_);
      request.sampling.validate();
    } catch (const std::invalid_argument& e) {
      detail::throw_invalid_message("request: ", e.what());
    }
    if (request.gamma < 0) detail::throw_invalid("request.gamma", "be >= 0", request.gamma);
    if (!drafts_.has(request.drafting)) {
      detail::throw_invalid_message("request.drafting is ", request.drafting, ", but this engine has no ",
                                    request.drafting == DraftMethod::drafter ? "drafter model"
                                    : request.drafting == DraftMethod::eagle ? "EAGLE head (EngineOptions::eagle)"
                                                                             : "Medusa heads (EngineOptions::medusa)",
                                    ": use none or prompt_lookup");
    }
  }

  static GenerationOptions generation_options(const Request& request) {
    return GenerationOptions{.max_new_tokens = request.max_new_tokens,
                             .eos_token_ids = request.eos_token_ids,
                             .stop_sequences = request.stop_sequences};
  }

  // Waiting requests join, first come first served, while a row is free and the next one fits.
  void admit(std::vector<EngineEvent>& events) {
    bool joined = false;
    while (!queue_.empty() && generating() < options_.max_rows && core_.fits(queue_.front().request.prompt)) {
      Waiting next = std::move(queue_.front());
      queue_.pop_front();
      const Request& request = next.request;
      const int64_t gamma = request.drafting == DraftMethod::none ? 0 : request.gamma;
      if (auto result = core_.add(next.id, request.prompt, requests_.at(next.id).options, gamma, /*prefill_alone=*/true)) {
        events.push_back({.id = next.id, .result = std::move(result)});  // max_new_tokens 0
        requests_.erase(next.id);
        continue;
      }
      // While the engine drafts, the drafter prefills the prompt now, apart from the batch; while
      // it runs target-only, the row joins the drafter empty and is fed at its first draft.
      const bool drafting = !options_.adaptive_draft_length || last_draft_length_ > 0 || steps_without_drafts_ == 0;
      drafts_.join(request.drafting, request.prompt,
                   drafting ? std::span<const int64_t>(request.prompt) : std::span<const int64_t>(),
                   core_.prefilled_features());
      Entry& entry = requests_.at(next.id);
      entry.state = RequestState::generating;
      entry.acceptance.start_from(pooled(request.drafting));
      joined = true;
    }
    if (joined) rebuild_processor();
  }

  // The step's most drafts per row: each request's gamma, or the cost model's choice (a row's
  // first step is the target's alone).
  int64_t draft_length() {
    if (!options_.adaptive_draft_length) return std::numeric_limits<int64_t>::max();
    alphas_.clear();
    caps_.clear();
    for (const detail::BatchRow& row : core_.rows()) {
      const Entry& entry = requests_.at(row.tag);
      alphas_.push_back(entry.acceptance.alpha());
      caps_.push_back(row.stepped ? entry.gamma : 0);
    }
    const int64_t model_rows = drafts_.model_rows();
    const int64_t k = costs_.choose(alphas_, caps_, model_rows);
    costs_.chose(k);
    if (k > 0 || steps_without_drafts_ < detail::DraftCostModel::kExploreEvery) return k;
    // Target-only steps: a one-column step keeps the estimates current, once what it costs
    // beyond a target-only step (the drafters' catch-up on what they have not seen included) is
    // a small share of the target-only time since the last draft (detail/draft_cost.hpp).
    const bool wanted = std::any_of(caps_.begin(), caps_.end(), [](int64_t cap) { return cap > 0; });
    if (!wanted) return 0;
    sequences_.clear();
    for (const detail::BatchRow& row : core_.rows()) sequences_.push_back(row.state->sequence());
    const int64_t behind = drafts_.catch_up_positions(sequences_);
    return costs_.explore(seconds_without_drafts_, static_cast<int64_t>(alphas_.size()), model_rows, behind) ? 1 : 0;
  }

  // What the step measured, for the cost model: the target's forward unless a prompt's prefill
  // made it wider than a draft step, the drafting where it drafted, the rest of the step
  // (detail/draft_cost.hpp).
  void observe(const detail::StepCost& cost, bool prefill, int64_t drafter_positions, double seconds) {
    const bool drafted = cost.columns > 0;
    if (drafted) costs_.observe_drafting(cost.columns, drafter_positions, cost.drafter_seconds);
    if (prefill) return;
    costs_.observe_target(cost.positions, cost.target_seconds);
    costs_.observe_overhead(drafted, seconds - cost.target_seconds - (drafted ? cost.drafter_seconds : 0.0));
  }

  detail::AcceptanceEstimate& pooled(DraftMethod method) { return pooled_[static_cast<size_t>(method)]; }

  // The rows' sampling parameters as tensors, once per change of the batch.
  void rebuild_processor() {
    std::vector<SamplingParams> rows;
    for (const detail::BatchRow& row : core_.rows()) rows.push_back(requests_.at(row.tag).sampling);
    processor_ = RowProcessor(rows, target_.device());
  }

  EngineOptions options_;
  T& target_;
  int64_t vocab_;
  int64_t limit_;
  detail::BatchCore<T> core_;
  detail::EngineDrafts<D, T> drafts_;
  RowProcessor processor_;
  std::deque<Waiting> queue_;
  std::unordered_map<RequestId, Entry> requests_;
  RequestId next_id_ = 0;
  std::vector<detail::RowOutcome> outcomes_;
  detail::DraftCostModel costs_;
  int64_t last_draft_length_ = 0, steps_without_drafts_ = 0;
  double seconds_without_drafts_ = 0;  // the steps' time since the last one that drafted
  std::vector<double> alphas_;
  std::vector<int64_t> caps_;
  std::vector<std::span<const int64_t>> sequences_;
  // Each draft method's acceptance over the engine's requests: where a joining request starts.
  std::array<detail::AcceptanceEstimate, 5> pooled_{
      detail::AcceptanceEstimate(detail::AcceptanceEstimate::kPooledDecay),
      detail::AcceptanceEstimate(detail::AcceptanceEstimate::kPooledDecay),
      detail::AcceptanceEstimate(detail::AcceptanceEstimate::kPooledDecay),
      detail::AcceptanceEstimate(detail::AcceptanceEstimate::kPooledDecay),
      detail::AcceptanceEstimate(detail::AcceptanceEstimate::kPooledDecay)};
};

template <class T>
Engine(T&, const EngineOptions&) -> Engine<T, void>;
template <class D, class T>
Engine(D&, T&, const EngineOptions&) -> Engine<T, D>;

}  // namespace specdec
