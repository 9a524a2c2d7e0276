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
//   BM_Floor: read_gb_per_s, the rate at which the threads read a 1 GiB buffer, each its own
//     stretch in one stream (best of 5);
//   BM_Ceiling: fp32_gmac_per_s, bf16_gmac_per_s and int16_gmac_per_s, the multiply-adds a
//     second the threads issue together with the packed loops' instruction (vfmadd231ps;
//     vdpbf16ps where the CPU has AVX512-BF16; the AVX2 loops' 8-lane vfmadd231ps on a CPU
//     without AVX-512; for int8, vpdpwssd where the CPU has AVX512-VNNI and the AVX2 loops'
//     vpmaddwd without AVX-512, two products a lane) when nothing waits on memory (best of 5);
//   BM_Forward/F/k: ms (one forward of k new tokens after 32 cached positions, best of the
//     iterations), paired_ratio (k > 1: each iteration also runs a one-token forward just before
//     its k-token one; the median over the iterations of t(k) over that t(1): where the memory's
//     speed drifts between runs, as on some virtual machines, a ratio of two bests may take them
//     from different speeds), weight_gb_per_s (the products' weight bytes over that time),
//     floor_fraction (weight_gb_per_s over read_gb_per_s) and mac_fraction (the products'
//     k x weights multiply-adds over that time, over BM_Ceiling's rate for the format): a
//     forward is bound by the memory where floor_fraction nears 1, by the arithmetic where
//     mac_fraction does;
//   BM_Generate/F/gamma: tokens_per_second of greedy decoding (gamma 0: autoregressive; else
//     speculative with the drafter in the same format), acceptance_rate, tokens_per_target_call,
//     target_ms_per_call.
//   BM_TreeVsChain/F: the drafter's chains (gamma 3 to 6) against its dynamic trees of 4, 5, 6, 8
//     and 16 nodes, with the default options (depth 5, top_k 4, score_temperature 1: treeN) and
//     with those that accepted most for llama2xs on bench_trees' calibration prompts (depth 8,
//     top_k 4, 0.5: calN), greedy, 64 tokens on each of four story openings (encoded with
//     SPECDEC_MODELS_DIR's stories260K tokenizer where set, else the one opening above), in
//     alternating rounds (SPECDEC_BENCH_ROUNDS, default 2; each method's best round counts): for
//     each method tokens/s (_tps), tokens per target call (_tpc) and the target's milliseconds
//     per call (_ms); best_chain_tps, best_tree_tps and their ratio tree_over_chain. Not in
//     scripts/bench-llamacpp.sh's run (it takes minutes per format).
//   BM_ParallelVsChain/F: a parallel drafter (SPECDEC_BENCH_PARALLEL: a folder of
//     io::load_parallel_drafter's layout; for the widened stories260K, models/stories260K/pard,
//     which computes for it what it computes for stories260K) against the drafter's chains and
//     autoregressive decoding, greedy, 64 tokens on each story opening, alternating rounds as
//     BM_TreeVsChain: autoregressive (ar), the drafter's chains (chain3..5), the parallel
//     drafter's chains (par3..6: one drafter forward a step) and its static trees (ptree4, ptree5:
//     the chain of that depth, the second and third choices at the first position and the second
//     at the second). Per method _tps, _tpc, _ms, and _dms (the drafter's milliseconds per step);
//     best_chain_tps, best_parallel_tps, parallel_over_chain, parallel_over_ar.
#include <benchmark/benchmark.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "specdec/drafting/dynamic_tree.hpp"
#include "specdec/drafting/parallel.hpp"
#include "specdec/generate.hpp"
#include "specdec/io/checkpoint.hpp"
#include "specdec/io/parallel_drafter.hpp"
#include "specdec/io/tokenizer.hpp"
#include "specdec/models/llama.hpp"
#include "specdec/threads.hpp"
#include "bench_support.hpp"
#include "story_openings.hpp"

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

