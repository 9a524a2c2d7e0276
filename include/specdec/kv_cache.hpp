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

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/detail/check.hpp"
#include "specdec/detail/torch_compat.hpp"
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

// Writes `added` [batch, kv_heads, T, head_dim] at each row's own positions [lengths[r],
// lengths[r] + T) of `storage` [batch, kv_heads, S, head_dim]; lengths int64 [batch] on its device.
inline void write_rows(const at::Tensor& storage, const at::Tensor& added, const at::Tensor& lengths) {
  const int64_t count = added.size(2);
  const at::Tensor index = (lengths.view({-1, 1}) + at::arange(count, lengths.options()))
                               .view({added.size(0), 1, count, 1})
                               .expand(added.sizes());
  storage.scatter_(2, index, added);
}

// Checks join_rows()'s argument: at least one cache, none null, each of one row (or empty).
// Returns the caches' lengths.
template <class C>
std::vector<int64_t> join_lengths(std::span<const C* const> caches) {
  if (caches.empty()) throw std::invalid_argument("join_rows needs at least one cache, got none");
  std::vector<int64_t> lengths;
  for (size_t r = 0; r < caches.size(); ++r) {
    if (caches[r] == nullptr) throw_invalid_message("join_rows: caches[", r, "] is null");
    const auto rows = caches[r]->row_lengths().size();
    if (rows > 1) throw_invalid_message("join_rows takes one-row caches, caches[", r, "] holds ", rows, " rows");
    lengths.push_back(caches[r]->length());
  }
  return lengths;
}

// Checks that a part of a join matches the first part in everything but its positions.
inline void check_joinable(size_t r, const at::Tensor& part, const at::Tensor& first) {
  if (part.size(1) != first.size(1) || part.size(3) != first.size(3) || part.dtype() != first.dtype() ||
      part.device() != first.device()) {
    throw_invalid_message("join_rows: caches[", r, "] holds keys ", part.sizes(), " (", part.dtype(), ", ",
                          part.device(), "), unlike the first cache's ", first.sizes(), " (", first.dtype(), ", ",
                          first.device(), ")");
  }
}

// Checks split_row()'s row index against a cache's row lengths.
inline void check_split_row(int64_t r, std::span<const int64_t> rows) {
  if (r < 0 || r >= static_cast<int64_t>(rows.size())) {
    throw_invalid_message("split_row: row must be in [0, ", rows.size(), "), got ", r);
  }
}

// The per-row lengths of a batched cache: row r holds its own first rows()[r] positions, at most
// the longest (the cache's length()). Rows are ragged after prune_rows() leaves them unequal.
class RowLengths {
 public:
  [[nodiscard]] std::span<const int64_t> rows() const noexcept { return rows_; }
  [[nodiscard]] bool ragged() const noexcept { return ragged_; }
  [[nodiscard]] int64_t longest() const noexcept { return rows_.empty() ? 0 : *std::max_element(rows_.begin(), rows_.end()); }

  // Sizes the rows on first use (a cache learns its batch from its first update).
  void ensure(int64_t batch, int64_t length) {
    if (static_cast<int64_t>(rows_.size()) != batch && !ragged_) rows_.assign(static_cast<size_t>(batch), length);
  }
  void add(int64_t n) {
    for (auto& row : rows_) row += n;
    device_ = at::Tensor();
  }
  // Every row drops n positions. Requires n <= the shortest row.
  void sub(int64_t n) {
    for (auto& row : rows_) {
      if (row < n) throw_invalid_message("prune count ", n, " exceeds a row of ", row, " positions");
    }
    add(-n);
  }
  // Row r keeps its first lengths[r] positions. Requires lengths[r] in [0, rows()[r]].
  void set(std::span<const int64_t> lengths) {
    if (lengths.size() != rows_.size()) {
      throw_invalid_message("lengths must have one entry per row (", rows_.size(), "), got ", lengths.size());
    }
    for (size_t r = 0; r < lengths.size(); ++r) {
      if (lengths[r] < 0 || lengths[r] > rows_[r]) {
        throw_invalid_message("lengths[", r, "] must be in [0, ", rows_[r], "], got ", lengths[r]);
      }
    }
    rows_.assign(lengths.begin(), lengths.end());
    ragged_ = !rows_.empty() && std::any_of(rows_.begin(), rows_.end(), [&](int64_t l) { return l != rows_.front(); });
    device_ = at::Tensor();
  }
  // n new rows of no positions follow the others.
  void append(int64_t n) {
    rows_.insert(rows_.end(), static_cast<size_t>(n), 0);
    ragged_ = !rows_.empty() && std::any_of(rows_.begin(), rows_.end(), [&](int64_t l) { return l != rows_.front(); });
    device_ = at::Tensor();
  }
  // New rows follow the others, row i holding lengths[i] positions.
  void append(std::span<const int64_t> lengths) {
    std::vector<int64_t> rows = rows_;
    rows.insert(rows.end(), lengths.begin(), lengths.end());
    assign(rows);
  }
  // Row r holds lengths[r] positions (any lengths: the caller wrote them).
  void assign(std::span<const int64_t> lengths) {
    rows_.assign(lengths.begin(), lengths.end());
    ragged_ = !rows_.empty() && std::any_of(rows_.begin(), rows_.end(), [&](int64_t l) { return l != rows_.front(); });
    device_ = at::Tensor();
  }
  // Row i becomes old row rows[i] (host indices, checked by the caller).
  void select(std::span<const int64_t> rows) {
    if (rows_.empty()) return;  // nothing cached yet
    rows_ = pick_rows(rows_, rows);
    ragged_ = !rows_.empty() && std::any_of(rows_.begin(), rows_.end(), [&](int64_t l) { return l != rows_.front(); });
    device_ = at::Tensor();
  }
  // The lengths as int64 [batch] on `device`, uploaded once per change.
  const at::Tensor& on(const at::Device& device) {
    if (!device_.defined() || device_.device() != device) {
      device_ = to_device<int64_t>(rows_, {static_cast<int64_t>(rows_.size())}, device);
    }
    return device_;
  }

