// custom_drafter: a new way of drafting is one type, and no change to the generation loop.
//
// A type with draft(request, processor, gen) -> specdec::Drafts and verified(outcome) models
// specdec::DraftSource; specdec::generate_with runs the shared step with it (one target forward
// per step, exact verification, cache pruning, stop rules, stats). This one drafts by repeating
// the text's last `period` tokens, which pays off wherever text repeats: indentation, rows of a
// table, a refrain. Its drafts are deterministic (q one-hot), so the output is exactly the
// target's: here, token for token the bundled model's greedy output.
#include <specdec/io/checkpoint.hpp>
#include <specdec/io/tokenizer.hpp>
#include <specdec/specdec.hpp>

#include <iostream>
#include <vector>

#ifndef SPECDEC_BUNDLED_MODELS_DIR
#define SPECDEC_BUNDLED_MODELS_DIR "models/bundled"
#endif

// Drafts the continuation in which the last `period` tokens repeat: draft i is the token
// `period` positions before it.
class RepeatDrafter {
 public:
  explicit RepeatDrafter(int64_t period) : period_(period) {}

  specdec::Drafts draft(const specdec::DraftRequest& request, const auto& /*processor*/, at::Generator& /*gen*/) {
    const auto sequence = request.sequence;
    const auto length = static_cast<int64_t>(sequence.size());
    drafts_.clear();
    for (int64_t i = 0; i < request.gamma && length >= period_; ++i) {
      const int64_t source = length + i - period_;
      drafts_.push_back(source < length ? sequence[static_cast<size_t>(source)]
                                        : drafts_[static_cast<size_t>(source - length)]);
    }
    return specdec::Drafts::from_host(drafts_, request.device, /*calls=*/1);
  }

  void verified(const specdec::VerifiedDrafts& outcome) { accepted_ += outcome.accepted; }
  [[nodiscard]] int64_t accepted() const noexcept { return accepted_; }

  // An optional hook: called before each generation's first step (the count starts again).
  void start(std::span<const int64_t> /*sequence*/, const specdec::SpeculativeOptions& /*options*/) { accepted_ = 0; }

 private:
  int64_t period_;
  int64_t accepted_ = 0;
  std::vector<int64_t> drafts_;
};
static_assert(specdec::DraftSource<RepeatDrafter, specdec::GreedyProcessor>);
// The step calls an optional hook only when its concept holds: stating it catches a misspelling.
static_assert(specdec::HasStartHook<RepeatDrafter>);

int main() {
  try {
    using namespace specdec;
    const auto checkpoint = io::load_llama(SPECDEC_BUNDLED_MODELS_DIR "/target");
    models::LlamaModel<StaticKVCache> target(checkpoint.config, checkpoint.weights);
    const io::ByteTokenizer bytes;
    const std::vector<int64_t> prompt = bytes.encode(
        "COLORS = [\n    'red',\n    'green',\n    'blue',\n    'cyan',\n    'magenta',\n    'yellow',\n");
    RepeatDrafter drafter(/*period=*/4);
    const auto fast = generate_with(drafter, target, prompt, {.max_new_tokens = 120, .gamma = 4});
    const auto slow = autoregressive_generate(target, prompt, {.max_new_tokens = 120});
    std::cout << bytes.decode(prompt) << bytes.decode(fast.tokens) << "\n\nrepeat drafter: acceptance rate "
              << fast.stats.acceptance_rate() << ", tokens per target call " << fast.stats.tokens_per_target_call()
              << " (" << drafter.accepted() << " drafts accepted)\nidentical to the target alone: "
              << (fast.tokens == slow.tokens ? "yes" : "no") << "\n";
    return fast.tokens == slow.tokens ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "custom_drafter: " << e.what() << "\n";
    return 2;
  }
}
