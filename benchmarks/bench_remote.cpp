// Remote verification on loopback with a simulated link: the bundled target behind an in-process
// specdec-verifier server, the bundled drafter in the client. For an added round-trip latency of
// 0, 5, 20 and 50 ms (RemoteOptions::added_latency: the client sleeps that long before each call,
// a simulation of the network, not a measurement of one), it compares remote autoregressive
// decoding (one round trip per token), remote speculative decoding at gamma 4 with exact
// verification, and the same with threshold verification (lossy; tau 0.25), at temperature 1.
// Counters: tokens/s, round trips per token, acceptance, the mean round trip and the server's
// forward within it.
//
// BM_RemoteClients: 1, 4 or 16 clients generating at once against one server that verifies one
// request per forward (max_batch 1) or batches the waiting ones into one forward (max_batch 16),
// remote autoregressive (no drafts: the server does all the work) and speculative at gamma 4.
// Counters: all clients' tokens per second of wall time, and verifications per target forward.
#include <benchmark/benchmark.h>

#include <memory>
#include <string>
#include <thread>
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

constexpr int kMaxClients = 16;

// One drafter per client thread (a model's forward is not shared between threads).
std::vector<std::unique_ptr<Model>>& drafters() {
  static std::vector<std::unique_ptr<Model>> all = [] {
    std::vector<std::unique_ptr<Model>> made;
    for (int c = 0; c < kMaxClients; ++c) made.push_back(std::make_unique<Model>(load("drafter")));
    return made;
  }();
  return all;
}

void BM_RemoteClients(benchmark::State& state) {
  const auto mode = static_cast<Mode>(state.range(0));
  const auto clients = static_cast<int>(state.range(1));
  const int64_t max_batch = state.range(2);
  Setup& s = setup();
  auto& own_drafters = drafters();
  remote::VerifierServer<Model> server{s.target, {.address = "127.0.0.1:0", .limits = {.max_batch = max_batch}}};
  const std::string address = "127.0.0.1:" + std::to_string(server.port());
  const MultinomialProcessor processor(1.0);
  int64_t generated = 0;
  double seconds = 0;
  uint64_t seed = 0;
  for (auto _ : state) {
    std::vector<std::thread> threads;
    std::vector<int64_t> counts(static_cast<size_t>(clients), 0);
    double elapsed = 0;
    {
      specdec::detail::ScopedTimer timer(elapsed);
      for (int c = 0; c < clients; ++c) {
        threads.emplace_back([&, c, run_seed = seed + static_cast<uint64_t>(c)] {
          remote::RemoteVerifier verifier(address);
          const std::string text = "def handler_" + std::to_string(c) + "(request):\n    ";
          const std::vector<int64_t> prompt(text.begin(), text.end());
          const SpeculativeOptions options{.max_new_tokens = kNewTokens, .seed = run_seed, .gamma = 4};
          if (mode == kAutoregressive) {
            NoDrafts none;
            counts[static_cast<size_t>(c)] = remote::remote_generate(none, verifier, prompt, options, processor).stats.generated;
          } else {
            ModelDraftSource drafts(*own_drafters[static_cast<size_t>(c)]);
            counts[static_cast<size_t>(c)] = remote::remote_generate(drafts, verifier, prompt, options, processor).stats.generated;
          }
        });
      }
      for (auto& thread : threads) thread.join();
    }
    seed += static_cast<uint64_t>(clients);
    for (const int64_t count : counts) generated += count;
    seconds += elapsed;
  }
  const remote::ServerStats stats = server.stats();
  state.counters["tokens_per_s"] = seconds > 0 ? static_cast<double>(generated) / seconds : 0.0;
  state.counters["verifications_per_forward"] =
      stats.forwards > 0 ? static_cast<double>(stats.verifications) / static_cast<double>(stats.forwards) : 0.0;
  state.counters["largest_batch"] = static_cast<double>(stats.largest_batch);
  state.SetLabel(mode == kAutoregressive ? "autoregressive" : "speculative");
}
BENCHMARK(BM_RemoteClients)
    ->ArgsProduct({{kAutoregressive, kExact}, {1, 4, kMaxClients}, {1, 16}})
    ->ArgNames({"mode", "clients", "max_batch"})
    ->Unit(benchmark::kMillisecond)
    ->Iterations(2)
    ->UseRealTime();

}  // namespace

int main(int argc, char** argv) { return specdec::bench::run_benchmarks(argc, argv); }
