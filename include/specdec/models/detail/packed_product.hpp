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
// Weights may be fp32, bf16 or int8 with one fp32 scale per output (weight-only quantization:
// y = scale * (x . q) + bias). fp32 weights multiply fp32 activations. An int8 product is an
// integer product: each row's activations are quantized to int16 per chunk of 128 inputs
// (s = max |x| over the chunk / 32767, each x rounded to the nearest multiple of s, ties to even),
// each chunk's products of int8 weights and int16 activations are summed exactly in int32, and
// the chunk's sum is added to the output's fp32 sum as fma(float(sum), s, total), chunk after
// chunk. An activation's rounding error is at most 1/65534 of its chunk's largest, so an outlier
// costs the precision of its own 128 inputs only; a chunk holding NaN or infinity gives NaN. The
// pair of inputs (2j, 2j + 1) of an output is one lane of `vpdpwssd` (AVX512-VNNI: 32
// multiply-adds an instruction into int32 sums) or of `vpmaddwd` and an add elsewhere: an int8
// panel holds each output's weights for inputs 2j and 2j + 1 side by side, as a bf16 panel does.
// Before, int8 weights were widened to fp32 and multiplied as fp32 weights, two conversions per
// 16 weights before the multiply-adds: on a 2-core AMD EPYC (Zen 4) a forward of 8 tokens on a
// 1B-parameter target took 89 to 93 ms that way and 45 to 49 by these dot products (one token:
// 21 to 31 ms either way, the memory's time; bench_cpu_target at d35f8cd and 9911f0e).
//
// A bf16 product is a bf16 product: the activations are rounded to bfloat16 (to the nearest, ties
// to even) and each pair of inputs (2j, 2j + 1) is added to the fp32 sum as AVX512-BF16's dot
// product adds it, sum = (sum + x[2j+1] w[2j+1]) + x[2j] w[2j], each step rounded once (a product
// of two bf16 values is exact in fp32). Its panels hold each output's weights for inputs 2j and
// 2j + 1 side by side. Where the CPU has AVX512-BF16 (AMD Zen 4, Intel Cooper Lake and Sapphire
// Rapids on) the products are `vdpbf16ps`, 32 multiply-adds an instruction against 16 for fp32: at
// 7 or more rows the arithmetic, not the memory, bounded a bf16 forward with the weights widened
// to fp32 (a 1B-parameter target, 2 threads of an AMD EPYC: 8 rows at 98 ms against 76 ms for
// one). Elsewhere the same sums come from fused multiply-adds on the widened values, bit for bit
// (what PackedProduct's tests check on a CPU that has both).
//
// The AVX-512 versions, and AVX2/FMA versions for CPUs without AVX-512 (bf16 widened there too),
// are compiled for their instructions whatever the caller's flags and chosen at run time where the
// CPU has them (x86.hpp); elsewhere the same loops run in portable C++ that the compiler
// vectorises for the caller's flags (SSE2 for generic x86-64: no fused multiply-add, 4 lanes).
// Panels are split over libtorch's intra-op threads.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <string>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "specdec/models/detail/x86.hpp"

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

// A weight [out, in] packed in panels (see the top of this file), the last panel padded with zero
// weights: for f32 element (o, i) at data[((o / 32) * in + i) * 32 + o % 32]; for bf16 and i8, in
// pairs of inputs (an odd `in` padded with a zero input), at
// data[(((o / 32) * pairs + i / 2) * 32 + o % 32) * 2 + i % 2] with pairs = (in + 1) / 2.
struct PackedWeight {
  const void* data = nullptr;
  int64_t in = 0;
  int64_t out = 0;
  WeightFormat format = WeightFormat::f32;
  const float* scales = nullptr;  // [out] for i8, null otherwise
};

// An uninitialised CPU tensor of `sizes` and `dtype` in memory the kernel may back with huge
// pages: aligned to 2 MiB and, on Linux, a fresh anonymous mapping marked with
// madvise(MADV_HUGEPAGE) before any of it is touched. A stream through memory in 4 KiB pages takes
// a TLB miss every 4 KiB, and the hardware prefetchers stop at each page's end; with transparent
// huge pages in madvise mode (Debian's default) nothing else would ask for them. The mapping must
// be fresh: memory from the allocator's heap (std::aligned_alloc) may already be faulted in as
// small pages (the fp32 checkpoint freed while packing leaves plenty), and advice does not
// convert those. Where the kernel refuses, the pages stay small.
inline at::Tensor huge_page_tensor(at::IntArrayRef sizes, at::ScalarType dtype) {
  constexpr size_t kHugePage = size_t{2} << 20;
  int64_t elements = 1;
  for (const int64_t size : sizes) elements *= size;
  const size_t bytes = static_cast<size_t>(elements) * at::elementSize(dtype);
  if (bytes < kHugePage) return at::empty(sizes, at::TensorOptions().dtype(dtype));
  const size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  // Map one huge page more than needed and unmap what lies outside the aligned span.
  const size_t span = rounded + kHugePage;
  void* mapped = ::mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapped == MAP_FAILED) throw std::bad_alloc();
  const auto first = reinterpret_cast<std::uintptr_t>(mapped);
  const std::uintptr_t start = (first + kHugePage - 1) / kHugePage * kHugePage;
  if (start > first) ::munmap(mapped, start - first);
  if (const size_t tail = first + span - (start + rounded); tail > 0) {
    ::munmap(reinterpret_cast<void*>(start + rounded), tail);
  }
  void* data = reinterpret_cast<void*>(start);
  (void)::madvise(data, rounded, MADV_HUGEPAGE);  // advice: refused, the pages stay small
  return at::from_blob(data, sizes, [rounded](void* memory) { ::munmap(memory, rounded); },
                       at::TensorOptions().dtype(dtype));
#else
  void* data = std::aligned_alloc(kHugePage, rounded);
  if (data == nullptr) throw std::bad_alloc();
  return at::from_blob(data, sizes, [](void* memory) { std::free(memory); }, at::TensorOptions().dtype(dtype));
#endif
}

// The panels of `weight` [out, in] (any floating dtype, any strides) in `dtype`: kFloat as a
// tensor [panels, in, 32], kBFloat16 or kChar (weights already quantized to integers) as
// [panels, (in + 1) / 2, 32, 2] (PackedWeight's layouts), in memory that may be backed by huge
// pages (huge_page_tensor).
inline at::Tensor pack_panels(const at::Tensor& weight, at::ScalarType dtype) {
  const int64_t out = weight.size(0), in = weight.size(1);
  const int64_t panels = (out + kPanelWidth - 1) / kPanelWidth;
  if (dtype == at::kBFloat16 || dtype == at::kChar) {
    const int64_t pairs = (in + 1) / 2;
    at::Tensor padded = at::zeros({panels * kPanelWidth, 2 * pairs}, weight.options().dtype(dtype));
    padded.narrow(0, 0, out).narrow(1, 0, in).copy_(weight);
    at::Tensor packed = huge_page_tensor({panels, pairs, kPanelWidth, 2}, dtype);
    packed.copy_(padded.view({panels, kPanelWidth, pairs, 2}).permute({0, 2, 1, 3}));
    return packed;
  }
  at::Tensor padded = at::zeros({panels * kPanelWidth, in}, weight.options().dtype(dtype));
  padded.narrow(0, 0, out).copy_(weight);
  at::Tensor packed = huge_page_tensor({panels, in, kPanelWidth}, dtype);
  packed.copy_(padded.view({panels, kPanelWidth, in}).transpose(1, 2));
  return packed;
}

