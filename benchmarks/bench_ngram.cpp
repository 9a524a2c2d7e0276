// N-gram storage throughput on a 1M-token stream (vocabulary 32000): updates per second (one
// update() call with one next token per position, as generation makes them, and the n-gram
// counts those calls update), look-ups per second
// (next_token() at every position) and bytes per stored n-gram. The stream is Zipf-distributed
// (exponent 1.1) so that n-grams repeat as in text.
#include <benchmark/benchmark.h>

#include <unistd.h>

#include <cmath>
#include <fstream>
#include <random>
#include <type_traits>
#include <vector>

#include "specdec/ngram_storage.hpp"

namespace {

using namespace specdec;
constexpr int64_t kVocab = 32000;
constexpr size_t kStream = 1'000'000;

const std::vector<int64_t>& stream() {
  static const std::vector<int64_t> tokens = [] {
    std::vector<double> weights(kVocab);
    for (int64_t i = 0; i < kVocab; ++i) weights[static_cast<size_t>(i)] = 1.0 / std::pow(static_cast<double>(i + 1), 1.1);
    std::discrete_distribution<int64_t> zipf(weights.begin(), weights.end());
    std::mt19937_64 rng(42);
    std::vector<int64_t> t(kStream);
    for (auto& x : t) x = zipf(rng);
    return t;
  }();
  return tokens;
}

// The process's resident bytes (/proc/self/statm), 0 where unavailable.
double resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  double pages = 0, resident = 0;
  if (!(statm >> pages >> resident)) return 0;
  return resident * static_cast<double>(sysconf(_SC_PAGESIZE));
}

template <class S>
void BM_Update(benchmark::State& state) {
  const auto& tokens = stream();
  const int64_t n = state.range(0);
  const double resident_before = resident_bytes();
  S storage(n, kVocab);
  for (auto _ : state) {
    storage.clear();
    for (size_t i = 1; i < tokens.size(); ++i) {
      storage.update(std::span(tokens).first(i), std::span(tokens).subspan(i, 1));
    }
  }
  // One update() call counts its follower under every context length it has (n - 1 of them for
  // the back-off storage, one for the one-level storage).
  const double orders = std::is_same_v<S, NGramStorage> ? static_cast<double>(n - 1) : 1.0;
  state.counters["updates_per_second"] =
      benchmark::Counter(static_cast<double>(tokens.size() - 1), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["ngram_updates_per_second"] = benchmark::Counter(
      orders * static_cast<double>(tokens.size() - 1), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["ngrams"] = static_cast<double>(storage.size());
  state.counters["bytes_per_ngram"] = static_cast<double>(storage.memory_bytes()) / static_cast<double>(storage.size());
  // Bytes per context by the tables' own size and by the growth of the process's resident memory
  // (freed tables of earlier growth steps may stay resident: RSS is an upper bound).
  const auto contexts = static_cast<double>(storage.contexts());
  state.counters["contexts"] = contexts;
  state.counters["bytes_per_context"] = static_cast<double>(storage.memory_bytes()) / contexts;
  state.counters["rss_bytes_per_context"] = (resident_bytes() - resident_before) / contexts;
}

template <class S>
void BM_Lookup(benchmark::State& state) {
  const auto& tokens = stream();
  const int64_t n = state.range(0);
  S storage(n, kVocab);
  storage.initialize(tokens);
  int64_t found = 0;
  for (auto _ : state) {
    for (size_t i = 1; i < tokens.size(); ++i) found += storage.next_token(std::span(tokens).first(i)).has_value();
  }
  benchmark::DoNotOptimize(found);
  state.counters["lookups_per_second"] =
      benchmark::Counter(static_cast<double>(tokens.size() - 1), benchmark::Counter::kIsIterationInvariantRate);
}

BENCHMARK_TEMPLATE(BM_Update, NGramStorage)->Arg(3)->Arg(5)->Unit(benchmark::kMillisecond)->Iterations(1);
BENCHMARK_TEMPLATE(BM_Update, OneLevelNGramStorage)->Arg(3)->Arg(5)->Unit(benchmark::kMillisecond)->Iterations(1);
BENCHMARK_TEMPLATE(BM_Lookup, NGramStorage)->Arg(3)->Arg(5)->Unit(benchmark::kMillisecond)->Iterations(1);
BENCHMARK_TEMPLATE(BM_Lookup, OneLevelNGramStorage)->Arg(3)->Arg(5)->Unit(benchmark::kMillisecond)->Iterations(1);

}  // namespace

BENCHMARK_MAIN();
