// The verification server: a target model behind gRPC (specdec-verifier is this class and a
// command line). Each client opens a session whose tokens and KV cache stay on the server
// (specdec::Session), then sends drafts; each Verify runs one step of the library's step core with
// the client's drafts as the draft source, so verification is exactly the local one (rejection
// sampling, the greedy fast path, threshold verification). The step's sampling generator is
// seeded from the client's seed and the step's index: a run is reproducible.
//
// Safety: the server listens on loopback unless told otherwise, and any other address needs a
// shared-secret token, which every request must then carry ("authorization: Bearer TOKEN"), or
// TLS with client certificates (ServerOptions::tls with trusted_ca: a client without a
// certificate signed by those CAs cannot connect). Without TLS the token travels in clear.
// Sessions belong to their clients: a session's handle is 128 bits from the kernel's random source
// (getrandom), Open also returns a 128-bit secret, and every later Verify and Close must present
// that secret from the identity that opened the session (its bearer token and TLS client
// certificate); a session the caller may not use gets the same NOT_FOUND as one that does not
// exist, and no error text shows a session's tokens.
// The front door (admission.hpp; docs/remote.md states the threat model): on a plaintext address
// the server accepts connections itself and relays them to gRPC (front_end.hpp), closing a
// connection that resets more streams than limits.max_resets_per_connection allows, or than its
// host's limits.max_resets_per_host (a rapid-reset flood, which gRPC 1.51 does not bound). Every
// call is served through gRPC's callback API (one generic service; on the wire the same unary
// calls clients make), so a stream costs no thread: gRPC hands a call over on its headers, the
// token is checked before a byte of the message is read, and an unauthenticated or reset stream costs a few
// allocations and no more than HTTP/2's flow-control window (bandwidth-delay probing is off, so a
// message nobody reads cannot grow the window; a read asks for the window it needs). An
// authenticated call then reads its one message, which must arrive within limits.read_timeout;
// calls still reading are at most limits.max_reading_calls (a client's fair share when full) and
// limits.max_streams_per_connection on a connection, and hold no request place. Once the message
// is there, its size and what its fields become in memory are charged to limits.max_memory_bytes
// before it is parsed, and only then does the call take one of limits.max_concurrent_requests
// places and a handler thread. Sessions (in all, with max-min fair admission between clients,
// and per client), tokens per session, drafts per request, request bytes and gRPC's own memory (its
// resource quota) are bounded (ServerLimits); a session idle for limits.idle_timeout and a
// connection idle for limits.connection_idle_timeout are closed, and the memory freed sessions
// held is handed back to the system. Every bad request is answered with INVALID_ARGUMENT,
// FAILED_PRECONDITION, NOT_FOUND, RESOURCE_EXHAUSTED or UNAUTHENTICATED and a message naming the
// limit, while the server goes on serving the others.
//
// Concurrency: the handler threads serve requests concurrently and sessions are independent. The
// target runs one forward at a time, all on one thread of the server's (so one thread's scratch
// buffers serve every forward: ForwardQueue, forward_queue.hpp, the queue apart from gRPC), and
// the verifications waiting for it are batched: when the model comes free, the next forward takes
// every waiting request (up to limits.max_batch) and hands it to a SessionBatcher
// (session_batch.hpp: the batching apart from gRPC, on batch generation's ragged forward), which
// joins their sessions' caches into one batched cache (JoinableKVCache), scores all their drafts
// in one forward with each row at its own positions, verifies each row with its own session's
// processor, mode and seed (one host copy for the whole batch), and splits each row's accepted
// prefix back into its session. A request that finds the model idle runs alone at once: batching
// adds no waiting (unless limits.batch_delay asks a forward to wait for more), it only collects
// what queued up during the previous forward. A batched forward pays two copies of its sessions'
// cached positions (join and split). A row's result is the one it would get alone, up to the
// rounding of a batched product. Targets whose cache is not a JoinableKVCache verify one request
// per forward.
//
// Tensor parallelism (ServerOptions::group): the target is rank 0's shard of a model split over a
// process group (parallel.hpp), and ranks 1..N-1 run follow_verifier() with their shards. Rank 0
// alone serves gRPC; before each round of its model thread (a prompt's prefill, a batch of
// verifications) it broadcasts the round's work (the requests, the sessions they belong to, the
// step indices, the sessions freed since the last round), and every rank then runs the same code
// on the same inputs: the same batches, joins, rollbacks and forwards, with every decision rank
// 0's (SharedDecisions). While idle, rank 0 broadcasts a heartbeat every ServerOptions::heartbeat,
// so the others wait for work without reaching the group's timeout, and a rank that is gone is
// noticed without traffic. A rank that fails or disappears fails the group for good: the calls in
// flight and every later call get UNAVAILABLE naming it, failure() says what happened, and the
// other ranks' collectives fail within the group's timeout.
#pragma once

#include <sys/random.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/resource_quota.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include <algorithm>
#include <cerrno>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <system_error>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/detail/torch_compat.hpp"
#include "specdec/draft_source.hpp"
#include "specdec/kv_cache.hpp"
#include "specdec/parallel.hpp"
#include "specdec/remote/admission.hpp"
#include "specdec/remote/forward_queue.hpp"
#include "specdec/remote/front_end.hpp"
#include "specdec/remote/protocol.hpp"
#include "specdec/remote/session_batch.hpp"
#include "specdec/remote/token.hpp"
#include "specdec/session.hpp"