// The weight [out, in] that pack_panels(weight, packed.scalar_type()) packed, in packed's dtype
// (a copy).
inline at::Tensor unpack_panels(const at::Tensor& packed, int64_t out, int64_t in) {
  if (packed.dim() == 4) {  // bf16 and int8: [panels, pairs, 32, 2]
    return packed.permute({0, 2, 1, 3}).reshape({-1, 2 * packed.size(1)}).narrow(0, 0, out).narrow(1, 0, in).contiguous();
  }
  return packed.transpose(1, 2).reshape({-1, in}).narrow(0, 0, out).contiguous();
}

// Which loops packed_product() runs.
enum class PackedLoops : uint8_t {
  best,      // the fastest this CPU has: AVX-512 with bf16 dot products where it has AVX512-BF16
             // and int16 dot products where it has AVX512-VNNI, else AVX-512, else AVX2 with FMA,
             // else portable C++
  avx512,    // AVX-512 with bf16 weights widened to fp32 and int16 products multiplied and added
             // (the same sums), where the CPU has AVX-512
  avx2,      // AVX2 with FMA, bf16 weights widened to fp32 (the same sums), where the CPU has them
  portable,  // portable C++ (the same sums)
};

// How packed_product() computes `format` on this CPU, for a header line: "avx512 loops", "avx512
// loops, bf16 dot products", "avx2 loops", "portable loops" (each saying what the CPU lacks).
inline std::string packed_product_isa(WeightFormat format) {
  if (!cpu_has_avx512()) {
    if (!cpu_has_avx2_fma()) return "portable loops: this CPU has neither AVX-512 nor AVX2 with FMA, slower";
    if (format != WeightFormat::bf16) return "avx2 loops: this CPU has no AVX-512";
    return "avx2 loops: this CPU has no AVX-512, bf16 products widened to fp32";
  }
  if (format == WeightFormat::i8) {
    return cpu_has_avx512_vnni() ? "avx512 loops, int16 dot products"
                                 : "avx512 loops: this CPU has no AVX512-VNNI, int16 products multiplied and added";
  }
  if (format != WeightFormat::bf16) return "avx512 loops";
  return cpu_has_avx512_bf16() ? "avx512 loops, bf16 dot products"
                               : "avx512 loops: this CPU has no AVX512-BF16, bf16 products widened to fp32, slower";
}

namespace packed {

// Rows whose 32 sums stay in registers through a pass over a panel (2 vectors each); up to 6
// rows, two panels are read at once (4 vectors per row).
inline constexpr int kRegisterRows = 12;

// The AVX2/FMA loops. With 16 vector registers of 8 lanes, a panel's 32 sums take 4 registers a
// row, so a pass keeps kAvx2Rows<F> rows in registers (3 for fp32: 12 sums, their 3 broadcast
// inputs and a weight; 2 for bf16, whose rows each need two broadcasts, an input pair's halves;
// 2 for int8, whose loop widens a pair's 4 weight vectors before its multiplies: with 3 rows GCC
// 12 kept 8 of the 12 sums on the stack, loading and storing them at every pair). More rows go
// through a panel in blocks of kAvx2BlockBytes: every group of rows runs over the block before the
// next block starts, the first group reading it from memory (with the software prefetch of the
// AVX-512 loops), the others from the first-level cache. Widening bf16 once per block for every
// group (each pair as two fp32 inputs) cost 3 and 4 rows 20% more than widening in every group,
// and saved nothing at 6 and 8, so bf16 widens in its loop. An int8 block is one chunk of its
// activations' steps (kInt8ChunkPairs pairs of inputs).
template <WeightFormat F>
inline constexpr int kAvx2Rows = F == WeightFormat::f32 ? 3 : 2;
inline constexpr int64_t kAvx2BlockBytes = 4096;

// Pairs of inputs per chunk of an int8 product's activations (128 inputs: see the top of this
// file). A chunk's int32 sums stay far from overflow: 64 pairs of products of at most 128 x
// 32768 in magnitude sum to at most 2^29.
inline constexpr int64_t kInt8ChunkPairs = 64;
static_assert(kAvx2BlockBytes == kInt8ChunkPairs * kPanelWidth * 2, "an AVX2 int8 block is one chunk");

// The largest magnitude an int8 product's activations are quantized to.
inline constexpr float kInt16Steps = 32767.0F;

template <WeightFormat F>
constexpr int64_t element_bytes() {
  return F == WeightFormat::f32 ? 4 : F == WeightFormat::bf16 ? 2 : 1;
}

// Bytes per unit of a panel: one input of fp32, one pair of inputs of bf16 or int8.
template <WeightFormat F>
constexpr int64_t unit_bytes() {
  return kPanelWidth * element_bytes<F>() * (F == WeightFormat::f32 ? 1 : 2);
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

// Portable: fp32 panel p times `rows` rows of x, given transposed (xt [in, rows]), into `acc`
// [rows, 32].
inline void panel_portable(const PackedWeight& w, int64_t p, const float* xt, int64_t rows, float* acc) {
  const float* panel = static_cast<const float*>(w.data) + p * w.in * kPanelWidth;
  std::fill(acc, acc + rows * kPanelWidth, 0.0F);
  for (int64_t i = 0; i < w.in; ++i) {
    const float* weights = panel + i * kPanelWidth;
    for (int64_t r = 0; r < rows; ++r) {
      const float v = xt[i * rows + r];
      float* sums = acc + r * kPanelWidth;
      for (int64_t j = 0; j < kPanelWidth; ++j) sums[j] += v * weights[j];
    }
  }
}

// `value` rounded to bfloat16, to the nearest with ties to even (a NaN stays a NaN), as
// at::BFloat16 rounds: the upper 16 bits of the result.
inline uint16_t round_to_bf16(float value) noexcept {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  if ((bits & 0x7FFFFFFFU) > 0x7F800000U) return static_cast<uint16_t>((bits >> 16) | 0x40U);
  bits += 0x7FFFU + ((bits >> 16) & 1U);
  return static_cast<uint16_t>(bits >> 16);
}

// The fp32 value of the bf16 `bits`.
inline float widen_bf16(uint32_t bits) noexcept {
  const uint32_t wide = bits << 16;
  float value;
  std::memcpy(&value, &wide, sizeof value);
  return value;
}

#ifdef SPECDEC_X86_KERNELS
// round_to_bf16 of each of `n` floats of `row`, 16 a step, into bits[0, n).
SPECDEC_TARGET_AVX512 inline void round_to_bf16_avx512(const float* row, int64_t n, uint16_t* bits) {
  // The zero-masked forms of the shifts (all 16 lanes kept): GCC 12 warns of an uninitialised
  // variable inside the unmasked ones' definitions (so do the widening loops below).
  constexpr __mmask16 kAll = 0xFFFF;
  const __m512i bias = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
  const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF), infinity = _mm512_set1_epi32(0x7F800000);
  const __m512i quiet = _mm512_set1_epi32(0x00400000);  // a NaN's bit 6 of its upper half
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = n - i >= 16 ? kAll : static_cast<__mmask16>((1U << (n - i)) - 1);
    const __m512i value = _mm512_maskz_loadu_epi32(lanes, row + i);
    const __m512i last = _mm512_and_si512(_mm512_maskz_srli_epi32(kAll, value, 16), one);  // the kept part's last bit
    const __m512i rounded = _mm512_add_epi32(value, _mm512_add_epi32(bias, last));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(value, magnitude), infinity);
    const __m512i result = _mm512_mask_or_epi32(rounded, nan, value, quiet);
    _mm512_mask_cvtepi32_storeu_epi16(bits + i, lanes, _mm512_maskz_srli_epi32(kAll, result, 16));
  }
}
#endif

