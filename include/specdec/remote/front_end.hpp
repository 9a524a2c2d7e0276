// The verifier's front end on plaintext addresses: it accepts every TCP connection itself and
// hands gRPC one end of a socket pair for it (grpc::AddInsecureChannelFromFd), relaying bytes
// both ways on one thread. On the way in it reads HTTP/2's frame headers (9 bytes each, after the
// 24-byte connection preface) and nothing else, and closes a connection that resets more streams
// than its budget allows: the rapid-reset flood (CVE-2023-44487), which gRPC 1.51 accepts without
// limit and whose calls then pile up in its callback executor faster than they can be answered.
// A connection's resets are charged twice: to its own budget and to one its host shares with its
// other connections, so that reconnecting does not renew what a host may reset; while a host's
// budget is spent, its new connections are closed as they are accepted, before gRPC sees them.
// A client of ours resets a stream only when it cancels a call. The relay also tells the server
// who a connection's peer is (gRPC names a descriptor's connection "fd:N").
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <grpcpp/server.h>
#include <grpcpp/server_posix.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

namespace specdec::remote::detail {

// How many streams a connection may reset: a bucket of `burst` resets that refills at `per_second`;
// a reset that finds it empty closes the connection. A host's connections also share a bucket of
// `host_burst` refilled at `host_per_second`, which a reset must find non-empty as well.
struct ResetBudget {
  int64_t burst = 64;
  int64_t per_second = 16;
  int64_t host_burst = 256;
  int64_t host_per_second = 64;
};

// `burst` tokens, refilled continuously at `per_second` up to `burst`.
class TokenBucket {
 public:
  TokenBucket(int64_t burst, int64_t per_second, std::chrono::steady_clock::time_point now)
      : burst_(static_cast<double>(burst)), per_second_(static_cast<double>(per_second)), tokens_(burst_), last_(now) {}

  // Refills up to `now`; true when a whole token is there.
  bool ready(std::chrono::steady_clock::time_point now) {
    if (now > last_) {
      tokens_ = std::min(burst_, tokens_ + std::chrono::duration<double>(now - last_).count() * per_second_);
      last_ = now;
    }
    return tokens_ >= 1;
  }
  void take() { tokens_ -= 1; }  // after ready() said yes
  [[nodiscard]] bool full(std::chrono::steady_clock::time_point now) { return ready(now) && tokens_ >= burst_; }

 private:
  double burst_, per_second_, tokens_;
  std::chrono::steady_clock::time_point last_;
};

// Counts the resets of one connection's inbound HTTP/2 frames, fed the bytes as they pass, against
// its own bucket and its host's (which the host's other connections share).
class FrameWatch {
 public:
  FrameWatch(ResetBudget budget, std::shared_ptr<TokenBucket> host, std::chrono::steady_clock::time_point now)
      : own_(budget.burst, budget.per_second, now), host_(std::move(host)) {}

  // Reads `bytes` (the next bytes from the client); false once the connection has reset more
  // streams than its budget or its host's allows (then it is to be closed).
  bool feed(const char* bytes, size_t size, std::chrono::steady_clock::time_point now) {
    size_t at = 0;
    while (at < size) {
      if (preface_left_ > 0) {  // "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n": not a frame
        const size_t take = std::min(preface_left_, size - at);
        preface_left_ -= take;
        at += take;
      } else if (payload_left_ > 0) {
        const size_t take = std::min<size_t>(payload_left_, size - at);
        payload_left_ -= take;
        at += take;
      } else {
        header_[header_filled_++] = static_cast<uint8_t>(bytes[at++]);
        if (header_filled_ < 9) continue;
        header_filled_ = 0;
        payload_left_ = uint64_t{header_[0]} << 16 | uint64_t{header_[1]} << 8 | header_[2];
        if (header_[3] == kRstStream) {
          if (!own_.ready(now) || !host_->ready(now)) return false;
          own_.take();
          host_->take();
        }
      }
    }
    return true;
  }

