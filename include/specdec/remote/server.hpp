// The verification server: a target model behind gRPC (specdec-verifier is this class and a
// command line). Each client opens a session whose tokens and KV cache stay on the server
// (specdec::Session), then sends drafts; each Verify runs one step of the library's step core with
// the client's drafts as the draft source, so verification is exactly the local one (rejection
// sampling, the greedy fast path, threshold verification). The step's sampling generator is
// seeded from the client's seed and the step's index: a run is reproducible.
//
// Safety: the server listens on loopback unless told otherwise, and any other address needs a
// shared-secret token, which every request must then carry ("authorization: Bearer TOKEN"; the
// token travels in clear: put a TLS-terminating proxy in front on an untrusted network). Sessions,
// tokens per session, drafts per request and request bytes are bounded (ServerLimits), a session
// idle for limits.idle_timeout is freed, and every bad request is answered with
// INVALID_ARGUMENT, FAILED_PRECONDITION, NOT_FOUND, RESOURCE_EXHAUSTED or UNAUTHENTICATED and a
// message, while the server goes on serving the others.
//
// Concurrency: gRPC's thread pool serves requests concurrently; sessions are independent and one
// target forward runs at a time (the model is shared). Verifications of concurrent sessions are
// not yet batched into one forward.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/draft_source.hpp"
#include "specdec/remote/protocol.hpp"
#include "specdec/session.hpp"

namespace specdec::remote {

struct ServerLimits {
  int64_t max_sessions = 64;                    // open sessions at once
  int64_t max_tokens_per_session = 1 << 16;     // also bounded by the target's max_sequence_length
  int64_t max_gamma = 64;                       // drafts in one request
  int64_t max_request_bytes = 64 << 20;         // one request on the wire
  std::chrono::milliseconds idle_timeout{60000};  // a session unused this long is freed
};

struct ServerOptions {
  std::string address = "127.0.0.1:50051";  // host:port; port 0 picks a free one (VerifierServer::port)
  std::string token;                        // shared secret; required on a non-loopback address
  ServerLimits limits;
};

// Whether `address` (host:port) names the loopback interface: localhost, 127.0.0.0/8 or [::1].
inline bool is_loopback(std::string_view address) {
  const size_t colon = address.rfind(':');
  const std::string_view host = address.substr(0, colon);
  return host == "localhost" || host == "[::1]" || host.rfind("127.", 0) == 0;
}

namespace detail {

// The client's drafts as a DraftSource: handed to the step once.
struct ClientDrafts {
  at::Tensor tokens, probs;
  template <LogitsProcessor P>
  Drafts draft(const DraftRequest& /*request*/, const P& /*processor*/, at::Generator& /*gen*/) {
    Drafts drafts{.tokens = std::move(tokens), .probs = std::move(probs)};
    tokens = at::Tensor(), probs = at::Tensor();
    return drafts;
  }
  void verified(const VerifiedDrafts& /*verified*/) const noexcept {}
};

// Compares a presented secret with the expected one in time independent of where they differ.
inline bool equal_secret(std::string_view presented, std::string_view expected) {
  size_t diff = presented.size() ^ expected.size();
  for (size_t i = 0; i < presented.size(); ++i) {
    const char other = i < expected.size() ? expected[i] : '\0';
    diff |= static_cast<unsigned char>(presented[i] ^ other);
  }
  return diff == 0 && !expected.empty();
}

}  // namespace detail

template <Target T>
class VerifierService final : public wire::Verifier::Service {
 public:
  VerifierService(T& target, ServerOptions options) : target_(target), options_(std::move(options)) {}

  grpc::Status Open(grpc::ServerContext* context, const wire::OpenRequest* request, wire::OpenReply* reply) override {
    if (auto denied = authorize(context)) return *denied;
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
    auto state = std::make_shared<State>();
    try {
      state->processor = processor_of(request->sampling());
    } catch (const std::invalid_argument& e) {
      return invalid(std::string("sampling: ") + e.what());
    }
    state->seed = request->seed();
    state->threshold = request->threshold();
    state->tau = request->tau();
    {
      const std::lock_guard model(model_mutex_);  // the cache is the target's to make
      state->session.emplace(target_);
    }
    state->session->append(prompt);
    state->last_used = std::chrono::steady_clock::now();
    const std::lock_guard lock(sessions_mutex_);
    if (static_cast<int64_t>(sessions_.size()) >= options_.limits.max_sessions) {
      return {grpc::StatusCode::RESOURCE_EXHAUSTED,
              "the server holds " + std::to_string(sessions_.size()) + " sessions, its limit (max_sessions)"};
    }
    const std::string id = new_id();
    sessions_.emplace(id, std::move(state));
    reply->set_session(id);
    reply->set_vocab_size(vocab);
    reply->set_max_sequence_length(token_limit());
    reply->set_max_gamma(options_.limits.max_gamma);
    return grpc::Status::OK;
  }