// One row of `in` activations rounded to bf16 (round_to_bf16) into bits[0, in), and bits[in] = 0
// where `in` is odd (a pair's zero pad): read as 32-bit words, the row's pairs of inputs. 16 at a
// step where `vector` (the CPU has AVX-512).
inline void round_pairs(const float* row, int64_t in, uint16_t* bits, bool vector) {
  if (in % 2 == 1) bits[in] = 0;
#ifdef SPECDEC_X86_KERNELS
  if (vector) {
    round_to_bf16_avx512(row, in, bits);
    return;
  }
#else
  (void)vector;
#endif
  for (int64_t i = 0; i < in; ++i) bits[i] = round_to_bf16(row[i]);
}

// The int16 value of x times `inv` (a chunk's 32767 / max |x|), rounded to the nearest, ties to
// even, as `vcvtps2dq` rounds under the default rounding mode.
inline int16_t quantize_int16(float x, float inv) noexcept {
  return static_cast<int16_t>(std::clamp(std::nearbyint(x * inv), -32768.0F, 32767.0F));
}

// A chunk's largest magnitude as the bits of a float, by integer comparison (exact and the same
// in every version; at or above 0x7F800000 where the chunk holds NaN or infinity).
inline uint32_t largest_bits(const float* x, int64_t n, uint32_t largest) noexcept {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, sizeof bits);
    largest = std::max(largest, bits & 0x7FFFFFFFU);
  }
  return largest;
}

// A chunk's step from its largest magnitude's bits, and the factor its activations are
// multiplied by before rounding (0 where they all quantize to 0): NaN for a chunk that holds NaN
// or infinity; 0 for one whose largest magnitude is below 2^-100 (32767 over it would overflow a
// float; such a chunk would add less than 2^-86 times the weights' scale: counted as zero).
struct ChunkScale {
  float step = 0.0F;
  float inv = 0.0F;
};
inline ChunkScale chunk_scale(uint32_t largest) noexcept {
  if (largest >= 0x7F800000U) return {.step = std::numeric_limits<float>::quiet_NaN(), .inv = 0.0F};
  float value;
  std::memcpy(&value, &largest, sizeof value);
  if (value < 0x1p-100F) return {};
  return {.step = value / kInt16Steps, .inv = kInt16Steps / value};
}

#ifdef SPECDEC_X86_KERNELS
// largest_bits by AVX2, 8 activations a step (the tail by largest_bits).
SPECDEC_TARGET_AVX2 inline uint32_t largest_bits_avx2(const float* x, int64_t n) {
  const int64_t whole = n / 8 * 8;
  const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF);
  __m256i most = _mm256_setzero_si256();
  for (int64_t i = 0; i < whole; i += 8) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
    most = _mm256_max_epi32(most, _mm256_and_si256(bits, magnitude));
  }
  alignas(32) uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), most);
  return largest_bits(x + whole, n - whole, *std::max_element(lanes, lanes + 8));
}

// quantize_int16 of each of `n` activations by AVX2, 8 a step (the same rounding of the same
// product; the tail by quantize_int16).
SPECDEC_TARGET_AVX2 inline void quantize_avx2(const float* x, int64_t n, float inv, int16_t* q) {
  const int64_t whole = n / 8 * 8;
  const __m256 factor = _mm256_set1_ps(inv);
  for (int64_t i = 0; i < whole; i += 8) {
    const __m256i rounded = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), factor));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(rounded, rounded), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm256_castsi256_si128(packed));
  }
  for (int64_t i = whole; i < n; ++i) q[i] = quantize_int16(x[i], inv);
}
#endif

// One row of `in` activations quantized for an int8 product (see the top of this file): the
// int16 values into q[0, in), q[in] = 0 where `in` is odd (a pair's zero pad), and chunk c's
// step into steps[c * stride]. 8 at a step where `vector` (the CPU has AVX2).
inline void quantize_row_int16(const float* row, int64_t in, int16_t* q, float* steps, int64_t stride, bool vector) {
  if (in % 2 == 1) q[in] = 0;
  constexpr int64_t kChunk = 2 * kInt8ChunkPairs;
  for (int64_t first = 0, c = 0; first < in; first += kChunk, ++c) {
    const int64_t n = std::min(kChunk, in - first);
    const float* const x = row + first;
    int16_t* const out = q + first;
#ifdef SPECDEC_X86_KERNELS
    const ChunkScale scale = chunk_scale(vector ? largest_bits_avx2(x, n) : largest_bits(x, n, 0));
#else
    (void)vector;
    const ChunkScale scale = chunk_scale(largest_bits(x, n, 0));
#endif
    steps[c * stride] = scale.step;
    if (scale.inv == 0.0F) {  // zeros, or NaN or infinity (whose step makes the sums NaN)
      std::fill(out, out + n, int16_t{0});
      continue;
    }
#ifdef SPECDEC_X86_KERNELS
    if (vector) {
      quantize_avx2(x, n, scale.inv, out);
      continue;
    }
#endif
    for (int64_t i = 0; i < n; ++i) out[i] = quantize_int16(x[i], scale.inv);
  }
}

// Portable: int8 panel p times `rows` rows of int16 activations given as pairs (xp [pairs, rows]:
// a row's inputs 2j and 2j + 1 in the low and high halves of xp[j * rows + r]) with their chunks'
// steps (steps [chunks, rows]), into `acc` [rows, 32]: each chunk's products summed in int32,
// then acc = fma(float(sum), step, acc).
inline void int8_panel_portable(const PackedWeight& w, int64_t p, const uint32_t* xp, const float* steps, int64_t rows,
                                float* acc) {
  const int64_t pairs = (w.in + 1) / 2;
  const int8_t* panel = static_cast<const int8_t*>(w.data) + p * pairs * kPanelWidth * 2;
  std::fill(acc, acc + rows * kPanelWidth, 0.0F);
  int32_t sums[kRegisterRows * kPanelWidth];
  for (int64_t first = 0; first < pairs; first += kInt8ChunkPairs) {
    std::fill(sums, sums + rows * kPanelWidth, 0);
    for (int64_t j = first; j < std::min(pairs, first + kInt8ChunkPairs); ++j) {
      const int8_t* line = panel + j * kPanelWidth * 2;
      for (int64_t r = 0; r < rows; ++r) {
        const uint32_t pair = xp[j * rows + r];
        const int32_t even = static_cast<int16_t>(pair & 0xFFFFU), odd = static_cast<int16_t>(pair >> 16);
        int32_t* row = sums + r * kPanelWidth;
        for (int64_t k = 0; k < kPanelWidth; ++k) row[k] += line[2 * k] * even + line[2 * k + 1] * odd;
      }
    }
    const float* step = steps + first / kInt8ChunkPairs * rows;
    for (int64_t e = 0; e < rows * kPanelWidth; ++e) {
      acc[e] = std::fma(static_cast<float>(sums[e]), step[e / kPanelWidth], acc[e]);
    }
  }
}

