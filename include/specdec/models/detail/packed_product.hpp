// The weight product of a decoding forward on the CPU for a few rows, y [rows, out] = x [rows, in]
// times W [out, in] transposed (times per-output scales, plus a bias), streaming W once from
// memory in one sequential pass per thread whatever the row count.
//
// A target whose weights do not fit the CPU's caches is limited by how fast its weights stream
// from memory: one token's forward reads every weight once, and a verification forward of k tokens
// should cost the same. BLAS and oneDNN products walk the weight in an order chosen for reuse in
// cache, several rows of memory at a time; on a 1B-parameter target a 9-token forward cost 2.8
// times a one-token one, and even the one-token forward read its weights at about 60% of the rate
// at which this machine can stream memory. Here W is packed once, at load, into panels of 32
// outputs: panel p holds, for each input i in order, the 32 weights W[32p .. 32p + 31][i] side by
// side, so each thread reads its panels as one sequential stream. For each input the panel's 32
// weights are multiplied into every row's 32 sums, which stay in registers over the whole pass
// (up to kRegisterRows rows at a time; more rows re-read the panel from the second-level cache).
//
// Weights may be fp32, bf16 (widened to fp32 in registers: the products and sums stay fp32, so a
// bf16 model computes as its fp32 copy with rounded weights) or int8 with one fp32 scale per output
// (weight-only quantization: y = scale * (x . q) + bias). The AVX-512 version is compiled for
// AVX-512F/BW/VL whatever the caller's flags and chosen at run time where the CPU has them;
// elsewhere the same loops run in portable C++ that the compiler vectorises for the caller's
// flags. Panels are split over libtorch's intra-op threads.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define SPECDEC_X86_AVX512_KERNELS 1
#define SPECDEC_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))
#endif

namespace specdec::detail {

// How a packed weight's elements are stored.
enum class WeightFormat : uint8_t {
  f32,   // float
  bf16,  // bfloat16 (the upper 16 bits of a float)
  i8,    // int8, times a per-output fp32 scale
};

inline const char* to_string(WeightFormat format) noexcept {
  return format == WeightFormat::f32 ? "float32" : format == WeightFormat::bf16 ? "bfloat16" : "int8";
}

// Outputs per panel of a packed weight.
inline constexpr int64_t kPanelWidth = 32;

// A weight [out, in] packed in panels (see the top of this file): element (o, i) at
// data[((o / 32) * in + i) * 32 + o % 32], the last panel padded with zero weights.
struct PackedWeight {
  const void* data = nullptr;
  int64_t in = 0;
  int64_t out = 0;
  WeightFormat format = WeightFormat::f32;
  const float* scales = nullptr;  // [out] for i8, null otherwise
};

// An uninitialised CPU tensor of `sizes` and `dtype` in memory the kernel may back with huge
// pages: aligned to 2 MiB and, on Linux, marked with madvise(MADV_HUGEPAGE) where it spans at least
// one. A stream through memory in 4 KiB pages takes a TLB miss every 4 KiB, and the hardware
// prefetchers stop at each page's end; with transparent huge pages in madvise mode (Debian's
// default) nothing else would ask for them. Where the kernel refuses, the pages stay small.
inline at::Tensor huge_page_tensor(at::IntArrayRef sizes, at::ScalarType dtype) {
  constexpr size_t kHugePage = size_t{2} << 20;
  int64_t elements = 1;
  for (const int64_t size : sizes) elements *= size;
  const size_t bytes = static_cast<size_t>(elements) * at::elementSize(dtype);
  if (bytes < kHugePage) return at::empty(sizes, at::TensorOptions().dtype(dtype));
  const size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  void* data = std::aligned_alloc(kHugePage, rounded);
  if (data == nullptr) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  (void)::madvise(data, rounded, MADV_HUGEPAGE);  // advice: refused, the pages stay small
#endif
  return at::from_blob(data, sizes, [](void* memory) { std::free(memory); }, at::TensorOptions().dtype(dtype));
}

// The panels of `weight` [out, in] (any floating dtype, any strides) as a tensor [panels, in, 32]
// of `dtype` (kFloat, kBFloat16, or kChar for weights already quantized to integers), in memory
// that may be backed by huge pages (huge_page_tensor).
inline at::Tensor pack_panels(const at::Tensor& weight, at::ScalarType dtype) {
  const int64_t out = weight.size(0), in = weight.size(1);
  const int64_t panels = (out + kPanelWidth - 1) / kPanelWidth;
  at::Tensor padded = at::zeros({panels * kPanelWidth, in}, weight.options().dtype(dtype));
  padded.narrow(0, 0, out).copy_(weight);
  at::Tensor packed = huge_page_tensor({panels, in, kPanelWidth}, dtype);
  packed.copy_(padded.view({panels, kPanelWidth, in}).transpose(1, 2));
  return packed;
}

// Whether this CPU runs the AVX-512 version (asked once per process).
inline bool cpu_has_avx512() {
#ifdef SPECDEC_X86_AVX512_KERNELS
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
  return has;
#else
  return false;
#endif
}

// "avx512" or "portable": which version packed_product() runs on this CPU.
inline const char* packed_product_isa() { return cpu_has_avx512() ? "avx512" : "portable"; }

namespace packed {

// Rows whose 32 sums stay in registers through a pass over a panel (2 vectors each); up to 6
// rows, two panels are read at once (4 vectors per row).
inline constexpr int kRegisterRows = 12;

// The fp32 value of element e of a panel row in format F.
template <WeightFormat F>
inline float element(const void* data, int64_t e) {
  if constexpr (F == WeightFormat::f32) {
    return static_cast<const float*>(data)[e];
  } else if constexpr (F == WeightFormat::bf16) {
    const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(data)[e]) << 16;
    float value;
    std::memcpy(&value, &bits, sizeof value);
    return value;
  } else {
    return static_cast<float>(static_cast<const int8_t*>(data)[e]);
  }
}

template <WeightFormat F>
constexpr int64_t element_bytes() {
  return F == WeightFormat::f32 ? 4 : F == WeightFormat::bf16 ? 2 : 1;
}

// The 32 outputs of panel p from the sums `acc` [rows, 32]: scaled, biased, and the columns that
// exist written to y [rows, out].
inline void store_panel(const PackedWeight& w, int64_t p, const float* acc, int64_t rows, float* y, const float* bias) {
  const int64_t first = p * kPanelWidth, width = std::min(kPanelWidth, w.out - first);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < width; ++j) {
      float value = acc[r * kPanelWidth + j];
      if (w.scales != nullptr) value *= w.scales[first + j];
      if (bias != nullptr) value += bias[first + j];
      y[r * w.out + first + j] = value;
    }
  }
}

