// Tokenizers for the bundled and llama2.c models.
//
// Llama2cTokenizer reads llama2.c's tokenizer file (int32 max_token_length, then for each token:
// float32 score, int32 length, bytes) and encodes as llama2.c does: an optional BOS, a dummy
// prefix space, one token per UTF-8 character where the vocabulary has it and byte-fallback
// tokens <0xXX> where it does not, then repeated merging of the adjacent pair whose concatenation
// is the highest-scoring vocabulary entry (a priority queue of pairs: O(n log n) in the text). Decoding drops the leading space of the first piece
// after BOS and turns <0xXX> pieces into their bytes.
//
// ByteTokenizer maps each byte to the token of the same value (the bundled models).
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "specdec/io/binary_reader.hpp"
#include "specdec/io/detail/bpe.hpp"
#include "specdec/io/errors.hpp"

namespace specdec::io {

class ByteTokenizer {
 public:
  [[nodiscard]] static constexpr int64_t vocab_size() noexcept { return 256; }

  [[nodiscard]] std::vector<int64_t> encode(std::string_view text) const {
    std::vector<int64_t> tokens;
    tokens.reserve(text.size());
    for (const char c : text) tokens.push_back(static_cast<unsigned char>(c));
    return tokens;
  }

  // The bytes of `token`; `previous` is unused (kept for a uniform streaming interface).
  [[nodiscard]] std::string decode_piece(int64_t /*previous*/, int64_t token) const {
    check(token);
    return std::string(1, static_cast<char>(token));
  }

  [[nodiscard]] std::string decode(std::span<const int64_t> tokens) const {
    std::string text;
    for (const int64_t t : tokens) text += decode_piece(-1, t);
    return text;
  }

 private:
  static void check(int64_t token) {
    if (token < 0 || token >= 256) {
      throw std::invalid_argument("token must be in [0, 256), got " + std::to_string(token));
    }
  }
};

class Llama2cTokenizer {
 public:
  static constexpr int64_t kBos = 1;
  static constexpr int64_t kEos = 2;

  // Reads a tokenizer file. `vocab_size` is the model's: the file must hold exactly that many
  // entries. Throws FormatError naming the file and the problem.
  static Llama2cTokenizer load(const std::filesystem::path& path, int64_t vocab_size) {
    if (vocab_size < 3 || vocab_size > (1 << 22)) {
      throw std::invalid_argument("vocab_size must be in [3, 4194304], got " + std::to_string(vocab_size));
    }
    detail::BinaryReader reader(path);
    Llama2cTokenizer tokenizer;
    const auto max_length = reader.read<int32_t>("max_token_length");
    if (max_length < 1 || max_length > (1 << 16)) {
      detail::throw_format(path, "max_token_length ", max_length, " is out of range");
    }
    tokenizer.max_token_length_ = max_length;
    // One token record (score, length, bytes) at the reader's position; false at the end of the file.
    const auto read_token = [&](int64_t i, std::string* bytes, float* score_out) {
      const std::string where = "token " + std::to_string(i);
      const auto score = reader.read<float>(where + " score");
      const auto length = reader.read<int32_t>(where + " length");
      if (!std::isfinite(score)) detail::throw_format(path, where, " has a non-finite score");
      if (length < 0 || length > max_length) {
        detail::throw_format(path, where, " has length ", length, " outside [0, max_token_length = ", max_length, "]");
      }
      *bytes = reader.read_string(static_cast<uint64_t>(length), where + " bytes");
      *score_out = score;
    };
    const auto mismatch = [&](int64_t held) {
      detail::throw_format(path, "holds ", held, " tokens but the model's vocabulary has ", vocab_size,
                           ": a tokenizer for another model?");
    };
    for (int64_t i = 0; i < vocab_size; ++i) {
      if (reader.remaining() == 0) mismatch(i);
      std::string bytes;
      float score = 0;
      read_token(i, &bytes, &score);
      tokenizer.pieces_.push_back(std::move(bytes));
      tokenizer.scores_.push_back(score);
    }
    if (reader.remaining() != 0) {
      // More records than the vocabulary: count them if they are well formed, for the message.
      const uint64_t extra_bytes = reader.remaining();
      int64_t held = vocab_size;
      try {
        for (std::string bytes; reader.remaining() != 0 && held < (int64_t{1} << 24); ++held) {
          float score = 0;
          read_token(held, &bytes, &score);
        }
      } catch (const FormatError&) {
        detail::throw_format(path, extra_bytes, " bytes follow the ", vocab_size, " tokens");
      }
      mismatch(held);
    }
    for (int64_t i = 0; i < vocab_size; ++i) {
      tokenizer.lookup_.emplace(tokenizer.pieces_[static_cast<size_t>(i)], i);  // first wins
      const auto byte = detail::byte_of(tokenizer.pieces_[static_cast<size_t>(i)]);
      if (byte && tokenizer.byte_tokens_[*byte] < 0) tokenizer.byte_tokens_[*byte] = i;
    }
    return tokenizer;
  }