// Portable: bf16 panel p times `rows` rows of x given as pairs (xp [pairs, rows]: a row's inputs
// 2j and 2j + 1 rounded to bf16 in the low and high halves of xp[j * rows + r]), into `acc`
// [rows, 32]: per pair, sum = (sum + x[2j+1] w[2j+1]) + x[2j] w[2j] (both products exact).
inline void bf16_panel_portable(const PackedWeight& w, int64_t p, const uint32_t* xp, int64_t rows, float* acc) {
  const int64_t pairs = (w.in + 1) / 2;
  const uint16_t* panel = static_cast<const uint16_t*>(w.data) + p * pairs * kPanelWidth * 2;
  std::fill(acc, acc + rows * kPanelWidth, 0.0F);
  for (int64_t j = 0; j < pairs; ++j) {
    float even[kPanelWidth], odd[kPanelWidth];
    const uint16_t* line = panel + j * kPanelWidth * 2;
    for (int64_t k = 0; k < kPanelWidth; ++k) {
      even[k] = widen_bf16(line[2 * k]);
      odd[k] = widen_bf16(line[2 * k + 1]);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const uint32_t pair = xp[j * rows + r];
      const float x_even = widen_bf16(pair & 0xFFFFU), x_odd = widen_bf16(pair >> 16);
      float* sums = acc + r * kPanelWidth;
      for (int64_t k = 0; k < kPanelWidth; ++k) sums[k] = (sums[k] + x_odd * odd[k]) + x_even * even[k];
    }
  }
}

#ifdef SPECDEC_X86_KERNELS
// How a stream asks for its weights ahead of its loads (software prefetch), by the rows R of its
// pass. The hardware prefetchers alone left the loads waiting on memory whenever the arithmetic
// between them grew: on a 1B-parameter target's products (2 threads, Intel Xeon with AVX-512)
// each line into the first-level cache kPrefetchBytes ahead took 8 rows from 174 to 105 ms in
// bf16 and from 283 to 203 ms in fp32, and one row from 96 to 78 ms in bf16 and 58 to 48 ms in
// int8 (1 to 4 KiB ahead were within noise of each other). Passes of up to kRegisterRows / 2 rows
// (two streams, bound by the memory) do that.
//
// Passes of more rows (one stream, the arithmetic about as long as the stream where the memory is
// fast) ask for each line twice: into the first-level cache kNearBytes ahead and into the
// second-level one kFarBytes ahead. Into the first level alone, the loads of 8 rows still waited:
// the products of one forward of a 1B-parameter target of TinyLlama's shape (2 threads of a
// 2-core AMD EPYC, Zen 4, in the moments its memory read about 65 GB/s) took 46.5 to 46.9 ms for
// 8 rows in bf16 and 87.4 in fp32 that way (one row: 34.2 to 36.1 and 64.8 to 65.5), and 39.1 to
// 39.4 and 75.5 to 76.1 with both levels. Where the memory read about 37 GB/s, the two ways were
// within 3% of each other. Asking for the lines of one-row passes into the second level instead
// made those slower (bf16 38.9 to 40.8 ms).
inline constexpr int64_t kPrefetchBytes = 4096;
inline constexpr int64_t kNearBytes = 2048;
inline constexpr int64_t kFarBytes = 16384;

// Asks for the `bytes` (a multiple of 64) of a stream at `line` ahead of its loads, as a pass of R
// rows does (above). The AVX2 loops' passes (at most kAvx2Rows rows) take the first-level way.
template <int R, int64_t bytes>
SPECDEC_TARGET_AVX2 __attribute__((always_inline)) inline void prefetch_stream(const char* line) {
  static_assert(bytes % 64 == 0);
#pragma GCC unroll 2
  for (int64_t c = 0; c < bytes; c += 64) {
    if constexpr (R > kRegisterRows / 2) {
      _mm_prefetch(line + kNearBytes + c, _MM_HINT_T0);
      _mm_prefetch(line + kFarBytes + c, _MM_HINT_T1);
    } else {
      _mm_prefetch(line + kPrefetchBytes + c, _MM_HINT_T0);
    }
  }
}

// The 2PR sums of P panels over R rows (each row's 32 sums as two vectors), kept in registers by
// the loops below: made zero, then stored to acc[j] [R, 32] for panel j.
template <int R, int P>
struct PanelSums {
  __m512 lo[P][R], hi[P][R];

  SPECDEC_TARGET_AVX512 __attribute__((always_inline)) inline PanelSums() {
#pragma GCC unroll 2
    for (int j = 0; j < P; ++j) {
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) lo[j][r] = hi[j][r] = _mm512_setzero_ps();
    }
  }

  SPECDEC_TARGET_AVX512 __attribute__((always_inline)) inline void store(float* const* acc) const {
#pragma GCC unroll 2
    for (int j = 0; j < P; ++j) {
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) {
        _mm512_storeu_ps(acc[j] + r * kPanelWidth, lo[j][r]);
        _mm512_storeu_ps(acc[j] + r * kPanelWidth + 16, hi[j][r]);
      }
    }
  }
};

// P fp32 panels (P streams from P places in memory) times R rows of x, given transposed (xt
// [in, R]: each input's R values side by side), into acc[j] [R, 32] for panel panels[j]: the 2PR
// sums in registers over every input.
template <int R, int P>
SPECDEC_TARGET_AVX512 inline void panels_avx512(const PackedWeight& w, const int64_t* panels, const float* xt,
                                                float* const* acc) {
  constexpr int64_t kStep = kPanelWidth * 4;  // bytes per input in a panel
  const char* line[P];
  PanelSums<R, P> sums;
#pragma GCC unroll 2
  for (int j = 0; j < P; ++j) line[j] = static_cast<const char*>(w.data) + panels[j] * w.in * kStep;
  for (int64_t i = 0; i < w.in; ++i, xt += R) {
    __m512 a[P], b[P];
#pragma GCC unroll 2
    for (int j = 0; j < P; ++j) {
      // Each cache line of the stream ahead (past a panel's end: the next panel's start, or an
      // address the prefetch ignores).
      prefetch_stream<R, kStep>(line[j]);
      a[j] = _mm512_loadu_ps(reinterpret_cast<const float*>(line[j]));
      b[j] = _mm512_loadu_ps(reinterpret_cast<const float*>(line[j] + kStep / 2));
      line[j] += kStep;
    }
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 v = _mm512_set1_ps(xt[r]);
#pragma GCC unroll 2
      for (int j = 0; j < P; ++j) {
        sums.lo[j][r] = _mm512_fmadd_ps(v, a[j], sums.lo[j][r]);
        sums.hi[j][r] = _mm512_fmadd_ps(v, b[j], sums.hi[j][r]);
      }
    }
  }
  sums.store(acc);
}

