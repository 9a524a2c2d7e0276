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
//
// BM_HeadsInBatches: the same head drafting for a batch of 1 to 16 rows (the prompts repeated),
// greedy, 64 new tokens per row, two ways in one run, alternated with batched autoregressive
// decoding of the same rows: one source per row (generate_with_batch: gamma head forwards per row
// and step) and one head for all rows (eagle_generate_batch, medusa_generate_batch: gamma head
// forwards per step). Counters: tokens/s of each, the head's milliseconds per step of each, and
// one head's speedup over the sources and over autoregressive decoding. The *_aten runs switch the
// EAGLE head's CPU loops off on both sides: every head forward is then an ATen pass, as on a GPU,
// where a forward's cost is its kernel launches more than its rows.
//
// BM_ParallelDrafting: a parallel drafter (models/<pair>/pard, adapted from the pair's drafter by
// tools/train_pard) at gamma 2 to 8 beside the unadapted drafter drafting one token at a time and
// the EAGLE-3 head, in one run; see the function's comment for its counters.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "bench_pairs.hpp"
#include "bench_support.hpp"
#include "specdec/drafting/eagle.hpp"
#include "specdec/drafting/head_batches.hpp"
#include "specdec/drafting/medusa.hpp"
#include "specdec/drafting/parallel.hpp"
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

enum class Method { eagle, medusa, drafter, ngram, stand, parallel, parallel_tree };

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
    case Method::parallel: {
      ParallelDraftSource source(*s.pard, {.mask_token = s.pard_mask, .vocab_size = target.vocab_size()});
      return generate_with(source, target, prompt, options);
    }
    case Method::parallel_tree: {
      ParallelTreeSource source(*s.pard, {.mask_token = s.pard_mask, .vocab_size = target.vocab_size()},
                                bench::parallel_tree(options.gamma));
      return generate_with(source, target, prompt, options);
    }
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

// Parallel drafting against the same drafter (before its adaptation) drafting one token at a time
// and the EAGLE-3 head, in one run: each prompt through every way in turn, then autoregressively.
// The parallel drafter also drafts a static tree from the same forward (parallel_tree: its chain
// and three second or third choices near the root, parallel_tree(gamma)). Per way: drafts
// accepted per step, drafter forwards per step, tokens/s and the speedup over autoregressive
// decoding, and the target's, drafter's and library's milliseconds per step; parallel_over_chain compares the parallel drafter's acceptance with the
// chain's.
void BM_ParallelDrafting(benchmark::State& state, Setup& (*setup)()) {
  Setup& s = setup();
  if (!s.target) return state.SkipWithError(s.missing.c_str());
  if (!s.pard) return state.SkipWithError("no parallel drafter for this target (models/<pair>/pard)");
  const SpeculativeOptions options{.max_new_tokens = kNewTokens, .gamma = state.range(0)};
  struct Way {
    const char* name;
    Method method;
    GenerationStats stats{};
  };
  std::vector<Way> ways{{"parallel", Method::parallel}, {"chain", Method::drafter}, {"parallel_tree", Method::parallel_tree}};
  if (s.eagle) ways.push_back({"eagle3", Method::eagle});
  for (const Way& way : ways) (void)run(s, way.method, s.prompts.front(), options);  // warm-up
  (void)autoregressive_generate(*s.target, s.prompts.front(), {.max_new_tokens = kNewTokens});
  GenerationStats alone;
  for (auto _ : state) {
    for (const auto& prompt : s.prompts) {
      for (Way& way : ways) way.stats += run(s, way.method, prompt, options).stats;
      alone += autoregressive_generate(*s.target, prompt, {.max_new_tokens = kNewTokens}).stats;
    }
  }
  const double alone_per_second = static_cast<double>(alone.generated) / alone.total_seconds;
  state.counters["autoregressive_tokens_per_second"] = alone_per_second;
  for (const Way& way : ways) {
    const auto steps = static_cast<double>(way.stats.steps);
    const double per_second = static_cast<double>(way.stats.generated) / way.stats.total_seconds;
    const std::string name = way.name;
    state.counters[name + "_accepted_per_step"] = static_cast<double>(way.stats.accepted) / steps;
    state.counters[name + "_drafter_forwards_per_step"] = static_cast<double>(way.stats.drafter_calls) / steps;
    state.counters[name + "_tokens_per_second"] = per_second;
    state.counters[name + "_speedup"] = per_second / alone_per_second;
    // Where a step's time goes: the target's forward, the drafter's work, the library's own.
    state.counters[name + "_target_ms_per_step"] = 1e3 * way.stats.target_seconds / steps;
    state.counters[name + "_drafter_ms_per_step"] = 1e3 * way.stats.drafter_seconds / steps;
    state.counters[name + "_library_ms_per_step"] = 1e3 * way.stats.library_seconds() / steps;
  }
  state.counters["autoregressive_ms_per_token"] = 1e3 / alone_per_second;
  state.counters["parallel_over_chain"] = static_cast<double>(ways[0].stats.accepted) /
                                          static_cast<double>(std::max<int64_t>(1, ways[1].stats.accepted)) *
                                          static_cast<double>(ways[1].stats.steps) / static_cast<double>(ways[0].stats.steps);
}

void gammas(benchmark::internal::Benchmark* b, int64_t most) {
  for (int64_t g = 1; g <= most; ++g) b->Arg(g);
  b->Unit(benchmark::kMillisecond)->Iterations(1);
}