namespace specdec::remote {

struct ServerLimits {
  // Open sessions at once. When full, an Open from a client holding at least two fewer sessions
  // than another client closes that client's least recently used idle session (max-min fair
  // admission, by host and then by client: admission.hpp); otherwise it is refused.
  int64_t max_sessions = 64;
  // Sessions one client may hold: a client is its TLS client certificate where the server requires
  // one (tls.trusted_ca), else its connection (the token is shared and tells nobody apart).
  int64_t max_sessions_per_client = 16;
  // Calls served at once, counted from when their message has arrived and been charged to
  // max_memory_bytes; more get RESOURCE_EXHAUSTED. Also the most handler threads.
  int64_t max_concurrent_requests = 64;
  // Authenticated calls whose message has not arrived yet. When full, a call from a client that has
  // at least two fewer of them than another cancels that client's oldest (max-min fair).
  int64_t max_reading_calls = 256;
  int64_t max_streams_per_connection = 16;  // HTTP/2 streams one connection may have open
  // Streams a plaintext connection may reset (RST_STREAM): a burst of max_resets_per_connection,
  // refilled at resets_per_second; one more closes the connection (front_end.hpp: the answer to
  // a rapid-reset flood). Clients reset a stream only when they cancel a call.
  int64_t max_resets_per_connection = 64;
  int64_t resets_per_second = 16;
  // The same, shared by all connections of one host (an IPv4 address, an IPv6 /64), so that a
  // client cannot renew its budget by reconnecting; while it is spent, the host's new
  // connections are closed as they are accepted (its open ones that do not reset go on).
  int64_t max_resets_per_host = 256;
  int64_t host_resets_per_second = 64;
  // Memory for requests in flight: a quarter is gRPC's resource quota (its transports' buffers),
  // the rest the budget every received request is charged to before it is parsed (its bytes and
  // the worst case of its parsed fields and working tensors). Sessions' caches are bounded apart:
  // max_sessions x max_tokens_per_session.
  int64_t max_memory_bytes = int64_t{1} << 30;
  // An authenticated call's message must arrive this soon after its headers, and a TLS handshake
  // end this soon, or it is cancelled.
  std::chrono::milliseconds read_timeout{10000};
  // A connection without calls this long is closed (GOAWAY; clients reconnect on their next call).
  std::chrono::milliseconds connection_idle_timeout{300000};
  int64_t max_tokens_per_session = 1 << 16;       // also bounded by the target's max_sequence_length
  int64_t max_gamma = 64;                         // drafts in one request
  int64_t max_request_bytes = 64 << 20;           // one request on the wire
  std::chrono::milliseconds idle_timeout{60000};  // a session unused this long is freed
  int64_t max_batch = 16;                         // verifications in one target forward (1: no batching)
  // How long a forward waits for more verifications to join while fewer than max_batch are
  // queued: 0 (the default) starts it at once; a few milliseconds trade latency for fuller batches.
  std::chrono::microseconds batch_delay{0};
};

// What the server's forwards have done: verifications served, target forwards run for them and
// the most verifications one forward served.
struct ServerStats {
  int64_t verifications = 0;
  int64_t forwards = 0;
  int64_t largest_batch = 0;
  int64_t sessions_evicted = 0;  // sessions closed by fair admission to make room for another client
  int64_t unauthenticated = 0;   // calls refused on their headers for want of the token
  int64_t live_calls = 0;        // calls handed over by gRPC and not yet done (now)
};

struct ServerOptions {
  std::string address = "127.0.0.1:50051";  // host:port; port 0 picks a free one (VerifierServer::port)
  std::string token{};                      // shared secret; a non-loopback address needs it or
                                            // TLS with client certificates
  ServerLimits limits{};
  // TLS: certificate_chain and private_key serve over TLS; trusted_ca then also requires every
  // client to present a certificate signed by one of those CAs. Empty: plaintext.
  TlsOptions tls{};
  // Tensor parallelism (see the top of this file): the group whose rank 0 this server is, with a
  // SharedDecisions alive on it and the target this rank's shard; null for one process.
  std::shared_ptr<Collectives> group{};
  // How often an idle rank 0 tells the other ranks that no work came: well under the group's
  // timeout, which is how long they wait for the next word.
  std::chrono::milliseconds heartbeat{1000};
};

// Whether `address` (host:port) names the loopback interface: localhost, 127.0.0.0/8 or [::1].
inline bool is_loopback(std::string_view address) {
  const size_t colon = address.rfind(':');
  const std::string_view host = address.substr(0, colon);
  return host == "localhost" || host == "[::1]" || host.rfind("127.", 0) == 0;
}

namespace detail {

// `bytes` bytes from the operating system's random source (getrandom: the kernel's CSPRNG), as
// 2 * bytes hex digits. Nothing seeds it and nothing in the process can reproduce it. Throws
// std::runtime_error when the source fails.
inline std::string random_hex(size_t bytes) {
  std::string raw(bytes, '\0');
  size_t filled = 0;
  while (filled < bytes) {
    const ssize_t got = ::getrandom(raw.data() + filled, bytes - filled, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      throw std::runtime_error(std::string("getrandom failed: ") + std::generic_category().message(errno));
    }
    filled += static_cast<size_t>(got);
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  for (const char c : raw) {
    hex += kHex[static_cast<unsigned char>(c) >> 4];
    hex += kHex[static_cast<unsigned char>(c) & 15];
  }
  return hex;
}

// Compares a presented secret with the expected one in time independent of where they differ.
inline bool equal_secret(std::string_view presented, std::string_view expected) {
  size_t diff = presented.size() ^ expected.size();
  for (size_t i = 0; i < presented.size(); ++i) {
    const char other = i < expected.size() ? expected[i] : '\0';
    diff |= static_cast<unsigned char>(presented[i] ^ other);
  }
  return diff == 0 && !expected.empty();
}

// Hands the allocator's free memory back to the system. glibc keeps what freed sessions held in
// its per-thread arenas, so without this a server's RSS stays near its peak after a storm of
// sessions. Other allocators return memory on their own; there this does nothing.
inline void return_free_memory() noexcept {
#if defined(__GLIBC__)
  (void)::malloc_trim(0);
#endif
}

// One round of a tensor-parallel verifier's work as rank 0 hands it to the others: int64s and
// length-prefixed byte strings (serialized requests), written by rank 0 and read by the others.
class WorkMessage {
 public:
  enum Kind : int64_t { idle = 0, stop = 1, open = 2, verify = 3 };

  void put(int64_t value) { bytes_.append(reinterpret_cast<const char*>(&value), sizeof value); }
  void put(const google::protobuf::MessageLite& message) {
    const std::string serialized = message.SerializeAsString();
    put(static_cast<int64_t>(serialized.size()));
    bytes_ += serialized;
  }
  [[nodiscard]] std::string& bytes() noexcept { return bytes_; }

 private:
  std::string bytes_;
};

// Reads a WorkMessage; throws std::runtime_error where it ends early or a string's size or a
// request does not parse (ranks built from different sources).
class WorkReader {
 public:
  explicit WorkReader(std::string_view bytes) : bytes_(bytes) {}
  int64_t integer() {
    int64_t value = 0;
    std::memcpy(&value, take(sizeof value).data(), sizeof value);
    return value;
  }
  template <class Message>
  Message message() {
    const int64_t size = integer();
    if (size < 0) malformed();
    Message parsed;
    const std::string_view bytes = take(static_cast<size_t>(size));
    if (!parsed.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) malformed();
    return parsed;
  }

 private:
  std::string_view take(size_t n) {
    if (n > bytes_.size() - at_) malformed();
    const std::string_view part = bytes_.substr(at_, n);
    at_ += n;
    return part;
  }
  [[noreturn]] static void malformed() {
    throw std::runtime_error(
        "tensor parallelism: the verifier's work message from rank 0 is malformed (are the ranks the same program?)");
  }
  std::string_view bytes_;
  size_t at_ = 0;
};

// Rank 0's `message`, on every rank of `group` (its size, then its bytes: two broadcasts). The
// other ranks pass anything (it is not read). Throws std::runtime_error when a collective fails.
inline std::string share(Collectives& group, const std::string& message) {
  at::Tensor size = at::full({1}, static_cast<int64_t>(message.size()), at::kLong);
  group.broadcast(size, 0);
  const int64_t n = size.item<int64_t>();
  if (n < 0) throw std::runtime_error("tensor parallelism: rank 0 announced a work message of " + std::to_string(n) + " bytes");
  at::Tensor bytes = at::empty({n}, at::kByte);
  if (group.rank() == 0) std::memcpy(bytes.data_ptr(), message.data(), static_cast<size_t>(n));
  if (n > 0) group.broadcast(bytes, 0);
  return {reinterpret_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(n)};
}

// The numbers of the sessions rank 0 has freed since its last round (tensor parallelism): the
// other ranks free theirs when they read the next round.
struct RetiredSessions {
  std::mutex mutex;
  std::vector<int64_t> numbers;
};

// Closed sessions remembered so that their clients hear why (fair admission's evictions): at most
// this many, the oldest forgotten first.
inline constexpr size_t kRememberedEvictions = 1024;

}  // namespace detail

template <Target T>
class VerifierService;

template <Target T>
void follow_verifier(T& target, std::shared_ptr<Collectives> group);

template <Target T>
class VerifierService final : public grpc::CallbackGenericService {
 public:
  // Throws std::invalid_argument when options.token holds a byte no client can send (see token.hpp).
  VerifierService(T& target, ServerOptions options)
      : target_(target),
        options_(std::move(options)),
        budget_(options_.limits.max_memory_bytes - grpc_share(options_.limits)),
        workers_(static_cast<size_t>(options_.limits.max_concurrent_requests)) {
    check_token(options_.token, "ServerOptions::token");
    if (options_.group) retired_ = std::make_shared<detail::RetiredSessions>();
    start_queue();
  }

  // How the server names a connection: gRPC's peer string as the front end resolves it (a
  // connection it relays is "fd:N" to gRPC). Set before serving.
  void set_peer_names(std::function<std::string(const std::string&)> names) { peer_names_ = std::move(names); }
  [[nodiscard]] std::string peer_of(const std::string& peer) const { return peer_names_ ? peer_names_(peer) : peer; }

  // The part of limits.max_memory_bytes that is gRPC's resource quota: a quarter.
  static int64_t grpc_share(const ServerLimits& limits) { return limits.max_memory_bytes / 4; }