// A parallel drafter's folder (where SPECDEC_BENCH_PARALLEL names one) loads with its mask token.
Model& load(Loaded& slot, const std::string& path, int format, int64_t* mask_token = nullptr) {
  if (slot.model && slot.path == path && slot.format == format) return *slot.model;
  slot.model.reset();
  const at::ScalarType dtype = format == 2 ? at::kBFloat16 : at::kFloat;
  if (mask_token != nullptr) {
    const io::ParallelDrafterCheckpoint checkpoint = io::load_parallel_drafter(path, at::TensorOptions().dtype(dtype));
    slot.model = std::make_unique<Model>(checkpoint.config, checkpoint.weights);
    *mask_token = checkpoint.mask_token;
  } else {
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

// The parallel drafter and its mask token.
Model& parallel_drafter(int format, int64_t* mask_token) {
  static Loaded slot;
  static int64_t mask = -1;
  Model& model = load(slot, setting("SPECDEC_BENCH_PARALLEL"), format, &mask);
  *mask_token = mask;
  return model;
}

// Weights (multiply-adds per token) of a forward's products.
double product_elements(const Model& model) {
  const models::LlamaConfig& c = model.config();
  return static_cast<double>(c.n_layers * (c.dim * (c.dim + 2 * c.kv_dim()) + c.dim * c.dim + 3 * c.dim * c.hidden_dim) +
                             c.vocab_size * c.dim);
}

// Bytes of the weight products a forward reads in `format`.
double product_bytes(const Model& model, int format) {
  return product_elements(model) * (format == 3 ? 1.0 : format == 2 ? 2.0 : 4.0);
}

double& read_rate() {
  static double rate = [] {
    // Each of the intra-op threads reads its own stretch of the buffer in one sequential stream,
    // as the packed products do, OR-ing 64-bit words (vectorised, a few instructions per cache
    // line: the memory, not the arithmetic, bounds it). A float sum through ATen read at about 60%
    // of the rate a forward's products reached on this project's AMD EPYC, so forwards read
    // "above the floor".
    const at::Tensor buffer = at::ones({int64_t{1} << 27}, at::kLong);  // 1 GiB
    const auto* words = buffer.data_ptr<int64_t>();
    double best = 1e30;
    for (int i = 0; i < 6; ++i) {
      std::atomic<uint64_t> seen{0};
      const auto start = Clock::now();
      at::parallel_for(0, buffer.numel(), int64_t{1} << 20, [&](int64_t begin, int64_t end) {
        uint64_t bits = 0;
        for (int64_t w = begin; w < end; ++w) bits |= static_cast<uint64_t>(words[w]);
        seen.fetch_or(bits);
      });
      benchmark::DoNotOptimize(seen.load());
      if (i > 0) best = std::min(best, std::chrono::duration<double>(Clock::now() - start).count());
    }
    return static_cast<double>(buffer.nbytes()) / best / 1e9;
  }();
  return rate;
}

#ifdef SPECDEC_X86_KERNELS
// One thread's multiply-adds with nothing waiting on memory: `steps` rounds of 16 independent
// sums (more than the instruction's latency needs) by the packed loops' instruction: vfmadd231ps
// (16 multiply-adds; the fp32 and int8 loops, and bf16 widened) or vdpbf16ps (32).
SPECDEC_TARGET_AVX512 float lane_total(const __m512 (&sums)[16]) {
  __m512 all = sums[0];
  for (int i = 1; i < 16; ++i) all = _mm512_add_ps(all, sums[i]);
  float lanes[16];
  _mm512_storeu_ps(lanes, all);
  float total = 0;
  for (const float lane : lanes) total += lane;
  return total;
}

SPECDEC_TARGET_AVX512 float fma_rounds(int64_t steps) {
  __m512 sums[16];
  for (auto& sum : sums) sum = _mm512_setzero_ps();
  __m512 a = _mm512_set1_ps(1e-3F);
  const __m512 b = _mm512_set1_ps(1.0F);
  for (int64_t i = 0; i < steps; ++i) {
#pragma GCC unroll 16
    for (auto& sum : sums) sum = _mm512_fmadd_ps(a, b, sum);
    asm volatile("" : "+v"(a));  // a stays an opaque register: nothing folds the rounds
  }
  return lane_total(sums);
}

// fma_rounds for the AVX2 loops: vfmadd231ps on 8 lanes, 12 independent sums (the loops keep 12
// in registers).
SPECDEC_TARGET_AVX2 float fma_rounds_avx2(int64_t steps) {
  __m256 sums[12];
  for (auto& sum : sums) sum = _mm256_setzero_ps();
  __m256 a = _mm256_set1_ps(1e-3F);
  const __m256 b = _mm256_set1_ps(1.0F);
  for (int64_t i = 0; i < steps; ++i) {
#pragma GCC unroll 12
    for (auto& sum : sums) sum = _mm256_fmadd_ps(a, b, sum);
    asm volatile("" : "+x"(a));
  }
  __m256 all = sums[0];
  for (int i = 1; i < 12; ++i) all = _mm256_add_ps(all, sums[i]);
  float lanes[8];
  _mm256_storeu_ps(lanes, all);
  float total = 0;
  for (const float lane : lanes) total += lane;
  return total;
}

// The int8 loops' instruction where the CPU has AVX512-VNNI: vpdpwssd (16 lanes, two int16
// products each) into 16 independent int32 sums.
SPECDEC_TARGET_AVX512_VNNI float dpwssd_rounds(int64_t steps) {
  __m512i sums[16];
  for (auto& sum : sums) sum = _mm512_setzero_si512();
  __m512i a = _mm512_set1_epi32(0x00030002);
  const __m512i b = _mm512_set1_epi32(0x00010001);
  for (int64_t i = 0; i < steps; ++i) {
#pragma GCC unroll 16
    for (auto& sum : sums) sum = _mm512_dpwssd_epi32(sum, a, b);
    asm volatile("" : "+v"(a));
  }
  __m512i all = sums[0];
  for (int i = 1; i < 16; ++i) all = _mm512_add_epi32(all, sums[i]);
  alignas(64) int32_t lanes[16];
  _mm512_store_si512(lanes, all);
  float total = 0;
  for (const int32_t lane : lanes) total += static_cast<float>(lane);
  return total;
}

// The int8 loops' instruction on a CPU without AVX-512: vpmaddwd (8 lanes, two int16 products
// each) added into 12 independent int32 sums.
SPECDEC_TARGET_AVX2 float madd_rounds_avx2(int64_t steps) {
  __m256i sums[12];
  for (auto& sum : sums) sum = _mm256_setzero_si256();
  __m256i a = _mm256_set1_epi32(0x00030002);
  const __m256i b = _mm256_set1_epi32(0x00010001);
  for (int64_t i = 0; i < steps; ++i) {
#pragma GCC unroll 12
    for (auto& sum : sums) sum = _mm256_add_epi32(sum, _mm256_madd_epi16(a, b));
    asm volatile("" : "+x"(a));
  }
  __m256i all = sums[0];
  for (int i = 1; i < 12; ++i) all = _mm256_add_epi32(all, sums[i]);
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), all);
  float total = 0;
  for (const int32_t lane : lanes) total += static_cast<float>(lane);
  return total;
}

