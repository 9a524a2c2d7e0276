// Speculative vs autoregressive decoding on the reference transformer, measured in one run, and
// the verification core alone on synthetic logits.
//
// Target: 8 layers x 512 wide (random weights). Drafters: "tiny", an unrelated 1 x 128 model (it
// almost never agrees: the cost of drafting with nothing accepted); "self1", the target's own first
// layer (a layer-skip drafter sharing the embedding and classifier); "same", the target itself
// (every draft accepted: the ceiling of acceptance, with a drafter as slow as the target).
#include <benchmark/benchmark.h>

#include <ATen/Parallel.h>
#include <torch/version.h>

#include <cmath>
#include <map>
#include <string>

#include "specdec/models/llama.hpp"
#include "specdec/specdec.hpp"

namespace {

using namespace specdec;
using Model = models::LlamaModel<StaticKVCache>;

constexpr int64_t kNewTokens = 64;
const std::vector<int64_t> kPrompt{1, 42, 314, 1592, 653, 7, 99, 1000};

const models::LlamaConfig& target_config() {
  static const models::LlamaConfig config{.dim = 512, .hidden_dim = 1376, .n_layers = 8,
                                          .n_heads = 8, .n_kv_heads = 4, .vocab_size = 4096,
                                          .max_seq_len = 512};
  return config;
}

Model& target() {
  static Model model(target_config(), models::LlamaWeights::random(target_config(), 2024));
  return model;
}

Model& drafter(const std::string& name) {
  static std::map<std::string, Model> drafters = [] {
    std::map<std::string, Model> result;
    const models::LlamaConfig tiny{.dim = 128, .hidden_dim = 344, .n_layers = 1, .n_heads = 4,
                                   .n_kv_heads = 2, .vocab_size = 4096, .max_seq_len = 512};
    result.emplace("tiny", Model(tiny, models::LlamaWeights::random(tiny, 7)));
    result.emplace("self1", Model(models::truncated(target_config(), target().weights(), 1)));
    result.emplace("same", Model(target_config(), target().weights()));
    return result;
  }();
  return drafters.at(name);
}

// Seconds per generated token and per forward of a model, measured once per process.
struct Baseline {
  double seconds_per_token;
  double seconds_per_call;
};
Baseline autoregressive_baseline(Model& model) {
  static std::map<const Model*, Baseline> cache;
  if (auto it = cache.find(&model); it != cache.end()) return it->second;
  (void)autoregressive_generate(model, kPrompt, {.max_new_tokens = 8});  // warm-up
  double seconds = 0;
  int64_t tokens = 0, calls = 0;
  double call_seconds = 0;
  for (int i = 0; i < 3; ++i) {
    const auto result = autoregressive_generate(model, kPrompt, {.max_new_tokens = kNewTokens});
    seconds += result.stats.total_seconds;
    tokens += result.stats.generated;
    calls += result.stats.target_calls;
    call_seconds += result.stats.target_seconds;
  }
  return cache[&model] = Baseline{seconds / tokens, call_seconds / calls};
}

void context(benchmark::State& state) {
  state.SetLabel("threads=" + std::to_string(at::get_num_threads()));
}

void BM_Autoregressive(benchmark::State& state) {
  context(state);
  GenerationStats stats;
  int64_t tokens = 0;
  for (auto _ : state) {
    stats = autoregressive_generate(target(), kPrompt, {.max_new_tokens = kNewTokens}).stats;
    tokens += stats.generated;
  }
  state.counters["tokens_per_second"] = benchmark::Counter(static_cast<double>(tokens), benchmark::Counter::kIsRate);
  state.counters["target_ms_per_call"] = 1e3 * stats.target_seconds / stats.target_calls;
  state.counters["library_ms_per_step"] = 1e3 * stats.library_seconds() / stats.steps;
}

void BM_Speculative(benchmark::State& state, const std::string& drafter_name) {
  context(state);
  const int64_t gamma = state.range(0);
  Model& draft_model = drafter(drafter_name);
  const Baseline target_baseline = autoregressive_baseline(target());
  const Baseline drafter_baseline = autoregressive_baseline(draft_model);
  GenerationStats total;
  for (auto _ : state) {
    const auto stats = speculative_generate(draft_model, target(), kPrompt,
                                            {.max_new_tokens = kNewTokens, .gamma = gamma})
                           .stats;
    total.generated += stats.generated;
    total.drafted += stats.drafted;
    total.accepted += stats.accepted;
    total.steps += stats.steps;
    total.target_calls += stats.target_calls;
    total.total_seconds += stats.total_seconds;
    total.target_seconds += stats.target_seconds;
    total.drafter_seconds += stats.drafter_seconds;
  }
  const double alpha = total.acceptance_rate();
  const double c = drafter_baseline.seconds_per_call / target_baseline.seconds_per_call;
  const double g = static_cast<double>(gamma);
  // Expected speedup of Leviathan et al. (2023): (1 - a^(g+1)) / ((1 - a)(g c + 1)).
  const double theoretical = alpha >= 1.0 ? (g + 1) / (g * c + 1)
                                          : (1 - std::pow(alpha, g + 1)) / ((1 - alpha) * (g * c + 1));
  const double seconds_per_token = total.total_seconds / static_cast<double>(total.generated);
  state.counters["tokens_per_second"] = 1.0 / seconds_per_token;
  state.counters["acceptance_rate"] = alpha;
  state.counters["tokens_per_target_call"] = total.tokens_per_target_call();
  state.counters["target_ms_per_call"] = 1e3 * total.target_seconds / total.target_calls;
  state.counters["library_ms_per_step"] = 1e3 * total.library_seconds() / total.steps;
  state.counters["speedup"] = target_baseline.seconds_per_token / seconds_per_token;
  state.counters["theoretical_speedup"] = theoretical;
  state.counters["cost_ratio_c"] = c;
}

BENCHMARK(BM_Autoregressive)->Unit(benchmark::kMillisecond)->Iterations(3);
BENCHMARK_CAPTURE(BM_Speculative, tiny, std::string("tiny"))
    ->DenseRange(1, 8)->Unit(benchmark::kMillisecond)->Iterations(3);
BENCHMARK_CAPTURE(BM_Speculative, self1, std::string("self1"))
    ->DenseRange(1, 8)->Unit(benchmark::kMillisecond)->Iterations(3);
BENCHMARK_CAPTURE(BM_Speculative, same, std::string("same"))
    ->DenseRange(1, 8)->Unit(benchmark::kMillisecond)->Iterations(3);

// The verification core alone: gamma = 5 drafts against a 32000-token vocabulary.
template <class P>
void BM_VerifyDrafts(benchmark::State& state, const P& processor) {
  constexpr int64_t kGamma = 5, kVocab = 32000;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1);
  const at::Tensor p = processor(at::randn({kGamma + 1, kVocab}, gen));
  const at::Tensor q = processor(at::randn({kGamma, kVocab}, gen));
  const at::Tensor drafts = processor.sample(q, gen).view({kGamma});
  for (auto _ : state) {
    benchmark::DoNotOptimize(verify_drafts(p, q, drafts, processor, gen));
  }
  state.counters["drafts_per_second"] =
      benchmark::Counter(static_cast<double>(kGamma), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK_CAPTURE(BM_VerifyDrafts, greedy, GreedyProcessor{})->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_VerifyDrafts, multinomial, MultinomialProcessor{1.0})->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_VerifyDrafts, top_k_nucleus, TopKNucleusProcessor(50, 0.9))->Unit(benchmark::kMicrosecond);

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  benchmark::AddCustomContext("torch", TORCH_VERSION);
  benchmark::AddCustomContext("device", "cpu");
  benchmark::AddCustomContext("torch_threads", std::to_string(at::get_num_threads()));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
}
