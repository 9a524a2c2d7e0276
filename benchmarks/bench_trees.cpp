// Draft trees against chains of the same drafter model, at matched verification cost: a chain of
// gamma drafts and a tree of gamma nodes both make the target score gamma + 1 positions per step.
//   bundled: the bundled target and drafter on held-out Python;
//   stories: stories260K (from SPECDEC_MODELS_DIR) with the llama2xs drafter, twelve openings.
// Each with its EAGLE-3 head (and the bundled target with its Medusa heads).
// Methods: chain (ModelDraftSource), static (ModelTreeSource on TreeTemplate::default_tree of
// gamma nodes; sampled children at temperature 1) and dynamic (DynamicTreeSource with depth 5,
// top_k 4, total_tokens gamma); eagle3 chain (EagleDraftSource) and dynamic tree
// (EagleTreeSource, same options); calibrated dynamic trees of 16 nodes (the depth, top_k and
// score_temperature that accepted the most on the pair's calibration prompts, which are not
// measured, chosen by BM_Calibration's grid); medusa chain (gamma at most the heads) and static
// tree (MedusaTreeSource on TreeTemplate::default_tree(gamma) cut to the heads' depth). Greedy
// (temperature 0) and temperature 1; 128 new tokens per prompt. Each iteration runs every prompt
// with the method and then autoregressively, so the speedup compares runs made moments apart.
// Counters: accepted drafts per step, tokens per target call, tokens/s of both, measured speedup,
// the drafter's and the target's milliseconds per step, and the library's own.
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

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
constexpr int64_t kNewTokens = 128;

using bench::bundled;
using bench::Setup;
using bench::stories;

enum class Method {
  chain,
  fixed,
  dynamic,
  dynamic_calibrated,
  eagle_chain,
  eagle_dynamic,
  eagle_calibrated,
  medusa_chain,
  medusa_static
};

// Greedy runs of a dynamic tree over `prompts`, from the drafter model or (head) the EAGLE-3 head.
GenerationStats dynamic_runs(Setup& s, bool head, const DynamicTreeOptions& options,
                             const std::vector<std::vector<int64_t>>& prompts) {
  GenerationStats stats;
  for (const auto& prompt : prompts) {
    const SpeculativeOptions step{.max_new_tokens = kNewTokens};
    if (head) {
      EagleTreeSource source(*s.eagle, *s.target, options);
      stats += generate_with(source, *s.target, prompt, step).stats;
    } else {
      DynamicTreeSource source(*s.drafter, options);
      stats += generate_with(source, *s.target, prompt, step).stats;
    }
  }
  return stats;
}

// The calibration grid for trees of 16 nodes: shapes (depth, top_k) by score temperatures.
const std::vector<std::pair<int64_t, int64_t>> kCalibrationShapes{{5, 4}, {8, 3}, {8, 4}, {12, 3}};
const std::vector<double> kCalibrationTemperatures{0.35, 0.5, 0.7, 1.0};

// One grid point on the calibration prompts (each measured once per process).
const GenerationStats& calibration_point(Setup& s, bool head, const DynamicTreeOptions& options) {
  static std::map<std::tuple<const Setup*, bool, int64_t, int64_t, double>, GenerationStats> done;
  const auto key = std::tuple(&s, head, options.depth, options.top_k, options.score_temperature);
  auto found = done.find(key);
  if (found == done.end())
    found = done.emplace(key, dynamic_runs(s, head, options, s.calibration)).first;
  return found->second;
}

// The grid point that accepts the most drafts per step on the calibration prompts (chosen once
// per pair and drafter).
DynamicTreeOptions calibrated(Setup& s, bool head) {
  static std::map<std::pair<const Setup*, bool>, DynamicTreeOptions> chosen;
  if (const auto found = chosen.find({&s, head}); found != chosen.end()) return found->second;
  DynamicTreeOptions best;
  double most = -1.0;
  for (const auto& [depth, top_k] : kCalibrationShapes) {
    for (const double temperature : kCalibrationTemperatures) {
      const DynamicTreeOptions options{
          .depth = depth, .top_k = top_k, .total_tokens = 16, .score_temperature = temperature};
      const GenerationStats& stats = calibration_point(s, head, options);
      const double accepted =
          static_cast<double>(stats.accepted) / static_cast<double>(stats.steps);
      if (accepted > most) {
        most = accepted;
        best = options;
      }
    }
  }
  chosen.emplace(std::pair(&s, head), best);
  return best;
}

