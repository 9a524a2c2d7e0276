// The GPU benchmark of scripts/gpu-check.sh: autoregressive decoding against speculative decoding
// with each drafter, eager and with CUDA graphs, on the checkpoints scripts/gpu_check.py makes
// (a 1B-class random-weight Llama in bfloat16, its first layers as a self-drafter, and a small
// separate drafter). Every mode runs once to warm up, then the modes take turns for --rounds
// rounds, so that clocks and caches are shared fairly. Writes one JSON object with each mode's
// tokens per second, acceptance, tokens per target call, device-to-host copies per step, the
// drafter's and target's time per call (for the cost model) and the greedy tokens, which
// gpu_check.py compares with transformers' on the same weights. An n-gram mode (no drafter model)
// shows the copies per step of a model-free source.
//
// Usage: specdec_gpu_bench --models DIR [--device cuda] [--dtype bfloat16] [--gamma 4]
//                          [--max-new-tokens 128] [--rounds 3] --json OUT
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "specdec/io/hf_llama.hpp"
#include "specdec/models/llama.hpp"
#include "specdec/specdec.hpp"

namespace {

namespace fs = std::filesystem;
using specdec::StaticKVCache;
using Model = specdec::models::LlamaModel<StaticKVCache>;

Model load(const fs::path& folder, const at::TensorOptions& options) {
  auto checkpoint = specdec::io::load_hf_llama(folder, options);
  return Model(checkpoint.config, std::move(checkpoint.weights));
}

// One way of generating, and what its runs measured.
struct Mode {
  std::string name{};
  Model* drafter = nullptr;  // nullptr: autoregressive decoding, or n-gram drafting where ngram
  bool graph = false;
  bool ngram = false;        // drafts from a fresh n-gram storage (n = 3) taught by the target
  double seconds = 0;
  specdec::GenerationStats stats{};
  int64_t copies = 0;
  std::vector<int64_t> tokens{};
};

void synchronize(const at::Device& device) {
  // A one-element copy to the host waits for the device's queued work (not counted: it is the
  // benchmark's, not the library's).
  if (!device.is_cpu()) (void)at::zeros({1}, at::TensorOptions().device(device)).cpu();
}

specdec::GenerationResult run(Mode& mode, Model& target, const std::vector<int64_t>& prompt, int64_t new_tokens,
                              int64_t gamma) {
  if (mode.ngram) {
    specdec::NGramStorage storage(3, target.vocab_size());
    return specdec::ngram_assisted_generate(storage, target, prompt,
                                            {.max_new_tokens = new_tokens, .eos_token_ids = {}, .gamma = gamma});
  }
  if (mode.drafter == nullptr) {
    return specdec::autoregressive_generate(target, prompt, {.max_new_tokens = new_tokens, .eos_token_ids = {}});
  }
  specdec::SpeculativeOptions options{.max_new_tokens = new_tokens, .eos_token_ids = {}, .gamma = gamma};
  options.cuda_graph = mode.graph;
  return specdec::speculative_generate(*mode.drafter, target, prompt, options);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"specdec's GPU benchmark (scripts/gpu-check.sh)"};
  std::string models;
  std::string device_name = "cuda";
  std::string dtype_name = "bfloat16";
  int64_t gamma = 4;
  int64_t new_tokens = 128;
  int64_t rounds = 3;
  std::string json_path;
  app.add_option("--models", models, "folder made by gpu_check.py make (target, self_drafter, small_drafter, prompt.json)")
      ->required()->check(CLI::ExistingDirectory);
  app.add_option("--device", device_name, "cuda or cpu");
  app.add_option("--dtype", dtype_name, "bfloat16, float16 or float32")
      ->check(CLI::IsMember({"bfloat16", "float16", "float32"}));
  app.add_option("--gamma", gamma, "drafts per step")->check(CLI::Range(1, 64));
  app.add_option("--max-new-tokens", new_tokens, "tokens per generation")->check(CLI::Range(1, 4096));
  app.add_option("--rounds", rounds, "timed rounds (modes alternate within each)")->check(CLI::Range(1, 100));
  app.add_option("--json", json_path, "where to write the results")->required();
  CLI11_PARSE(app, argc, argv);

