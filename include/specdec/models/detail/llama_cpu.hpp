// The element-wise and attention parts of a Llama layer as plain loops over fp32 rows, for the
// CPU forward. At decoding sizes (a handful of new tokens, a model of a few hundred dimensions) a
// forward made of ATen operations spends most of its time dispatching them: about 80 per layer,
// against 4 matrix products. These loops replace the RMSNorms, the rotary embedding, the attention
// over the cache and the SwiGLU gate with one pass each; the matrix products stay with oneDNN or
// BLAS (cpu_linear.hpp). The attention and SwiGLU loops have AVX2/FMA versions, compiled for
// those instructions whatever the caller's flags and chosen at run time on a CPU that has them
// (attention was the largest part of a 5-token verification forward after the products: its
// portable loops, compiled for generic x86-64, reduce every score across SSE lanes); elsewhere
// the portable loops and ATen's vectorised softmax and silu run. The loops accumulate in fp32, as
// llama2.c does.
#pragma once

#include <ATen/Parallel.h>
#include <c10/macros/Macros.h>

#if defined(__SSE__) || defined(_M_X64)
#include <xmmintrin.h>
#define SPECDEC_HAS_MXCSR 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "specdec/detail/torch_compat.hpp"
#include "specdec/models/detail/x86.hpp"

namespace specdec::detail {

// Flushes subnormal fp32 results to zero and reads subnormal inputs as zero on the calling thread
// while it lives (x86's FTZ and DAZ bits), restoring the caller's setting after. A peaked softmax
// makes numbers below 2^-126 by the thousand, and on x86 every operation on one costs about a
// hundred cycles: in a forward over real text this took a fifth of the time. Nothing the forward
// computes can be changed by a number that small beside the ones it is summed with. A no-op where
// the CPU has no such bits.
class FlushSubnormals {
 public:
#ifdef SPECDEC_HAS_MXCSR
  FlushSubnormals() noexcept : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | kFlushToZero | kDenormalsAreZero); }
  ~FlushSubnormals() { _mm_setcsr(saved_); }
#else
  FlushSubnormals() noexcept = default;
#endif
  FlushSubnormals(const FlushSubnormals&) = delete;
  FlushSubnormals& operator=(const FlushSubnormals&) = delete;

 private:
#ifdef SPECDEC_HAS_MXCSR
  static constexpr unsigned kFlushToZero = 0x8000;       // MXCSR bit 15
  static constexpr unsigned kDenormalsAreZero = 0x0040;  // MXCSR bit 6
  unsigned saved_;
#endif
};

// The dot product of n floats, summed in 8 interleaved partial sums so that the compiler can keep
// them in vector registers (one running sum is a chain of dependent additions, 4 cycles each).
inline float dot(const float* a, const float* b, int64_t n) {
  float lanes[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int64_t l = 0; l < 8; ++l) lanes[l] += a[i + l] * b[i + l];
  }
  float sum = 0.0F;
  for (; i < n; ++i) sum += a[i] * b[i];
  for (const float lane : lanes) sum += lane;
  return sum;
}

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, for `rows` rows of `dim` floats.
inline void rms_norm_rows(const float* x, const float* weight, float* out, int64_t rows, int64_t dim, double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = x + r * dim;
    float* o = out + r * dim;
    const float squares = dot(in, in, dim);
    const float scale = 1.0F / std::sqrt(squares / static_cast<float>(dim) + static_cast<float>(eps));
    for (int64_t i = 0; i < dim; ++i) o[i] = in[i] * scale * weight[i];
  }
}

// Rotates consecutive pairs (2i, 2i+1) of `heads` heads of `head_dim` floats, starting at `x`, by
// the angles of `position`: (a, b) becomes (a cos - b sin, a sin + b cos). cos and sin are the
// tables [max_seq_len, head_dim / 2].
inline void rotate_heads(float* x, int64_t heads, int64_t head_dim, int64_t position, const float* cos,
                         const float* sin) {
  const int64_t half = head_dim / 2;
  const float* c = cos + position * half;
  const float* s = sin + position * half;
  for (int64_t h = 0; h < heads; ++h) {
    float* pairs = x + h * head_dim;
    for (int64_t i = 0; i < half; ++i) {
      const float a = pairs[2 * i];
      const float b = pairs[2 * i + 1];
      pairs[2 * i] = a * c[i] - b * s[i];
      pairs[2 * i + 1] = a * s[i] + b * c[i];
    }
  }
}

