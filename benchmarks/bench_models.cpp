// Speculative vs autoregressive decoding on trained models, measured in one run:
//   stories: stories260K (target) with llama2xs (drafter), two TinyStories models of the same
//            size on one tokenizer (from SPECDEC_MODELS_DIR);
//   bundled: the bundled byte-level pair (a 4 x 192 target, a 2 x 96 drafter) on held-out Python
//            standard library sources.
// Greedy decoding, 128 new tokens per prompt; BM_Sampled, BM_Threshold and BM_Calibration sample
// at temperature 1.
#include <benchmark/benchmark.h>


#include <cstdlib>
#include <filesystem>
#include <optional>

#include "bench_support.hpp"
#include "specdec/io/checkpoint.hpp"
#include "specdec/io/tokenizer.hpp"
#include "specdec/text/prompts.hpp"
#include "text/python_corpus.hpp"

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
  const auto checkpoint = io::load_llama(path, bench::on_device());
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
  bench::measure_speculative(state, *p.drafter, *p.target, p.prompts, kNewTokens, {.gamma = state.range(0)});
}

// Draft-length policies (greedy), beside the fixed gammas of BM_Speculative.
const SpeculativeOptions kEgag{.gamma_policy = GammaPolicy::egag, .gamma_min = 1, .gamma_max = 8};
const SpeculativeOptions kEgagSmoothed{.gamma_policy = GammaPolicy::egag, .gamma_min = 1, .gamma_max = 8,
                                       .egag_ema_beta = 0.5};
const SpeculativeOptions kSchedule{.gamma = 4, .gamma_policy = GammaPolicy::schedule, .gamma_min = 1, .gamma_max = 8};
const SpeculativeOptions kConfidenceStop{.gamma = 8, .p_min = 0.4};
const SpeculativeOptions kEgagConfidenceStop{.gamma_policy = GammaPolicy::egag, .gamma_min = 1, .gamma_max = 8,
                                             .p_min = 0.4};

void BM_Policy(benchmark::State& state, Pair& (*pair)(), const SpeculativeOptions* options) {
  Pair& p = pair();
  if (!p.target) return state.SkipWithError(p.missing.c_str());
  bench::measure_speculative(state, *p.drafter, *p.target, p.prompts, kNewTokens, *options);
}

// Sampling at temperature 1, gamma 4: exact rejection sampling, then lossy threshold verification
// at tau = range(0) / 100.
void BM_Sampled(benchmark::State& state, Pair& (*pair)()) {
  Pair& p = pair();
  if (!p.target) return state.SkipWithError(p.missing.c_str());
  bench::measure_speculative(state, *p.drafter, *p.target, p.prompts, kNewTokens, {.gamma = 4},
                             MultinomialProcessor{});
}

void BM_Threshold(benchmark::State& state, Pair& (*pair)()) {
  Pair& p = pair();
  if (!p.target) return state.SkipWithError(p.missing.c_str());
  const double tau = static_cast<double>(state.range(0)) / 100.0;
  state.counters["threshold"] = tau;
  bench::measure_speculative(state, *p.drafter, *p.target, p.prompts, kNewTokens,
                             {.gamma = 4, .verification = Verification::threshold, .threshold = tau},
                             MultinomialProcessor{});
}

// calibrate_threshold on the prompts (the dev set), aiming at acceptance 0.7: the chosen tau and
// its acceptance.
void BM_Calibration(benchmark::State& state, Pair& (*pair)()) {
  Pair& p = pair();
  if (!p.target) return state.SkipWithError(p.missing.c_str());
  CalibrationResult result;
  for (auto _ : state) {
    result = calibrate_threshold(*p.drafter, *p.target, p.prompts, {.max_new_tokens = kNewTokens, .seed = 0, .gamma = 4},
                                 {.thresholds = {0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4}}, MultinomialProcessor{});
  }
  for (const CalibrationPoint& point : result.points) {
    if (point.threshold == result.best_threshold) {
      state.counters["best_threshold"] = point.threshold;
      state.counters["acceptance_rate"] = point.acceptance_rate();
      state.counters["tokens_per_target_call"] = point.tokens_per_target_call();
    }
  }
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
BENCHMARK_CAPTURE(BM_Policy, stories_egag, &stories, &kEgag)->Unit(benchmark::kMillisecond)->Iterations(3);
BENCHMARK_CAPTURE(BM_Policy, stories_egag_smoothed, &stories, &kEgagSmoothed)->Unit(benchmark::kMillisecond)->Iterations(3);
BENCHMARK_CAPTURE(BM_Policy, stories_schedule, &stories, &kSchedule)->Unit(benchmark::kMillisecond)->Iterations(3);
BENCHMARK_CAPTURE(BM_Policy, stories_confidence_stop, &stories, &kConfidenceStop)->Unit(benchmark::kMillisecond)->Iterations(3);
BENCHMARK_CAPTURE(BM_Policy, stories_egag_confidence_stop, &stories, &kEgagConfidenceStop)->Unit(benchmark::kMillisecond)->Iterations(3);
BENCHMARK_CAPTURE(BM_Policy, bundled_egag, &bundled, &kEgag)->Unit(benchmark::kMillisecond)->Iterations(2);
BENCHMARK_CAPTURE(BM_Policy, bundled_egag_smoothed, &bundled, &kEgagSmoothed)->Unit(benchmark::kMillisecond)->Iterations(2);
BENCHMARK_CAPTURE(BM_Policy, bundled_schedule, &bundled, &kSchedule)->Unit(benchmark::kMillisecond)->Iterations(2);
BENCHMARK_CAPTURE(BM_Policy, bundled_confidence_stop, &bundled, &kConfidenceStop)->Unit(benchmark::kMillisecond)->Iterations(2);
BENCHMARK_CAPTURE(BM_Policy, bundled_egag_confidence_stop, &bundled, &kEgagConfidenceStop)->Unit(benchmark::kMillisecond)->Iterations(2);
BENCHMARK_CAPTURE(BM_Sampled, stories, &stories)->Unit(benchmark::kMillisecond)->Iterations(3);
BENCHMARK_CAPTURE(BM_Threshold, stories, &stories)->Arg(10)->Arg(20)->Arg(25)->Arg(30)->Arg(40)->Arg(60)
    ->Unit(benchmark::kMillisecond)->Iterations(3);
BENCHMARK_CAPTURE(BM_Calibration, stories, &stories)->Unit(benchmark::kMillisecond)->Iterations(1);
BENCHMARK_CAPTURE(BM_Sampled, bundled, &bundled)->Unit(benchmark::kMillisecond)->Iterations(2);
BENCHMARK_CAPTURE(BM_Threshold, bundled, &bundled)->Arg(10)->Arg(20)->Arg(25)->Arg(30)->Arg(40)->Arg(60)
    ->Unit(benchmark::kMillisecond)->Iterations(2);
BENCHMARK_CAPTURE(BM_Calibration, bundled, &bundled)->Unit(benchmark::kMillisecond)->Iterations(1);
BENCHMARK_CAPTURE(BM_BeamSearch, bundled, &bundled)->Arg(1)->Arg(2)->Arg(4)->Arg(8)
    ->Unit(benchmark::kMillisecond)->Iterations(1);

}  // namespace

int main(int argc, char** argv) { return specdec::bench::run_benchmarks(argc, argv); }
