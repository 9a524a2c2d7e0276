// specdec-generate: text in, text out, with speculative or autoregressive decoding.
//
// By default it runs the bundled pair (models/bundled: a byte-level target and a drafter trained
// on Python sources); --target/--drafter take a llama2.c checkpoint file or a Hugging Face Llama
// folder, and --tokenizer a llama2.c tokenizer file or a Hugging Face tokenizer.json (by default
// the target folder's tokenizer.json, where it has one).
//
// The program's parts: arguments.hpp (the command line), text.hpp (tokens and output), modes.hpp
// (beam search, STAND, calibration, batches), remote.hpp (the edge half of remote verification)
// and here run(), which loads the models and runs the chosen mode, and main().
#include "arguments.hpp"
#include "modes.hpp"
#include "remote.hpp"
#include "text.hpp"

namespace {

// Models whose weight products hold more bytes than this are packed by --weights auto: they
// outgrow every CPU cache, and the packed route streams them at the memory's rate.
constexpr int64_t kPackedWeightBytes = int64_t{64} << 20;

// Bytes of `model`'s weight products: every layer's q, k, v, o, gate, up and down, and the
// classifier.
int64_t product_weight_bytes(const Model& model) {
  const models::LlamaConfig& c = model.config();
  const int64_t layer = c.dim * (c.dim + 2 * c.kv_dim()) + c.dim * c.dim + 3 * c.dim * c.hidden_dim;
  return (c.n_layers * layer + c.vocab_size * c.dim) * static_cast<int64_t>(at::elementSize(model.dtype()));
}

// --weights on `model`: packs its CPU products (auto: where its weights outgrow the caches, or are
// bf16, whose CPU forward needs them packed). Returns how its products read their weights, for
// the header line ("packed bfloat16, avx512 loops, bf16 dot products"), or "" where they are not
// packed.
std::string apply_weights(const Arguments& a, Model& model) {
  if (!model.device().is_cpu() || a.weights == "unpacked") return {};
  const bool bf16 = model.dtype() == at::kBFloat16;
  if (a.weights == "auto" && (!a.batch_file.empty() || model.dtype() == at::kHalf)) return {};
  if (a.weights == "auto" && !bf16 && product_weight_bytes(model) < kPackedWeightBytes) return {};
  model.pack_weights(a.weights == "int8" ? specdec::detail::WeightFormat::i8
                     : bf16                ? specdec::detail::WeightFormat::bf16
                                           : specdec::detail::WeightFormat::f32);
  return std::string("packed ") + specdec::detail::to_string(model.weight_format()) + ", " +
         specdec::detail::packed_product_isa(model.weight_format());
}

int run(const Arguments& a) {
#ifdef SPECDEC_HAVE_REMOTE
  if (!a.verifier.empty()) return run_remote(a);
#endif
  const ThreadSettings threads = set_threads(a.threads);
  const auto weights = at::TensorOptions().dtype(parse_dtype(a.dtype)).device(parse_device(a.device));
  const io::LoadLimits limits{.max_sequence_length = a.max_seq_len};
  // Ranks other than 0 of a group started by hand print nothing (--tp discards theirs itself).
  if (a.parallel.follower() && a.parallel.rendezvous_file.empty() && std::freopen("/dev/null", "w", stdout) == nullptr) {
    throw std::runtime_error("cannot discard the standard output of rank " + std::to_string(a.parallel.rank));
  }
  // Split over ranks, each reads its own shard of the target (and refuses a model that does not
  // divide before any rank starts).
  io::LlamaCheckpoint target_checkpoint = io::load_llama(a.target, weights, limits, a.parallel.shard());
  examples::Parallel parallel("specdec-generate");
  parallel.start(a.parallel, target_checkpoint.config, a.device.rfind("cuda", 0) == 0);
  const auto& group = parallel.group();
  Model target = group ? Model(target_checkpoint.config, target_checkpoint.weights, group)
                       : Model(target_checkpoint.config, target_checkpoint.weights);
  target_checkpoint.weights = models::LlamaWeights{};  // the model holds them: packing can release them
  const std::string target_weights = apply_weights(a, target);
  const Text text(a, target.vocab_size());
  std::optional<Model> drafter;
  // The length check before encoding: a text encodes to at least min_tokens of its bytes.
  const int64_t least = text.min_tokens(static_cast<int64_t>(a.prompt.size()));
  if (least > target.max_sequence_length()) {
    throw std::invalid_argument("--prompt of " + std::to_string(a.prompt.size()) + " bytes is at least " +
                                std::to_string(least) + " tokens, more than the target's max_sequence_length " +
                                std::to_string(target.max_sequence_length()));
  }
  const Request request = encode_request(a, text);
  const std::vector<int64_t>& prompt = request.prompt;
  const std::vector<std::vector<int64_t>>& stops = request.stops;
  const std::vector<int64_t>& eos = request.eos;
  if (a.mode == "beam") return run_beam(a, target, text, prompt, eos);
  if (a.mode == "stand") return run_stand(a, target, text, prompt, eos, make_processor(a));
  // --mode eagle and medusa: heads on the target's hidden states.
  std::optional<models::EagleHead> eagle;
  std::optional<models::MedusaHeads> medusa;
  if (a.mode == "eagle") eagle.emplace(io::load_eagle(a.drafter, io::EagleTarget::of(target), weights, limits));
  if (a.mode == "medusa") medusa.emplace(io::load_medusa(a.drafter, target.hidden_size(), target.vocab_size(), weights, limits));
  if (a.mode == "speculative") {
    const io::LlamaCheckpoint drafter_checkpoint = io::load_llama(a.drafter, weights, limits);
    drafter.emplace(drafter_checkpoint.config, drafter_checkpoint.weights);
    (void)apply_weights(a, *drafter);
  }
  // --mode parallel: a drafter whose mask tokens give every draft of a step in one forward.
  std::optional<ParallelDraftOptions> parallel_drafting;
  if (a.mode == "parallel") {
    io::ParallelDrafterCheckpoint checkpoint = io::load_parallel_drafter(a.drafter, weights, limits);
    drafter.emplace(checkpoint.config, checkpoint.weights);
    (void)apply_weights(a, *drafter);
    parallel_drafting = ParallelDraftOptions{.mask_token = checkpoint.mask_token, .vocab_size = target.vocab_size()};
    specdec::detail::check_parallel_draft_options(*parallel_drafting, drafter->vocab_size());
  }
  const Processor processor = make_processor(a);
  if (!a.batch_file.empty()) {
    return run_batch_file(a, target, drafter ? &*drafter : nullptr, eagle ? &*eagle : nullptr,
                          medusa ? &*medusa : nullptr, text, eos, stops, processor);
  }
  SpeculativeOptions speculative_options = make_speculative_options(a, eos, stops);
  std::optional<CalibrationResult> calibration;
  if (a.calibrate) {
    calibration = calibrate(a, *drafter, target, text, prompt, speculative_options, processor);
    speculative_options.verification = Verification::threshold;
    speculative_options.threshold = calibration->best_threshold;
  }
  const bool color = isatty(fileno(stdout)) != 0;
  const Colors colors = color ? Colors{"\033[32m", "\033[9;31m", "\033[1;34m", "\033[0m"} : Colors{};
  const bool show_text = !a.json;

  // A step as the printer needs it, copied out of StepInfo (whose spans live for the callback only).
  struct Printed {
    std::vector<int64_t> drafts, emitted;
    int64_t accepted = 0, token = 0;
  };
  int64_t previous = prompt.back();
  // Prints a StepInfo as it streams, or a recorded step (the same fields).
  const auto print_step = [&](const auto& step) {
    if (a.trace) {
      const size_t accepted = std::min(step.emitted.size(), static_cast<size_t>(step.accepted));
      std::cout << colors.accepted;
      for (size_t i = 0; i < accepted; ++i) {
        std::cout << (color ? "" : "[+") << text.piece(previous, step.emitted[i]) << (color ? "" : "]");
        previous = step.emitted[i];
      }
      std::cout << colors.reset;
      if (step.emitted.size() > accepted) {  // the target's token was emitted too
        if (step.accepted < static_cast<int64_t>(step.drafts.size())) {
          std::cout << colors.rejected << (color ? "" : "[-")
                    << text.piece(previous, step.drafts[static_cast<size_t>(step.accepted)])
                    << (color ? "" : "]") << colors.reset;
        }
        std::cout << colors.target << (color ? "" : "[*") << text.piece(previous, step.token)
                  << (color ? "" : "]") << colors.reset;
        previous = step.token;
      }
      std::cout << std::flush;
      return;
    }
    for (const int64_t token : step.emitted) {
      std::cout << text.piece(previous, token);
      previous = token;
    }
    std::cout << std::flush;
  };
  const auto copy_step = [](const StepInfo& step) {
    return Printed{.drafts = {step.drafts.begin(), step.drafts.end()},
                   .emitted = {step.emitted.begin(), step.emitted.end()},
                   .accepted = step.accepted,
                   .token = step.token};
  };
  // Without --compare the text streams as it is generated; with it, every timed run (of either
  // mode) records its steps the same way and the text is printed after the timing.
  const auto on_step = [&](const StepInfo& step) {
    if (show_text) print_step(step);
  };

  if (show_text) {
    std::cout << "target:  " << a.target << " (" << target_checkpoint.format << ", " << target.config() << ", "
              << a.dtype << " on " << a.device << "; threads: " << threads
              << (target.onednn() ? "; products: " + specdec::detail::onednn_version() : std::string())
              << (target_weights.empty() ? std::string() : "; weights: " + target_weights)
              << (group ? "; split over " + std::to_string(group->world_size()) + " ranks" : std::string()) << ")\n";
    if (drafter) {
      std::cout << "drafter: " << a.drafter << " (" << drafter->config()
                << (parallel_drafting ? "; parallel, mask token " + std::to_string(parallel_drafting->mask_token)
                                      : std::string())
                << ")\n";
    }
    if (eagle) {
      const models::EagleConfig& c = eagle->config();
      std::cout << "head:    " << a.drafter << " (" << models::to_string(c.kind) << ", hidden " << c.hidden_size()
                << ", draft vocabulary " << c.draft_vocab_size << ", target layers";
      for (const int64_t layer : c.feature_layers) std::cout << " " << layer;
      std::cout << ")\n";
    }
    if (medusa) {
      std::cout << "heads:   " << a.drafter << " (medusa, " << medusa->config().num_heads << " heads of "
                << medusa->config().num_layers << " blocks)\n";
    }
    std::visit([&](const auto& p) { std::cout << "mode: " << a.mode << ", " << p; }, processor);
    if (a.tree == "none") {
      std::cout << ", gamma " << a.gamma;
    } else {
      std::cout << ", " << a.tree << " trees of " << a.tree_nodes.value_or(16) << " nodes, at most " << a.tree_depth
                << " deep";
      if (a.tree == "dynamic") std::cout << ", top-k " << a.tree_top_k << ", score temperature " << a.tree_score_temperature;
    }
    if (drafter && a.tree == "none") {
      std::cout << ", gamma policy " << a.gamma_policy;
      if (a.p_min > 0) std::cout << ", p_min " << a.p_min;
      if (a.entropy_gate < 1) std::cout << ", entropy gate " << a.entropy_gate;
      if (speculative_options.verification == Verification::threshold) {
        std::cout << ", threshold verification (lossy) at " << speculative_options.threshold;
      }
    }
    std::cout << "\n";
    if (a.trace) {
      std::cout << (color ? "trace: \033[32maccepted drafts\033[0m, \033[9;31mrejected draft\033[0m, \033[1;34mthe target's token\033[0m\n"
                          : "trace: [+accepted draft] [-rejected draft] [*the target's token]\n");
    }
    std::cout << "\n" << a.prompt << std::flush;
  }
  std::optional<NGramStorage> initial_storage;
  if (a.mode == "ngram") {
    initial_storage.emplace(a.storage.empty() ? NGramStorage(a.ngram_order, target.vocab_size())
                                              : NGramStorage::load(a.storage));
    if (initial_storage->vocab_size() != target.vocab_size()) {
      throw std::invalid_argument("--storage was built for vocabulary " + std::to_string(initial_storage->vocab_size()) +
                                  ", the target has " + std::to_string(target.vocab_size()));
    }
  }
  std::optional<SuffixCache> initial_cache;
  if (a.mode == "suffix") initial_cache.emplace(load_suffix_cache(a, target.vocab_size()));
  // One run of the chosen mode (`baseline`: autoregressive decoding instead). Each run of the
  // n-gram and suffix modes starts from the same storage or cache (its own copy), so that every
  // run drafts alike.
  std::optional<NGramStorage> storage;
  std::optional<SuffixCache> cache;
  const auto generate = [&](bool baseline, const StepCallback& callback) {
    return std::visit(
        [&](const auto& p) {
          const GenerationOptions plain{.max_new_tokens = a.max_new_tokens, .eos_token_ids = eos,
                                        .stop_sequences = stops, .seed = a.seed, .on_step = callback};
          if (baseline) return autoregressive_generate(target, prompt, plain, p);
          const NGramAssistedOptions ngram_options{.max_new_tokens = a.max_new_tokens, .eos_token_ids = eos,
                                                   .stop_sequences = stops, .seed = a.seed, .on_step = callback,
                                                   .gamma = a.gamma, .filler_top_k = a.filler,
                                                   .draft_rule = a.draft_rule};
          if (initial_storage) {
            storage.emplace(*initial_storage);
            return ngram_assisted_generate(*storage, target, prompt, ngram_options, p);
          }
          if (initial_cache) {
            cache.emplace(*initial_cache);
            return suffix_generate(*cache, target, prompt,
                                   {.max_new_tokens = a.max_new_tokens, .eos_token_ids = eos, .stop_sequences = stops,
                                    .seed = a.seed, .on_step = callback, .gamma = a.gamma, .rule = a.suffix_rule,
                                    .tree = a.suffix_tree},
                                   p);
          }
          if (a.mode == "prompt-lookup") {
            PromptLookupDrafter lookup;
            return ngram_assisted_generate(lookup, target, prompt, ngram_options, p);
          }
          SpeculativeOptions options = speculative_options;
          options.on_step = callback;
          // --tree: the drafter's or the heads' trees, else chains.
          const DynamicTreeOptions dynamic{.depth = a.tree_depth, .top_k = a.tree_top_k,
                                           .total_tokens = a.tree_nodes.value_or(16),
                                           .score_temperature = a.tree_score_temperature};
          const auto shape = [&](int64_t most_depth) {
            return TreeTemplate::default_tree(a.tree_nodes.value_or(16), std::min(a.tree_depth, most_depth));
          };
          if (parallel_drafting) {
            if (a.tree == "static") {
              ParallelTreeSource source(*drafter, *parallel_drafting, shape(a.tree_depth));
              return generate_with(source, target, prompt, options, p);
            }
            ParallelDraftSource source(*drafter, *parallel_drafting);
            return generate_with(source, target, prompt, options, p);
          }
          if (drafter) {
            if (a.tree == "static") {
              ModelTreeSource source(*drafter, shape(a.tree_depth),
                                     a.temperature > 0 ? TreeChildren::sampled : TreeChildren::top_k);
              return generate_with(source, target, prompt, options, p);
            }
            if (a.tree == "dynamic") {
              DynamicTreeSource source(*drafter, dynamic);
              return generate_with(source, target, prompt, options, p);
            }
            return speculative_generate(*drafter, target, prompt, options, p);
          }
          if (eagle) {
            if (a.tree == "dynamic") {
              EagleTreeSource heads(*eagle, target, dynamic);
              return generate_with(heads, target, prompt, options, p);
            }
            EagleDraftSource heads(*eagle, target);
            return generate_with(heads, target, prompt, options, p);
          }
          if (medusa) {
            if (a.tree == "static") {
              MedusaTreeSource heads(*medusa, target, shape(medusa->config().num_heads));
              return generate_with(heads, target, prompt, options, p);
            }
            MedusaDraftSource heads(*medusa, target);
            return generate_with(heads, target, prompt, options, p);
          }
          return autoregressive_generate(target, prompt, plain, p);
        },
        processor);
  };
  const bool comparing = a.compare && a.mode != "autoregressive";
  std::optional<GenerationResult> baseline;
  std::vector<double> mode_seconds, baseline_seconds;
  GenerationResult result;
  if (!comparing) {
    result = generate(false, on_step);
  } else {
    // A fair comparison: both modes warmed up (first forwards of each shape, page faults, the
    // products' first use), then alternated, each timed run recording its steps the same way.
    (void)generate(false, {});
    (void)generate(true, {});
    std::vector<std::vector<Printed>> mode_steps;
    std::vector<GenerationResult> mode_results, baseline_results;
    for (int run = 0; run < a.compare_runs; ++run) {
      for (const bool is_baseline : {run % 2 == 1, run % 2 == 0}) {
        std::vector<Printed> steps;
        GenerationResult timed = generate(is_baseline, [&](const StepInfo& step) { steps.push_back(copy_step(step)); });
        if (is_baseline) {
          baseline_results.push_back(std::move(timed));
        } else {
          mode_results.push_back(std::move(timed));
          mode_steps.push_back(std::move(steps));
        }
      }
    }
    // The runs with the median times stand for their mode (an odd count: the middle one).
    const auto median = [](const std::vector<GenerationResult>& runs) {
      std::vector<size_t> order(runs.size());
      for (size_t i = 0; i < order.size(); ++i) order[i] = i;
      std::sort(order.begin(), order.end(),
                [&](size_t x, size_t y) { return runs[x].stats.total_seconds < runs[y].stats.total_seconds; });
      return order[(order.size() - 1) / 2];
    };
    const size_t mode_median = median(mode_results), baseline_median = median(baseline_results);
    for (const auto& r : mode_results) mode_seconds.push_back(r.stats.total_seconds);
    for (const auto& r : baseline_results) baseline_seconds.push_back(r.stats.total_seconds);
    result = std::move(mode_results[mode_median]);
    baseline = std::move(baseline_results[baseline_median]);
    if (show_text) {
      for (const Printed& step : mode_steps[mode_median]) print_step(step);
    }
  }
  if (storage && !a.save_storage.empty()) storage->save(a.save_storage);
  if (cache && !a.save_storage.empty()) cache->save(a.save_storage);

  const GenerationStats& s = result.stats;
  if (a.json) {
    std::ostringstream reason;
    reason << result.stop_reason;
    nlohmann::json out{{"mode", a.mode}, {"gamma", a.gamma}, {"device", a.device}, {"dtype", a.dtype},
                       {"stop_reason", reason.str()}, {"stats", stats_json(s)}};
    if (drafter) {
      out["gamma_policy"] = a.gamma_policy;
      out["verification"] = speculative_options.verification == Verification::threshold ? "threshold" : "rejection";
      if (speculative_options.verification == Verification::threshold) out["threshold"] = speculative_options.threshold;
    }
    if (calibration) {
      nlohmann::json table = nlohmann::json::array();
      for (const CalibrationPoint& point : calibration->points) {
        table.push_back({{"threshold", point.threshold}, {"acceptance_rate", point.acceptance_rate()},
                         {"tokens_per_target_call", point.tokens_per_target_call()}, {"seconds", point.seconds()}});
      }
      out["calibration"] = {{"points", table}, {"best_threshold", calibration->best_threshold}};
    }
    if (baseline) {
      out["autoregressive"] = stats_json(baseline->stats);
      out["speedup"] = baseline->stats.total_seconds / s.total_seconds;
      out["identical_to_autoregressive"] = baseline->tokens == result.tokens;
      // What was measured: stats and autoregressive are the median runs of these.
      out["compare"] = {{"warmup_runs", 1},
                        {"timed_runs", a.compare_runs},
                        {"order", "alternating, " + std::string(a.mode) + " first"},
                        {"seconds", mode_seconds},
                        {"autoregressive_seconds", baseline_seconds}};
    }
    std::cout << out.dump(2) << "\n";
    return 0;
  }
  std::cout << std::fixed << std::setprecision(2) << "\n\n"
            << s.generated << " tokens in " << s.total_seconds << " s: " << s.generated / s.total_seconds
            << " tokens/s; " << s.target_calls << " target calls (" << s.tokens_per_target_call()
            << " tokens each), stopped by " << result.stop_reason;
  if (a.mode != "autoregressive") {
    std::cout << ", " << s.drafter_calls << " drafter calls, acceptance rate " << s.acceptance_rate();
  }
  std::cout << "\n";
  if (baseline) {
    const auto& b = baseline->stats;
    std::cout << "autoregressive: " << b.generated << " tokens in " << b.total_seconds << " s: "
              << b.generated / b.total_seconds << " tokens/s; speedup " << b.total_seconds / s.total_seconds
              << "x; output identical: " << (baseline->tokens == result.tokens ? "yes" : "no") << "\n"
              << "(medians of " << a.compare_runs << " timed runs of each mode, alternated, after one untimed "
              << "warm-up run of each; the text is printed after the timing)\n";
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  examples::Parallel::command_line().assign(argv, argv + argc);
  try {
    return run(parse(argc, argv));
  } catch (const CLI::ParseError& e) {
    std::cerr << "specdec-generate: " << e.what() << " (see --help)\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "specdec-generate" << examples::Parallel::label() << ": " << e.what() << "\n";
    return 2;
  }
}
