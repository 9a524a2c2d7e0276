// EAGLE heads: one decoder layer that drafts from the target's own hidden states, as EAGLE-1 (Li
// et al., 2024; its EAGLE-2 checkpoints are the same heads) and EAGLE-3 (Li et al., 2025) define
// them and their published checkpoints hold them.
//
// The head runs beside the target, one position behind it: its position p reads the target's
// hidden state at p and the token at p + 1, and its output at p predicts the token at p + 2. A
// draft position reads the head's own output at the position before in place of the target's.
//   EAGLE-3: fc maps the concatenation of three target hidden states (the inputs of decoder layers
//     2, L/2 and L-3 by default) to the head's width H. The layer's attention reads
//     [input_norm(embedding(token)); hidden_norm(h)] (2H wide) and adds to h (or to hidden_norm(h)
//     when norm_before_residual), then a SwiGLU block as in Llama. Its output, normalised, goes to
//     lm_head over a draft vocabulary; draft id d is target id d + d2t[d].
//   EAGLE-1: fc (with bias) maps [embedding(token); feature] (2H) to H, where the feature is the
//     target's final normalised hidden state; the layer has no input norm, and its output goes
//     straight to the target's own classifier.
// Rotary embeddings rotate consecutive pairs (2i, 2i+1), as LlamaModel's do; a loader of Hugging
// Face's rotate-half checkpoints permutes wq and wk (io/eagle.hpp). On the CPU in fp32 the head
// runs as fused loops around its products (their route measured as LlamaModel's are), with
// LlamaModel's attention and SwiGLU loops (a draft step of ATen operations would cost several of
// the target's own forwards); use_cpu_kernels(false) forces the ATen forward, which every other
// device and dtype takes.
//
// The network only: drafting with it (EagleDraftSource's chains, EagleTreeSource's dynamic trees)
// is drafting/eagle.hpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "specdec/detail/check.hpp"
#include "specdec/detail/torch_compat.hpp"
#include "specdec/device.hpp"
#include "specdec/models/detail/cpu_linear.hpp"
#include "specdec/models/detail/llama_cpu.hpp"
#include "specdec/models/llama.hpp"
#include "specdec/models/llama_config.hpp"

namespace specdec::models {

enum class EagleKind { eagle1, eagle3 };

inline const char* to_string(EagleKind kind) {
  return kind == EagleKind::eagle1 ? "eagle1" : "eagle3";
}

struct EagleConfig {
  EagleKind kind = EagleKind::eagle3;
  // The head's decoder layer: dim (H), hidden_dim, n_heads, n_kv_heads, rope_theta, rope_scaling
  // and norm_eps are read; vocab_size is the target's vocabulary. n_layers, max_seq_len,
  // sliding_window and the bias flags are not used (one layer, no biases, positions unbounded).
  LlamaConfig layer{};
  int64_t target_hidden_size = 0;  // width of one target hidden state (EAGLE-3 may differ from H)
  int64_t draft_vocab_size = 0;    // EAGLE-3: lm_head's rows; EAGLE-1: the target's vocabulary
  std::vector<int64_t> feature_layers;  // the target hidden states read (FeatureTarget numbering)
  bool norm_before_residual = false;    // EAGLE-3: the residual is hidden_norm(h), not h

  [[nodiscard]] int64_t hidden_size() const noexcept { return layer.dim; }
  [[nodiscard]] int64_t vocab_size() const noexcept { return layer.vocab_size; }
  // The width of what fc reads: three target hidden states (EAGLE-3), or [embedding; feature].
  [[nodiscard]] int64_t fc_inputs() const noexcept {
    return kind == EagleKind::eagle3
               ? static_cast<int64_t>(feature_layers.size()) * target_hidden_size
               : 2 * layer.dim;
  }
  // The width the attention's projections read.
  [[nodiscard]] int64_t attention_inputs() const noexcept {
    return kind == EagleKind::eagle3 ? 2 * layer.dim : layer.dim;
  }

  // Throws std::invalid_argument naming the first field out of range.
  void validate() const {
    LlamaConfig checked = layer;
    checked.n_layers = 1;
    checked.validate();
    if (target_hidden_size < 1)
      detail::throw_invalid("eagle: target_hidden_size", "be >= 1", target_hidden_size);
    if (kind == EagleKind::eagle1 && target_hidden_size != layer.dim) {
      detail::throw_invalid_message("eagle1: target_hidden_size = ", target_hidden_size,
                                    " must equal hidden_size = ", layer.dim);
    }
    if (draft_vocab_size < 1 || draft_vocab_size > layer.vocab_size) {
      detail::throw_invalid_message("eagle: draft_vocab_size = ", draft_vocab_size,
                                    " must be in [1, vocab_size = ", layer.vocab_size, "]");
    }
    if (kind == EagleKind::eagle1 && draft_vocab_size != layer.vocab_size) {
      detail::throw_invalid_message("eagle1: draft_vocab_size = ", draft_vocab_size,
                                    " must equal vocab_size = ", layer.vocab_size);
    }
    const size_t expected = kind == EagleKind::eagle3 ? 3 : 1;
    if (feature_layers.size() != expected) {
      detail::throw_invalid_message(to_string(kind), ": feature_layers has ", feature_layers.size(),
                                    " entries, expected ", expected);
    }
    for (size_t i = 0; i < feature_layers.size(); ++i) {
      if (feature_layers[i] < 0)
        detail::throw_invalid_message("eagle: feature_layers[", i, "] = ", feature_layers[i],
                                      " must be >= 0");
    }
  }

  // EAGLE-3's default target layers for a target of `layers` decoder layers: the inputs of layers
  // 2, L/2 and L-3, as its reference implementation and vLLM choose them. Throws for L < 3.
  static std::vector<int64_t> eagle3_default_layers(int64_t layers) {
    if (layers < 3) {
      detail::throw_invalid_message(
          "eagle3: a target of ", layers,
          " layers has no default feature layers (2, L/2, L-3): give them explicitly");
    }
    return {std::min<int64_t>(2, layers - 1), layers / 2, layers - 3};
  }
};

// The head's weights, every projection [out, in].
struct EagleWeights {
  at::Tensor embedding{};    // [vocab, H]: the head's own or the target's
  at::Tensor fc{};           // [H, fc_inputs()]
  at::Tensor fc_bias{};      // [H]; EAGLE-1 always, EAGLE-3 optional (undefined: none)
  at::Tensor input_norm{};   // EAGLE-3: [H], on the embedding
  at::Tensor hidden_norm{};  // EAGLE-3: [H], on the hidden state
  at::Tensor wq{}, wk{}, wv{},
      wo{};               // [heads hd, attention_inputs()], [kv hd, ...] twice, [H, heads hd]
  at::Tensor ffn_norm{};  // [H] (post_attention_layernorm)
  at::Tensor w_gate{}, w_up{}, w_down{};  // [F, H], [F, H], [H, F]
  at::Tensor norm{};                      // EAGLE-3: [H], before lm_head
  at::Tensor lm_head{};  // EAGLE-3: [draft_vocab, H]; EAGLE-1: the target's classifier [vocab, H]
  at::Tensor d2t{};      // EAGLE-3: int64 [draft_vocab], target id = draft id + d2t[draft id];
                         // undefined: the identity (draft_vocab == vocab)
};

// A head's keys and values for positions [start, start + length()), in a buffer that grows by
// doubling (no allocation per token) and is cut back without copying.
class EagleCache {
 public:
  [[nodiscard]] int64_t start() const noexcept { return start_; }
  [[nodiscard]] int64_t length() const noexcept { return length_; }
  [[nodiscard]] int64_t end() const noexcept { return start_ + length_; }
  // [kv_heads, length, head_dim] views.
  [[nodiscard]] at::Tensor keys() const {
    return length_ == 0 ? at::Tensor() : keys_.narrow(1, 0, length_);
  }
  [[nodiscard]] at::Tensor values() const {
    return length_ == 0 ? at::Tensor() : values_.narrow(1, 0, length_);
  }