template <LogitsProcessor P>
GenerationResult run(Setup& s, Method method, int64_t gamma, const std::vector<int64_t>& prompt,
                     const P& processor, uint64_t seed) {
  const SpeculativeOptions options{.max_new_tokens = kNewTokens, .seed = seed, .gamma = gamma};
  switch (method) {
    case Method::chain: {
      ModelDraftSource source(*s.drafter);
      return generate_with(source, *s.target, prompt, options, processor);
    }
    case Method::fixed: {
      ModelTreeSource source(*s.drafter, TreeTemplate::default_tree(gamma), TreeChildren::sampled);
      return generate_with(source, *s.target, prompt, options, processor);
    }
    case Method::dynamic: {
      DynamicTreeSource source(*s.drafter, {.depth = 5, .top_k = 4, .total_tokens = gamma});
      return generate_with(source, *s.target, prompt, options, processor);
    }
    case Method::dynamic_calibrated: {
      DynamicTreeOptions calibration = calibrated(s, false);
      calibration.total_tokens = gamma;
      DynamicTreeSource source(*s.drafter, calibration);
      return generate_with(source, *s.target, prompt, options, processor);
    }
    case Method::eagle_chain: {
      EagleDraftSource source(*s.eagle, *s.target);
      return generate_with(source, *s.target, prompt, options, processor);
    }
    case Method::eagle_dynamic: {
      EagleTreeSource source(*s.eagle, *s.target,
                                     {.depth = 5, .top_k = 4, .total_tokens = gamma});
      return generate_with(source, *s.target, prompt, options, processor);
    }
    case Method::eagle_calibrated: {
      DynamicTreeOptions calibration = calibrated(s, true);
      calibration.total_tokens = gamma;
      EagleTreeSource source(*s.eagle, *s.target, calibration);
      return generate_with(source, *s.target, prompt, options, processor);
    }
    case Method::medusa_chain: {
      MedusaDraftSource source(*s.medusa, *s.target);
      return generate_with(source, *s.target, prompt, options, processor);
    }
    case Method::medusa_static: {
      static const std::vector<double> kRanks{0.55, 0.2,  0.1,   0.06, 0.04,
                                              0.03, 0.02, 0.015, 0.01, 0.01};
      MedusaTreeSource source(
          *s.medusa, *s.target,
          TreeTemplate::best_first(gamma, kRanks, s.medusa->config().num_heads));
      return generate_with(source, *s.target, prompt, options, processor);
    }
  }
  return {};
}

// The pair's prompts and its further ones.
std::vector<std::vector<int64_t>> measured(const Setup& s) {
  std::vector<std::vector<int64_t>> prompts = s.prompts;
  prompts.insert(prompts.end(), s.more_prompts.begin(), s.more_prompts.end());
  return prompts;
}

template <LogitsProcessor P>
void measure(benchmark::State& state, Setup& s, Method method, const P& processor) {
  const int64_t gamma = state.range(0);
  (void)run(s, method, gamma, s.prompts.front(), processor, 1);  // warm-up
  (void)autoregressive_generate(*s.target, s.prompts.front(), {.max_new_tokens = kNewTokens});
  const std::vector<std::vector<int64_t>> prompts = measured(s);
  GenerationStats with, alone;
  uint64_t seed = 0;
  for (auto _ : state) {
    for (const auto& prompt : prompts) {
      ++seed;
      with += run(s, method, gamma, prompt, processor, seed).stats;
      alone += autoregressive_generate(*s.target, prompt,
                                       {.max_new_tokens = kNewTokens, .seed = seed}, processor)
                   .stats;
    }
  }
  const double steps = static_cast<double>(with.steps);
  const double per_token = with.total_seconds / static_cast<double>(with.generated);
  const double alone_per_token = alone.total_seconds / static_cast<double>(alone.generated);
  state.counters["accepted_per_step"] = static_cast<double>(with.accepted) / steps;
  state.counters["tokens_per_target_call"] = with.tokens_per_target_call();
  state.counters["tokens_per_second"] = 1.0 / per_token;
  state.counters["autoregressive_tokens_per_second"] = 1.0 / alone_per_token;
  state.counters["speedup"] = alone_per_token / per_token;
  state.counters["drafter_ms_per_step"] = 1e3 * with.drafter_seconds / steps;
  state.counters["target_ms_per_step"] = 1e3 * with.target_seconds / steps;
  state.counters["library_ms_per_step"] = 1e3 * with.library_seconds() / steps;
}