  // The three methods, as a Call runs them: the caller is authenticated and the request read.
  grpc::Status Open(const detail::Caller& caller, const wire::OpenRequest* request, wire::OpenReply* reply) {
    const int64_t vocab = target_.vocab_size();
    const std::span<const int64_t> prompt(request->prompt().data(), static_cast<size_t>(request->prompt_size()));
    if (prompt.empty()) return invalid("prompt must not be empty");
    if (auto bad = check_tokens("prompt", prompt, vocab)) return *bad;
    if (static_cast<int64_t>(prompt.size()) + 1 > token_limit()) {
      return {grpc::StatusCode::RESOURCE_EXHAUSTED, "prompt of " + std::to_string(prompt.size()) +
                                                        " tokens leaves no room under the session limit of " +
                                                        std::to_string(token_limit()) + " tokens"};
    }
    if (request->threshold() && !(std::isfinite(request->tau()) && request->tau() >= 0)) {
      return invalid("tau must be a finite number >= 0, got " + std::to_string(request->tau()));
    }
    if (auto full = make_room(caller, /*evict=*/false)) return *full;  // a refused Open costs no forward
    std::shared_ptr<State> state;
    try {
      state = state_of(*request);
    } catch (const std::invalid_argument& e) {
      return invalid(std::string("sampling: ") + e.what());
    }
    state->number = next_number_++;
    state->retired = retired_;
    Job prefill{.task = [&] { return prefill_session(*state, prompt); }, .opening = request, .number = state->number};
    if (const grpc::Status prefilled = schedule(prefill); !prefilled.ok()) return prefilled;
    state->last_used = std::chrono::steady_clock::now();
    const std::lock_guard lock(sessions_mutex_);
    if (auto full = make_room_locked(caller, /*evict=*/true)) return *full;  // others may have opened meanwhile
    // The handle and the secret: 128 random bits each. The secret and the opener's identity are
    // what every later call must present; the handle only finds the session.
    std::string id = detail::random_hex(16);
    while (sessions_.contains(id) || evicted_.contains(id)) id = detail::random_hex(16);
    state->secret = detail::random_hex(16);
    state->owner = caller.identity;
    state->path = caller.path;
    reply->set_secret(state->secret);
    sessions_.emplace(id, std::move(state));
    reply->set_session(id);
    reply->set_vocab_size(vocab);
    reply->set_max_sequence_length(token_limit());
    reply->set_max_gamma(options_.limits.max_gamma);
    return grpc::Status::OK;
  }

  grpc::Status Verify(const detail::Caller& caller, const wire::VerifyRequest* request, wire::VerifyReply* reply) {
    const std::shared_ptr<State> state = find(caller, request->session(), request->secret());
    if (!state) return no_session(caller, request->session(), request->secret());
    const std::lock_guard lock(state->mutex);
    if (state->evicted) return no_session(caller, request->session(), request->secret());
    state->last_used = std::chrono::steady_clock::now();
    Session<T>& session = *state->session;
    const int64_t vocab = target_.vocab_size();
    const std::span<const int64_t> append(request->append().data(), static_cast<size_t>(request->append_size()));
    const std::span<const int64_t> drafts(request->drafts().data(), static_cast<size_t>(request->drafts_size()));
    const auto k = static_cast<int64_t>(drafts.size());
    if (request->length() < 1 || request->length() > session.length()) {
      return {grpc::StatusCode::FAILED_PRECONDITION, "length " + std::to_string(request->length()) +
                                                         " is not a length of the session, which holds " +
                                                         std::to_string(session.length()) + " tokens"};
    }
    if (session.tokens()[static_cast<size_t>(request->length() - 1)] != request->last_token()) {
      // The session's own token is not named: errors never show what a session holds.
      return {grpc::StatusCode::FAILED_PRECONDITION,
              "last_token does not match the session's token at position " + std::to_string(request->length() - 1) +
                  ": client and server hold different sequences"};
    }
    if (k > options_.limits.max_gamma) {
      return invalid("drafts holds " + std::to_string(k) + " tokens, more than max_gamma = " +
                     std::to_string(options_.limits.max_gamma));
    }
    if (auto bad = check_tokens("append", append, vocab)) return *bad;
    if (auto bad = check_tokens("drafts", drafts, vocab)) return *bad;
    const int64_t after = request->length() + static_cast<int64_t>(append.size()) + k + 1;
    if (after > token_limit()) {
      return {grpc::StatusCode::RESOURCE_EXHAUSTED, "the session would hold " + std::to_string(after) +
                                                        " tokens, more than its limit of " +
                                                        std::to_string(token_limit())};
    }
    Job job{.state = state.get(), .request = request, .number = state->number, .step = state->steps};
    try {
      prepare(job, vocab);
    } catch (const std::invalid_argument& e) {
      return invalid(e.what());
    }
    ++state->steps;
    session.rollback(request->length());
    session.append(append);
    const grpc::Status status = schedule(job);
    if (!status.ok()) {
      session.rollback(request->length());
      return status;
    }
    reply->set_accepted(job.verification.accepted);
    reply->set_token(job.verification.token);
    reply->set_prefill_seconds(job.verification.seconds);
    reply->set_length(session.length());
    return grpc::Status::OK;
  }

  grpc::Status Close(const detail::Caller& caller, const wire::CloseRequest* request, wire::CloseReply* /*reply*/) {
    {
      const std::lock_guard lock(sessions_mutex_);
      const auto it = sessions_.find(request->session());
      if (it != sessions_.end() && belongs(*it->second, caller, request->secret())) {
        sessions_.erase(it);
        return grpc::Status::OK;
      }
    }
    return no_session(caller, request->session(), request->secret());
  }

  // Open sessions.
  [[nodiscard]] int64_t sessions() const {
    const std::lock_guard lock(sessions_mutex_);
    return static_cast<int64_t>(sessions_.size());
  }

  // Frees the sessions idle for longer than limits.idle_timeout (not those serving a request).
  // Then, if calls were served or sessions freed since the last time and no call is being served
  // at this moment, hands the memory freed meanwhile back to the system: at most once per reaper
  // round (at most once a second), and never while a call runs, where it would be allocated
  // again at once.
  void free_idle() {
    const auto now = std::chrono::steady_clock::now();
    {
      const std::lock_guard lock(sessions_mutex_);
      for (auto it = sessions_.begin(); it != sessions_.end();) {
        std::unique_lock busy(it->second->mutex, std::try_to_lock);
        if (busy && now - it->second->last_used > options_.limits.idle_timeout) {
          busy.unlock();
          it = sessions_.erase(it);
          busy_since_trim_ = true;
        } else {
          ++it;
        }
      }
    }
    if (serving_ == 0 && busy_since_trim_.exchange(false)) detail::return_free_memory();
  }

  // Cancels the calls whose message has not arrived within limits.read_timeout of their headers.
  void cancel_slow_reads() {
    const auto now = std::chrono::steady_clock::now();
    const std::lock_guard lock(reading_mutex_);
    for (auto it = reading_.begin(); it != reading_.end();) {
      if (now - it->second > options_.limits.read_timeout) {
        it->first->context().TryCancel();
        it = reading_.erase(it);
      } else {
        ++it;
      }
    }
  }

  // Calls whose message has not arrived yet.
  [[nodiscard]] int64_t reading() const {
    const std::lock_guard lock(reading_mutex_);
    return static_cast<int64_t>(reading_.size());
  }

  // Calls admitted (message arrived, charged) and not yet answered; threads started to serve them.
  [[nodiscard]] int64_t serving() const noexcept { return serving_.load(); }
  [[nodiscard]] size_t handler_threads() const { return workers_.threads(); }

  // The bytes of requests in flight charged now, and the budget (max_memory_bytes less gRPC's share).
  [[nodiscard]] int64_t charged_bytes() const noexcept { return budget_.used(); }
  [[nodiscard]] int64_t budget_bytes() const noexcept { return budget_.limit(); }

  // Every call starts here (gRPC's callback API, on one of its threads): see Call.
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* context) override {
    return new Call(*this, context);
  }

  [[nodiscard]] const ServerOptions& options() const noexcept { return options_; }

  // Stops the handler threads and then the model's thread once the queue is empty (after the gRPC
  // server has shut down, so no call comes and none waits on them). Idempotent; the destructor
  // calls it.
  void stop() {
    workers_.stop();
    if (queue_) queue_->stop();
  }
  VerifierService(const VerifierService&) = delete;
  VerifierService& operator=(const VerifierService&) = delete;
  ~VerifierService() override { stop(); }

  [[nodiscard]] ServerStats stats() const {
    ServerStats stats;
    if (queue_) {
      const ForwardQueueStats served = queue_->stats();
      stats.verifications = served.verifications;
      stats.forwards = served.forwards;
      stats.largest_batch = served.largest_batch;
    }
    stats.sessions_evicted = sessions_evicted_.load();
    stats.unauthenticated = unauthenticated_.load();
    stats.live_calls = live_calls_.load();
    return stats;
  }

