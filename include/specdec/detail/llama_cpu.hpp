// The element-wise and attention parts of a Llama layer as plain loops over fp32 rows, for the
// CPU forward. At decoding sizes (a handful of new tokens, a model of a few hundred dimensions) a
// forward made of ATen operations spends most of its time dispatching them: about 80 per layer,
// against 4 matrix products. These loops replace the RMSNorms, the rotary embedding and the
// attention over the cache with one pass each; the matrix products stay with ATen's BLAS, and the
// SwiGLU product with ATen's vectorised silu (its exponentials are faster there than in a portable
// loop). The loops are written for the compiler to vectorise (contiguous inner loops, no
// intrinsics) and accumulate in fp32, as llama2.c does.
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

#include "specdec/detail/torch_compat.hpp"

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

// x[i] += y[i] for n floats.
inline void add_into(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
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
};

// A softmax weight below this (2^-60) cannot change an fp32 sum of fewer than 2^30 terms that
// also holds the largest weight (at least 1 / keys), whose precision is 2^-24 of it.
inline constexpr float kNegligibleWeight = 0x1p-60F;

// Scaled dot-product attention of `count` new tokens per batch row over the cache's keys and
// values (which hold them last), in three passes: every score (a loop), their softmax (one ATen
// call, vectorised, as the ATen forward computes it), and the weighted sums of the values (a
// loop).
//
// Requires: queries at query_rows + (b * count + t) * query_stride + h * head_dim (head h of new
//   token t of row b); keys and values [batch, kv_heads, past + count, head_dim] fp32 with a
//   contiguous last dimension; new_bias [count, count] (row t: 0 where token t sees new token u,
//   -inf where not), or null when every new token is visible (one new token). Every cached
//   position is visible.
// Writes: out [batch * count, heads * head_dim], head h of query head h's attention (query head h
//   reads key/value head h / (heads / kv_heads)).
inline void attend(const AttentionShape& shape, const float* query_rows, int64_t query_stride, const at::Tensor& keys,
                   const at::Tensor& values, const float* new_bias, float* out) {
  const int64_t count = shape.count, past = shape.past, keys_total = past + count;
  const int64_t group = shape.heads / shape.kv_heads;
  const int64_t head_dim = shape.head_dim;
  const float scale = 1.0F / std::sqrt(static_cast<float>(head_dim));
  const int64_t tasks = shape.batch * count * shape.heads;  // task (b * count + t) * heads + h
  const at::Tensor scores = at::empty({tasks, keys_total}, keys.options());
  float* const score_rows = scores.data_ptr<float>();
  // Split across libtorch's intra-op threads only when a task is worth a thread's start.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, keys_total * head_dim));
  const float* const key_data = keys.data_ptr<float>();
  const int64_t key_step = keys.stride(2);
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t token_row = task / shape.heads, h = task % shape.heads;
      const int64_t b = token_row / count, t = token_row % count;
      const float* query = query_rows + token_row * query_stride + h * head_dim;
      const float* k = key_data + b * keys.stride(0) + (h / group) * keys.stride(1);
      float* row = score_rows + task * keys_total;
      for (int64_t j = 0; j < past; ++j) row[j] = dot(query, k + j * key_step, head_dim) * scale;
      for (int64_t u = 0; u < count; ++u) {
        const float bias = new_bias == nullptr ? 0.0F : new_bias[t * count + u];
        row[past + u] = bias == -std::numeric_limits<float>::infinity()
                            ? bias
                            : dot(query, k + (past + u) * key_step, head_dim) * scale + bias;
      }
    }
  });
  const at::Tensor weights = scores.softmax(-1);
  const float* const weight_rows = weights.data_ptr<float>();
  const float* const value_data = values.data_ptr<float>();
  const int64_t value_step = values.stride(2);
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t token_row = task / shape.heads, h = task % shape.heads;
      const int64_t b = token_row / count;
      const float* v = value_data + b * values.stride(0) + (h / group) * values.stride(1);
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
// every query head over its key/value head, the additive `grouped_bias` [group * T, T] over the
// new tokens' columns (causal or a tree; rows ordered query head within the group, then token),
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
    scores.narrow(2, scores.size(2) - count, count).add_(grouped_bias);
    const at::Tensor attended = at::bmm(scores.softmax(-1), values[b]);  // [kv_heads, group * T, hd]
    layout(out.narrow(0, b * count, count)).copy_(attended.view({shape.kv_heads, group, count, head_dim}));
  }
}

}  // namespace specdec::detail
