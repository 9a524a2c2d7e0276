// One weight product of the CPU forward, x [rows, in] times weight [out, in] transposed plus an
// optional bias, by one of three routes:
//  - packed: detail::packed_product (packed_product.hpp) over a copy of the weight packed in
//    panels, which streams the weight once per call whatever the row count; the only route for
//    bf16 and int8 weights, and one a model takes once its weights are packed
//    (LlamaModel::pack_weights). An fp32 weight of at most kPackedBesideBytes also keeps a packed
//    copy beside itself, so that its few-row products may take whichever route is faster;
//  - onednn: oneDNN's matmul, where specdec was built with oneDNN (its CMake defines
//    SPECDEC_HAVE_ONEDNN when it finds the library; Debian: libdnnl-dev);
//  - blas: a BLAS product (at::mm / at::addmm).
//
// The oneDNN route creates one matmul primitive per weight, once, with the number of rows left to
// run time: it reads the weight where it lies (any strides, so the [in, out] layout of the CPU
// forward and a classifier tied to the embedding alike, without a copy) and runs kernels that
// oneDNN generates for the CPU it finds. BLAS libraries choose their kernels by a table of CPU
// models instead, and OpenBLAS falls back to its SSE3 kernels on a CPU it does not know: there
// oneDNN is 3-5x faster for every row count (docs/benchmarks.md, BM_SmallLinear). Both walk the
// weight in an order made for reuse in cache, which costs little on a weight that fits the caches
// and bandwidth on one that does not (docs/performance.md).
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <compare>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

#if defined(SPECDEC_HAVE_ONEDNN)
#include <oneapi/dnnl/dnnl.hpp>
#endif

#include "specdec/detail/check.hpp"
#include "specdec/detail/torch_compat.hpp"
#include "specdec/models/detail/packed_product.hpp"

namespace specdec::detail {

// Whether this build runs the CPU forward's products through oneDNN by default.
inline constexpr bool kOneDnnBuilt =
#if defined(SPECDEC_HAVE_ONEDNN)
    true;
#else
    false;
#endif

// "onednn 2.6.3" where built with oneDNN, "" otherwise.
inline std::string onednn_version() {
#if defined(SPECDEC_HAVE_ONEDNN)
  const dnnl::version_t* v = dnnl::version();
  return "onednn " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch);
#else
  return {};
#endif
}

// The routes of a product (see the top of this file).
enum class ProductRoute : uint8_t { blas, onednn, packed };

inline const char* to_string(ProductRoute route) noexcept {
  return route == ProductRoute::blas ? "blas" : route == ProductRoute::onednn ? "onednn" : "packed";
}

// Which routes a product may take: the measured fastest of those it has (automatic), or one
// (where the product has it; otherwise the measured fastest of the others).
enum class ProductChoice : uint8_t { automatic, blas, onednn, packed };

// Which route multiplies a few rows fastest, of BLAS, oneDNN and the packed panels (those a
// product has), for products of one shape and layout: measured once per process, on the first
// product of each row count, and kept for every CpuLinear of that key, so that two models built
// alike compute alike (bit for bit) in one process. No route wins everywhere: on one machine
// measured here BLAS on the pre-transposed weight took 26 us for a layer's products at 1 and 2
// rows against oneDNN's 29 and 38 us, and oneDNN 39 us at 3 rows against BLAS's 47 (bench_forward,
// BM_SmallLinear); on another oneDNN was 3-5x faster at every row count; on an AVX-512 CPU the
// packed panels took stories260K's one-token forward from 66 to 50 us. The measurement runs on
// the weight itself, so a weight larger than the caches is measured as it streams. Beyond
// kMeasuredRows rows (prefills) fp32 products take oneDNN (or BLAS) unmeasured.
class ProductRoutes {
 public:
  static constexpr int64_t kMeasuredRows = 16;

  struct Key {
    int64_t in = 0, out = 0, row_stride = 0, column_stride = 0, rows = 0;
    bool bias = false;
    auto operator<=>(const Key&) const = default;
  };

