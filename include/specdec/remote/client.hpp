// The edge side of remote verification: a local draft source (a drafter model, n-grams) against
// a specdec-verifier that holds the target.
//
//   specdec::remote::RemoteVerifier verifier("127.0.0.1:50051", {.token = "..."});
//   specdec::ModelDraftSource drafts(drafter);
//   auto result = specdec::remote::remote_generate(drafts, verifier, prompt, {.max_new_tokens = 64, .gamma = 4});
//
// Each step drafts locally, sends the drafts and what verification needs of the drafter's
// distributions q, and appends what the server accepted plus its token (one round trip per step;
// autoregressive remote decoding is the same with NoDrafts). What q costs on the wire: nothing
// under greedy decoding or threshold verification; the nonzero entries per row with top-k or
// nucleus processors (exact); every entry otherwise, as float32 (exact) or, with
// RemoteOptions::half_precision_q, as float16 (half the bytes; verification then uses the rounded
// q, which biases the output by at most the rounding, about 2^-11 relative).
//
// Greedy output equals local autoregressive decoding of the target token for token; sampled
// output is distributed exactly as the target's, and reproducible for a given seed (the server
// samples each step with a generator seeded from the client's seed and the step's index).
// StepInfo::rtt_seconds and prefill_seconds give each step's round trip and the server's forward
// within it, GenerationStats their totals.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/detail/generation_state.hpp"
#include "specdec/device.hpp"
#include "specdec/draft_source.hpp"
#include "specdec/options.hpp"
#include "specdec/remote/protocol.hpp"
#include "specdec/remote/token.hpp"
#include "specdec/result.hpp"
#include "specdec/step.hpp"

namespace specdec::remote {

struct RemoteOptions {
  std::string token{};                          // the server's shared secret, if it has one
  std::chrono::milliseconds timeout{30000};     // deadline of each call
  std::chrono::microseconds added_latency{0};   // a simulation of a slower link: sleeps this long
                                                // before each call (benchmarks, not deployments)
  bool half_precision_q = false;                // send dense q rows as float16 (see above)
  // TLS: trusted_ca (the CAs that sign the server's certificate) connects over TLS; with
  // certificate_chain and private_key the client also presents its own certificate (servers that
  // require client certificates). Empty: plaintext.
  TlsOptions tls{};
  std::string tls_server_name{};                // the name the server's certificate must carry,
                                                // when not the address's host
};

// A call that failed: the server's status code and message. From remote_generate, it carries the
// tokens generated before the failure (partial().tokens), which stay valid output.
class RemoteError : public std::runtime_error {
 public:
  RemoteError(grpc::StatusCode code, const std::string& message)
      : std::runtime_error(message), code_(code) {}
  [[nodiscard]] grpc::StatusCode code() const noexcept { return code_; }
  [[nodiscard]] const GenerationResult& partial() const noexcept { return partial_; }
  void set_partial(GenerationResult partial) { partial_ = std::move(partial); }

 private:
  grpc::StatusCode code_;
  GenerationResult partial_;
};

// A connection to a verification server. The calls are thread-safe (gRPC channels are); each
// generation has its own session.
class RemoteVerifier {
 public:
  struct Opened {
    std::string session{};
    std::string secret{};  // presented with every Verify and Close of the session
    int64_t vocab_size = 0;
    int64_t max_sequence_length = 0;
    int64_t max_gamma = 0;
  };

  explicit RemoteVerifier(const std::string& address, RemoteOptions options = {})
      : address_(address), options_(std::move(options)) {
    if (options_.timeout.count() <= 0) throw std::invalid_argument("timeout must be positive");
    if (options_.added_latency.count() < 0) throw std::invalid_argument("added_latency must be >= 0");
    check_token(options_.token, "RemoteOptions::token");  // gRPC would abort on a byte metadata cannot carry
    const TlsOptions& tls = options_.tls;
    if (tls.enabled() && tls.trusted_ca.empty()) {
      throw std::invalid_argument("tls: trusted_ca (the CA of the server's certificate) is required for TLS");
    }
    if (tls.certificate_chain.empty() != tls.private_key.empty()) {
      throw std::invalid_argument("tls: a client certificate needs both certificate_chain and private_key");
    }
    grpc::ChannelArguments arguments;
    arguments.SetMaxReceiveMessageSize(64 << 20);
    if (!options_.tls_server_name.empty()) arguments.SetSslTargetNameOverride(options_.tls_server_name);
    const auto credentials =
        tls.enabled() ? grpc::SslCredentials({.pem_root_certs = tls.trusted_ca,
                                              .pem_private_key = tls.private_key,
                                              .pem_cert_chain = tls.certificate_chain})
                      : grpc::InsecureChannelCredentials();
    stub_ = wire::Verifier::NewStub(grpc::CreateCustomChannel(address, credentials, arguments));
  }

