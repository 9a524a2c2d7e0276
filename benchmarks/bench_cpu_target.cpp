// bench_cpu_target: a target larger than the CPU's caches, as a user with a real model sees it:
// the forward's cost for k new tokens (t(k), a verification of k - 1 drafts), autoregressive and
// speculative decoding, in each weight format of the CPU forward, beside this machine's memory
// floor (a forward cannot read its weights faster than the memory streams them).
//
//   export SPECDEC_BENCH_TARGET=w1b.bin SPECDEC_BENCH_DRAFTER=llama2xs/model.bin
//   bench_cpu_target --threads 2 [google benchmark flags]
//
// scripts/bench-llamacpp.sh makes the target (stories260K widened to TinyLlama-1.1B's shape,
// ../shared/benchmarks) and runs this program alternately with llama.cpp on the same models.
//
// Weight formats (the second argument of each benchmark): 0 unpacked fp32 (oneDNN or BLAS
// products, the measured faster), 1 packed fp32, 2 packed bf16 (the checkpoint loaded as
// bfloat16), 3 packed int8 (from the fp32 checkpoint). Counters:
//   BM_Floor: read_gb_per_s, the rate at which two passes over a 1 GiB buffer stream (best of 5);
//   BM_Forward/F/k: ms (one forward of k new tokens after 32 cached positions, best of the
//     iterations), weight_gb_per_s (the products' weight bytes over that time) and
//     floor_fraction (weight_gb_per_s over read_gb_per_s);
//   BM_Generate/F/gamma: tokens_per_second of greedy decoding (gamma 0: autoregressive; else
//     speculative with the drafter in the same format), acceptance_rate, tokens_per_target_call,
//     target_ms_per_call.
#include <benchmark/benchmark.h>

#include <ATen/Parallel.h>

#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "specdec/generate.hpp"
#include "specdec/io/checkpoint.hpp"
#include "specdec/models/llama.hpp"
#include "specdec/threads.hpp"