  // The fastest route for `key`: the recorded answer, or `measure()`'s, recorded. Two threads
  // that measure one key at once keep the first answer.
  template <class Measure>
  static ProductRoute fastest(const Key& key, Measure measure) {
    {
      const std::lock_guard lock(mutex());
      const auto found = table().find(key);
      if (found != table().end()) return found->second;
    }
    const ProductRoute route = measure();
    const std::lock_guard lock(mutex());
    return table().emplace(key, route).first->second;
  }

 private:
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static std::map<Key, ProductRoute>& table() {
    static std::map<Key, ProductRoute> t;
    return t;
  }
};

class CpuLinear {
 public:
  // The largest fp32 weight that keeps a packed copy beside itself (its bytes): a second copy of
  // a weight this small costs little memory (a model made of such weights has at most tens of
  // millions of parameters), and it is at such sizes, where a product's call costs as much as its
  // arithmetic, that the routes differ most. Larger weights are packed by
  // LlamaModel::pack_weights, or not at all.
  static constexpr int64_t kPackedBesideBytes = int64_t{1} << 20;

  CpuLinear() = default;

  // weight [out, in] fp32 on the CPU with any strides; bias [out] or undefined (kept as fp32). It
  // has the BLAS route, the oneDNN route where its primitive can be created (not for an unusual
  // layout or a CPU oneDNN does not support), and the packed route, over a copy in fp32 panels,
  // where the weight holds at most kPackedBesideBytes. A bf16 weight is packed (packed(), bf16):
  // the packed route is the only one for it.
  CpuLinear(at::Tensor weight, at::Tensor bias) {
    if (weight.scalar_type() != at::kFloat) {
      *this = packed(weight, bias, WeightFormat::bf16, "weight");
      return;
    }
    weight_ = std::move(weight);
    out_ = weight_.size(0);
    in_ = weight_.size(1);
    if (bias.defined()) bias_ = bias.to(at::kFloat).contiguous();
    make_onednn();
    if (weight_.numel() > 0 && weight_.numel() * 4 <= kPackedBesideBytes) {
      packed_ = pack_panels(weight_, at::kFloat);
      packed_weight_ = PackedWeight{.data = packed_.data_ptr(), .in = in_, .out = out_, .format = WeightFormat::f32};
    }
  }

  // The product of `weight` [out, in] (fp32 or bf16, any strides) packed in panels in `format`
  // (packed_product.hpp): f32 (a bf16 weight widened), bf16 (an fp32 weight rounded to the
  // nearest), or i8: one fp32 scale per output, symmetric (scale = max |w| / 127 over the
  // output's weights, each weight rounded to the nearest step). Only the packed route; `weight`
  // is not kept. `bias` is kept as fp32.
  // Throws std::invalid_argument naming `name` where the weight is not a non-empty matrix of
  // finite values (i8).
  static CpuLinear packed(const at::Tensor& weight, const at::Tensor& bias, WeightFormat format,
                          const std::string& name) {
    if (!weight.defined() || weight.dim() != 2 || weight.numel() == 0) {
      throw_invalid_message(name, ": packed weights need a non-empty matrix [out, in], got ",
                            weight.defined() ? weight.sizes() : at::IntArrayRef{});
    }
    CpuLinear product;
    product.out_ = weight.size(0);
    product.in_ = weight.size(1);
    if (bias.defined()) product.bias_ = bias.to(at::kFloat).contiguous();
    if (format == WeightFormat::i8) {
      const at::Tensor wide = weight.to(at::kFloat);
      if (!at::isfinite(wide).all().item<bool>()) {
        throw_invalid_message(name, ": int8 weights need finite values; the matrix holds NaN or infinity");
      }
      const at::Tensor largest = wide.abs().amax(1);  // [out]
      product.scales_ = at::where(largest > 0, largest / 127.0, at::ones_like(largest)).contiguous();
      product.packed_ = pack_panels(at::round(wide / product.scales_.unsqueeze(1)).clamp(-127, 127), at::kChar);
    } else {
      product.packed_ = pack_panels(weight, format == WeightFormat::bf16 ? at::kBFloat16 : at::kFloat);
    }
    product.format_ = format;
    product.packed_weight_ = PackedWeight{.data = product.packed_.data_ptr(), .in = product.in_, .out = product.out_,
                                          .format = format,
                                          .scales = format == WeightFormat::i8 ? product.scales_.data_ptr<float>() : nullptr};
    return product;
  }