SPECDEC_TARGET_AVX512_BF16 float dot_rounds(int64_t steps) {
  __m512 sums[16];
  for (auto& sum : sums) sum = _mm512_setzero_ps();
  __m512i a = _mm512_set1_epi32(0x3A833A83);        // bf16 pairs of about 1e-3
  const __m512i b = _mm512_set1_epi32(0x3F803F80);  // pairs of 1
  for (int64_t i = 0; i < steps; ++i) {
#pragma GCC unroll 16
    for (auto& sum : sums) sum = _mm512_dpbf16_ps(sum, (__m512bh)a, (__m512bh)b);
    asm volatile("" : "+v"(a));
  }
  return lane_total(sums);
}
#endif

// Multiply-adds a second that all the intra-op threads issue together with the instruction the
// packed loops of `format` run (best of 5 after a warm-up): the arithmetic ceiling of a forward,
// as read_rate is its memory floor. On a CPU without AVX-512, the AVX2 loops' vfmadd231ps (every
// format: bf16 widened); 0 where the CPU has neither (the portable loops: none measured).
double arithmetic_rate(int format) {
  // fp32 multiply-adds, bf16 dot products, int16 pair products (the int8 loops: vpdpwssd where
  // the CPU has AVX512-VNNI, else the AVX2 loops' vpmaddwd; none measured for AVX-512 without
  // VNNI)
  static const std::array<double, 3> rates = [] {
    std::array<double, 3> measured{0, 0, 0};
#ifdef SPECDEC_X86_KERNELS
    const bool avx512 = specdec::detail::cpu_has_avx512();
    if (!avx512 && !specdec::detail::cpu_has_avx2_fma()) return measured;
    const int64_t threads = at::get_num_threads(), steps = int64_t{1} << 21;
    for (int kind = 0; kind < 3; ++kind) {
      if (kind == 1 && !specdec::detail::cpu_has_avx512_bf16()) continue;
      const bool vnni = specdec::detail::cpu_has_avx512_vnni();
      if (kind == 2 && avx512 && !vnni) continue;
      double best = 1e30;
      for (int i = 0; i < 6; ++i) {
        std::atomic<float> seen{0};
        const auto start = Clock::now();
        at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
          for (int64_t t = begin; t < end; ++t) {
            seen.store(kind == 2   ? (vnni ? dpwssd_rounds(steps) : madd_rounds_avx2(steps))
                       : kind == 1 ? dot_rounds(steps)
                       : avx512    ? fma_rounds(steps)
                                   : fma_rounds_avx2(steps));
          }
        });
        benchmark::DoNotOptimize(seen.load());
        if (i > 0) best = std::min(best, std::chrono::duration<double>(Clock::now() - start).count());
      }
      // multiply-adds a step: sums times lanes (times two for the pair products)
      const double per_step = kind == 2   ? (vnni ? 16.0 * 32.0 : 12.0 * 16.0)
                              : kind == 1 ? 16.0 * 32.0
                              : avx512    ? 16.0 * 16.0
                                          : 12.0 * 8.0;
      measured[static_cast<size_t>(kind)] = static_cast<double>(threads * steps) * per_step / best;
    }