// The bf16 panels' prefetch, loads and pointer step for one pair of inputs (64 bytes: 16
// outputs' two weights; a pair line is two of them).
struct Bf16Stream {
  static constexpr int64_t kStep = kPanelWidth * 2 * 2;  // bytes per pair of inputs in a panel
  const char* line = nullptr;

  // Starts the streams of panels[0 .. P) of w; returns the pairs of inputs each holds.
  template <int P>
  static int64_t start(Bf16Stream (&stream)[P], const PackedWeight& w, const int64_t* panels) {
    const int64_t pairs = (w.in + 1) / 2;
    for (int j = 0; j < P; ++j) stream[j].line = static_cast<const char*>(w.data) + panels[j] * pairs * kStep;
    return pairs;
  }

  // R: the rows of the pass (prefetch_stream).
  template <int R>
  SPECDEC_TARGET_AVX512 __attribute__((always_inline)) inline void next(__m512i& low, __m512i& high) {
    prefetch_stream<R, kStep>(line);
    low = _mm512_loadu_si512(line);
    high = _mm512_loadu_si512(line + 64);
    line += kStep;
  }
};

// P bf16 panels times R rows of x given as pairs (xp [pairs, R], see bf16_panel_portable) into
// acc[j] [R, 32], by AVX512-BF16's dot products: 32 multiply-adds an instruction.
template <int R, int P>
SPECDEC_TARGET_AVX512_BF16 inline void bf16_panels_dot(const PackedWeight& w, const int64_t* panels, const uint32_t* xp,
                                                       float* const* acc) {
  Bf16Stream stream[P];
  const int64_t pairs = Bf16Stream::start(stream, w, panels);
  PanelSums<R, P> sums;
  for (int64_t i = 0; i < pairs; ++i, xp += R) {
#pragma GCC unroll 2
    for (int j = 0; j < P; ++j) {
      __m512i a, b;
      stream[j].template next<R>(a, b);
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) {
        const __m512i x = _mm512_set1_epi32(static_cast<int>(xp[r]));
        sums.lo[j][r] = _mm512_dpbf16_ps(sums.lo[j][r], (__m512bh)x, (__m512bh)a);
        sums.hi[j][r] = _mm512_dpbf16_ps(sums.hi[j][r], (__m512bh)x, (__m512bh)b);
      }
    }
  }
  sums.store(acc);
}

// bf16_panels_dot's sums, bit for bit, on a CPU without AVX512-BF16: each pair's two weights
// widened to fp32 (the low half shifted up, the high half masked), two fused multiply-adds.
template <int R, int P>
SPECDEC_TARGET_AVX512 inline void bf16_panels_widened(const PackedWeight& w, const int64_t* panels, const uint32_t* xp,
                                                      float* const* acc) {
  constexpr __mmask16 kAll = 0xFFFF;  // the zero-masked shift: see round_to_bf16_avx512
  const __m512i upper = _mm512_set1_epi32(static_cast<int>(0xFFFF0000U));
  Bf16Stream stream[P];
  const int64_t pairs = Bf16Stream::start(stream, w, panels);
  PanelSums<R, P> sums;
  for (int64_t i = 0; i < pairs; ++i, xp += R) {
#pragma GCC unroll 2
    for (int j = 0; j < P; ++j) {
      __m512i a, b;
      stream[j].template next<R>(a, b);
      const __m512 a_even = _mm512_castsi512_ps(_mm512_maskz_slli_epi32(kAll, a, 16));
      const __m512 a_odd = _mm512_castsi512_ps(_mm512_and_si512(a, upper));
      const __m512 b_even = _mm512_castsi512_ps(_mm512_maskz_slli_epi32(kAll, b, 16));
      const __m512 b_odd = _mm512_castsi512_ps(_mm512_and_si512(b, upper));
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) {
        const __m512i x = _mm512_set1_epi32(static_cast<int>(xp[r]));
        const __m512 x_even = _mm512_castsi512_ps(_mm512_maskz_slli_epi32(kAll, x, 16));
        const __m512 x_odd = _mm512_castsi512_ps(_mm512_and_si512(x, upper));
        sums.lo[j][r] = _mm512_fmadd_ps(x_even, a_even, _mm512_fmadd_ps(x_odd, a_odd, sums.lo[j][r]));
        sums.hi[j][r] = _mm512_fmadd_ps(x_even, b_even, _mm512_fmadd_ps(x_odd, b_odd, sums.hi[j][r]));
      }
    }
  }
  sums.store(acc);
}

// The int8 panels' prefetch, loads and pointer step for one pair of inputs (64 bytes: 32
// outputs' two weights), each 16-output half widened to int16.
struct Int8Stream {
  static constexpr int64_t kStep = kPanelWidth * 2;  // bytes per pair of inputs in a panel
  const char* line = nullptr;

  // Starts the streams of panels[0 .. P) of w; returns the pairs of inputs each holds.
  template <int P>
  static int64_t start(Int8Stream (&stream)[P], const PackedWeight& w, const int64_t* panels) {
    const int64_t pairs = (w.in + 1) / 2;
    for (int j = 0; j < P; ++j) stream[j].line = static_cast<const char*>(w.data) + panels[j] * pairs * kStep;
    return pairs;
  }

  // R: the rows of the pass (prefetch_stream).
  template <int R>
  SPECDEC_TARGET_AVX512 __attribute__((always_inline)) inline void next(__m512i& low, __m512i& high) {
    constexpr __mmask32 kAll = 0xFFFFFFFFU;  // the zero-masked widening: see round_to_bf16_avx512
    prefetch_stream<R, kStep>(line);
    low = _mm512_maskz_cvtepi8_epi16(kAll, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line)));
    high = _mm512_maskz_cvtepi8_epi16(kAll, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 32)));
    line += kStep;
  }
};

// The int32 sums of one chunk of P int8 panels over R rows (each row's 32 sums as two vectors),
// in registers: made zero, then added to acc[j] [R, 32] as fma(float(sum), step, acc).
template <int R, int P>
struct Int8Sums {
  __m512i lo[P][R], hi[P][R];

  SPECDEC_TARGET_AVX512 __attribute__((always_inline)) inline Int8Sums() {
#pragma GCC unroll 2
    for (int j = 0; j < P; ++j) {
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) lo[j][r] = hi[j][r] = _mm512_setzero_si512();
    }
  }

  // step [R]: the rows' steps for this chunk.
  SPECDEC_TARGET_AVX512 __attribute__((always_inline)) inline void add_to(float* const* acc, const float* step) const {
    constexpr __mmask16 kAll = 0xFFFF;  // the zero-masked conversion: see round_to_bf16_avx512
#pragma GCC unroll 2
    for (int j = 0; j < P; ++j) {
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) {
        const __m512 scale = _mm512_set1_ps(step[r]);
        float* const out = acc[j] + r * kPanelWidth;
        const __m512 low = _mm512_maskz_cvtepi32_ps(kAll, lo[j][r]), high = _mm512_maskz_cvtepi32_ps(kAll, hi[j][r]);
        _mm512_storeu_ps(out, _mm512_fmadd_ps(low, scale, _mm512_loadu_ps(out)));
        _mm512_storeu_ps(out + 16, _mm512_fmadd_ps(high, scale, _mm512_loadu_ps(out + 16)));
      }
    }
  }
};

