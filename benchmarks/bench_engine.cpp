// bench_engine: continuous batching (specdec::Engine) under load, speculative against the same
// engine decoding autoregressively, in one run.
//
//   bench_engine [--threads N] [google benchmark flags]
//   SPECDEC_BENCH_TARGET=w1b.bin SPECDEC_BENCH_DRAFTER=llama2xs/model.bin bench_engine --threads 2
//
// The models: SPECDEC_BENCH_TARGET and SPECDEC_BENCH_DRAFTER (llama2.c files or Hugging Face
// folders), else the bundled pair; weights packed for the CPU forward (fp32). Prompts: the story
// openings where the target has stories260K's vocabulary (512, with SPECDEC_MODELS_DIR's
// tokenizer), else lines of Python. Requests cycle through output lengths (16, 32, 24, 48 tokens;
// a third of them on the 1B target) and three samplings: greedy, temperature 0.8 with top-p 0.95,
// temperature 1 with top-k 40 and min-p 0.05.
//
// BM_Engine/L, L = the requests kept active, with 2 L + 4 requests per run, each method in
// alternating rounds (SPECDEC_BENCH_ROUNDS, default 1; each method's best round counts), on one
// engine per method kept across the warm-up and every round, as a server keeps one (its cost model
// learns in the warm-up):
//   ar:    every request DraftMethod::none (the engine as an autoregressive batcher);
//   spec:  every request drafts with the drafter, gamma 6, the adaptive draft length;
//   fixed: gamma 4 every step (EngineOptions::adaptive_draft_length = false);
//   eagle: every request drafts with the EAGLE head, gamma 6, the adaptive draft length, where
//     the pair has one (SPECDEC_BENCH_EAGLE, a folder; default: the bundled target's eagle3).
//     Counters eagle_over_ar, eagle_tpc.
// Two workloads per method:
//   closed loop: L requests from the start, a new one as soon as one ends. Counters <m>_tps
//     (generated tokens per second) and spec_over_ar, fixed_over_ar (the ratios);
//   Poisson arrivals at 0.9 of the rate at which ar completed requests in its closed loop (so
//     ar keeps about L active): <m>_ttft_p50/p90_ms (arrival to first token), <m>_tpot_p50/p90_ms
//     (time per output token after the first), <m>_active (mean requests generating).
// Also spec_tpc (tokens per target call), spec_k (mean drafts per step), spec_ms_per_step.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench_support.hpp"
#include "story_openings.hpp"
#include "specdec/engine.hpp"
#include "specdec/io/checkpoint.hpp"
#include "specdec/io/eagle.hpp"
#include "specdec/io/tokenizer.hpp"
#include "specdec/models/llama.hpp"

