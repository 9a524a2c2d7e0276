// One weight product of the CPU fp32 forward, x [rows, in] times weight [out, in] transposed plus
// an optional bias: through oneDNN's matmul where specdec was built with oneDNN (its CMake defines
// SPECDEC_HAVE_ONEDNN when it finds the library; Debian: libdnnl-dev), through a BLAS product
// (at::mm / at::addmm) otherwise or on request.
//
// The oneDNN route creates one matmul primitive per weight, once, with the number of rows left to
// run time: it reads the weight where it lies (any strides, so the [in, out] layout of the CPU
// forward and a classifier tied to the embedding alike, without a copy) and runs kernels that
// oneDNN generates for the CPU it finds. BLAS libraries choose their kernels by a table of CPU
// models instead, and OpenBLAS falls back to its SSE3 kernels on a CPU it does not know: there
// oneDNN is 3-5x faster for every row count (docs/benchmarks.md, BM_SmallLinear).
#pragma once

#include <algorithm>
#include <chrono>
#include <compare>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

#if defined(SPECDEC_HAVE_ONEDNN)
#include <oneapi/dnnl/dnnl.hpp>
#endif

#include "specdec/detail/torch_compat.hpp"

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

// Which route multiplies a few rows faster, for products of one shape and weight layout: measured
// once per process, on the first product of each row count, and kept for every CpuLinear of that
// shape, so that two models built alike compute alike (bit for bit) in one process. Neither route
// wins everywhere: on one machine measured here BLAS on the pre-transposed weight took 26 us for a
// layer's products at 1 and 2 rows against oneDNN's 29 and 38 us, and oneDNN 39 us at 3 rows
// against BLAS's 47 (bench_forward, BM_SmallLinear); on another oneDNN was 3-5x faster at every
// row count. Beyond kMeasuredRows rows (prefills) oneDNN's blocked kernels are taken unmeasured.
class ProductRoutes {
 public:
  static constexpr int64_t kMeasuredRows = 16;

  struct Key {
    int64_t in = 0, out = 0, row_stride = 0, column_stride = 0, rows = 0;
    bool bias = false;
    auto operator<=>(const Key&) const = default;
  };

  // Whether oneDNN is the faster route for `key`: the recorded answer, or `measure()`'s (true
  // for oneDNN), recorded. Two threads that measure one key at once keep the first answer.
  template <class Measure>
  static bool onednn_faster(const Key& key, Measure measure) {
    {
      const std::lock_guard lock(mutex());
      const auto found = table().find(key);
      if (found != table().end()) return found->second;
    }
    const bool faster = measure();
    const std::lock_guard lock(mutex());
    return table().emplace(key, faster).first->second;
  }

 private:
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static std::map<Key, bool>& table() {
    static std::map<Key, bool> t;
    return t;
  }
};

class CpuLinear {
 public:
  CpuLinear() = default;

  // weight [out, in] fp32 on the CPU with any strides; bias [out] or undefined. Where the oneDNN
  // primitive cannot be created (an unusual layout, a CPU oneDNN does not support), products take
  // the BLAS route.
  CpuLinear(at::Tensor weight, at::Tensor bias) : weight_(std::move(weight)), bias_(std::move(bias)) {
#if defined(SPECDEC_HAVE_ONEDNN)
    using dnnl::memory;
    const memory::dim out = weight_.size(0), in = weight_.size(1);
    // The weight as oneDNN's [in, out] operand: weight_.t() with its strides.
    weights_ = memory::desc({in, out}, memory::data_type::f32, {weight_.stride(1), weight_.stride(0)});
    const memory::desc source({DNNL_RUNTIME_DIM_VAL, in}, memory::data_type::f32, {in, 1});
    const memory::desc target({DNNL_RUNTIME_DIM_VAL, out}, memory::data_type::f32, {out, 1});
    if (bias_.defined()) {
      bias_ = bias_.contiguous();
      bias_desc_ = memory::desc({1, out}, memory::data_type::f32, {out, 1});
    }
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

  // Whether products can take the oneDNN route.
  [[nodiscard]] bool has_onednn() const noexcept { return onednn_; }

  // x [rows, in] fp32, contiguous: [rows, out], through oneDNN (where it has its primitive) or
  // BLAS as `use_onednn` says, unmeasured.
  [[nodiscard]] at::Tensor operator()(const at::Tensor& x, bool use_onednn) const {
    at::Tensor y = at::empty({x.size(0), weight_.size(0)}, x.options());
    run(x.data_ptr<float>(), x.size(0), y.data_ptr<float>(), use_onednn);
    return y;
  }

  // y = x times the weight, transposed, plus the bias, for x `rows` contiguous rows of `in` floats
  // and y as many of `out`, on the CPU; x and y do not overlap. With `use_onednn`, the route that
  // ProductRoutes measured faster for this shape and row count; without, BLAS. No tensor is made
  // on the oneDNN route: the forward's products write into its own buffers.
  void into(const float* x, int64_t rows, float* y, bool use_onednn) const {
    if (use_onednn && onednn_ && rows <= ProductRoutes::kMeasuredRows) {
      const ProductRoutes::Key key{.in = weight_.size(1), .out = weight_.size(0), .row_stride = weight_.stride(0),
                                   .column_stride = weight_.stride(1), .rows = rows, .bias = bias_.defined()};
      use_onednn = ProductRoutes::onednn_faster(key, [&] { return measure_onednn_faster(x, rows, y); });
    }
    run(x, rows, y, use_onednn);
  }

 private:
  // Both routes on this input, alternated after one untimed run of each: whether oneDNN's best of
  // five is faster than BLAS's. y is overwritten.
  bool measure_onednn_faster(const float* x, int64_t rows, float* y) const {
    using Clock = std::chrono::steady_clock;
    double best[2] = {1e30, 1e30};
    for (int round = 0; round < 6; ++round) {
      for (const int route : {0, 1}) {
        const auto start = Clock::now();
        run(x, rows, y, route == 1);
        if (round > 0) best[route] = std::min(best[route], std::chrono::duration<double>(Clock::now() - start).count());
      }
    }
    return best[1] < best[0];
  }

  void run(const float* x, int64_t rows, float* y, bool use_onednn) const {
    const int64_t in = weight_.size(1), out = weight_.size(0);
#if defined(SPECDEC_HAVE_ONEDNN)
    if (use_onednn && onednn_) {
      using dnnl::memory;
      const memory source(memory::desc({rows, in}, memory::data_type::f32, {in, 1}), engine(), const_cast<float*>(x));
      const memory weights(weights_, engine(), weight_.data_ptr());
      const memory target(memory::desc({rows, out}, memory::data_type::f32, {out, 1}), engine(), y);
      std::unordered_map<int, memory> arguments{
          {DNNL_ARG_SRC, source}, {DNNL_ARG_WEIGHTS, weights}, {DNNL_ARG_DST, target}};
      if (bias_.defined()) arguments.emplace(DNNL_ARG_BIAS, memory(bias_desc_, engine(), bias_.data_ptr()));
      thread_local dnnl::stream stream(engine());
      primitive_.execute(stream, arguments);
      return;
    }
#else
    (void)use_onednn;
#endif
    const auto options = at::TensorOptions().dtype(at::kFloat);
    const at::Tensor source = at::from_blob(const_cast<float*>(x), {rows, in}, options);
    at::Tensor target = at::from_blob(y, {rows, out}, options);
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
  at::Tensor weight_;
  at::Tensor bias_;
  bool onednn_ = false;
};

}  // namespace specdec::detail