// P int8 panels times R rows of int16 activations given as pairs (xp [pairs, R], see
// int8_panel_portable) with their chunks' steps (steps [chunks, R]) into acc[j] [R, 32], by
// AVX512-VNNI's dot products (`vpdpwssd`: 32 multiply-adds an instruction, a lane's two products
// added to its int32 sum), chunk by chunk, as int8_panel_portable adds them.
template <int R, int P>
SPECDEC_TARGET_AVX512_VNNI inline void int8_panels_dot(const PackedWeight& w, const int64_t* panels, const uint32_t* xp,
                                                       const float* steps, float* const* acc) {
  Int8Stream stream[P];
  const int64_t pairs = Int8Stream::start(stream, w, panels);
  for (int j = 0; j < P; ++j) std::fill(acc[j], acc[j] + R * kPanelWidth, 0.0F);
  for (int64_t first = 0; first < pairs; first += kInt8ChunkPairs, steps += R) {
    Int8Sums<R, P> sums;
    for (int64_t i = first; i < std::min(pairs, first + kInt8ChunkPairs); ++i, xp += R) {
#pragma GCC unroll 2
      for (int j = 0; j < P; ++j) {
        __m512i a, b;
        stream[j].template next<R>(a, b);
#pragma GCC unroll 12
        for (int r = 0; r < R; ++r) {
          const __m512i x = _mm512_set1_epi32(static_cast<int>(xp[r]));
          sums.lo[j][r] = _mm512_dpwssd_epi32(sums.lo[j][r], a, x);
          sums.hi[j][r] = _mm512_dpwssd_epi32(sums.hi[j][r], b, x);
        }
      }
    }
    sums.add_to(acc, steps);
  }
}

// int8_panels_dot's sums on a CPU without AVX512-VNNI: `vpmaddwd` and an add (the same int32
// sums: no pair of products here comes near overflow).
template <int R, int P>
SPECDEC_TARGET_AVX512 inline void int8_panels_madd(const PackedWeight& w, const int64_t* panels, const uint32_t* xp,
                                                   const float* steps, float* const* acc) {
  Int8Stream stream[P];
  const int64_t pairs = Int8Stream::start(stream, w, panels);
  for (int j = 0; j < P; ++j) std::fill(acc[j], acc[j] + R * kPanelWidth, 0.0F);
  for (int64_t first = 0; first < pairs; first += kInt8ChunkPairs, steps += R) {
    Int8Sums<R, P> sums;
    for (int64_t i = first; i < std::min(pairs, first + kInt8ChunkPairs); ++i, xp += R) {
#pragma GCC unroll 2
      for (int j = 0; j < P; ++j) {
        __m512i a, b;
        stream[j].template next<R>(a, b);
#pragma GCC unroll 12
        for (int r = 0; r < R; ++r) {
          const __m512i x = _mm512_set1_epi32(static_cast<int>(xp[r]));
          sums.lo[j][r] = _mm512_add_epi32(sums.lo[j][r], _mm512_madd_epi16(a, x));
          sums.hi[j][r] = _mm512_add_epi32(sums.hi[j][r], _mm512_madd_epi16(b, x));
        }
      }
    }
    sums.add_to(acc, steps);
  }
}

// R rows' 32 sums as 4 vectors each, in registers through the AVX2 loops: loaded from acc [R, 32]
// and stored back.
template <int R>
struct Avx2Sums {
  __m256 v[R][4];

  SPECDEC_TARGET_AVX2 __attribute__((always_inline)) inline explicit Avx2Sums(const float* acc) {
#pragma GCC unroll 3
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) v[r][g] = _mm256_loadu_ps(acc + r * kPanelWidth + 8 * g);
    }
  }

  SPECDEC_TARGET_AVX2 __attribute__((always_inline)) inline void store(float* acc) const {
#pragma GCC unroll 3
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) _mm256_storeu_ps(acc + r * kPanelWidth + 8 * g, v[r][g]);
    }
  }
};

// `count` inputs of an fp32 panel from `line` times R rows (input i's R values side by side at
// xt + i * stride) added to acc [R, 32].
template <int R>
SPECDEC_TARGET_AVX2 inline void block_avx2(const char* line, int64_t count, const float* xt, int64_t stride, float* acc) {
  constexpr int64_t kStep = kPanelWidth * 4;
  Avx2Sums<R> sums(acc);
  for (int64_t i = 0; i < count; ++i, line += kStep, xt += stride) {
    prefetch_stream<R, kStep>(line);
    __m256 x[R];
#pragma GCC unroll 3
    for (int r = 0; r < R; ++r) x[r] = _mm256_broadcast_ss(xt + r);
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {
      const __m256 weights = _mm256_loadu_ps(reinterpret_cast<const float*>(line + g * kStep / 4));
#pragma GCC unroll 3
      for (int r = 0; r < R; ++r) sums.v[r][g] = _mm256_fmadd_ps(x[r], weights, sums.v[r][g]);
    }
  }
  sums.store(acc);
}

// `count` pairs of a bf16 panel from `line` times R rows given as pairs (pair j's R values side by
// side at xp + j * stride) added to acc [R, 32], each pair's two weights widened to fp32 (the low
// half shifted up, the high half masked) and added as bf16_panel_portable adds them, bit for bit.
template <int R>
SPECDEC_TARGET_AVX2 inline void bf16_block_avx2(const char* line, int64_t count, const uint32_t* xp, int64_t stride,
                                                float* acc) {
  constexpr int64_t kStep = kPanelWidth * 2 * 2;
  const __m256i upper = _mm256_set1_epi32(static_cast<int>(0xFFFF0000U));
  Avx2Sums<R> sums(acc);
  for (int64_t i = 0; i < count; ++i, line += kStep, xp += stride) {
    prefetch_stream<R, kStep>(line);
    __m256 x_even[R], x_odd[R];
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_set1_epi32(static_cast<int>(xp[r]));
      x_even[r] = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
      x_odd[r] = _mm256_castsi256_ps(_mm256_and_si256(x, upper));
    }
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {
      const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 32 * g));
      const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
      const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(pairs, upper));
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) {
        sums.v[r][g] = _mm256_fmadd_ps(x_even[r], even, _mm256_fmadd_ps(x_odd[r], odd, sums.v[r][g]));
      }
    }
  }
  sums.store(acc);
}