#endif
    return measured;
  }();
  if (format == 3) return rates[2];
  return format == 2 && rates[1] > 0 ? rates[1] : rates[0];
}

// Token ids of a story's opening (stories260K's tokenizer: "Once upon a time, there was a"),
// taken modulo a smaller vocabulary (the smoke test's bundled pair).
std::vector<int64_t> prompt_for(const Model& model) {
  std::vector<int64_t> prompt{1, 403, 407, 261, 378, 432, 383, 286, 261};
  for (int64_t& token : prompt) token %= model.vocab_size();
  return prompt;
}

// SPECDEC_BENCH_ROUNDS (default 2): the alternating rounds of BM_TreeVsChain and BM_ParallelVsChain.
// Anything but a whole number in [1, 1000] is refused, naming the setting and its value.
int rounds_asked() {
  const std::string value = setting("SPECDEC_BENCH_ROUNDS");
  if (value.empty()) return 2;
  int rounds = 0;
  const auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), rounds);
  if (error != std::errc() || end != value.data() + value.size() || rounds < 1 || rounds > 1000) {
    throw std::invalid_argument("SPECDEC_BENCH_ROUNDS must be a whole number in [1, 1000], got '" + value + "'");
  }
  return rounds;
}

bool have_models(benchmark::State& state, bool need_drafter) {
  if (setting("SPECDEC_BENCH_TARGET").empty() || (need_drafter && setting("SPECDEC_BENCH_DRAFTER").empty())) {
    state.SkipWithError("set SPECDEC_BENCH_TARGET (and SPECDEC_BENCH_DRAFTER): scripts/bench-llamacpp.sh does");
    return false;
  }
  return true;
}

// Sets a method's tokens/s, tokens per target call and ms per target call; returns its tokens/s.
double method_counters(benchmark::State& state, const std::string& name, const GenerationStats& stats) {
  const double rate = static_cast<double>(stats.generated) / stats.total_seconds;
  state.counters[name + "_tps"] = rate;
  state.counters[name + "_tpc"] = stats.tokens_per_target_call();
  state.counters[name + "_ms"] = 1e3 * stats.target_seconds / static_cast<double>(stats.target_calls);
  return rate;
}

void BM_Floor(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(read_rate());
  state.counters["read_gb_per_s"] = read_rate();
}

