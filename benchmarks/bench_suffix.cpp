// Suffix decoding against Arctic Inference's suffix tree (arctic-inference 0.3.0 from its source
// distribution on PyPI, compiled into this program when SPECDEC_ARCTIC_SOURCE_DIR names its
// csrc/suffix_decoding; scripts/fetch-arctic.sh fetches it), replaying the same token streams
// through both, alternated inside each iteration after a warm-up replay:
//
//   a stream is a list of requests (prompt, response). A request starts its own tree from the
//   prompt; then at each position of the response the drafter proposes up to kMaxSpec tokens
//   for the text so far, the longest prefix equal to the response is accepted, and the text
//   advances by that plus one token (the target's own), which both trees learn. At the end the
//   response joins the cache of earlier responses that the next requests draft from too.
//
// Arctic's side is driven as its SuffixDecodingCache (cache.py) drives it: a tree per request
// (sequence 0), one global tree with each response as a sequence (extended as it is generated),
// speculate() on both with the context cut to the tree's depth, the higher score wins (ties:
// the request's). Same rule on both sides: depth kDepth, at most kMaxSpec tokens,
// max_spec_factor 1, offset 0, min_token_prob 0.1; no eviction. BM_Replay/stream/tree:1 drafts
// trees of at most kMaxSpec nodes on both sides (specdec's SuffixTreeSource, Arctic's
// use_tree_spec); a tree's accepted tokens are its longest path from the root that the response
// follows.
//
// Streams:
//   synthetic  text/token_stream.hpp's stream (the n-gram benchmarks'), cut into 64 requests of
//              a 512-token prompt and a 512-token response; its copied spans reach back across
//              requests, so the cache of responses pays;
//   agentic    a tool loop made here (agentic_stream below): a workspace of 8 files of token
//              lines; each turn the prompt is a fixed system text, the last turn's tool call and
//              the `cat` of one file, and the response re-emits that file with one to three
//              lines edited (changed, inserted or deleted) inside a fixed tool-call template.
//              The edited file replaces the old one, so later turns copy it again.
//
// BM_Session/pair: end to end on an agentic-style session with a target model (pair 0: the bundled
// pair, 1: stories260K with SPECDEC_MODELS_DIR): turn 1 is a prompt of the pair; every later turn
// sends back the previous answer edited (its middle eighth cut out), wrapped in the first tokens
// of the pair's next prompt, and the model answers 40 tokens greedily, while the session's
// context allows. Autoregressive decoding, suffix decoding (a cache shared across turns' answers;
// chains, and trees of at most 8 nodes), the n-gram storage (n 3, its default rule) and prompt
// lookup, each with gamma 8, run the same turns in one session each, the modes' order rotating
// every iteration; counters give each mode's tokens/s and tokens per target call, and
// `identical` whether every mode's answers equal autoregressive decoding's. These targets are tiny: the figures measure the library's overhead
// per step against what a step saves, not a memory-bound target's time.
//
// Counters of BM_Replay, per implementation (specdec_*, arctic_*): accepted tokens per draft call
// (accepted_per_draft), the accepted share of drafted tokens (accepted_share), draft calls per
// second of drafting and updating together (drafts_per_s), nanoseconds of drafting and updating
// per stream token (ns_per_token), and of each apart (draft_ns_per_call per speculate call;
// update_ns_per_token per answer token learned; start_ns_per_token, a request's start from its
// prompt, and stop_ns_per_token, its answer joining the cache, per answer token; each call timed
// on its own), and bytes per cached token at the end (bytes_per_token: memory_bytes() of
// specdec's cache and request tree; Arctic's estimate_memory() of its trees and sequences);
// speed_ratio is Arctic's ns_per_token over specdec's. A request gets a new drafter on both sides
// (specdec: a new source, which takes the arrays the last request's left in the cache).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "bench_pairs.hpp"
#include "specdec/drafting/suffix.hpp"
#include "specdec/generate.hpp"
#include "specdec/session.hpp"
#include "specdec/text/token_stream.hpp"

#ifdef SPECDEC_BENCH_ARCTIC
#include "suffix_tree.h"
#endif

