// Feature-level drafters beside the other draft sources, on the same targets, greedy, 128 new
// tokens per prompt, gamma 1 to 8:
//   bundled: the bundled byte-level target on held-out Python, with its EAGLE-3 head
//            (models/bundled/eagle3), its Medusa heads (models/bundled/medusa, 3 heads: gamma 1
//            to 3), the bundled drafter model, n-gram drafting (a trigram storage) and STAND;
//   stories: stories260K (from SPECDEC_MODELS_DIR) on four story openings, with its EAGLE-3 head
//            (models/stories260K/eagle3), the llama2xs drafter, n-gram drafting and STAND.
// Each iteration runs every prompt with the method and then autoregressively, so that the
// speedup compares runs made moments apart. Counters: accepted drafts per step, tokens per target
// call, tokens/s of both, the measured speedup, the draft source's cost per draft as a fraction of
// a one-token target forward (c: for a head, its whole time per step over its drafts, its
// forward over the verified positions included) and the speedup the cost model of Leviathan et
// al. (2023) predicts from the measured acceptance, gamma and c.
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <optional>

#include "bench_pairs.hpp"
#include "bench_support.hpp"
#include "specdec/drafting/eagle.hpp"
#include "specdec/drafting/medusa.hpp"
#include "specdec/io/checkpoint.hpp"
#include "specdec/io/eagle.hpp"
#include "specdec/io/medusa.hpp"
#include "specdec/io/tokenizer.hpp"
#include "specdec/text/prompts.hpp"
#include "text/python_corpus.hpp"

namespace {

using namespace specdec;
using Model = bench::PairModel;
constexpr int64_t kNewTokens = 128;

using bench::Setup;
using bench::bundled;
using bench::stories;

enum class Method { eagle, medusa, drafter, ngram, stand };

// One generation of `method` (speculative options with gamma), for the step statistics.
GenerationResult run(Setup& s, Method method, const std::vector<int64_t>& prompt, SpeculativeOptions options) {
  Model& target = *s.target;
  switch (method) {
    case Method::eagle: {
      EagleDraftSource source(*s.eagle, target);
      return generate_with(source, target, prompt, options);
    }
    case Method::medusa: {
      MedusaDraftSource source(*s.medusa, target);
      return generate_with(source, target, prompt, options);
    }
    case Method::drafter: return speculative_generate(*s.drafter, target, prompt, options);
    case Method::ngram: {
      NGramStorage storage(3, target.vocab_size());
      NGramDraftSource source(storage);
      return generate_with(source, target, prompt, options);
    }
    case Method::stand: {
      ProbabilisticNGramStorage memory(target.vocab_size(), 3);
      return stand_generate(memory, target, prompt, {.max_new_tokens = options.max_new_tokens});
    }
  }
  return {};
}

void BM_Drafting(benchmark::State& state, Setup& (*setup)(), Method method) {
  Setup& s = setup();
  if (!s.target) return state.SkipWithError(s.missing.c_str());
  if ((method == Method::eagle && !s.eagle) || (method == Method::medusa && !s.medusa)) {
    return state.SkipWithError("no head of this kind for this target");
  }
  const int64_t gamma = state.range(0);
  const SpeculativeOptions options{.max_new_tokens = kNewTokens, .gamma = gamma};
  // Warm-up: one generation of each.
  (void)run(s, method, s.prompts.front(), options);
  (void)autoregressive_generate(*s.target, s.prompts.front(), {.max_new_tokens = kNewTokens});
  GenerationStats with, alone;
  bench::Prefills prefills;
  for (auto _ : state) {
    for (const auto& prompt : s.prompts) {
      with += run(s, method, prompt, options).stats;
      alone += autoregressive_generate(*s.target, prompt, {.max_new_tokens = kNewTokens, .on_step = prefills.recorder()}).stats;
    }
  }
  const double seconds_per_token = with.total_seconds / static_cast<double>(with.generated);
  const double alone_per_token = alone.total_seconds / static_cast<double>(alone.generated);
  const double target_call = prefills.seconds_per_call(alone);
  const double drafts = static_cast<double>(with.drafted);
  const double c = drafts > 0 ? with.drafter_seconds / drafts / target_call : 0.0;
  state.counters["accepted_per_step"] = static_cast<double>(with.accepted) / static_cast<double>(with.steps);
  state.counters["tokens_per_target_call"] = with.tokens_per_target_call();
  state.counters["acceptance_rate"] = with.acceptance_rate();
  state.counters["tokens_per_second"] = 1.0 / seconds_per_token;
  state.counters["autoregressive_tokens_per_second"] = 1.0 / alone_per_token;
  state.counters["speedup"] = alone_per_token / seconds_per_token;
  state.counters["cost_ratio_c"] = c;
  state.counters["theoretical_speedup"] =
      method == Method::stand ? 0.0 : bench::theoretical_speedup(with.acceptance_rate(), static_cast<double>(gamma), c);
  state.counters["library_ms_per_step"] = 1e3 * with.library_seconds() / static_cast<double>(with.steps);
}

void gammas(benchmark::internal::Benchmark* b, int64_t most) {
  for (int64_t g = 1; g <= most; ++g) b->Arg(g);
  b->Unit(benchmark::kMillisecond)->Iterations(1);
}

BENCHMARK_CAPTURE(BM_Drafting, bundled_eagle3, &bundled, Method::eagle)->Apply([](auto* b) { gammas(b, 8); });
BENCHMARK_CAPTURE(BM_Drafting, bundled_medusa, &bundled, Method::medusa)->Apply([](auto* b) { gammas(b, 3); });
BENCHMARK_CAPTURE(BM_Drafting, bundled_drafter, &bundled, Method::drafter)->Apply([](auto* b) { gammas(b, 8); });
BENCHMARK_CAPTURE(BM_Drafting, bundled_ngram, &bundled, Method::ngram)->Apply([](auto* b) { gammas(b, 8); });
BENCHMARK_CAPTURE(BM_Drafting, bundled_stand, &bundled, Method::stand)->Arg(0)->Unit(benchmark::kMillisecond)->Iterations(1);
BENCHMARK_CAPTURE(BM_Drafting, stories_eagle3, &stories, Method::eagle)->Apply([](auto* b) { gammas(b, 8); });
BENCHMARK_CAPTURE(BM_Drafting, stories_medusa, &stories, Method::medusa)->Apply([](auto* b) { gammas(b, 3); });
BENCHMARK_CAPTURE(BM_Drafting, stories_llama2xs, &stories, Method::drafter)->Apply([](auto* b) { gammas(b, 8); });
BENCHMARK_CAPTURE(BM_Drafting, stories_ngram, &stories, Method::ngram)->Apply([](auto* b) { gammas(b, 8); });
BENCHMARK_CAPTURE(BM_Drafting, stories_stand, &stories, Method::stand)->Arg(0)->Unit(benchmark::kMillisecond)->Iterations(1);

}  // namespace

int main(int argc, char** argv) { return specdec::bench::run_benchmarks(argc, argv); }
