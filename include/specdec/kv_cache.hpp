// Key/value caches for attention layers, both modelling the KVCache concept.
//
// A cache holds, for every layer, keys and values [batch, kv_heads, length, head_dim]. An attention
// layer calls update(layer, keys, values) with the new positions' keys and values and attends over
// what it returns; once every layer has been updated the model calls commit(new_positions). Until
// the commit the new positions are not part of the cache: a forward that throws half-way leaves the
// cache as it was.
//
// DynamicKVCache grows by concatenation and needs no capacity. StaticKVCache preallocates its
// capacity and writes in place: a step allocates no storage, and prune() only moves the length.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/detail/check.hpp"
#include "specdec/device.hpp"

namespace specdec {
namespace detail {

inline void check_prune(int64_t n, int64_t length) {
  if (n < 0 || n > length) throw_invalid_message("prune count must be in [0, ", length, "], got ", n);
}

inline void check_layer(int64_t layer, int64_t num_layers) {
  if (layer < 0 || layer >= num_layers) {
    throw_invalid_message("layer must be in [0, ", num_layers, "), got ", layer);
  }
}

inline void check_new_entries(const at::Tensor& keys, const at::Tensor& values) {
  if (!keys.defined() || !values.defined() || keys.dim() != 4 || !keys.sizes().equals(values.sizes())) {
    throw_invalid_message(
        "keys and values must both have shape [batch, kv_heads, new_positions, head_dim], got ",
        keys.defined() ? keys.sizes() : at::IntArrayRef{}, " and ",
        values.defined() ? values.sizes() : at::IntArrayRef{});
  }
}

inline void check_rows(const at::Tensor& rows, int64_t batch) {
  if (!rows.defined() || rows.dim() != 1 || rows.scalar_type() != at::kLong) {
    throw_invalid_message("rows must be a 1-D int64 tensor of batch indices");
  }
  if (rows.numel() == 0 || !rows.is_cpu()) return;
  const at::Tensor host = rows.contiguous();
  const int64_t* data = host.data_ptr<int64_t>();
  const auto [low, high] = std::minmax_element(data, data + host.numel());
  if (*low < 0 || *high >= batch) {
    throw_invalid_message("rows must index batch rows in [0, ", batch, "), got values in [", *low, ", ",
                          *high, "]");
  }
}

// Checks reorder()'s rows and returns them on `device`. Host rows are checked value by value and
// copied up once without blocking; rows already on a device are used as they are (checking their
// values would cost a synchronisation; an out-of-range row fails in index_select).
inline at::Tensor rows_on(const at::Tensor& rows, int64_t batch, const at::Device& device) {
  check_rows(rows, batch);
  if (!rows.is_cpu()) return rows.to(device);
  const at::Tensor host = rows.contiguous();
  return to_device<int64_t>(std::span<const int64_t>(host.data_ptr<int64_t>(), static_cast<size_t>(host.numel())),
                            {host.numel()}, device);
}

// Checks keep()'s arguments and returns the positions as an int64 tensor on `device` (an
// asynchronous host-to-device copy, no synchronisation).
inline at::Tensor keep_index(int64_t prefix, std::span<const int64_t> positions, int64_t length,
                             const at::Device& device) {
  if (prefix < 0 || prefix > length) throw_invalid_message("keep prefix must be in [0, ", length, "], got ", prefix);
  int64_t previous = prefix - 1;
  for (size_t i = 0; i < positions.size(); ++i) {
    if (positions[i] <= previous || positions[i] >= length) {
      throw_invalid_message("keep positions must increase strictly within [prefix = ", prefix, ", length = ",
                            length, "), got positions[", i, "] = ", positions[i]);
    }
    previous = positions[i];
  }
  return to_device(positions, {static_cast<int64_t>(positions.size())}, device);
}

}  // namespace detail

// A cache that grows by concatenation: memory follows the sequence length, no capacity to choose.
class DynamicKVCache {
 public:
  // An empty cache for a model with `num_layers` attention layers (>= 1).
  explicit DynamicKVCache(int64_t num_layers) : keys_(check_layers(num_layers)), values_(num_layers) {}

  [[nodiscard]] int64_t length() const noexcept { return length_; }
  [[nodiscard]] int64_t num_layers() const noexcept { return static_cast<int64_t>(keys_.size()); }

  // Drops the last n positions, 0 <= n <= length(). Views only: no copy.
  void prune(int64_t n) {
    detail::check_prune(n, length_);
    length_ -= n;
    for (size_t layer = 0; layer < keys_.size(); ++layer) {
      if (keys_[layer].defined()) {
        keys_[layer] = keys_[layer].narrow(2, 0, length_);
        values_[layer] = values_[layer].narrow(2, 0, length_);
      }
    }
  }

