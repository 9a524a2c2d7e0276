// N-gram storages on a seeded 1M-token stream (vocabulary 32000, Zipf 1.1 unigrams, 30% of the
// tokens in spans copied from earlier in the stream; text/token_stream.hpp):
//   BM_Build   initialize() over the whole stream: tokens/s, contexts, bytes per context by
//              memory_bytes() and by the growth of the process's resident memory;
//   BM_Update  update() once per position with its next token, as generation teaches a storage;
//   BM_Lookup  next_token() at every position;
//   BM_DraftSpeed  draft() of up to 8 tokens at every position of a built storage: drafts/s;
//   BM_Acceptance  speculation against the stream itself: from an empty storage, draft up to 8
//              tokens, accept the longest prefix that equals the stream, advance by that plus the
//              target's own token and teach the storage what was passed. Accepted tokens per draft
//              and the accepted share of drafted tokens, per draft rule;
//   BM_Table   the counting core (insert or increment one slot per context) on this library's
//              flat table and on tsl::hopscotch_map, where installed.
#include <benchmark/benchmark.h>

#include <unistd.h>

#include <fstream>
#include <string>
#include <vector>

#include "specdec/ngram_storage.hpp"
#include "specdec/text/token_stream.hpp"

#ifdef SPECDEC_BENCH_TSL
#include <tsl/hopscotch_map.h>
#endif

namespace {

using namespace specdec;
constexpr int64_t kVocab = 32000;
constexpr int64_t kGamma = 8;

const text::TokenStream& stream() {
  static const text::TokenStream s = text::make_token_stream({.tokens = 1'000'000, .vocab_size = kVocab});
  return s;
}

// The process's resident bytes (/proc/self/statm), 0 where unavailable.
double resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  double pages = 0, resident = 0;
  if (!(statm >> pages >> resident)) return 0;
  return resident * static_cast<double>(sysconf(_SC_PAGESIZE));
}

void memory_counters(benchmark::State& state, const NGramStorage& storage, double resident_before) {
  const auto contexts = static_cast<double>(storage.contexts());
  state.counters["contexts"] = contexts;
  state.counters["ngrams"] = static_cast<double>(storage.size());
  state.counters["bytes_per_context"] = static_cast<double>(storage.memory_bytes()) / contexts;
  state.counters["rss_bytes_per_context"] = (resident_bytes() - resident_before) / contexts;
}

