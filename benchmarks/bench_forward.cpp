// The reference model's forward against this machine's floor. For T = 1, 2, 3, 5 and 9 new tokens
// after a 200-position cache (the prefill is timed on its own, never in the per-forward figures),
// the bundled target's forward time beside the floor measured in the same run:
// max(weight bytes / copy bandwidth, multiply-add FLOPs / large-GEMM throughput), and their ratio.
// The floor's rates come from a 1024^3 fp32 matrix product (the faster of BLAS and, where built
// in, oneDNN) and from copying a buffer as large as the model's weights, so a performance claim compares with what this machine does, not with a
// datasheet. The weights of a small model stay in the CPU's caches between forwards, so the copy
// is measured at their size (cache_gbytes_per_s); a 256 MiB copy (dram_gbytes_per_s) is printed
// beside it for models too large for the caches.
//
// BM_Forward/T/products:0 runs the same forward with its products as BLAS products
// (use_onednn(false)), products:1 as the default does where oneDNN is built in: each product
// takes the route measured faster for its shape and row count (detail::ProductRoutes).
//
// BM_SmallLinear: the products the forward is made of, by five routes, to choose the forward's:
// one layer's four weight products of the bundled target (fused q|k|v, o, fused gate|up, down)
// for M = 1..16 rows and a 200-row prefill, as at::linear (the ATen forward), as at::mm with the
// weight transposed once beforehand, through libtorch's oneDNN (at::mkldnn_linear, weights
// converted to oneDNN's layout once; inputs converted and outputs converted back in every call,
// as a forward would), as one BLAS matrix-vector product per row (at::mv on the weight as it
// lies), and through oneDNN's matmul directly (detail::CpuLinear: one primitive per weight, made
// once, reading the transposed weight where it lies). CPU only; a oneDNN route is skipped where
// it is not available.
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <chrono>
#include <utility>
#include <vector>

#include "bench_support.hpp"
#include "specdec/io/checkpoint.hpp"
#include "specdec/models/llama.hpp"