  [[nodiscard]] bool has_onednn() const noexcept { return onednn_; }
  [[nodiscard]] bool has_packed() const noexcept { return packed_weight_.data != nullptr; }
  [[nodiscard]] bool has_blas() const noexcept { return weight_.defined(); }
  [[nodiscard]] bool has(ProductRoute route) const noexcept {
    return route == ProductRoute::blas ? has_blas() : route == ProductRoute::onednn ? has_onednn() : has_packed();
  }
  // The format of the weight's elements as products read them.
  [[nodiscard]] WeightFormat format() const noexcept { return format_; }
  [[nodiscard]] int64_t in() const noexcept { return in_; }
  [[nodiscard]] int64_t out() const noexcept { return out_; }
  // The weight as an fp32 [out, in] tensor: the one given (fp32, not packed()), or unpacked from
  // the panels (times the scales for int8; a copy), for forwards that multiply through ATen.
  [[nodiscard]] at::Tensor dense() const {
    if (has_blas()) return weight_;
    at::Tensor rows = unpack_panels(packed_, out_, in_).to(at::kFloat);
    return format_ == WeightFormat::i8 ? rows * scales_.unsqueeze(1) : rows;
  }
  [[nodiscard]] const at::Tensor& bias() const noexcept { return bias_; }
  // The weight as the packed route reads it (data null where it has no such route).
  [[nodiscard]] const PackedWeight& packed_weight() const noexcept { return packed_weight_; }

  // x [rows, in] fp32, contiguous: [rows, out] by `route` where the product has it, unmeasured;
  // otherwise by BLAS, or the packed route where it has no BLAS route.
  [[nodiscard]] at::Tensor operator()(const at::Tensor& x, ProductRoute route) const {
    at::Tensor y = at::empty({x.size(0), out_}, x.options());
    if (!has(route)) route = has_blas() ? ProductRoute::blas : ProductRoute::packed;
    run(x.data_ptr<float>(), x.size(0), y.data_ptr<float>(), route);
    return y;
  }

  // y = x times the weight, transposed, plus the bias, for x `rows` contiguous rows of `in` floats
  // and y as many of `out`, on the CPU; x and y do not overlap. The route is the one `choice`
  // names where the product has it, otherwise the fastest it has, measured (ProductRoutes) for
  // up to kMeasuredRows rows; beyond, oneDNN or BLAS where it has them. No tensor is made on the
  // oneDNN and packed routes: the forward's products write into its own buffers.
  void into(const float* x, int64_t rows, float* y, ProductChoice choice = ProductChoice::automatic) const {
    run(x, rows, y, route_for(x, rows, y, choice));
  }

  // The route into() takes for `rows` rows under `choice` (measured on x and y where not yet).
  ProductRoute route_for(const float* x, int64_t rows, float* y, ProductChoice choice) const {
    if (choice != ProductChoice::automatic) {
      const auto named = static_cast<ProductRoute>(static_cast<uint8_t>(choice) - 1);
      if (has(named)) return named;
    }
    if (!has_blas()) return ProductRoute::packed;
    if (rows > ProductRoutes::kMeasuredRows || (!has_onednn() && !has_packed())) {
      return has_onednn() ? ProductRoute::onednn : ProductRoute::blas;
    }
    const ProductRoutes::Key key{.in = in_, .out = out_, .row_stride = weight_.stride(0),
                                 .column_stride = weight_.stride(1), .rows = rows, .bias = bias_.defined()};
    return ProductRoutes::fastest(key, [&] { return measure_fastest(x, rows, y); });
  }