// The calibration grid: dynamic trees of 16 nodes, greedy, on the calibration prompts, for each
// depth and top_k (range 0 and 1) and score_temperature (range 2, in hundredths).
void BM_Calibration(benchmark::State& state, Setup& (*setup)(), bool head) {
  Setup& s = setup();
  if (!s.target || (head && !s.eagle))
    return state.SkipWithError(s.missing.empty() ? "no EAGLE-3 head" : s.missing.c_str());
  const DynamicTreeOptions options{.depth = state.range(0),
                                   .top_k = state.range(1),
                                   .total_tokens = 16,
                                   .score_temperature = static_cast<double>(state.range(2)) / 100};
  GenerationStats with;
  for (auto _ : state) with = calibration_point(s, head, options);
  const double steps = static_cast<double>(with.steps);
  state.counters["accepted_per_step"] = static_cast<double>(with.accepted) / steps;
  state.counters["tokens_per_second"] = static_cast<double>(with.generated) / with.total_seconds;
  state.counters["drafter_ms_per_step"] = 1e3 * with.drafter_seconds / steps;
}

void grid(benchmark::internal::Benchmark* b) {
  for (const auto& [depth, top_k] : kCalibrationShapes) {
    for (const double temperature : kCalibrationTemperatures)
      b->Args({depth, top_k, std::llround(temperature * 100)});
  }
  b->Unit(benchmark::kMillisecond)->Iterations(1);
}

BENCHMARK_CAPTURE(BM_Calibration, stories_llama2xs, &stories, false)->Apply(grid);
BENCHMARK_CAPTURE(BM_Calibration, stories_eagle3, &stories, true)->Apply(grid);
BENCHMARK_CAPTURE(BM_Calibration, bundled_eagle3, &bundled, true)->Apply(grid);

void BM_Trees(benchmark::State& state, Setup& (*setup)(), Method method, double temperature) {
  Setup& s = setup();
  if (!s.target) return state.SkipWithError(s.missing.c_str());
  const bool eagle = method == Method::eagle_chain || method == Method::eagle_dynamic ||
                     method == Method::eagle_calibrated;
  const bool medusa = method == Method::medusa_chain || method == Method::medusa_static;
  if ((eagle && !s.eagle) || (medusa && !s.medusa)) {
    return state.SkipWithError("no head of this kind for this target");
  }
  if (temperature == 0.0) {
    measure(state, s, method, GreedyProcessor{});
  } else {
    measure(state, s, method, MultinomialProcessor(temperature));
  }
  if (method == Method::dynamic_calibrated || method == Method::eagle_calibrated) {
    const DynamicTreeOptions chosen = calibrated(s, eagle);
    state.counters["depth"] = static_cast<double>(chosen.depth);
    state.counters["top_k"] = static_cast<double>(chosen.top_k);
    state.counters["score_temperature"] = chosen.score_temperature;
  }
}

void sizes(benchmark::internal::Benchmark* b) {
  for (const int64_t gamma : {2, 4, 6, 8, 16}) b->Arg(gamma);
  b->Unit(benchmark::kMillisecond)->Iterations(1);
}
void calibrated_size(benchmark::internal::Benchmark* b) {
  b->Arg(16)->Unit(benchmark::kMillisecond)->Iterations(1);
}

BENCHMARK_CAPTURE(BM_Trees, stories_chain_greedy, &stories, Method::chain, 0.0)->Apply(sizes);
BENCHMARK_CAPTURE(BM_Trees, stories_static_greedy, &stories, Method::fixed, 0.0)->Apply(sizes);
BENCHMARK_CAPTURE(BM_Trees, stories_dynamic_greedy, &stories, Method::dynamic, 0.0)->Apply(sizes);
BENCHMARK_CAPTURE(BM_Trees, stories_dynamic_calibrated_greedy, &stories, Method::dynamic_calibrated,
                  0.0)
    ->Apply(calibrated_size);