 private:
  static constexpr uint8_t kRstStream = 3;

  TokenBucket own_;
  std::shared_ptr<TokenBucket> host_;
  size_t preface_left_ = 24;
  uint64_t payload_left_ = 0;
  uint8_t header_[9]{};
  size_t header_filled_ = 0;
};

// The host a reset budget is shared by: an IPv4 address (also when IPv4-mapped), or the /64
// prefix of an IPv6 address (what one site is routed).
inline std::string host_of(const sockaddr_storage& address) {
  if (address.ss_family == AF_INET) {
    const auto& v4 = reinterpret_cast<const sockaddr_in&>(address);
    return std::string(reinterpret_cast<const char*>(&v4.sin_addr), 4);
  }
  if (address.ss_family != AF_INET6) return {};
  const auto& v6 = reinterpret_cast<const sockaddr_in6&>(address);
  if (IN6_IS_ADDR_V4MAPPED(&v6.sin6_addr)) return std::string(reinterpret_cast<const char*>(&v6.sin6_addr.s6_addr[12]), 4);
  return std::string(reinterpret_cast<const char*>(v6.sin6_addr.s6_addr), 8);
}

// gRPC's name for a peer address: "ipv4:10.0.0.7:5123", "ipv6:[::1]:5123".
inline std::string peer_name(const sockaddr_storage& address) {
  char host[INET6_ADDRSTRLEN] = {};
  if (address.ss_family == AF_INET) {
    const auto& v4 = reinterpret_cast<const sockaddr_in&>(address);
    ::inet_ntop(AF_INET, &v4.sin_addr, host, sizeof host);
    return std::string("ipv4:") + host + ":" + std::to_string(ntohs(v4.sin_port));
  }
  const auto& v6 = reinterpret_cast<const sockaddr_in6&>(address);
  if (IN6_IS_ADDR_V4MAPPED(&v6.sin6_addr)) {
    ::inet_ntop(AF_INET, &v6.sin6_addr.s6_addr[12], host, sizeof host);
    return std::string("ipv4:") + host + ":" + std::to_string(ntohs(v6.sin6_port));
  }
  ::inet_ntop(AF_INET6, &v6.sin6_addr, host, sizeof host);
  return std::string("ipv6:[") + host + "]:" + std::to_string(ntohs(v6.sin6_port));
}

// The listening socket, the relay thread and its connections (see the top of this file).
class FrontEnd {
 public:
  struct Stats {
    int64_t connections = 0;         // accepted
    int64_t closed_for_resets = 0;   // closed past their reset budget or their host's
    int64_t refused_for_resets = 0;  // closed as accepted, their host's reset budget spent
  };

