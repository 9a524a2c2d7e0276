// Batched decoding: tokens per second summed over the rows of a batch, batched autoregressive
// decoding against batched speculative decoding at gamma 1, 2, 4 and 8, for batches of 1, 2, 4,
// 8 and 16 prompts, greedy, 48 new tokens per row:
//   bundled: the bundled byte-level pair (4 x 192 target, 2 x 96 drafter) on held-out Python;
//   large:   a random-weight 8 x 512 target (vocabulary 4096) whose forward is compute-bound on
//            a CPU, with its own first layer as drafter.
// speedup is against batched autoregressive decoding of the same rows at the same batch size, run
// right before the speculative run in every iteration (BM_Batch/<model>/<B>/0 is that baseline).
#include <benchmark/benchmark.h>

#include <chrono>
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
constexpr int64_t kNewTokens = 48;

struct Pair {
  std::optional<Model> target, drafter;
  std::vector<std::vector<int64_t>> prompts;  // 16 prompts
  std::string missing;
};

Pair& bundled() {
  static Pair pair = [] {
    Pair p;
    const std::filesystem::path models = SPECDEC_BUNDLED_MODELS_DIR;
    if (!std::filesystem::exists("/usr/lib/python3.11")) {
      p.missing = "the held-out text needs /usr/lib/python3.11 (Debian's libpython3.11-stdlib)";
      return p;
    }
    const auto target = io::load_llama(models / "target", bench::on_device());
    const auto drafter = io::load_llama(models / "drafter", bench::on_device());
    p.target.emplace(target.config, target.weights);
    p.drafter.emplace(drafter.config, drafter.weights);
    const io::ByteTokenizer bytes;
    for (const auto& prompt : text::line_prompts(text::load_python_corpus("/usr/lib/python3.11").held_out, 16, 120)) {
      p.prompts.push_back(bytes.encode(prompt));
    }
    return p;
  }();
  return pair;
}

Pair& large() {
  static Pair pair = [] {
    Pair p;
    const models::LlamaConfig config{.dim = 512, .hidden_dim = 1376, .n_layers = 8, .n_heads = 8,
                                     .n_kv_heads = 4, .vocab_size = 4096, .max_seq_len = 256};
    const auto weights = models::LlamaWeights::random(config, 2024, bench::on_device());
    p.target.emplace(config, weights);
    p.drafter.emplace(models::truncated(config, weights, 1));
    for (int64_t r = 0; r < 16; ++r) {
      std::vector<int64_t> prompt;
      for (int64_t i = 0; i < 8 + r % 5; ++i) prompt.push_back((97 * r + 31 * i + 5) % config.vocab_size);
      p.prompts.push_back(prompt);
    }
    return p;
  }();
  return pair;
}

// range(0): batch size; range(1): gamma, 0 for batched autoregressive decoding alone. Each
// iteration runs batched autoregressive decoding of the same rows right before the speculative
// run, and speedup compares the two (this machine's speed drifts by tens of percent over minutes).
void BM_Batch(benchmark::State& state, Pair& (*pair)()) {
  Pair& p = pair();
  if (!p.target) return state.SkipWithError(p.missing.c_str());
  const int64_t batch = state.range(0);
  const int64_t gamma = state.range(1);
  const std::span<const std::vector<int64_t>> rows(p.prompts.data(), static_cast<size_t>(batch));
  (void)autoregressive_generate_batch(*p.target, rows, {.max_new_tokens = 4});  // warm-up
  const auto timed = [](auto run, GenerationStats& total, int64_t& batch_steps) {
    const auto start = std::chrono::steady_clock::now();
    const auto results = run();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    int64_t steps = 0;
    for (const auto& result : results) {
      total += result.stats;
      steps = std::max(steps, result.stats.steps);
    }
    batch_steps += steps;
    return seconds;
  };
  double seconds = 0, baseline_seconds = 0;
  GenerationStats total, baseline_total;
  int64_t batch_steps = 0, baseline_steps = 0;
  for (auto _ : state) {
    baseline_seconds += timed([&] { return autoregressive_generate_batch(*p.target, rows, {.max_new_tokens = kNewTokens}); },
                              baseline_total, baseline_steps);
    if (gamma == 0) continue;
    seconds += timed([&] {
      return speculative_generate_batch(*p.drafter, *p.target, rows, {.max_new_tokens = kNewTokens, .gamma = gamma});
    }, total, batch_steps);
  }
  if (gamma == 0) {
    seconds = baseline_seconds;
    total = baseline_total;
    batch_steps = baseline_steps;
  }
  state.counters["tokens_per_second"] = static_cast<double>(total.generated) / seconds;
  state.counters["autoregressive_tokens_per_second"] = static_cast<double>(baseline_total.generated) / baseline_seconds;
  state.counters["speedup"] = baseline_seconds / seconds;
  state.counters["acceptance_rate"] = total.acceptance_rate();
  state.counters["tokens_per_row_step"] = static_cast<double>(total.generated) / static_cast<double>(total.steps);
  state.counters["ms_per_batch_step"] = 1e3 * seconds / static_cast<double>(batch_steps);
}

void batch_arguments(benchmark::internal::Benchmark* b) {
  for (int64_t batch : {1, 2, 4, 8, 16}) {
    for (int64_t gamma : {0, 1, 2, 4, 8}) b->Args({batch, gamma});
  }
  b->Unit(benchmark::kMillisecond);
}

BENCHMARK_CAPTURE(BM_Batch, bundled, bundled)->Apply(batch_arguments)->Iterations(4);
BENCHMARK_CAPTURE(BM_Batch, large, large)->Apply(batch_arguments)->Iterations(1);

}  // namespace

int main(int argc, char** argv) { return specdec::bench::run_benchmarks(argc, argv); }