#ifdef SPECDEC_X86_KERNELS
// The sum of a vector's 8 lanes.
SPECDEC_TARGET_AVX2 inline float lane_sum(__m256 v) {
  const __m128 halves = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_add_ps(halves, _mm_movehl_ps(halves, halves));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
}

// The sums of a0 .. a7's lanes, in that order: three rounds of pairwise horizontal additions.
SPECDEC_TARGET_AVX2 inline __m256 lane_sums8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                                             __m256 a6, __m256 a7) {
  const __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));   // 0123 | 0123
  const __m256 high = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));  // 4567 | 4567
  return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
}

// out[j] = dot(query, keys + j * key_step) * scale for j < n, head_dim a multiple of 8. Eight
// keys at a time, their eight sums reduced together (one horizontal reduction per eight scores).
SPECDEC_TARGET_AVX2 inline void query_scores_avx2(const float* query, const float* keys, int64_t key_step, int64_t n,
                                                  int64_t head_dim, float scale, float* out) {
  const __m256 scaling = _mm256_set1_ps(scale);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const float* k = keys + j * key_step;
    __m256 a[8];
    for (__m256& sum : a) sum = _mm256_setzero_ps();
    for (int64_t i = 0; i < head_dim; i += 8) {
      const __m256 q = _mm256_loadu_ps(query + i);
      for (int64_t u = 0; u < 8; ++u) a[u] = _mm256_fmadd_ps(q, _mm256_loadu_ps(k + u * key_step + i), a[u]);
    }
    _mm256_storeu_ps(out + j, _mm256_mul_ps(lane_sums8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]), scaling));
  }
  for (; j < n; ++j) {
    const float* k = keys + j * key_step;
    __m256 a = _mm256_setzero_ps();
    for (int64_t i = 0; i < head_dim; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(query + i), _mm256_loadu_ps(k + i), a);
    out[j] = lane_sum(a) * scale;
  }
}

// e^x lane by lane: x = n ln 2 + r with |r| <= ln 2 / 2, e^r by a degree-7 polynomial (the
// classic Cephes expf coefficients), 2^n put into the exponent bits. Relative error about 2e-7.
// Below -87.3 (where e^x is no longer a normal float) the result is 0; above 88.3 it saturates
// at about 2^127; NaN stays NaN.
SPECDEC_TARGET_AVX2 inline __m256 exp_avx2(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(-87.3365448F), highest = _mm256_set1_ps(88.3762626F);
  const __m256 below = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  const __m256 clamped = _mm256_min_ps(_mm256_max_ps(x, lowest), highest);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(clamped, _mm256_set1_ps(1.44269504088896341F)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - n ln 2, with ln 2 in two parts so that n * (first part) is exact.
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375F), clamped);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4F), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4F);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3F));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3F));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2F));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1F));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1F));
  const __m256 e = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0F));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 result = _mm256_andnot_ps(below, _mm256_mul_ps(e, _mm256_castsi256_ps(exponent)));
  return _mm256_blendv_ps(result, x, nan);
}

// out[0, 8) = e^x[0, 8), for tests.
SPECDEC_TARGET_AVX2 inline void store_exp_avx2(const float* x, float* out) {
  _mm256_storeu_ps(out, exp_avx2(_mm256_loadu_ps(x)));
}

// silu(g) * u lane by lane, silu(g) = g / (1 + e^-g).
SPECDEC_TARGET_AVX2 inline __m256 swiglu_avx2(__m256 g, __m256 u) {
  const __m256 one = _mm256_set1_ps(1.0F);
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), g)))), u);
}

