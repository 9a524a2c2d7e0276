// The README's usage example: greedy speculative decoding returns exactly the target's tokens.
#include <specdec/models/llama.hpp>
#include <specdec/specdec.hpp>

#include <iostream>

int main() {
  using namespace specdec;
  // Any types that model specdec::Target and specdec::Drafter work; here a randomly initialised
  // Llama target and, as drafter, its own first layer (a self-speculative "layer skip" drafter).
  const models::LlamaConfig config{.dim = 128, .hidden_dim = 256, .n_layers = 4, .n_heads = 4,
                                   .n_kv_heads = 2, .vocab_size = 256, .max_seq_len = 256};
  const models::LlamaWeights weights = models::LlamaWeights::random(config, /*seed=*/1);
  models::LlamaModel<StaticKVCache> target(config, weights);
  models::LlamaModel<StaticKVCache> drafter(models::truncated(config, weights, /*n_layers=*/1));

  const std::vector<int64_t> prompt{1, 2, 3};
  const auto fast = speculative_generate(drafter, target, prompt, {.max_new_tokens = 48, .gamma = 4});
  const auto slow = autoregressive_generate(target, prompt, {.max_new_tokens = 48});

  std::cout << "acceptance rate " << fast.stats.acceptance_rate() << ", tokens per target call "
            << fast.stats.tokens_per_target_call() << "\n"
            << "speculative == autoregressive: " << (fast.tokens == slow.tokens ? "yes" : "no") << "\n";
  return fast.tokens == slow.tokens ? 0 : 1;
}