  grpc::Status Verify(grpc::ServerContext* context, const wire::VerifyRequest* request, wire::VerifyReply* reply) override {
    if (auto denied = authorize(context)) return *denied;
    const std::shared_ptr<State> state = find(request->session());
    if (!state) return {grpc::StatusCode::NOT_FOUND, "no session '" + printable(request->session()) + "' (closed or idle too long)"};
    const std::lock_guard lock(state->mutex);
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
      return {grpc::StatusCode::FAILED_PRECONDITION,
              "last_token " + std::to_string(request->last_token()) + " differs from the session's token " +
                  std::to_string(session.tokens()[static_cast<size_t>(request->length() - 1)]) + " at position " +
                  std::to_string(request->length() - 1) + ": client and server hold different sequences"};
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
    detail::ClientDrafts source;
    const bool greedy = std::holds_alternative<GreedyProcessor>(state->processor);
    const bool needs_q = k > 0 && !greedy && !state->threshold;
    if (!needs_q && request->q().encoding() != wire::DraftProbs::NONE) {
      return invalid("q must have encoding NONE under greedy decoding, threshold verification or without drafts");
    }
    try {
      if (needs_q) source.probs = decode_q(request->q(), drafts, vocab);
    } catch (const std::invalid_argument& e) {
      return invalid(e.what());
    }
    if (k > 0) source.tokens = at::tensor(std::vector<int64_t>(drafts.begin(), drafts.end()), at::kLong);

    session.rollback(request->length());
    session.append(append);
    std::optional<StepInfo> step;
    SpeculativeOptions options{.max_new_tokens = k + 1,
                               .seed = step_seed(state->seed, state->steps++),
                               .gamma = std::max<int64_t>(k, 1),
                               .first_target = false,
                               .verification = state->threshold ? Verification::threshold : Verification::rejection,
                               .threshold = state->threshold ? state->tau : 0.25};
    options.on_step = [&](const StepInfo& info) {
      step = info;
      return StepAction::stop;
    };
    GenerationResult result;
    try {
      const std::lock_guard model(model_mutex_);
      result = std::visit([&](const auto& processor) { return session.generate(source, options, processor); },
                          state->processor);
    } catch (const std::invalid_argument& e) {
      session.rollback(request->length());
      return invalid(e.what());
    } catch (const std::exception& e) {
      session.rollback(request->length());
      return {grpc::StatusCode::INTERNAL, e.what()};
    }
    if (!step) {  // every step reports to on_step; a generation without one did not run
      session.rollback(request->length());
      return {grpc::StatusCode::INTERNAL, "the step did not run"};
    }
    reply->set_accepted(step->accepted);
    reply->set_token(step->token);
    reply->set_prefill_seconds(result.stats.target_seconds);
    reply->set_length(session.length());
    return grpc::Status::OK;
  }

  grpc::Status Close(grpc::ServerContext* context, const wire::CloseRequest* request, wire::CloseReply* /*reply*/) override {
    if (auto denied = authorize(context)) return *denied;
    const std::lock_guard lock(sessions_mutex_);
    if (sessions_.erase(request->session()) == 0) {
      return {grpc::StatusCode::NOT_FOUND, "no session '" + printable(request->session()) + "'"};
    }
    return grpc::Status::OK;
  }

  // Open sessions.
  [[nodiscard]] int64_t sessions() const {
    const std::lock_guard lock(sessions_mutex_);
    return static_cast<int64_t>(sessions_.size());
  }

  // Frees the sessions idle for longer than limits.idle_timeout (not those serving a request).
  void free_idle() {
    const auto now = std::chrono::steady_clock::now();
    const std::lock_guard lock(sessions_mutex_);
    for (auto it = sessions_.begin(); it != sessions_.end();) {
      std::unique_lock busy(it->second->mutex, std::try_to_lock);
      if (busy && now - it->second->last_used > options_.limits.idle_timeout) {
        busy.unlock();
        it = sessions_.erase(it);
      } else {
        ++it;
      }
    }
  }

  [[nodiscard]] const ServerOptions& options() const noexcept { return options_; }