// out[r][i] = silu(gate[r][i]) * up[r][i] for `rows` rows of gate | up ([rows, 2 * hidden]). The
// last hidden % 8 elements of a row go through the same lane-wise arithmetic under a mask (the
// lanes past the row neither read nor written).
SPECDEC_TARGET_AVX2 inline void swiglu_rows_avx2(const float* gate_up, int64_t rows, int64_t hidden, float* out) {
  const int64_t whole = hidden / 8 * 8, tail = hidden - whole;
  // Lane l is read and written where l < tail.
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(tail)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = gate_up + r * 2 * hidden;
    const float* up = gate + hidden;
    float* o = out + r * hidden;
    for (int64_t i = 0; i < whole; i += 8) _mm256_storeu_ps(o + i, swiglu_avx2(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
    if (tail > 0) {
      _mm256_maskstore_ps(o + whole, mask,
                          swiglu_avx2(_mm256_maskload_ps(gate + whole, mask), _mm256_maskload_ps(up + whole, mask)));
    }
  }
}

// Transposes 8 rows of 8 floats: on return, r[i] holds lane i of every row given.
SPECDEC_TARGET_AVX2 inline void transpose8(__m256 (&r)[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// Up to 8 query rows that read the same keys and values, for attend(): Rows rows of scores
// (row r at scores + r * padded), their softmax, and the weighted sums of the values, each key
// and value read once for all the rows and the rows' dependent chains interleaved.
template <int Rows>
struct AttentionBlock {
  const float* const* queries;  // [Rows] rows of head_dim floats
  float* const* out;            // [Rows]
  float* scores;                // [Rows, padded]
  uint32_t* keep;               // [padded]
  int64_t padded;

  // scores[r][j] = dot(query r, key j) * scale for j < n. A head of 8 floats: every 8 keys
  // transposed once (lane d of vector d: dimension d of the 8 keys) and each row's scores made by
  // 8 multiply-adds of its query's elements; wider heads: query_scores_avx2 row by row.
  SPECDEC_TARGET_AVX2 void score(const float* keys, int64_t key_step, int64_t n, int64_t head_dim, float scale) const {
    if (head_dim != 8) {
      for (int r = 0; r < Rows; ++r)
        query_scores_avx2(queries[r], keys, key_step, n, head_dim, scale, scores + r * padded);
      return;
    }
    float q[Rows][8];
    for (int r = 0; r < Rows; ++r) {
      for (int d = 0; d < 8; ++d) q[r][d] = queries[r][d] * scale;
    }
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      __m256 k[8];
      for (int u = 0; u < 8; ++u) k[u] = _mm256_loadu_ps(keys + (j + u) * key_step);
      transpose8(k);
      __m256 sum[Rows];
#pragma GCC unroll 8
      for (int r = 0; r < Rows; ++r) sum[r] = _mm256_mul_ps(_mm256_broadcast_ss(&q[r][0]), k[0]);
      for (int d = 1; d < 8; ++d) {
#pragma GCC unroll 8
        for (int r = 0; r < Rows; ++r) sum[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&q[r][d]), k[d], sum[r]);
      }
      for (int r = 0; r < Rows; ++r) _mm256_storeu_ps(scores + r * padded + j, sum[r]);
    }
    for (; j < n; ++j) {
      const __m256 key = _mm256_loadu_ps(keys + j * key_step);
      for (int r = 0; r < Rows; ++r) scores[r * padded + j] = lane_sum(_mm256_mul_ps(_mm256_loadu_ps(q[r]), key));
    }
  }

  // Each row's softmax, unnormalised: e^(score - the row's largest), a weight below `negligible`
  // (the largest is 1) set to 0, NaN kept; inverse[r] = 1 / row r's sum. keep[j] is nonzero where
  // some row keeps key j's weight. scores[r][n, padded) must hold -inf.
  SPECDEC_TARGET_AVX2 void softmax(float negligible, float* inverse) const {
    __m256 shift[Rows], total[Rows];
    for (int r = 0; r < Rows; ++r) {
      __m256 most = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
      for (int64_t j = 0; j < padded; j += 8) most = _mm256_max_ps(most, _mm256_loadu_ps(scores + r * padded + j));
      __m128 m = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
      m = _mm_max_ps(m, _mm_movehl_ps(m, m));
      m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
      shift[r] = _mm256_set1_ps(_mm_cvtss_f32(m));
      total[r] = _mm256_setzero_ps();
    }
    const __m256 least = _mm256_set1_ps(negligible);
    for (int64_t j = 0; j < padded; j += 8) {
      __m256 any = _mm256_setzero_ps();
#pragma GCC unroll 8
      for (int r = 0; r < Rows; ++r) {
        float* const at = scores + r * padded + j;
        const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(at), shift[r]));
        const __m256 kept = _mm256_cmp_ps(e, least, _CMP_NLT_UQ);  // e >= negligible, or NaN
        const __m256 weight = _mm256_and_ps(e, kept);
        _mm256_storeu_ps(at, weight);
        total[r] = _mm256_add_ps(total[r], weight);
        any = _mm256_or_ps(any, kept);
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(keep + j), _mm256_castps_si256(any));
    }
    for (int r = 0; r < Rows; ++r) inverse[r] = 1.0F / lane_sum(total[r]);
  }

  // out[r] = inverse[r] * the sum over the keys some row keeps of weight[r][j] * value j, 8
  // floats of head_dim at a time; every value read once for all the rows. A key no row keeps is
  // not read (a batch row's own cache slots past its length may hold anything). With fewer than
  // 4 rows the keys are split over Chains running sums per row, so that the additions do not wait
  // on one another (an FMA's result is ready 4 to 5 cycles after it starts).
  SPECDEC_TARGET_AVX2 void weigh(const float* values, int64_t value_step, int64_t n, int64_t head_dim,
                                 const float* inverse) const {
    constexpr int Chains = Rows == 1 ? 4 : (Rows < 4 ? 2 : 1);
    for (int64_t i = 0; i < head_dim; i += 8) {
      __m256 acc[Chains][Rows];
      for (auto& chain : acc) {
        for (__m256& sum : chain) sum = _mm256_setzero_ps();
      }
      int64_t j = 0;
      for (; j + Chains <= n; j += Chains) {
        for (int c = 0; c < Chains; ++c) add_key(acc[c], values + i, value_step, j + c);
      }
      for (; j < n; ++j) add_key(acc[0], values + i, value_step, j);
      for (int r = 0; r < Rows; ++r) {
        __m256 sum = acc[0][r];
        for (int c = 1; c < Chains; ++c) sum = _mm256_add_ps(sum, acc[c][r]);
        _mm256_storeu_ps(out[r] + i, _mm256_mul_ps(sum, _mm256_set1_ps(inverse[r])));
      }
    }
  }

  SPECDEC_TARGET_AVX2 void add_key(__m256 (&sums)[Rows], const float* values, int64_t value_step, int64_t j) const {
    if (keep[j] == 0) return;
    const __m256 value = _mm256_loadu_ps(values + j * value_step);
#pragma GCC unroll 8
    for (int r = 0; r < Rows; ++r)
      sums[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(scores + r * padded + j), value, sums[r]);
  }
};

