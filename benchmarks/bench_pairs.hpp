// The target/drafter pairs that bench_heads and bench_trees run, each with its heads and prompts:
//   bundled: the bundled pair on held-out Python (needs /usr/lib/python3.11), its EAGLE-3 and
//            Medusa heads and parallel drafter (models/bundled);
//   stories: stories260K and llama2xs from SPECDEC_MODELS_DIR, four story openings, the heads and
//            the parallel drafter in models/stories260K.
// stories also has eight more openings for benchmarks whose figures need more steps than four
// prompts give (bench_trees measures on all twelve). Each pair has calibration prompts, disjoint
// from the measured ones, for benchmarks that choose options before they measure (eight other
// openings; the held-out lines halfway between the measured ones).
// Loaded once per process; `missing` says why a pair is absent.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "bench_support.hpp"
#include "story_openings.hpp"
#include "specdec/io/checkpoint.hpp"
#include "specdec/io/eagle.hpp"
#include "specdec/io/medusa.hpp"
#include "specdec/io/parallel_drafter.hpp"
#include "specdec/io/tokenizer.hpp"
#include "specdec/text/prompts.hpp"
#include "text/python_corpus.hpp"

namespace specdec::bench {

using PairModel = models::LlamaModel<StaticKVCache>;

struct Setup {
  std::optional<PairModel> target, drafter;
  std::optional<models::EagleHead> eagle;
  std::optional<models::MedusaHeads> medusa;
  std::optional<PairModel> pard;  // a parallel drafter (models/<pair>/pard), its mask token below
  int64_t pard_mask = -1;
  std::vector<std::vector<int64_t>> prompts;
  std::vector<std::vector<int64_t>> more_prompts;  // further measured prompts (bench_trees)
  std::vector<std::vector<int64_t>> calibration;   // other prompts, for choosing options
  std::string missing;
};

inline PairModel load_pair_model(const std::filesystem::path& path) {
  const auto checkpoint = io::load_llama(path, on_device());
  return PairModel(checkpoint.config, checkpoint.weights);
}

inline void load_heads(Setup& s, const std::filesystem::path& folder) {
  if (std::filesystem::exists(folder / "eagle3")) {
    s.eagle.emplace(io::load_eagle(folder / "eagle3", io::EagleTarget::of(*s.target), on_device()));
  }
  if (std::filesystem::exists(folder / "pard")) {
    const io::ParallelDrafterCheckpoint pard = io::load_parallel_drafter(folder / "pard", on_device());
    s.pard.emplace(pard.config, pard.weights);
    s.pard_mask = pard.mask_token;
  }
  if (std::filesystem::exists(folder / "medusa")) {
    s.medusa.emplace(io::load_medusa(folder / "medusa", s.target->hidden_size(),
                                     s.target->vocab_size(), on_device()));
  }
}

inline Setup& bundled() {
  static Setup setup = [] {
    Setup s;
    if (!std::filesystem::exists("/usr/lib/python3.11")) {
      s.missing = "the held-out text needs /usr/lib/python3.11 (Debian's libpython3.11-stdlib)";
      return s;
    }
    const std::filesystem::path models = SPECDEC_BUNDLED_MODELS_DIR;
    s.target.emplace(load_pair_model(models / "target"));
    s.drafter.emplace(load_pair_model(models / "drafter"));
    load_heads(s, models);
    const auto corpus = text::load_python_corpus("/usr/lib/python3.11");
    const io::ByteTokenizer bytes;
    for (const auto& prompt : text::line_prompts(corpus.held_out, 8, 200))
      s.prompts.push_back(bytes.encode(prompt));
    // Halfway between the measured prompts.
    const auto between = text::line_prompts(corpus.held_out, 16, 200);
    for (size_t i = 1; i < between.size(); i += 2)
      s.calibration.push_back(bytes.encode(between[i]));
    return s;
  }();
  return setup;
}

inline Setup& stories() {
  static Setup setup = [] {
    Setup s;
    const char* folder = std::getenv("SPECDEC_MODELS_DIR");
    const std::filesystem::path models = folder ? folder : "";
    if (!folder || !std::filesystem::exists(models / "stories260K/stories260K.bin")) {
      s.missing = "set SPECDEC_MODELS_DIR to ../shared/models";
      return s;
    }
    s.target.emplace(load_pair_model(models / "stories260K/stories260K.bin"));
    s.drafter.emplace(load_pair_model(models / "llama2xs/model.bin"));
    load_heads(s, std::filesystem::path(SPECDEC_BUNDLED_MODELS_DIR).parent_path() / "stories260K");
    const auto tokenizer = io::Llama2cTokenizer::load(models / "stories260K/tok512.bin", 512);
    for (const char* text : kStoryOpenings) s.prompts.push_back(tokenizer.encode(text));
    for (const char* text :
         {"The cat sat on the mat", "Jack found a big box", "It was a rainy day",
          "Mia and her dad baked a cake", "A small bunny lived in the woods",
          "The boy wanted a new toy", "Sara had a pretty doll", "One morning, the bird sang"}) {
      s.more_prompts.push_back(tokenizer.encode(text));
    }
    for (const char* text :
         {"Lily wanted to play outside", "There was a big red ball", "Ben saw a little bird",
          "Once there was a happy cat", "Sam and his mom went to the store", "The sun was shining",
          "A boy named Tim had a toy car", "Anna liked to draw"}) {
      s.calibration.push_back(tokenizer.encode(text));
    }
    return s;
  }();
  return setup;
}

}  // namespace specdec::bench