namespace {

using namespace specdec;
using Model = models::LlamaModel<StaticKVCache>;
using Clock = std::chrono::steady_clock;

std::string setting(const char* name, const std::string& otherwise) {
  const char* value = std::getenv(name);
  return value == nullptr || *value == '\0' ? otherwise : std::string(value);
}

std::unique_ptr<Model> load(const std::string& path) {
  const io::LlamaCheckpoint checkpoint = io::load_llama(path);
  auto model = std::make_unique<Model>(checkpoint.config, checkpoint.weights);
  model->pack_weights(specdec::detail::WeightFormat::f32);
  return model;
}

struct Pair {
  std::unique_ptr<Model> target, drafter;
  std::optional<models::EagleHead> eagle;  // SPECDEC_BENCH_EAGLE, or the bundled target's head
  std::vector<std::vector<int64_t>> prompts;
  bool large = false;  // a target of a billion parameters: shorter outputs
};

Pair& pair() {
  static Pair p = [] {
    Pair made;
    const std::string bundled = SPECDEC_BUNDLED_MODELS_DIR;
    made.target = load(setting("SPECDEC_BENCH_TARGET", bundled + "/target"));
    made.drafter = load(setting("SPECDEC_BENCH_DRAFTER", bundled + "/drafter"));
    made.large = made.target->config().dim >= 1024;
    const std::string head = setting("SPECDEC_BENCH_EAGLE", setting("SPECDEC_BENCH_TARGET", "").empty() ? bundled + "/eagle3" : "");
    if (!head.empty()) made.eagle.emplace(io::load_eagle(head, io::EagleTarget::of(*made.target)));
    const std::filesystem::path tokenizer = setting("SPECDEC_MODELS_DIR", "") + "/stories260K/tok512.bin";
    if (made.target->vocab_size() == 512 && std::filesystem::exists(tokenizer)) {
      const auto tok = io::Llama2cTokenizer::load(tokenizer, 512);
      for (const char* text : bench::kStoryOpenings) made.prompts.push_back(tok.encode(text));
      for (const char* text : {"The cat sat on the mat", "Jack found a big box", "It was a rainy day",
                               "Mia and her dad baked a cake"}) {
        made.prompts.push_back(tok.encode(text));
      }
    } else {
      const io::ByteTokenizer bytes;
      for (const char* text : {"class Stack(object):\n    def __init__(self):\n        self.",
                               "import os\nimport sys\n\ndef main(", "    def push(self, item):\n",
                               "for i in range(10):\n    print(", "def read(path):\n    with open(",
                               "    return self.", "if __name__ == '__main__':\n", "    except ValueError:\n"}) {
        made.prompts.push_back(bytes.encode(text));
      }
    }
    return made;
  }();
  return p;
}

// Request i of a run (its drafting set by the method).
Request job(int64_t i, const Pair& p) {
  static const int64_t lengths[] = {16, 32, 24, 48};
  static const SamplingParams samplings[] = {
      {}, {.temperature = 0.8, .top_p = 0.95}, {.temperature = 1.0, .top_k = 40, .min_p = 0.05}};
  const int64_t length = lengths[i % 4];
  return Request{.prompt = p.prompts[static_cast<size_t>(i) % p.prompts.size()],
                 .max_new_tokens = p.large ? std::max<int64_t>(8, length / 3) : length,
                 .sampling = samplings[i % 3]};
}

struct Method {
  const char* name;
  DraftMethod drafting;
  int64_t gamma;
  bool adaptive;
};
constexpr Method kAllMethods[] = {{"ar", DraftMethod::none, 0, true},
                                  {"spec", DraftMethod::drafter, 6, true},
                                  {"fixed", DraftMethod::drafter, 4, false},
                                  {"eagle", DraftMethod::eagle, 6, true}};

// The methods this pair runs: eagle where it has a head.
std::vector<Method> methods() {
  std::vector<Method> result;
  for (const Method& method : kAllMethods) {
    if (method.drafting != DraftMethod::eagle || pair().eagle) result.push_back(method);
  }
  return result;
}

struct Run {
  double seconds = 0;
  int64_t tokens = 0, requests = 0, target_calls = 0, steps = 0, drafted_columns = 0;
  double active_seconds = 0;  // integral of requests generating over time
  std::vector<double> ttft, tpot;
};

double percentile(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  return values[static_cast<size_t>(q * static_cast<double>(values.size() - 1))];
}

// One run of `count` requests: closed loop at `load` when `arrivals` is empty, else each request
// joins at its arrival time (seconds from the start).
Run run(Engine<Model, Model>& engine, const Method& method, int64_t load, int64_t count,
        const std::vector<double>& arrivals) {
  Pair& p = pair();
  std::map<RequestId, double> arrived, first;
  std::map<RequestId, int64_t> tokens;
  Run result;
  const int64_t calls_before = engine.stats().target_calls;
  const auto start = Clock::now();
  const auto now = [&] { return std::chrono::duration<double>(Clock::now() - start).count(); };
  int64_t next = 0;
  const auto add = [&](double at) {
    Request request = job(next++, p);
    request.drafting = method.drafting;
    request.gamma = method.gamma;
    arrived[*engine.add(std::move(request))] = at;
  };
  if (arrivals.empty()) {
    while (next < std::min(load, count)) add(0.0);
  }
  while (next < count || !engine.idle()) {
    if (!arrivals.empty()) {
      while (next < count && arrivals[static_cast<size_t>(next)] <= now()) add(arrivals[static_cast<size_t>(next)]);
      if (engine.idle()) {
        std::this_thread::sleep_for(std::chrono::duration<double>(arrivals[static_cast<size_t>(next)] - now()));
        continue;
      }
    }
    const double before = now();
    const int64_t active = engine.generating() + engine.waiting();
    const std::vector<EngineEvent> events = engine.step();
    const double after = now();
    result.active_seconds += static_cast<double>(active) * (after - before);
    ++result.steps;
    result.drafted_columns += engine.costs().draft_length;
    for (const EngineEvent& event : events) {
      if (!event.tokens.empty() && !first.contains(event.id)) first[event.id] = after;
      tokens[event.id] += static_cast<int64_t>(event.tokens.size());
      if (!event.result) continue;
      ++result.requests;
      result.tokens += tokens[event.id];
      if (first.contains(event.id)) {
        result.ttft.push_back(first[event.id] - arrived[event.id]);
        if (tokens[event.id] > 1) result.tpot.push_back((after - first[event.id]) / static_cast<double>(tokens[event.id] - 1));
      }
      if (arrivals.empty() && next < count) add(after);
    }
  }
  result.seconds = now();
  result.target_calls = engine.stats().target_calls - calls_before;
  return result;
}

void BM_Engine(benchmark::State& state) {
  const int64_t load = state.range(0);
  const int64_t count = 2 * load + 4;
  const auto rounds = static_cast<int>(std::stoi(setting("SPECDEC_BENCH_ROUNDS", "1")));
  std::map<std::string, Run> closed, open;
  // One engine per method for the whole benchmark, as a server keeps one: the warm-up run is also
  // where its cost model first measures the steps.
  std::map<std::string, std::unique_ptr<Engine<Model, Model>>> engines;
  const std::vector<Method> chosen = methods();
  for (const Method& method : chosen) {
    const bool eagle = method.drafting == DraftMethod::eagle;
    engines[method.name] = std::make_unique<Engine<Model, Model>>(
        *pair().drafter, *pair().target,
        EngineOptions{.max_rows = std::max<int64_t>(load, 1) * 2, .seed = 1, .adaptive_draft_length = method.adaptive,
                      .eagle = eagle ? &*pair().eagle : nullptr});
  }
  for (auto _ : state) {
    for (const Method& method : chosen) static_cast<void>(run(*engines[method.name], method, load, count, {}));  // warm-up
    for (int round = 0; round < rounds; ++round) {
      for (const Method& method : chosen) {
        Run r = run(*engines[method.name], method, load, count, {});
        auto& best = closed[method.name];
        if (best.seconds == 0 || r.tokens / r.seconds > best.tokens / best.seconds) best = std::move(r);
      }
      // Poisson arrivals at 0.9 of ar's closed-loop completion rate.
      const double rate = 0.9 * static_cast<double>(closed["ar"].requests) / closed["ar"].seconds;
      std::mt19937_64 gen(static_cast<uint64_t>(7 + round));
      std::exponential_distribution<double> gap(rate);
      std::vector<double> arrivals;
      double at = 0;
      for (int64_t i = 0; i < count; ++i) arrivals.push_back(at += (i == 0 ? 0.0 : gap(gen)));
      for (const Method& method : chosen) {
        Run r = run(*engines[method.name], method, load, count, arrivals);
        auto& best = open[method.name];
        if (best.seconds == 0 || percentile(r.tpot, 0.5) < percentile(best.tpot, 0.5)) best = std::move(r);
      }
    }
  }
  for (const Method& method : chosen) {
    const std::string m = method.name;
    const Run& c = closed[m];
    const Run& o = open[m];
    state.counters[m + "_tps"] = static_cast<double>(c.tokens) / c.seconds;
    state.counters[m + "_ttft_p50_ms"] = 1e3 * percentile(o.ttft, 0.5);
    state.counters[m + "_ttft_p90_ms"] = 1e3 * percentile(o.ttft, 0.9);
    state.counters[m + "_tpot_p50_ms"] = 1e3 * percentile(o.tpot, 0.5);
    state.counters[m + "_tpot_p90_ms"] = 1e3 * percentile(o.tpot, 0.9);
    state.counters[m + "_active"] = o.active_seconds / o.seconds;
  }
  const double ar = state.counters["ar_tps"];
  state.counters["spec_over_ar"] = state.counters["spec_tps"] / ar;
  state.counters["fixed_over_ar"] = state.counters["fixed_tps"] / ar;
  if (pair().eagle) {
    state.counters["eagle_over_ar"] = state.counters["eagle_tps"] / ar;
    const Run& eagle = closed["eagle"];
    state.counters["eagle_tpc"] = static_cast<double>(eagle.tokens) / static_cast<double>(std::max<int64_t>(1, eagle.target_calls));
  }
  const Run& spec = closed["spec"];
  state.counters["spec_tpc"] = static_cast<double>(spec.tokens) / static_cast<double>(std::max<int64_t>(1, spec.target_calls));
  state.counters["spec_k"] = static_cast<double>(spec.drafted_columns) / static_cast<double>(std::max<int64_t>(1, spec.steps));
  state.counters["spec_ms_per_step"] = 1e3 * spec.seconds / static_cast<double>(std::max<int64_t>(1, spec.steps));
}
BENCHMARK(BM_Engine)->ArgName("active")->Arg(1)->Arg(2)->Arg(4)->Arg(8)->Arg(16)->Iterations(1)->Unit(benchmark::kSecond);

}  // namespace

int main(int argc, char** argv) { return specdec::bench::run_benchmarks(argc, argv); }