  [[nodiscard]] int64_t vocab_size() const noexcept { return static_cast<int64_t>(pieces_.size()); }
  [[nodiscard]] const std::string& piece(int64_t token) const { return pieces_.at(checked(token)); }

  // Tokens of `text`, with BOS first when `bos`. Throws std::invalid_argument when a byte has
  // neither a character token nor a byte-fallback token.
  [[nodiscard]] std::vector<int64_t> encode(std::string_view text, bool bos = true) const {
    std::vector<int64_t> tokens;
    if (bos) tokens.push_back(kBos);
    if (text.empty()) return tokens;
    if (const auto space = find(" ")) tokens.push_back(*space);
    for (size_t i = 0; i < text.size();) {
      // One UTF-8 character: a lead byte and its continuation bytes (at most 4 bytes).
      size_t end = i + 1;
      while (end < text.size() && end - i < 4 && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) ++end;
      if (const auto id = find(text.substr(i, end - i))) {
        tokens.push_back(*id);
      } else {
        for (size_t b = i; b < end; ++b) {
          const int64_t fallback = byte_tokens_[static_cast<unsigned char>(text[b])];
          if (fallback < 0) {
            throw std::invalid_argument("the tokenizer has no token for byte " +
                                        std::to_string(static_cast<unsigned char>(text[b])));
          }
          tokens.push_back(fallback);
        }
      }
      i = end;
    }
    merge(tokens, bos ? 1 : 0);
    return tokens;
  }

  // The longest piece in bytes: a text of B bytes encodes to at least B / max_token_length()
  // tokens, a bound a caller can check before encoding.
  [[nodiscard]] int64_t max_token_length() const noexcept { return max_token_length_; }

  // The text of `token` following `previous` (-1 for none).
  [[nodiscard]] std::string decode_piece(int64_t previous, int64_t token) const {
    const std::string& text = pieces_[checked(token)];
    if (const auto byte = detail::byte_of(text)) return std::string(1, static_cast<char>(*byte));
    if (previous == kBos && !text.empty() && text.front() == ' ') return text.substr(1);
    return text;
  }

  [[nodiscard]] std::string decode(std::span<const int64_t> tokens, int64_t previous = -1) const {
    std::string text;
    for (const int64_t t : tokens) {
      text += decode_piece(previous, t);
      previous = t;
    }
    return text;
  }

 private:
  // Merges tokens[first..] as SentencePiece BPE does: repeatedly the adjacent pair whose
  // concatenation is the highest-scoring vocabulary entry, the leftmost on ties.
  void merge(std::vector<int64_t>& tokens, size_t first) const {
    detail::merge_pairs(tokens, first, [&](int64_t left, int64_t right) -> std::optional<detail::PairMerge> {
      const auto id = find(pieces_[static_cast<size_t>(left)] + pieces_[static_cast<size_t>(right)]);
      if (!id) return std::nullopt;
      return detail::PairMerge{scores_[static_cast<size_t>(*id)], *id};
    });
  }

  [[nodiscard]] std::optional<int64_t> find(std::string_view text) const {
    const auto it = lookup_.find(std::string(text));
    return it == lookup_.end() ? std::nullopt : std::optional(it->second);
  }

  [[nodiscard]] size_t checked(int64_t token) const {
    if (token < 0 || token >= vocab_size()) {
      throw std::invalid_argument("token must be in [0, " + std::to_string(vocab_size()) + "), got " +
                                  std::to_string(token));
    }
    return static_cast<size_t>(token);
  }

  int64_t max_token_length_ = 1;
  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::unordered_map<std::string, int64_t> lookup_;
  std::array<int64_t, 256> byte_tokens_ = [] {
    std::array<int64_t, 256> a{};
    a.fill(-1);
    return a;
  }();
};

}  // namespace specdec::io