 private:
  std::vector<int64_t> rows_;
  bool ragged_ = false;
  at::Tensor device_;
};

// Whether rows (host indices) only drop rows and keep the others' order: strictly increasing.
inline bool increasing(std::span<const int64_t> rows) {
  return std::adjacent_find(rows.begin(), rows.end(), [](int64_t a, int64_t b) { return a >= b; }) == rows.end();
}

inline void check_append(int64_t n) {
  if (n < 0) throw_invalid("n", "be >= 0", n);
}

// Host row indices from a tensor of them (on any device: a device tensor costs a copy).
inline std::vector<int64_t> host_rows(const at::Tensor& rows) {
  const at::Tensor host = rows.is_cpu() ? rows.contiguous() : to_host(rows);
  return {host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel()};
}

}  // namespace detail

// A cache that grows by concatenation: memory follows the sequence length, no capacity to choose.
class DynamicKVCache {
 public:
  // An empty cache for a model with `num_layers` attention layers (>= 1).
  explicit DynamicKVCache(int64_t num_layers) : keys_(check_layers(num_layers)), values_(num_layers) {}

  [[nodiscard]] int64_t length() const noexcept { return length_; }
  [[nodiscard]] int64_t num_layers() const noexcept { return static_cast<int64_t>(keys_.size()); }

  // BatchedKVCache: each row's length (empty before the first update), whether they differ, and
  // the lengths on the cache's device.
  [[nodiscard]] std::span<const int64_t> row_lengths() const noexcept { return rows_.rows(); }
  [[nodiscard]] bool ragged() const noexcept { return rows_.ragged(); }
  [[nodiscard]] const at::Tensor& device_row_lengths() { return rows_.on(device()); }

  // Drops the last n positions of every row, 0 <= n <= the shortest row. Views only: no copy.
  void prune(int64_t n) {
    detail::check_prune(n, length_);
    rows_.sub(n);
    narrow_to(length_ - n);
  }

  // Row r keeps its first lengths[r] positions (lengths[r] in [0, row_lengths()[r]]). Views only.
  void prune_rows(std::span<const int64_t> lengths) {
    rows_.set(lengths);
    narrow_to(rows_.longest());
  }

  // Keeps the rows `rows` (host indices in [0, batch), may repeat): row i becomes old row rows[i].
  void select_rows(std::span<const int64_t> rows) {
    const at::Tensor index = detail::to_device<int64_t>(rows, {static_cast<int64_t>(rows.size())}, device());
    rows_.select(rows);
    // The cache ends where its longest kept row does: a longer row that left takes its positions.
    if (!rows_.rows().empty()) length_ = rows_.longest();
    for (size_t layer = 0; layer < keys_.size(); ++layer) {
      if (!keys_[layer].defined()) continue;
      keys_[layer] = keys_[layer].narrow(2, 0, length_).index_select(0, index);
      values_[layer] = values_[layer].narrow(2, 0, length_).index_select(0, index);
    }
  }

  // AppendableKVCache: n rows of no positions follow the others (a request joins a running
  // batch). Copies the cache once, with zeros for the new rows.
  void append_rows(int64_t n) {
    detail::check_append(n);
    if (n == 0) return;
    rows_.append(n);
    for (size_t layer = 0; layer < keys_.size(); ++layer) {
      if (!keys_[layer].defined()) continue;
      for (auto* tensors : {&keys_, &values_}) {
        at::Tensor& t = (*tensors)[layer];
        t = at::cat({t.narrow(2, 0, length_), at::zeros({n, t.size(1), length_, t.size(3)}, t.options())}, 0);
      }
    }
    narrow_to(rows_.longest());
  }

