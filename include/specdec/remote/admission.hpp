// What the verification server admits, and whom it makes room for: the pieces of its front door
// that hold under denial of service (server.hpp uses them; docs/remote.md states the threat model).
//
// - Caller: who a call comes from, as far as the server can tell: the identity it authenticates
//   (a TLS client certificate; the shared token gates access but tells nobody apart), the host
//   and the connection. A client, what quotas count, is its certificate where the server requires
//   one and its connection otherwise; an `authorization` header the server does not check is
//   never part of either.
// - fair_victim: max-min fair admission. When a bounded resource (sessions, calls whose message
//   is still arriving) is full, a newcomer takes the place of the group that holds the most, level
//   by level (host, then connection), and only while that group holds at least two more than the
//   newcomer's: a client that holds nothing always gets in ahead of one that holds many, and
//   holders of equal shares never displace each other.
// - MemoryBudget: requests in flight are charged before they are parsed, from their size and the
//   worst case of what their fields become in memory (wire_cost), against limits.max_memory_bytes.
// - Workers: the handlers' threads. gRPC's callback API serves every stream without a thread of
//   its own; only a call that is authenticated, whose message has arrived and has been charged,
//   runs on one of these, and there are never more than limits.max_concurrent_requests of them.
#pragma once

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

namespace specdec::remote::detail {

// The host of a gRPC peer ("ipv4:10.0.0.7:5123" gives "ipv4:10.0.0.7"): a client's connections
// share it, their ports differ.
inline std::string peer_host(const std::string& peer) {
  const size_t colon = peer.rfind(':');
  return colon == std::string::npos || colon < peer.find(':') + 1 ? peer : peer.substr(0, colon);
}

// Who a call comes from. `identity` binds sessions to their opener (with each session's secret);
// `path` is where the caller stands for fair admission, from the widest group to the client:
// {certificate} where the server authenticates certificates, else {host, connection}.
struct Caller {
  std::string identity;
  std::vector<std::string> path;
  [[nodiscard]] const std::string& client() const { return path.back(); }
};

// The caller of `context`, whose peer address is `peer` (gRPC's "ipv4:10.0.0.7:5123"), on a
// server whose token is `token` (empty: none). The token joins the identity only where the server
// checks it (every caller then presents the same one); a header a server without a token receives
// is ignored, so inventing values makes no new client.
inline Caller caller_of(const grpc::ServerContextBase& context, std::string_view token, const std::string& peer) {
  Caller caller;
  std::string certificate;
  if (const auto auth = context.auth_context(); auth != nullptr && auth->IsPeerAuthenticated()) {
    for (const grpc::string_ref& name : auth->GetPeerIdentity()) certificate.append(name.data(), name.size()).append(",");
  }
  caller.identity = std::string(token.empty() ? "" : "token|") + "certificate:" + certificate;
  if (!certificate.empty()) {
    caller.path = {"certificate:" + certificate};
  } else {
    caller.path = {"host:" + peer_host(peer), "connection:" + peer};
  }
  return caller;
}

// One holder of a bounded resource, for fair_victim: where its holder stands (a Caller's path),
// when it was last used (the longest unused goes first) and whether it may be taken now.
struct Holding {
  const std::vector<std::string>* path = nullptr;
  std::chrono::steady_clock::time_point last_used{};
  bool takeable = true;
};

// Max-min fair admission to a full resource: the index in `held` of the holding to take so that
// `newcomer` may have one, or nullopt when none may be taken. At each level of the paths (all of
// one depth), among the groups of holdings that share the newcomer's path so far: if the largest
// group other than the newcomer's holds at least two more than the newcomer's own group, the
// victim is the least recently used takeable holding of that group's largest client (ties: the
// earliest group in name order); otherwise the comparison goes one level down inside the
// newcomer's own group. A newcomer whose group is as large as any other, at every level, takes
// nothing.
inline std::optional<size_t> fair_victim(std::span<const Holding> held, const std::vector<std::string>& newcomer) {
  std::vector<size_t> scope;
  for (size_t i = 0; i < held.size(); ++i) {
    if (held[i].path->size() == newcomer.size()) scope.push_back(i);
  }
  for (size_t level = 0; level < newcomer.size(); ++level) {
    std::map<std::string_view, int64_t> counts;
    for (const size_t i : scope) ++counts[(*held[i].path)[level]];
    const auto own = counts.find(newcomer[level]);
    const int64_t mine = own == counts.end() ? 0 : own->second;
    std::string_view largest;
    int64_t most = -1;
    for (const auto& [group, count] : counts) {
      if (group != newcomer[level] && count > most) most = count, largest = group;
    }
    if (most >= mine + 2) {
      // The victim: inside the largest group, the client (last level) that holds the most, and its
      // least recently used holding that may be taken.
      std::map<std::string_view, int64_t> clients;
      for (const size_t i : scope) {
        if ((*held[i].path)[level] == largest) ++clients[held[i].path->back()];
      }
      std::optional<size_t> victim;
      int64_t biggest = -1;
      for (const size_t i : scope) {
        if ((*held[i].path)[level] != largest || !held[i].takeable) continue;
        const int64_t size = clients[held[i].path->back()];
        if (!victim || size > biggest || (size == biggest && held[i].last_used < held[*victim].last_used)) {
          victim = i;
          biggest = size;
        }
      }
      return victim;
    }
    std::vector<size_t> inside;
    for (const size_t i : scope) {
      if ((*held[i].path)[level] == newcomer[level]) inside.push_back(i);
    }
    scope.swap(inside);
  }
  return std::nullopt;
}

// The bytes that requests in flight may hold (limits.max_memory_bytes, less gRPC's share).
class MemoryBudget {
 public:
  explicit MemoryBudget(int64_t bytes) : limit_(bytes) {}
  // Takes `bytes` from the budget; false, taking nothing, when they are not there.
  [[nodiscard]] bool take(int64_t bytes) noexcept {
    int64_t used = used_.load();
    do {
      if (bytes > limit_ - used) return false;
    } while (!used_.compare_exchange_weak(used, used + bytes));
    return true;
  }
  void give(int64_t bytes) noexcept { used_ -= bytes; }
  [[nodiscard]] int64_t limit() const noexcept { return limit_; }
  [[nodiscard]] int64_t used() const noexcept { return used_.load(); }

