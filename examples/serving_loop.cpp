// A serving engine's loop over specdec::Engine on the bundled pair and its EAGLE-3 head: requests
// arrive while others generate, each with its own sampling, budget and draft method (the drafter,
// the head, prompt lookup); every step's new tokens are
// streamed; the greedy requests are checked against autoregressive decoding. docs/engine.md
// walks through it.
#include <specdec/engine.hpp>
#include <specdec/io/checkpoint.hpp>
#include <specdec/io/eagle.hpp>
#include <specdec/io/tokenizer.hpp>
#include <specdec/specdec.hpp>

#include <iostream>
#include <map>
#include <string>
#include <vector>

int main() {
  try {
    using namespace specdec;
    const auto t = io::load_llama(SPECDEC_BUNDLED_MODELS_DIR "/target");
    const auto d = io::load_llama(SPECDEC_BUNDLED_MODELS_DIR "/drafter");
    models::LlamaModel<StaticKVCache> target(t.config, t.weights), drafter(d.config, d.weights);
    const auto head = io::load_eagle(SPECDEC_BUNDLED_MODELS_DIR "/eagle3", io::EagleTarget::of(target));
    Engine engine(drafter, target, {.max_rows = 4, .seed = 7, .eagle = &head});
    const io::ByteTokenizer bytes;
    const std::vector<std::string> prompts{"class Stack(object):\n    def __init__(self):\n        self.",
                                           "import os\nimport sys\n\ndef main(", "    def push(self, item):\n",
                                           "for i in range(10):\n    print(", "def read(path):\n    with open(",
                                           "    return self."};
    std::map<RequestId, Request> requests;
    std::map<RequestId, std::vector<int64_t>> streamed;
    for (size_t step = 0, next = 0; next < prompts.size() || !engine.idle(); ++step) {
      if (next < prompts.size() && step % 3 == 0) {  // a new request every third step
        Request request{.prompt = bytes.encode(prompts[next]), .max_new_tokens = 48};
        if (next % 3 == 1) request.sampling = {.temperature = 0.8, .top_p = 0.95, .seed = next};
        if (next % 3 == 2) request.drafting = next == 2 ? DraftMethod::prompt_lookup : DraftMethod::eagle;
        requests.emplace(*engine.add(request), request);
        ++next;
      }
      for (const EngineEvent& event : engine.step()) {
        auto& tokens = streamed[event.id];  // a server would send event.tokens on now
        tokens.insert(tokens.end(), event.tokens.begin(), event.tokens.end());
        if (event.result) {
          std::cout << "request " << event.id << " (" << requests[event.id].drafting << ", " << event.result->stop_reason << ", "
                    << event.result->stats.tokens_per_target_call() << " tokens per target call):\n"
                    << bytes.decode(requests[event.id].prompt) << bytes.decode(tokens) << "\n\n";
        }
      }
    }
    bool same = true;
    for (const auto& [id, request] : requests) {
      if (!request.sampling.greedy()) continue;
      const auto alone = autoregressive_generate(target, request.prompt, {.max_new_tokens = 48});
      same = same && alone.tokens == streamed[id];
    }
    std::cout << "target calls " << engine.stats().target_calls << "; greedy requests identical to "
              << "autoregressive decoding: " << (same ? "yes" : "no") << "\n";
    return same ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "serving_loop: " << e.what() << "\n";
    return 2;
  }
}