  // Tensor parallelism: what failed the group (a rank gone, a collective timed out), once it has
  // failed; then the server serves no more requests. Empty while it serves, and for one process.
  [[nodiscard]] std::optional<std::string> failure() const {
    const std::lock_guard lock(failure_mutex_);
    return failure_;
  }

 private:
  friend void follow_verifier<T>(T& target, std::shared_ptr<Collectives> group);
  struct Follower {};
  // A service that serves no calls: a tensor-parallel rank other than 0 (follow()).
  VerifierService(T& target, ServerOptions options, Follower /*tag*/)
      : target_(target), options_(std::move(options)), budget_(0), workers_(0) {}

  using cache_type = typename T::cache_type;
  static constexpr bool kJoinable = JoinableKVCache<cache_type>;

  struct State {
    std::mutex mutex{};
    std::unique_ptr<cache_type> cache{};  // the session's cache (declared first: the session uses it)
    std::optional<Session<T>> session{};
    AnyProcessor processor{};
    uint64_t seed = 0;
    bool threshold = false;
    double tau = 0;
    uint64_t steps = 0;
    std::chrono::steady_clock::time_point last_used{};
    std::string secret{};  // OpenReply.secret: every later call presents it
    std::string owner{};   // the Caller::identity that opened it
    // Where its client stands (Caller::path, the last call's: a client that reconnects takes its
    // sessions along); its last entry is what max_sessions_per_client counts.
    std::vector<std::string> path{};
    bool evicted = false;  // closed by fair admission while a call had found it
    int64_t number = 0;    // what the ranks of a tensor-parallel verifier call it
    std::shared_ptr<detail::RetiredSessions> retired{};  // where it is reported freed (tensor parallelism)
    State() = default;
    State(const State&) = delete;
    State& operator=(const State&) = delete;
    ~State() {
      if (!retired) return;
      try {
        const std::lock_guard lock(retired->mutex);
        retired->numbers.push_back(number);
      } catch (...) {  // no memory for the number: the other ranks keep the session's cache
      }
    }
  };

  // Work for the model's thread: a task (a prompt's prefill) or one verification (the session,
  // whose tokens already hold the request's context, with the drafts, their q and the step's
  // options: prepare()); then the outcome, written by the forward that served it.
  struct Job {
    std::function<grpc::Status()> task{};  // run alone when set
    const wire::OpenRequest* opening = nullptr;  // the task's request (handed to the other ranks)
    State* state = nullptr;
    const wire::VerifyRequest* request = nullptr;  // the verification's request
    int64_t number = 0;                            // the session's State::number
    uint64_t step = 0;                             // the session's step index (its seed)
    SessionStep<T> verification{};                 // what the batcher serves, and its outcome
    grpc::Status status{};
  };

  static grpc::Status invalid(const std::string& message) { return {grpc::StatusCode::INVALID_ARGUMENT, message}; }

  // A session as `request` opens it, before its prefill. Throws std::invalid_argument for a bad
  // sampling description.
  static std::shared_ptr<State> state_of(const wire::OpenRequest& request) {
    auto state = std::make_shared<State>();
    state->processor = processor_of(request.sampling());
    state->seed = request.seed();
    state->threshold = request.threshold();
    state->tau = request.tau();
    return state;
  }

  // The cache is the target's to make, and the prompt is computed now (but for its last token,
  // which the first Verify feeds): a Verify then computes only the step's new tokens, so batched
  // rows stay of similar widths.
  grpc::Status prefill_session(State& state, std::span<const int64_t> prompt) {
    try {
      state.cache = std::make_unique<cache_type>(target_.make_cache(1));
      state.session.emplace(target_, *state.cache);
      state.session->append(prompt);
      state.session->prefill();
      return grpc::Status::OK;
    } catch (const std::exception& e) {
      return {grpc::StatusCode::INTERNAL, std::string("prefill of the prompt failed: ") + e.what()};
    }
  }

  // The step of `job.request` (validated but for q) on its session: the drafts, their q and the
  // step's options, seeded from job.step. Throws std::invalid_argument for a bad q.
  static void prepare(Job& job, int64_t vocab) {
    const wire::VerifyRequest& request = *job.request;
    State& state = *job.state;
    SessionStep<T>& step = job.verification;
    step.session = &*state.session;
    step.cache = state.cache.get();
    step.processor = &state.processor;
    step.drafts.assign(request.drafts().begin(), request.drafts().end());
    const auto k = static_cast<int64_t>(step.drafts.size());
    const bool greedy = std::holds_alternative<GreedyProcessor>(state.processor);
    const bool needs_q = k > 0 && !greedy && !state.threshold;
    if (!needs_q && request.q().encoding() != wire::DraftProbs::NONE) {
      throw std::invalid_argument("q must have encoding NONE under greedy decoding, threshold verification or without drafts");
    }
    if (needs_q) step.q = decode_q(request.q(), step.drafts, vocab);
    step.options = SpeculativeOptions{.max_new_tokens = k + 1,
                                      .seed = step_seed(state.seed, job.step),
                                      .gamma = std::max<int64_t>(k, 1),
                                      .first_target = false,
                                      .verification = state.threshold ? Verification::threshold : Verification::rejection,
                                      .threshold = state.threshold ? state.tau : 0.25};
  }

  enum class Method { open, verify, close };

  // One call, from its headers to its answer, on gRPC's callback API: no thread is held while
  // it waits. The constructor checks the token (unauthenticated: UNAUTHENTICATED, nothing read),
  // the method and a reading place (start_reading), then asks for the message; OnReadDone hands
  // it to admit(), which charges it, takes a request place and runs it on a handler thread
  // (serve()), which answers. gRPC deletes nothing: OnDone, after the answer, deletes the call.
  class Call final : public grpc::ServerGenericBidiReactor {
   public:
    Call(VerifierService& service, grpc::GenericCallbackServerContext* context) : service_(service), context_(*context) {
      ++service.live_calls_;
      if (auto denied = service.authorize(*context)) {
        ++service.unauthenticated_;
        Finish(*denied);
        return;
      }
      const std::string& path = context->method();
      const std::string prefix = "/" + std::string(wire::Verifier::service_full_name()) + "/";
      const std::string_view name = path.rfind(prefix, 0) == 0 ? std::string_view(path).substr(prefix.size()) : "";
      if (name == "Open") {
        method_ = Method::open;
      } else if (name == "Verify") {
        method_ = Method::verify;
      } else if (name == "Close") {
        method_ = Method::close;
      } else {
        Finish({grpc::StatusCode::UNIMPLEMENTED, "the verifier serves " + prefix + "Open, Verify and Close only"});
        return;
      }
      caller_ = detail::caller_of(*context, service.options_.token, service.peer_of(context->peer()));
      if (auto full = service.start_reading(*this)) {
        Finish(*full);
        return;
      }
      StartRead(&message_);
    }
    Call(const Call&) = delete;
    Call& operator=(const Call&) = delete;

    void OnReadDone(bool ok) override {
      service_.stop_reading(*this);
      if (!ok) {
        // Cancelled (read_timeout, a fairer caller, or the client), larger than max_request_bytes
        // (gRPC has answered RESOURCE_EXHAUSTED), or a call closed without a message.
        Finish(context_.IsCancelled() ? grpc::Status(grpc::StatusCode::CANCELLED,
                                                     "the request's message did not arrive within read_timeout, "
                                                     "or the call was cancelled")
                                      : invalid("the call carried no request message"));
        return;
      }
      service_.admit(*this);
    }
    void OnDone() override {
      --service_.live_calls_;
      delete this;
    }

    [[nodiscard]] grpc::GenericCallbackServerContext& context() noexcept { return context_; }
    [[nodiscard]] const detail::Caller& caller() const noexcept { return caller_; }

   private:
    friend class VerifierService;
    VerifierService& service_;
    grpc::GenericCallbackServerContext& context_;
    Method method_ = Method::open;
    detail::Caller caller_;
    grpc::ByteBuffer message_;  // the request as it arrived
    detail::Charge charge_;     // its part of the memory budget
    grpc::ByteBuffer reply_;
  };