 private:
  const int64_t limit_;
  std::atomic<int64_t> used_{0};
};

// A part of a MemoryBudget a call holds, handed back when it is dropped.
class Charge {
 public:
  Charge() = default;
  Charge(const Charge&) = delete;
  Charge& operator=(const Charge&) = delete;
  ~Charge() { release(); }
  // Takes `bytes` more; false when the budget lacks them (what was held stays held).
  [[nodiscard]] bool add(MemoryBudget& budget, int64_t bytes) noexcept {
    if (budget_ != nullptr && budget_ != &budget) return false;
    if (!budget.take(bytes)) return false;
    budget_ = &budget;
    bytes_ += bytes;
    return true;
  }
  void release() noexcept {
    if (budget_ != nullptr) budget_->give(bytes_);
    budget_ = nullptr;
    bytes_ = 0;
  }
  [[nodiscard]] int64_t bytes() const noexcept { return bytes_; }

 private:
  MemoryBudget* budget_ = nullptr;
  int64_t bytes_ = 0;
};

// Threads for the handlers, started as they are needed up to `limit` and kept until stop().
class Workers {
 public:
  explicit Workers(size_t limit) : limit_(limit) {}
  Workers(const Workers&) = delete;
  Workers& operator=(const Workers&) = delete;
  ~Workers() { stop(); }

