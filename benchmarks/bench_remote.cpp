// Remote verification on loopback with a simulated link: the bundled target behind an in-process
// specdec-verifier server, the bundled drafter in the client. For an added round-trip latency of
// 0, 5, 20 and 50 ms (RemoteOptions::added_latency: the client sleeps that long before each call,
// a simulation of the network, not a measurement of one), it compares remote autoregressive
// decoding (one round trip per token), remote speculative decoding at gamma 4 with exact
// verification, and the same with threshold verification (lossy; tau 0.25), at temperature 1.
// Counters: tokens/s, round trips per token, acceptance, the mean round trip and the server's
// forward within it.
#include <benchmark/benchmark.h>

#include <string>
#include <vector>

#include "bench_support.hpp"
#include "specdec/io/checkpoint.hpp"
#include "specdec/models/llama.hpp"
#include "specdec/remote/client.hpp"
#include "specdec/remote/server.hpp"
#include "specdec/specdec.hpp"

namespace {

using namespace specdec;
using Model = models::LlamaModel<StaticKVCache>;
constexpr int64_t kNewTokens = 64;

Model load(const char* which) {
  const auto checkpoint = io::load_llama(std::string(SPECDEC_BUNDLED_MODELS_DIR) + "/" + which, bench::on_device());
  return Model(checkpoint.config, checkpoint.weights);
}

struct Setup {
  Model target = load("target");
  Model drafter = load("drafter");
  remote::VerifierServer<Model> server{target, {.address = "127.0.0.1:0"}};
};

Setup& setup() {
  static Setup s;
  return s;
}

enum Mode : int64_t { kAutoregressive = 0, kExact = 1, kThreshold = 2 };

void BM_Remote(benchmark::State& state) {
  const auto mode = static_cast<Mode>(state.range(0));
  const int64_t latency_ms = state.range(1);
  Setup& s = setup();
  remote::RemoteVerifier verifier("127.0.0.1:" + std::to_string(s.server.port()),
                                  {.added_latency = std::chrono::milliseconds(latency_ms)});
  const std::string text = "def parse(line):\n    \"\"\"Split a line into fields.\"\"\"\n    ";
  const std::vector<int64_t> prompt(text.begin(), text.end());
  const MultinomialProcessor processor(1.0);
  GenerationStats total;
  uint64_t seed = 0;
  for (auto _ : state) {
    SpeculativeOptions options{.max_new_tokens = kNewTokens, .seed = seed++, .gamma = 4};
    if (mode == kThreshold) options.verification = Verification::threshold, options.threshold = 0.25;
    GenerationResult result;
    if (mode == kAutoregressive) {
      NoDrafts none;
      result = remote::remote_generate(none, verifier, prompt, options, processor);
    } else {
      ModelDraftSource drafts(s.drafter);
      result = remote::remote_generate(drafts, verifier, prompt, options, processor);
    }
    total += result.stats;
  }
  const auto per = [](double a, double b) { return b > 0 ? a / b : 0.0; };
  state.counters["tokens_per_s"] = per(static_cast<double>(total.generated), total.total_seconds);
  state.counters["round_trips_per_token"] = per(static_cast<double>(total.target_calls), static_cast<double>(total.generated));
  state.counters["acceptance"] = total.acceptance_rate();
  state.counters["rtt_ms"] = per(total.rtt_seconds * 1e3, static_cast<double>(total.target_calls));
  state.counters["server_forward_ms"] = per(total.prefill_seconds * 1e3, static_cast<double>(total.target_calls));
  state.SetLabel(mode == kAutoregressive ? "autoregressive" : mode == kExact ? "speculative" : "threshold");
}
BENCHMARK(BM_Remote)
    ->ArgsProduct({{kAutoregressive, kExact, kThreshold}, {0, 5, 20, 50}})
    ->ArgNames({"mode", "latency_ms"})
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);

}  // namespace

int main(int argc, char** argv) { return specdec::bench::run_benchmarks(argc, argv); }