  // Forgets everything; the next entry will be at `position`.
  void reset(int64_t position) {
    start_ = position;
    length_ = 0;
  }
  // Keeps positions before `position` (in [start, end]).
  void truncate(int64_t position) {
    if (position < start_ || position > end()) {
      detail::throw_invalid_message("EagleCache::truncate: position = ", position, " must be in [",
                                    start_, ", ", end(), "]");
    }
    length_ = position - start_;
  }
  // Appends keys and values [kv_heads, T, head_dim] at the end.
  void append(const at::Tensor& keys, const at::Tensor& values) {
    const int64_t count = keys.size(1);
    reserve(count, keys.size(0), keys.size(2), keys.options());
    keys_.narrow(1, length_, count).copy_(keys);
    values_.narrow(1, length_, count).copy_(values);
    length_ += count;
  }

  // append() for fp32 rows on the host: row t's kv_heads * head_dim keys at keys + t * stride, its
  // values at values + t * stride. The cache must hold fp32 CPU tensors or nothing yet.
  void append_host(const float* keys, const float* values, int64_t stride, int64_t count, int64_t kv_heads,
                   int64_t head_dim) {
    reserve(count, kv_heads, head_dim, at::TensorOptions().dtype(at::kFloat));
    write_host(keys, values, stride, count, kv_heads, head_dim, keys_.data_ptr<float>(),
               values_.data_ptr<float>(), keys_.size(1), length_);
    length_ += count;
  }

  // Writes `count` rows of fp32 keys and values (as append_host() takes them) into buffers
  // [kv_heads, capacity, head_dim] at slot `at`.
  static void write_host(const float* keys, const float* values, int64_t stride, int64_t count,
                         int64_t kv_heads, int64_t head_dim, float* k, float* v, int64_t capacity,
                         int64_t at) {
    for (int64_t t = 0; t < count; ++t) {
      for (int64_t h = 0; h < kv_heads; ++h) {
        std::copy_n(keys + t * stride + h * head_dim, head_dim,
                    k + (h * capacity + at + t) * head_dim);
        std::copy_n(values + t * stride + h * head_dim, head_dim,
                    v + (h * capacity + at + t) * head_dim);
      }
    }
  }

  // The whole buffers [kv_heads, capacity, head_dim], of which positions [0, length()) are held.
  [[nodiscard]] const at::Tensor& key_buffer() const noexcept { return keys_; }
  [[nodiscard]] const at::Tensor& value_buffer() const noexcept { return values_; }

 private:
  // Room for `count` more positions of this shape and type (the buffers double when full).
  void reserve(int64_t count, int64_t kv_heads, int64_t head_dim, const at::TensorOptions& options) {
    if (keys_.defined() && keys_.size(1) >= length_ + count && keys_.size(0) == kv_heads && keys_.size(2) == head_dim &&
        keys_.scalar_type() == options.dtype().toScalarType() && keys_.device() == options.device()) {
      return;
    }
    const int64_t capacity = std::max<int64_t>(64, 2 * (length_ + count));
    at::Tensor k = at::empty({kv_heads, capacity, head_dim}, options);
    at::Tensor v = at::empty({kv_heads, capacity, head_dim}, options);
    if (length_ > 0) {
      k.narrow(1, 0, length_).copy_(keys_.narrow(1, 0, length_));
      v.narrow(1, 0, length_).copy_(values_.narrow(1, 0, length_));
    }
    keys_ = k;
    values_ = v;
  }

  at::Tensor keys_{}, values_{};
  int64_t start_ = 0;
  int64_t length_ = 0;
};

// The keys and values of a head over a batch of rows, each row's positions
// [start(r), start(r) + length(r)) held from slot 0 of its row: buffers [rows, kv_heads,
// capacity, head_dim] that grow by doubling, rows cut back by moving their length alone. A
// batched forward (EagleHead::forward_rows) writes each row's new entries after its own length,
// so rows of different lengths need no padding in the cache; slots past a row's length are stale
// and never read unmasked (they always hold finite numbers).
// The buffers keep room for more rows than rows() (they double too), so that rows joining and
// leaving between steps (continuous batching) move only what they must: a joining row is copied
// into a free row of the buffers, and select() keeping rows in their order moves each kept row's
// entries up in place; nothing else is reallocated or copied.
class EagleBatchCache {
 public:
  // `rows` empty rows, each starting at position 0.
  explicit EagleBatchCache(int64_t rows = 0)
      : starts_(static_cast<size_t>(std::max<int64_t>(rows, 0)), 0),
        lengths_(static_cast<size_t>(std::max<int64_t>(rows, 0)), 0) {
    if (rows < 0) detail::throw_invalid("rows", "be >= 0", rows);
  }

  [[nodiscard]] int64_t rows() const noexcept { return static_cast<int64_t>(lengths_.size()); }
  [[nodiscard]] int64_t start(int64_t row) const { return starts_.at(index(row)); }
  [[nodiscard]] int64_t length(int64_t row) const { return lengths_.at(index(row)); }
  [[nodiscard]] int64_t end(int64_t row) const { return start(row) + length(row); }
  [[nodiscard]] std::span<const int64_t> lengths() const noexcept { return lengths_; }
  // Row `row`'s keys and values [kv_heads, length, head_dim] (views; undefined when empty).
  [[nodiscard]] at::Tensor keys(int64_t row) const { return row_view(keys_, row); }
  [[nodiscard]] at::Tensor values(int64_t row) const { return row_view(values_, row); }