  // Listens on `address` (host:port; port 0 picks one). Throws std::runtime_error naming the
  // address when it cannot be bound.
  FrontEnd(const std::string& address, ResetBudget budget) : budget_(budget) {
    const size_t colon = address.rfind(':');
    if (colon == std::string::npos) throw std::invalid_argument("address " + address + " has no port");
    std::string host = address.substr(0, colon);
    if (host.size() >= 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    addrinfo* found = nullptr;
    const std::string port = address.substr(colon + 1);
    if (::getaddrinfo(host.empty() || host == "*" ? nullptr : host.c_str(), port.c_str(), &hints, &found) != 0 || !found) {
      throw std::runtime_error("cannot listen on " + address + ": the host does not resolve");
    }
    const std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> addresses(found, &::freeaddrinfo);
    listener_ = ::socket(found->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    const int one = 1;
    if (listener_ >= 0) ::setsockopt(listener_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (listener_ < 0 || ::bind(listener_, found->ai_addr, found->ai_addrlen) != 0 || ::listen(listener_, 1024) != 0) {
      const std::string reason = std::generic_category().message(errno);
      close_quietly(listener_);
      throw std::runtime_error("cannot listen on " + address + ": " + reason);
    }
    sockaddr_storage bound{};
    socklen_t size = sizeof bound;
    ::getsockname(listener_, reinterpret_cast<sockaddr*>(&bound), &size);
    port_ = ntohs(bound.ss_family == AF_INET ? reinterpret_cast<sockaddr_in&>(bound).sin_port
                                             : reinterpret_cast<sockaddr_in6&>(bound).sin6_port);
    epoll_ = ::epoll_create1(EPOLL_CLOEXEC);
    wake_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (epoll_ < 0 || wake_ < 0) {
      close_quietly(listener_), close_quietly(epoll_), close_quietly(wake_);
      throw std::runtime_error("cannot listen on " + address + ": no epoll or eventfd");
    }
    watch(listener_, EPOLLIN);
    watch(wake_, EPOLLIN);
  }
  FrontEnd(const FrontEnd&) = delete;
  FrontEnd& operator=(const FrontEnd&) = delete;
  ~FrontEnd() { stop(); }

  [[nodiscard]] int port() const noexcept { return port_; }

  // Starts relaying to `server` (started, without listening ports of its own).
  void start(grpc::Server& server) {
    server_ = &server;
    thread_ = std::thread([this] { relay(); });
  }

  // Closes the listener and every connection, and joins the thread. Idempotent.
  void stop() {
    if (stopping_.exchange(true)) return;
    const uint64_t one = 1;
    if (wake_ >= 0) (void)!::write(wake_, &one, sizeof one);
    if (thread_.joinable()) thread_.join();
    for (auto& [fd, connection] : connections_) close_quietly(connection->client), close_quietly(connection->relay);
    connections_.clear();
    close_quietly(listener_), close_quietly(epoll_), close_quietly(wake_);
  }

  // The peer of a connection as gRPC names it ("fd:N"), as its client's address; `peer` itself
  // where it is not one of this front end's.
  [[nodiscard]] std::string peer_of(const std::string& peer) const {
    const std::lock_guard lock(peers_mutex_);
    const auto it = peers_.find(peer);
    return it == peers_.end() ? peer : it->second;
  }

  [[nodiscard]] Stats stats() const {
    return {.connections = connections_accepted_.load(),
            .closed_for_resets = closed_for_resets_.load(),
            .refused_for_resets = refused_for_resets_.load()};
  }

 private:
  // One connection: the client's socket, this end of the pair whose other end gRPC reads, what
  // is waiting to be written each way, and the watch over the client's frames.
  struct Connection {
    int client = -1, relay = -1;
    std::string to_relay, to_client;  // bytes read but not yet written on
    FrameWatch frames;
    std::string peer_key;  // "fd:N" of gRPC's end
    Connection(ResetBudget budget, std::shared_ptr<TokenBucket> host, std::chrono::steady_clock::time_point now)
        : frames(budget, std::move(host), now) {}
  };

  static constexpr size_t kChunk = 64 << 10;  // bytes read at once
  // Bytes held for a side that does not read: reading from the other side pauses above this (the
  // sender's TCP window then pushes back), so a connection costs the relay at most 2 x kHeld.
  static constexpr size_t kHeld = 64 << 10;

  static void close_quietly(int& fd) {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }

  void watch(int fd, uint32_t events, bool change = false) {
    epoll_event event{};
    event.events = events;
    event.data.fd = fd;
    (void)::epoll_ctl(epoll_, change ? EPOLL_CTL_MOD : EPOLL_CTL_ADD, fd, &event);
  }

  void relay() {
    std::vector<epoll_event> events(256);
    std::string chunk(kChunk, '\0');
    while (!stopping_) {
      const int ready = ::epoll_wait(epoll_, events.data(), static_cast<int>(events.size()), listen_paused_until_ ? 50 : 1000);
      if (ready < 0 && errno != EINTR) break;
      if (listen_paused_until_ && std::chrono::steady_clock::now() >= *listen_paused_until_) {
        watch(listener_, EPOLLIN);
        listen_paused_until_.reset();
      }
      for (int i = 0; i < ready; ++i) {
        const int fd = events[static_cast<size_t>(i)].data.fd;
        if (fd == wake_) continue;
        if (fd == listener_) {
          accept_all();
          continue;
        }
        const auto it = connections_.find(fd);
        if (it == connections_.end()) continue;
        const std::shared_ptr<Connection> connection = it->second;  // pump() may close it
        pump(*connection, chunk);
      }
    }
  }

  void accept_all() {
    while (true) {
      sockaddr_storage address{};
      socklen_t size = sizeof address;
      int client = ::accept4(listener_, reinterpret_cast<sockaddr*>(&address), &size, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (client < 0) {
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          // Out of descriptors or memory: the waiting connection stays queued and the listener
          // stays readable, so stop watching it for a while rather than spin on it.
          (void)::epoll_ctl(epoll_, EPOLL_CTL_DEL, listener_, nullptr);
          listen_paused_until_ = std::chrono::steady_clock::now() + kListenPause;
        }
        return;
      }
      ++connections_accepted_;
      const auto now = std::chrono::steady_clock::now();
      std::shared_ptr<TokenBucket> host = host_budget(address, now);
      if (!host->ready(now)) {  // its host is flooding: gRPC never sees this connection
        ++refused_for_resets_;
        close_quietly(client);
        continue;
      }
      int pair[2] = {-1, -1};
      if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) {
        close_quietly(client);
        continue;
      }
      const int one = 1;
      ::setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      ::fcntl(pair[0], F_SETFL, ::fcntl(pair[0], F_GETFL) | O_NONBLOCK);
      ::fcntl(pair[1], F_SETFL, ::fcntl(pair[1], F_GETFL) | O_NONBLOCK);  // gRPC reads it without blocking
      auto connection = std::make_shared<Connection>(budget_, std::move(host), now);
      connection->client = client;
      connection->relay = pair[0];
      connection->peer_key = "fd:" + std::to_string(pair[1]);
      {
        const std::lock_guard lock(peers_mutex_);
        peers_[connection->peer_key] = peer_name(address);
      }
      connections_[client] = connection;
      connections_[pair[0]] = connection;
      watch(client, EPOLLIN | EPOLLRDHUP);
      watch(pair[0], EPOLLIN | EPOLLRDHUP);
      grpc::AddInsecureChannelFromFd(server_, pair[1]);  // gRPC owns pair[1] from here
    }
  }

  // The reset budget `address`'s host shares. A host's entry is dropped once it has no connection
  // and its bucket is full again (as a new one would be), when the table has doubled since the
  // last such sweep: it holds only hosts that connected or reset recently.
  std::shared_ptr<TokenBucket> host_budget(const sockaddr_storage& address, std::chrono::steady_clock::time_point now) {
    if (hosts_.size() >= sweep_at_) {
      std::erase_if(hosts_, [now](auto& entry) { return entry.second.use_count() == 1 && entry.second->full(now); });
      sweep_at_ = std::max<size_t>(kFirstSweep, 2 * hosts_.size());
    }
    std::shared_ptr<TokenBucket>& bucket = hosts_[host_of(address)];
    if (!bucket) bucket = std::make_shared<TokenBucket>(budget_.host_burst, budget_.host_per_second, now);
    return bucket;
  }

  // Moves what can be moved between the two sides of `c`; closes it on an end, an error or a
  // reset budget spent.
  void pump(Connection& c, std::string& chunk) {
    const auto now = std::chrono::steady_clock::now();
    bool open = flush(c.relay, c.to_relay) && flush(c.client, c.to_client);
    // Client to gRPC, watching the frames; gRPC to client. A side whose destination holds kHeld
    // bytes is not read (its socket buffers then push back on the sender).
    while (open && c.to_relay.size() < kHeld) {
      const ssize_t got = ::recv(c.client, chunk.data(), chunk.size(), 0);
      if (got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR)) open = false;
      if (got <= 0) break;
      if (!c.frames.feed(chunk.data(), static_cast<size_t>(got), now)) {
        ++closed_for_resets_;
        open = false;
        break;
      }
      c.to_relay.append(chunk.data(), static_cast<size_t>(got));
      open = flush(c.relay, c.to_relay);
    }
    bool server_ended = false;
    while (open && c.to_client.size() < kHeld) {
      const ssize_t got = ::recv(c.relay, chunk.data(), chunk.size(), 0);
      if (got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR)) open = false, server_ended = true;
      if (got <= 0) break;
      c.to_client.append(chunk.data(), static_cast<size_t>(got));
      open = flush(c.client, c.to_client);
    }
    if (!open) {
      if (server_ended) {
        // gRPC closed the connection (idle, GOAWAY, its memory quota): what it said last goes to
        // the client, whose unread bytes are drained so that the close is an end, not a reset.
        (void)flush(c.client, c.to_client);
        while (::recv(c.client, chunk.data(), chunk.size(), 0) > 0) {
        }
        ::shutdown(c.client, SHUT_WR);
      }
      close(c);
      return;
    }
    // Wait to write where bytes are held; wait to read only where there is room.
    constexpr uint32_t kRead = EPOLLIN | EPOLLRDHUP, kWrite = EPOLLOUT, kNone = 0;
    watch(c.client, (c.to_relay.size() < kHeld ? kRead : kNone) | (c.to_client.empty() ? kNone : kWrite), true);
    watch(c.relay, (c.to_client.size() < kHeld ? kRead : kNone) | (c.to_relay.empty() ? kNone : kWrite), true);
  }