  // Appends this layer's keys and values [batch, kv_heads, T, head_dim] after the committed
  // positions. Returns the layer's keys and values for all length() + T positions.
  std::pair<at::Tensor, at::Tensor> update(int64_t layer, const at::Tensor& keys,
                                           const at::Tensor& values) {
    detail::check_layer(layer, num_layers());
    detail::check_new_entries(keys, values);
    auto& cached_keys = keys_[static_cast<size_t>(layer)];
    auto& cached_values = values_[static_cast<size_t>(layer)];
    if (!cached_keys.defined() || length_ == 0) {
      cached_keys = keys;
      cached_values = values;
    } else {
      check_compatible(cached_keys, keys);
      cached_keys = at::cat({cached_keys.narrow(2, 0, length_), keys}, 2);
      cached_values = at::cat({cached_values.narrow(2, 0, length_), values}, 2);
    }
    return {cached_keys, cached_values};
  }

  // Makes the `new_positions` written by update() to every layer part of the cache.
  void commit(int64_t new_positions) {
    for (const auto& keys : keys_) {
      if (!keys.defined() || keys.size(2) != length_ + new_positions) {
        detail::throw_invalid_message("commit(", new_positions,
                                      ") requires every layer to hold length() + ", new_positions,
                                      " = ", length_ + new_positions, " positions");
      }
    }
    length_ += new_positions;
  }

  // Keys / values [batch, kv_heads, length(), head_dim] of one layer (undefined while empty).
  [[nodiscard]] at::Tensor keys(int64_t layer) const { return layer_view(keys_, layer); }
  [[nodiscard]] at::Tensor values(int64_t layer) const { return layer_view(values_, layer); }

  // Keeps positions [0, prefix) and then `positions` (strictly increasing, in [prefix, length())):
  // the accepted path of a draft tree. Moves only the kept positions after prefix, in place.
  void keep(int64_t prefix, std::span<const int64_t> positions) {
    if (positions.empty() && prefix == length_) return;
    const at::Device device = keys_.front().defined() ? keys_.front().device() : at::Device(at::kCPU);
    const at::Tensor index = detail::keep_index(prefix, positions, length_, device);
    const auto kept = static_cast<int64_t>(positions.size());
    for (size_t layer = 0; layer < keys_.size(); ++layer) {
      for (auto* tensors : {&keys_, &values_}) {
        at::Tensor& t = (*tensors)[layer];
        if (kept > 0) t.narrow(2, prefix, kept).copy_(t.index_select(2, index));
        t = t.narrow(2, 0, prefix + kept);
      }
    }
    length_ = prefix + kept;
  }

  // Reorders (or repeats) the batch rows: row i becomes the old row rows[i]. For beam search.
  // rows may live on the host (checked, then copied up once without blocking) or on the cache's
  // device (used as they are).
  void reorder(const at::Tensor& rows) {
    if (length_ == 0) return;
    const at::Tensor index = detail::rows_on(rows, keys_.front().size(0), keys_.front().device());
    for (size_t layer = 0; layer < keys_.size(); ++layer) {
      keys_[layer] = keys_[layer].narrow(2, 0, length_).index_select(0, index);
      values_[layer] = values_[layer].narrow(2, 0, length_).index_select(0, index);
    }
  }

 private:
  static size_t check_layers(int64_t num_layers) {
    if (num_layers < 1) detail::throw_invalid("num_layers", "be >= 1", num_layers);
    return static_cast<size_t>(num_layers);
  }

  static void check_compatible(const at::Tensor& cached, const at::Tensor& added) {
    if (cached.size(0) != added.size(0) || cached.size(1) != added.size(1) ||
        cached.size(3) != added.size(3)) {
      detail::throw_invalid_message("new keys ", added.sizes(), " do not match the cached keys ",
                                    cached.sizes(), " in batch, kv_heads or head_dim");
    }
  }

  at::Tensor layer_view(const std::vector<at::Tensor>& tensors, int64_t layer) const {
    detail::check_layer(layer, num_layers());
    const auto& tensor = tensors[static_cast<size_t>(layer)];
    return tensor.defined() ? tensor.narrow(2, 0, length_) : tensor;
  }

  std::vector<at::Tensor> keys_;
  std::vector<at::Tensor> values_;
  int64_t length_ = 0;
};

// The dimensions of a StaticKVCache.
struct StaticKVCacheShape {
  int64_t num_layers = 1;
  int64_t batch = 1;
  int64_t kv_heads = 1;
  int64_t capacity = 1;  // the most positions the cache can hold
  int64_t head_dim = 1;
};

// A cache preallocated to a fixed capacity: update() writes in place, prune() moves the length
// back in O(1), and no step allocates storage.
class StaticKVCache {
 public:
  // Allocates [num_layers, 2, batch, kv_heads, capacity, head_dim] with `options` (dtype, device),
  // uninitialised: only positions written by update() are ever read.
  // Requires every dimension >= 1.
  StaticKVCache(const StaticKVCacheShape& shape, const at::TensorOptions& options)
      : shape_(check_shape(shape)),
        storage_(at::empty({shape.num_layers, 2, shape.batch, shape.kv_heads, shape.capacity,
                            shape.head_dim},
                           options)) {}