  // Forgets row `row`; its next entry will be at `position`.
  void reset(int64_t row, int64_t position) {
    starts_.at(index(row)) = position;
    lengths_.at(index(row)) = 0;
  }
  // Keeps row `row`'s positions before `position` (in [start, end]).
  void truncate(int64_t row, int64_t position) {
    if (position < start(row) || position > end(row)) {
      detail::throw_invalid_message("EagleBatchCache::truncate: position = ", position, " of row ",
                                    row, " must be in [", start(row), ", ", end(row), "]");
    }
    lengths_[static_cast<size_t>(row)] = position - starts_[static_cast<size_t>(row)];
  }
  // Keeps the rows `rows` (indices in [0, rows()), in their new order). Rows kept in increasing
  // order move up in place (only their entries); any other order gathers them.
  void select(std::span<const int64_t> rows) {
    std::vector<int64_t> starts, lengths;
    for (const int64_t r : rows) {
      starts.push_back(start(r));
      lengths.push_back(length(r));
    }
    if (keys_.defined()) {
      bool increasing = true;
      for (size_t i = 1; i < rows.size(); ++i) increasing = increasing && rows[i] > rows[i - 1];
      if (increasing) {
        // Row i's source rows[i] >= i, and every later source is beyond it: moving rows in order
        // never overwrites a row still to be moved.
        for (size_t i = 0; i < rows.size(); ++i) {
          const int64_t from = rows[i], n = lengths[i];
          if (from == static_cast<int64_t>(i) || n == 0) continue;
          for (at::Tensor* buffer : {&keys_, &values_}) {
            buffer->select(0, static_cast<int64_t>(i)).narrow(1, 0, n).copy_(buffer->select(0, from).narrow(1, 0, n));
          }
        }
      } else {
        const at::Tensor index =
            detail::to_device<int64_t>(rows, {static_cast<int64_t>(rows.size())}, keys_.device());
        const int64_t span = lengths.empty() ? 0 : *std::max_element(lengths.begin(), lengths.end());
        if (span > 0) {
          const at::Tensor keys = keys_.narrow(2, 0, span).index_select(0, index);
          const at::Tensor values = values_.narrow(2, 0, span).index_select(0, index);
          if (row_capacity() < keys.size(0)) grow(keys.size(0), keys_.size(2));  // a row kept twice
          keys_.narrow(0, 0, keys.size(0)).narrow(2, 0, span).copy_(keys);
          values_.narrow(0, 0, values.size(0)).narrow(2, 0, span).copy_(values);
        }
      }
    }
    starts_ = std::move(starts);
    lengths_ = std::move(lengths);
    refresh();
  }

  // The rows of `other` follow this cache's, each with its positions and entries (a row whose
  // head was fed on its own joins a batch). Only their entries are copied, into free rows of the
  // buffers (which double when none is free); buffers of different heads (kv_heads, head_dim,
  // dtype, device) are refused.
  void append_rows_from(const EagleBatchCache& other) {
    const int64_t n = other.rows();
    if (n == 0) return;
    const int64_t held = other.keys_.defined() ? other.longest() : 0;
    if (held > 0) {
      const at::Tensor& from = other.keys_;
      if (keys_.defined() && (keys_.size(1) != from.size(1) || keys_.size(3) != from.size(3) ||
                              keys_.scalar_type() != from.scalar_type() || keys_.device() != from.device())) {
        detail::throw_invalid_message("EagleBatchCache::append_rows_from: entries ", from.sizes(), " ",
                                      from.scalar_type(), " do not fit this cache's ", keys_.sizes(), " ",
                                      keys_.scalar_type());
      }
      if (!keys_.defined()) {
        rebuild(rows() + n, from.size(2), from.size(1), from.size(3), from.options());
      } else if (keys_.size(2) < held) {
        grow(row_capacity(), held);
      }
    }
    if (keys_.defined()) {
      if (row_capacity() < rows() + n) grow(std::max(rows() + n, 2 * row_capacity()), keys_.size(2));
      if (held > 0) {
        keys_.narrow(0, rows(), n).narrow(2, 0, held).copy_(other.keys_.narrow(2, 0, held));
        values_.narrow(0, rows(), n).narrow(2, 0, held).copy_(other.values_.narrow(2, 0, held));
      }
    }
    starts_.insert(starts_.end(), other.starts_.begin(), other.starts_.end());
    lengths_.insert(lengths_.end(), other.lengths_.begin(), other.lengths_.end());
    refresh();
  }

  // The buffers' rows [0, rows()): [rows, kv_heads, capacity, head_dim] (for
  // EagleHead::forward_rows; contiguous views of the whole buffers, undefined before any entry).
  [[nodiscard]] const at::Tensor& key_buffer() const noexcept { return key_rows_; }
  [[nodiscard]] const at::Tensor& value_buffer() const noexcept { return value_rows_; }
  // The rows the buffers have room for (rows() and the free ones).
  [[nodiscard]] int64_t row_capacity() const noexcept { return keys_.defined() ? keys_.size(0) : 0; }

  // Room for `count` more slots after the longest row, of this shape and type (the buffers double
  // when full; rows keep their entries).
  void reserve(int64_t count, int64_t kv_heads, int64_t head_dim,
               const at::TensorOptions& options) {
    const int64_t need = longest() + count;
    const bool fits = keys_.defined() && keys_.size(1) == kv_heads && keys_.size(3) == head_dim &&
                      keys_.scalar_type() == options.dtype().toScalarType() && keys_.device() == options.device();
    if (fits && keys_.size(2) >= need) return;
    // The first entries, or entries of another type, take new buffers (the rows' entries
    // converted).
    rebuild(std::max(rows(), row_capacity()), std::max<int64_t>(64, 2 * need), kv_heads, head_dim, options);
  }
  // Adds counts[r] entries to row r (written by the forward after its old length).
  void advance(std::span<const int64_t> counts) {
    for (size_t r = 0; r < lengths_.size(); ++r) lengths_[r] += counts[r];
  }
  [[nodiscard]] int64_t longest() const noexcept {
    return lengths_.empty() ? 0 : *std::max_element(lengths_.begin(), lengths_.end());
  }

  // One row as the head's CPU loops use a cache (EagleCache's interface; fp32 CPU buffers with
  // room reserved beforehand).
  class Row {
   public:
    Row(EagleBatchCache& cache, int64_t row) : cache_(cache), row_(row) {}
    [[nodiscard]] int64_t start() const { return cache_.start(row_); }
    [[nodiscard]] int64_t length() const { return cache_.length(row_); }
    [[nodiscard]] int64_t end() const { return cache_.end(row_); }
    [[nodiscard]] at::Tensor key_buffer() const { return cache_.keys_.select(0, row_); }
    [[nodiscard]] at::Tensor value_buffer() const { return cache_.values_.select(0, row_); }
    void append_host(const float* keys, const float* values, int64_t stride, int64_t count,
                     int64_t kv_heads, int64_t head_dim) {
      if (cache_.keys_.size(2) < length() + count) {
        detail::throw_invalid_message("EagleBatchCache::Row: no room for ", count,
                                      " entries after ", length());
      }
      EagleCache::write_host(keys, values, stride, count, kv_heads, head_dim,
                             key_buffer().data_ptr<float>(), value_buffer().data_ptr<float>(),
                             cache_.keys_.size(2), length());
      cache_.lengths_[static_cast<size_t>(row_)] += count;
    }