 private:
  void make_onednn() {
#if defined(SPECDEC_HAVE_ONEDNN)
    using dnnl::memory;
    const memory::dim out = out_, in = in_;
    // The weight as oneDNN's [in, out] operand: weight_.t() with its strides.
    weights_ = memory::desc({in, out}, memory::data_type::f32, {weight_.stride(1), weight_.stride(0)});
    const memory::desc source({DNNL_RUNTIME_DIM_VAL, in}, memory::data_type::f32, {in, 1});
    const memory::desc target({DNNL_RUNTIME_DIM_VAL, out}, memory::data_type::f32, {out, 1});
    if (bias_.defined()) bias_desc_ = memory::desc({1, out}, memory::data_type::f32, {out, 1});
    try {
#if DNNL_VERSION_MAJOR >= 3
      primitive_ = dnnl::matmul(dnnl::matmul::primitive_desc(engine(), source, weights_, bias_desc_, target));
#else
      primitive_ = dnnl::matmul(dnnl::matmul::primitive_desc(dnnl::matmul::desc(source, weights_, bias_desc_, target), engine()));
#endif
      onednn_ = true;
    } catch (const dnnl::error&) {
      onednn_ = false;
    }
#endif
  }

  // Every route the product has on this input, alternated after one untimed run of each: the
  // one with the best of five (BLAS where they tie). y is overwritten.
  ProductRoute measure_fastest(const float* x, int64_t rows, float* y) const {
    using Clock = std::chrono::steady_clock;
    constexpr std::array kRoutes{ProductRoute::blas, ProductRoute::onednn, ProductRoute::packed};
    std::array<double, kRoutes.size()> best{};
    best.fill(std::numeric_limits<double>::infinity());
    for (int round = 0; round < 6; ++round) {
      for (const ProductRoute route : kRoutes) {
        if (!has(route)) continue;
        const auto start = Clock::now();
        run(x, rows, y, route);
        const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
        if (round > 0) best[static_cast<size_t>(route)] = std::min(best[static_cast<size_t>(route)], seconds);
      }
    }
    return kRoutes[static_cast<size_t>(std::ranges::min_element(best) - best.begin())];
  }

  void run(const float* x, int64_t rows, float* y, ProductRoute route) const {
    if (route == ProductRoute::packed) {
      packed_product(packed_weight_, x, rows, y, bias_.defined() ? bias_.data_ptr<float>() : nullptr);
      return;
    }
#if defined(SPECDEC_HAVE_ONEDNN)
    if (route == ProductRoute::onednn) {
      using dnnl::memory;
      const memory source(memory::desc({rows, in_}, memory::data_type::f32, {in_, 1}), engine(), const_cast<float*>(x));
      const memory weights(weights_, engine(), weight_.data_ptr());
      const memory target(memory::desc({rows, out_}, memory::data_type::f32, {out_, 1}), engine(), y);
      std::unordered_map<int, memory> arguments{
          {DNNL_ARG_SRC, source}, {DNNL_ARG_WEIGHTS, weights}, {DNNL_ARG_DST, target}};
      if (bias_.defined()) arguments.emplace(DNNL_ARG_BIAS, memory(bias_desc_, engine(), bias_.data_ptr()));
      thread_local dnnl::stream stream(engine());
      primitive_.execute(stream, arguments);
      return;
    }
#endif
    const auto options = at::TensorOptions().dtype(at::kFloat);
    const at::Tensor source = at::from_blob(const_cast<float*>(x), {rows, in_}, options);
    at::Tensor target = at::from_blob(y, {rows, out_}, options);
    if (bias_.defined()) {
      at::addmm_out(target, bias_, source, weight_.t());
    } else {
      at::mm_out(target, source, weight_.t());
    }
  }

#if defined(SPECDEC_HAVE_ONEDNN)
  static dnnl::engine& engine() {
    static dnnl::engine cpu(dnnl::engine::kind::cpu, 0);
    return cpu;
  }
  dnnl::memory::desc weights_;
  dnnl::memory::desc bias_desc_;  // zero (no bias) unless bias_ is defined
  dnnl::matmul primitive_;
#endif
  at::Tensor weight_;   // [out, in] fp32 (the BLAS and oneDNN routes), or undefined once packed
  at::Tensor bias_;     // [out] fp32, or undefined
  at::Tensor packed_;   // the panels (pack_panels; the packed route, beside weight_ where small), or undefined
  at::Tensor scales_;   // [out] fp32 for int8 panels
  PackedWeight packed_weight_{};  // data null where the packed route does not apply
  WeightFormat format_ = WeightFormat::f32;
  int64_t in_ = 0, out_ = 0;
  bool onednn_ = false;
};

}  // namespace specdec::detail
