// Tensor parallelism on this machine's CPU: tokens/s of a random-weight Llama run whole in one
// process (TP 1) and split over two processes (TP 2), one thread per rank, for autoregressive and
// speculative decoding (a one-layer drafter sharing the target's first layer, replicated), and
// the share of each generation that rank 0 spends inside collectives.
//
// The program is rank 0: it starts rank 1 as a copy of itself (--rank 1, output discarded), and
// both run the same benchmarks with fixed iteration counts, so that their collectives pair up.
// TP 1 runs on rank 0 alone while rank 1 waits. Each comparison runs twice, alternated
// (round 1 and 2), after one untimed generation of each model.
//
// --size large (default): dim 1024, 8 layers, feed-forward 2816, 16 heads (8 key/value), 4096
// tokens: 110 M parameters, 440 MB in fp32, far beyond the caches, so one token's forward is
// bound by reading the weights from memory, as a large target's is on a GPU. --size small: a
// model of 0.2 M parameters, for CI's smoke run.
#include <CLI/CLI.hpp>
#include <benchmark/benchmark.h>

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <optional>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "specdec/distributed.hpp"
#include "specdec/generate.hpp"
#include "specdec/models/llama.hpp"
#include "specdec/threads.hpp"
#include "../examples/support/processes.hpp"

namespace {

using namespace specdec;
using Model = models::LlamaModel<StaticKVCache>;
using Clock = std::chrono::steady_clock;

// Collectives that add the time spent in them to a counter.
class TimedCollectives final : public Collectives {
 public:
  explicit TimedCollectives(std::shared_ptr<Collectives> inner) : inner_(std::move(inner)) {}
  [[nodiscard]] int64_t rank() const override { return inner_->rank(); }
  [[nodiscard]] int64_t world_size() const override { return inner_->world_size(); }
  void all_reduce(at::Tensor& tensor) override {
    const Clock::time_point start = Clock::now();
    inner_->all_reduce(tensor);
    seconds += std::chrono::duration<double>(Clock::now() - start).count();
  }
  void broadcast(at::Tensor& tensor, int64_t root) override {
    const Clock::time_point start = Clock::now();
    inner_->broadcast(tensor, root);
    seconds += std::chrono::duration<double>(Clock::now() - start).count();
  }
  double seconds = 0;

 private:
  std::shared_ptr<Collectives> inner_;
};

struct Setup {
  int64_t rank = 0, world_size = 2;
  std::string file, size = "large";
  std::shared_ptr<TimedCollectives> group;
  std::optional<Model> whole, shard, drafter;  // whole on rank 0 only
  std::vector<int64_t> prompt;
  int64_t new_tokens = 48;
};

Setup& setup() {
  static Setup s;
  return s;
}

models::LlamaConfig config_of(const std::string& size) {
  if (size == "small") {
    return models::LlamaConfig{.dim = 64, .hidden_dim = 128, .n_layers = 2, .n_heads = 8, .n_kv_heads = 4,
                               .vocab_size = 256, .max_seq_len = 128};
  }
  return models::LlamaConfig{.dim = 1024, .hidden_dim = 2816, .n_layers = 8, .n_heads = 16, .n_kv_heads = 8,
                             .vocab_size = 4096, .max_seq_len = 256};
}

void BM_Parallel(benchmark::State& state, bool speculative, int64_t tp) {
  Setup& s = setup();
  const bool idle = tp == 1 && s.rank != 0;  // TP 1 is rank 0's alone
  Model* target = tp == 1 ? (s.rank == 0 ? &*s.whole : nullptr) : &*s.shard;
  const SpeculativeOptions options{.max_new_tokens = s.new_tokens, .gamma = 4};
  // Rank 0's decisions are shared with the other ranks in TP 2 runs only: TP 1 runs alone.
  std::optional<SharedDecisions> decisions;
  if (tp > 1) decisions.emplace(*s.group);
  const auto generate = [&] {
    return speculative ? speculative_generate(*s.drafter, *target, s.prompt, options)
                       : autoregressive_generate(*target, s.prompt, {.max_new_tokens = s.new_tokens});
  };
  GenerationStats stats;
  double seconds = 0, collective = 0;
  for (auto _ : state) {
    if (idle) continue;
    s.group->seconds = 0;
    const Clock::time_point start = Clock::now();
    const GenerationResult result = generate();
    seconds += std::chrono::duration<double>(Clock::now() - start).count();
    collective += tp > 1 ? s.group->seconds : 0.0;
    stats = result.stats;
  }
  if (idle) return;
  const double runs = static_cast<double>(state.iterations());
  state.counters["tokens_per_s"] = static_cast<double>(stats.generated) * runs / seconds;
  state.counters["collective_share"] = collective / seconds;
  state.counters["tokens_per_target_call"] = stats.tokens_per_target_call();
  if (speculative) state.counters["acceptance"] = stats.acceptance_rate();
}

// The reporter of ranks other than 0: they run the benchmarks in step with rank 0 and report
// nothing (their standard error stays open for their errors).
class Silent : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

void start_rank(const std::vector<std::string>& command, int64_t rank, const std::string& file) {
  std::vector<std::string> args = command;
  for (const std::string& extra : {std::string("--rank"), std::to_string(rank), std::string("--file"), file}) {
    args.push_back(extra);
  }
  (void)examples::start_copy(std::move(args));
}

}  // namespace

