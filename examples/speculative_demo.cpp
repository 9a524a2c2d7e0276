// specdec-demo: speculative decoding beside autoregressive decoding on one target, streaming the
// tokens as they are accepted and printing acceptance and the measured speedup.
//
// The models are randomly initialised (real checkpoints come with the loaders): an 8-layer,
// 512-wide Llama target and, as drafter, the target's own first layer sharing its embedding and
// classifier. Random weights make no sense as text, so the output is token ids.
#include <specdec/models/llama.hpp>
#include <specdec/specdec.hpp>

#include <cstdlib>
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

constexpr std::string_view kUsage = R"(usage: specdec-demo [options]
  --gamma N            drafts per step (default 4)
  --max-new-tokens N   tokens to generate (default 96)
  --drafter-layers N   layers of the target the drafter keeps (default 1 of 8)
  --temperature T      0 for greedy (default), > 0 to sample
  --seed N             sampling seed (default 7)
  --help               this text
)";

Arguments parse(int argc, char** argv) {
  Arguments args;
  for (int i = 1; i < argc; ++i) {
    const std::string_view flag = argv[i];
    if (flag == "--help") {
      std::cout << kUsage;
      std::exit(0);
    }
    if (i + 1 >= argc) throw std::invalid_argument(std::string(flag) + " needs a value (see --help)");
    const std::string value = argv[++i];
    if (flag == "--gamma") args.gamma = std::stoll(value);
    else if (flag == "--max-new-tokens") args.max_new_tokens = std::stoll(value);
    else if (flag == "--drafter-layers") args.drafter_layers = std::stoll(value);
    else if (flag == "--temperature") args.temperature = std::stod(value);
    else if (flag == "--seed") args.seed = std::stoull(value);
    else throw std::invalid_argument("unknown option " + std::string(flag) + " (see --help)");
  }
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
  } catch (const std::exception& e) {
    std::cerr << "specdec-demo: " << e.what() << "\n";
    return 2;
  }
}