  [[nodiscard]] const std::string& address() const noexcept { return address_; }
  [[nodiscard]] const RemoteOptions& options() const noexcept { return options_; }

  Opened open(const wire::OpenRequest& request) {
    wire::OpenReply reply;
    call("Open", [&](grpc::ClientContext* context) { return stub_->Open(context, request, &reply); });
    return {reply.session(), reply.secret(), reply.vocab_size(), reply.max_sequence_length(), reply.max_gamma()};
  }

  wire::VerifyReply verify(const wire::VerifyRequest& request) {
    wire::VerifyReply reply;
    call("Verify", [&](grpc::ClientContext* context) { return stub_->Verify(context, request, &reply); });
    return reply;
  }

  void close(const Opened& session) {
    wire::CloseRequest request;
    request.set_session(session.session);
    request.set_secret(session.secret);
    wire::CloseReply reply;
    call("Close", [&](grpc::ClientContext* context) { return stub_->Close(context, request, &reply); });
  }

 private:
  template <class F>
  void call(const char* what, F&& f) {
    if (options_.added_latency.count() > 0) std::this_thread::sleep_for(options_.added_latency);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + options_.timeout);
    if (!options_.token.empty()) context.AddMetadata(std::string(kAuthorization), std::string(kBearer) + options_.token);
    const grpc::Status status = f(&context);
    if (!status.ok()) {
      throw RemoteError(status.error_code(), std::string("verifier ") + address_ + ": " + what + " failed (" +
                                                 code_name(status.error_code()) + "): " + status.error_message());
    }
  }

  static const char* code_name(grpc::StatusCode code) {
    switch (code) {
      case grpc::StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
      case grpc::StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
      case grpc::StatusCode::NOT_FOUND: return "NOT_FOUND";
      case grpc::StatusCode::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
      case grpc::StatusCode::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
      case grpc::StatusCode::UNAUTHENTICATED: return "UNAUTHENTICATED";
      case grpc::StatusCode::UNAVAILABLE: return "UNAVAILABLE";
      case grpc::StatusCode::INTERNAL: return "INTERNAL";
      case grpc::StatusCode::CANCELLED: return "CANCELLED";
      default: return "error";
    }
  }

  std::string address_;
  RemoteOptions options_;
  std::unique_ptr<wire::Verifier::Stub> stub_;
};

// Speculative decoding with drafts from `source` verified remotely: the loop of
// speculative_generate with the target's forward and verification on the server. Options and
// processors as speculative_generate (max_new_tokens, eos_token_ids, stop_sequences, seed, gamma
// and the draft-length policies, first_target, verification and threshold, on_step); use_cache
// and skip_sample_adjustment do not apply (the server always caches and is exact).
// Throws std::invalid_argument for bad input, RemoteError when a call fails (with the tokens
// generated so far in partial()).
template <class S, LogitsProcessor P = GreedyProcessor>
  requires DraftSource<S, P>