void BM_Build(benchmark::State& state) {
  const auto& tokens = stream().tokens;
  const double resident_before = resident_bytes();
  NGramStorage storage(state.range(0), kVocab);
  for (auto _ : state) {
    storage.clear();
    storage.initialize(tokens);
  }
  state.counters["tokens_per_second"] =
      benchmark::Counter(static_cast<double>(tokens.size()), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["copied_share"] = static_cast<double>(stream().copied) / static_cast<double>(tokens.size());
  memory_counters(state, storage, resident_before);
}

void BM_Update(benchmark::State& state) {
  const auto& tokens = stream().tokens;
  const double resident_before = resident_bytes();
  NGramStorage storage(state.range(0), kVocab);
  for (auto _ : state) {
    storage.clear();
    for (size_t i = 1; i < tokens.size(); ++i) storage.update(std::span(tokens).first(i), std::span(tokens).subspan(i, 1));
  }
  state.counters["tokens_per_second"] =
      benchmark::Counter(static_cast<double>(tokens.size() - 1), benchmark::Counter::kIsIterationInvariantRate);
  memory_counters(state, storage, resident_before);
}

void BM_Lookup(benchmark::State& state) {
  const auto& tokens = stream().tokens;
  NGramStorage storage(state.range(0), kVocab);
  storage.initialize(tokens);
  int64_t found = 0;
  for (auto _ : state) {
    for (size_t i = 1; i < tokens.size(); ++i) found += storage.next_token(std::span(tokens).first(i)).has_value();
  }
  benchmark::DoNotOptimize(found);
  state.counters["lookups_per_second"] =
      benchmark::Counter(static_cast<double>(tokens.size() - 1), benchmark::Counter::kIsIterationInvariantRate);
}

// The draft rules compared: 0 the neutral rule (draft while any context is known), then
// confident rules.
NGramDraftRule rule_of(int64_t index, int64_t n) {
  switch (index) {
    case 0: return {};
    case 1: return {.min_count = 1, .min_share = 0.5};
    case 2: return {.min_count = 2, .min_share = 0.5};
    case 3: return {.min_count = 1, .min_share = 0.5, .min_context = n - 1};
    case 4: return {.min_count = 1, .min_share = 0.9, .min_context = n - 1};
    case 5: return {.min_count = 1, .min_share = 0.75, .min_context = std::max<int64_t>(1, n - 2)};
    default: return {.min_count = 2, .min_share = 0.6, .min_context = 2};
  }
}

void BM_DraftSpeed(benchmark::State& state) {
  const auto& tokens = stream().tokens;
  const int64_t n = state.range(0);
  const NGramDraftRule rule = rule_of(state.range(1), n);
  NGramStorage storage(n, kVocab);
  storage.initialize(tokens);
  std::vector<int64_t> out(kGamma);
  int64_t drafted = 0;
  for (auto _ : state) {
    for (size_t i = 1; i < tokens.size(); ++i) drafted += storage.draft(std::span(tokens).first(i), out, rule);
  }
  benchmark::DoNotOptimize(drafted);
  state.SetLabel((std::ostringstream() << rule).str());
  state.counters["drafts_per_second"] =
      benchmark::Counter(static_cast<double>(tokens.size() - 1), benchmark::Counter::kIsIterationInvariantRate);
}

void BM_Acceptance(benchmark::State& state) {
  const auto& tokens = stream().tokens;
  const std::span<const int64_t> all(tokens);
  const int64_t n = state.range(0);
  const NGramDraftRule rule = rule_of(state.range(1), n);
  std::vector<int64_t> out(kGamma);
  int64_t drafts = 0, drafted = 0, accepted = 0, full = 0, steps = 0;
  for (auto _ : state) {
    NGramStorage storage(n, kVocab);
    drafts = drafted = accepted = full = steps = 0;
    for (size_t position = 1; position < tokens.size();) {
      const int64_t k = storage.draft(all.first(position), out, rule);
      size_t matched = 0;
      while (matched < static_cast<size_t>(k) && position + matched < tokens.size() && out[matched] == tokens[position + matched]) {
        ++matched;
      }
      drafts += k > 0;
      full += k == kGamma;
      drafted += k;
      accepted += static_cast<int64_t>(matched);
      ++steps;
      const size_t advance = std::min(matched + 1, tokens.size() - position);
      for (size_t j = 0; j < advance; ++j, ++position) storage.update(all.first(position), all.subspan(position, 1));
    }
  }
  state.SetLabel((std::ostringstream() << rule).str());
  state.counters["accepted_per_draft"] = static_cast<double>(accepted) / static_cast<double>(drafts);
  state.counters["accepted_share"] = static_cast<double>(accepted) / static_cast<double>(drafted);
  state.counters["full_drafts"] = static_cast<double>(full) / static_cast<double>(drafts);
  state.counters["drafts_per_step"] = static_cast<double>(drafts) / static_cast<double>(steps);
  state.counters["tokens_per_step"] = static_cast<double>(tokens.size() - 1) / static_cast<double>(steps);
}

// The counting core on one table type: one insert-or-increment per context of lengths 1..3 (n = 4).
template <class Table>
void BM_Table(benchmark::State& state) {
  const auto& tokens = stream().tokens;
  const int bits = detail::token_bits(kVocab);
  size_t size = 0;
  for (auto _ : state) {
    Table table;
    for (size_t i = 1; i < tokens.size(); ++i) {
      for (size_t length = 1; length <= std::min<size_t>(3, i); ++length) {
        const uint64_t key = detail::pack_key<uint64_t>(std::span(tokens).subspan(i - length, length), bits);
        if constexpr (requires { table.insert(key).first->total; }) {
          ++table.insert(key).first->total;
        } else {
          ++table[key].total;
        }
      }
    }
    size = table.size();
  }
  state.counters["contexts"] = static_cast<double>(size);
  state.counters["tokens_per_second"] =
      benchmark::Counter(static_cast<double>(tokens.size() - 1), benchmark::Counter::kIsIterationInvariantRate);
}

struct KeyHash {
  size_t operator()(uint64_t key) const noexcept { return detail::hash_key(key); }
};

BENCHMARK(BM_Build)->Arg(3)->Arg(4)->Arg(5)->Unit(benchmark::kMillisecond)->Iterations(3);
BENCHMARK(BM_Update)->Arg(3)->Arg(4)->Arg(5)->Unit(benchmark::kMillisecond)->Iterations(1);
BENCHMARK(BM_Lookup)->Arg(3)->Arg(4)->Arg(5)->Unit(benchmark::kMillisecond)->Iterations(1);
BENCHMARK(BM_DraftSpeed)->Args({4, 0})->Args({4, 1})->Unit(benchmark::kMillisecond)->Iterations(1);
BENCHMARK(BM_Acceptance)
    ->ArgsProduct({{3, 4, 5}, {0, 1, 2, 3, 4, 5, 6}})
    ->Unit(benchmark::kMillisecond)
    ->Iterations(1);
BENCHMARK_TEMPLATE(BM_Table, detail::FlatTable<uint64_t, detail::ContextCounts>)
    ->Name("BM_Table/flat")->Unit(benchmark::kMillisecond)->Iterations(1);
#ifdef SPECDEC_BENCH_TSL
BENCHMARK_TEMPLATE(BM_Table, tsl::hopscotch_map<uint64_t, detail::ContextCounts, KeyHash>)
    ->Name("BM_Table/tsl_hopscotch")->Unit(benchmark::kMillisecond)->Iterations(1);
#endif

}  // namespace

BENCHMARK_MAIN();