// Portable: panel p times `rows` rows of x, given transposed (xt [in, rows]), into `acc`
// [rows, 32].
template <WeightFormat F>
inline void panel_portable(const PackedWeight& w, int64_t p, const float* xt, int64_t rows, float* acc) {
  const char* panel = static_cast<const char*>(w.data) + p * w.in * kPanelWidth * element_bytes<F>();
  std::fill(acc, acc + rows * kPanelWidth, 0.0F);
  for (int64_t i = 0; i < w.in; ++i) {
    float weights[kPanelWidth];
    const char* line = panel + i * kPanelWidth * element_bytes<F>();
    for (int64_t j = 0; j < kPanelWidth; ++j) weights[j] = element<F>(line, j);
    for (int64_t r = 0; r < rows; ++r) {
      const float v = xt[i * rows + r];
      float* sums = acc + r * kPanelWidth;
      for (int64_t j = 0; j < kPanelWidth; ++j) sums[j] += v * weights[j];
    }
  }
}

#ifdef SPECDEC_X86_AVX512_KERNELS
// 16 weights from `data`, widened to fp32.
template <WeightFormat F>
SPECDEC_TARGET_AVX512 inline __m512 load16(const char* data) {
  // The zero-masked forms of the widening instructions (all 16 lanes kept): GCC 12 warns of an
  // uninitialised variable inside the unmasked ones' definitions.
  constexpr __mmask16 kAll = 0xFFFF;
  if constexpr (F == WeightFormat::f32) {
    return _mm512_loadu_ps(data);
  } else if constexpr (F == WeightFormat::bf16) {
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(data));
    return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(kAll, _mm512_maskz_cvtepu16_epi32(kAll, half), 16));
  } else {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(data));
    return _mm512_maskz_cvtepi32_ps(kAll, _mm512_maskz_cvtepi8_epi32(kAll, bytes));
  }
}

