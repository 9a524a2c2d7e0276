// specdec-generate: text in and out (tokenizers or bytes), the request it makes of the library,
// and what it prints (colours, statistics as JSON).
#pragma once

#include "arguments.hpp"

namespace {

// Text of tokens: through a Hugging Face tokenizer.json (with its folder's BOS, EOS and chat
// settings), a llama2.c tokenizer, or as bytes.
class Text {
 public:
  Text(const Arguments& a, int64_t vocab) : chat_(a.chat) {
    std::filesystem::path hf;
    if (!a.tokenizer.empty()) {
      const std::filesystem::path path(a.tokenizer);
      if (std::filesystem::is_directory(path) || path.extension() == ".json") hf = path;
      else tokenizer_ = io::Llama2cTokenizer::load(path, vocab);
    } else if (std::filesystem::is_directory(a.target) && std::filesystem::exists(std::filesystem::path(a.target) / "tokenizer.json")) {
      hf = a.target;
    }
    if (!hf.empty()) {
      hf_ = io::HfTokenizer::load(hf);
      if (hf_->vocab_size() > vocab) {
        throw std::invalid_argument(hf_->file().string() + " has ids up to " + std::to_string(hf_->vocab_size() - 1) +
                                    ", beyond the model's vocabulary of " + std::to_string(vocab));
      }
      const auto folder = std::filesystem::is_directory(hf) ? hf : hf.parent_path();
      settings_ = io::read_text_settings(folder, *hf_);
    }
    if (!tokenizer_ && !hf_ && vocab != io::ByteTokenizer::vocab_size()) {
      throw std::invalid_argument("a model with vocabulary " + std::to_string(vocab) +
                                  " needs --tokenizer (byte-level models have 256 tokens)");
    }
    if (chat_ && !(hf_ && settings_.chat)) {
      throw std::invalid_argument("--chat needs a tokenizer.json whose tokens or tokenizer_config.json's chat_template "
                                  "name a known chat format (Llama 3, ChatML, Zephyr, [INST])");
    }
  }
  // The end-of-sequence ids the tokenizer's folder gives (llama2.c: 2; bytes: none).
  [[nodiscard]] std::vector<int64_t> eos() const {
    if (hf_) return settings_.eos_token_ids;
    if (tokenizer_) return {io::Llama2cTokenizer::kEos};
    return {};
  }
  // The fewest tokens a text of `bytes` bytes encodes to (BOS aside).
  [[nodiscard]] int64_t min_tokens(int64_t bytes) const {
    return hf_ ? bytes / hf_->max_token_bytes() : tokenizer_ ? bytes / tokenizer_->max_token_length() : bytes;
  }
  // A prompt: BOS as the tokenizer's settings say, in the chat format under --chat.
  [[nodiscard]] std::vector<int64_t> encode(const std::string& text) const {
    if (hf_) return io::encode_prompt(*hf_, settings_, chat_ ? io::apply_chat_template(*settings_.chat, text) : text);
    return tokenizer_ ? tokenizer_->encode(text) : bytes_.encode(text);
  }
  // Text inside a sequence (a stop string): no BOS, no chat format.
  [[nodiscard]] std::vector<int64_t> encode_inner(const std::string& text) const {
    if (hf_) return hf_->encode(text, false);
    return tokenizer_ ? tokenizer_->encode(text, false) : bytes_.encode(text);
  }
  [[nodiscard]] std::string piece(int64_t previous, int64_t token) const {
    if (hf_) return hf_->decode_piece(previous, token);
    return tokenizer_ ? tokenizer_->decode_piece(previous, token) : bytes_.decode_piece(previous, token);
  }
  // The text of `tokens` following the token `previous`.
  [[nodiscard]] std::string decode(int64_t previous, const std::vector<int64_t>& tokens) const {
    std::string out;
    for (const int64_t t : tokens) out += piece(previous, t), previous = t;
    return out;
  }

 private:
  bool chat_ = false;
  std::optional<io::HfTokenizer> hf_;
  io::HfTextSettings settings_;
  std::optional<io::Llama2cTokenizer> tokenizer_;
  io::ByteTokenizer bytes_;
};

// The prompt, stop sequences and end tokens of a run, through its tokenizer.
struct Request {
  std::vector<int64_t> prompt{};
  std::vector<std::vector<int64_t>> stops{};
  std::vector<int64_t> eos{};
};
Request encode_request(const Arguments& a, const Text& text) {
  Request request{.prompt = text.encode(a.prompt), .eos = a.eos};
  if (request.prompt.empty()) throw std::invalid_argument("--prompt must not be empty");
  for (const std::string& stop : a.stops) {
    if (stop.empty()) throw std::invalid_argument("--stop must not be empty");
    request.stops.push_back(text.encode_inner(stop));
  }
  if (request.eos.empty()) request.eos = text.eos();
  return request;
}

// The speculative options the flags give.
SpeculativeOptions make_speculative_options(const Arguments& a, const std::vector<int64_t>& eos,
                                            const std::vector<std::vector<int64_t>>& stops) {
  return {.max_new_tokens = a.max_new_tokens, .eos_token_ids = eos, .stop_sequences = stops, .seed = a.seed,
          .gamma = a.gamma,
          .gamma_policy = a.gamma_policy == "egag" ? GammaPolicy::egag
                          : a.gamma_policy == "schedule" ? GammaPolicy::schedule : GammaPolicy::fixed,
          .gamma_min = a.gamma_min, .gamma_max = a.gamma_max, .egag_ema_beta = a.egag_beta, .p_min = a.p_min,
          .entropy_gate = a.entropy_gate,
          .verification = a.verify == "threshold" ? Verification::threshold : Verification::rejection,
          .threshold = a.threshold};
}

struct Colors {
  const char* accepted = "";
  const char* rejected = "";
  const char* target = "";
  const char* reset = "";
};

nlohmann::json stats_json(const GenerationStats& s) {
  return {{"generated", s.generated}, {"steps", s.steps}, {"drafted", s.drafted}, {"accepted", s.accepted},
          {"acceptance_rate", s.acceptance_rate()}, {"target_calls", s.target_calls},
          {"drafter_calls", s.drafter_calls}, {"tokens_per_target_call", s.tokens_per_target_call()},
          {"total_seconds", s.total_seconds}, {"target_seconds", s.target_seconds},
          {"drafter_seconds", s.drafter_seconds}, {"target_positions", s.target_positions},
          {"tokens_per_second", s.total_seconds > 0 ? s.generated / s.total_seconds : 0.0}};
}

}  // namespace