// One AttentionBlock's attention: scores, the bias (biases[r]: row r's over the `width` keys from
// `biased`, or null), the softmax and the weighted sums.
template <int Rows>
SPECDEC_TARGET_AVX2 inline void attend_block_avx2(const AttentionBlock<Rows>& block, const float* keys,
                                                  int64_t key_step, const float* values, int64_t value_step, int64_t n,
                                                  int64_t head_dim, float scale, const float* const* biases,
                                                  int64_t biased, int64_t width, float negligible) {
  block.score(keys, key_step, n, head_dim, scale);
  for (int r = 0; r < Rows; ++r) {
    float* const row = block.scores + r * block.padded;
    std::fill(row + n, row + block.padded, -std::numeric_limits<float>::infinity());  // the softmax's padding
    if (biases != nullptr) {  // a hidden key's score is -inf whatever its slot holds
      for (int64_t u = 0; u < width; ++u) {
        const float bias = biases[r][u];
        row[biased + u] = bias == -std::numeric_limits<float>::infinity() ? bias : row[biased + u] + bias;
      }
    }
  }
  float inverse[Rows];
  block.softmax(negligible, inverse);
  block.weigh(values, value_step, n, head_dim, inverse);
}
#endif

// x[i] += y[i] for n floats.
inline void add_into(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

// out [rows, hidden] = silu(gate) * up for gate_up [rows, 2 * hidden] (gate | up per row), as the
// AVX2 loop above where the CPU has it, through ATen's vectorised silu otherwise.
inline void swiglu_rows(const float* gate_up, int64_t rows, int64_t hidden, float* out) {
#ifdef SPECDEC_X86_KERNELS
  if (cpu_has_avx2_fma()) {
    swiglu_rows_avx2(gate_up, rows, hidden, out);
    return;
  }
#endif
  const auto options = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor both = at::from_blob(const_cast<float*>(gate_up), {rows, 2 * hidden}, options);
  at::Tensor result = at::from_blob(out, {rows, hidden}, options);
  at::mul_out(result, at::silu(both.narrow(1, 0, hidden)), both.narrow(1, hidden, hidden));
}

// The shape of one attention call: `count` new tokens per batch row after `past` cached positions,
// `heads` query heads sharing `kv_heads` key/value heads.
struct AttentionShape {
  int64_t batch = 1;
  int64_t count = 1;
  int64_t past = 0;
  int64_t heads = 1;
  int64_t kv_heads = 1;
  int64_t head_dim = 1;
  // The keys the bias covers: the last bias_width (0: the count new tokens'). Every key before
  // them is visible.
  int64_t bias_width = 0;
  // Floats from one batch row's bias to the next's (0: one bias for every row; rows of different
  // lengths have their own, over every key).
  int64_t bias_row_stride = 0;
};

// A softmax weight below this (2^-60) cannot change an fp32 sum of fewer than 2^30 terms that
// also holds the largest weight (at least 1 / keys), whose precision is 2^-24 of it.
inline constexpr float kNegligibleWeight = 0x1p-60F;

// Scaled dot-product attention of `count` new tokens per batch row over the cache's keys and
// values (which hold them last). With AVX2/FMA and a head size that is a multiple of 8: tasks of
// up to 8 query rows that share a key/value head, their scores and softmax in rows of scratch
// floats, then the weighted sums of the values for all of them at once. Otherwise three passes:
// every score (a loop), their softmax (one ATen call, vectorised, as the ATen forward computes
// it), and the weighted sums of the values (a loop).
//
// Requires: queries at query_rows + (b * count + t) * query_stride + h * head_dim (head h of new
//   token t of row b); keys and values [batch, kv_heads, past + count, head_dim] fp32 with a
//   contiguous last dimension; new_bias [count, W] over the last W = shape.bias_width (or count)
//   keys (row t: 0 where token t sees that key, -inf where not), or null when every key is
//   visible (one new token). Every key before those W is visible.
// Writes: out [batch * count, heads * head_dim], head h of query head h's attention (query head h
//   reads key/value head h / (heads / kv_heads)).
inline void attend(const AttentionShape& shape, const float* query_rows, int64_t query_stride, const at::Tensor& keys,
                   const at::Tensor& values, const float* new_bias, float* out) {
  const int64_t count = shape.count, past = shape.past, keys_total = past + count;
  const int64_t width = shape.bias_width > 0 ? shape.bias_width : count, biased = keys_total - width;
  const int64_t group = shape.heads / shape.kv_heads;
  const int64_t head_dim = shape.head_dim;
  const float scale = 1.0F / std::sqrt(static_cast<float>(head_dim));
  const int64_t tasks = shape.batch * count * shape.heads;  // task (b * count + t) * heads + h
  // Split across libtorch's intra-op threads only when a task is worth a thread's start.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, keys_total * head_dim));
  const float* const key_data = keys.data_ptr<float>();
  const float* const value_data = values.data_ptr<float>();
  const int64_t key_step = keys.stride(2), value_step = values.stride(2);
  // The keys and values that query head h of batch row b reads.
  const auto keys_of = [&](int64_t b, int64_t h) {
    return key_data + b * keys.stride(0) + (h / group) * keys.stride(1);
  };
  const auto values_of = [&](int64_t b, int64_t h) {
    return value_data + b * values.stride(0) + (h / group) * values.stride(1);
  };
#ifdef SPECDEC_X86_KERNELS
  if (cpu_has_avx2_fma() && head_dim % 8 == 0) {
    // A task is up to kRows query rows that read the same key/value head of the same batch row
    // (row i of that head's group * count: token i / group, query head g * group + i % group).
    constexpr int64_t kRows = 8;
    const int64_t padded = (keys_total + 7) / 8 * 8;
    const int64_t group_rows = group * count, blocks = (group_rows + kRows - 1) / kRows;
    const int64_t block_tasks = shape.batch * shape.kv_heads * blocks;
    const int64_t block_grain = std::max<int64_t>(1, grain / std::min(kRows, group_rows));
    at::parallel_for(0, block_tasks, block_grain, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> scratch;
      thread_local std::vector<uint32_t> keep;
      if (static_cast<int64_t>(scratch.size()) < kRows * padded) scratch.resize(static_cast<size_t>(kRows * padded));
      if (static_cast<int64_t>(keep.size()) < padded) keep.resize(static_cast<size_t>(padded));
      const float* queries[kRows];
      const float* biases[kRows];
      float* outs[kRows];
      for (int64_t task = begin; task < end; ++task) {
        const int64_t first = (task % blocks) * kRows, rows = std::min(kRows, group_rows - first);
        const int64_t b = task / blocks / shape.kv_heads, kv = task / blocks % shape.kv_heads;
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t t = (first + r) / group, h = kv * group + (first + r) % group;
          const int64_t token_row = b * count + t;
          queries[r] = query_rows + token_row * query_stride + h * head_dim;
          biases[r] = new_bias == nullptr ? nullptr : new_bias + b * shape.bias_row_stride + t * width;
          outs[r] = out + (token_row * shape.heads + h) * head_dim;
        }
        const float* const k = keys_of(b, kv * group);
        const float* const v = values_of(b, kv * group);
        const float* const* const bias = new_bias == nullptr ? nullptr : biases;
        with_count<kRows>(rows, [&]<int Rows>() {
          attend_block_avx2(AttentionBlock<Rows>{queries, outs, scratch.data(), keep.data(), padded}, k, key_step, v,
                            value_step, keys_total, head_dim, scale, bias, biased, width, kNegligibleWeight);
        });
      }
    });
    return;
  }
