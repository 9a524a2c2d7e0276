// specdec-demo: speculative decoding beside autoregressive decoding on one target, streaming the
// tokens as they are accepted and printing acceptance and the measured speedup.
//
// The models are randomly initialised (real checkpoints come with the loaders): an 8-layer,
// 512-wide Llama target and, as drafter, the target's own first layer sharing its embedding and
// classifier. Random weights make no sense as text, so the output is token ids.
#include <specdec/models/llama.hpp>
#include <specdec/specdec.hpp>

#include "support/cli.hpp"

#include <cstdlib>
#include <limits>
#include <iomanip>
#include <iostream>
#include <string>
#include <string_view>

namespace {

struct Arguments {
  int64_t gamma = 4;
  int64_t max_new_tokens = 96;
  int64_t drafter_layers = 1;
  double temperature = 0.0;  // 0: greedy
  uint64_t seed = 7;
};

// Parses the command line with CLI11; exits 0 after --help, throws CLI::ParseError naming a bad
// flag or value.
Arguments parse(int argc, char** argv) {
  Arguments args;
  CLI::App app("Speculative decoding beside autoregressive decoding on a random-weight Llama pair.", "specdec-demo");
  app.add_option("--gamma", args.gamma, "drafts per step (default 4)")->check(cli::integer<int64_t>(1, 1024));
  app.add_option("--max-new-tokens", args.max_new_tokens, "tokens to generate (default 96)")
      ->check(cli::integer<int64_t>(0, 900));
  app.add_option("--drafter-layers", args.drafter_layers, "layers of the target the drafter keeps (default 1 of 8)")
      ->check(cli::integer<int64_t>(1, 8));
  app.add_option("--temperature", args.temperature, "0 for greedy (default), > 0 to sample")
      ->check(cli::real(0.0, 1e6));
  app.add_option("--seed", args.seed, "sampling seed (default 7)")
      ->check(cli::integer<uint64_t>(0, std::numeric_limits<uint64_t>::max()));
  cli::parse_or_help(app, argc, argv);
  return args;
}

template <specdec::LogitsProcessor P>
int run(const Arguments& args, const P& processor) {
  using namespace specdec;
  const models::LlamaConfig config{.dim = 512, .hidden_dim = 1376, .n_layers = 8, .n_heads = 8,
                                   .n_kv_heads = 4, .vocab_size = 4096, .max_seq_len = 1024};
  const models::LlamaWeights weights = models::LlamaWeights::random(config, /*seed=*/2024);
  models::LlamaModel<StaticKVCache> target(config, weights);
  models::LlamaModel<StaticKVCache> drafter(models::truncated(config, weights, args.drafter_layers));
  const std::vector<int64_t> prompt{1, 42, 314, 1592, 653};

  std::cout << "target  " << config << "\ndrafter first " << args.drafter_layers
            << " layer(s) of the target\nprocessor " << processor << ", gamma " << args.gamma
            << "\n(randomly initialised models: the output is token ids, not text)\n\n";

  // Warm up the kernels once so that both timed runs start equal.
  (void)autoregressive_generate(target, prompt, {.max_new_tokens = 4});

  std::cout << "speculative:   ";
  const auto fast = speculative_generate(
      drafter, target, prompt,
      {.max_new_tokens = args.max_new_tokens, .seed = args.seed,
       .on_step = [](const StepInfo& step) {
         // Accepted drafts plain, the target's own token in brackets.
         for (size_t i = 0; i < step.emitted.size(); ++i) {
           const bool own = static_cast<int64_t>(i) >= step.accepted;
           std::cout << (own ? "[" : "") << step.emitted[i] << (own ? "] " : " ");
         }
         std::cout << std::flush;
       },
       .gamma = args.gamma},
      processor);
  const auto slow = autoregressive_generate(
      target, prompt, {.max_new_tokens = args.max_new_tokens, .seed = args.seed}, processor);

  const auto& s = fast.stats;
  const double alpha = s.acceptance_rate();
  std::cout << std::fixed << std::setprecision(2) << "\n\n"
            << "autoregressive: " << slow.tokens.size() << " tokens in " << slow.stats.total_seconds
            << " s, " << slow.tokens.size() / slow.stats.total_seconds << " tokens/s\n"
            << "speculative:    " << fast.tokens.size() << " tokens in " << s.total_seconds << " s, "
            << fast.tokens.size() / s.total_seconds << " tokens/s\n"
            << "speedup " << slow.stats.total_seconds / s.total_seconds << "x, acceptance rate "
            << alpha << ", tokens per target call " << s.tokens_per_target_call() << "\n"
            << "target calls " << s.target_calls << ", drafter calls " << s.drafter_calls
            << ", time in target " << s.target_seconds << " s, drafter " << s.drafter_seconds
            << " s, library " << s.library_seconds() << " s\n";
  if (args.temperature == 0.0) {
    std::cout << "greedy output identical to autoregressive: "
              << (fast.tokens == slow.tokens ? "yes" : "NO") << "\n";
    return fast.tokens == slow.tokens ? 0 : 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Arguments args = parse(argc, argv);
    if (args.temperature == 0.0) return run(args, specdec::GreedyProcessor{});
    return run(args, specdec::MultinomialProcessor{args.temperature});
  } catch (const CLI::ParseError& e) {
    std::cerr << "specdec-demo: " << e.what() << " (see --help)\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "specdec-demo: " << e.what() << "\n";
    return 2;
  }
}