// How far ahead of its loads a stream asks for its weights (software prefetch). The hardware
// prefetchers alone left the loads waiting on memory whenever the arithmetic between them grew:
// on a 1B-parameter target's products (2 threads, Intel Xeon with AVX-512) 4 KiB ahead took
// 8 rows from 174 to 105 ms in bf16 and from 283 to 203 ms in fp32, and one row from 96 to 78
// ms in bf16 and 58 to 48 ms in int8 (1 to 4 KiB ahead were within noise of each other).
inline constexpr int64_t kPrefetchBytes = 4096;

// P panels (P streams from P places in memory) times R rows of x, given transposed (xt [in, R]:
// each input's R values side by side), into acc[j] [R, 32] for panel panels[j]: the 2PR sums in
// registers over every input.
template <WeightFormat F, int R, int P>
SPECDEC_TARGET_AVX512 inline void panels_avx512(const PackedWeight& w, const int64_t* panels, const float* xt,
                                                float* const* acc) {
  constexpr int64_t kStep = kPanelWidth * element_bytes<F>();  // bytes per input in a panel
  const char* line[P];
  __m512 lo[P][R], hi[P][R];
#pragma GCC unroll 2
  for (int j = 0; j < P; ++j) {
    line[j] = static_cast<const char*>(w.data) + panels[j] * w.in * kStep;
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) lo[j][r] = hi[j][r] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < w.in; ++i, xt += R) {
    __m512 a[P], b[P];
#pragma GCC unroll 2
    for (int j = 0; j < P; ++j) {
      // Each cache line of the stream once, kPrefetchBytes ahead (past a panel's end: the next
      // panel's start, or an address the prefetch ignores).
      if constexpr (kStep >= 64) {
#pragma GCC unroll 2
        for (int64_t c = 0; c < kStep; c += 64) _mm_prefetch(line[j] + kPrefetchBytes + c, _MM_HINT_T0);
      } else if ((i & (64 / kStep - 1)) == 0) {
        _mm_prefetch(line[j] + kPrefetchBytes, _MM_HINT_T0);
      }
      a[j] = load16<F>(line[j]);
      b[j] = load16<F>(line[j] + kStep / 2);
      line[j] += kStep;
    }
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 v = _mm512_set1_ps(xt[r]);
#pragma GCC unroll 2
      for (int j = 0; j < P; ++j) {
        lo[j][r] = _mm512_fmadd_ps(v, a[j], lo[j][r]);
        hi[j][r] = _mm512_fmadd_ps(v, b[j], hi[j][r]);
      }
    }
  }
#pragma GCC unroll 2
  for (int j = 0; j < P; ++j) {
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(acc[j] + r * kPanelWidth, lo[j][r]);
      _mm512_storeu_ps(acc[j] + r * kPanelWidth + 16, hi[j][r]);
    }
  }
}

// panels_avx512 for a row count known at run time: one panel for up to kRegisterRows rows, two
// for up to kRegisterRows / 2.
template <WeightFormat F, int P>
SPECDEC_TARGET_AVX512 inline void panels_rows_avx512(const PackedWeight& w, const int64_t* panels, const float* xt,
                                                     int64_t rows, float* const* acc) {
  static_assert(P == 1 || P == 2);
  switch (rows) {
    case 1: panels_avx512<F, 1, P>(w, panels, xt, acc); break;
    case 2: panels_avx512<F, 2, P>(w, panels, xt, acc); break;
    case 3: panels_avx512<F, 3, P>(w, panels, xt, acc); break;
    case 4: panels_avx512<F, 4, P>(w, panels, xt, acc); break;
    case 5: panels_avx512<F, 5, P>(w, panels, xt, acc); break;
    case 6: panels_avx512<F, 6, P>(w, panels, xt, acc); break;
    default:
      if constexpr (P == 1) {
        switch (rows) {
          case 7: panels_avx512<F, 7, 1>(w, panels, xt, acc); break;
          case 8: panels_avx512<F, 8, 1>(w, panels, xt, acc); break;
          case 9: panels_avx512<F, 9, 1>(w, panels, xt, acc); break;
          case 10: panels_avx512<F, 10, 1>(w, panels, xt, acc); break;
          case 11: panels_avx512<F, 11, 1>(w, panels, xt, acc); break;
          default: panels_avx512<F, 12, 1>(w, panels, xt, acc); break;
        }
      }
      break;
  }
}
#endif

