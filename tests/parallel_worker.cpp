// One rank of the tensor-parallel tests (test_parallel.cpp starts N of these as processes): a
// random-weight Llama split over --world-size ranks meeting at --file, generating with one mode
// on fixed prompts, and writing what it emitted to --out, one line of tokens per generation.
// --world-size 1 is the whole model in one process, the reference. The output file appears
// whole or not at all (written beside, then renamed).
//
// Modes: autoregressive, speculative (a perturbed copy of the target drafts), ngram (prompt
// lookup), stand, batch (speculative, four rows at once), sampled (--samples speculative
// generations of two tokens, seeds 0, 1, ...), sampled-autoregressive (--samples generations of
// eight tokens, seeds --seed-offset + 0, 1, ...; with --seed-per-rank each rank's seeds are
// offset by 1000 * rank more), distribution (rank 0 writes the target's next-token probabilities at the
// sampled prompt, one per line), die (speculative, greedy; rank world_size - 1 ends its process
// after --die-at-step steps of the second prompt). --model-per-rank gives each rank the weights
// of another seed (a mismatched checkpoint). --device cuda runs on cuda:0; --nccl joins an NCCL
// group even at world size 1 (one GPU cannot hold two NCCL ranks), and exits with status 77,
// printing why, where this build has no NCCL or the machine no GPU.
#include <CLI/CLI.hpp>

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "specdec/batch.hpp"
#include "specdec/distributed.hpp"
#include "specdec/drafting/stand.hpp"
#include "specdec/generate.hpp"
#include "specdec/models/llama.hpp"
#include "specdec/ngram_storage.hpp"
#include "support/llama_fixtures.hpp"