BENCHMARK_CAPTURE(BM_Trees, stories_chain_t1, &stories, Method::chain, 1.0)->Apply(sizes);
BENCHMARK_CAPTURE(BM_Trees, stories_static_t1, &stories, Method::fixed, 1.0)->Apply(sizes);
BENCHMARK_CAPTURE(BM_Trees, stories_dynamic_t1, &stories, Method::dynamic, 1.0)->Apply(sizes);
BENCHMARK_CAPTURE(BM_Trees, stories_eagle3_chain_greedy, &stories, Method::eagle_chain, 0.0)
    ->Apply(sizes);
BENCHMARK_CAPTURE(BM_Trees, stories_eagle3_dynamic_greedy, &stories, Method::eagle_dynamic, 0.0)
    ->Apply(sizes);
BENCHMARK_CAPTURE(BM_Trees, stories_eagle3_calibrated_greedy, &stories, Method::eagle_calibrated,
                  0.0)
    ->Apply(calibrated_size);
BENCHMARK_CAPTURE(BM_Trees, stories_eagle3_chain_t1, &stories, Method::eagle_chain, 1.0)
    ->Apply(sizes);
BENCHMARK_CAPTURE(BM_Trees, stories_eagle3_dynamic_t1, &stories, Method::eagle_dynamic, 1.0)
    ->Apply(sizes);
BENCHMARK_CAPTURE(BM_Trees, bundled_chain_greedy, &bundled, Method::chain, 0.0)->Apply(sizes);
BENCHMARK_CAPTURE(BM_Trees, bundled_static_greedy, &bundled, Method::fixed, 0.0)->Apply(sizes);
BENCHMARK_CAPTURE(BM_Trees, bundled_dynamic_greedy, &bundled, Method::dynamic, 0.0)->Apply(sizes);
BENCHMARK_CAPTURE(BM_Trees, bundled_chain_t1, &bundled, Method::chain, 1.0)->Apply(sizes);
BENCHMARK_CAPTURE(BM_Trees, bundled_static_t1, &bundled, Method::fixed, 1.0)->Apply(sizes);
BENCHMARK_CAPTURE(BM_Trees, bundled_dynamic_t1, &bundled, Method::dynamic, 1.0)->Apply(sizes);

BENCHMARK_CAPTURE(BM_Trees, bundled_eagle3_chain_greedy, &bundled, Method::eagle_chain, 0.0)
    ->Apply(sizes);
BENCHMARK_CAPTURE(BM_Trees, bundled_eagle3_dynamic_greedy, &bundled, Method::eagle_dynamic, 0.0)
    ->Apply(sizes);
BENCHMARK_CAPTURE(BM_Trees, bundled_eagle3_calibrated_greedy, &bundled, Method::eagle_calibrated,
                  0.0)
    ->Apply(calibrated_size);
BENCHMARK_CAPTURE(BM_Trees, bundled_eagle3_chain_t1, &bundled, Method::eagle_chain, 1.0)
    ->Apply(sizes);
BENCHMARK_CAPTURE(BM_Trees, bundled_eagle3_dynamic_t1, &bundled, Method::eagle_dynamic, 1.0)
    ->Apply(sizes);
BENCHMARK_CAPTURE(BM_Trees, bundled_medusa_chain_greedy, &bundled, Method::medusa_chain, 0.0)
    ->Arg(1)
    ->Arg(2)
    ->Arg(3)
    ->Unit(benchmark::kMillisecond)
    ->Iterations(1);
BENCHMARK_CAPTURE(BM_Trees, bundled_medusa_static_greedy, &bundled, Method::medusa_static, 0.0)
    ->Apply(sizes);
BENCHMARK_CAPTURE(BM_Trees, bundled_medusa_chain_t1, &bundled, Method::medusa_chain, 1.0)
    ->Arg(1)
    ->Arg(2)
    ->Arg(3)
    ->Unit(benchmark::kMillisecond)
    ->Iterations(1);
BENCHMARK_CAPTURE(BM_Trees, bundled_medusa_static_t1, &bundled, Method::medusa_static, 1.0)
    ->Apply(sizes);

}  // namespace

int main(int argc, char** argv) { return specdec::bench::run_benchmarks(argc, argv); }