namespace {

using namespace specdec;
using Clock = std::chrono::steady_clock;
using Model = models::LlamaModel<StaticKVCache>;

constexpr int64_t kContext = 200;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

void synchronize() {
  if (bench::device().is_cuda()) (void)at::ones({1}, at::TensorOptions().device(bench::device())).sum().item<float>();
}

// The best of `repeats` timings of `work`, in seconds.
template <class Work>
double best_of(int repeats, Work work) {
  double best = 1e30;
  for (int i = 0; i < repeats; ++i) {
    synchronize();
    const auto start = Clock::now();
    work();
    synchronize();
    best = std::min(best, seconds_since(start));
  }
  return best;
}

struct Floor {
  double gemm_flops_per_second = 0;  // one 1024^3 fp32 product
  double cache_bytes_per_second = 0; // bytes moved (read and written) per second by copying a
                                     // buffer of the model's weight bytes, warm in the caches
  double dram_bytes_per_second = 0;  // the same for a 256 MiB copy
};

// Bytes moved per second by copying `bytes` of fp32 (best of 5 after a warm-up copy).
double copy_rate(int64_t bytes) {
  const at::Tensor source = at::ones({std::max<int64_t>(1, bytes / 4)}, bench::on_device());
  at::Tensor target = at::empty_like(source);
  target.copy_(source);
  return 2.0 * static_cast<double>(source.nbytes()) / best_of(5, [&] { target.copy_(source); });
}

const Floor& floor_rates(double weight_bytes) {
  static const Floor floor = [weight_bytes] {
    const auto options = bench::on_device();
    const at::Tensor a = at::randn({1024, 1024}, options), b = at::randn({1024, 1024}, options);
    at::Tensor c = at::empty({1024, 1024}, options);
    double gemm = best_of(5, [&] { at::mm_out(c, a, b); });
    if (specdec::detail::kOneDnnBuilt && bench::device().is_cpu()) {
      const specdec::detail::CpuLinear product(b.t(), at::Tensor());
      (void)product(a, specdec::detail::ProductRoute::onednn);
      gemm = std::min(gemm, best_of(5, [&] { benchmark::DoNotOptimize(product(a, specdec::detail::ProductRoute::onednn).data_ptr()); }));
    }
    return Floor{2.0 * 1024 * 1024 * 1024 / gemm, copy_rate(static_cast<int64_t>(weight_bytes)),
                 copy_rate(int64_t{256} << 20)};
  }();
  return floor;
}

Model& target() {
  static Model model = [] {
    const auto checkpoint = io::load_llama(SPECDEC_BUNDLED_MODELS_DIR "/target", bench::on_device());
    return Model(checkpoint.config, checkpoint.weights);
  }();
  return model;
}

// Weight bytes a forward reads (every matrix and norm; the embedding rows it gathers are few) and
// multiply-adds of its matrix products for T new tokens after `context` cached positions.
struct Work {
  double weight_bytes = 0;
  double flops = 0;
};

Work work_of(const Model& model, int64_t tokens, int64_t context) {
  const models::LlamaWeights& w = model.weights();
  const models::LlamaConfig& c = model.config();
  Work work;
  double matrix_elements = static_cast<double>(w.output.numel());
  work.weight_bytes = static_cast<double>(w.output.nbytes() + w.norm.nbytes());
  for (const auto& layer : w.layers) {
    for (const at::Tensor* m : {&layer.wq, &layer.wk, &layer.wv, &layer.wo, &layer.w1, &layer.w2, &layer.w3}) {
      matrix_elements += static_cast<double>(m->numel());
      work.weight_bytes += static_cast<double>(m->nbytes());
    }
    work.weight_bytes += static_cast<double>(layer.attention_norm.nbytes() + layer.ffn_norm.nbytes());
  }
  const auto t = static_cast<double>(tokens);
  // Projections and classifier, then attention scores and values over the context.
  work.flops = 2 * matrix_elements * t +
               2 * 2 * static_cast<double>(c.n_layers * c.dim) * static_cast<double>(context + tokens) * t;
  return work;
}

void BM_Forward(benchmark::State& state) {
  const int64_t tokens = state.range(0);
  const bool onednn = state.range(1) != 0;
  Model& model = target();
  if (onednn && !(specdec::detail::kOneDnnBuilt && bench::device().is_cpu())) {
    state.SkipWithError("oneDNN products need a CPU model and a build with oneDNN");
    return;
  }
  model.use_onednn(onednn);
  c10::InferenceMode inference;
  auto cache = model.make_cache(1);
  const auto ids = at::TensorOptions().dtype(at::kLong).device(bench::device());
  (void)model.forward(at::randint(0, 256, {1, kContext}, ids), cache);
  const at::Tensor fresh = at::randint(0, 256, {1, tokens}, ids);
  double seconds = 0;
  int64_t forwards = 0;
  for (auto _ : state) {
    synchronize();
    const auto start = Clock::now();
    const at::Tensor logits = model.forward(fresh, cache);
    synchronize();
    seconds += seconds_since(start);
    ++forwards;
    benchmark::DoNotOptimize(logits.data_ptr());
    cache.prune(tokens);
  }
  const Work work = work_of(model, tokens, kContext);
  const Floor& floor = floor_rates(work.weight_bytes);
  const double floor_seconds =
      std::max(work.weight_bytes / floor.cache_bytes_per_second, work.flops / floor.gemm_flops_per_second);
  const double ms = 1e3 * seconds / static_cast<double>(forwards);
  state.counters["forward_ms"] = ms;
  state.counters["floor_ms"] = 1e3 * floor_seconds;
  state.counters["ratio_to_floor"] = ms / (1e3 * floor_seconds);
  state.counters["gemm_gflops"] = floor.gemm_flops_per_second / 1e9;
  state.counters["cache_gbytes_per_s"] = floor.cache_bytes_per_second / 1e9;
  state.counters["dram_gbytes_per_s"] = floor.dram_bytes_per_second / 1e9;
  state.SetLabel(model.onednn() ? "onednn" : "blas");
  model.use_onednn(true);
}

// The 200-token prefill on its own.
void BM_Prefill(benchmark::State& state) {
  Model& model = target();
  const auto ids = at::TensorOptions().dtype(at::kLong).device(bench::device());
  const at::Tensor prompt = at::randint(0, 256, {1, kContext}, ids);
  c10::InferenceMode inference;
  double seconds = 0;
  int64_t runs = 0;
  for (auto _ : state) {
    auto cache = model.make_cache(1);
    synchronize();
    const auto start = Clock::now();
    benchmark::DoNotOptimize(model.forward(prompt, cache).data_ptr());
    synchronize();
    seconds += seconds_since(start);
    ++runs;
  }
  state.counters["prefill_ms"] = 1e3 * seconds / static_cast<double>(runs);
  state.counters["prefill_tokens_per_second"] = static_cast<double>(kContext * runs) / seconds;
}

enum LinearRoute : int64_t { kLinear = 0, kPretransposed = 1, kOneDnn = 2, kRowMv = 3, kOneDnnMatmul = 4 };

void BM_SmallLinear(benchmark::State& state) {
  const int64_t rows = state.range(0);
  const auto route = static_cast<LinearRoute>(state.range(1));
  if (!bench::device().is_cpu()) {
    state.SkipWithError("CPU products only");
    return;
  }
  if (route == kOneDnn && !at::hasMKLDNN()) {
    state.SkipWithError("this libtorch was built without oneDNN (MKLDNN)");
    return;
  }
  if (route == kOneDnnMatmul && !specdec::detail::kOneDnnBuilt) {
    state.SkipWithError("specdec was built without oneDNN");
    return;
  }
  const models::LlamaConfig& c = target().config();
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {c.dim + 2 * c.kv_dim(), c.dim}, {c.dim, c.dim}, {2 * c.hidden_dim, c.dim}, {c.dim, c.hidden_dim}};
  c10::InferenceMode inference;
  std::vector<at::Tensor> weights, transposed, onednn, inputs;
  std::vector<specdec::detail::CpuLinear> matmuls;
  double flops = 0;
  for (const auto& [out, in] : shapes) {
    weights.push_back(at::randn({out, in}));
    transposed.push_back(weights.back().t().contiguous());
    if (route == kOneDnn) onednn.push_back(weights.back().to_mkldnn());
    if (route == kOneDnnMatmul) matmuls.emplace_back(transposed.back().t(), at::Tensor());
    inputs.push_back(at::randn({rows, in}));
    flops += 2.0 * static_cast<double>(rows * out * in);
  }
  const at::Tensor no_bias;
  double seconds = 0;
  int64_t runs = 0;
  for (auto _ : state) {
    const auto start = Clock::now();
    for (size_t i = 0; i < shapes.size(); ++i) {
      at::Tensor y;
      if (route == kLinear) {
        y = at::linear(inputs[i], weights[i]);
      } else if (route == kPretransposed) {
        y = at::mm(inputs[i], transposed[i]);
      } else if (route == kOneDnn) {
        y = at::mkldnn_linear(inputs[i].to_mkldnn(), onednn[i], no_bias).to_dense();
      } else if (route == kOneDnnMatmul) {
        y = matmuls[i](inputs[i], specdec::detail::ProductRoute::onednn);
      } else {
        y = at::empty({rows, shapes[i].first});
        for (int64_t r = 0; r < rows; ++r) {
          at::Tensor row = y[r];
          at::mv_out(row, weights[i], inputs[i][r]);
        }
      }
      benchmark::DoNotOptimize(y.data_ptr());
    }
    seconds += seconds_since(start);
    ++runs;
  }
  state.counters["layer_products_us"] = 1e6 * seconds / static_cast<double>(runs);
  state.counters["gflops"] = flops * static_cast<double>(runs) / seconds / 1e9;
  constexpr const char* kRouteNames[] = {"linear", "mm_pretransposed", "onednn", "row_mv", "onednn_matmul"};
  state.SetLabel(kRouteNames[route]);
}

}  // namespace

BENCHMARK(BM_SmallLinear)
    ->ArgsProduct({{1, 2, 3, 5, 9, 16, 200}, {kLinear, kPretransposed, kOneDnn, kRowMv, kOneDnnMatmul}})
    ->ArgNames({"rows", "route"})
    ->MinTime(0.3);
BENCHMARK(BM_Forward)
    ->ArgsProduct({{1, 2, 3, 5, 9}, {0, 1}})
    ->ArgNames({"T", "products"})
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.5);
BENCHMARK(BM_Prefill)->Unit(benchmark::kMillisecond)->MinTime(0.5);

int main(int argc, char** argv) { return specdec::bench::run_benchmarks(argc, argv); }