namespace {

using Tokens = std::vector<int64_t>;
constexpr int64_t kVocab = 32000;
constexpr int64_t kDepth = 32;
constexpr int64_t kMaxSpec = 16;

struct Request {
  Tokens prompt, response;
};

std::vector<Request> synthetic_stream() {
  const auto stream = specdec::text::make_token_stream({.tokens = 64 * 1024, .vocab_size = kVocab});
  std::vector<Request> requests;
  for (size_t at = 0; at + 1024 <= stream.tokens.size(); at += 1024) {
    const auto begin = stream.tokens.begin() + static_cast<std::ptrdiff_t>(at);
    requests.push_back({Tokens(begin, begin + 512), Tokens(begin + 512, begin + 1024)});
  }
  return requests;
}

std::vector<Request> agentic_stream() {
  std::mt19937_64 rng(7);
  std::vector<double> weights(kVocab);
  for (size_t t = 0; t < weights.size(); ++t) weights[t] = 1.0 / std::pow(static_cast<double>(t + 1), 1.1);
  std::discrete_distribution<int64_t> zipf(weights.begin(), weights.end());
  const auto words = [&](int64_t n) {
    Tokens out(static_cast<size_t>(n));
    for (auto& t : out) t = zipf(rng);
    return out;
  };
  const auto uniform = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  const Tokens system = words(64), call_open = words(12), call_mid = words(6), call_close = words(5),
               cat_open = words(8), ok = words(4);
  std::vector<std::vector<Tokens>> files(8);
  for (auto& file : files) {
    for (int64_t line = uniform(12, 30); line > 0; --line) file.push_back(words(uniform(4, 14)));
  }
  const auto append = [](Tokens& to, const Tokens& from) { to.insert(to.end(), from.begin(), from.end()); };
  std::vector<Request> requests;
  Tokens last_call;
  for (int turn = 0; turn < 64; ++turn) {
    const auto f = static_cast<size_t>(uniform(0, static_cast<int64_t>(files.size()) - 1));
    Request r;
    append(r.prompt, system);
    append(r.prompt, last_call);
    append(r.prompt, cat_open);
    r.prompt.push_back(static_cast<int64_t>(f));
    for (const Tokens& line : files[f]) append(r.prompt, line);
    append(r.prompt, words(16));  // the user's instruction
    for (int64_t edits = uniform(1, 3); edits > 0; --edits) {
      auto& file = files[f];
      const auto at = static_cast<size_t>(uniform(0, static_cast<int64_t>(file.size()) - 1));
      switch (uniform(0, 2)) {
        case 0: file[at] = words(uniform(4, 14)); break;
        case 1: file.insert(file.begin() + static_cast<std::ptrdiff_t>(at), words(uniform(4, 14))); break;
        default: if (file.size() > 4) file.erase(file.begin() + static_cast<std::ptrdiff_t>(at)); break;
      }
    }
    append(r.response, call_open);
    r.response.push_back(static_cast<int64_t>(f));
    append(r.response, call_mid);
    for (const Tokens& line : files[f]) append(r.response, line);
    append(r.response, call_close);
    last_call = r.response;
    append(last_call, ok);
    requests.push_back(std::move(r));
  }
  return requests;
}

const std::vector<Request>& stream(int64_t which) {
  static const std::vector<Request> synthetic = synthetic_stream(), agentic = agentic_stream();
  return which == 0 ? synthetic : agentic;
}

struct Tally {
  int64_t drafts = 0, drafted = 0, accepted = 0, tokens = 0;
  double seconds = 0.0;
  double draft_seconds = 0.0, learn_seconds = 0.0, start_seconds = 0.0, stop_seconds = 0.0;  // inside the replay, each call timed
  size_t bytes = 0;
  int64_t cached_tokens = 0;
};

// A drafter's proposal: node i is tokens[i] below node parents[i] (-1: the text's last token).
// A chain's parents are i - 1.
struct Proposal {
  std::span<const int64_t> tokens, parents;
};

// How many tokens of `response` from `at` on a path of the proposal matches, root down.
size_t accepted_length(const Proposal& p, const Tokens& response, size_t at) {
  size_t accepted = 0;
  for (int64_t node = -1; at + accepted < response.size();) {
    int64_t next = -1;
    for (size_t i = 0; i < p.tokens.size() && next < 0; ++i) {
      if (p.parents[i] == node && p.tokens[i] == response[at + accepted]) next = static_cast<int64_t>(i);
    }
    if (next < 0) break;
    node = next;
    ++accepted;
  }
  return accepted;
}

// Replays `requests` through a drafter with start(prompt), propose(text, cap) -> Proposal,
// learn(tokens) and stop(), counting acceptance and timing all of it.
template <class Drafter>
Tally replay(const std::vector<Request>& requests) {
  Tally tally;
  Drafter drafter;
  const auto start = std::chrono::steady_clock::now();
  for (const Request& r : requests) {
    Tokens text = r.prompt;
    const auto t0 = std::chrono::steady_clock::now();
    drafter.start(text);
    tally.start_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    size_t at = 0;
    while (at < r.response.size()) {
      const auto drafting = std::chrono::steady_clock::now();
      const Proposal draft = drafter.propose(text, kMaxSpec);
      tally.draft_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - drafting).count();
      const size_t accepted = accepted_length(draft, r.response, at);
      ++tally.drafts;
      tally.drafted += static_cast<int64_t>(draft.tokens.size());
      tally.accepted += static_cast<int64_t>(accepted);
      const size_t step = std::min(accepted + 1, r.response.size() - at);
      const std::span<const int64_t> passed(r.response.data() + at, step);
      text.insert(text.end(), passed.begin(), passed.end());
      const auto learning = std::chrono::steady_clock::now();
      drafter.learn(text, passed);
      tally.learn_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - learning).count();
      at += step;
    }
    const auto t1 = std::chrono::steady_clock::now();
    drafter.stop(text, r.response);
    tally.stop_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
    tally.tokens += static_cast<int64_t>(r.response.size());
    tally.cached_tokens += static_cast<int64_t>(r.response.size());
  }
  tally.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  tally.bytes = drafter.memory_bytes();
  return tally;
}