void BM_Ceiling(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(arithmetic_rate(1));
  state.counters["fp32_gmac_per_s"] = arithmetic_rate(1) / 1e9;
  state.counters["bf16_gmac_per_s"] = arithmetic_rate(2) / 1e9;
  state.counters["int16_gmac_per_s"] = arithmetic_rate(3) / 1e9;
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
  const at::Tensor one = ids.narrow(1, 0, 1);
  (void)model.forward(ids, cache);  // warm-up
  cache.prune(k);
  const auto timed = [&](const at::Tensor& tokens) {
    const auto start = Clock::now();
    benchmark::DoNotOptimize(model.forward(tokens, cache).data_ptr());
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    cache.prune(tokens.size(1));
    return seconds;
  };
  double best = 1e30;
  std::vector<double> ratios;  // k > 1: t(k) over the one-token forward just before it
  for (auto _ : state) {
    const double first = k > 1 ? timed(one) : 0.0;
    const double seconds = timed(ids);
    best = std::min(best, seconds);
    if (k > 1) ratios.push_back(seconds / first);
  }
  if (!ratios.empty()) {
    std::sort(ratios.begin(), ratios.end());
    state.counters["paired_ratio"] = ratios[ratios.size() / 2];
  }
  const double rate = product_bytes(model, format) / best / 1e9;
  state.counters["ms"] = 1e3 * best;
  state.counters["weight_gb_per_s"] = rate;
  state.counters["floor_fraction"] = rate / read_rate();
  if (const double ceiling = arithmetic_rate(format); ceiling > 0) {
    state.counters["mac_fraction"] = static_cast<double>(k) * product_elements(model) / best / ceiling;
  }
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

// Four story openings in stories260K's tokenizer (the widened target's), or prompt_for's one
// where SPECDEC_MODELS_DIR is not set.
std::vector<std::vector<int64_t>> story_prompts(const Model& model) {
  const std::string folder = setting("SPECDEC_MODELS_DIR");
  const std::filesystem::path file = std::filesystem::path(folder) / "stories260K/tok512.bin";
  if (folder.empty() || !std::filesystem::exists(file) || model.vocab_size() != 512) return {prompt_for(model)};
  const auto tokenizer = io::Llama2cTokenizer::load(file, 512);
  std::vector<std::vector<int64_t>> prompts;
  for (const char* text : bench::kStoryOpenings) prompts.push_back(tokenizer.encode(text));
  return prompts;
}

void BM_TreeVsChain(benchmark::State& state) {
  if (!have_models(state, true)) return;
  const int format = static_cast<int>(state.range(0));
  Model& t = target(format);
  Model& d = drafter(format);
  const std::vector<std::vector<int64_t>> prompts = story_prompts(t);
  const int rounds = rounds_asked();
  // A chain of `size` drafts (tree unset), or a dynamic tree of `size` nodes.
  struct Method {
    std::string name;
    int64_t size = 0;
    std::optional<DynamicTreeOptions> tree;
  };
  std::vector<Method> methods;
  for (const int64_t gamma : {3, 4, 5, 6}) methods.push_back({"chain" + std::to_string(gamma), gamma, {}});
  for (const int64_t nodes : {4, 5, 6, 8, 16}) {
    methods.push_back({"tree" + std::to_string(nodes), nodes, DynamicTreeOptions{.total_tokens = nodes}});
    methods.push_back({"cal" + std::to_string(nodes), nodes,
                       DynamicTreeOptions{.depth = 8, .top_k = 4, .total_tokens = nodes, .score_temperature = 0.5}});
  }
  const auto run = [&](const Method& method) {
    GenerationStats stats;
    for (const auto& prompt : prompts) {
      const SpeculativeOptions options{.max_new_tokens = 64, .gamma = method.size};
      if (!method.tree) {
        stats += speculative_generate(d, t, prompt, options).stats;
      } else {
        DynamicTreeSource source(d, *method.tree);
        stats += generate_with(source, t, prompt, options).stats;
      }
    }
    return stats;
  };
  (void)run(methods.front());  // warm-up: both models' first forwards
  (void)run(methods.back());
  std::map<std::string, GenerationStats> best;
  for (auto _ : state) best = bench::best_of_rounds(methods, rounds, run);
  double best_chain = 0, best_tree = 0;
  for (const Method& method : methods) {
    const GenerationStats& stats = best.at(method.name);
    const double rate = method_counters(state, method.name, stats);
    double& best_of_kind = method.tree ? best_tree : best_chain;
    best_of_kind = std::max(best_of_kind, rate);
  }
  state.counters["best_chain_tps"] = best_chain;
  state.counters["best_tree_tps"] = best_tree;
  state.counters["tree_over_chain"] = best_tree / best_chain;
  state.SetLabel(kFormatNames[format]);
}

void BM_ParallelVsChain(benchmark::State& state) {
  if (!have_models(state, true)) return;
  if (setting("SPECDEC_BENCH_PARALLEL").empty()) {
    return state.SkipWithError("set SPECDEC_BENCH_PARALLEL to a parallel drafter's folder (models/stories260K/pard)");
  }
  const int format = static_cast<int>(state.range(0));
  Model& t = target(format);
  Model& d = drafter(format);
  int64_t mask = -1;
  Model& pard = parallel_drafter(format, &mask);
  const ParallelDraftOptions parallel{.mask_token = mask, .vocab_size = t.vocab_size()};
  const std::vector<std::vector<int64_t>> prompts = story_prompts(t);
  const int rounds = rounds_asked();
  enum class Kind { autoregressive, chain, parallel, tree };
  struct Method {
    std::string name;
    Kind kind;
    int64_t gamma = 0;
  };
  std::vector<Method> methods{{"ar", Kind::autoregressive}};
  for (const int64_t gamma : {3, 4, 5}) methods.push_back({"chain" + std::to_string(gamma), Kind::chain, gamma});
  for (const int64_t gamma : {3, 4, 5, 6}) methods.push_back({"par" + std::to_string(gamma), Kind::parallel, gamma});
  for (const int64_t depth : {4, 5}) methods.push_back({"ptree" + std::to_string(depth), Kind::tree, depth});
  const auto run = [&](const Method& method) {
    GenerationStats stats;
    for (const auto& prompt : prompts) {
      const SpeculativeOptions options{.max_new_tokens = 64, .gamma = std::max<int64_t>(1, method.gamma)};
      switch (method.kind) {
        case Kind::autoregressive: stats += autoregressive_generate(t, prompt, {.max_new_tokens = 64}).stats; break;
        case Kind::chain: stats += speculative_generate(d, t, prompt, options).stats; break;
        case Kind::parallel: {
          ParallelDraftSource source(pard, parallel);
          stats += generate_with(source, t, prompt, options).stats;
          break;
        }
        case Kind::tree: {
          ParallelTreeSource source(pard, parallel, bench::parallel_tree(method.gamma));
          stats += generate_with(source, t, prompt, options).stats;
          break;
        }
      }
    }
    return stats;
  };
  for (const Method& method : methods) (void)run(method);  // warm-up: every shape's first forwards
  std::map<std::string, GenerationStats> best;
  for (auto _ : state) best = bench::best_of_rounds(methods, rounds, run);
  double best_chain = 0, best_parallel = 0, ar = 0;
  for (const Method& method : methods) {
    const GenerationStats& stats = best.at(method.name);
    const double rate = method_counters(state, method.name, stats);
    state.counters[method.name + "_dms"] = 1e3 * stats.drafter_seconds / static_cast<double>(stats.steps);
    if (method.kind == Kind::autoregressive) ar = rate;
    if (method.kind == Kind::chain) best_chain = std::max(best_chain, rate);
    if (method.kind == Kind::parallel || method.kind == Kind::tree) best_parallel = std::max(best_parallel, rate);
  }
  state.counters["best_chain_tps"] = best_chain;
  state.counters["best_parallel_tps"] = best_parallel;
  state.counters["parallel_over_chain"] = best_parallel / best_chain;
  state.counters["parallel_over_ar"] = best_parallel / ar;
  state.SetLabel(kFormatNames[format]);
}

}  // namespace