#endif
  const at::Tensor scores = at::empty({tasks, keys_total}, keys.options());
  float* const score_rows = scores.data_ptr<float>();
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t token_row = task / shape.heads, h = task % shape.heads;
      const int64_t b = token_row / count, t = token_row % count;
      const float* query = query_rows + token_row * query_stride + h * head_dim;
      const float* k = keys_of(b, h);
      float* row = score_rows + task * keys_total;
      for (int64_t j = 0; j < biased; ++j) row[j] = dot(query, k + j * key_step, head_dim) * scale;
      for (int64_t u = 0; u < width; ++u) {
        const float bias = new_bias == nullptr ? 0.0F : new_bias[b * shape.bias_row_stride + t * width + u];
        row[biased + u] = bias == -std::numeric_limits<float>::infinity()
                              ? bias
                              : dot(query, k + (biased + u) * key_step, head_dim) * scale + bias;
      }
    }
  });
  const at::Tensor weights = scores.softmax(-1);
  const float* const weight_rows = weights.data_ptr<float>();
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t token_row = task / shape.heads, h = task % shape.heads;
      const int64_t b = token_row / count;
      const float* v = values_of(b, h);
      const float* row = weight_rows + task * keys_total;
      float* C10_RESTRICT o = out + task * head_dim;
      std::fill(o, o + head_dim, 0.0F);
      for (int64_t j = 0; j < keys_total; ++j) {
        // Negligible weights (NaN is not) are skipped: nothing is lost, and no product reaches
        // the subnormal range. Hidden keys weigh exactly 0.
        const float weight = row[j];
        if (weight < kNegligibleWeight) continue;
        const float* C10_RESTRICT value = v + j * value_step;
        for (int64_t i = 0; i < head_dim; ++i) o[i] += weight * value[i];
      }
    }
  });
}