// `count` pairs of an int8 panel from `line` (at most one chunk) times R rows of int16
// activations given as pairs (pair j's R values side by side at xp + j * stride), the rows'
// steps for this chunk at step[0, R): the products summed in int32 (`vpmaddwd`: a lane's two
// products added), then added to acc [R, 32] as fma(float(sum), step, acc), as
// int8_panel_portable adds them.
template <int R>
SPECDEC_TARGET_AVX2 inline void int8_block_avx2(const char* line, int64_t count, const uint32_t* xp, int64_t stride,
                                                const float* step, float* acc) {
  constexpr int64_t kStep = kPanelWidth * 2;
  __m256i sums[R][4];
#pragma GCC unroll 2
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) sums[r][g] = _mm256_setzero_si256();
  }
  for (int64_t i = 0; i < count; ++i, line += kStep, xp += stride) {
    prefetch_stream<R, kStep>(line);
    __m256i x[R];
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) x[r] = _mm256_set1_epi32(static_cast<int>(xp[r]));
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {
      // 8 outputs' pairs of weights, widened to int16.
      const __m256i weights = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(line + 16 * g)));
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) sums[r][g] = _mm256_add_epi32(sums[r][g], _mm256_madd_epi16(weights, x[r]));
    }
  }
#pragma GCC unroll 2
  for (int r = 0; r < R; ++r) {
    const __m256 scale = _mm256_set1_ps(step[r]);
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {
      float* const out = acc + r * kPanelWidth + 8 * g;
      _mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][g]), scale, _mm256_loadu_ps(out)));
    }
  }
}

// Panel p times `rows` rows (xt: fp32 [in, rows]; bf16 or int16 pairs [pairs, rows], with the
// int16 chunks' steps [chunks, rows]) into acc [rows, 32] by the AVX2 loops, block by block (see
// kAvx2Rows).
template <WeightFormat F>
inline void panel_avx2(const PackedWeight& w, int64_t p, const void* xt, const float* steps, int64_t rows, float* acc) {
  constexpr int64_t kStep = unit_bytes<F>();
  constexpr int64_t kBlock = kAvx2BlockBytes / kStep;  // units (inputs; pairs for bf16 and int8) a block
  const int64_t units = F == WeightFormat::f32 ? w.in : (w.in + 1) / 2;
  const char* panel = static_cast<const char*>(w.data) + p * units * kStep;
  std::fill(acc, acc + rows * kPanelWidth, 0.0F);
  for (int64_t start = 0; start < units; start += kBlock) {
    const int64_t count = std::min(kBlock, units - start);
    const char* line = panel + start * kStep;
    for (int64_t first = 0; first < rows; first += kAvx2Rows<F>) {
      float* const sums = acc + first * kPanelWidth;
      const int64_t group = std::min<int64_t>(kAvx2Rows<F>, rows - first);
      if constexpr (F == WeightFormat::bf16) {
        const uint32_t* xp = static_cast<const uint32_t*>(xt) + start * rows + first;
        if (group == 2) {
          bf16_block_avx2<2>(line, count, xp, rows, sums);
        } else {
          bf16_block_avx2<1>(line, count, xp, rows, sums);
        }
      } else if constexpr (F == WeightFormat::i8) {
        const uint32_t* xp = static_cast<const uint32_t*>(xt) + start * rows + first;
        const float* step = steps + start / kInt8ChunkPairs * rows + first;
        if (group == 2) {
          int8_block_avx2<2>(line, count, xp, rows, step, sums);
        } else {
          int8_block_avx2<1>(line, count, xp, rows, step, sums);
        }
      } else {
        const float* x = static_cast<const float*>(xt) + start * rows + first;
        switch (group) {
          case 1: block_avx2<1>(line, count, x, rows, sums); break;
          case 2: block_avx2<2>(line, count, x, rows, sums); break;
          default: block_avx2<3>(line, count, x, rows, sums); break;
        }
      }
    }
  }
}

// Calls run.template operator()<R>() with R = rows: up to kRegisterRows rows for one panel, up
// to kRegisterRows / 2 for two.
template <int P, class Run>
inline void with_row_count(int64_t rows, Run&& run) {
  static_assert(P == 1 || P == 2);
  with_count<P == 1 ? kRegisterRows : kRegisterRows / 2>(rows, std::forward<Run>(run));
}

// P panels times `rows` rows of x (xt: fp32 [in, rows]; bf16 pairs [pairs, rows] for a bf16
// weight; int16 pairs [pairs, rows] and their chunks' steps for an int8 one) by the AVX-512
// loops: for bf16 and int8 the dot products where `dot`, else widened or multiplied and added.
template <WeightFormat F, int P>
inline void panels_rows_avx512(const PackedWeight& w, const int64_t* panels, const void* xt, const float* steps,
                               int64_t rows, float* const* acc, bool dot) {
  with_row_count<P>(rows, [&]<int R>() {
    if constexpr (F == WeightFormat::i8) {
      const auto* xp = static_cast<const uint32_t*>(xt);
      if (dot) {
        int8_panels_dot<R, P>(w, panels, xp, steps, acc);
      } else {
        int8_panels_madd<R, P>(w, panels, xp, steps, acc);
      }
    } else if constexpr (F == WeightFormat::bf16) {
      const auto* xp = static_cast<const uint32_t*>(xt);
      if (dot) {
        bf16_panels_dot<R, P>(w, panels, xp, acc);
      } else {
        bf16_panels_widened<R, P>(w, panels, xp, acc);
      }
    } else {
      panels_avx512<R, P>(w, panels, static_cast<const float*>(xt), acc);
    }
  });
}
#endif

// How a call's panels are computed: the instruction set of the loops, and for bf16 and int8 on
// AVX-512 whether by their dot products (AVX512-BF16, AVX512-VNNI).
enum class Isa : uint8_t { portable, avx2, avx512 };
struct Loops {
  Isa isa = Isa::portable;
  bool dot = false;
};

// Panel p times the rows into `acc` [rows, 32] by the portable loops.
template <WeightFormat F>
inline void panel_portable_any(const PackedWeight& w, int64_t p, const void* xt, const float* steps, int64_t rows,
                               float* acc) {
  if constexpr (F == WeightFormat::bf16) {
    bf16_panel_portable(w, p, static_cast<const uint32_t*>(xt), rows, acc);
  } else if constexpr (F == WeightFormat::i8) {
    int8_panel_portable(w, p, static_cast<const uint32_t*>(xt), steps, rows, acc);
  } else {
    panel_portable(w, p, static_cast<const float*>(xt), rows, acc);
  }
}