// Each format's benchmarks together, so that each model loads once per run.
void register_benchmarks() {
  benchmark::RegisterBenchmark("BM_Floor", BM_Floor)->Iterations(1);
  benchmark::RegisterBenchmark("BM_Ceiling", BM_Ceiling)->Iterations(1);
  for (int format = 0; format < 4; ++format) {
    for (int64_t k = 1; k <= 9; ++k) {
      benchmark::RegisterBenchmark("BM_Forward", BM_Forward)->Args({format, k})->Iterations(5);
    }
    for (const int64_t gamma : {0, 1, 2, 3, 4, 5, 6, 8}) {
      benchmark::RegisterBenchmark("BM_Generate", BM_Generate)->Args({format, gamma})->Iterations(1);
    }
    benchmark::RegisterBenchmark("BM_TreeVsChain", BM_TreeVsChain)->Args({format})->Iterations(1);
    benchmark::RegisterBenchmark("BM_ParallelVsChain", BM_ParallelVsChain)->Args({format})->Iterations(1);
  }
}

// --threads N (default 1) and Google Benchmark's flags, read by bench::run_benchmarks. The models
// load on the CPU, so --device is refused rather than ignored.
int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]).starts_with("--device")) {
      std::cerr << argv[0] << ": --device is not taken: this benchmark measures the CPU forward\n";
      return 2;
    }
  }
  try {
    (void)rounds_asked();  // a bad SPECDEC_BENCH_ROUNDS ends the run before any benchmark
  } catch (const std::invalid_argument& error) {
    std::cerr << argv[0] << ": " << error.what() << "\n";
    return 2;
  }
  register_benchmarks();
  return bench::run_benchmarks(argc, argv);
}