  // Runs `task` on a worker. Throws std::system_error when no thread can be started and none is
  // free, std::logic_error after stop().
  void post(std::function<void()> task) {
    const std::lock_guard lock(mutex_);
    if (stopping_) throw std::logic_error("Workers::post after stop()");
    tasks_.push_back(std::move(task));
    if (tasks_.size() > idle_ && threads_.size() < limit_) {
      try {
        threads_.emplace_back([this] { work(); });
      } catch (...) {
        if (threads_.empty()) {
          tasks_.pop_back();
          throw;
        }
      }
    }
    ready_.notify_one();
  }

  // Runs what was posted, then joins every thread. Idempotent.
  void stop() {
    {
      const std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    ready_.notify_all();
    for (std::thread& thread : threads_) {
      if (thread.joinable()) thread.join();
    }
  }

  [[nodiscard]] size_t threads() const {
    const std::lock_guard lock(mutex_);
    return threads_.size();
  }

 private:
  void work() {
    std::unique_lock lock(mutex_);
    while (true) {
      ++idle_;
      ready_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
      --idle_;
      if (tasks_.empty()) return;
      std::function<void()> task = std::move(tasks_.front());
      tasks_.pop_front();
      lock.unlock();
      task();
      lock.lock();
    }
  }

  const size_t limit_;
  mutable std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> tasks_;
  std::vector<std::thread> threads_;
  size_t idle_ = 0;
  bool stopping_ = false;
};

// How a field of a request message is held once parsed, for wire_cost.
struct FieldShape {
  enum Kind { scalar, repeated_int64, repeated_int32, repeated_float, bytes, message } kind = scalar;
  const std::map<int, FieldShape>* fields = nullptr;  // a message field's own fields
};
using MessageShape = std::map<int, FieldShape>;

// What a serialized request costs once parsed, read from its wire bytes without parsing it:
// `parsed` bounds the bytes its fields take in memory, `elements` counts the entries of each
// top-level field (a packed field's values, or an unpacked field's occurrences).
struct WireCost {
  int64_t parsed = 0;
  std::map<int, int64_t> elements;
};

// Bytes an unknown field may take once parsed beyond its payload (protobuf keeps unknown fields).
inline constexpr int64_t kUnknownFieldBytes = 64;

namespace wire_detail {

// Adds what `in`'s fields (to its end or its limit) cost as a message of `shape` to `cost`, with
// the top-level elements counted where `top`. False where the bytes are not a well-formed message.
inline bool tally(google::protobuf::io::CodedInputStream& in, const MessageShape& shape, WireCost& cost, bool top,
                  int depth) {
  if (depth > 8) return false;
  // Varints in the next `length` bytes: the bytes that end one (high bit clear).
  const auto count_varints = [&in](int64_t length, int64_t& ends) {
    while (length > 0) {
      const void* data = nullptr;
      int size = 0;
      if (!in.GetDirectBufferPointer(&data, &size)) return false;
      const auto* bytes = static_cast<const uint8_t*>(data);
      const int64_t take = std::min<int64_t>(size, length);
      for (int64_t i = 0; i < take; ++i) ends += (bytes[i] & 0x80) == 0 ? 1 : 0;
      in.Skip(static_cast<int>(take));
      length -= take;
    }
    return true;
  };
  int64_t ignored = 0;
  while (const uint32_t tag = in.ReadTag()) {
    const int number = static_cast<int>(tag >> 3);
    const uint32_t type = tag & 7;
    const auto known = shape.find(number);
    const bool unknown = known == shape.end();
    const FieldShape field = unknown ? FieldShape{} : known->second;
    int64_t& elements = top ? cost.elements[number] : ignored;
    const int64_t per_value = field.kind == FieldShape::repeated_int64 ? 8
                              : field.kind == FieldShape::repeated_int32 || field.kind == FieldShape::repeated_float ? 4
                                                                                                                     : 0;
    if (type == 0 || type == 1 || type == 5) {  // a varint, 8 or 4 bytes: one value
      uint64_t value = 0;
      if (!(type == 0 ? in.ReadVarint64(&value) : in.Skip(type == 1 ? 8 : 4))) return false;
      ++elements;
      cost.parsed += unknown ? kUnknownFieldBytes : per_value;
    } else if (type == 2) {  // length-delimited
      uint32_t length = 0;
      if (!in.ReadVarint32(&length) || length > static_cast<uint32_t>(std::numeric_limits<int>::max())) return false;
      if (!unknown && field.kind == FieldShape::message) {
        const auto limit = in.PushLimit(static_cast<int>(length));
        WireCost inner;
        if (!tally(in, *field.fields, inner, false, depth + 1) || in.BytesUntilLimit() != 0) return false;
        in.PopLimit(limit);
        ++elements;
        cost.parsed += inner.parsed;
      } else if (!unknown && (field.kind == FieldShape::repeated_int64 || field.kind == FieldShape::repeated_int32)) {
        int64_t values = 0;
        if (!count_varints(length, values)) return false;
        elements += values;
        cost.parsed += values * per_value;
      } else {
        if (!in.Skip(static_cast<int>(length))) return false;
        elements += !unknown && field.kind == FieldShape::repeated_float ? length / 4 : 1;
        cost.parsed += length + (unknown ? kUnknownFieldBytes : 0);
      }
    } else {
      return false;  // groups (3, 4) or no wire type at all
    }
  }
  return in.ConsumedEntireMessage();
}

}  // namespace wire_detail

// The cost of a serialized message of `shape` (read from `in` to its end); nullopt when it is not
// a well-formed message (truncated, a length past its end, groups, nesting deeper than 8). Every
// repeated value costs its parsed size (a packed varint of one byte becomes 8 bytes of int64),
// every string and unknown field its length (and kUnknownFieldBytes), nested messages their own
// cost.
inline std::optional<WireCost> wire_cost(google::protobuf::io::ZeroCopyInputStream& stream, const MessageShape& shape) {
  google::protobuf::io::CodedInputStream in(&stream);
  WireCost cost;
  if (!wire_detail::tally(in, shape, cost, true, 0)) return std::nullopt;
  return cost;
}
inline std::optional<WireCost> wire_cost(std::string_view wire, const MessageShape& shape) {
  google::protobuf::io::ArrayInputStream stream(wire.data(), static_cast<int>(wire.size()));
  return wire_cost(stream, shape);
}

// The shapes of the verifier's requests (proto/specdec/remote/v1/verifier.proto).
inline const MessageShape& sampling_shape() {
  static const MessageShape shape{{1, {}}, {2, {}}, {3, {}}, {4, {}}};
  return shape;
}
inline const MessageShape& open_shape() {
  static const MessageShape shape{{1, {FieldShape::message, &sampling_shape()}}, {2, {}}, {3, {}}, {4, {}},
                                  {5, {FieldShape::repeated_int64}}};
  return shape;
}
inline const MessageShape& draft_probs_shape() {
  static const MessageShape shape{{1, {}},
                                  {2, {FieldShape::repeated_int32}},
                                  {3, {FieldShape::repeated_int32}},
                                  {4, {FieldShape::repeated_float}},
                                  {5, {FieldShape::bytes}}};
  return shape;
}
inline const MessageShape& verify_shape() {
  static const MessageShape shape{{1, {FieldShape::bytes}}, {2, {}}, {3, {}},
                                  {4, {FieldShape::repeated_int64}}, {5, {FieldShape::repeated_int64}},
                                  {6, {FieldShape::message, &draft_probs_shape()}}, {7, {FieldShape::bytes}}};
  return shape;
}
inline const MessageShape& close_shape() {
  static const MessageShape shape{{1, {FieldShape::bytes}}, {2, {FieldShape::bytes}}};
  return shape;
}

}  // namespace specdec::remote::detail