// y[r][32p, 32p + 32) for the `rows` (<= kRegisterRows) rows of xt [in, rows] and every panel p
// in [p0, p1), y's rows w.out apart.
template <WeightFormat F>
inline void product_panels(const PackedWeight& w, const float* xt, int64_t rows, float* y, const float* bias, int64_t p0,
                           int64_t p1, bool avx512) {
  float acc[kRegisterRows * kPanelWidth];
#ifdef SPECDEC_X86_AVX512_KERNELS
  if (avx512 && rows <= kRegisterRows / 2) {
    // Two streams at once, the first half of the panels beside the second: one stream per core
    // left the memory idle between misses (10-25% slower for 2 to 6 rows here).
    float other[kRegisterRows * kPanelWidth];
    float* const both[2] = {acc, other};
    const int64_t half = (p1 - p0) / 2;
    for (int64_t p = p0; p < p0 + half; ++p) {
      const int64_t panels[2] = {p, p + half};
      panels_rows_avx512<F, 2>(w, panels, xt, rows, both);
      store_panel(w, p, acc, rows, y, bias);
      store_panel(w, p + half, other, rows, y, bias);
    }
    p0 += 2 * half;
  }
#endif
  for (int64_t p = p0; p < p1; ++p) {
#ifdef SPECDEC_X86_AVX512_KERNELS
    if (avx512) {
      float* const one[1] = {acc};
      panels_rows_avx512<F, 1>(w, &p, xt, rows, one);
    } else {
      panel_portable<F>(w, p, xt, rows, acc);
    }
#else
    (void)avx512;
    panel_portable<F>(w, p, xt, rows, acc);
#endif
    store_panel(w, p, acc, rows, y, bias);
  }
}

}  // namespace packed

// y [rows, w.out] = x [rows, w.in] times W transposed, times the per-output scales (int8), plus
// `bias` [out] where not null, for x and y contiguous fp32 rows that do not overlap. Each panel
// of W is read from memory once per call for up to kRegisterRows rows (each thread its share of
// the panels, in one sequential stream); meant for the few rows of a decoding forward, where the
// weights' bytes, not the arithmetic, bound the time. `avx512` false runs the portable loops
// (tests); true runs the AVX-512 ones where the CPU has them.
// Requires: w.in, w.out >= 1; w.scales given exactly for i8.
inline void packed_product(const PackedWeight& w, const float* x, int64_t rows, float* y, const float* bias,
                           bool avx512 = true) {
  const bool vector = avx512 && cpu_has_avx512();
  const int64_t panels = (w.out + kPanelWidth - 1) / kPanelWidth;
  const int64_t element = w.format == WeightFormat::f32 ? 4 : w.format == WeightFormat::bf16 ? 2 : 1;
  // A thread's share is worth its start where it streams at least 256 KiB of weights.
  const int64_t panel_bytes = kPanelWidth * w.in * element;
  const int64_t grain = std::max<int64_t>(1, (int64_t{256} << 10) / std::max<int64_t>(1, panel_bytes));
  // Up to kRegisterRows rows per pass over W, each pass's rows transposed first: a panel's
  // input i then needs the rows' values side by side (rows of x lie a power of two apart in
  // real models, and would share the first-level cache's sets).
  thread_local std::vector<float> transposed;
  if (transposed.size() < static_cast<size_t>(w.in * packed::kRegisterRows)) {
    transposed.resize(static_cast<size_t>(w.in * packed::kRegisterRows));
  }
  for (int64_t first = 0; first < rows; first += packed::kRegisterRows) {
    const int64_t count = std::min<int64_t>(packed::kRegisterRows, rows - first);
    float* const xt = transposed.data();
    for (int64_t r = 0; r < count; ++r) {
      const float* row = x + (first + r) * w.in;
      for (int64_t i = 0; i < w.in; ++i) xt[i * count + r] = row[i];
    }
    float* const ys = y + first * w.out;
    at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
      switch (w.format) {
        case WeightFormat::f32: packed::product_panels<WeightFormat::f32>(w, xt, count, ys, bias, begin, end, vector); break;
        case WeightFormat::bf16: packed::product_panels<WeightFormat::bf16>(w, xt, count, ys, bias, begin, end, vector); break;
        case WeightFormat::i8: packed::product_panels<WeightFormat::i8>(w, xt, count, ys, bias, begin, end, vector); break;
      }
    });
  }
}

}  // namespace specdec::detail