// The parents of a chain of n tokens.
std::span<const int64_t> chain_parents(size_t n) {
  static const Tokens parents = [] {
    Tokens p(static_cast<size_t>(kMaxSpec));
    for (size_t i = 0; i < p.size(); ++i) p[i] = static_cast<int64_t>(i) - 1;
    return p;
  }();
  return std::span<const int64_t>(parents).first(n);
}

// specdec's chain (SuffixDraftSource) or tree (SuffixTreeSource, at most cap nodes and cap deep).
template <bool Tree>
class SpecdecDrafter {
 public:
  using Source = std::conditional_t<Tree, specdec::SuffixTreeSource, specdec::SuffixDraftSource>;
  void start(const Tokens& prompt) {
    source_ = std::make_unique<Source>(cache_, rule_);  // a source per request, as Arctic's tree
    source_->start(prompt, {});
  }
  Proposal propose(const Tokens& text, int64_t cap) {
    if constexpr (Tree) {
      const auto& tree = source_->propose(text, cap, cap);
      return {tree.tokens, tree.parents};
    } else {
      const std::span<const int64_t> chain = source_->propose(text, cap);
      return {chain, chain_parents(chain.size())};
    }
  }
  // As the step core tells it; propose() then finds nothing new to learn.
  void learn(const Tokens& text, std::span<const int64_t> /*passed*/) {
    if constexpr (Tree) {
      source_->verified_tree(text, 0);
    } else {
      source_->verified({.sequence = text});
    }
  }
  void stop(const Tokens& text, const Tokens& /*response*/) {
    source_->finish(text);
    request_bytes_ = source_->memory_bytes();
  }
  [[nodiscard]] size_t memory_bytes() const { return cache_.memory_bytes() + request_bytes_; }

 private:
  specdec::SuffixCache cache_{kVocab, {.max_depth = kDepth, .max_bytes = int64_t{1} << 32}};
  specdec::SuffixDraftRule rule_{.max_depth = kDepth, .max_spec_factor = 1.0, .min_token_prob = 0.1};
  std::unique_ptr<Source> source_;
  size_t request_bytes_ = 0;
};

#ifdef SPECDEC_BENCH_ARCTIC
// Arctic's chain or tree (use_tree_spec).
template <bool Tree>
class ArcticDrafter {
 public:
  void start(const Tokens& prompt) {
    local_ = std::make_unique<SuffixTree>(static_cast<int>(kDepth));
    local_->extend(0, to_int32(prompt));
    ++seq_id_;
  }
  Proposal propose(const Tokens& text, int64_t cap) {
    const size_t keep = std::min(text.size(), static_cast<size_t>(kDepth));
    context_.assign(text.end() - static_cast<std::ptrdiff_t>(keep), text.end());
    const Draft mine = local_->speculate(context_, static_cast<int>(cap), 1.0F, 0.0F, 0.1F, Tree);
    const Draft theirs = global_.speculate(context_, static_cast<int>(cap), 1.0F, 0.0F, 0.1F, Tree);
    const Draft& chosen = mine.score >= theirs.score ? mine : theirs;
    draft_.assign(chosen.token_ids.begin(), chosen.token_ids.end());
    parents_.assign(chosen.parents.begin(), chosen.parents.end());
    return {draft_, parents_};
  }
  void learn(const Tokens& /*text*/, std::span<const int64_t> passed) {
    const std::vector<int32_t> tokens = to_int32(passed);
    local_->extend(0, tokens);
    global_.extend(seq_id_, tokens);  // as add_active_response
  }
  void stop(const Tokens& /*text*/, const Tokens& /*response*/) { local_bytes_ = local_->estimate_memory(); }
  [[nodiscard]] size_t memory_bytes() const { return global_.estimate_memory() + local_bytes_; }

