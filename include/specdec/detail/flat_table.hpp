// A flat open-addressing hash table for the n-gram storages: linear probing over one array of
// (key, value) slots without padding (the key is kept as bytes, so a 64-bit key and 12 bytes of
// counts take 20 bytes, not 24), any capacity (a hash picks its home slot by multiply-shift, not by a mask), grown
// by half when more than 4/5 full, so between 53% and 80% of the slots are used. An all-zero key marks an empty slot
// (the packed n-gram keys carry their length, at least 1, in their top bits, so none is zero), and
// keys and values are trivially copyable, so the array is one calloc'd block: memory_bytes() is
// exactly capacity() * sizeof(Slot). Compared with node-based or neighbourhood-bitmap tables it
// stores nothing but the slots, and prefetch() lets a caller start the memory access of a look-up
// it will make a few tokens later.
//
// The keys: uint64_t, or Key128 (two words) for n-grams that do not fit 60 bits.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <stdexcept>
#include <type_traits>
#include <utility>

namespace specdec::detail {

// A 128-bit key as two words (no compiler extension, so every C++20 compiler builds it).
struct Key128 {
  uint64_t low = 0;
  uint64_t high = 0;
  friend bool operator==(const Key128&, const Key128&) = default;
};

inline uint64_t mix64(uint64_t x) noexcept {  // splitmix64's finaliser
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}
inline uint64_t hash_key(uint64_t key) noexcept { return mix64(key); }
inline uint64_t hash_key(const Key128& key) noexcept { return mix64(key.low ^ mix64(key.high)); }
inline bool is_empty_key(uint64_t key) noexcept { return key == 0; }
inline bool is_empty_key(const Key128& key) noexcept { return (key.low | key.high) == 0; }

template <class Key, class Value>
class FlatTable {
  static_assert(std::is_trivially_copyable_v<Key> && std::is_trivially_copyable_v<Value>);

 public:
  // The key as bytes (read and written with memcpy, so nothing refers to it misaligned) and the
  // value: sizeof(Key) + sizeof(Value) bytes, aligned as Value.
  struct Slot {
    unsigned char key[sizeof(Key)];
    Value value;
  };
  // At most 2^32 - 1 slots (the home slot is a 32 x 32-bit multiply-shift).
  static constexpr size_t kMaxCapacity = (size_t{1} << 32) - 1;

  FlatTable() = default;
  FlatTable(const FlatTable& other) { *this = other; }
  FlatTable(FlatTable&& other) noexcept { swap(other); }
  FlatTable& operator=(const FlatTable& other) {
    if (this != &other) {
      FlatTable copy;
      if (other.capacity_ > 0) {
        copy.allocate(other.capacity_);
        std::memcpy(static_cast<void*>(copy.slots_.get()), other.slots_.get(), other.capacity_ * sizeof(Slot));
        copy.size_ = other.size_;
      }
      swap(copy);
    }
    return *this;
  }
  FlatTable& operator=(FlatTable&& other) noexcept {
    FlatTable moved(std::move(other.slots_), other.capacity_, other.size_);
    other.capacity_ = other.size_ = 0;
    swap(moved);
    return *this;
  }
  void swap(FlatTable& other) noexcept {
    std::swap(slots_, other.slots_);
    std::swap(capacity_, other.capacity_);
    std::swap(size_, other.size_);
  }

  [[nodiscard]] size_t size() const noexcept { return size_; }
  [[nodiscard]] size_t capacity() const noexcept { return capacity_; }
  // Exactly the bytes the slot array holds.
  [[nodiscard]] size_t memory_bytes() const noexcept { return capacity_ * sizeof(Slot); }

  // The value of `key`, nullptr when absent. Valid until the next insertion, reserve or clear.
  [[nodiscard]] Value* find(const Key& key) noexcept { return const_cast<Value*>(std::as_const(*this).find(key)); }
  [[nodiscard]] const Value* find(const Key& key) const noexcept {
    if (capacity_ == 0) return nullptr;
    for (size_t i = home(key);; i = next(i)) {
      const Slot& slot = slots_[i];
      const Key stored = key_of(slot);
      if (stored == key) return &slot.value;
      if (is_empty_key(stored)) return nullptr;
    }
  }