// y[r][32p, 32p + 32) for the `rows` (<= kRegisterRows) rows of xt (fp32 [in, rows]; bf16 pairs
// [pairs, rows] for a bf16 weight; int16 pairs [pairs, rows] and their chunks' steps [chunks,
// rows] for an int8 weight) and every panel p in [p0, p1), y's rows w.out apart.
template <WeightFormat F>
inline void product_panels(const PackedWeight& w, const void* xt, const float* steps, int64_t rows, float* y,
                           const float* bias, int64_t p0, int64_t p1, Loops loops) {
  float acc[kRegisterRows * kPanelWidth];
#ifdef SPECDEC_X86_KERNELS
  if (loops.isa == Isa::avx512 && rows <= kRegisterRows / 2) {
    // Two streams at once, the first half of the panels beside the second: one stream per core
    // left the memory idle between misses (10-25% slower for 2 to 6 rows here).
    float other[kRegisterRows * kPanelWidth];
    float* const both[2] = {acc, other};
    const int64_t half = (p1 - p0) / 2;
    for (int64_t p = p0; p < p0 + half; ++p) {
      const int64_t panels[2] = {p, p + half};
      panels_rows_avx512<F, 2>(w, panels, xt, steps, rows, both, loops.dot);
      store_panel(w, p, acc, rows, y, bias);
      store_panel(w, p + half, other, rows, y, bias);
    }
    p0 += 2 * half;
  }
#endif
  for (int64_t p = p0; p < p1; ++p) {
#ifdef SPECDEC_X86_KERNELS
    if (loops.isa == Isa::avx512) {
      float* const one[1] = {acc};
      panels_rows_avx512<F, 1>(w, &p, xt, steps, rows, one, loops.dot);
    } else if (loops.isa == Isa::avx2) {
      panel_avx2<F>(w, p, xt, steps, rows, acc);
    } else {
      panel_portable_any<F>(w, p, xt, steps, rows, acc);
    }
#else
    (void)loops;  // portable loops only
    panel_portable_any<F>(w, p, xt, steps, rows, acc);
#endif
    store_panel(w, p, acc, rows, y, bias);
  }
}

}  // namespace packed

// y [rows, w.out] = x [rows, w.in] times W transposed, times the per-output scales (int8), plus
// `bias` [out] where not null, for x and y contiguous fp32 rows that do not overlap; for a bf16 W,
// with x rounded to bf16, for an int8 W with x quantized to int16 per chunk (see the top of this
// file). Each panel of W is read from memory once per call for up to kRegisterRows rows (each
// thread its share of the panels, in one sequential stream); meant for the few rows of a decoding
// forward, where the weights' bytes, not the arithmetic, bound the time. `loops` picks the
// version (PackedLoops; one the CPU lacks falls back to the next); every version computes the same
// sums.
// Requires: w.in, w.out >= 1; w.scales given exactly for i8.
inline void packed_product(const PackedWeight& w, const float* x, int64_t rows, float* y, const float* bias,
                           PackedLoops loops = PackedLoops::best) {
  const bool vector = (loops == PackedLoops::best || loops == PackedLoops::avx512) && cpu_has_avx512();
  const bool avx2 = !vector && loops != PackedLoops::portable && cpu_has_avx2_fma();
  const bool dot = w.format == WeightFormat::bf16 ? cpu_has_avx512_bf16()
                   : w.format == WeightFormat::i8 ? cpu_has_avx512_vnni()
                                                  : false;
  const packed::Loops chosen{.isa = vector ? packed::Isa::avx512 : avx2 ? packed::Isa::avx2 : packed::Isa::portable,
                             .dot = vector && loops == PackedLoops::best && dot};
  const int64_t panels = (w.out + kPanelWidth - 1) / kPanelWidth;
  const int64_t element = w.format == WeightFormat::f32 ? 4 : w.format == WeightFormat::bf16 ? 2 : 1;
  const int64_t pairs = (w.in + 1) / 2;
  const int64_t chunks = (pairs + packed::kInt8ChunkPairs - 1) / packed::kInt8ChunkPairs;
  const bool in_pairs = w.format != WeightFormat::f32;
  // A thread's share is worth its start where it streams at least 256 KiB of weights.
  const int64_t panel_bytes = kPanelWidth * (in_pairs ? 2 * pairs : w.in) * element;
  const int64_t grain = std::max<int64_t>(1, (int64_t{256} << 10) / std::max<int64_t>(1, panel_bytes));
  // Up to kRegisterRows rows per pass over W, each pass's rows transposed first: a panel's
  // input i (pair j for bf16) then needs the rows' values side by side (rows of x lie a power of
  // two apart in real models, and would share the first-level cache's sets).
  thread_local std::vector<float> transposed;
  thread_local std::vector<uint32_t> transposed_pairs;
  thread_local std::vector<uint16_t> rounded_rows;  // bf16 and int8: each row rounded, in order
  thread_local std::vector<float> steps;            // int8: the chunks' steps [chunks, rows]
  // Each grows only for the layout it holds: a bf16 model never touches the fp32 buffer.
  if (in_pairs) {
    if (transposed_pairs.size() < static_cast<size_t>(pairs * packed::kRegisterRows)) {
      transposed_pairs.resize(static_cast<size_t>(pairs * packed::kRegisterRows));
      rounded_rows.resize(static_cast<size_t>(2 * pairs * packed::kRegisterRows));
    }
    if (w.format == WeightFormat::i8 && steps.size() < static_cast<size_t>(chunks * packed::kRegisterRows)) {
      steps.resize(static_cast<size_t>(chunks * packed::kRegisterRows));
    }
  } else if (transposed.size() < static_cast<size_t>(w.in * packed::kRegisterRows)) {
    transposed.resize(static_cast<size_t>(w.in * packed::kRegisterRows));
  }
  for (int64_t first = 0; first < rows; first += packed::kRegisterRows) {
    const int64_t count = std::min<int64_t>(packed::kRegisterRows, rows - first);
    const void* xt = nullptr;
    if (in_pairs) {
      // Each row rounded in order (16 activations a step for bf16, 8 for int8), then its pairs
      // laid beside the others'.
      for (int64_t r = 0; r < count; ++r) {
        uint16_t* const rounded = rounded_rows.data() + r * 2 * pairs;
        if (w.format == WeightFormat::bf16) {
          packed::round_pairs(x + (first + r) * w.in, w.in, rounded, vector);
        } else {
          packed::quantize_row_int16(x + (first + r) * w.in, w.in, reinterpret_cast<int16_t*>(rounded),
                                     steps.data() + r, count, chosen.isa != packed::Isa::portable);
        }
      }
      uint32_t* const xp = transposed_pairs.data();
      for (int64_t j = 0; j < pairs; ++j) {
        for (int64_t r = 0; r < count; ++r) std::memcpy(xp + j * count + r, rounded_rows.data() + (r * pairs + j) * 2, 4);
      }
      xt = xp;
    } else {
      float* const xf = transposed.data();
      for (int64_t r = 0; r < count; ++r) {
        const float* row = x + (first + r) * w.in;
        for (int64_t i = 0; i < w.in; ++i) xf[i * count + r] = row[i];
      }
      xt = xf;
    }
    float* const ys = y + first * w.out;
    // Taken here: in the threads of parallel_for, `steps` names their own (empty) buffers.
    const float* const chunk_steps = steps.data();
    at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
      switch (w.format) {
        case WeightFormat::f32:
          packed::product_panels<WeightFormat::f32>(w, xt, nullptr, count, ys, bias, begin, end, chosen);
          break;
        case WeightFormat::bf16:
          packed::product_panels<WeightFormat::bf16>(w, xt, nullptr, count, ys, bias, begin, end, chosen);
          break;
        case WeightFormat::i8:
          packed::product_panels<WeightFormat::i8>(w, xt, chunk_steps, count, ys, bias, begin, end, chosen);
          break;
      }
    });
  }
}

}  // namespace specdec::detail