  // AppendableKVCache: the rows of `source` follow the others, each holding the positions it
  // holds there (a request prefilled on its own joins a running batch). `source` has the same
  // layers, heads, head size, dtype and device, and has held positions (its rows are known).
  // Copies the cache once, zeros after shorter rows (never attended to).
  void append_rows_from(const DynamicKVCache& source) {
    const std::span<const int64_t> lengths = source.rows_.rows();
    if (source.num_layers() != num_layers()) {
      detail::throw_invalid_message("append_rows_from: the source has ", source.num_layers(), " layers, this cache ",
                                    num_layers());
    }
    if (lengths.empty()) {
      throw std::invalid_argument("append_rows_from: the source has held no positions, so its rows are unknown: "
                                  "use append_rows()");
    }
    const auto batch = static_cast<int64_t>(rows_.rows().size());
    const auto n = static_cast<int64_t>(lengths.size());
    const int64_t longest = std::max(length_, *std::max_element(lengths.begin(), lengths.end()));
    for (size_t layer = 0; layer < keys_.size(); ++layer) {
      for (auto* tensors : {&keys_, &values_}) {
        const at::Tensor& from = (tensors == &keys_ ? source.keys_ : source.values_)[layer];
        at::Tensor& t = (*tensors)[layer];
        const at::Tensor& like = from.defined() ? from : t;
        if (!like.defined()) continue;  // no positions on either side yet
        if (from.defined() && t.defined()) detail::check_joinable(0, from, t);
        at::Tensor joined = at::zeros({batch + n, like.size(1), longest, like.size(3)}, like.options());
        if (t.defined() && length_ > 0) joined.narrow(0, 0, batch).narrow(2, 0, length_).copy_(t.narrow(2, 0, length_));
        if (from.defined()) {
          for (int64_t r = 0; r < n; ++r) {
            const int64_t length = lengths[static_cast<size_t>(r)];
            if (length > 0) joined[batch + r].narrow(1, 0, length).copy_(from[r].narrow(1, 0, length));
          }
        }
        t = std::move(joined);
      }
    }
    rows_.append(lengths);
    length_ = rows_.longest();
  }

  // JoinableKVCache: one cache whose row r is caches[r] (one-row caches, empty ones included;
  // same layers, heads, head_dim, dtype and device). Copies every cached position once; shorter
  // rows are padded with zeros (never attended to).
  static DynamicKVCache join_rows(std::span<const DynamicKVCache* const> caches) {
    const std::vector<int64_t> lengths = detail::join_lengths(caches);
    const auto batch = static_cast<int64_t>(caches.size());
    const int64_t layers = caches.front()->num_layers();
    const DynamicKVCache* shaped = nullptr;  // a part with positions gives the joined shape
    for (size_t r = 0; r < caches.size(); ++r) {
      if (caches[r]->num_layers() != layers) {
        detail::throw_invalid_message("join_rows: caches[", r, "] has ", caches[r]->num_layers(),
                                      " layers, caches[0] has ", layers);
      }
      if (shaped == nullptr && lengths[r] > 0) shaped = caches[r];
    }
    DynamicKVCache joined(layers);
    if (shaped == nullptr) return joined;  // nothing cached: rows start at 0 on the first update
    const int64_t longest = *std::max_element(lengths.begin(), lengths.end());
    for (size_t layer = 0; layer < static_cast<size_t>(layers); ++layer) {
      const at::Tensor& like = shaped->keys_[layer];
      joined.keys_[layer] = at::zeros({batch, like.size(1), longest, like.size(3)}, like.options());
      joined.values_[layer] = at::zeros_like(joined.keys_[layer]);
      for (size_t r = 0; r < caches.size(); ++r) {
        const int64_t length = lengths[r];
        if (length == 0) continue;
        detail::check_joinable(r, caches[r]->keys_[layer], like);
        const auto row = static_cast<int64_t>(r);
        joined.keys_[layer][row].narrow(1, 0, length).copy_(caches[r]->keys_[layer][0].narrow(1, 0, length));
        joined.values_[layer][row].narrow(1, 0, length).copy_(caches[r]->values_[layer][0].narrow(1, 0, length));
      }
    }
    joined.length_ = longest;
    joined.rows_.ensure(batch, longest);
    joined.rows_.set(lengths);
    return joined;
  }

  // JoinableKVCache: a one-row cache of row r's positions, copied (it shares no storage with
  // this cache, so keeping it keeps nothing else alive).
  [[nodiscard]] DynamicKVCache split_row(int64_t r) const {
    detail::check_split_row(r, rows_.rows());
    DynamicKVCache row(num_layers());
    const int64_t length = rows_.rows()[static_cast<size_t>(r)];
    if (length == 0) return row;
    for (size_t layer = 0; layer < keys_.size(); ++layer) {
      row.keys_[layer] = keys_[layer].narrow(0, r, 1).narrow(2, 0, length).clone();
      row.values_[layer] = values_[layer].narrow(0, r, 1).narrow(2, 0, length).clone();
    }
    row.length_ = length;
    row.rows_.ensure(1, length);
    return row;
  }