GenerationResult remote_generate(S& source, RemoteVerifier& verifier, std::span<const int64_t> prompt,
                                 const SpeculativeOptions& options = {}, const P& processor = {}) {
  if (options.skip_sample_adjustment) throw std::invalid_argument("skip_sample_adjustment does not apply to remote_generate");
  const bool threshold = options.verification == Verification::threshold;
  const uint64_t seed = options.seed ? *options.seed : specdec::detail::random_seed();
  wire::OpenRequest open;
  *open.mutable_sampling() = describe(processor);
  open.set_seed(seed);
  open.set_threshold(threshold);
  open.set_tau(options.threshold);
  open.mutable_prompt()->Add(prompt.begin(), prompt.end());
  const c10::InferenceMode inference;
  std::vector<int64_t> sequence(prompt.begin(), prompt.end());
  if (sequence.empty()) throw std::invalid_argument("prompt must not be empty");
  const RemoteVerifier::Opened session = verifier.open(open);
  try {
    specdec::detail::check_source(source, session.vocab_size, options);
    specdec::detail::check_common(options, prompt, session.vocab_size, session.max_sequence_length);
  } catch (...) {
    try {
      verifier.close(session);
    } catch (const RemoteError&) {
      // freed at the idle timeout
    }
    throw;
  }
  specdec::detail::GenerationState state(sequence, options, session.max_sequence_length);
  GenerationStats& stats = state.stats();
  if constexpr (HasStartHook<S>) {
    specdec::detail::ScopedTimer timer(stats.drafter_seconds);
    source.start(std::span<const int64_t>(sequence), options);
  }
  at::Generator gen = specdec::detail::make_generator(seed, at::kCPU);
  const wire::DraftProbs::Encoding encoding = encoding_for<P>(threshold, verifier.options().half_precision_q);
  bool first = true;
  try {
    while (!state.finished()) {
      const int64_t position = state.length();
      const int64_t room = std::min({state.room() - 1, specdec::detail::source_room(source, position), session.max_gamma});
      Drafts drafts;
      if (!(first && options.first_target) && room > 0) {
        specdec::detail::ScopedTimer timer(stats.drafter_seconds);
        drafts = source.draft(DraftRequest{.sequence = state.sequence(), .gamma = std::min(options.gamma, room),
                                           .room = room, .device = at::kCPU},
                              processor, gen);
      }
      first = false;
      stats.drafter_calls += drafts.calls;
      const int64_t k = drafts.size();
      if (k > room) specdec::detail::throw_invalid_message("the draft source proposed ", k, " drafts, more than room = ", room);
      wire::VerifyRequest request;
      request.set_session(session.session);
      request.set_secret(session.secret);
      request.set_length(position);
      request.set_last_token(sequence.back());
      std::vector<int64_t> draft_tokens;
      if (k > 0) {
        // The drafts and, for deterministic ones, whether their logits were finite: one host copy.
        const at::Tensor tokens = drafts.tokens.to(at::kLong).view({k});
        const at::Tensor host = specdec::detail::to_host(
            drafts.finite.defined() ? at::cat({tokens, drafts.finite.to(tokens.device(), at::kLong).view({1})}) : tokens);
        if (drafts.finite.defined() && host.data_ptr<int64_t>()[k] == 0) {
          specdec::detail::throw_non_finite("remote_generate", "drafter");
        }
        draft_tokens.assign(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + k);
        request.mutable_drafts()->Add(draft_tokens.begin(), draft_tokens.end());
        if (drafts.probs.defined()) {
          encode_q(drafts.probs, encoding, request.mutable_q());
        } else if (encoding != wire::DraftProbs::NONE) {  // deterministic drafts: q one-hot at each
          wire::DraftProbs* q = request.mutable_q();
          q->set_encoding(wire::DraftProbs::SPARSE);
          for (const int64_t t : draft_tokens) q->add_row_lengths(1), q->add_indices(static_cast<int32_t>(t)), q->add_values(1.0f);
        }
      }
      const auto sent = std::chrono::steady_clock::now();
      const wire::VerifyReply reply = verifier.verify(request);
      const double rtt = std::chrono::duration<double>(std::chrono::steady_clock::now() - sent).count();
      if (reply.accepted() < 0 || reply.accepted() > k || reply.token() < 0 || reply.token() >= session.vocab_size) {
        throw RemoteError(grpc::StatusCode::INTERNAL, "verifier " + verifier.address() + " replied accepted = " +
                                                          std::to_string(reply.accepted()) + ", token = " +
                                                          std::to_string(reply.token()) + " to " + std::to_string(k) + " drafts");
      }
      ++stats.target_calls;
      stats.target_seconds += reply.prefill_seconds();
      stats.target_positions += k + 1;
      state.emit({.drafts = draft_tokens, .accepted = reply.accepted(), .token = reply.token(),
                  .gamma = drafts.gamma.value_or(-1), .entropy = drafts.entropy, .rtt_seconds = rtt,
                  .prefill_seconds = reply.prefill_seconds()},
                 [&] {
                   specdec::detail::ScopedTimer timer(stats.drafter_seconds);
                   source.verified(VerifiedDrafts{.sequence = state.sequence(), .position = position,
                                                  .drafted = k, .accepted = reply.accepted()});
                 });
    }
  } catch (RemoteError& error) {
    error.set_partial(std::move(state).finish());
    throw;
  }
  if constexpr (HasFinishHook<S>) {
    source.finish(std::span<const int64_t>(sequence));
  }
  GenerationResult result = std::move(state).finish();
  try {
    verifier.close(session);
  } catch (const RemoteError&) {
    // the session is freed at the idle timeout anyway; the output stands
  }
  return result;
}

}  // namespace specdec::remote