  // Takes a place among limits.max_reading_calls for `call`, whose message is to be read: nullopt
  // when it has one (cancelling, where the calls are full, the oldest call of the client that
  // holds the most, if it holds at least two more than this caller: fair_victim), else the refusal.
  std::optional<grpc::Status> start_reading(Call& call) {
    const auto now = std::chrono::steady_clock::now();
    const std::lock_guard lock(reading_mutex_);
    if (static_cast<int64_t>(reading_.size()) >= options_.limits.max_reading_calls) {
      std::vector<Call*> calls;
      std::vector<detail::Holding> held;
      for (const auto& [other, since] : reading_) {
        calls.push_back(other);
        held.push_back({.path = &other->caller().path, .last_used = since});
      }
      const std::optional<size_t> victim = detail::fair_victim(held, call.caller().path);
      if (!victim) {
        return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                            "the server holds " + std::to_string(reading_.size()) +
                                " calls whose message has not arrived, its limit (max_reading_calls), and this "
                                "client holds as many as any other: try again");
      }
      calls[*victim]->context().TryCancel();
      reading_.erase(calls[*victim]);
    }
    reading_.emplace(&call, now);
    return std::nullopt;
  }

  // `call`'s message has arrived, or its read has failed: it leaves the reading calls.
  void stop_reading(Call& call) {
    const std::lock_guard lock(reading_mutex_);
    reading_.erase(&call);
  }

  // A memory refusal that names the limit.
  [[nodiscard]] grpc::Status over_budget(int64_t needed) const {
    return {grpc::StatusCode::RESOURCE_EXHAUSTED,
            "the request needs " + std::to_string(needed) + " bytes of the server's memory budget for requests in "
                "flight, of which " + std::to_string(budget_.limit() - budget_.used()) + " of " +
                std::to_string(budget_.limit()) + " are free (max_memory_bytes): try again, or send less"};
  }

  // `call`'s message has arrived: its bytes are charged, then, from its wire form and before it is
  // parsed, what its fields will hold (wire_cost, three times over for the growth of repeated
  // fields as they parse) and what its step will allocate (q decoded densely); counts over the
  // request limits are refused here, unparsed. Then it takes a request place and a handler
  // thread, or is answered RESOURCE_EXHAUSTED naming the limit.
  // Answers `call` with `status` without serving it; what it held of the memory budget is handed
  // back first, so that the budget is free by the time its client hears.
  static void refuse(Call& call, const grpc::Status& status) {
    call.message_.Clear();
    call.charge_.release();
    call.Finish(status);
  }

  void admit(Call& call) noexcept {
    try {
      const auto size = static_cast<int64_t>(call.message_.Length());
      if (!call.charge_.add(budget_, size)) return refuse(call, over_budget(size));
      const detail::MessageShape& shape = call.method_ == Method::open     ? detail::open_shape()
                                          : call.method_ == Method::verify ? detail::verify_shape()
                                                                           : detail::close_shape();
      std::optional<detail::WireCost> cost;
      {
        grpc::ProtoBufferReader reader(&call.message_);
        cost = detail::wire_cost(reader, shape);
      }
      if (!cost) return refuse(call, invalid("the request message is not a well-formed protobuf message"));
      const auto count = [&](int field) {
        const auto it = cost->elements.find(field);
        return it == cost->elements.end() ? int64_t{0} : it->second;
      };
      int64_t working = 0;
      if (call.method_ == Method::open && count(5) >= token_limit()) {
        return refuse(call, {grpc::StatusCode::RESOURCE_EXHAUSTED,
                            "prompt of " + std::to_string(count(5)) + " tokens leaves no room under the session limit of " +
                                std::to_string(token_limit()) + " tokens"});
      }
      if (call.method_ == Method::verify) {
        if (count(5) > options_.limits.max_gamma) {
          return refuse(call, invalid("drafts holds " + std::to_string(count(5)) + " tokens, more than max_gamma = " +
                                     std::to_string(options_.limits.max_gamma)));
        }
        if (count(4) >= token_limit()) {
          return refuse(call, {grpc::StatusCode::RESOURCE_EXHAUSTED,
                              "append holds " + std::to_string(count(4)) + " tokens, more than the session limit of " +
                                  std::to_string(token_limit()) + " tokens"});
        }
        working = count(5) * target_.vocab_size() * static_cast<int64_t>(sizeof(float) + sizeof(uint16_t));
      }
      const int64_t parsing = 3 * cost->parsed + working;
      if (!call.charge_.add(budget_, parsing)) return refuse(call, over_budget(call.charge_.bytes() + parsing));
      if (++serving_ > options_.limits.max_concurrent_requests) {
        --serving_;
        return refuse(call, {grpc::StatusCode::RESOURCE_EXHAUSTED,
                            "the server is serving " + std::to_string(options_.limits.max_concurrent_requests) +
                                " requests, its limit (max_concurrent_requests): try again"});
      }
      try {
        workers_.post([this, &call] { serve(call); });
      } catch (const std::exception& e) {
        --serving_;
        call.charge_.release();
        return refuse(call, {grpc::StatusCode::RESOURCE_EXHAUSTED, std::string("no handler thread: ") + e.what()});
      }
    } catch (const std::exception& e) {  // memory for the message's copy or the cost's tally
      refuse(call, {grpc::StatusCode::RESOURCE_EXHAUSTED, std::string("the request cannot be held: ") + e.what()});
    }
  }

  // On a handler thread: parses `call`'s request, runs its method and answers.
  void serve(Call& call) noexcept {
    grpc::Status status;
    try {
      switch (call.method_) {
        case Method::open: status = run_method(call, &VerifierService::Open); break;
        case Method::verify: status = run_method(call, &VerifierService::Verify); break;
        case Method::close: status = run_method(call, &VerifierService::Close); break;
      }
    } catch (const std::exception& e) {
      status = {grpc::StatusCode::INTERNAL, e.what()};
    }
    call.message_.Clear();
    call.charge_.release();
    busy_since_trim_ = true;
    --serving_;
    if (status.ok()) {
      call.StartWriteAndFinish(&call.reply_, grpc::WriteOptions(), status);
    } else {
      call.Finish(status);
    }
  }

  template <class Request, class Reply>
  grpc::Status run_method(Call& call, grpc::Status (VerifierService::*handler)(const detail::Caller&, const Request*, Reply*)) {
    Request request;
    if (!grpc::SerializationTraits<Request>::Deserialize(&call.message_, &request).ok()) {
      return invalid("the request message cannot be parsed as a " + std::string(Request::descriptor()->name()));
    }
    Reply reply;
    const grpc::Status status = (this->*handler)(call.caller(), &request, &reply);
    if (!status.ok()) return status;
    bool own = false;
    return grpc::SerializationTraits<Reply>::Serialize(reply, &call.reply_, &own);
  }

  // Queues `job` for the model's thread and returns when it has been served.
  grpc::Status schedule(Job& job) {
    try {
      if (job.task) {
        queue_->task(job);
      } else {
        queue_->verify(job);
      }
    } catch (const std::exception& e) {  // the queue has stopped (no call should reach it then), or a
                                         // round failed outside the handlers' own checks
      return {queue_->stopping() ? grpc::StatusCode::UNAVAILABLE : grpc::StatusCode::INTERNAL, e.what()};
    }
    return job.status;
  }

  // The model's thread (forward_queue.hpp): every forward (prefills and verifications) runs there,
  // one at a time, so one thread's buffers serve them all (a forward's scratch memory is per
  // thread). Each round runs the oldest prefill, if any, then every queued verification (up to
  // max_batch) in one forward, after waiting up to batch_delay for more to join. With a group,
  // each round's work is handed to the other ranks first (hand_over), an idle wait of
  // ServerOptions::heartbeat hands them an empty round, and the last round tells them to stop.
  void start_queue() {
    ForwardQueueOptions queue{.max_batch = kJoinable ? options_.limits.max_batch : 1,
                              .batch_delay = options_.limits.batch_delay};
    if (options_.group) queue.heartbeat = options_.heartbeat;
    typename ForwardQueue<Job>::Rounds rounds{
        .task =
            [this](Job& job) {
              Job* const round[] = {&job};
              if (!hand_over(round, detail::WorkMessage::open)) return;
              try {
                job.status = job.task();
              } catch (const std::exception& e) {
                job.status = {grpc::StatusCode::INTERNAL, e.what()};
              }
              check_group(round);
            },
        .verify =
            [this](std::span<Job* const> batch) {
              if (!hand_over(batch, detail::WorkMessage::verify)) return;
              run(batch);
              check_group(batch);
            },
        .idle = [this] { hand_over({}, detail::WorkMessage::idle); },
        .stop = [this] { hand_over({}, detail::WorkMessage::stop); }};
    queue_.emplace(queue, std::move(rounds));
  }