   private:
    EagleBatchCache& cache_;
    int64_t row_;
  };

 private:
  [[nodiscard]] size_t index(int64_t row) const {
    if (row < 0 || row >= rows())
      detail::throw_invalid_message("row = ", row, " must be in [0, ", rows(), ")");
    return static_cast<size_t>(row);
  }
  [[nodiscard]] at::Tensor row_view(const at::Tensor& buffer, int64_t row) const {
    const int64_t n = length(row);
    return n == 0 ? at::Tensor() : buffer.select(0, row).narrow(1, 0, n);
  }

  // New buffers [rows, kv_heads, capacity, head_dim] of zeros (finite, as every slot must be),
  // the rows' entries copied over (converted where the options differ).
  void rebuild(int64_t rows, int64_t capacity, int64_t kv_heads, int64_t head_dim, const at::TensorOptions& options) {
    const int64_t held = longest();
    for (at::Tensor* buffer : {&keys_, &values_}) {
      at::Tensor t = at::zeros({rows, kv_heads, capacity, head_dim}, options);
      if (held > 0) t.narrow(0, 0, this->rows()).narrow(2, 0, held).copy_(buffer->narrow(0, 0, this->rows()).narrow(2, 0, held));
      *buffer = std::move(t);
    }
    refresh();
  }
  // rebuild() with this cache's shape and type.
  void grow(int64_t rows, int64_t capacity) { rebuild(rows, capacity, keys_.size(1), keys_.size(3), keys_.options()); }
  // key_buffer() and value_buffer(): the rows in use.
  void refresh() {
    if (!keys_.defined()) return;
    key_rows_ = keys_.narrow(0, 0, rows());
    value_rows_ = values_.narrow(0, 0, rows());
  }

  at::Tensor keys_{}, values_{};  // [row_capacity(), kv_heads, capacity, head_dim]
  at::Tensor key_rows_{}, value_rows_{};
  std::vector<int64_t> starts_, lengths_;
};

class EagleHead {
 public:
  // Throws std::invalid_argument naming the weight, its shape and the expected one when a weight
  // does not fit `config`, and naming d2t's first entry that maps outside the target vocabulary.
  EagleHead(EagleConfig config, EagleWeights weights)
      : config_(std::move(config)), w_(std::move(weights)) {
    config_.validate();
    check_weights();
    const at::Tensor inv_freq = LlamaModel<>::rope_inverse_frequencies(config_.layer);
    inv_freq_ = inv_freq.to(w_.fc.device());
    if (config_.kind == EagleKind::eagle3) {
      at::Tensor ids =
          at::arange(config_.draft_vocab_size, at::TensorOptions(at::kLong).device(w_.fc.device()));
      if (w_.d2t.defined()) ids = ids + w_.d2t;
      draft_to_target_ = ids;
    }
    if (config_.kind == EagleKind::eagle3) {
      const at::Tensor table = draft_to_target_.cpu().contiguous();
      draft_to_target_host_.assign(table.data_ptr<int64_t>(), table.data_ptr<int64_t>() + table.numel());
    }
    if (device().is_cpu() && dtype() == at::kFloat) cpu_ = std::make_shared<const CpuParts>(config_, w_, inv_freq);
  }

  // Whether forwards on the CPU in fp32 run the fused loops (true by default; false runs the ATen
  // forward, e.g. to compare the two). Forwards that record gradients always take the ATen one.
  void use_cpu_kernels(bool enabled) noexcept { cpu_kernels_ = enabled; }
  // Whether forwards that do not record gradients run the fused loops (a CPU fp32 head, not
  // switched off).
  [[nodiscard]] bool uses_cpu_kernels() const noexcept { return cpu_ != nullptr && cpu_kernels_; }

  [[nodiscard]] const EagleConfig& config() const noexcept { return config_; }
  [[nodiscard]] const EagleWeights& weights() const noexcept { return w_; }
  [[nodiscard]] at::Device device() const { return w_.fc.device(); }
  [[nodiscard]] at::ScalarType dtype() const { return w_.fc.scalar_type(); }

  // What the layer reads as the hidden state of positions whose target hidden states are
  // `features` [T, feature width]: fc of them for EAGLE-3, themselves for EAGLE-1 (whose fc comes
  // with the embedding).
  [[nodiscard]] at::Tensor fuse(const at::Tensor& features) const {
    const at::Tensor x = features.to(dtype());
    if (config_.kind == EagleKind::eagle1) return x;
    return at::linear(x, w_.fc, w_.fc_bias);
  }

  // The layer over T positions: tokens `ids` (int64 [T], on the head's device) with hidden states
  // `hidden` [T, H] (fuse()d target states, or the head's own outputs), at positions
  // [cache.end(), cache.end() + T), attending to the cache and causally to each other; appends
  // their keys and values to `cache`. Returns the layer's outputs [T, H] (before the final norm),
  // which logits() reads and later draft positions take as their hidden state.
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& hidden, EagleCache& cache) const {
    if (kernels_apply(hidden) && cache.end() + ids.size(0) <= cpu_->positions) return forward_cpu(ids, hidden, cache);
    const int64_t count = ids.size(0);
    const auto longs = at::TensorOptions(at::kLong).device(device());
    // Query t (position first + t) sees keys at positions <= first + t.
    const at::Tensor key_positions = at::arange(cache.start(), cache.end() + count, longs);
    const at::Tensor query_positions = at::arange(cache.end(), cache.end() + count, longs);
    return forward_masked(ids, hidden, cache, query_positions,
                          key_positions.unsqueeze(0) <= query_positions.unsqueeze(1));
  }

  // forward() for draft trees: token t sits at position positions_of[t] (int64 [T] on the head's
  // device) and attends to the cache's entries and the new tokens where visible[t] (bool
  // [T, cache.length() + T]) is true; appends the T keys and values to the cache in order. The
  // cache's later entries may be other branches' draft positions, which the mask hides; a
  // verified step truncates them away. Always the ATen forward.
  at::Tensor forward_masked(const at::Tensor& ids, const at::Tensor& hidden, EagleCache& cache,
                            const at::Tensor& positions_of, const at::Tensor& visible) const {
    const LlamaConfig& c = config_.layer;
    const int64_t count = ids.size(0);
    const int64_t heads = c.n_heads, kv_heads = c.n_kv_heads, head_dim = c.head_dim();
    const Projected p = project(ids, hidden, positions_of);
    cache.append(p.k.transpose(0, 1), p.v.transpose(0, 1));
    const int64_t length = cache.length();
    const int64_t group = heads / kv_heads;
    // Queries grouped by their key/value head: [kv_heads, group * T, hd].
    const at::Tensor grouped = p.q.transpose(0, 1).reshape({kv_heads, group * count, head_dim});
    at::Tensor scores = at::matmul(grouped, cache.keys().transpose(1, 2))
                            .mul_(1.0 / std::sqrt(static_cast<double>(head_dim)));
    const at::Tensor hidden_keys = visible.to(device()).logical_not();  // [T, length]
    if (hidden_keys.size(0) != count || hidden_keys.size(1) != length) {
      detail::throw_invalid_message("visible must be bool [", count, ", ", length, "], got ", visible.sizes());
    }
    scores.masked_fill_(hidden_keys.repeat({group, 1}).unsqueeze(0),
                        -std::numeric_limits<double>::infinity());
    const at::Tensor probabilities =
        scores.softmax(-1, at::promote_types(scores.scalar_type(), at::kFloat)).to(dtype());
    const at::Tensor attended = at::matmul(probabilities, cache.values())
                                    .view({heads, count, head_dim})
                                    .transpose(0, 1)
                                    .reshape({count, heads * head_dim});
    return finish(p.residual, attended);
  }

