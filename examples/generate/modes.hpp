// specdec-generate's modes beside plain generation: beam search, STAND, calibration of
// threshold verification, and a file of prompts generated as one batch.
#pragma once

#include "text.hpp"

namespace {

// The largest --dev-file or --batch-file read.
constexpr size_t kMaxPromptFileBytes = size_t{64} << 20;

// Beam search prints its n-best list when it is done (hypotheses are not final before).
// --mode suffix: the cache of responses from --storage, else a new one of --suffix-depth and
// --suffix-cache-mib.
SuffixCache load_suffix_cache(const Arguments& a, int64_t vocab) {
  if (!a.storage.empty()) return SuffixCache::load(a.storage, vocab);
  return SuffixCache(vocab, {.max_depth = a.suffix_rule.max_depth, .max_bytes = a.suffix_cache_mib << 20});
}

int run_beam(const Arguments& a, Model& target, const Text& text, const std::vector<int64_t>& prompt,
             const std::vector<int64_t>& eos) {
  const BeamSearchResult result = beam_search_generate(
      target, prompt, {.max_new_tokens = a.max_new_tokens, .eos_token_ids = eos, .num_beams = a.num_beams,
                       .top_k = a.num_beams, .alpha = a.length_penalty});
  const auto decode = [&](const std::vector<int64_t>& tokens) { return text.decode(prompt.back(), tokens); };
  const GenerationStats& s = result.stats;
  if (a.json) {
    nlohmann::json hypotheses = nlohmann::json::array();
    for (const auto& h : result.n_best) {
      hypotheses.push_back({{"text", decode(h.tokens)}, {"score", h.score}, {"log_probability", h.log_probability},
                            {"finished", h.finished}});
    }
    std::cout << nlohmann::json{{"mode", "beam"}, {"num_beams", a.num_beams}, {"n_best", hypotheses},
                                {"stats", stats_json(s)}, {"tokens_scored", result.tokens_scored}}.dump(2) << "\n";
    return 0;
  }
  std::cout << "beam search, " << a.num_beams << " beams, length penalty " << a.length_penalty << "\n\n"
            << a.prompt << decode(result.tokens) << "\n\n";
  for (size_t i = 0; i < result.n_best.size(); ++i) {
    std::cout << "#" << i + 1 << " score " << result.n_best[i].score << (result.n_best[i].finished ? "" : " (length limit)")
              << ": " << decode(result.n_best[i].tokens).substr(0, 60) << "\n";
  }
  std::cout << std::fixed << std::setprecision(2) << "\n" << s.target_calls << " target calls, "
            << result.tokens_scored << " tokens scored in " << s.total_seconds << " s\n";
  return 0;
}

// --mode stand: N trajectories of the prompt, one after another, sharing one memory; each is
// printed when done, with its tokens per target call (which grow as the memory learns).
int run_stand(const Arguments& a, Model& target, const Text& text, const std::vector<int64_t>& prompt,
              const std::vector<int64_t>& eos, const Processor& processor) {
  ProbabilisticNGramStorage memory = a.storage.empty() ? ProbabilisticNGramStorage(target.vocab_size(), 3)
                                                       : ProbabilisticNGramStorage::load(a.storage);
  if (memory.vocab_size() != target.vocab_size()) {
    throw std::invalid_argument("--storage was built for vocabulary " + std::to_string(memory.vocab_size()) +
                                ", the target has " + std::to_string(target.vocab_size()));
  }
  const StandOptions options{.max_new_tokens = a.max_new_tokens, .eos_token_ids = eos, .seed = a.seed,
                             .tree = TreeTemplate::default_tree(a.tree_nodes.value_or(64)),
                             .stochastic = !a.deterministic};
  const auto decode = [&](const std::vector<int64_t>& tokens) { return text.decode(prompt.back(), tokens); };
  nlohmann::json runs = nlohmann::json::array();
  GenerationStats stand_total, baseline_total;
  bool identical = true;
  if (!a.json) {
    std::cout << "mode: stand, " << a.trajectories << " trajectories, " << options.tree
              << (a.deterministic ? ", deterministic drafting" : ", Gumbel drafting") << "\n";
  }
  const auto autoregressive = [&](uint64_t seed) {
    return std::visit([&](const auto& p) {
      return autoregressive_generate(target, prompt, {.max_new_tokens = a.max_new_tokens, .eos_token_ids = eos,
                                                      .seed = seed}, p);
    }, processor);
  };
  if (a.compare) {
    // A fair comparison: both warmed up untimed (STAND on a copy, so that the memory learns only
    // from the timed trajectories), then each trajectory beside an autoregressive run, in
    // alternating order; nothing streams while timed.
    ProbabilisticNGramStorage scratch = memory;
    (void)std::visit([&](const auto& p) { return stand_generate(scratch, target, prompt, options, p); }, processor);
    (void)autoregressive(a.seed);
  }
  for (int64_t i = 0; i < a.trajectories; ++i) {
    StandOptions run = options;
    run.seed = a.seed + static_cast<uint64_t>(i);
    std::optional<GenerationResult> baseline;
    if (a.compare && i % 2 == 1) baseline = autoregressive(*run.seed);
    const GenerationResult result =
        std::visit([&](const auto& p) { return stand_generate(memory, target, prompt, run, p); }, processor);
    if (a.compare && i % 2 == 0) baseline = autoregressive(*run.seed);
    stand_total += result.stats;
    if (baseline) {
      baseline_total += baseline->stats;
      identical = identical && baseline->tokens == result.tokens;
    }
    const GenerationStats& s = result.stats;
    if (a.json) {
      runs.push_back({{"text", decode(result.tokens)}, {"stats", stats_json(s)}});
      continue;
    }
    std::cout << std::fixed << std::setprecision(2) << "\n--- trajectory " << i + 1 << ": " << s.generated
              << " tokens, " << s.tokens_per_target_call() << " tokens per target call, "
              << s.generated / s.total_seconds << " tokens/s\n"
              << std::defaultfloat << a.prompt << decode(result.tokens) << "\n";
  }
  if (!a.save_storage.empty()) memory.save(a.save_storage);
  if (a.json) {
    nlohmann::json out{{"mode", "stand"}, {"trajectories", runs}, {"stats", stats_json(stand_total)},
                       {"memory_contexts", memory.size()}, {"memory_bytes", memory.memory_bytes()}};
    if (a.compare) {
      out["autoregressive"] = stats_json(baseline_total);
      out["speedup"] = baseline_total.total_seconds / stand_total.total_seconds;
      out["identical_to_autoregressive"] = identical;
    }
    std::cout << out.dump(2) << "\n";
    return 0;
  }
  std::cout << std::fixed << std::setprecision(2) << "\nall trajectories: " << stand_total.generated << " tokens in "
            << stand_total.total_seconds << " s: " << stand_total.generated / stand_total.total_seconds
            << " tokens/s; " << stand_total.tokens_per_target_call() << " tokens per target call; memory "
            << memory.size() << " contexts, " << memory.memory_bytes() / 1024 << " KiB\n";
  if (a.compare) {
    std::cout << "autoregressive: " << baseline_total.generated / baseline_total.total_seconds << " tokens/s; speedup "
              << baseline_total.total_seconds / stand_total.total_seconds
              << "x; output identical: " << (identical ? "yes" : "no") << "\n"
              << "(all trajectories against as many autoregressive runs, alternated, after one untimed warm-up run "
                 "of each)\n";
  }
  return 0;
}

// --calibrate: the threshold grid on the dev prompts, printed as a table (or kept for --json).
CalibrationResult calibrate(const Arguments& a, Model& drafter, Model& target, const Text& text,
                            const std::vector<int64_t>& prompt, const SpeculativeOptions& options,
                            const Processor& processor) {
  std::vector<std::vector<int64_t>> dev{prompt};
  if (!a.dev_file.empty()) {
    const std::string read = io::read_regular_file(a.dev_file, "--dev-file", kMaxPromptFileBytes);
    if (read.size() > kMaxPromptFileBytes) throw std::invalid_argument("--dev-file " + a.dev_file + " is larger than 64 MiB");
    const std::vector<uint8_t> bytes(read.begin(), read.end());
    dev.clear();
    for (const auto& window : text::line_prompts(bytes, 8, 256)) dev.push_back(text.encode(window));
    if (dev.empty()) throw std::invalid_argument("--dev-file: " + a.dev_file + " is too short for 256-byte prompts");
  }
  SpeculativeOptions quiet = options;
  quiet.on_step = nullptr;
  const CalibrationResult result = std::visit(
      [&](const auto& p) {
        return calibrate_threshold(drafter, target, dev, quiet,
                                   {.thresholds = a.thresholds, .target_acceptance = a.target_acceptance}, p);
      },
      processor);
  if (!a.json) {
    std::cout << "calibration on " << dev.size() << " dev prompt(s), target acceptance " << a.target_acceptance
              << "\n  threshold  acceptance  tokens/call  seconds\n" << std::fixed;
    for (const CalibrationPoint& point : result.points) {
      std::cout << std::setprecision(2) << "  " << std::setw(9) << point.threshold << std::setprecision(3)
                << std::setw(12) << point.acceptance_rate() << std::setw(13) << point.tokens_per_target_call()
                << std::setw(9) << point.seconds() << (point.threshold == result.best_threshold ? "  <- chosen" : "")
                << "\n";
    }
    std::cout << std::defaultfloat << "\n";
  }
  return result;
}

// --batch-file: every line of the file is a prompt; all rows generate together as one batch.
// Heads (--mode eagle, medusa) draft with a source per row.
int run_batch_file(const Arguments& a, Model& target, Model* drafter, const models::EagleHead* eagle,
                   const models::MedusaHeads* medusa, const Text& text, const std::vector<int64_t>& eos,
                   const std::vector<std::vector<int64_t>>& stops, const Processor& processor) {
  const std::string read = io::read_regular_file(a.batch_file, "--batch-file", kMaxPromptFileBytes);
  if (read.size() > kMaxPromptFileBytes) throw std::invalid_argument("--batch-file " + a.batch_file + " is larger than 64 MiB");
  std::istringstream in(read);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) {
    // "\n" (backslash, n) in a line stands for a newline of the prompt.
    std::string prompt;
    prompt.reserve(line.size());
    for (size_t i = 0; i < line.size(); ++i) {
      const bool escape = line[i] == '\\' && i + 1 < line.size() && line[i + 1] == 'n';
      prompt.push_back(escape ? '\n' : line[i]);
      if (escape) ++i;
    }
    lines.push_back(std::move(prompt));
  }
  if (lines.empty()) throw std::invalid_argument("--batch-file: " + a.batch_file + " holds no prompt");
  std::vector<std::vector<int64_t>> prompts;
  for (const auto& line : lines) prompts.push_back(text.encode(line));
  std::optional<NGramStorage> storage;
  if (a.mode == "ngram") storage.emplace(a.ngram_order, target.vocab_size());
  std::optional<SuffixCache> cache;
  if (a.mode == "suffix") cache.emplace(load_suffix_cache(a, target.vocab_size()));
  const auto start = std::chrono::steady_clock::now();
  const std::vector<GenerationResult> results = std::visit(
      [&](const auto& p) {
        if (storage) {
          return ngram_assisted_generate_batch(*storage, target, prompts,
                                               {.max_new_tokens = a.max_new_tokens, .eos_token_ids = eos,
                                                .stop_sequences = stops, .seed = a.seed, .gamma = a.gamma,
                                                .filler_top_k = 1, .draft_rule = a.draft_rule},
                                               p);
        }
        const SpeculativeOptions options{.max_new_tokens = a.max_new_tokens, .eos_token_ids = eos,
                                         .stop_sequences = stops, .seed = a.seed, .gamma = a.gamma};
        if (drafter != nullptr) return speculative_generate_batch(*drafter, target, prompts, options, p);
        if (cache) {  // one source per row, all drafting from (and adding their responses to) one cache
          std::vector<SuffixDraftSource> sources;
          for (size_t r = 0; r < prompts.size(); ++r) sources.emplace_back(*cache, a.suffix_rule);
          return generate_with_batch(std::span(sources), target, prompts, options, p);
        }
        // Heads draft for every row in one forward per draft position.
        if (eagle != nullptr) return eagle_generate_batch(*eagle, target, prompts, options, p);
        if (medusa != nullptr) return medusa_generate_batch(*medusa, target, prompts, options, p);
        return autoregressive_generate_batch(target, prompts,
                                             {.max_new_tokens = a.max_new_tokens, .eos_token_ids = eos,
                                              .stop_sequences = stops, .seed = a.seed},
                                             p);
      },
      processor);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (cache && !a.save_storage.empty()) cache->save(a.save_storage);
  // --compare: every row against its own autoregressive decoding, one prompt at a time.
  std::optional<bool> identical;
  if (a.compare) {
    identical = true;
    for (size_t r = 0; r < prompts.size(); ++r) {
      const auto alone = std::visit([&](const auto& p) {
        return autoregressive_generate(target, prompts[r], {.max_new_tokens = a.max_new_tokens, .eos_token_ids = eos,
                                                            .stop_sequences = stops, .seed = a.seed}, p);
      }, processor);
      identical = *identical && alone.tokens == results[r].tokens;
    }
  }
  int64_t generated = 0;
  nlohmann::json rows = nlohmann::json::array();
  for (size_t r = 0; r < results.size(); ++r) {
    const GenerationResult& result = results[r];
    generated += result.stats.generated;
    std::ostringstream reason;
    reason << result.stop_reason;
    const std::string continuation = text.decode(prompts[r].back(), result.tokens);
    if (a.json) {
      rows.push_back({{"prompt", lines[r]}, {"text", continuation}, {"stop_reason", reason.str()},
                      {"stats", stats_json(result.stats)}});
      continue;
    }
    std::cout << "--- row " << r << ": " << result.stats.generated << " tokens, stopped by " << reason.str();
    if (a.mode != "autoregressive") {
      std::cout << ", acceptance rate " << std::fixed << std::setprecision(2) << result.stats.acceptance_rate()
                << std::defaultfloat;
    }
    std::cout << ", " << result.stats.target_calls << " target calls\n" << lines[r] << continuation << "\n";
  }
  if (a.json) {
    nlohmann::json out{{"mode", a.mode}, {"batch", results.size()}, {"rows", rows},
                       {"seconds", seconds}, {"tokens_per_second", generated / seconds}};
    if (identical) out["rows_identical_to_autoregressive"] = *identical;
    std::cout << out.dump(2) << "\n";
    return 0;
  }
  std::cout << std::fixed << std::setprecision(2) << "\nbatch of " << results.size() << ": " << generated
            << " tokens in " << seconds << " s: " << generated / seconds << " tokens/s\n";
  if (identical) std::cout << "rows identical to autoregressive: " << (*identical ? "yes" : "no") << "\n";
  return 0;
}

}  // namespace