  // Tensor parallelism: broadcasts the round of `kind` that serves `jobs` (and the sessions freed
  // since the last round) to the other ranks, before rank 0 runs it. False, with every job's
  // status UNAVAILABLE, once the group has failed (now or before); true without a group.
  bool hand_over(std::span<Job* const> jobs, detail::WorkMessage::Kind kind) noexcept {
    if (!options_.group) return true;
    if (!failure()) {
      try {
        detail::WorkMessage message;
        message.put(kind);
        std::vector<int64_t> retired;
        {
          const std::lock_guard lock(retired_->mutex);
          retired.swap(retired_->numbers);
        }
        message.put(static_cast<int64_t>(retired.size()));
        for (const int64_t number : retired) message.put(number);
        if (kind == detail::WorkMessage::verify) message.put(static_cast<int64_t>(jobs.size()));
        for (const Job* job : jobs) {
          message.put(job->number);
          if (job->opening != nullptr) {
            message.put(*job->opening);
          } else {
            message.put(static_cast<int64_t>(job->step));
            message.put(*job->request);
          }
        }
        detail::share(*options_.group, message.bytes());
        return true;
      } catch (const std::exception& e) {
        fail(e.what());
      }
    }
    const grpc::Status status = failed_status();
    for (Job* job : jobs) job->status = status;
    return false;
  }

  // Tensor parallelism: a round that ended in an internal error (a collective that failed, a rank
  // that ran out of memory) has left the ranks out of step: the group fails for good, and the
  // round's calls say so (UNAVAILABLE, as every later call).
  void check_group(std::span<Job* const> jobs) {
    if (!options_.group) return;
    for (const Job* job : jobs) {
      if (job->status.error_code() == grpc::StatusCode::INTERNAL) fail(job->status.error_message());
    }
    if (!failure()) return;
    const grpc::Status status = failed_status();
    for (Job* job : jobs) {
      if (job->status.error_code() == grpc::StatusCode::INTERNAL) job->status = status;
    }
  }

  void fail(const std::string& what) noexcept {
    const std::lock_guard lock(failure_mutex_);
    if (!failure_) failure_ = what;
  }

  [[nodiscard]] grpc::Status failed_status() const {
    return {grpc::StatusCode::UNAVAILABLE,
            "the verifier's tensor-parallel group has failed, and serves no more requests: " + failure().value_or("")};
  }

  // A rank other than 0 of a tensor-parallel verifier: reads each round rank 0 hands over and
  // runs it as rank 0 does (the same sessions, batches and forwards), until rank 0 stops. Throws
  // std::runtime_error when the group fails, or when a round fails here as it cannot have on rank
  // 0 (which would have failed the group).
  void follow() {
    std::map<int64_t, std::shared_ptr<State>> sessions;
    const int64_t vocab = target_.vocab_size();
    const auto session_of = [&](int64_t number) {
      const auto it = sessions.find(number);
      if (it == sessions.end()) {
        throw std::runtime_error("tensor parallelism: rank 0 named session " + std::to_string(number) +
                                 ", which this rank does not hold");
      }
      return it->second;
    };
    while (true) {
      const std::string bytes = detail::share(*options_.group, {});
      detail::WorkReader in(bytes);
      const int64_t kind = in.integer();
      const int64_t retired = in.integer();
      for (int64_t i = 0; i < retired; ++i) sessions.erase(in.integer());
      if (retired > 0) detail::return_free_memory();
      if (kind == detail::WorkMessage::stop) return;
      if (kind == detail::WorkMessage::open) {
        const int64_t number = in.integer();
        const auto request = in.message<wire::OpenRequest>();
        std::shared_ptr<State> state = state_of(request);
        const std::span<const int64_t> prompt(request.prompt().data(), static_cast<size_t>(request.prompt_size()));
        if (const grpc::Status status = prefill_session(*state, prompt); !status.ok()) {
          throw std::runtime_error(status.error_message());
        }
        sessions[number] = std::move(state);
      } else if (kind == detail::WorkMessage::verify) {
        const int64_t count = in.integer();
        if (count < 1 || static_cast<size_t>(count) > bytes.size() / (3 * sizeof(int64_t))) {
          throw std::runtime_error("tensor parallelism: rank 0 sent a batch of " + std::to_string(count) + " verifications");
        }
        std::vector<wire::VerifyRequest> requests(static_cast<size_t>(count));
        std::vector<std::shared_ptr<State>> states;
        std::vector<Job> jobs(static_cast<size_t>(count));
        std::vector<Job*> batch;
        for (size_t i = 0; i < requests.size(); ++i) {
          states.push_back(session_of(in.integer()));
          Job& job = jobs[i];
          job.step = static_cast<uint64_t>(in.integer());
          requests[i] = in.message<wire::VerifyRequest>();
          job.state = states.back().get();
          job.request = &requests[i];
          prepare(job, vocab);
          Session<T>& session = *job.state->session;
          session.rollback(requests[i].length());
          session.append(std::span<const int64_t>(requests[i].append().data(), static_cast<size_t>(requests[i].append_size())));
          batch.push_back(&job);
        }
        run(batch);
        for (size_t i = 0; i < jobs.size(); ++i) {
          if (jobs[i].status.error_code() == grpc::StatusCode::INTERNAL) throw std::runtime_error(jobs[i].status.error_message());
          if (!jobs[i].status.ok()) jobs[i].state->session->rollback(requests[i].length());
        }
      } else if (kind != detail::WorkMessage::idle) {
        throw std::runtime_error("tensor parallelism: rank 0 sent a round of unknown kind " + std::to_string(kind));
      }
    }
  }

  // Serves `batch` through the batcher (session_batch.hpp): in one target forward where its
  // rows fit together; every job gets its status (nothing throws).
  void run(std::span<Job* const> batch) noexcept {
    try {
      std::vector<SessionStep<T>*> steps;
      for (Job* job : batch) steps.push_back(&job->verification);
      batcher_.run(steps);
      for (Job* job : batch) {
        const SessionStep<T>& step = job->verification;
        if (step.error == StepError::invalid) {
          job->status = invalid(step.message);
        } else if (step.error == StepError::internal) {
          job->status = {grpc::StatusCode::INTERNAL, step.message};
        }
      }
    } catch (const std::exception& e) {  // allocations of the batch's own list
      for (Job* job : batch) job->status = {grpc::StatusCode::INTERNAL, e.what()};
    }
  }

