// The element-wise and attention parts of a Llama layer as plain loops over fp32 rows, for the
// CPU forward. At decoding sizes (a handful of new tokens, a model of a few hundred dimensions) a
// forward made of ATen operations spends most of its time dispatching them: about 80 per layer,
// against 4 matrix products. These loops replace the RMSNorms, the rotary embedding, the attention
// over the cache and the SwiGLU product with one pass each; the matrix products stay with ATen's
// BLAS. The loops are written for the compiler to vectorise (contiguous inner loops, no
// intrinsics) and accumulate in fp32, as llama2.c does.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace specdec::detail {

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, for `rows` rows of `dim` floats.
inline void rms_norm_rows(const float* x, const float* weight, float* out, int64_t rows, int64_t dim, double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = x + r * dim;
    float* o = out + r * dim;
    float squares = 0.0F;
    for (int64_t i = 0; i < dim; ++i) squares += in[i] * in[i];
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

// out[i] = silu(gate[i]) * up[i] for `rows` rows whose gate and up halves are the two halves of
// gate_up [rows, 2 * hidden]; out is [rows, hidden].
inline void swiglu_rows(const float* gate_up, float* out, int64_t rows, int64_t hidden) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = gate_up + r * 2 * hidden;
    const float* up = gate + hidden;
    float* o = out + r * hidden;
    for (int64_t i = 0; i < hidden; ++i) o[i] = gate[i] / (1.0F + std::exp(-gate[i])) * up[i];
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

// A softmax term this far below the largest (e^-40 < 2^-57) cannot change an fp32 sum of fewer
// than 2^30 terms, whose precision is 2^-24 of the largest.
inline constexpr float kNegligibleScore = -40.0F;

// Scaled dot-product attention of the new tokens' queries over the cache's keys and values.
//
// Requires: queries at query_rows + (b * count + t) * query_stride + h * head_dim (head h of token
//   t of row b); keys and values [batch, kv_heads, past + count, head_dim] fp32 with a contiguous
//   last dimension; visible, when given, a bool [count, count] over the new tokens (new token t
//   sees new token j where visible[t][j]), otherwise causal (t sees j <= t); every cached
//   position is visible to every new token.
// Writes: out [batch * count, heads * head_dim], head h of query head h's attention (query head
//   h reads key/value head h / (heads / kv_heads)).
inline void attend(const AttentionShape& shape, const float* query_rows, int64_t query_stride, const at::Tensor& keys,
                   const at::Tensor& values, const bool* visible, float* out) {
  const int64_t keys_total = shape.past + shape.count;
  const int64_t group = shape.heads / shape.kv_heads;
  const int64_t head_dim = shape.head_dim;
  const float scale = 1.0F / std::sqrt(static_cast<float>(head_dim));
  const float* key_data = keys.data_ptr<float>();
  const float* value_data = values.data_ptr<float>();
  const int64_t key_row = keys.stride(0), key_head = keys.stride(1), key_step = keys.stride(2);
  const int64_t value_row = values.stride(0), value_head = values.stride(1), value_step = values.stride(2);
  const int64_t tasks = shape.batch * shape.heads * shape.count;
  // Split across libtorch's intra-op threads only when a task is worth a thread's start.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, keys_total * head_dim));
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(keys_total));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task % shape.count;
      const int64_t h = (task / shape.count) % shape.heads;
      const int64_t b = task / (shape.count * shape.heads);
      const int64_t kv = h / group;
      const float* q = query_rows + (b * shape.count + t) * query_stride + h * head_dim;
      const float* k = key_data + b * key_row + kv * key_head;
      const float* v = value_data + b * value_row + kv * value_head;
      // Keys this query sees: every cached one, then the new tokens its mask allows.
      float best = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < keys_total; ++j) {
        const int64_t fresh = j - shape.past;
        const bool seen = fresh < 0 || (visible != nullptr ? visible[t * shape.count + fresh] : fresh <= t);
        if (!seen) {
          scores[static_cast<size_t>(j)] = -std::numeric_limits<float>::infinity();
          continue;
        }
        const float* key = k + j * key_step;
        float dot = 0.0F;
        for (int64_t i = 0; i < head_dim; ++i) dot += q[i] * key[i];
        scores[static_cast<size_t>(j)] = dot * scale;
        best = std::max(best, scores[static_cast<size_t>(j)]);
      }
      // Keys more than -kNegligibleScore below the best weigh under 2^-57 of it, below what an
      // fp32 sum can hold: they are dropped rather than carried into products that underflow to
      // subnormal numbers, whose arithmetic is two orders of magnitude slower on x86.
      float total = 0.0F;
      for (int64_t j = 0; j < keys_total; ++j) {
        const float centred = scores[static_cast<size_t>(j)] - best;
        const float e = centred < kNegligibleScore ? 0.0F : std::exp(centred);
        scores[static_cast<size_t>(j)] = e;
        total += e;
      }
      float* o = out + (b * shape.count + t) * shape.heads * head_dim + h * head_dim;
      std::fill(o, o + head_dim, 0.0F);
      const float norm = 1.0F / total;
      for (int64_t j = 0; j < keys_total; ++j) {
        const float weight = scores[static_cast<size_t>(j)] * norm;
        if (weight == 0.0F) continue;
        const float* value = v + j * value_step;
        for (int64_t i = 0; i < head_dim; ++i) o[i] += weight * value[i];
      }
    }
  });
}

}  // namespace specdec::detail