  // Appends this layer's keys and values [batch, kv_heads, T, head_dim] after the committed
  // positions. Returns the layer's keys and values for all length() + T positions.
  std::pair<at::Tensor, at::Tensor> update(int64_t layer, const at::Tensor& keys,
                                           const at::Tensor& values) {
    detail::check_layer(layer, num_layers());
    detail::check_new_entries(keys, values);
    auto& cached_keys = keys_[static_cast<size_t>(layer)];
    auto& cached_values = values_[static_cast<size_t>(layer)];
    rows_.ensure(keys.size(0), length_);
    if (!cached_keys.defined() || length_ == 0) {
      // Copies: the cache owns what it keeps, whatever buffer the caller's tensors view (a
      // forward's scratch, a product it reuses) and however large that buffer is.
      cached_keys = keys.clone(at::MemoryFormat::Contiguous);
      cached_values = values.clone(at::MemoryFormat::Contiguous);
    } else if (!rows_.ragged()) {
      check_compatible(cached_keys, keys);
      cached_keys = at::cat({cached_keys.narrow(2, 0, length_), keys}, 2);
      cached_values = at::cat({cached_values.narrow(2, 0, length_), values}, 2);
    } else {  // rows of different lengths: each row's new positions follow its own
      check_compatible(cached_keys, keys);
      cached_keys = at::cat({cached_keys.narrow(2, 0, length_), at::zeros_like(keys)}, 2);
      cached_values = at::cat({cached_values.narrow(2, 0, length_), at::zeros_like(values)}, 2);
      const at::Tensor& lengths = rows_.on(keys.device());
      detail::write_rows(cached_keys, keys, lengths);
      detail::write_rows(cached_values, values, lengths);
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
    rows_.add(new_positions);
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
    rows_.set(std::vector<int64_t>(rows_.rows().size(), length_));
  }

  // Reorders (or repeats) the batch rows: row i becomes the old row rows[i]. For beam search.
  // rows may live on the host (checked, then copied up once without blocking) or on the cache's
  // device (used as they are; with rows of different lengths they are read on the host).
  void reorder(const at::Tensor& rows) {
    if (length_ == 0) return;
    if (rows_.ragged()) {
      detail::check_rows(rows, keys_.front().size(0));
      select_rows(detail::host_rows(rows));
      return;
    }
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

  [[nodiscard]] at::Device device() const {
    return keys_.front().defined() ? keys_.front().device() : at::Device(at::kCPU);
  }

  void narrow_to(int64_t length) {
    length_ = length;
    for (size_t layer = 0; layer < keys_.size(); ++layer) {
      if (keys_[layer].defined()) {
        keys_[layer] = keys_[layer].narrow(2, 0, length_);
        values_[layer] = values_[layer].narrow(2, 0, length_);
      }
    }
  }

  std::vector<at::Tensor> keys_;
  std::vector<at::Tensor> values_;
  int64_t length_ = 0;
  detail::RowLengths rows_;
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
                           options)),
        slots_(storage_) {
    rows_.ensure(shape.batch, 0);
  }

  [[nodiscard]] int64_t length() const noexcept { return length_; }
  [[nodiscard]] int64_t capacity() const noexcept { return shape_.capacity; }
  [[nodiscard]] int64_t num_layers() const noexcept { return shape_.num_layers; }
  [[nodiscard]] const StaticKVCacheShape& shape() const noexcept { return shape_; }
  // The address of the storage: the same for the cache's whole life unless select_rows() or a
  // move replaces it (a captured CUDA graph that writes the cache is valid while it holds).
  [[nodiscard]] const void* storage_address() const { return storage_.data_ptr(); }

  // BatchedKVCache: each row's length, whether they differ, and the lengths on the cache's device.
  [[nodiscard]] std::span<const int64_t> row_lengths() const noexcept { return rows_.rows(); }
  [[nodiscard]] bool ragged() const noexcept { return rows_.ragged(); }
  [[nodiscard]] const at::Tensor& device_row_lengths() { return rows_.on(storage_.device()); }

  // Drops the last n positions of every row, 0 <= n <= the shortest row: O(1), nothing is touched.
  void prune(int64_t n) {
    detail::check_prune(n, length_);
    rows_.sub(n);
    length_ -= n;
  }

  // Row r keeps its first lengths[r] positions (lengths[r] in [0, row_lengths()[r]]): O(batch).
  void prune_rows(std::span<const int64_t> lengths) {
    rows_.set(lengths);
    length_ = rows_.longest();
  }