  // Whether `caller` may open a session: nullopt when it may, else RESOURCE_EXHAUSTED naming the
  // limit. Its client holding max_sessions_per_client is refused. On a full server, fair_victim
  // picks the session to close (the least recently used idle session of the client holding the
  // most, where it holds at least two more than this caller, by host and then by client); with
  // `evict` it is closed, and its client hears why on its next call.
  std::optional<grpc::Status> make_room(const detail::Caller& caller, bool evict) {
    const std::lock_guard lock(sessions_mutex_);
    return make_room_locked(caller, evict);
  }
  std::optional<grpc::Status> make_room_locked(const detail::Caller& caller, bool evict) {
    const auto held = std::count_if(sessions_.begin(), sessions_.end(),
                                    [&](const auto& s) { return s.second->path.back() == caller.client(); });
    if (held >= options_.limits.max_sessions_per_client) {
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          "this client holds " + std::to_string(held) +
                              " sessions, the limit per client (max_sessions_per_client): close one first");
    }
    if (static_cast<int64_t>(sessions_.size()) < options_.limits.max_sessions) return std::nullopt;
    std::vector<typename decltype(sessions_)::iterator> entries;
    std::vector<detail::Holding> holdings;
    for (auto it = sessions_.begin(); it != sessions_.end(); ++it) {
      State& state = *it->second;
      std::unique_lock idle(state.mutex, std::try_to_lock);  // a session serving a call is not taken
      entries.push_back(it);
      holdings.push_back({.path = &state.path, .last_used = idle ? state.last_used : std::chrono::steady_clock::time_point{},
                          .takeable = static_cast<bool>(idle)});
    }
    const std::optional<size_t> victim = detail::fair_victim(holdings, caller.path);
    if (!victim) {
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          "the server holds " + std::to_string(sessions_.size()) +
                              " sessions, its limit (max_sessions), and no client holds two more than this one "
                              "(fair admission): try again later");
    }
    if (!evict) return std::nullopt;
    const auto it = entries[*victim];
    State& state = *it->second;
    std::unique_lock idle(state.mutex, std::try_to_lock);
    if (!idle) {
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          "the server holds " + std::to_string(sessions_.size()) + " sessions, its limit (max_sessions): try again");
    }
    const int64_t held_by_victim = std::count_if(sessions_.begin(), sessions_.end(),
                                                 [&](const auto& s) { return s.second->path.back() == state.path.back(); });
    state.evicted = true;
    remember_eviction(it->first, state,
                      "this session was closed to make room for another client: the server held its limit of " +
                          std::to_string(options_.limits.max_sessions) + " sessions (max_sessions) and this client held " +
                          std::to_string(held_by_victim) + ", the most (fair admission closes the least recently used "
                          "session of the largest holder); open a new session");
    idle.unlock();
    sessions_.erase(it);
    ++sessions_evicted_;
    busy_since_trim_ = true;
    return std::nullopt;
  }

  // Keeps why session `id` was closed, for its client's next call (at most kRememberedEvictions).
  void remember_eviction(const std::string& id, const State& state, std::string why) {
    evicted_.insert_or_assign(id, Eviction{.secret = state.secret, .owner = state.owner, .why = std::move(why)});
    eviction_order_.push_back(id);
    while (eviction_order_.size() > detail::kRememberedEvictions) {
      evicted_.erase(eviction_order_.front());
      eviction_order_.pop_front();
    }
  }

  [[nodiscard]] int64_t token_limit() const {
    return std::min<int64_t>(options_.limits.max_tokens_per_session, specdec::detail::sequence_limit(target_));
  }

  static std::optional<grpc::Status> check_tokens(const char* field, std::span<const int64_t> tokens, int64_t vocab) {
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (tokens[i] < 0 || tokens[i] >= vocab) {
        return invalid(std::string(field) + "[" + std::to_string(i) + "] = " + std::to_string(tokens[i]) +
                       " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
      }
    }
    return std::nullopt;
  }

  [[nodiscard]] std::optional<grpc::Status> authorize(const grpc::ServerContextBase& context) const {
    if (options_.token.empty()) return std::nullopt;
    const auto& metadata = context.client_metadata();
    const auto it = metadata.find(grpc::string_ref(kAuthorization.data(), kAuthorization.size()));
    if (it != metadata.end()) {
      const std::string_view value(it->second.data(), it->second.size());
      if (value.rfind(kBearer, 0) == 0 && detail::equal_secret(value.substr(kBearer.size()), options_.token)) {
        return std::nullopt;
      }
    }
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "a valid token is required (authorization: Bearer TOKEN)");
  }

  // The session `id` where `secret` is its secret and `caller` the identity that opened it (its
  // client is then where the caller stands now); null otherwise, the same for a session that does
  // not exist and one that is not the caller's.
  std::shared_ptr<State> find(const detail::Caller& caller, const std::string& id, const std::string& secret) {
    const std::lock_guard lock(sessions_mutex_);
    const auto it = sessions_.find(id);
    if (it == sessions_.end() || !belongs(*it->second, caller, secret)) return nullptr;
    it->second->path = caller.path;
    return it->second;
  }

  // Whether `caller` may use a session of `secret` and `owner`: its secret (compared in constant
  // time) and the identity that opened it.
  static bool belongs(const std::string& secret, const std::string& owner, const detail::Caller& caller,
                      const std::string& presented) {
    const bool secret_matches = detail::equal_secret(presented, secret);
    const bool owner_matches = caller.identity == owner;
    return secret_matches && owner_matches;
  }
  static bool belongs(const State& state, const detail::Caller& caller, const std::string& presented) {
    return belongs(state.secret, state.owner, caller, presented);
  }

  // The answer for a session the caller cannot use: unknown, closed, idle too long, or another
  // client's (the handle is not echoed) get one NOT_FOUND; a session of the caller's that fair
  // admission closed says so.
  grpc::Status no_session(const detail::Caller& caller, const std::string& id, const std::string& secret) const {
    {
      const std::lock_guard lock(sessions_mutex_);
      const auto it = evicted_.find(id);
      if (it != evicted_.end() && belongs(it->second.secret, it->second.owner, caller, secret)) {
        return {grpc::StatusCode::NOT_FOUND, it->second.why};
      }
    }
    return {grpc::StatusCode::NOT_FOUND, "no such session for this client (closed, idle too long, or never opened by it)"};
  }

  // Why a session was closed, for its client: its secret and owner as it had them.
  struct Eviction {
    std::string secret, owner, why;
  };

  T& target_;
  SessionBatcher<T> batcher_{target_};  // the model thread's forwards of verifications
  ServerOptions options_;
  mutable std::mutex sessions_mutex_;
  std::map<std::string, std::shared_ptr<State>> sessions_;
  std::map<std::string, Eviction> evicted_;  // sessions fair admission closed (guarded by sessions_mutex_)
  std::deque<std::string> eviction_order_;   // their handles, oldest first
  std::atomic<int64_t> sessions_evicted_{0};
  std::atomic<int64_t> unauthenticated_{0}, live_calls_{0};
  std::function<std::string(const std::string&)> peer_names_{};
  detail::MemoryBudget budget_;
  detail::Workers workers_;
  std::atomic<int64_t> serving_{0};
  std::atomic<bool> busy_since_trim_{false};  // calls served or sessions freed since the last
                                              // return_free_memory()
  mutable std::mutex reading_mutex_;
  std::map<Call*, std::chrono::steady_clock::time_point> reading_;  // calls awaiting their message, since
  std::shared_ptr<detail::RetiredSessions> retired_{};  // tensor parallelism: sessions freed since the last round
  std::atomic<int64_t> next_number_{0};                 // the next session's State::number
  mutable std::mutex failure_mutex_;
  std::optional<std::string> failure_{};  // failure()
  std::optional<ForwardQueue<Job>> queue_{};  // the model's thread (start_queue), started last by the
                                             // constructor; none on a follower
};

namespace detail {

// Throws std::invalid_argument unless a SharedDecisions is alive on `group`: without it the ranks
// of a tensor-parallel verifier would each take their own decisions and fall out of step.
inline void check_shared_decisions(const Collectives& group) {
  if (specdec::detail::decision_group().load() != &group) {
    throw std::invalid_argument("ServerOptions::group: no specdec::SharedDecisions is alive on it; every rank of a "
                                "tensor-parallel verifier needs one for as long as it serves");
  }
}

}  // namespace detail

// Rank group->rank() (not 0) of a tensor-parallel verifier (see the top of this file): runs, on
// this thread, every round of work that rank 0's VerifierServer over the same group hands over,
// with `target` this rank's shard, until rank 0 stops serving (it returns) or the group fails (it
// throws std::runtime_error naming the collective and the rank; within the group's timeout of
// rank 0's last word). A SharedDecisions must be alive on `group`. Throws std::invalid_argument
// for a missing group, rank 0, or no SharedDecisions.
template <Target T>
void follow_verifier(T& target, std::shared_ptr<Collectives> group) {
  if (!group) throw std::invalid_argument("follow_verifier: group must not be null");
  if (group->rank() == 0) {
    throw std::invalid_argument("follow_verifier: rank 0 serves (VerifierServer with ServerOptions::group), it does not follow");
  }
  detail::check_shared_decisions(*group);
  ServerOptions options;
  options.group = std::move(group);
  VerifierService<T> service(target, std::move(options), typename VerifierService<T>::Follower{});
  service.follow();
}