 private:
  static std::vector<int32_t> to_int32(std::span<const int64_t> tokens) { return {tokens.begin(), tokens.end()}; }
  SuffixTree global_{static_cast<int>(kDepth)};
  std::unique_ptr<SuffixTree> local_;
  std::vector<int32_t> context_;
  Tokens draft_, parents_;
  int seq_id_ = -1;
  size_t local_bytes_ = 0;
};
#endif

void report(benchmark::State& state, const std::string& name, const Tally& t, int64_t iterations) {
  const auto per = [](double a, double b) { return b > 0 ? a / b : 0.0; };
  state.counters[name + "_accepted_per_draft"] = per(static_cast<double>(t.accepted), static_cast<double>(t.drafts));
  state.counters[name + "_accepted_share"] = per(static_cast<double>(t.accepted), static_cast<double>(t.drafted));
  state.counters[name + "_drafts_per_s"] = per(static_cast<double>(t.drafts * iterations), t.seconds);
  state.counters[name + "_ns_per_token"] = per(t.seconds * 1e9, static_cast<double>(t.tokens * iterations));
  state.counters[name + "_draft_ns_per_call"] = per(t.draft_seconds * 1e9, static_cast<double>(t.drafts * iterations));
  state.counters[name + "_update_ns_per_token"] = per(t.learn_seconds * 1e9, static_cast<double>(t.tokens * iterations));
  state.counters[name + "_start_ns_per_token"] = per(t.start_seconds * 1e9, static_cast<double>(t.tokens * iterations));
  state.counters[name + "_stop_ns_per_token"] = per(t.stop_seconds * 1e9, static_cast<double>(t.tokens * iterations));
  state.counters[name + "_bytes_per_token"] = per(static_cast<double>(t.bytes), static_cast<double>(t.cached_tokens));
}

// BM_Replay/stream/tree: stream 0 synthetic, 1 agentic; tree 0 chains, 1 trees (both sides). Each
// iteration replays the stream through both implementations, in alternating order; the fastest
// iteration of each is reported.
template <bool Tree>
void replay_both(benchmark::State& state) {
  const auto& requests = stream(state.range(0));
  (void)replay<SpecdecDrafter<Tree>>(requests);  // warm-up: page faults, the allocator, caches
  Tally ours, best_ours;
#ifdef SPECDEC_BENCH_ARCTIC
  (void)replay<ArcticDrafter<Tree>>(requests);
  Tally theirs, best_theirs;
#endif
  int64_t iteration = 0;
  for (auto _ : state) {
    const auto run_ours = [&] {
      ours = replay<SpecdecDrafter<Tree>>(requests);
      if (best_ours.seconds == 0 || ours.seconds < best_ours.seconds) best_ours = ours;
    };
#ifdef SPECDEC_BENCH_ARCTIC
    const auto run_theirs = [&] {
      theirs = replay<ArcticDrafter<Tree>>(requests);
      if (best_theirs.seconds == 0 || theirs.seconds < best_theirs.seconds) best_theirs = theirs;
    };
    if (iteration % 2 == 0) {
      run_ours();
      run_theirs();
    } else {
      run_theirs();
      run_ours();
    }
#else
    run_ours();
#endif
    ++iteration;
  }
  report(state, "specdec", best_ours, 1);
#ifdef SPECDEC_BENCH_ARCTIC
  report(state, "arctic", best_theirs, 1);
  state.counters["speed_ratio"] = best_theirs.seconds / best_ours.seconds;
#else
  state.SetLabel("Arctic Inference not built in (SPECDEC_ARCTIC_SOURCE_DIR): specdec alone");
#endif
  state.counters["requests"] = static_cast<double>(requests.size());
  state.counters["response_tokens"] = static_cast<double>(ours.tokens);
}

void BM_Replay(benchmark::State& state) {
  if (state.range(1) != 0) {
    replay_both<true>(state);
  } else {
    replay_both<false>(state);
  }
}
BENCHMARK(BM_Replay)->ArgNames({"stream", "tree"})->ArgsProduct({{0, 1}, {0, 1}})->Iterations(6)->Unit(benchmark::kMillisecond);