// The batch's tokens, wall seconds and the head's seconds per step of one batched generation.
struct BatchRun {
  int64_t tokens = 0;
  double seconds = 0.0, head_seconds = 0.0;
  int64_t steps = 0;
  void add(const std::vector<GenerationResult>& results, double wall) {
    seconds += wall;
    const GenerationResult* longest = &results.front();
    for (const GenerationResult& r : results) {
      tokens += r.stats.generated;
      if (r.stats.steps > longest->stats.steps) longest = &r;
    }
    // Every row's stats count the batch's shared drafting whole: the longest row's is the batch's.
    head_seconds += longest->stats.drafter_seconds;
    steps += longest->stats.steps;
  }
};

template <class Run>
std::vector<GenerationResult> timed(BatchRun& into, Run&& run) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<GenerationResult> results = run();
  into.add(results, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return results;
}

void BM_HeadsInBatches(benchmark::State& state, Setup& (*setup)(), Method method, bool aten) {
  Setup& s = setup();
  if (!s.target) return state.SkipWithError(s.missing.c_str());
  if ((method == Method::eagle && !s.eagle) || (method == Method::medusa && !s.medusa)) {
    return state.SkipWithError("no head of this kind for this target");
  }
  // `aten`: the EAGLE head's ATen forward both ways (its CPU loops off), as on a device.
  struct Restore {
    models::EagleHead* head;
    ~Restore() {
      if (head != nullptr) head->use_cpu_kernels(true);
    }
  } restore{aten && s.eagle ? &*s.eagle : nullptr};
  if (restore.head != nullptr) restore.head->use_cpu_kernels(false);
  const int64_t batch = state.range(0);
  std::vector<std::vector<int64_t>> prompts;
  for (int64_t r = 0; r < batch; ++r) prompts.push_back(s.prompts[static_cast<size_t>(r) % s.prompts.size()]);
  Model& target = *s.target;
  const SpeculativeOptions options{.max_new_tokens = 64, .gamma = method == Method::eagle ? 4 : 3};
  const auto per_row = [&] {
    if (method == Method::eagle) {
      std::vector<EagleDraftSource> sources;
      for (int64_t r = 0; r < batch; ++r) sources.emplace_back(*s.eagle, target);
      return generate_with_batch(std::span(sources), target, prompts, options);
    }
    std::vector<MedusaDraftSource> sources;
    for (int64_t r = 0; r < batch; ++r) sources.emplace_back(*s.medusa, target);
    return generate_with_batch(std::span(sources), target, prompts, options);
  };
  const auto one_head = [&] {
    return method == Method::eagle ? eagle_generate_batch(*s.eagle, target, prompts, options)
                                   : medusa_generate_batch(*s.medusa, target, prompts, options);
  };
  const auto alone = [&] { return autoregressive_generate_batch(target, prompts, {.max_new_tokens = 64}); };
  (void)per_row();  // warm-up
  (void)one_head();
  (void)alone();
  BatchRun rows, head, autoregressive;
  bool same = true;
  int64_t round = 0;
  for (auto _ : state) {
    const bool head_first = round++ % 2 == 1;  // each order in turn
    std::vector<GenerationResult> a, b;
    if (head_first) b = timed(head, one_head);
    a = timed(rows, per_row);
    if (!head_first) b = timed(head, one_head);
    (void)timed(autoregressive, alone);
    for (size_t r = 0; r < a.size(); ++r) same = same && a[r].tokens == b[r].tokens;
  }
  if (!same) return state.SkipWithError("one head's rows differ from the sources' rows");
  const auto tps = [](const BatchRun& run) { return static_cast<double>(run.tokens) / run.seconds; };
  state.counters["rows_tokens_per_second"] = tps(rows);
  state.counters["head_tokens_per_second"] = tps(head);
  state.counters["autoregressive_tokens_per_second"] = tps(autoregressive);
  state.counters["rows_head_ms_per_step"] = 1e3 * rows.head_seconds / static_cast<double>(rows.steps);
  state.counters["head_head_ms_per_step"] = 1e3 * head.head_seconds / static_cast<double>(head.steps);
  state.counters["head_over_rows"] = tps(head) / tps(rows);
  state.counters["head_over_autoregressive"] = tps(head) / tps(autoregressive);
}

void batches(benchmark::internal::Benchmark* b) {
  for (const int64_t rows : {1, 2, 4, 8, 16}) b->Arg(rows);
  b->Unit(benchmark::kMillisecond)->Iterations(2);
}

BENCHMARK_CAPTURE(BM_HeadsInBatches, bundled_eagle3, &bundled, Method::eagle, false)->Apply(batches);
BENCHMARK_CAPTURE(BM_HeadsInBatches, bundled_eagle3_aten, &bundled, Method::eagle, true)->Apply(batches);
BENCHMARK_CAPTURE(BM_HeadsInBatches, bundled_medusa, &bundled, Method::medusa, false)->Apply(batches);
BENCHMARK_CAPTURE(BM_HeadsInBatches, stories_eagle3, &stories, Method::eagle, false)->Apply(batches);
BENCHMARK_CAPTURE(BM_HeadsInBatches, stories_eagle3_aten, &stories, Method::eagle, true)->Apply(batches);

BENCHMARK_CAPTURE(BM_ParallelDrafting, bundled, &bundled)->DenseRange(2, 8)->Unit(benchmark::kMillisecond)->Iterations(1);
BENCHMARK_CAPTURE(BM_ParallelDrafting, stories, &stories)->DenseRange(2, 8)->Unit(benchmark::kMillisecond)->Iterations(1);
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
