// Speculative vs autoregressive decoding on the reference transformer, measured in one run, and
// the verification core alone on synthetic logits.
//
// Target: 8 layers x 512 wide (random weights). Drafters: "tiny", an unrelated 1 x 128 model (it
// almost never agrees: the cost of drafting with nothing accepted); "self1", the target's own first
// layer (a layer-skip drafter sharing the embedding and classifier); "same", the target itself
// (every draft accepted: the ceiling of acceptance, with a drafter as slow as the target).
#include <benchmark/benchmark.h>


#include <map>
#include <string>

#include "bench_support.hpp"
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
  static Model model(target_config(), models::LlamaWeights::random(target_config(), 2024, bench::on_device()));
  return model;
}

Model& drafter(const std::string& name) {
  static std::map<std::string, Model> drafters = [] {
    std::map<std::string, Model> result;
    const models::LlamaConfig tiny{.dim = 128, .hidden_dim = 344, .n_layers = 1, .n_heads = 4,
                                   .n_kv_heads = 2, .vocab_size = 4096, .max_seq_len = 512};
    result.emplace("tiny", Model(tiny, models::LlamaWeights::random(tiny, 7, bench::on_device())));
    result.emplace("self1", Model(models::truncated(target_config(), target().weights(), 1)));
    result.emplace("same", Model(target_config(), target().weights()));
    return result;
  }();
  return drafters.at(name);
}

const std::vector<std::vector<int64_t>>& prompts() {
  static const std::vector<std::vector<int64_t>> list{kPrompt};
  return list;
}

void BM_Autoregressive(benchmark::State& state) {
  bench::measure_autoregressive(state, target(), prompts(), kNewTokens);
}

void BM_Speculative(benchmark::State& state, const std::string& drafter_name) {
  bench::measure_speculative(state, drafter(drafter_name), target(), prompts(), kNewTokens, {.gamma = state.range(0)});
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

int main(int argc, char** argv) { return specdec::bench::run_benchmarks(argc, argv); }