// A running server: the service on options.address, and a thread that frees idle sessions.
template <Target T>
class VerifierServer {
 public:
  // Starts serving. Throws std::invalid_argument for a non-loopback address without a token or
  // bad limits, std::runtime_error when the address cannot be bound.
  VerifierServer(T& target, ServerOptions options) : service_(target, check(std::move(options))) {
    const ServerLimits& l = service_.options().limits;
    grpc::ServerBuilder builder;
    if (service_.options().tls.enabled()) {
      builder.AddListeningPort(service_.options().address, credentials(service_.options().tls), &port_);
    } else {
      front_ = std::make_unique<detail::FrontEnd>(
          service_.options().address,
          detail::ResetBudget{.burst = l.max_resets_per_connection,
                              .per_second = l.resets_per_second,
                              .host_burst = l.max_resets_per_host,
                              .host_per_second = l.host_resets_per_second});
      port_ = front_->port();
      service_.set_peer_names([front = front_.get()](const std::string& peer) { return front->peer_of(peer); });
    }
    builder.RegisterCallbackGenericService(&service_);
    const ServerLimits& limits = service_.options().limits;
    builder.SetMaxReceiveMessageSize(static_cast<int>(limits.max_request_bytes));
    grpc::ResourceQuota quota("specdec-verifier");
    quota.Resize(static_cast<size_t>(VerifierService<T>::grpc_share(limits)));
    builder.SetResourceQuota(quota);
    builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);  // see the top of this file
    builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, static_cast<int>(limits.max_streams_per_connection));
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, milliseconds(limits.connection_idle_timeout));
    builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, milliseconds(limits.read_timeout));
    // The port is this server's alone. gRPC binds with SO_REUSEPORT by default, which lets a second
    // process of the same user bind the same port and take a share of new connections (and of the
    // sessions' traffic); without it, binding a taken port fails here.
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    server_ = builder.BuildAndStart();
    if (server_ && front_) front_->start(*server_);
    if (!server_ || port_ == 0) {
      throw std::runtime_error("cannot listen on " + service_.options().address +
                               ": the address is in use by another process, or not an address of this machine");
    }
    reaper_ = std::thread([this] {
      const ServerLimits& l = service_.options().limits;
      const auto period = std::max(std::chrono::milliseconds(10),
                                   std::min({std::chrono::milliseconds(1000), l.idle_timeout / 4, l.read_timeout / 4}));
      std::unique_lock lock(mutex_);
      while (!stopping_) {
        stop_.wait_for(lock, period);
        service_.free_idle();
        service_.cancel_slow_reads();
      }
    });
  }
  VerifierServer(const VerifierServer&) = delete;
  VerifierServer& operator=(const VerifierServer&) = delete;
  ~VerifierServer() { shutdown(); }

  [[nodiscard]] int port() const noexcept { return port_; }
  [[nodiscard]] int64_t sessions() const { return service_.sessions(); }
  [[nodiscard]] ServerStats stats() const { return service_.stats(); }
  // Calls whose message has not arrived yet, calls being served, the handler threads started and
  // the bytes of requests in flight charged to the memory budget (of budget_bytes()).
  [[nodiscard]] int64_t reading() const { return service_.reading(); }
  [[nodiscard]] int64_t serving() const noexcept { return service_.serving(); }
  [[nodiscard]] size_t handler_threads() const { return service_.handler_threads(); }
  [[nodiscard]] int64_t charged_bytes() const noexcept { return service_.charged_bytes(); }
  [[nodiscard]] int64_t budget_bytes() const noexcept { return service_.budget_bytes(); }
  // Plaintext servers: connections accepted, and closed past their reset budget.
  [[nodiscard]] detail::FrontEnd::Stats front_end() const { return front_ ? front_->stats() : detail::FrontEnd::Stats{}; }
  // Tensor parallelism: what failed the group, once it has (then every call gets UNAVAILABLE;
  // a program stops the server and exits). Empty while it serves.
  [[nodiscard]] std::optional<std::string> failure() const { return service_.failure(); }

  // Stops accepting requests, cancels those in flight and stops the reaper. Idempotent.
  void shutdown() {
    {
      const std::lock_guard lock(mutex_);
      if (stopping_) return;
      stopping_ = true;
    }
    stop_.notify_all();
    if (reaper_.joinable()) reaper_.join();
    if (front_) front_->stop();
    server_->Shutdown(std::chrono::system_clock::now());
    service_.stop();
  }

  // Blocks until shutdown().
  void wait() { server_->Wait(); }

 private:
  static ServerOptions check(ServerOptions options) {
    const TlsOptions& tls = options.tls;
    if (tls.enabled() && (tls.certificate_chain.empty() || tls.private_key.empty())) {
      throw std::invalid_argument("tls: serving over TLS needs both certificate_chain and private_key");
    }
    check_tls_key(tls, "tls.certificate_chain", "tls.private_key");
    if (!is_loopback(options.address) && options.token.empty() && tls.trusted_ca.empty()) {
      throw std::invalid_argument("address " + options.address +
                                  " is not loopback: a token or TLS with client certificates (tls.trusted_ca) is "
                                  "required to serve on it");
    }
    const ServerLimits& l = options.limits;
    const auto in = [](int64_t value, int64_t low, int64_t high) { return value >= low && value <= high; };
    constexpr int64_t kInt = (int64_t{1} << 31) - 1;
    const std::vector<std::pair<const char*, bool>> rules = {
        {"max_sessions >= 1", l.max_sessions >= 1},
        {"max_sessions_per_client >= 1", l.max_sessions_per_client >= 1},
        {"max_tokens_per_session >= 2", l.max_tokens_per_session >= 2},
        {"max_gamma >= 0", l.max_gamma >= 0},
        {"max_request_bytes in [1024, 2^31)", in(l.max_request_bytes, 1024, kInt)},
        {"max_concurrent_requests in [1, 65536]", in(l.max_concurrent_requests, 1, 65536)},
        {"max_reading_calls >= 1", l.max_reading_calls >= 1},
        {"max_resets_per_connection >= 1", l.max_resets_per_connection >= 1},
        {"resets_per_second >= 0", l.resets_per_second >= 0},
        {"max_resets_per_host >= 1", l.max_resets_per_host >= 1},
        {"host_resets_per_second >= 0", l.host_resets_per_second >= 0},
        {"max_streams_per_connection in [1, 2^31)", in(l.max_streams_per_connection, 1, kInt)},
        {"max_memory_bytes >= 4 MiB", l.max_memory_bytes >= (int64_t{4} << 20)},
        {"idle_timeout >= 1 ms", l.idle_timeout.count() >= 1},
        {"read_timeout in [1 ms, 2^31 ms)", in(l.read_timeout.count(), 1, kInt)},
        {"connection_idle_timeout in [1 ms, 2^31 ms)", in(l.connection_idle_timeout.count(), 1, kInt)},
        {"max_batch >= 1", l.max_batch >= 1},
        {"batch_delay in [0, 1 s]", l.batch_delay.count() >= 0 && l.batch_delay <= std::chrono::seconds(1)},
    };
    for (const auto& [rule, holds] : rules) {
      if (!holds) throw std::invalid_argument(std::string("limits: ") + rule + " is required");
    }
    if (options.group) {
      if (options.group->rank() != 0) {
        throw std::invalid_argument("ServerOptions::group: this process is rank " + std::to_string(options.group->rank()) +
                                    "; rank 0 serves, the other ranks run remote::follow_verifier");
      }
      if (options.heartbeat.count() < 1) {
        throw std::invalid_argument("ServerOptions::heartbeat must be >= 1 ms, got " +
                                    std::to_string(options.heartbeat.count()) + " ms");
      }
      detail::check_shared_decisions(*options.group);
    }
    return options;
  }

  static int milliseconds(std::chrono::milliseconds duration) { return static_cast<int>(duration.count()); }

  // Plaintext, TLS, or TLS that requires and verifies client certificates.
  static std::shared_ptr<grpc::ServerCredentials> credentials(const TlsOptions& tls) {
    if (!tls.enabled()) return grpc::InsecureServerCredentials();
    grpc::SslServerCredentialsOptions ssl(tls.trusted_ca.empty()
                                              ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                              : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    ssl.pem_root_certs = tls.trusted_ca;
    ssl.pem_key_cert_pairs.push_back({tls.private_key, tls.certificate_chain});
    return grpc::SslServerCredentials(ssl);
  }

  VerifierService<T> service_;
  std::unique_ptr<detail::FrontEnd> front_;  // plaintext: the listener and relay (front_end.hpp)
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::mutex mutex_;
  std::condition_variable stop_;
  bool stopping_ = false;
  std::thread reaper_;
};

}  // namespace specdec::remote