 private:
  struct State {
    std::mutex mutex;
    std::optional<Session<T>> session;
    AnyProcessor processor;
    uint64_t seed = 0;
    bool threshold = false;
    double tau = 0;
    uint64_t steps = 0;
    std::chrono::steady_clock::time_point last_used;
  };

  static grpc::Status invalid(const std::string& message) { return {grpc::StatusCode::INVALID_ARGUMENT, message}; }

  static std::string printable(const std::string& text) { return text.size() > 64 ? text.substr(0, 64) + "..." : text; }

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

  [[nodiscard]] std::optional<grpc::Status> authorize(const grpc::ServerContext* context) const {
    if (options_.token.empty()) return std::nullopt;
    const auto& metadata = context->client_metadata();
    const auto it = metadata.find(grpc::string_ref(kAuthorization.data(), kAuthorization.size()));
    if (it != metadata.end()) {
      const std::string_view value(it->second.data(), it->second.size());
      if (value.rfind(kBearer, 0) == 0 && detail::equal_secret(value.substr(kBearer.size()), options_.token)) {
        return std::nullopt;
      }
    }
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "a valid token is required (authorization: Bearer TOKEN)");
  }

  std::shared_ptr<State> find(const std::string& id) const {
    const std::lock_guard lock(sessions_mutex_);
    const auto it = sessions_.find(id);
    return it == sessions_.end() ? nullptr : it->second;
  }

  std::string new_id() {
    static constexpr char kHex[] = "0123456789abcdef";
    std::string id;
    for (int i = 0; i < 32; ++i) id += kHex[random_() & 15];
    return id;
  }

  T& target_;
  ServerOptions options_;
  mutable std::mutex sessions_mutex_;
  std::map<std::string, std::shared_ptr<State>> sessions_;
  std::mutex model_mutex_;
  std::mt19937_64 random_{std::random_device{}()};
};

// A running server: the service on options.address, and a thread that frees idle sessions.
template <Target T>
class VerifierServer {
 public:
  // Starts serving. Throws std::invalid_argument for a non-loopback address without a token or
  // bad limits, std::runtime_error when the address cannot be bound.
  VerifierServer(T& target, ServerOptions options) : service_(target, check(std::move(options))) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort(service_.options().address, grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&service_);
    builder.SetMaxReceiveMessageSize(static_cast<int>(service_.options().limits.max_request_bytes));
    server_ = builder.BuildAndStart();
    if (!server_ || port_ == 0) throw std::runtime_error("cannot listen on " + service_.options().address);
    reaper_ = std::thread([this] {
      const auto period = std::max(std::chrono::milliseconds(10),
                                   std::min(std::chrono::milliseconds(1000), service_.options().limits.idle_timeout / 4));
      std::unique_lock lock(mutex_);
      while (!stopping_) {
        stop_.wait_for(lock, period);
        service_.free_idle();
      }
    });
  }
  VerifierServer(const VerifierServer&) = delete;
  VerifierServer& operator=(const VerifierServer&) = delete;
  ~VerifierServer() { shutdown(); }

  [[nodiscard]] int port() const noexcept { return port_; }
  [[nodiscard]] int64_t sessions() const { return service_.sessions(); }

  // Stops accepting requests, cancels those in flight and stops the reaper. Idempotent.
  void shutdown() {
    {
      const std::lock_guard lock(mutex_);
      if (stopping_) return;
      stopping_ = true;
    }
    stop_.notify_all();
    if (reaper_.joinable()) reaper_.join();
    server_->Shutdown(std::chrono::system_clock::now());
  }

  // Blocks until shutdown().
  void wait() { server_->Wait(); }

 private:
  static ServerOptions check(ServerOptions options) {
    if (!is_loopback(options.address) && options.token.empty()) {
      throw std::invalid_argument("address " + options.address +
                                  " is not loopback: a token is required to serve on it");
    }
    const ServerLimits& l = options.limits;
    if (l.max_sessions < 1 || l.max_tokens_per_session < 2 || l.max_gamma < 0 || l.max_request_bytes < 1024 ||
        l.max_request_bytes > (int64_t{1} << 31) - 1 || l.idle_timeout.count() < 1) {
      throw std::invalid_argument("limits: max_sessions >= 1, max_tokens_per_session >= 2, max_gamma >= 0, "
                                  "max_request_bytes in [1024, 2^31), idle_timeout >= 1 ms");
    }
    return options;
  }

  VerifierService<T> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::mutex mutex_;
  std::condition_variable stop_;
  bool stopping_ = false;
  std::thread reaper_;
};

}  // namespace specdec::remote
