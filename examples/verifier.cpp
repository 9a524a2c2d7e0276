// specdec-verifier: serves a target model for remote verification (include/specdec/remote).
//
//   specdec-verifier --target models/bundled/target                  # 127.0.0.1:50051
//   SPECDEC_VERIFIER_TOKEN=... specdec-verifier --target DIR --address 0.0.0.0:50051
//   specdec-verifier --address 0.0.0.0:50051 --tls-cert server.pem --tls-key server.key --tls-client-ca ca.pem
//   specdec-verifier --target DIR --tp 2                              # the target split over 2 processes
//
// Clients: specdec-generate --verifier HOST:PORT, or remote_generate in your own program. It prints
// "listening on HOST:PORT" once it serves and stops cleanly on SIGINT or SIGTERM.
//
// Tensor parallelism (--tp N, or --rank/--world-size/--master; support/parallel.hpp): rank 0 serves
// gRPC and hands every round of its model's work to the other ranks, which run it with their
// shards (remote::follow_verifier) and end when rank 0 stops. When the group fails (a rank gone,
// a collective timed out), rank 0 answers the calls in flight with UNAVAILABLE naming it and exits
// with status 2.
#include <grpcpp/version_info.h>
#include <specdec/io/checkpoint.hpp>
#include <specdec/models/llama.hpp>
#include <specdec/remote/server.hpp>
#include <specdec/threads.hpp>

#include <csignal>
#include <ctime>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>

#include "support/cli.hpp"
#include "support/parallel.hpp"

#ifndef SPECDEC_BUNDLED_MODELS_DIR
#define SPECDEC_BUNDLED_MODELS_DIR "models/bundled"
#endif

namespace {

using Model = specdec::models::LlamaModel<specdec::StaticKVCache>;

}  // namespace