namespace {

using namespace specdec;
using Model = models::LlamaModel<StaticKVCache>;
using Clock = std::chrono::steady_clock;

constexpr const char* kFormatNames[] = {"unpacked_fp32", "packed_fp32", "packed_bf16", "packed_int8"};

std::string setting(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr ? std::string() : std::string(value);
}

// One model at a time in memory (a 1B target in fp32 is 4 GB): the last one asked for.
struct Loaded {
  std::string path;
  int format = -1;
  std::unique_ptr<Model> model;
};

Model& load(Loaded& slot, const std::string& path, int format) {
  if (slot.model && slot.path == path && slot.format == format) return *slot.model;
  slot.model.reset();
  const at::ScalarType dtype = format == 2 ? at::kBFloat16 : at::kFloat;
  {
    const io::LlamaCheckpoint checkpoint = io::load_llama(path, at::TensorOptions().dtype(dtype));
    slot.model = std::make_unique<Model>(checkpoint.config, checkpoint.weights);
  }  // the checkpoint's tensors go: packing then releases the only other copy
  if (format == 1) slot.model->pack_weights(specdec::detail::WeightFormat::f32);
  if (format == 2) slot.model->pack_weights(specdec::detail::WeightFormat::bf16);
  if (format == 3) slot.model->pack_weights(specdec::detail::WeightFormat::i8);
  slot.path = path;
  slot.format = format;
  return *slot.model;
}

Model& target(int format) {
  static Loaded slot;
  return load(slot, setting("SPECDEC_BENCH_TARGET"), format);
}

Model& drafter(int format) {
  static Loaded slot;
  return load(slot, setting("SPECDEC_BENCH_DRAFTER"), format);
}

// Bytes of the weight products a forward reads in `format`.
double product_bytes(const Model& model, int format) {
  const models::LlamaConfig& c = model.config();
  const double elements = static_cast<double>(
      c.n_layers * (c.dim * (c.dim + 2 * c.kv_dim()) + c.dim * c.dim + 3 * c.dim * c.hidden_dim) + c.vocab_size * c.dim);
  return elements * (format == 3 ? 1.0 : format == 2 ? 2.0 : 4.0);
}

double& read_rate() {
  static double rate = [] {
    const at::Tensor buffer = at::ones({int64_t{1} << 28});  // 1 GiB of fp32
    double best = 1e30;
    for (int i = 0; i < 6; ++i) {
      const auto start = Clock::now();
      benchmark::DoNotOptimize(buffer.sum().item<float>());
      if (i > 0) best = std::min(best, std::chrono::duration<double>(Clock::now() - start).count());
    }
    return static_cast<double>(buffer.nbytes()) / best / 1e9;
  }();
  return rate;
}

// Token ids of a story's opening (stories260K's tokenizer: "Once upon a time, there was a"),
// taken modulo a smaller vocabulary (the smoke test's bundled pair).
std::vector<int64_t> prompt_for(const Model& model) {
  std::vector<int64_t> prompt{1, 403, 407, 261, 378, 432, 383, 286, 261};
  for (int64_t& token : prompt) token %= model.vocab_size();
  return prompt;
}

bool have_models(benchmark::State& state, bool need_drafter) {
  if (setting("SPECDEC_BENCH_TARGET").empty() || (need_drafter && setting("SPECDEC_BENCH_DRAFTER").empty())) {
    state.SkipWithError("set SPECDEC_BENCH_TARGET (and SPECDEC_BENCH_DRAFTER): scripts/bench-llamacpp.sh does");
    return false;
  }
  return true;
}

void BM_Floor(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(read_rate());
  state.counters["read_gb_per_s"] = read_rate();
}

void BM_Forward(benchmark::State& state) {
  if (!have_models(state, false)) return;
  const int format = static_cast<int>(state.range(0));
  const int64_t k = state.range(1);
  Model& model = target(format);
  c10::InferenceMode inference;
  auto cache = model.make_cache(1);
  const int64_t context = 32;
  (void)model.forward(at::randint(3, model.vocab_size(), {1, context}, at::kLong), cache);
  const at::Tensor ids = at::randint(3, model.vocab_size(), {1, k}, at::kLong);
  (void)model.forward(ids, cache);  // warm-up
  cache.prune(k);
  double best = 1e30;
  for (auto _ : state) {
    const auto start = Clock::now();
    benchmark::DoNotOptimize(model.forward(ids, cache).data_ptr());
    best = std::min(best, std::chrono::duration<double>(Clock::now() - start).count());
    cache.prune(k);
  }
  const double rate = product_bytes(model, format) / best / 1e9;
  state.counters["ms"] = 1e3 * best;
  state.counters["weight_gb_per_s"] = rate;
  state.counters["floor_fraction"] = rate / read_rate();
  state.SetLabel(kFormatNames[format]);
}

void BM_Generate(benchmark::State& state) {
  const int format = static_cast<int>(state.range(0));
  const int64_t gamma = state.range(1);
  if (!have_models(state, gamma > 0)) return;
  const int64_t new_tokens = 64;
  Model& t = target(format);
  const std::vector<int64_t> prompt = prompt_for(t);
  GenerationStats total;
  for (auto _ : state) {
    if (gamma == 0) {
      total += autoregressive_generate(t, prompt, {.max_new_tokens = new_tokens}).stats;
    } else {
      Model& d = drafter(format);
      total += speculative_generate(d, t, prompt, {.max_new_tokens = new_tokens, .gamma = gamma}).stats;
    }
  }
  state.counters["tokens_per_second"] = static_cast<double>(total.generated) / total.total_seconds;
  state.counters["acceptance_rate"] = total.acceptance_rate();
  state.counters["tokens_per_target_call"] = total.tokens_per_target_call();
  state.counters["target_ms_per_call"] = 1e3 * total.target_seconds / static_cast<double>(total.target_calls);
  state.SetLabel(kFormatNames[format]);
}

}  // namespace

// Each format's benchmarks together, so that each model loads once per run.
void register_benchmarks() {
  benchmark::RegisterBenchmark("BM_Floor", BM_Floor)->Iterations(1);
  for (int format = 0; format < 4; ++format) {
    for (int64_t k = 1; k <= 9; ++k) {
      benchmark::RegisterBenchmark("BM_Forward", BM_Forward)->Args({format, k})->Iterations(5);
    }
    for (const int64_t gamma : {0, 1, 2, 3, 4, 5, 6, 8}) {
      benchmark::RegisterBenchmark("BM_Generate", BM_Generate)->Args({format, gamma})->Iterations(1);
    }
  }
}

// --threads N (default 1): libtorch's intra-op threads, before Google Benchmark reads its flags.
int main(int argc, char** argv) {
  int threads = 1;
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    if (std::string(argv[i]) == "--threads" && i + 1 < argc) {
      threads = std::atoi(argv[++i]);
    } else {
      rest.push_back(argv[i]);
    }
  }
  specdec::set_threads(std::max(1, threads));
  int count = static_cast<int>(rest.size());
  register_benchmarks();
  benchmark::Initialize(&count, rest.data());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