  // Keeps the rows `rows` (host indices in [0, batch), may repeat): row i becomes old row rows[i].
  // The batch becomes rows.size(). Rows that only leave (rows strictly increasing, as finished
  // requests leave a batch) are moved down in place, each kept row's own positions copied once,
  // and their slots stay allocated for append_rows(); any other order is a new allocation.
  void select_rows(std::span<const int64_t> rows) {
    if (detail::increasing(rows)) {
      const auto held = rows_.rows();
      for (size_t i = 0; i < rows.size(); ++i) {
        const auto from = rows[i];
        const int64_t length = held.empty() ? 0 : held[static_cast<size_t>(from)];
        if (from == static_cast<int64_t>(i) || length == 0) continue;
        slots_.narrow(2, static_cast<int64_t>(i), 1).narrow(4, 0, length).copy_(slots_.narrow(2, from, 1).narrow(4, 0, length));
      }
      storage_ = slots_.narrow(2, 0, static_cast<int64_t>(rows.size()));
    } else {
      const at::Tensor index = detail::to_device<int64_t>(rows, {static_cast<int64_t>(rows.size())}, storage_.device());
      storage_ = storage_.index_select(2, index);
      slots_ = storage_;
    }
    shape_.batch = static_cast<int64_t>(rows.size());
    rows_.select(rows);
    // The cache ends where its longest kept row does: a longer row that left takes its positions.
    length_ = rows_.longest();
  }

  // AppendableKVCache: n rows of no positions follow the others (a request joins a running
  // batch). The rows reuse the slots that select_rows() freed, with no allocation; beyond the
  // slots ever allocated, the storage grows (one copy of the held positions).
  void append_rows(int64_t n) {
    detail::check_append(n);
    if (n == 0) return;
    const int64_t batch = shape_.batch;
    if (batch + n > slots_.size(2)) {
      auto sizes = slots_.sizes().vec();
      sizes[2] = batch + n;
      at::Tensor grown = at::empty(sizes, slots_.options());
      if (initialized_ > 0) grown.narrow(2, 0, batch).narrow(4, 0, initialized_).copy_(storage_.narrow(4, 0, initialized_));
      slots_ = grown;
    }
    // A new row sees the positions the others hold (masked): they must be finite, never garbage.
    if (initialized_ > 0) slots_.narrow(2, batch, n).narrow(4, 0, initialized_).zero_();
    storage_ = slots_.narrow(2, 0, batch + n);
    shape_.batch = batch + n;
    rows_.append(n);
    length_ = rows_.longest();
  }