  try {
    const at::Device device(device_name);
    const std::map<std::string, at::ScalarType> dtypes{
        {"bfloat16", at::kBFloat16}, {"float16", at::kHalf}, {"float32", at::kFloat}};
    const at::TensorOptions options = at::TensorOptions(dtypes.at(dtype_name)).device(device);
    const fs::path folder(models);
    std::ifstream prompt_file(folder / "prompt.json");
    const std::vector<int64_t> prompt = nlohmann::json::parse(prompt_file).at("prompt").get<std::vector<int64_t>>();

    Model target = load(folder / "target", options);
    Model self_drafter = load(folder / "self_drafter", options);
    Model small_drafter = load(folder / "small_drafter", options);
    std::vector<Mode> modes{{.name = "autoregressive"},
                            {.name = "self_drafter_eager", .drafter = &self_drafter},
                            {.name = "self_drafter_graph", .drafter = &self_drafter, .graph = true},
                            {.name = "small_drafter_eager", .drafter = &small_drafter},
                            {.name = "small_drafter_graph", .drafter = &small_drafter, .graph = true},
                            {.name = "ngram", .ngram = true}};

    for (Mode& mode : modes) {  // warm-up: first forwards of each shape, the allocator, graph capture
      mode.tokens = run(mode, target, prompt, new_tokens, gamma).tokens;
    }
    for (int64_t round = 0; round < rounds; ++round) {
      for (Mode& mode : modes) {
        synchronize(device);
        const int64_t copies = specdec::device_to_host_copies();
        const auto start = std::chrono::steady_clock::now();
        const specdec::GenerationResult result = run(mode, target, prompt, new_tokens, gamma);
        synchronize(device);
        mode.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        mode.copies += specdec::device_to_host_copies() - copies;
        mode.stats += result.stats;
        if (result.tokens != mode.tokens) throw std::runtime_error(mode.name + ": greedy tokens changed between runs");
      }
    }

    nlohmann::json out;
    out["device"] = device.str();
    out["dtype"] = dtype_name;
    out["gamma"] = gamma;
    out["max_new_tokens"] = new_tokens;
    out["rounds"] = rounds;
    out["torch"] = specdec::torch_version();
    for (const Mode& mode : modes) {
      const auto& s = mode.stats;
      const auto per = [](double total, int64_t count) { return count > 0 ? total / static_cast<double>(count) : 0.0; };
      out["modes"][mode.name] = {
          {"tokens_per_second", static_cast<double>(s.generated) / mode.seconds},
          {"seconds", mode.seconds},
          {"generated", s.generated},
          {"steps", s.steps},
          {"graph_steps", s.graph_steps},
          {"acceptance", s.acceptance_rate()},
          {"tokens_per_target_call", s.tokens_per_target_call()},
          {"copies_per_step", per(static_cast<double>(mode.copies), s.steps)},
          {"target_ms_per_call", 1e3 * per(s.target_seconds, s.target_calls)},
          {"drafter_ms_per_call", 1e3 * per(s.drafter_seconds, s.drafter_calls)},
          {"tokens", mode.tokens},
      };
      std::cout << mode.name << ": " << s.generated << " tokens in " << mode.seconds << " s, "
                << static_cast<double>(s.generated) / mode.seconds << " tokens/s, acceptance " << s.acceptance_rate()
                << ", graph steps " << s.graph_steps << " of " << s.steps << "\n";
    }
    std::ofstream(json_path) << out.dump(2) << "\n";
  } catch (const std::exception& e) {
    std::cerr << "specdec_gpu_bench: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
