// Shared measurement code of the generation benchmarks: autoregressive and speculative decoding
// of the same target in one run, reported as Google Benchmark counters.
#pragma once

#include <benchmark/benchmark.h>

#include <ATen/Parallel.h>
#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <map>
#include <sstream>
#include <span>
#include <string>
#include <vector>

#include "specdec/models/detail/cpu_linear.hpp"
#include "specdec/specdec.hpp"

namespace specdec::bench {

// Seconds per generated token and per forward call of a model decoding alone, measured once per
// process and model (after a warm-up).
struct Baseline {
  double seconds_per_token = 0;
  double seconds_per_call = 0;
};

// The prompts' prefills, apart from the per-call figures: the first step of a generation runs
// the target over the whole prompt, which would otherwise inflate the time per target call (and
// the cost ratio c) by the prompt's length.
struct Prefills {
  double seconds = 0;     // the first steps' target time
  int64_t count = 0;      // generations

  // An on_step callback that records the first step's target time here.
  [[nodiscard]] StepCallback recorder() {
    return [this](const StepInfo& step) {
      if (step.step == 0) {
        seconds += step.target_seconds;
        ++count;
      }
    };
  }
  // Seconds per target call after the prefill (each generation's first call is its prefill).
  [[nodiscard]] double seconds_per_call(const GenerationStats& total) const {
    return (total.target_seconds - seconds) / static_cast<double>(std::max<int64_t>(1, total.target_calls - count));
  }
  void report(benchmark::State& state, const GenerationStats& total) const {
    state.counters["target_ms_per_call"] = 1e3 * seconds_per_call(total);
    state.counters["prefill_ms"] = 1e3 * seconds / static_cast<double>(std::max<int64_t>(1, count));
  }
};

template <LanguageModel M>
Baseline autoregressive_baseline(M& model, std::span<const int64_t> prompt, int64_t new_tokens) {
  static std::map<const void*, Baseline> measured;
  if (auto it = measured.find(&model); it != measured.end()) return it->second;
  (void)autoregressive_generate(model, prompt, {.max_new_tokens = 8});
  GenerationStats total;
  Prefills prefills;
  for (int i = 0; i < 3; ++i) {
    total += autoregressive_generate(model, prompt, {.max_new_tokens = new_tokens, .on_step = prefills.recorder()}).stats;
  }
  return measured[&model] = Baseline{total.total_seconds / static_cast<double>(total.generated),
                                     prefills.seconds_per_call(total)};
}

// Expected speedup of Leviathan et al. (2023) for acceptance alpha, gamma drafts and cost ratio c:
// (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)).
inline double theoretical_speedup(double alpha, double gamma, double c) {
  if (alpha >= 1.0) return (gamma + 1) / (gamma * c + 1);
  return (1 - std::pow(alpha, gamma + 1)) / ((1 - alpha) * (gamma * c + 1));
}

// Runs autoregressive decoding of `target` for every prompt per iteration.
template <Target T>
void measure_autoregressive(benchmark::State& state, T& target, std::span<const std::vector<int64_t>> prompts,
                            int64_t new_tokens) {
  GenerationStats total;
  Prefills prefills;
  for (auto _ : state) {
    for (const auto& prompt : prompts) {
      total += autoregressive_generate(target, prompt, {.max_new_tokens = new_tokens, .on_step = prefills.recorder()}).stats;
    }
  }
  state.counters["tokens_per_second"] = static_cast<double>(total.generated) / total.total_seconds;
  prefills.report(state, total);
  state.counters["library_ms_per_step"] = 1e3 * total.library_seconds() / static_cast<double>(total.steps);
}

// Runs speculative decoding with `options` (max_new_tokens is set here) for every prompt per
// iteration and reports acceptance, tokens per target call, drafts per step, the library's own
// time, and measured beside theoretical speedup. The speedup is against greedy autoregressive
// decoding, whatever the processor (sampling costs the same per token). The theoretical speedup
// takes the fixed gamma, or for adaptive policies the mean number of drafts per step.
template <Drafter D, Target T, LogitsProcessor P = GreedyProcessor>
void measure_speculative(benchmark::State& state, D& drafter, T& target,
                         std::span<const std::vector<int64_t>> prompts, int64_t new_tokens,
                         SpeculativeOptions options, const P& processor = {}) {
  const Baseline target_alone = autoregressive_baseline(target, prompts.front(), new_tokens);
  const Baseline drafter_alone = autoregressive_baseline(drafter, prompts.front(), new_tokens);
  options.max_new_tokens = new_tokens;
  GenerationStats total;
  Prefills prefills;
  options.on_step = prefills.recorder();
  uint64_t seed = 0;
  for (auto _ : state) {
    for (const auto& prompt : prompts) {
      options.seed = seed++;
      total += speculative_generate(drafter, target, prompt, options, processor).stats;
    }
  }
  const double seconds_per_token = total.total_seconds / static_cast<double>(total.generated);
  const double c = drafter_alone.seconds_per_call / target_alone.seconds_per_call;
  const bool fixed = options.gamma_policy == GammaPolicy::fixed && options.p_min == 0.0 && options.entropy_gate == 1.0;
  state.counters["tokens_per_second"] = 1.0 / seconds_per_token;
  state.counters["acceptance_rate"] = total.acceptance_rate();
  state.counters["tokens_per_target_call"] = total.tokens_per_target_call();
  state.counters["drafts_per_step"] = total.drafts_per_step();
  state.counters["drafter_calls_per_token"] = total.drafter_calls_per_token();
  prefills.report(state, total);
  state.counters["library_ms_per_step"] = 1e3 * total.library_seconds() / static_cast<double>(total.steps);
  // The library's share of the decoding steps' wall time (the prefills left out).
  state.counters["library_share"] = total.library_seconds() / (total.total_seconds - prefills.seconds);
  state.counters["speedup"] = target_alone.seconds_per_token / seconds_per_token;
  state.counters["theoretical_speedup"] = theoretical_speedup(
      total.acceptance_rate(), fixed ? static_cast<double>(options.gamma) : total.drafts_per_step(), c);
  state.counters["cost_ratio_c"] = c;
}

// Seconds per token of autoregressive decoding over a whole prompt set, measured once per set.
template <Target T>
double autoregressive_seconds_per_token(T& target, std::span<const std::vector<int64_t>> prompts, int64_t new_tokens) {
  static std::map<std::pair<const void*, const void*>, double> measured;
  const auto key = std::make_pair(static_cast<const void*>(&target), static_cast<const void*>(prompts.data()));
  if (auto it = measured.find(key); it != measured.end()) return it->second;
  GenerationStats total;
  for (const auto& prompt : prompts) total += autoregressive_generate(target, prompt, {.max_new_tokens = new_tokens}).stats;
  return measured[key] = total.total_seconds / static_cast<double>(total.generated);
}

// Greedy n-gram assisted decoding (a fresh drafter from make_drafter() per prompt) against
// autoregressive decoding of the same prompts.
template <Target T, class MakeDrafter>
void measure_ngram(benchmark::State& state, MakeDrafter make_drafter, T& target,
                   std::span<const std::vector<int64_t>> prompts, int64_t new_tokens, int64_t gamma) {
  const double baseline = autoregressive_seconds_per_token(target, prompts, new_tokens);
  GenerationStats total;
  for (auto _ : state) {
    for (const auto& prompt : prompts) {
      auto drafter = make_drafter();
      total += ngram_assisted_generate(drafter, target, prompt, {.max_new_tokens = new_tokens, .gamma = gamma}).stats;
    }
  }
  const double seconds_per_token = total.total_seconds / static_cast<double>(total.generated);
  state.counters["tokens_per_second"] = 1.0 / seconds_per_token;
  state.counters["acceptance_rate"] = total.acceptance_rate();
  state.counters["tokens_per_target_call"] = total.tokens_per_target_call();
  state.counters["drafter_ms_per_step"] = 1e3 * total.drafter_seconds / static_cast<double>(total.steps);
  state.counters["speedup"] = baseline / seconds_per_token;
}

// The device the benchmarks' models run on: --device cpu (default) or cuda[:N].
inline at::Device& device() {
  static at::Device chosen(at::kCPU);
  return chosen;
}

// Weights' tensor options on the benchmarks' device.
inline at::TensorOptions on_device(at::ScalarType dtype = at::kFloat) {
  return at::TensorOptions().dtype(dtype).device(device());
}

// main() of a benchmark program: takes --device D (cpu or cuda[:N]) and --threads N (libtorch's
// and the BLAS's threads together, set_threads; default 1) besides Google Benchmark's flags, and
// runs the benchmarks with the torch version, device and thread counts recorded as context.
inline int run_benchmarks(int argc, char** argv) {
  std::vector<char*> args;
  int threads = 1;
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    std::string value;
    if (arg == "--threads" && i + 1 < argc) {
      const std::string text = argv[++i];
      if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos || text.size() > 4 ||
          std::stoi(text) < 1) {
        std::cerr << argv[0] << ": --threads must be an integer in [1, 9999], got '" << text << "'\n";
        return 2;
      }
      threads = std::stoi(text);
      continue;
    }
    if (arg == "--device" && i + 1 < argc) {
      value = argv[++i];
    } else if (arg.rfind("--device=", 0) == 0) {
      value = arg.substr(9);
    } else {
      args.push_back(argv[i]);
      continue;
    }
    try {
      device() = at::Device(value);
    } catch (const std::exception&) {
      std::cerr << argv[0] << ": --device must be cpu or cuda[:N], got " << value << "\n";
      return 2;
    }
    if (device().is_cuda() && !at::hasCUDA()) {
      std::cerr << argv[0] << ": --device " << value << ": this libtorch build sees no CUDA device\n";
      return 2;
    }
  }
  int count = static_cast<int>(args.size());
  benchmark::Initialize(&count, args.data());
  benchmark::AddCustomContext("torch", TORCH_VERSION);
  benchmark::AddCustomContext("device", device().str());
  const ThreadSettings settings = set_threads(threads);
  benchmark::AddCustomContext("threads", (std::ostringstream() << settings).str());
  // The CPU forward's weight products: oneDNN's matmul where built in, BLAS products otherwise.
  benchmark::AddCustomContext("cpu products", detail::kOneDnnBuilt ? detail::onednn_version() : "blas");
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

