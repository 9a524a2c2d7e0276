// Speculative vs autoregressive decoding on trained models, measured in one run:
//   stories: stories260K (target) with llama2xs (drafter), two TinyStories models of the same
//            size on one tokenizer (from SPECDEC_MODELS_DIR);
//   bundled: the bundled byte-level pair (a 4 x 192 target, a 2 x 96 drafter) on held-out Python
//            standard library sources.
// Greedy decoding, 128 new tokens per prompt.
#include <benchmark/benchmark.h>


#include <cstdlib>
#include <filesystem>
#include <optional>

#include "bench_support.hpp"
#include "specdec/io/checkpoint.hpp"
#include "specdec/io/tokenizer.hpp"
#include "specdec/text/prompts.hpp"
#include "specdec/text/python_corpus.hpp"

namespace {

using namespace specdec;
using Model = models::LlamaModel<StaticKVCache>;
constexpr int64_t kNewTokens = 128;

struct Pair {
  std::optional<Model> target, drafter;
  std::vector<std::vector<int64_t>> prompts;     // free text / held-out code
  std::vector<std::vector<int64_t>> repetitive;  // prompts that quote themselves
  std::string missing;  // why the pair is unavailable
};

Model load(const std::filesystem::path& path) {
  const auto checkpoint = io::load_llama(path);
  return Model(checkpoint.config, checkpoint.weights);
}

Pair& stories() {
  static Pair pair = [] {
    Pair p;
    const char* folder = std::getenv("SPECDEC_MODELS_DIR");
    const std::filesystem::path models = folder ? folder : "";
    if (!folder || !std::filesystem::exists(models / "stories260K/stories260K.bin")) {
      p.missing = "set SPECDEC_MODELS_DIR to ../shared/models";
      return p;
    }
    p.target.emplace(load(models / "stories260K/stories260K.bin"));
    p.drafter.emplace(load(models / "llama2xs/model.bin"));
    const auto tokenizer = io::Llama2cTokenizer::load(models / "stories260K/tok512.bin", 512);
    for (const char* text : {"Once upon a time", "The little dog", "Tom and Sue went to the park",
                             "One day, a girl named Mia"}) {
      p.prompts.push_back(tokenizer.encode(text));
    }
    for (const char* text : {"Tom saw a big red ball in the park. Tom saw a big red ball in the park. Tom saw a",
                             "Lily said, \"I like my cat.\" Lily said, \"I like my cat.\" Lily said,",
                             "The sun was hot. The sun was hot. The sun was hot. The sun"}) {
      p.repetitive.push_back(tokenizer.encode(text));
    }
    return p;
  }();
  return pair;
}

Pair& bundled() {
  static Pair pair = [] {
    Pair p;
    const std::filesystem::path models = SPECDEC_BUNDLED_MODELS_DIR;
    if (!std::filesystem::exists("/usr/lib/python3.11")) {
      p.missing = "the held-out text needs /usr/lib/python3.11 (Debian's libpython3.11-stdlib)";
      return p;
    }
    p.target.emplace(load(models / "target"));
    p.drafter.emplace(load(models / "drafter"));
    const auto corpus = text::load_python_corpus("/usr/lib/python3.11");
    const io::ByteTokenizer bytes;
    for (const auto& prompt : text::line_prompts(corpus.held_out, 8, 200)) {
      p.prompts.push_back(bytes.encode(prompt));
      // The snippet, then its first half again: a prompt that quotes itself.
      p.repetitive.push_back(bytes.encode(prompt + prompt.substr(0, prompt.size() / 2)));
    }
    return p;
  }();
  return pair;
}

void BM_Autoregressive(benchmark::State& state, Pair& (*pair)()) {
  Pair& p = pair();
  if (!p.target) return state.SkipWithError(p.missing.c_str());
  bench::measure_autoregressive(state, *p.target, p.prompts, kNewTokens);
}

void BM_Speculative(benchmark::State& state, Pair& (*pair)()) {
  Pair& p = pair();
  if (!p.target) return state.SkipWithError(p.missing.c_str());
  bench::measure_speculative(state, *p.drafter, *p.target, p.prompts, kNewTokens, state.range(0));
}

// Beam search over the same prompts: all beams in one batch per step.
void BM_BeamSearch(benchmark::State& state, Pair& (*pair)()) {
  Pair& p = pair();
  if (!p.target) return state.SkipWithError(p.missing.c_str());
  const int64_t beams = state.range(0);
  int64_t generated = 0, calls = 0, scored = 0;
  double seconds = 0;
  for (auto _ : state) {
    for (const auto& prompt : p.prompts) {
      const auto result = beam_search_generate(*p.target, prompt,
                                               {.max_new_tokens = kNewTokens, .num_beams = beams, .top_k = beams});
      generated += result.stats.generated;
      calls += result.stats.target_calls;
      scored += result.tokens_scored;
      seconds += result.stats.total_seconds;
    }
  }
  state.counters["tokens_per_second"] = static_cast<double>(generated) / seconds;
  state.counters["target_calls_per_token"] = static_cast<double>(calls) / static_cast<double>(generated);
  state.counters["tokens_scored_per_token"] = static_cast<double>(scored) / static_cast<double>(generated);
}

// NASD (a trigram storage with back-off, filler 3) and prompt lookup, gamma 5, on free and
// self-quoting prompts.
void BM_NGram(benchmark::State& state, Pair& (*pair)(), bool repetitive) {
  Pair& p = pair();
  if (!p.target) return state.SkipWithError(p.missing.c_str());
  const int64_t vocab = p.target->vocab_size();
  bench::measure_ngram(state, [&] { return NGramStorage(3, vocab); }, *p.target, repetitive ? p.repetitive : p.prompts,
                       kNewTokens, 5);
}
void BM_PromptLookup(benchmark::State& state, Pair& (*pair)(), bool repetitive) {
  Pair& p = pair();
  if (!p.target) return state.SkipWithError(p.missing.c_str());
  bench::measure_ngram(state, [] { return PromptLookupDrafter(3, 1); }, *p.target, repetitive ? p.repetitive : p.prompts,
                       kNewTokens, 5);
}
BENCHMARK_CAPTURE(BM_NGram, stories_free, &stories, false)->Unit(benchmark::kMillisecond)->Iterations(2);
BENCHMARK_CAPTURE(BM_NGram, stories_repetitive, &stories, true)->Unit(benchmark::kMillisecond)->Iterations(2);
BENCHMARK_CAPTURE(BM_PromptLookup, stories_free, &stories, false)->Unit(benchmark::kMillisecond)->Iterations(2);
BENCHMARK_CAPTURE(BM_PromptLookup, stories_repetitive, &stories, true)->Unit(benchmark::kMillisecond)->Iterations(2);
BENCHMARK_CAPTURE(BM_NGram, bundled_code, &bundled, false)->Unit(benchmark::kMillisecond)->Iterations(1);
BENCHMARK_CAPTURE(BM_NGram, bundled_repetitive, &bundled, true)->Unit(benchmark::kMillisecond)->Iterations(1);
BENCHMARK_CAPTURE(BM_PromptLookup, bundled_code, &bundled, false)->Unit(benchmark::kMillisecond)->Iterations(1);
BENCHMARK_CAPTURE(BM_PromptLookup, bundled_repetitive, &bundled, true)->Unit(benchmark::kMillisecond)->Iterations(1);

BENCHMARK_CAPTURE(BM_Autoregressive, stories, &stories)->Unit(benchmark::kMillisecond)->Iterations(3);
BENCHMARK_CAPTURE(BM_Speculative, stories, &stories)->Arg(1)->Arg(2)->Arg(3)->Arg(4)->Arg(6)->Arg(8)
    ->Unit(benchmark::kMillisecond)->Iterations(3);
BENCHMARK_CAPTURE(BM_Autoregressive, bundled, &bundled)->Unit(benchmark::kMillisecond)->Iterations(2);
BENCHMARK_CAPTURE(BM_Speculative, bundled, &bundled)->Arg(1)->Arg(2)->Arg(3)->Arg(4)->Arg(6)->Arg(8)
    ->Unit(benchmark::kMillisecond)->Iterations(2);
BENCHMARK_CAPTURE(BM_BeamSearch, bundled, &bundled)->Arg(1)->Arg(2)->Arg(4)->Arg(8)
    ->Unit(benchmark::kMillisecond)->Iterations(1);

}  // namespace

int main(int argc, char** argv) { return specdec::bench::run_benchmarks(argc, argv); }