  // forward() over a batch of rows in one pass: row r's tokens ids[r, t] (int64 [B, T], on the
  // head's device) with hidden states hidden[r, t] ([B, T, H]) at positions cache.end(r) + t,
  // each row attending to its own cache entries and causally to its own new tokens. Row r keeps
  // the first counts[r] (in [0, T]) of its new entries; its later tokens are padding, whose
  // outputs mean nothing. B must be cache.rows(). Returns the outputs [B, T, H]. One pass over
  // the batch: the ATen forward, or where forward() takes the CPU loops, those loops over every
  // row's tokens (padding skipped; its outputs are zeros).
  at::Tensor forward_rows(const at::Tensor& ids, const at::Tensor& hidden, EagleBatchCache& cache,
                          std::span<const int64_t> counts) const {
    const LlamaConfig& c = config_.layer;
    if (ids.dim() != 2 || ids.size(0) != cache.rows() ||
        static_cast<int64_t>(counts.size()) != cache.rows()) {
      detail::throw_invalid_message("forward_rows: ids must be [", cache.rows(), ", T] with ",
                                    cache.rows(), " counts, got ", ids.sizes(), " and ",
                                    counts.size(), " counts");
    }
    const int64_t b = ids.size(0), count = ids.size(1);
    const int64_t heads = c.n_heads, kv_heads = c.n_kv_heads, head_dim = c.head_dim();
    if (hidden.dim() != 3 || hidden.size(0) != b || hidden.size(1) != count) {
      detail::throw_invalid_message("forward_rows: hidden must be [", b, ", ", count, ", H], got ",
                                    hidden.sizes());
    }
    for (size_t r = 0; r < counts.size(); ++r) {
      if (counts[r] < 0 || counts[r] > count) {
        detail::throw_invalid_message("forward_rows: counts[", r, "] = ", counts[r],
                                      " must be in [0, ", count, "]");
      }
    }
    cache.reserve(count, kv_heads, head_dim, w_.fc.options());
    int64_t last_end = 0;
    for (int64_t r = 0; r < b; ++r) last_end = std::max(last_end, cache.end(r));
    if (kernels_apply(hidden) && last_end + count <= cpu_->positions) {
      // A CPU fp32 head: its fused loops, the rows' real tokens as segments of one pass (the
      // products read the weights once for all rows; each row attends to its own entries).
      std::vector<EagleBatchCache::Row> rows;
      std::vector<int64_t> segments, real;
      for (int64_t r = 0; r < b; ++r) {
        const int64_t n = counts[static_cast<size_t>(r)];
        if (n == 0) continue;
        rows.emplace_back(cache, r);
        segments.push_back(n);
        for (int64_t t = 0; t < n; ++t) real.push_back(r * count + t);
      }
      at::Tensor out = at::zeros({b * count, c.dim}, hidden.options());
      if (real.empty()) return out.view({b, count, c.dim});
      const at::Tensor index = at::tensor(real, at::kLong);
      const at::Tensor outputs =
          forward_cpu(ids.reshape({b * count}).index_select(0, index),
                      hidden.reshape({b * count, hidden.size(2)}).index_select(0, index),
                      std::span<EagleBatchCache::Row>(rows), std::span<const int64_t>(segments));
      return out.index_copy_(0, index, outputs).view({b, count, c.dim});
    }
    const int64_t capacity = cache.key_buffer().size(2);
    // Each (row, t): its position, and for each key/value head its slot in the flattened
    // [B * kv_heads * capacity] buffers.
    std::vector<int64_t> positions(static_cast<size_t>(b * count)),
        slots(positions.size() * kv_heads), lengths(static_cast<size_t>(b));
    for (int64_t r = 0; r < b; ++r) {
      lengths[static_cast<size_t>(r)] = cache.length(r);
      for (int64_t t = 0; t < count; ++t) {
        positions[static_cast<size_t>(r * count + t)] = cache.end(r) + t;
        for (int64_t h = 0; h < kv_heads; ++h) {
          slots[static_cast<size_t>((r * count + t) * kv_heads + h)] =
              (r * kv_heads + h) * capacity + cache.length(r) + t;
        }
      }
    }
    const at::Device where = device();
    // Padding reads zeros, whatever the caller left there: its keys and values land in slots that
    // later forwards read masked, which must hold finite numbers.
    at::Tensor inputs = hidden.reshape({b * count, hidden.size(2)});
    if (std::any_of(counts.begin(), counts.end(), [&](int64_t n) { return n < count; })) {
      std::vector<uint8_t> padding(static_cast<size_t>(b * count));
      for (int64_t r = 0; r < b; ++r) {
        for (int64_t t = counts[static_cast<size_t>(r)]; t < count; ++t)
          padding[static_cast<size_t>(r * count + t)] = 1;
      }
      inputs = inputs.masked_fill(
          detail::to_device<uint8_t>(padding, {b * count, 1}, where).to(at::kBool), 0.0);
    }
    const Projected p = project(ids.reshape({b * count}), inputs,
                                detail::to_device<int64_t>(positions, {b * count}, where));
    const at::Tensor slot = detail::to_device<int64_t>(slots, {b * count * kv_heads}, where);
    cache.key_buffer()
        .view({b * kv_heads * capacity, head_dim})
        .index_copy_(0, slot, p.k.reshape({-1, head_dim}));
    cache.value_buffer()
        .view({b * kv_heads * capacity, head_dim})
        .index_copy_(0, slot, p.v.reshape({-1, head_dim}));
    // Row r's query t sees its slots up to its own, length(r) + t; later slots are another
    // step's or padding.
    const int64_t span = cache.longest() + count;
    const at::Tensor own =
        detail::to_device<int64_t>(lengths, {b, 1, 1}, where) +
        at::arange(count, at::TensorOptions(at::kLong).device(where)).view({1, count, 1});
    const at::Tensor hidden_keys =
        at::arange(span, at::TensorOptions(at::kLong).device(where)).view({1, 1, span}) >
        own;  // [B, T, span]
    const int64_t group = heads / kv_heads;
    const at::Tensor keys =
        cache.key_buffer().narrow(2, 0, span).transpose(2, 3);          // [B, kv, hd, span]
    const at::Tensor values = cache.value_buffer().narrow(2, 0, span);  // [B, kv, span, hd]
    // Queries grouped by their key/value head: [B, kv_heads, group * T, hd].
    const at::Tensor grouped = p.q.view({b, count, heads, head_dim})
                                   .permute({0, 2, 1, 3})
                                   .reshape({b, kv_heads, group * count, head_dim});
    at::Tensor scores =
        at::matmul(grouped, keys).mul_(1.0 / std::sqrt(static_cast<double>(head_dim)));
    scores.masked_fill_(hidden_keys.repeat({1, group, 1}).unsqueeze(1),
                        -std::numeric_limits<double>::infinity());
    const at::Tensor probabilities =
        scores.softmax(-1, at::promote_types(scores.scalar_type(), at::kFloat)).to(dtype());
    const at::Tensor attended = at::matmul(probabilities, values)
                                    .view({b, heads, count, head_dim})
                                    .permute({0, 2, 1, 3})
                                    .reshape({b * count, heads * head_dim});
    cache.advance(counts);
    return finish(p.residual, attended).view({b, count, -1});
  }