  // The value of `key` and whether it was inserted (value-initialised: all zero) by this call.
  // Requires a non-empty key. Valid until the next insertion, reserve or clear.
  std::pair<Value*, bool> insert(const Key& key) {
    if ((size_ + 1) * 5 > capacity_ * 4) grow(std::max(capacity_ + capacity_ / 2, (size_ + 1) * 5 / 4 + 1));
    for (size_t i = home(key);; i = next(i)) {
      Slot& slot = slots_[i];
      const Key stored = key_of(slot);
      if (stored == key) return {&slot.value, false};
      if (is_empty_key(stored)) {
        std::memcpy(slot.key, &key, sizeof(Key));
        ++size_;
        return {&slot.value, true};
      }
    }
  }

  // Starts loading the slot where a look-up of `key` begins.
  void prefetch(const Key& key) const noexcept {
    if (capacity_ > 0) __builtin_prefetch(&slots_[home(key)]);
  }

  // Room for `entries` without growing.
  void reserve(size_t entries) {
    if (entries * 5 > capacity_ * 4) grow(entries * 5 / 4 + 1);
  }

  void clear() noexcept {
    slots_.reset();
    capacity_ = size_ = 0;
  }
  // Removes every entry and keeps the slots (for a table refilled to about its old size).
  void clear_keeping_capacity() noexcept {
    if (capacity_ > 0) std::memset(static_cast<void*>(slots_.get()), 0, capacity_ * sizeof(Slot));
    size_ = 0;
  }

  // Calls f(key, value) for every entry, in slot order.
  template <class F>
  void for_each(F&& f) const {
    for (size_t i = 0; i < capacity_; ++i) {
      const Key key = key_of(slots_[i]);
      if (!is_empty_key(key)) f(key, slots_[i].value);
    }
  }

 private:
  struct Free {
    void operator()(Slot* p) const noexcept { std::free(p); }
  };
  FlatTable(std::unique_ptr<Slot[], Free> slots, size_t capacity, size_t size)
      : slots_(std::move(slots)), capacity_(capacity), size_(size) {}

  static Key key_of(const Slot& slot) noexcept {
    Key key;
    std::memcpy(&key, slot.key, sizeof(Key));
    return key;
  }
  [[nodiscard]] size_t home(const Key& key) const noexcept {
    return static_cast<size_t>(((hash_key(key) >> 32) * static_cast<uint64_t>(capacity_)) >> 32);
  }
  [[nodiscard]] size_t next(size_t i) const noexcept { return i + 1 == capacity_ ? 0 : i + 1; }

  void allocate(size_t capacity) {
    if (capacity > kMaxCapacity) throw std::length_error("an n-gram table needs more than 2^32 - 1 slots");
    void* p = std::calloc(capacity, sizeof(Slot));  // zero pages: empty slots, mapped lazily
    if (p == nullptr) throw std::bad_alloc();
    slots_.reset(static_cast<Slot*>(p));
    capacity_ = capacity;
    size_ = 0;
  }

  // Rehashes into `capacity` slots (at least 16).
  void grow(size_t capacity) {
    FlatTable bigger;
    bigger.allocate(std::max<size_t>(capacity, 16));
    constexpr size_t kAhead = 16;  // slots whose new home is prefetched before they are moved
    for (size_t i = 0; i < capacity_; ++i) {
      if (i + kAhead < capacity_) {
        const Key ahead = key_of(slots_[i + kAhead]);
        if (!is_empty_key(ahead)) bigger.prefetch(ahead);
      }
      const Slot& slot = slots_[i];
      const Key key = key_of(slot);
      if (is_empty_key(key)) continue;
      size_t j = bigger.home(key);
      while (!is_empty_key(key_of(bigger.slots_[j]))) j = bigger.next(j);
      bigger.slots_[j] = slot;
    }
    bigger.size_ = size_;
    swap(bigger);
  }

  std::unique_ptr<Slot[], Free> slots_;
  size_t capacity_ = 0;
  size_t size_ = 0;
};

}  // namespace specdec::detail
