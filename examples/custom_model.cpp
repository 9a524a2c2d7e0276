// custom_model: how an engine plugs its own model into specdec.
//
// Anything with a cache type (length() and prune(n)), make_cache, forward, vocab_size and device
// models specdec::LanguageModel. Here the engine's own drafter is a byte bigram table counted
// from a text, whose "cache" is simply the tokens it has seen; the target is the bundled
// byte-level model. Speculative decoding with it returns exactly the target's greedy output.
#include <specdec/io/checkpoint.hpp>
#include <specdec/io/tokenizer.hpp>
#include <specdec/specdec.hpp>

#include <iostream>
#include <string_view>

#ifndef SPECDEC_BUNDLED_MODELS_DIR
#define SPECDEC_BUNDLED_MODELS_DIR "models/bundled"
#endif

// The engine's cache: the tokens seen so far.
class SeenTokens {
 public:
  [[nodiscard]] int64_t length() const noexcept { return static_cast<int64_t>(tokens_.size()); }
  void prune(int64_t n) { tokens_.resize(tokens_.size() - static_cast<size_t>(n)); }
  void append(const at::Tensor& ids) {
    const at::Tensor cpu = ids.to(at::kCPU).contiguous();
    tokens_.insert(tokens_.end(), cpu.data_ptr<int64_t>(), cpu.data_ptr<int64_t>() + cpu.numel());
  }

 private:
  std::vector<int64_t> tokens_;
};

// The engine's drafter: log P(next byte | byte) from bigram counts with add-one smoothing.
class BigramDrafter {
 public:
  using cache_type = SeenTokens;

  explicit BigramDrafter(std::string_view text) {
    at::Tensor counts = at::ones({256, 256});
    auto table = counts.accessor<float, 2>();
    for (size_t i = 0; i + 1 < text.size(); ++i) {
      table[static_cast<unsigned char>(text[i])][static_cast<unsigned char>(text[i + 1])] += 1;
    }
    log_probs_ = (counts / counts.sum(1, /*keepdim=*/true)).log();
  }

  [[nodiscard]] cache_type make_cache(int64_t /*batch*/) const { return {}; }
  // ids [batch, T] -> logits [batch, T, 256]: the row of each token.
  at::Tensor forward(const at::Tensor& ids, cache_type& cache) {
    cache.append(ids);
    return log_probs_.index_select(0, ids.flatten()).view({ids.size(0), ids.size(1), 256});
  }
  [[nodiscard]] int64_t vocab_size() const { return 256; }
  [[nodiscard]] at::Device device() const { return at::kCPU; }

 private:
  at::Tensor log_probs_;
};
static_assert(specdec::Drafter<BigramDrafter>);

int main() {
  try {
    using namespace specdec;
    const auto checkpoint = io::load_llama(SPECDEC_BUNDLED_MODELS_DIR "/target");
    models::LlamaModel<StaticKVCache> target(checkpoint.config, checkpoint.weights);
    BigramDrafter drafter(
        "import os\nimport sys\n\n\ndef main(argv):\n    for arg in argv:\n        if arg.startswith('-'):\n"
        "            return 1\n    return 0\n\n\nclass Parser(object):\n    def __init__(self, name):\n"
        "        self.name = name\n        self.items = []\n\n    def parse(self, text):\n"
        "        return [line.strip() for line in text.splitlines()]\n");
    const io::ByteTokenizer bytes;
    const std::vector<int64_t> prompt = bytes.encode("class Stack(object):\n    def __init__(self):\n");
    const auto fast = speculative_generate(drafter, target, prompt, {.max_new_tokens = 120, .gamma = 3});
    const auto slow = autoregressive_generate(target, prompt, {.max_new_tokens = 120});
    std::cout << bytes.decode(prompt) << bytes.decode(fast.tokens) << "\n\nacceptance rate "
              << fast.stats.acceptance_rate() << ", tokens per target call "
              << fast.stats.tokens_per_target_call() << "\nidentical to the target alone: "
              << (fast.tokens == slow.tokens ? "yes" : "no") << "\n";
    return fast.tokens == slow.tokens ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "custom_model: " << e.what() << "\n";
    return 2;
  }
}