int main(int argc, char** argv) {
  Setup& s = setup();
  const std::vector<std::string> command(argv, argv + argc);
  // This program's own flags (CLI11); the rest go to Google Benchmark.
  CLI::App app("TP 1 against TP 2; other flags are Google Benchmark's", "bench_parallel");
  app.allow_extras();
  app.add_option("--size", s.size, "large (default) or small (CI's smoke run)")->check(CLI::IsMember({"small", "large"}));
  app.add_option("--rank", s.rank, "set for the rank this program starts")->check(CLI::Range(0, 1));
  app.add_option("--file", s.file, "the rendezvous file, set for that rank");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  std::vector<std::string> extras = app.remaining();
  std::vector<char*> rest{argv[0]};
  for (std::string& extra : extras) rest.push_back(extra.data());
  int rest_count = static_cast<int>(rest.size());
  benchmark::Initialize(&rest_count, rest.data());
  try {
    (void)set_threads(1);
    std::filesystem::path folder;
    if (s.rank == 0) {
      folder = std::filesystem::temp_directory_path() / ("specdec-bench-tp-" + std::to_string(getpid()));
      std::filesystem::remove_all(folder);
      std::filesystem::create_directories(folder);
      s.file = (folder / "rendezvous").string();
      start_rank(command, 1, s.file);
    }
    s.group = std::make_shared<TimedCollectives>(connect(Rendezvous{.rank = s.rank, .world_size = s.world_size,
                                                                    .file = s.file}));
    const models::LlamaConfig config = config_of(s.size);
    const models::LlamaWeights weights = models::LlamaWeights::random(config, 1);
    s.shard.emplace(config, models::llama_shard(config, weights, s.rank, s.world_size), s.group);
    const auto [drafter_config, drafter_weights] = models::truncated(config, weights, 1);
    s.drafter.emplace(drafter_config, drafter_weights);
    if (s.rank == 0) s.whole.emplace(config, weights);
    for (int64_t t = 0; t < 16; ++t) s.prompt.push_back((37 * t + 11) % config.vocab_size);
    if (s.size == "small") s.new_tokens = 16;
    const int64_t iterations = s.size == "small" ? 1 : 2;
    // The warm-up: one generation of each model, untimed (first forwards, page faults).
    if (s.rank == 0) (void)autoregressive_generate(*s.whole, s.prompt, {.max_new_tokens = 4});
    {
      const SharedDecisions decisions(*s.group);
      (void)autoregressive_generate(*s.shard, s.prompt, {.max_new_tokens = 4});
    }
    for (const int round : {1, 2}) {
      for (const bool speculative : {false, true}) {
        for (const int64_t tp : {int64_t{1}, int64_t{2}}) {
          const std::string name = std::string("BM_Parallel/") + (speculative ? "speculative" : "autoregressive") +
                                   "/tp:" + std::to_string(tp) + "/round:" + std::to_string(round);
          benchmark::RegisterBenchmark(name.c_str(), BM_Parallel, speculative, tp)
              ->Iterations(iterations)
              ->Unit(benchmark::kMillisecond)
              ->UseRealTime();
        }
      }
    }
    if (s.rank == 0) {
      benchmark::RunSpecifiedBenchmarks();
    } else {
      Silent silent;
      benchmark::RunSpecifiedBenchmarks(&silent);
    }
    benchmark::Shutdown();
    if (s.rank == 0) {
      int status = 0;
      while (wait(&status) > 0) {
      }
      std::filesystem::remove_all(folder);
    }
  } catch (const std::exception& e) {
    std::cerr << "bench_parallel rank " << s.rank << ": " << e.what() << "\n";
    return 1;
  }
  return 0;
}