// A parallel drafter's tree of depth `depth`: its chain of top tokens, the second and third
// choices at the first position and the second at the second (depth + 3 nodes; 2 at depth 1).
inline TreeTemplate parallel_tree(int64_t depth) {
  std::vector<std::vector<int64_t>> paths;
  for (int64_t d = 1; d <= depth; ++d) paths.emplace_back(static_cast<size_t>(d), 0);
  paths.push_back({1});
  if (depth > 1) paths.insert(paths.end(), {{2}, {0, 1}, {1, 0}});
  return TreeTemplate::from_paths(paths);
}

// Runs every method (anything with a `name`) `rounds` times through run(method) -> GenerationStats,
// the order reversed every other round so that no method always runs after the same one, and
// keeps each method's fastest round.
template <class Method, class Run>
std::map<std::string, GenerationStats> best_of_rounds(const std::vector<Method>& methods, int rounds, Run&& run) {
  std::map<std::string, GenerationStats> best;
  for (int round = 0; round < rounds; ++round) {
    std::vector<Method> order = methods;
    if (round % 2 == 1) std::reverse(order.begin(), order.end());
    for (const Method& method : order) {
      const GenerationStats stats = run(method);
      auto [at, fresh] = best.try_emplace(method.name, stats);
      if (!fresh && stats.total_seconds < at->second.total_seconds) at->second = stats;
    }
  }
  return best;
}

}  // namespace specdec::bench