  // Logits [T, draft_vocab] of layer outputs [T, H]: lm_head of their norm (EAGLE-3), or the
  // target's classifier of them (EAGLE-1, where the draft vocabulary is the target's).
  [[nodiscard]] at::Tensor logits(const at::Tensor& outputs) const {
    if (kernels_apply(outputs)) {
      const at::Tensor x = outputs.contiguous();
      const int64_t rows = x.size(0), h = config_.layer.dim;
      if (config_.kind == EagleKind::eagle1) return cpu_->lm_head(x, detail::ProductRoute::onednn);
      at::Tensor normed = at::empty({rows, h}, x.options());
      detail::rms_norm_rows(x.data_ptr<float>(), w_.norm.data_ptr<float>(), normed.data_ptr<float>(), rows, h,
                            config_.layer.norm_eps);
      return cpu_->lm_head(normed, detail::ProductRoute::onednn);
    }
    if (config_.kind == EagleKind::eagle1) return at::linear(outputs, w_.lm_head);
    return at::linear(rms_norm(outputs, w_.norm), w_.lm_head);
  }

  // The target id of draft id `d` (in [0, draft_vocab)), on the host.
  [[nodiscard]] int64_t target_id(int64_t d) const {
    return config_.kind == EagleKind::eagle1 ? d : draft_to_target_host_[static_cast<size_t>(d)];
  }

  // Target ids of draft ids (any shape, on the head's device).
  [[nodiscard]] at::Tensor to_target(const at::Tensor& draft_ids) const {
    return config_.kind == EagleKind::eagle1
               ? draft_ids
               : draft_to_target_.index_select(0, draft_ids.flatten()).view_as(draft_ids);
  }

  // Draft logits [T, draft_vocab] spread over the target vocabulary [T, vocab]: each draft id's
  // logit at its target id, -inf at target ids the draft vocabulary lacks.
  [[nodiscard]] at::Tensor target_logits(const at::Tensor& logits) const {
    if (config_.kind == EagleKind::eagle1 || !w_.d2t.defined()) {
      return logits;
    }
    at::Tensor spread = at::full({logits.size(0), config_.vocab_size()},
                                 -std::numeric_limits<double>::infinity(), logits.options());
    return spread.index_copy_(1, draft_to_target_, logits);
  }

  // A random head (tests and benchmarks) on a target's embedding and classifier ([vocab, H] each,
  // whose dtype and device it takes). EAGLE-3's draft vocabulary is the first draft_vocab_size
  // ids in a random order.
  static EagleWeights random(const EagleConfig& config, const at::Tensor& embedding,
                             const at::Tensor& classifier, uint64_t seed) {
    config.validate();
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    const auto normal = [&](std::vector<int64_t> shape, double std) {
      return at::normal(0.0, std, shape, gen, at::TensorOptions(at::kFloat))
          .to(embedding.options());
    };
    const LlamaConfig& c = config.layer;
    const int64_t h = c.dim, in = config.attention_inputs();
    const double s = 1.0 / std::sqrt(static_cast<double>(h));
    EagleWeights w;
    w.embedding = embedding;
    w.fc =
        normal({h, config.fc_inputs()}, 1.0 / std::sqrt(static_cast<double>(config.fc_inputs())));
    w.fc_bias = config.kind == EagleKind::eagle1 ? normal({h}, 0.1) : at::Tensor();
    w.wq = normal({c.n_heads * c.head_dim(), in}, 2.0 / std::sqrt(static_cast<double>(in)));
    w.wk = normal({c.kv_dim(), in}, 2.0 / std::sqrt(static_cast<double>(in)));
    w.wv = normal({c.kv_dim(), in}, 1.0 / std::sqrt(static_cast<double>(in)));
    w.wo = normal({h, c.n_heads * c.head_dim()}, s);
    w.ffn_norm = at::ones({h}, embedding.options());
    w.w_gate = normal({c.hidden_dim, h}, s);
    w.w_up = normal({c.hidden_dim, h}, s);
    w.w_down = normal({h, c.hidden_dim}, 1.0 / std::sqrt(static_cast<double>(c.hidden_dim)));
    if (config.kind == EagleKind::eagle3) {
      w.input_norm = at::ones({h}, embedding.options());
      w.hidden_norm = at::ones({h}, embedding.options());
      w.norm = at::ones({h}, embedding.options());
      const at::Tensor order = at::randperm(c.vocab_size, gen, at::TensorOptions(at::kLong))
                                   .narrow(0, 0, config.draft_vocab_size);
      const at::Tensor sorted = std::get<0>(order.sort());
      w.d2t = (sorted - at::arange(config.draft_vocab_size, at::kLong)).to(embedding.device());
      w.lm_head = classifier.index_select(0, sorted.to(classifier.device())).clone();
    } else {
      w.lm_head = classifier;
    }
    return w;
  }