// The turns of a session on `pair`: each the tokens a turn appends, built from autoregressive
// answers (every exact mode answers the same).
std::vector<Tokens> session_turns(specdec::bench::Setup& pair, int64_t new_tokens) {
  using Model = specdec::bench::PairModel;
  specdec::Session<Model> session(*pair.target);
  const int64_t limit = pair.target->max_sequence_length();
  std::vector<Tokens> turns{pair.prompts.front()};
  for (size_t k = 1;; ++k) {
    session.append(turns.back());
    const Tokens answer = session.generate({.max_new_tokens = new_tokens}).tokens;
    const Tokens& next_prompt = pair.prompts[k % pair.prompts.size()];
    Tokens turn(next_prompt.begin(), next_prompt.begin() + static_cast<std::ptrdiff_t>(std::min<size_t>(8, next_prompt.size())));
    const size_t cut = answer.size() / 8;
    turn.insert(turn.end(), answer.begin(), answer.begin() + static_cast<std::ptrdiff_t>(answer.size() / 2 - cut / 2));
    turn.insert(turn.end(), answer.begin() + static_cast<std::ptrdiff_t>(answer.size() / 2 + cut - cut / 2), answer.end());
    if (session.length() + static_cast<int64_t>(turn.size()) + new_tokens > limit - 1 || k == 8) break;
    turns.push_back(std::move(turn));
  }
  return turns;
}

void BM_Session(benchmark::State& state) {
  using Model = specdec::bench::PairModel;
  auto& pair = state.range(0) == 0 ? specdec::bench::bundled() : specdec::bench::stories();
  if (!pair.missing.empty()) {
    state.SkipWithError(pair.missing.c_str());
    return;
  }
  constexpr int64_t kNewTokens = 40;
  const std::vector<Tokens> turns = session_turns(pair, kNewTokens);
  const std::vector<std::string> names{"autoregressive", "suffix", "suffix_tree", "ngram", "prompt_lookup"};
  struct Totals {
    double seconds = 0;
    int64_t tokens = 0, target_calls = 0;
    std::vector<Tokens> answers;
  };
  // One session of `mode`: every turn appended and answered; returns its answers and time.
  const auto run = [&](size_t mode) {
    Totals t;
    specdec::Session<Model> session(*pair.target);
    specdec::SuffixCache cache(pair.target->vocab_size());
    specdec::SuffixDraftSource suffix(cache);
    specdec::SuffixTreeSource suffix_tree(cache);
    specdec::NGramStorage storage(3, pair.target->vocab_size());
    specdec::NGramDraftSource<specdec::NGramStorage> ngram(storage);
    specdec::PromptLookupDrafter lookup_storage;
    specdec::NGramDraftSource<specdec::PromptLookupDrafter> lookup(lookup_storage);
    const specdec::SpeculativeOptions options{.max_new_tokens = kNewTokens, .gamma = 8};
    const auto start = std::chrono::steady_clock::now();
    for (const Tokens& turn : turns) {
      session.append(turn);
      const specdec::GenerationResult r = mode == 0   ? session.generate({.max_new_tokens = kNewTokens})
                                          : mode == 1 ? session.generate(suffix, options)
                                          : mode == 2 ? session.generate(suffix_tree, options)
                                          : mode == 3 ? session.generate(ngram, options)
                                                      : session.generate(lookup, options);
      t.tokens += r.stats.generated;
      t.target_calls += r.stats.target_calls;
      t.answers.push_back(r.tokens);
    }
    t.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return t;
  };
  std::vector<Totals> best(names.size());
  for (size_t m = 0; m < names.size(); ++m) best[m] = run(m);  // warm-up, and the answers to compare
  bool identical = true;
  int64_t iteration = 0;
  for (auto _ : state) {
    for (size_t i = 0; i < names.size(); ++i) {
      const size_t m = (i + static_cast<size_t>(iteration)) % names.size();
      Totals t = run(m);
      identical = identical && t.answers == best[0].answers;
      if (t.seconds < best[m].seconds) best[m] = std::move(t);
    }
    ++iteration;
  }
  for (size_t m = 0; m < names.size(); ++m) {
    state.counters[names[m] + "_tokens_per_s"] = static_cast<double>(best[m].tokens) / best[m].seconds;
    state.counters[names[m] + "_tokens_per_call"] =
        static_cast<double>(best[m].tokens) / static_cast<double>(std::max<int64_t>(best[m].target_calls, 1));
  }
  state.counters["turns"] = static_cast<double>(turns.size());
  state.counters["identical"] = identical ? 1 : 0;
}
BENCHMARK(BM_Session)->ArgName("pair")->Arg(0)->Arg(1)->Iterations(5)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