namespace {

using namespace specdec;
using Model = models::LlamaModel<>;

// Four query heads and two key/value heads per rank at world size 2, two and one at 4.
models::LlamaConfig parallel_config() {
  return models::LlamaConfig{.dim = 64, .hidden_dim = 128, .n_layers = 2, .n_heads = 8,
                             .n_kv_heads = 4, .vocab_size = 64, .max_seq_len = 160};
}

std::vector<std::vector<int64_t>> prompts() {
  return {{1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3},
          {9, 10, 11, 9, 10, 11, 12},
          {40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 40, 41},
          {5, 17, 33, 60, 2}};
}

struct Arguments {
  int64_t rank = 0, world_size = 1, samples = 0, die_at_step = 3, timeout_ms = 20000, seed_offset = 0;
  std::string file, out, mode;
  bool seed_per_rank = false, model_per_rank = false, nccl = false;
  std::string device = "cpu";
};

constexpr int kSkipped = 77;

void write_whole(const std::string& path, const std::string& text) {
  const std::string partial = path + ".partial";
  {
    std::ofstream out(partial, std::ios::trunc);
    out << text;
    if (!out.flush()) throw std::runtime_error("cannot write " + partial);
  }
  std::filesystem::rename(partial, path);
}

std::string line(const std::vector<int64_t>& tokens) {
  std::string text;
  for (const int64_t token : tokens) text += std::to_string(token) + " ";
  return text + "\n";
}

int run(const Arguments& a) {
  if (a.nccl || a.device == "cuda") {
#ifndef SPECDEC_HAVE_NCCL
    if (a.nccl) {
      std::cerr << "skipped: this build of specdec has no NCCL (a libtorch with CUDA and nccl.h)\n";
      return kSkipped;
    }
#endif
    if (!at::hasCUDA()) {
      std::cerr << "skipped: no CUDA device\n";
      return kSkipped;
    }
  }
  const models::LlamaConfig config = parallel_config();
  const at::Device device = a.device == "cuda" ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  const models::LlamaWeights weights = models::LlamaWeights::random(
      config, a.model_per_rank ? 1 + static_cast<uint64_t>(a.rank) : 1, at::TensorOptions(at::kFloat).device(device));
  std::shared_ptr<Collectives> group;
  std::optional<SharedDecisions> decisions;
  if (a.world_size > 1 || a.nccl) {
    check_tensor_parallel(config, a.world_size);  // before the rendezvous: nothing to wait for
    group = connect(Rendezvous{.rank = a.rank, .world_size = a.world_size, .file = a.file,
                               .timeout = std::chrono::milliseconds(a.timeout_ms),
                               .backend = a.nccl ? Rendezvous::Backend::nccl : Rendezvous::Backend::gloo});
    decisions.emplace(*group);
  }
  Model target = group ? Model(config, models::llama_shard(config, weights, a.rank, a.world_size), group)
                       : Model(config, weights);
  // The drafter is replicated: every rank holds it whole.
  Model drafter(config, test::perturbed(weights, 0.05, 2));
  const std::vector<std::vector<int64_t>> all = prompts();
  std::string text;
  const SpeculativeOptions greedy{.max_new_tokens = 40, .gamma = 4};
  if (a.mode == "autoregressive") {
    for (const auto& prompt : all) text += line(autoregressive_generate(target, prompt, {.max_new_tokens = 40}).tokens);
  } else if (a.mode == "speculative") {
    for (const auto& prompt : all) text += line(speculative_generate(drafter, target, prompt, greedy).tokens);
  } else if (a.mode == "ngram") {
    for (const auto& prompt : all) {
      PromptLookupDrafter lookup;
      text += line(ngram_assisted_generate(lookup, target, prompt, {.max_new_tokens = 40, .gamma = 4}).tokens);
    }
  } else if (a.mode == "stand") {
    for (const auto& prompt : all) {
      ProbabilisticNGramStorage memory(config.vocab_size, 2);
      text += line(stand_generate(memory, target, prompt, {.max_new_tokens = 40}).tokens);
    }
  } else if (a.mode == "batch") {
    for (const GenerationResult& row : speculative_generate_batch(drafter, target, std::span(all), greedy)) {
      text += line(row.tokens);
    }
  } else if (a.mode == "sampled") {
    for (int64_t s = 0; s < a.samples; ++s) {
      const SpeculativeOptions sampled{.max_new_tokens = 2, .seed = static_cast<uint64_t>(s), .gamma = 3,
                                       .first_target = false};
      text += line(speculative_generate(drafter, target, all[1], sampled, MultinomialProcessor{}).tokens);
    }
  } else if (a.mode == "sampled-autoregressive") {
    for (int64_t s = 0; s < a.samples; ++s) {
      const uint64_t seed = static_cast<uint64_t>(a.seed_offset + s + (a.seed_per_rank ? 1000 * a.rank : 0));
      const GenerationOptions sampled{.max_new_tokens = 8, .seed = seed};
      text += line(autoregressive_generate(target, all[1], sampled, MultinomialProcessor{}).tokens);
    }
  } else if (a.mode == "distribution") {
    auto cache = target.make_cache(1);
    const at::Tensor ids = at::tensor(all[1], at::kLong).view({1, -1});
    const at::Tensor p = target.forward(ids, cache)[0][-1].to(at::kDouble).softmax(-1);
    for (int64_t v = 0; v < p.size(0); ++v) text += std::to_string(p[v].item<double>()) + "\n";
  } else if (a.mode == "die") {
    text += line(speculative_generate(drafter, target, all[0], greedy).tokens);
    SpeculativeOptions dying = greedy;
    dying.on_step = [&](const StepInfo& step) {
      if (a.rank == a.world_size - 1 && step.step + 1 >= a.die_at_step) {
        std::cerr << "rank " << a.rank << ": ending its process after " << step.step + 1 << " steps\n";
        _exit(3);
      }
      return StepAction::proceed;
    };
    text += line(speculative_generate(drafter, target, all[1], dying).tokens);
  } else {
    throw std::invalid_argument("--mode " + a.mode + " is not a mode");
  }
  write_whole(a.out, text);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Arguments a;
  CLI::App app("One rank of the tensor-parallel tests");
  app.add_option("--rank", a.rank)->required();
  app.add_option("--world-size", a.world_size)->required();
  app.add_option("--file", a.file, "the rendezvous file");
  app.add_option("--out", a.out)->required();
  app.add_option("--mode", a.mode)->required();
  app.add_option("--samples", a.samples);
  app.add_option("--die-at-step", a.die_at_step);
  app.add_option("--timeout-ms", a.timeout_ms);
  app.add_option("--seed-offset", a.seed_offset);
  app.add_flag("--seed-per-rank", a.seed_per_rank);
  app.add_flag("--model-per-rank", a.model_per_rank);
  app.add_option("--device", a.device)->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_flag("--nccl", a.nccl);
  CLI11_PARSE(app, argc, argv);
  try {
    at::set_num_threads(1);
    return run(a);
  } catch (const std::exception& e) {
    std::cerr << "specdec_parallel_worker rank " << a.rank << ": " << e.what() << "\n";
    return 1;
  }
}
