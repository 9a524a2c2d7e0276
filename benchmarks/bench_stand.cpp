// STAND against the model-free baselines on stories260K (SPECDEC_MODELS_DIR), for N trajectories
// of one prompt ("Once upon a time", 128 new tokens each), greedy and at temperature 1, in one
// run: autoregressive decoding, NASD (one back-off trigram storage shared by the trajectories),
// prompt lookup (each trajectory alone), and STAND with Gumbel or deterministic drafting, on the
// default 64-node template or on a 32-node template learned from a 780-node one on other prompts.
// Every method starts each benchmark iteration with an empty memory.
//
// Counters: tokens_per_second, tokens_per_target_call, acceptance_length (accepted drafts per
// target call), speedup (against autoregressive decoding of the same trajectories, run just
// before in each iteration), target_ms_per_call and library_ms_per_step (time outside the
// target's forwards).
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>

#include "bench_support.hpp"
#include "specdec/io/checkpoint.hpp"
#include "specdec/io/tokenizer.hpp"

namespace {

using namespace specdec;
using Model = models::LlamaModel<StaticKVCache>;
constexpr int64_t kNewTokens = 128;

struct Stories {
  std::optional<Model> target;
  std::vector<int64_t> prompt;
  std::vector<std::vector<int64_t>> other_prompts;  // for learning the template
  std::string missing;
};

Stories& stories() {
  static Stories s = [] {
    Stories p;
    const char* folder = std::getenv("SPECDEC_MODELS_DIR");
    const std::filesystem::path models = folder ? folder : "";
    if (!folder || !std::filesystem::exists(models / "stories260K/stories260K.bin")) {
      p.missing = "set SPECDEC_MODELS_DIR to ../shared/models";
      return p;
    }
    const auto checkpoint = io::load_llama(models / "stories260K/stories260K.bin", bench::on_device());
    p.target.emplace(checkpoint.config, checkpoint.weights);
    const auto tokenizer = io::Llama2cTokenizer::load(models / "stories260K/tok512.bin", 512);
    p.prompt = tokenizer.encode("Once upon a time");
    for (const char* text : {"The little dog", "Tom and Sue went to the park"}) {
      p.other_prompts.push_back(tokenizer.encode(text));
    }
    return p;
  }();
  return s;
}

enum class Method { autoregressive, nasd, prompt_lookup, stand_gumbel, stand_deterministic, stand_learned };

// 32 nodes learned from how often each node of a 780-node template (5 children per node, 4 deep)
// was accepted over 8 sampled trajectories of each of two other prompts.
const TreeTemplate& learned_template() {
  static const TreeTemplate learned = [] {
    Stories& s = stories();
    const TreeTemplate large = TreeTemplate::full(5, 4);
    std::vector<int64_t> counts;
    for (const auto& prompt : s.other_prompts) {
      ProbabilisticNGramStorage memory(s.target->vocab_size(), 3);
      (void)stand_generate_trajectories(memory, *s.target, prompt, 8,
                                        {.max_new_tokens = kNewTokens, .seed = 100, .tree = large,
                                         .node_acceptances = &counts},
                                        MultinomialProcessor{});
    }
    return large.learned(counts, 32);
  }();
  return learned;
}

template <class P>
GenerationStats run(Method method, int64_t trajectories, const P& processor) {
  Stories& s = stories();
  GenerationStats total;
  NGramStorage storage(3, s.target->vocab_size());
  ProbabilisticNGramStorage memory(s.target->vocab_size(), 3);
  StandOptions stand{.max_new_tokens = kNewTokens, .stochastic = method != Method::stand_deterministic};
  if (method == Method::stand_learned) stand.tree = learned_template();
  for (int64_t i = 0; i < trajectories; ++i) {
    const auto seed = static_cast<uint64_t>(i);
    switch (method) {
      case Method::autoregressive:
        total += autoregressive_generate(*s.target, s.prompt, {.max_new_tokens = kNewTokens, .seed = seed}, processor).stats;
        break;
      case Method::nasd:
        total += ngram_assisted_generate(storage, *s.target, s.prompt,
                                         {.max_new_tokens = kNewTokens, .seed = seed, .gamma = 5}, processor)
                     .stats;
        break;
      case Method::prompt_lookup: {
        PromptLookupDrafter lookup;
        total += ngram_assisted_generate(lookup, *s.target, s.prompt,
                                         {.max_new_tokens = kNewTokens, .seed = seed, .gamma = 5}, processor)
                     .stats;
        break;
      }
      default:
        stand.seed = seed;
        total += stand_generate(memory, *s.target, s.prompt, stand, processor).stats;
    }
  }
  return total;
}

// Each iteration runs autoregressive decoding of the same trajectories right before the method,
// so that the speedup compares runs made seconds apart (this machine's speed drifts by tens of
// percent over minutes).
template <class P>
void measure(benchmark::State& state, Method method, const P& processor) {
  Stories& s = stories();
  if (!s.target) return state.SkipWithError(s.missing.c_str());
  const int64_t trajectories = state.range(0);
  if (method == Method::stand_learned) (void)learned_template();
  GenerationStats total, baseline;
  for (auto _ : state) {
    state.PauseTiming();
    baseline += run(Method::autoregressive, trajectories, processor);
    state.ResumeTiming();
    total += run(method, trajectories, processor);
  }
  const double seconds_per_token = total.total_seconds / static_cast<double>(total.generated);
  state.counters["tokens_per_second"] = 1.0 / seconds_per_token;
  state.counters["tokens_per_target_call"] = total.tokens_per_target_call();
  state.counters["acceptance_length"] = static_cast<double>(total.accepted) / static_cast<double>(total.target_calls);
  state.counters["speedup"] = baseline.total_seconds / static_cast<double>(baseline.generated) / seconds_per_token;
  state.counters["target_ms_per_call"] = 1e3 * total.target_seconds / static_cast<double>(total.target_calls);
  state.counters["library_ms_per_step"] = 1e3 * total.library_seconds() / static_cast<double>(total.steps);
}

void BM_Greedy(benchmark::State& state, Method method) { measure(state, method, GreedyProcessor{}); }
void BM_Sampled(benchmark::State& state, Method method) { measure(state, method, MultinomialProcessor{1.0}); }

#define SPECDEC_STAND_BENCHMARKS(function)                                                             \
  BENCHMARK_CAPTURE(function, nasd, Method::nasd)->Arg(1)->Arg(4)->Arg(8)->Arg(16)                      \
      ->Unit(benchmark::kMillisecond)->Iterations(2);                                                   \
  BENCHMARK_CAPTURE(function, prompt_lookup, Method::prompt_lookup)->Arg(1)->Arg(4)->Arg(8)->Arg(16)    \
      ->Unit(benchmark::kMillisecond)->Iterations(2);                                                   \
  BENCHMARK_CAPTURE(function, stand_gumbel, Method::stand_gumbel)->Arg(1)->Arg(4)->Arg(8)->Arg(16)      \
      ->Unit(benchmark::kMillisecond)->Iterations(2);                                                   \
  BENCHMARK_CAPTURE(function, stand_deterministic, Method::stand_deterministic)                        \
      ->Arg(1)->Arg(4)->Arg(8)->Arg(16)->Unit(benchmark::kMillisecond)->Iterations(2);                  \
  BENCHMARK_CAPTURE(function, stand_learned, Method::stand_learned)->Arg(1)->Arg(4)->Arg(8)->Arg(16)    \
      ->Unit(benchmark::kMillisecond)->Iterations(2)

SPECDEC_STAND_BENCHMARKS(BM_Greedy);
SPECDEC_STAND_BENCHMARKS(BM_Sampled);

}  // namespace

int main(int argc, char** argv) { return specdec::bench::run_benchmarks(argc, argv); }