int main(int argc, char** argv) {
  specdec::examples::Parallel::command_line().assign(argv, argv + argc);
  try {
    std::string target = SPECDEC_BUNDLED_MODELS_DIR "/target";
    std::string token_file;
    specdec::remote::ServerOptions options;
    int threads = 1;
    int64_t idle_seconds = 60;
    CLI::App app("Serves a target model for remote speculative decoding.", "specdec-verifier");
    app.add_option("--target", target, "llama2.c file or Hugging Face folder (default: the bundled target)");
    app.add_option("--address", options.address,
                   "host:port to listen on (default 127.0.0.1:50051; port 0 picks one; any non-loopback "
                   "address needs a token)");
    app.add_option("--token-file", token_file, "the shared secret, first line (default: $SPECDEC_VERIFIER_TOKEN)");
    std::string tls_cert, tls_key, tls_client_ca;
    app.add_option("--tls-cert", tls_cert, "serve over TLS with this certificate chain (PEM; with --tls-key)");
    app.add_option("--tls-key", tls_key, "the private key of --tls-cert (PEM)");
    app.add_option("--tls-client-ca", tls_client_ca,
                   "require every client to present a certificate signed by a CA in this PEM file (with --tls-cert; "
                   "stands in for the token on a non-loopback address)");
    app.add_option("--max-sessions", options.limits.max_sessions, "open sessions at once (default 64)")
        ->check(cli::integer<int64_t>(1, 1 << 20));
    app.add_option("--max-sessions-per-client", options.limits.max_sessions_per_client,
                   "sessions one client (its TLS certificate where one is required, else its connection) may hold (default 16)")
        ->check(cli::integer<int64_t>(1, 1 << 20));
    app.add_option("--max-concurrent-requests", options.limits.max_concurrent_requests,
                   "requests served at once once their message has arrived; more are refused (default 64)")
        ->check(cli::integer<int64_t>(1, 65536));
    app.add_option("--max-reading-calls", options.limits.max_reading_calls,
                   "authenticated calls whose message has not arrived yet, at most (fair between clients; default 256)")
        ->check(cli::integer<int64_t>(1, 1 << 20));
    app.add_option("--max-resets-per-connection", options.limits.max_resets_per_connection,
                   "streams a plaintext connection may reset in a burst before it is closed (default 64)")
        ->check(cli::integer<int64_t>(1, 1 << 20));
    app.add_option("--resets-per-second", options.limits.resets_per_second,
                   "how fast that budget refills (default 16)")
        ->check(cli::integer<int64_t>(0, 1 << 20));
    app.add_option("--max-resets-per-host", options.limits.max_resets_per_host,
                   "streams all plaintext connections of one host (IPv4 address, IPv6 /64) may reset in a burst; "
                   "while spent, the host's resetting connections are closed and its new ones refused (default 256)")
        ->check(cli::integer<int64_t>(1, 1 << 20));
    app.add_option("--host-resets-per-second", options.limits.host_resets_per_second,
                   "how fast a host's budget refills (default 64)")
        ->check(cli::integer<int64_t>(0, 1 << 20));
    app.add_option("--max-streams-per-connection", options.limits.max_streams_per_connection,
                   "HTTP/2 streams one connection may have open (default 16)")
        ->check(cli::integer<int64_t>(1, 1 << 20));
    int64_t memory_mib = options.limits.max_memory_bytes >> 20;
    app.add_option("--max-memory-mib", memory_mib,
                   "memory for requests in flight, MiB: a quarter gRPC's buffers, the rest charged by requests before "
                   "they are parsed (default 1024)")
        ->check(cli::integer<int64_t>(4, int64_t{1} << 30));
    int64_t read_timeout_ms = options.limits.read_timeout.count();
    app.add_option("--read-timeout-ms", read_timeout_ms,
                   "milliseconds a request's message (and a TLS handshake) may take to arrive (default 10000)")
        ->check(cli::integer<int64_t>(1, (int64_t{1} << 31) - 1));
    int64_t connection_idle_seconds = options.limits.connection_idle_timeout.count() / 1000;
    app.add_option("--connection-idle-timeout", connection_idle_seconds,
                   "seconds before a connection without calls is closed (default 300)")
        ->check(cli::integer<int64_t>(1, 2000000));
    app.add_option("--max-tokens", options.limits.max_tokens_per_session,
                   "tokens per session (default 65536, and the target's context)")
        ->check(cli::integer<int64_t>(2, int64_t{1} << 40));
    app.add_option("--max-gamma", options.limits.max_gamma, "drafts per request (default 64)")
        ->check(cli::integer<int64_t>(0, 4096));
    app.add_option("--max-request-bytes", options.limits.max_request_bytes, "bytes per request (default 64 MiB)")
        ->check(cli::integer<int64_t>(1024, (int64_t{1} << 31) - 1));
    app.add_option("--idle-timeout", idle_seconds, "seconds before an unused session is freed (default 60)")
        ->check(cli::integer<int64_t>(1, int64_t{1} << 30));
    app.add_option("--max-batch", options.limits.max_batch,
                   "verifications batched into one target forward (default 16; 1 verifies one at a time)")
        ->check(cli::integer<int64_t>(1, 4096));
    int64_t batch_delay_us = 0;
    app.add_option("--batch-delay-us", batch_delay_us,
                   "microseconds a forward waits for more verifications to batch (default 0: none)")
        ->check(cli::integer<int64_t>(0, 1000000));
    app.add_option("--threads", threads, "CPU threads of libtorch and BLAS (default 1)")->check(cli::integer<int>(1, 1024));
    specdec::examples::TensorParallelFlags parallel_flags;
    parallel_flags.add_to(app);
    cli::parse_or_help(app, argc, argv);
    parallel_flags.check();
    options.limits.idle_timeout = std::chrono::seconds(idle_seconds);
    options.limits.max_memory_bytes = memory_mib << 20;
    options.limits.read_timeout = std::chrono::milliseconds(read_timeout_ms);
    options.limits.connection_idle_timeout = std::chrono::seconds(connection_idle_seconds);
    options.limits.batch_delay = std::chrono::microseconds(batch_delay_us);
    options.token = specdec::remote::read_token(token_file, "--token-file");  // the file, else $SPECDEC_VERIFIER_TOKEN
    const auto pem = [](const std::string& file, const char* flag) {
      return file.empty() ? std::string() : specdec::remote::read_pem(file, flag);
    };
    options.tls = {.certificate_chain = pem(tls_cert, "--tls-cert"),
                   .private_key = pem(tls_key, "--tls-key"),
                   .trusted_ca = pem(tls_client_ca, "--tls-client-ca")};
    specdec::remote::check_tls_key(options.tls, "--tls-cert " + tls_cert, "--tls-key " + tls_key);

    // On rank 0, SIGINT and SIGTERM are taken by sigwait below, in this thread only (blocked
    // before any thread starts). The other ranks end when rank 0 stops, or by SIGTERM; those that
    // --tp started ignore SIGINT, which a terminal sends them beside rank 0, so that rank 0 can
    // stop them in order.
    sigset_t signals;
    sigemptyset(&signals);
    sigaddset(&signals, SIGINT);
    sigaddset(&signals, SIGTERM);
    if (!parallel_flags.follower()) {
      pthread_sigmask(SIG_BLOCK, &signals, nullptr);
    } else if (!parallel_flags.rendezvous_file.empty()) {
      std::signal(SIGINT, SIG_IGN);
    }

    (void)specdec::set_threads(threads);
    const specdec::io::LlamaCheckpoint checkpoint =
        specdec::io::load_llama(target, at::kFloat, {}, parallel_flags.shard());
    specdec::examples::Parallel parallel("specdec-verifier");
    parallel.start(parallel_flags, checkpoint.config, /*nccl=*/false);
    const auto& group = parallel.group();
    Model model = group ? Model(checkpoint.config, checkpoint.weights, group) : Model(checkpoint.config, checkpoint.weights);
    if (parallel_flags.follower()) {
      specdec::remote::follow_verifier(model, group);  // until rank 0 stops, or the group fails
      return 0;
    }
    options.group = group;
    options.heartbeat = std::chrono::milliseconds(std::max<int64_t>(1, parallel_flags.timeout_ms / 4));
    specdec::remote::VerifierServer<Model> server(model, options);
    const std::string host = options.address.substr(0, options.address.rfind(':'));
    std::cout << "listening on " << host << ":" << server.port() << " (target " << target << ", "
              << (options.token.empty() ? "no token" : "token required") << ", "
              << (!options.tls.enabled()           ? "plaintext"
                  : options.tls.trusted_ca.empty() ? "TLS"
                                                   : "TLS with client certificates")
              << (group ? ", split over " + std::to_string(group->world_size()) + " ranks" : std::string()) << ")"
              << std::endl;
    if (options.tls.enabled() && options.tls.trusted_ca.empty()) {
      // gRPC terminates TLS itself, so the front end cannot read the frames (docs/remote.md).
      std::cerr << "specdec-verifier: note: over TLS without --tls-client-ca, a client without the token can flood "
                   "the server with reset streams, which gRPC "
                << GRPC_CPP_VERSION_STRING
                << " does not bound; require client certificates, or serve plaintext on loopback behind a TLS "
                   "terminator"
                << std::endl;
    }
    int signal = 0;
    const timespec tick{.tv_sec = 0, .tv_nsec = 100'000'000};  // how often a split server looks at its group
    while ((signal = sigtimedwait(&signals, nullptr, &tick)) <= 0) {
      if (const std::optional<std::string> failure = server.failure()) {
        server.shutdown();
        throw std::runtime_error("the tensor-parallel group failed, the server stops: " + *failure);
      }
    }
    server.shutdown();
    const specdec::remote::ServerStats stats = server.stats();
    std::cout << "stopping (signal " << signal << "): " << stats.verifications << " verifications in "
              << stats.forwards << " target forwards, largest batch " << stats.largest_batch << "; refused "
              << stats.unauthenticated << " calls without the token, closed " << stats.sessions_evicted
              << " sessions for fair admission and " << server.front_end().closed_for_resets
              << " connections past their reset budget, refusing " << server.front_end().refused_for_resets
              << " more from hosts past theirs" << std::endl;
    return 0;
  } catch (const CLI::ParseError& e) {
    std::cerr << "specdec-verifier: " << e.what() << " (see --help)\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "specdec-verifier" << specdec::examples::Parallel::label() << ": " << e.what() << "\n";
    return 2;
  }
}