 private:
  // The layer's inputs of T tokens: the residual stream [T, H], rotated queries [T, heads, hd],
  // rotated keys and values [T, kv_heads, hd].
  struct Projected {
    at::Tensor residual, q, k, v;
  };
  Projected project(const at::Tensor& ids, const at::Tensor& hidden,
                    const at::Tensor& positions_of) const {
    const LlamaConfig& c = config_.layer;
    const int64_t count = ids.size(0);
    const int64_t heads = c.n_heads, kv_heads = c.n_kv_heads, head_dim = c.head_dim();
    const at::Tensor embedded = at::embedding(w_.embedding, ids).to(dtype());
    const at::Tensor h = hidden.to(dtype());
    Projected p;
    at::Tensor attention_input;
    if (config_.kind == EagleKind::eagle3) {
      const at::Tensor normed = rms_norm(h, w_.hidden_norm);
      p.residual = config_.norm_before_residual ? normed : h;
      attention_input = at::cat({rms_norm(embedded, w_.input_norm), normed}, -1);
    } else {
      p.residual = at::linear(at::cat({embedded, h}, -1), w_.fc, w_.fc_bias);
      attention_input = p.residual;
    }
    const at::Tensor positions = positions_of.to(at::kDouble);
    const at::Tensor angles = positions.unsqueeze(1) * inv_freq_.unsqueeze(0);  // [T, hd/2]
    const at::Tensor cos = angles.cos().to(dtype()).unsqueeze(1),
                     sin = angles.sin().to(dtype()).unsqueeze(1);
    const auto rotate = [&](const at::Tensor& x) {  // x [T, n, hd]: consecutive pairs
      const at::Tensor pairs = x.reshape({count, x.size(1), head_dim / 2, 2});
      const at::Tensor even = pairs.select(-1, 0), odd = pairs.select(-1, 1);
      return at::stack({even * cos - odd * sin, even * sin + odd * cos}, -1).reshape(x.sizes());
    };
    p.q = rotate(at::linear(attention_input, w_.wq).view({count, heads, head_dim}));
    p.k = rotate(at::linear(attention_input, w_.wk).view({count, kv_heads, head_dim}));
    p.v = at::linear(attention_input, w_.wv).view({count, kv_heads, head_dim});
    return p;
  }
  // The layer's output from its residual stream [T, H] and attention [T, heads * hd]: the output
  // projection, then the SwiGLU block.
  at::Tensor finish(const at::Tensor& residual, const at::Tensor& attended) const {
    const at::Tensor x = residual + at::linear(attended, w_.wo);
    const at::Tensor f = rms_norm(x, w_.ffn_norm);
    return x + at::linear(at::silu(at::linear(f, w_.w_gate)) * at::linear(f, w_.w_up), w_.w_down);
  }

  // The CPU fp32 forward's fused weights, products and rotary tables, for positions below
  // `positions` (later ones take the ATen forward).
  struct CpuParts {
    CpuParts(const EagleConfig& config, const EagleWeights& w, const at::Tensor& inv_freq)
        : wqkv(at::cat({w.wq, w.wk, w.wv}, 0).contiguous()),
          w13(at::cat({w.w_gate, w.w_up}, 0).contiguous()),
          fc(w.fc.contiguous(), w.fc_bias.defined() ? w.fc_bias.contiguous() : at::Tensor()),
          qkv(wqkv, at::Tensor()),
          wo(w.wo.contiguous(), at::Tensor()),
          gate_up(w13, at::Tensor()),
          down(w.w_down.contiguous(), at::Tensor()),
          lm_head(w.lm_head, at::Tensor()),
          embedding(w.embedding.contiguous()),
          positions(std::min<int64_t>(std::max<int64_t>(config.layer.max_seq_len, 1), 16384)) {
      const at::Tensor angles = at::arange(positions, at::kDouble).unsqueeze(1) * inv_freq.cpu().unsqueeze(0);
      cos = angles.cos().to(at::kFloat).contiguous();
      sin = angles.sin().to(at::kFloat).contiguous();
    }
    at::Tensor wqkv, w13;
    detail::CpuLinear fc, qkv, wo, gate_up, down, lm_head;
    at::Tensor embedding, cos, sin;
    int64_t positions;
  };

  [[nodiscard]] bool kernels_apply(const at::Tensor& x) const {
    return cpu_ && cpu_kernels_ && x.device().is_cpu() && x.scalar_type() == at::kFloat &&
           !(at::GradMode::is_enabled() && (x.requires_grad() || w_.fc.requires_grad()));
  }

  // forward() as loops over fp32 rows around the products (see the top of this file).
  at::Tensor forward_cpu(const at::Tensor& ids, const at::Tensor& hidden, EagleCache& cache) const {
    const int64_t count = ids.size(0);
    return forward_cpu(ids, hidden, std::span<EagleCache>(&cache, 1), std::span<const int64_t>(&count, 1));
  }

  // forward_cpu() over segments of the T tokens: the first counts[0] extend caches[0], the next
  // counts[1] caches[1], and so on, each attending to its own cache; the products run once over
  // all T (one pass over the weights for every segment). `Cache`: EagleCache, or a row of an
  // EagleBatchCache.
  template <class Cache>
  at::Tensor forward_cpu(const at::Tensor& ids_in, const at::Tensor& hidden, std::span<Cache> caches,
                         std::span<const int64_t> counts) const {
    const LlamaConfig& c = config_.layer;
    const CpuParts& p = *cpu_;
    const bool eagle3 = config_.kind == EagleKind::eagle3;
    const int64_t count = ids_in.size(0), h = c.dim, in = config_.attention_inputs();
    const int64_t heads = c.n_heads, kv_heads = c.n_kv_heads, head_dim = c.head_dim();
    const int64_t q_width = heads * head_dim, kv_width = kv_heads * head_dim, width = q_width + 2 * kv_width;
    const int64_t ffn = c.hidden_dim;
    const auto onednn = detail::ProductChoice::automatic;  // the measured fastest route
    const at::Tensor ids = ids_in.to(at::kLong).contiguous();
    const at::Tensor states = hidden.contiguous();
    const int64_t* id = ids.data_ptr<int64_t>();
    const float* state = states.data_ptr<float>();
    const float* embedding = p.embedding.data_ptr<float>();
    const auto options = at::TensorOptions().dtype(at::kFloat);
    at::Tensor out = at::empty({count, h}, options);
    std::vector<float> input(static_cast<size_t>(count * in)), qkv(static_cast<size_t>(count * width));
    std::vector<float> attended(static_cast<size_t>(count * q_width)), normed(static_cast<size_t>(count * h));
    std::vector<float> gate_up(static_cast<size_t>(count * 2 * ffn)), act(static_cast<size_t>(count * ffn));
    float* x = out.data_ptr<float>();  // the residual stream
    if (eagle3) {
      for (int64_t t = 0; t < count; ++t) {
        float* row = input.data() + t * in;
        detail::rms_norm_rows(embedding + id[t] * h, w_.input_norm.data_ptr<float>(), row, 1, h, c.norm_eps);
        detail::rms_norm_rows(state + t * h, w_.hidden_norm.data_ptr<float>(), row + h, 1, h, c.norm_eps);
        std::copy_n(config_.norm_before_residual ? row + h : state + t * h, h, x + t * h);
      }
    } else {
      std::vector<float> joined(static_cast<size_t>(count * 2 * h));
      for (int64_t t = 0; t < count; ++t) {
        std::copy_n(embedding + id[t] * h, h, joined.data() + t * 2 * h);
        std::copy_n(state + t * h, h, joined.data() + t * 2 * h + h);
      }
      p.fc.into(joined.data(), count, x, onednn);
      std::copy_n(x, count * h, input.data());
    }
    p.qkv.into(input.data(), count, qkv.data(), onednn);
    const float* cos = p.cos.data_ptr<float>();
    const float* sin = p.sin.data_ptr<float>();
    std::vector<float> causal;  // [n, n]: 0 where token t sees new token u <= t, -inf after
    int64_t offset = 0;  // the segment's first token
    for (size_t segment = 0; segment < caches.size(); ++segment) {
      Cache& cache = caches[segment];
      const int64_t n = counts[segment];
      float* const rows = qkv.data() + offset * width;
      const int64_t first = cache.end();
      for (int64_t t = 0; t < n; ++t) {
        detail::rotate_heads(rows + t * width, heads + kv_heads, head_dim, first + t, cos, sin);
      }
      cache.append_host(rows + q_width, rows + q_width + kv_width, width, n, kv_heads, head_dim);
      // The held positions [start, end) as the model's loops read a cache: [1, kv_heads, keys,
      // head_dim], heads head_stride apart and rows head_dim apart; the segment's n tokens last.
      const int64_t past = first - cache.start(), head_stride = cache.key_buffer().stride(0);
      const auto held = [&](const at::Tensor& buffer) {
        return at::from_blob(buffer.template data_ptr<float>(), {1, kv_heads, past + n, head_dim},
                             {0, head_stride, head_dim, 1}, options);
      };
      if (n > 1) {
        causal.assign(static_cast<size_t>(n * n), 0.0F);
        for (int64_t t = 0; t < n; ++t) {
          std::fill(causal.begin() + t * n + t + 1, causal.begin() + (t + 1) * n, -std::numeric_limits<float>::infinity());
        }
      }
      const detail::AttentionShape shape{
          .batch = 1, .count = n, .past = past, .heads = heads, .kv_heads = kv_heads, .head_dim = head_dim};
      detail::attend(shape, rows, width, held(cache.key_buffer()), held(cache.value_buffer()),
                     n > 1 ? causal.data() : nullptr, attended.data() + offset * q_width);
      offset += n;
    }
    std::vector<float> projected(static_cast<size_t>(count * h));
    p.wo.into(attended.data(), count, projected.data(), onednn);
    detail::add_into(x, projected.data(), count * h);
    detail::rms_norm_rows(x, w_.ffn_norm.data_ptr<float>(), normed.data(), count, h, c.norm_eps);
    p.gate_up.into(normed.data(), count, gate_up.data(), onednn);
    detail::swiglu_rows(gate_up.data(), count, ffn, act.data());
    p.down.into(act.data(), count, projected.data(), onednn);
    detail::add_into(x, projected.data(), count * h);
    return out;
  }

