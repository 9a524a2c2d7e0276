// specdec-generate --verifier: the edge half of remote verification (the drafter here, the
// target behind a specdec-verifier server).
#pragma once

#include "text.hpp"

#ifdef SPECDEC_HAVE_REMOTE
namespace {

// --verifier: the drafter (and the tokenizer of its folder) here, the target on the server.
int run_remote(const Arguments& a) {
  const ThreadSettings threads = set_threads(a.threads);
  const io::LlamaCheckpoint checkpoint = io::load_llama(a.drafter, at::kFloat, {.max_sequence_length = a.max_seq_len});
  Model drafter(checkpoint.config, checkpoint.weights);
  Arguments text_arguments = a;
  text_arguments.target = a.drafter;  // a tokenizer.json beside the drafter
  const Text text(text_arguments, drafter.vocab_size());
  const Request request = encode_request(a, text);
  const std::vector<int64_t>& prompt = request.prompt;
  const std::vector<std::vector<int64_t>>& stops = request.stops;
  const std::vector<int64_t>& eos = request.eos;
  // The file's first line, else $SPECDEC_VERIFIER_TOKEN, read and checked by parse() as the
  // server reads its own.
  const std::string& token = a.verifier_token;
  const auto pem = [](const std::string& file, const char* flag) { return file.empty() ? std::string() : remote::read_pem(file, flag); };
  remote::RemoteVerifier verifier(
      a.verifier, {.token = token,
                   .added_latency = std::chrono::microseconds(static_cast<int64_t>(a.added_latency_ms * 1000)),
                   .half_precision_q = a.half_q,
                   .tls = {.certificate_chain = pem(a.verifier_tls_cert, "--verifier-tls-cert"),
                           .private_key = pem(a.verifier_tls_key, "--verifier-tls-key"),
                           .trusted_ca = pem(a.verifier_tls_ca, "--verifier-tls-ca")}});
  const Processor processor = make_processor(a);
  SpeculativeOptions options = make_speculative_options(a, eos, stops);
  int64_t previous = prompt.back();
  options.on_step = [&](const StepInfo& step) {
    if (a.json) return;
    for (const int64_t t : step.emitted) std::cout << text.piece(previous, t), previous = t;
    if (a.trace) {
      std::cout << std::fixed << std::setprecision(2) << "[k=" << step.drafts.size() << " accepted=" << step.accepted
                << " rtt_ms=" << step.rtt_seconds * 1e3 << " prefill_ms=" << step.prefill_seconds * 1e3 << "]"
                << std::defaultfloat;
    }
    std::cout << std::flush;
  };
  if (!a.json) {
    std::cout << "verifier: " << a.verifier << "\ndrafter:  " << a.drafter << " (" << drafter.config()
              << "; threads: " << threads << ")\n";
    std::visit([&](const auto& p) { std::cout << "mode: " << a.mode << " (remote), " << p << ", gamma " << a.gamma; }, processor);
    std::cout << "\n\n" << a.prompt << std::flush;
  }
  GenerationResult result;
  try {
    // The wire names the processor, so the remote path takes each one as itself.
    const remote::AnyProcessor chosen = std::visit(
        [](const auto& p) -> remote::AnyProcessor {
          if constexpr (std::is_same_v<std::decay_t<decltype(p)>, SampledProcessor>) {
            return std::visit([](const auto& sampled) -> remote::AnyProcessor { return sampled; }, p.choice());
          } else {
            return p;
          }
        },
        processor);
    result = std::visit(
        [&](const auto& p) {
          if (a.mode == "autoregressive") {
            NoDrafts none;
            return remote::remote_generate(none, verifier, prompt, options, p);
          }
          ModelDraftSource drafts(drafter);
          return remote::remote_generate(drafts, verifier, prompt, options, p);
        },
        chosen);
  } catch (const remote::RemoteError& e) {
    std::cout << std::endl;
    std::cerr << "specdec-generate: " << e.what() << "\nspecdec-generate: " << e.partial().tokens.size()
              << " tokens were generated before the failure: " << text.decode(prompt.back(), e.partial().tokens) << "\n";
    return 1;
  }
  const GenerationStats& s = result.stats;
  if (a.json) {
    std::ostringstream reason;
    reason << result.stop_reason;
    nlohmann::json stats = stats_json(s);
    stats["rtt_seconds"] = s.rtt_seconds;
    stats["prefill_seconds"] = s.prefill_seconds;
    std::cout << nlohmann::json{{"mode", a.mode}, {"verifier", a.verifier}, {"gamma", a.gamma},
                                {"text", text.decode(prompt.back(), result.tokens)},
                                {"stop_reason", reason.str()}, {"stats", stats}}.dump(2) << "\n";
    return 0;
  }
  std::cout << std::fixed << std::setprecision(2) << "\n\n"
            << s.generated << " tokens in " << s.total_seconds << " s: " << s.generated / s.total_seconds
            << " tokens/s; " << s.target_calls << " round trips (" << s.tokens_per_target_call()
            << " tokens each, " << (s.target_calls > 0 ? s.rtt_seconds * 1e3 / static_cast<double>(s.target_calls) : 0.0)
            << " ms each, of which the server's forward " << (s.target_calls > 0 ? s.prefill_seconds * 1e3 / static_cast<double>(s.target_calls) : 0.0)
            << " ms), stopped by " << result.stop_reason;
  if (a.mode != "autoregressive") {
    std::cout << ", " << s.drafter_calls << " drafter calls, acceptance rate " << s.acceptance_rate();
  }
  std::cout << "\n";
  return 0;
}

}  // namespace
#endif