// attend() through batched matrix products, for several new tokens: one bmm for the scores of
// every query head over its key/value head, the additive `grouped_bias` [group * T, W] over the
// last W key columns (the new tokens' for W = T; causal or a tree; rows ordered query head within
// the group, then token; [batch, group * T, W] where each row has its own),
// the softmax, and one bmm with the values. For T new tokens the loops of attend() repeat every
// key's products T times at the compiler's vector width; BLAS does them at the CPU's. Same
// requirements and result as attend(), with the queries given as `queries` [batch * T, heads *
// head_dim] (a view with a contiguous last dimension) and the result written into `out`.
inline void attend_batched(const AttentionShape& shape, const at::Tensor& queries, const at::Tensor& keys,
                           const at::Tensor& values, const at::Tensor& grouped_bias, const at::Tensor& out) {
  const int64_t group = shape.heads / shape.kv_heads;
  const int64_t count = shape.count, head_dim = shape.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  const auto layout = [&](const at::Tensor& rows) {  // [T, heads * hd] -> [kv_heads, group, T, hd]
    return rows.view({count, shape.kv_heads, group, head_dim}).permute({1, 2, 0, 3});
  };
  for (int64_t b = 0; b < shape.batch; ++b) {
    const at::Tensor q = layout(queries.narrow(0, b * count, count)).reshape({shape.kv_heads, group * count, head_dim});
    at::Tensor scores = at::bmm(q, keys[b].transpose(1, 2)).mul_(scale);  // [kv_heads, group * T, keys]
    const at::Tensor bias = grouped_bias.dim() == 3 ? grouped_bias[b] : grouped_bias;
    scores.narrow(2, scores.size(2) - bias.size(1), bias.size(1)).add_(bias);
    const at::Tensor attended = at::bmm(scores.softmax(-1), values[b]);  // [kv_heads, group * T, hd]
    layout(out.narrow(0, b * count, count)).copy_(attended.view({shape.kv_heads, group, count, head_dim}));
  }
}

}  // namespace specdec::detail