  // AppendableKVCache: the rows of `source` follow the others, each holding the positions it
  // holds there (a request prefilled on its own joins a running batch): slots reused as
  // append_rows() reuses them, each joined row's positions copied once. `source` has the same
  // layers, heads, head size, dtype and device; its rows fit this capacity.
  void append_rows_from(const StaticKVCache& source) {
    const StaticKVCacheShape& from = source.shape_;
    if (from.num_layers != shape_.num_layers || from.kv_heads != shape_.kv_heads || from.head_dim != shape_.head_dim ||
        source.storage_.scalar_type() != storage_.scalar_type() || source.storage_.device() != storage_.device()) {
      detail::throw_invalid_message("append_rows_from: the source's [layers ", from.num_layers, ", kv_heads ",
                                    from.kv_heads, ", head_dim ", from.head_dim, "] ", source.storage_.scalar_type(),
                                    " on ", source.storage_.device(), " differ from this cache's [", shape_.num_layers,
                                    ", ", shape_.kv_heads, ", ", shape_.head_dim, "] ", storage_.scalar_type(), " on ",
                                    storage_.device());
    }
    const std::span<const int64_t> lengths = source.rows_.rows();
    const int64_t longest = lengths.empty() ? 0 : *std::max_element(lengths.begin(), lengths.end());
    if (longest > shape_.capacity) {
      detail::throw_invalid_message("append_rows_from: a source row holds ", longest, " positions, the capacity is ",
                                    shape_.capacity);
    }
    const int64_t batch = shape_.batch;
    // The other rows see positions up to the longest (masked): they must be finite.
    if (longest > initialized_) {
      if (batch > 0) storage_.narrow(4, initialized_, longest - initialized_).zero_();
      initialized_ = longest;
    }
    const auto n = static_cast<int64_t>(lengths.size());
    append_rows(n);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t length = lengths[static_cast<size_t>(r)];
      if (length > 0) {
        storage_.narrow(2, batch + r, 1).narrow(4, 0, length).copy_(source.storage_.narrow(2, r, 1).narrow(4, 0, length));
      }
    }
    std::vector<int64_t> held(rows_.rows().begin(), rows_.rows().end() - n);
    held.insert(held.end(), lengths.begin(), lengths.end());
    rows_.assign(held);
    length_ = rows_.longest();
  }

  // The rows the storage holds: append_rows() up to this many allocates nothing.
  [[nodiscard]] int64_t slot_capacity() const noexcept { return slots_.size(2); }

  // JoinableKVCache: one cache whose row r is caches[r] (one-row caches, empty ones included, of
  // one shape, dtype and device), in new storage of the same capacity. Copies every cached
  // position once; the positions between a shorter row's end and the longest are zeroed.
  static StaticKVCache join_rows(std::span<const StaticKVCache* const> caches) {
    const std::vector<int64_t> lengths = detail::join_lengths(caches);
    const StaticKVCache& first = *caches.front();
    StaticKVCacheShape shape = first.shape_;
    shape.batch = static_cast<int64_t>(caches.size());
    for (size_t r = 1; r < caches.size(); ++r) {
      const StaticKVCacheShape& other = caches[r]->shape_;
      if (other.num_layers != shape.num_layers || other.capacity != shape.capacity) {
        detail::throw_invalid_message("join_rows: caches[", r, "] has ", other.num_layers, " layers and capacity ",
                                      other.capacity, ", caches[0] has ", shape.num_layers, " and ", shape.capacity);
      }
      detail::check_joinable(r, caches[r]->storage_[0][0], first.storage_[0][0]);
    }
    StaticKVCache joined(shape, first.storage_.options());
    const int64_t longest = *std::max_element(lengths.begin(), lengths.end());
    for (size_t r = 0; r < caches.size(); ++r) {
      const at::Tensor row = joined.storage_.narrow(2, static_cast<int64_t>(r), 1);
      if (lengths[r] > 0) row.narrow(4, 0, lengths[r]).copy_(caches[r]->storage_.narrow(4, 0, lengths[r]));
      if (lengths[r] < longest) row.narrow(4, lengths[r], longest - lengths[r]).zero_();
    }
    joined.length_ = longest;
    joined.initialized_ = longest;
    joined.rows_.add(longest);
    joined.rows_.set(lengths);
    return joined;
  }

  // JoinableKVCache: a one-row cache of row r's positions in new storage of the same capacity
  // (it shares nothing with this cache, so keeping it keeps nothing else alive).
  [[nodiscard]] StaticKVCache split_row(int64_t r) const {
    detail::check_split_row(r, rows_.rows());
    StaticKVCache row({.num_layers = shape_.num_layers, .batch = 1, .kv_heads = shape_.kv_heads,
                       .capacity = shape_.capacity, .head_dim = shape_.head_dim},
                      storage_.options());
    const int64_t length = rows_.rows()[static_cast<size_t>(r)];
    if (length > 0) row.storage_.narrow(4, 0, length).copy_(storage_.narrow(2, r, 1).narrow(4, 0, length));
    row.length_ = length;
    row.initialized_ = length;
    row.rows_.add(length);
    return row;
  }

  // split_row() without an allocation: row r's positions copied into `into`, a one-row cache of
  // the same layers, heads, head size, dtype and device whose capacity holds them. `into` then
  // holds those positions alone (what it held is dropped; its storage stays where it was). The
  // remote verifier hands each session its cache back this way after a joined forward, so a
  // round allocates no cache per session (remote/session_batch.hpp).
  // Throws std::invalid_argument for a row out of range or an `into` that differs, naming it.
  void split_row_into(int64_t r, StaticKVCache& into) const {
    detail::check_split_row(r, rows_.rows());
    const int64_t length = rows_.rows()[static_cast<size_t>(r)];
    const StaticKVCacheShape& to = into.shape_;
    if (to.batch != 1 || to.num_layers != shape_.num_layers || to.kv_heads != shape_.kv_heads ||
        to.head_dim != shape_.head_dim || to.capacity < length) {
      detail::throw_invalid_message("split_row_into: into must be one row of ", shape_.num_layers, " layers, ",
                                    shape_.kv_heads, " kv heads of size ", shape_.head_dim, " and capacity >= ", length,
                                    ", got ", to.batch, " rows of ", to.num_layers, " layers, ", to.kv_heads,
                                    " kv heads of size ", to.head_dim, " and capacity ", to.capacity);
    }
    if (into.storage_.dtype() != storage_.dtype() || into.storage_.device() != storage_.device()) {
      detail::throw_invalid_message("split_row_into: into holds ", into.storage_.dtype(), " on ", into.storage_.device(),
                                    ", this cache ", storage_.dtype(), " on ", storage_.device());
    }
    if (&into != this && length > 0) {
      into.storage_.narrow(4, 0, length).copy_(storage_.narrow(2, r, 1).narrow(4, 0, length));
    }
    into.length_ = length;
    into.initialized_ = std::max(into.initialized_, length);
    const std::array<int64_t, 1> lengths{length};
    into.rows_.assign(lengths);
  }

  // Writes this layer's keys and values [batch, kv_heads, T, head_dim] in place after the
  // committed positions. Returns views of the layer's keys and values for length() + T positions.
  // Throws std::length_error when length() + T exceeds capacity().
  std::pair<at::Tensor, at::Tensor> update(int64_t layer, const at::Tensor& keys,
                                           const at::Tensor& values) {
    detail::check_layer(layer, shape_.num_layers);
    detail::check_new_entries(keys, values);
    check_new_shape(keys.sizes(), keys.size(2));
    const int64_t end = length_ + keys.size(2);
    const at::Tensor layer_keys = storage_[layer][0];
    const at::Tensor layer_values = storage_[layer][1];
    if (rows_.ragged()) {  // rows of different lengths: each row's new positions follow its own
      // Shorter rows see positions no write has reached yet (masked, but never NaN garbage).
      if (end > initialized_) {
        layer_keys.narrow(2, initialized_, end - initialized_).zero_();
        layer_values.narrow(2, initialized_, end - initialized_).zero_();
      }
      const at::Tensor& lengths = rows_.on(storage_.device());
      detail::write_rows(layer_keys, keys, lengths);
      detail::write_rows(layer_values, values, lengths);
    } else {
      layer_keys.narrow(2, length_, keys.size(2)).copy_(keys);
      layer_values.narrow(2, length_, values.size(2)).copy_(values);
    }
    return {layer_keys.narrow(2, 0, end), layer_values.narrow(2, 0, end)};
  }

  // update() for keys and values given as one tensor [2, batch, kv_heads, T, head_dim] (keys,
  // then values), written with one copy where the rows are aligned: the storage keeps each layer's
  // keys and values side by side, so a model whose projection lays them out together writes a layer
  // in one operation. Returns what update() returns.
  std::pair<at::Tensor, at::Tensor> update_stacked(int64_t layer, const at::Tensor& keys_and_values) {
    if (!keys_and_values.defined() || keys_and_values.dim() != 5 || keys_and_values.size(0) != 2) {
      detail::throw_invalid_message("keys_and_values must have shape [2, batch, kv_heads, new_positions, head_dim], got ",
                                    keys_and_values.defined() ? keys_and_values.sizes() : at::IntArrayRef{});
    }
    if (rows_.ragged()) return update(layer, keys_and_values[0], keys_and_values[1]);
    detail::check_layer(layer, shape_.num_layers);
    const int64_t count = keys_and_values.size(3);
    check_new_shape(keys_and_values.sizes().slice(1), count);
    const int64_t end = length_ + count;
    if (write_on_host(layer, keys_and_values)) {
      // The layer's keys and values as views of the storage (two ATen calls where the general
      // path makes seven: at decoding sizes on a CPU each costs what a small product does).
      const auto view = [&](int64_t half) {
        return storage_.as_strided({shape_.batch, shape_.kv_heads, end, shape_.head_dim},
                                   {storage_.stride(2), storage_.stride(3), storage_.stride(4), storage_.stride(5)},
                                   storage_.storage_offset() + layer * storage_.stride(0) + half * storage_.stride(1));
      };
      return {view(0), view(1)};
    }
    const at::Tensor both = storage_[layer];
    both.narrow(3, length_, count).copy_(keys_and_values);
    return {both[0].narrow(2, 0, end), both[1].narrow(2, 0, end)};
  }

  // Writes this layer's keys and values [2, batch, kv_heads, T, head_dim] (keys, then values) at
  // the positions `positions` (int64 [T] on the cache's device, each in [0, capacity())) of every
  // row, with no host synchronisation and nothing read from the host but shapes: a forward that
  // can be captured in a CUDA graph writes this way. Returns the layer's keys and values over the
  // whole capacity [batch, kv_heads, capacity, head_dim]; the caller masks the positions it must
  // not see and commits the written positions (commit(), prune()) once it knows their values.
  std::pair<at::Tensor, at::Tensor> update_at(int64_t layer, const at::Tensor& keys_and_values,
                                              const at::Tensor& positions) {
    detail::check_layer(layer, shape_.num_layers);
    if (!keys_and_values.defined() || keys_and_values.dim() != 5 || keys_and_values.size(0) != 2) {
      detail::throw_invalid_message("keys_and_values must have shape [2, batch, kv_heads, new_positions, head_dim], got ",
                                    keys_and_values.defined() ? keys_and_values.sizes() : at::IntArrayRef{});
    }
    const at::IntArrayRef sizes = keys_and_values.sizes().slice(1);
    if (sizes[0] != shape_.batch || sizes[1] != shape_.kv_heads || sizes[3] != shape_.head_dim) {
      detail::throw_invalid_message("new keys ", sizes, " do not match the static cache's [", shape_.batch, ", ",
                                    shape_.kv_heads, ", T, ", shape_.head_dim, "]");
    }
    if (!positions.defined() || positions.dim() != 1 || positions.size(0) != sizes[2] ||
        positions.scalar_type() != at::kLong || positions.device() != storage_.device()) {
      detail::throw_invalid_message("positions must be int64 [", sizes[2], "] on ", storage_.device());
    }
    const at::Tensor both = storage_[layer];
    both.index_copy_(3, positions, keys_and_values.to(storage_.scalar_type()));
    return {both[0], both[1]};
  }

  // Zeroes every position no write has reached yet, so that a forward that reads the whole
  // capacity under a mask (update_at) never meets uninitialised memory (a NaN there would survive
  // a zero attention weight). Once per cache; O(capacity).
  void zero_unwritten() {
    if (initialized_ < shape_.capacity) storage_.narrow(4, initialized_, shape_.capacity - initialized_).zero_();
    initialized_ = shape_.capacity;
  }

  // Makes the `new_positions` written by update() or update_at() part of the cache.
  void commit(int64_t new_positions) {
    if (new_positions < 0 || length_ + new_positions > shape_.capacity) {
      detail::throw_invalid_message("commit(", new_positions, ") must keep the length in [0, ",
                                    shape_.capacity, "]");
    }
    length_ += new_positions;
    initialized_ = std::max(initialized_, length_);
    rows_.add(new_positions);
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
    rows_.set(std::vector<int64_t>(rows_.rows().size(), length_));
  }

  // Reorders (or repeats) the batch rows in place: row i becomes the old row rows[i]. Copies only
  // the length() valid positions.
  void reorder(const at::Tensor& rows) {
    detail::check_rows(rows, shape_.batch);
    if (rows.size(0) != shape_.batch) {
      detail::throw_invalid_message("rows must have ", shape_.batch, " entries, got ", rows.size(0));
    }
    if (length_ == 0) return;
    if (rows_.ragged()) rows_.select(detail::host_rows(rows));
    const at::Tensor valid = storage_.narrow(4, 0, length_);
    valid.copy_(valid.index_select(2, detail::rows_on(rows, shape_.batch, storage_.device())));
  }

 private:
  // update_stacked's copy by the host, where both tensors are fp32 on the CPU with a contiguous
  // last dimension, apart in memory, and outside autograd: each head's row of head_dim floats
  // copied where it goes, without an ATen call. Returns false, having written nothing, for any
  // other tensors.
  bool write_on_host(int64_t layer, const at::Tensor& source) {
    const at::Tensor& to = storage_;
    if (!to.device().is_cpu() || !source.device().is_cpu() || to.scalar_type() != at::kFloat ||
        source.scalar_type() != at::kFloat || to.stride(5) != 1 || source.stride(4) != 1 || source.requires_grad() ||
        to.requires_grad() || source.is_alias_of(to)) {
      return false;
    }
    const int64_t count = source.size(3), row_bytes = shape_.head_dim * static_cast<int64_t>(sizeof(float));
    const float* const from = source.data_ptr<float>();
    float* const base = to.data_ptr<float>() + layer * to.stride(0) + length_ * to.stride(4);
    for (int64_t half = 0; half < 2; ++half) {
      for (int64_t b = 0; b < shape_.batch; ++b) {
        for (int64_t h = 0; h < shape_.kv_heads; ++h) {
          for (int64_t t = 0; t < count; ++t) {
            std::memcpy(base + half * to.stride(1) + b * to.stride(2) + h * to.stride(3) + t * to.stride(4),
                        from + half * source.stride(0) + b * source.stride(1) + h * source.stride(2) + t * source.stride(3),
                        static_cast<size_t>(row_bytes));
          }
        }
      }
    }
    return true;
  }

  // Throws unless new keys of `sizes` [batch, kv_heads, T, head_dim] match the storage and T more
  // positions fit (std::length_error).
  void check_new_shape(at::IntArrayRef sizes, int64_t count) const {
    if (sizes[0] != shape_.batch || sizes[1] != shape_.kv_heads || sizes[3] != shape_.head_dim) {
      detail::throw_invalid_message("new keys ", sizes, " do not match the static cache's [", shape_.batch, ", ",
                                    shape_.kv_heads, ", T, ", shape_.head_dim, "]");
    }
    if (length_ + count > shape_.capacity) {
      throw std::length_error("StaticKVCache: " + std::to_string(length_ + count) +
                              " positions exceed the capacity " + std::to_string(shape_.capacity));
    }
  }

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
  at::Tensor storage_;  // the batch's rows: slots_'s first shape_.batch
  at::Tensor slots_;    // every row allocated (select_rows() frees rows into it)
  int64_t length_ = 0;
  int64_t initialized_ = 0;  // positions [0, initialized_) of every row hold finite values
  detail::RowLengths rows_;
};

static_assert(CompactableKVCache<DynamicKVCache> && ReorderableKVCache<DynamicKVCache> && JoinableKVCache<DynamicKVCache> &&
              AppendableKVCache<DynamicKVCache>);
static_assert(CompactableKVCache<StaticKVCache> && ReorderableKVCache<StaticKVCache> && JoinableKVCache<StaticKVCache> &&
              AppendableKVCache<StaticKVCache>);

// Drops the last n positions of any KVCache. Requires 0 <= n <= cache.length().
template <KVCache C>
void prune_cache(C& cache, int64_t n) {
  detail::check_prune(n, static_cast<int64_t>(cache.length()));
  cache.prune(n);
}

}  // namespace specdec