  [[nodiscard]] int64_t length() const noexcept { return length_; }
  [[nodiscard]] int64_t capacity() const noexcept { return shape_.capacity; }
  [[nodiscard]] int64_t num_layers() const noexcept { return shape_.num_layers; }
  [[nodiscard]] const StaticKVCacheShape& shape() const noexcept { return shape_; }

  // Drops the last n positions, 0 <= n <= length(): O(1), nothing is touched.
  void prune(int64_t n) {
    detail::check_prune(n, length_);
    length_ -= n;
  }

  // Writes this layer's keys and values [batch, kv_heads, T, head_dim] in place after the
  // committed positions. Returns views of the layer's keys and values for length() + T positions.
  // Throws std::length_error when length() + T exceeds capacity().
  std::pair<at::Tensor, at::Tensor> update(int64_t layer, const at::Tensor& keys,
                                           const at::Tensor& values) {
    detail::check_layer(layer, shape_.num_layers);
    detail::check_new_entries(keys, values);
    if (keys.size(0) != shape_.batch || keys.size(1) != shape_.kv_heads ||
        keys.size(3) != shape_.head_dim) {
      detail::throw_invalid_message("new keys ", keys.sizes(), " do not match the static cache's [",
                                    shape_.batch, ", ", shape_.kv_heads, ", T, ", shape_.head_dim,
                                    "]");
    }
    const int64_t end = length_ + keys.size(2);
    if (end > shape_.capacity) {
      throw std::length_error("StaticKVCache: " + std::to_string(end) +
                              " positions exceed the capacity " + std::to_string(shape_.capacity));
    }
    const at::Tensor layer_keys = storage_[layer][0];
    const at::Tensor layer_values = storage_[layer][1];
    layer_keys.narrow(2, length_, keys.size(2)).copy_(keys);
    layer_values.narrow(2, length_, values.size(2)).copy_(values);
    return {layer_keys.narrow(2, 0, end), layer_values.narrow(2, 0, end)};
  }

  // Makes the `new_positions` written by update() part of the cache.
  void commit(int64_t new_positions) {
    if (new_positions < 0 || length_ + new_positions > shape_.capacity) {
      detail::throw_invalid_message("commit(", new_positions, ") must keep the length in [0, ",
                                    shape_.capacity, "]");
    }
    length_ += new_positions;
  }

  [[nodiscard]] at::Tensor keys(int64_t layer) const {
    detail::check_layer(layer, shape_.num_layers);
    return storage_[layer][0].narrow(2, 0, length_);
  }
  [[nodiscard]] at::Tensor values(int64_t layer) const {
    detail::check_layer(layer, shape_.num_layers);
    return storage_[layer][1].narrow(2, 0, length_);
  }

  // Keeps positions [0, prefix) and then `positions` (strictly increasing, in [prefix, length())):
  // the accepted path of a draft tree. Copies only the kept positions after prefix, in place.
  void keep(int64_t prefix, std::span<const int64_t> positions) {
    const at::Tensor index = detail::keep_index(prefix, positions, length_, storage_.device());
    const auto kept = static_cast<int64_t>(positions.size());
    if (kept > 0) storage_.narrow(4, prefix, kept).copy_(storage_.index_select(4, index));
    length_ = prefix + kept;
  }

  // Reorders (or repeats) the batch rows in place: row i becomes the old row rows[i]. Copies only
  // the length() valid positions.
  void reorder(const at::Tensor& rows) {
    detail::check_rows(rows, shape_.batch);
    if (rows.size(0) != shape_.batch) {
      detail::throw_invalid_message("rows must have ", shape_.batch, " entries, got ", rows.size(0));
    }
    if (length_ == 0) return;
    const at::Tensor valid = storage_.narrow(4, 0, length_);
    valid.copy_(valid.index_select(2, detail::rows_on(rows, shape_.batch, storage_.device())));
  }

 private:
  static StaticKVCacheShape check_shape(const StaticKVCacheShape& shape) {
    const std::pair<const char*, int64_t> fields[] = {
        {"num_layers", shape.num_layers}, {"batch", shape.batch},       {"kv_heads", shape.kv_heads},
        {"capacity", shape.capacity},     {"head_dim", shape.head_dim}};
    for (const auto& [name, value] : fields) {
      if (value < 1) detail::throw_invalid(name, "be >= 1", value);
    }
    return shape;
  }

  StaticKVCacheShape shape_;
  at::Tensor storage_;
  int64_t length_ = 0;
};

static_assert(CompactableKVCache<DynamicKVCache> && ReorderableKVCache<DynamicKVCache>);
static_assert(CompactableKVCache<StaticKVCache> && ReorderableKVCache<StaticKVCache>);

// Drops the last n positions of any KVCache. Requires 0 <= n <= cache.length().
template <KVCache C>
void prune_cache(C& cache, int64_t n) {
  detail::check_prune(n, static_cast<int64_t>(cache.length()));
  cache.prune(n);
}

}  // namespace specdec