  at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight) const {
    const at::Tensor wide = x.to(at::promote_types(x.scalar_type(), at::kFloat));
    return (wide * at::rsqrt(wide.pow(2).mean(-1, /*keepdim=*/true) + config_.layer.norm_eps))
               .to(x.scalar_type()) *
           weight;
  }

  void check_weights() const {
    const LlamaConfig& c = config_.layer;
    const int64_t h = c.dim, in = config_.attention_inputs();
    const at::Tensor& first = w_.fc;
    const auto expect = [&](const at::Tensor& t, const char* name, std::vector<int64_t> shape) {
      if (!t.defined() || t.sizes() != at::IntArrayRef(shape) || !t.is_floating_point() ||
          (first.defined() &&
           (t.scalar_type() != first.scalar_type() || t.device() != first.device()))) {
        detail::throw_invalid_message(
            to_string(config_.kind), " head: ", name, " must be a ", at::IntArrayRef(shape),
            " tensor of fc's dtype and device, got ", t.defined() ? t.sizes() : at::IntArrayRef{},
            t.defined() ? " " : "", t.defined() ? c10::toString(t.scalar_type()) : "nothing");
      }
    };
    expect(w_.fc, "fc", {h, config_.fc_inputs()});
    if (w_.fc_bias.defined() || config_.kind == EagleKind::eagle1)
      expect(w_.fc_bias, "fc.bias", {h});
    expect(w_.embedding, "embedding", {c.vocab_size, h});
    expect(w_.wq, "q_proj", {c.n_heads * c.head_dim(), in});
    expect(w_.wk, "k_proj", {c.kv_dim(), in});
    expect(w_.wv, "v_proj", {c.kv_dim(), in});
    expect(w_.wo, "o_proj", {h, c.n_heads * c.head_dim()});
    expect(w_.ffn_norm, "post_attention_layernorm", {h});
    expect(w_.w_gate, "gate_proj", {c.hidden_dim, h});
    expect(w_.w_up, "up_proj", {c.hidden_dim, h});
    expect(w_.w_down, "down_proj", {h, c.hidden_dim});
    expect(w_.lm_head, "lm_head", {config_.draft_vocab_size, h});
    if (config_.kind == EagleKind::eagle1) return;
    expect(w_.input_norm, "input_layernorm", {h});
    expect(w_.hidden_norm, "hidden_norm", {h});
    expect(w_.norm, "norm", {h});
    if (!w_.d2t.defined()) {
      if (config_.draft_vocab_size != c.vocab_size) {
        detail::throw_invalid_message("eagle3 head: d2t is needed when draft_vocab_size (",
                                      config_.draft_vocab_size, ") differs from vocab_size (",
                                      c.vocab_size, ")");
      }
      return;
    }
    if (w_.d2t.sizes() != at::IntArrayRef{config_.draft_vocab_size} ||
        w_.d2t.scalar_type() != at::kLong) {
      detail::throw_invalid_message("eagle3 head: d2t must be an int64 [", config_.draft_vocab_size,
                                    "] tensor, got ", w_.d2t.sizes(), " ",
                                    c10::toString(w_.d2t.scalar_type()));
    }
    // Once, at load: every draft id must map into the target vocabulary.
    const at::Tensor targets = at::arange(config_.draft_vocab_size, at::kLong) + w_.d2t.cpu();
    const at::Tensor outside = ((targets < 0) | (targets >= c.vocab_size)).nonzero();
    if (outside.numel() > 0) {
      const int64_t d = outside[0][0].item<int64_t>();
      detail::throw_invalid_message("eagle3 head: d2t[", d, "] = ", w_.d2t.cpu()[d].item<int64_t>(),
                                    " maps draft id ", d, " to ", targets[d].item<int64_t>(),
                                    ", outside the target vocabulary [0, ", c.vocab_size, ")");
    }
  }

  EagleConfig config_;
  EagleWeights w_;
  at::Tensor inv_freq_{};         // float64 [hd/2], on the head's device
  at::Tensor draft_to_target_{};  // EAGLE-3: int64 [draft_vocab], target id of each draft id
  std::vector<int64_t> draft_to_target_host_{};  // the same on the host
  std::shared_ptr<const CpuParts> cpu_{};  // the CPU fp32 forward's parts (CPU fp32 heads only)
  bool cpu_kernels_ = true;
};

}  // namespace specdec::models