  // Writes what `pending` holds to `fd` as far as it takes it; false on an error.
  static bool flush(int fd, std::string& pending) {
    size_t written = 0;
    while (written < pending.size()) {
      const ssize_t sent = ::send(fd, pending.data() + written, pending.size() - written, MSG_NOSIGNAL);
      if (sent < 0) {
        if (errno == EAGAIN || errno == EINTR) break;
        return false;
      }
      written += static_cast<size_t>(sent);
    }
    pending.erase(0, written);
    return true;
  }

  void close(Connection& c) {
    {
      const std::lock_guard lock(peers_mutex_);
      peers_.erase(c.peer_key);
    }
    const int client = c.client, relay = c.relay;
    ::epoll_ctl(epoll_, EPOLL_CTL_DEL, client, nullptr);
    ::epoll_ctl(epoll_, EPOLL_CTL_DEL, relay, nullptr);
    close_quietly(c.client);
    close_quietly(c.relay);  // gRPC sees its end close and drops the transport
    connections_.erase(client);
    connections_.erase(relay);
  }

  ResetBudget budget_;
  int listener_ = -1, epoll_ = -1, wake_ = -1, port_ = 0;
  grpc::Server* server_ = nullptr;
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  std::map<int, std::shared_ptr<Connection>> connections_;  // by either descriptor; the relay thread's
  static constexpr size_t kFirstSweep = 1024;
  static constexpr std::chrono::milliseconds kListenPause{100};  // after accept runs out of descriptors
  // When the unwatched listener is watched again; empty while it is watched. The relay thread's.
  std::optional<std::chrono::steady_clock::time_point> listen_paused_until_;
  std::map<std::string, std::shared_ptr<TokenBucket>> hosts_;  // by host_of; the relay thread's
  size_t sweep_at_ = kFirstSweep;
  mutable std::mutex peers_mutex_;
  std::map<std::string, std::string> peers_;  // "fd:N" to the client's address
  std::atomic<int64_t> connections_accepted_{0}, closed_for_resets_{0}, refused_for_resets_{0};
};

}  // namespace specdec::remote::detail
