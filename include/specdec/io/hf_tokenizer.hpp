// Hugging Face tokenizer.json: the BPE tokenizers of Llama 2/3, TinyLlama, Mistral, Qwen2/2.5/3
// and GPT-2.
//
// Two kinds of BPE tokenizer are read, as the `tokenizers` library defines them:
//   byte-level (GPT-2, Llama 3, Qwen): a regex pre-tokenizer splits the text into words, each byte
//     of a word becomes one printable character (GPT-2's byte-to-unicode table), and merges apply
//     by rank inside each word;
//   SentencePiece-style (Llama 2, TinyLlama, Mistral): spaces become U+2581 "▁" (Prepend/Replace
//     normalizers or a Metaspace pre-tokenizer), merges apply over the whole text, and characters
//     without a token become their <0xXX> byte tokens (byte_fallback).
// Added tokens (<s>, <|begin_of_text|>, <|im_start|>, ...) are found in the text first, leftmost
// and longest, and never split.
//
// What is read: normalizer NFC, Prepend, Replace (string patterns) and Sequence; pre_tokenizer
// Split (Regex or String pattern; Isolated, Removed, MergedWithPrevious, MergedWithNext),
// ByteLevel, Metaspace and Sequence; model BPE (merges as "a b" strings or [a, b] pairs,
// ignore_merges, byte_fallback, unk_token, fuse_unk); post_processor TemplateProcessing, ByteLevel
// and Sequence; decoder ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace and Sequence.
// Anything else is refused with an io::FormatError naming the file and the field.
//
// Libraries: nlohmann-json reads the file, PCRE2 (UTF and UCP mode, JIT where available) runs the
// pre-tokenizer regexes with their Unicode classes (\p{L}, \p{N}, \s), and utf8proc validates
// UTF-8 and applies NFC. Link specdec::tokenizers to use this header.
//
// Differences from `tokenizers`, on purpose: decode() returns the bytes the tokens stand for, so a
// token sequence that ends inside a UTF-8 character decodes to that character's first bytes (not
// U+FFFD), which is what a stream printing piece by piece needs; transformers'
// clean_up_tokenization_spaces (" ." -> ".") is not applied, so decode(encode(text)) == text for
// byte-level tokenizers; a character with neither a token, byte-fallback tokens nor an unk token
// is an error rather than dropped.
#pragma once

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "specdec/io/detail/bpe.hpp"
#include "specdec/io/errors.hpp"
#include "specdec/io/json.hpp"
#include "specdec/io/limits.hpp"

namespace specdec::io {
namespace detail {

// The UTF-8 bytes of code point `c`.
inline std::string utf8(int32_t c) {
  std::array<utf8proc_uint8_t, 4> bytes{};
  const auto n = utf8proc_encode_char(c, bytes.data());
  return std::string(reinterpret_cast<const char*>(bytes.data()), static_cast<size_t>(n));
}

// The byte length of the UTF-8 character starting at text[i] (text is valid UTF-8).
inline size_t utf8_length(std::string_view text, size_t i) {
  const auto lead = static_cast<unsigned char>(text[i]);
  return lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
}

// Throws std::invalid_argument naming `what` and the byte offset where `text` is not UTF-8.
inline void require_utf8(std::string_view text, const char* what) {
  const auto* data = reinterpret_cast<const utf8proc_uint8_t*>(text.data());
  for (size_t i = 0; i < text.size();) {
    utf8proc_int32_t c = 0;
    const auto n = utf8proc_iterate(data + i, static_cast<utf8proc_ssize_t>(text.size() - i), &c);
    if (n < 0) throw std::invalid_argument(std::string(what) + " is not valid UTF-8 at byte " + std::to_string(i));
    i += static_cast<size_t>(n);
  }
}

// GPT-2's byte-to-unicode table: bytes that are printable Latin-1 characters stand for
// themselves, the other 68 bytes for the code points 256, 257, ... in byte order.
struct ByteLevelTable {
  std::array<std::string, 256> to_char{};
  std::unordered_map<int32_t, uint8_t> to_byte{};
  ByteLevelTable() {
    int32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      const int32_t c = printable ? b : next++;
      to_char[static_cast<size_t>(b)] = utf8(c);
      to_byte.emplace(c, static_cast<uint8_t>(b));
    }
  }
};

// Hashes std::string and std::string_view alike, so that maps keyed by strings take views.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view text) const noexcept { return std::hash<std::string_view>{}(text); }
};

// The limits for tokenizer files: a JSON array or object may hold up to 4 x max_vocab_size entries
// (vocabularies, merge lists and added-token tables are that long).
inline LoadLimits tokenizer_limits(const LoadLimits& limits) {
  LoadLimits wide = limits;
  wide.max_json_entries = std::max<uint64_t>(limits.max_json_entries, 4 * static_cast<uint64_t>(limits.max_vocab_size));
  return wide;
}

inline const ByteLevelTable& byte_level_table() {
  static const ByteLevelTable table;
  return table;
}

// A compiled PCRE2 pattern (UTF, UCP: \s, \w and the POSIX classes are Unicode-aware), shared by
// copies of the tokenizer. Matching is thread-safe: each call has its own match data.
class Regex {
 public:
  Regex(std::string_view pattern, bool literal, const std::filesystem::path& file, const std::string& field) {
    int error = 0;
    PCRE2_SIZE offset = 0;
    const uint32_t options = literal ? PCRE2_UTF | PCRE2_LITERAL : PCRE2_UTF | PCRE2_UCP;
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options, &error,
                                     &offset, nullptr);
    if (code == nullptr) {
      std::array<PCRE2_UCHAR, 256> message{};
      pcre2_get_error_message(error, message.data(), message.size());
      throw_format(file, field, " is not a pattern PCRE2 accepts at offset ", offset, ": ",
                   reinterpret_cast<const char*>(message.data()));
    }
    pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // without JIT support the interpreter runs
    code_.reset(code, pcre2_code_free);
  }

  // Calls f(begin, end) for each match in `text` (valid UTF-8), left to right; an empty match
  // moves on by one character.
  template <class F>
  void for_each_match(std::string_view text, F&& f) const {
    std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> match(
        pcre2_match_data_create_from_pattern(code_.get(), nullptr), pcre2_match_data_free);
    if (!match) throw std::bad_alloc();
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    for (size_t at = 0; at <= text.size();) {
      const int rc = pcre2_match(code_.get(), subject, text.size(), at, PCRE2_NO_UTF_CHECK, match.get(), nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) return;
      if (rc < 0) {  // e.g. a file's pattern that backtracks past PCRE2's match limit
        std::array<PCRE2_UCHAR, 256> message{};
        pcre2_get_error_message(rc, message.data(), message.size());
        throw std::runtime_error(std::string("a pre-tokenizer pattern failed on the text: ") +
                                 reinterpret_cast<const char*>(message.data()));
      }
      const PCRE2_SIZE* span = pcre2_get_ovector_pointer(match.get());
      const size_t begin = span[0], end = span[1];
      if (end > begin) f(begin, end);
      at = end > begin ? end : (end < text.size() ? end + utf8_length(text, end) : text.size() + 1);
    }
  }

 private:
  std::shared_ptr<pcre2_code> code_;
};

}  // namespace detail

// The chat formats `apply_chat_template` writes (see detect_chat_template).
enum class ChatTemplate { llama3, chatml, zephyr, inst };

class HfTokenizer {
 public:
  // Reads `path`, a tokenizer.json or a folder holding one. The file is untrusted: its size is
  // bounded by limits.max_json_bytes, ids by limits.max_vocab_size, and a JSON array or object
  // may hold up to 4 x max_vocab_size entries (vocabularies and merge lists are that long).
  static HfTokenizer load(const std::filesystem::path& path, const LoadLimits& limits = {}) {
    const std::filesystem::path file = std::filesystem::is_directory(path) ? path / "tokenizer.json" : path;
    const nlohmann::json json = detail::read_json(file, detail::tokenizer_limits(limits));
    if (!json.is_object()) detail::throw_format(file, "the top level is not a JSON object");
    HfTokenizer tokenizer;
    tokenizer.file_ = file;
    tokenizer.read_model(json, limits);
    tokenizer.read_added_tokens(json, limits);
    tokenizer.read_normalizer(json.value("normalizer", nlohmann::json()), "normalizer");
    tokenizer.read_pre_tokenizer(json.value("pre_tokenizer", nlohmann::json()), "pre_tokenizer");
    tokenizer.read_post_processor(json.value("post_processor", nlohmann::json()), "post_processor");
    tokenizer.read_decoder(json.value("decoder", nlohmann::json()), "decoder");
    tokenizer.measure_tokens();
    return tokenizer;
  }

  // One more than the largest id of the vocabulary and the added tokens.
  [[nodiscard]] int64_t vocab_size() const noexcept { return static_cast<int64_t>(tokens_.size()); }
  [[nodiscard]] const std::filesystem::path& file() const noexcept { return file_; }

  // The id of a vocabulary entry or added token, written as in the file ("Ġthe", "▁the", "<s>").
  [[nodiscard]] std::optional<int64_t> token_to_id(std::string_view token) const {
    if (const auto it = added_ids_.find(token); it != added_ids_.end()) return it->second;
    return vocab_id(token);
  }
  // The entry of `id` as the file writes it. Throws std::invalid_argument for an id with none.
  [[nodiscard]] const std::string& id_to_token(int64_t id) const { return tokens_[checked(id)]; }
  // Whether `id` is an added token marked special (BOS, EOS, chat markers).
  [[nodiscard]] bool is_special(int64_t id) const { return special_[checked(id)] != 0; }

  // What the post-processor puts before and after a single sequence (e.g. BOS), empty for none.
  [[nodiscard]] const std::vector<int64_t>& prefix_tokens() const noexcept { return prefix_; }
  [[nodiscard]] const std::vector<int64_t>& suffix_tokens() const noexcept { return suffix_; }

  // The most input bytes one token can stand for: a text of B bytes encodes to at least
  // B / max_token_bytes() tokens, a bound a caller can check before encoding. A tokenizer whose
  // unk token can stand for any run of characters has no bound (the largest int64_t).
  [[nodiscard]] int64_t max_token_bytes() const noexcept { return max_token_bytes_; }

  // The ids of `text` (UTF-8; std::invalid_argument otherwise), with the post-processor's
  // tokens (e.g. BOS) when `add_special_tokens`.
  [[nodiscard]] std::vector<int64_t> encode(std::string_view text, bool add_special_tokens = true) const {
    detail::require_utf8(text, "the text");
    std::vector<int64_t> ids;
    if (add_special_tokens) ids = prefix_;
    bool first = true;
    for_each_segment(text, [&](std::string_view segment, int64_t added) {
      if (added >= 0) {
        ids.push_back(added);
      } else {
        encode_segment(segment, first, ids);
      }
      first = false;
    });
    if (add_special_tokens) ids.insert(ids.end(), suffix_.begin(), suffix_.end());
    return ids;
  }

  // The bytes `tokens` stand for, through the decoder; special tokens left out when
  // `skip_special_tokens`.
  [[nodiscard]] std::string decode(std::span<const int64_t> tokens, bool skip_special_tokens = false) const {
    std::vector<std::string> pieces;
    pieces.reserve(tokens.size());
    for (const int64_t id : tokens) {
      const size_t i = checked(id);
      if (skip_special_tokens && special_[i] != 0) continue;
      pieces.push_back(tokens_[i]);
    }
    return run_decoder(std::move(pieces), /*at_start=*/true);
  }

  // The bytes of `token` following `previous` (-1 at the start of a text): what a stream prints.
  // The decoder's start-of-text rules (Strip, Metaspace's first space) apply when `previous` is
  // -1 or a special token, so the pieces of a sequence after BOS join to decode(sequence, true).
  [[nodiscard]] std::string decode_piece(int64_t previous, int64_t token) const {
    const bool at_start = previous < 0 || is_special(previous);
    return run_decoder({tokens_[checked(token)]}, at_start);
  }

 private:
  enum class Kind {
    nfc, prepend, replace,                                              // normalizers
    split, byte_level, metaspace,                                       // pre-tokenizers (and decoders)
    byte_fallback, fuse, strip                                          // decoders
  };
  enum class SplitBehavior { isolated, removed, merged_with_previous, merged_with_next };
  enum class Prepend { always, first, never };
  struct Step {
    Kind kind{};
    std::string a{}, b{};  // prepend: a; replace: a -> b; metaspace: a = replacement; strip: a = content
    std::optional<detail::Regex> regex{};
    SplitBehavior behavior = SplitBehavior::isolated;
    bool flag = false;  // byte_level: add_prefix_space; metaspace: split
    bool use_regex = false;
    Prepend prepend = Prepend::always;
    int64_t start = 0, stop = 0;
  };
  struct Added {
    std::string content{};
    int64_t id{};
    bool lstrip, rstrip, single_word;
  };
  struct Merge {
    int32_t rank{};
    int32_t merged{};
  };

  // ---- reading -------------------------------------------------------------------------------

  [[noreturn]] void unsupported(const std::string& field, const nlohmann::json& value, const char* supported) const {
    detail::throw_format(file_, field, " ", detail::excerpt(value), " is not supported (supported: ", supported, ")");
  }

  std::string string_at(const nlohmann::json& object, const std::string& field, const char* key) const {
    if (!object.is_object() || !object.contains(key) || !object.at(key).is_string()) {
      detail::throw_format(file_, field, ".", key, " must be a string");
    }
    return object.at(key).get<std::string>();
  }

  bool bool_at(const nlohmann::json& object, const std::string& field, const char* key, bool fallback) const {
    if (!object.contains(key) || object.at(key).is_null()) return fallback;
    if (!object.at(key).is_boolean()) detail::throw_format(file_, field, ".", key, " must be true or false");
    return object.at(key).get<bool>();
  }

  int64_t id_at(const nlohmann::json& value, const std::string& field, const LoadLimits& limits) const {
    if (!value.is_number_integer() || (!value.is_number_unsigned() && value.get<int64_t>() < 0) ||
        value.get<uint64_t>() >= static_cast<uint64_t>(limits.max_vocab_size)) {
      detail::throw_format(file_, field, " = ", detail::excerpt(value), " is not an id in [0, ",
                           limits.max_vocab_size, ") (LoadLimits::max_vocab_size)");
    }
    return value.get<int64_t>();
  }

  void define(int64_t id, const std::string& token, const std::string& field) {
    if (static_cast<size_t>(id) >= tokens_.size()) {
      tokens_.resize(static_cast<size_t>(id) + 1);
      defined_.resize(tokens_.size(), 0);
      special_.resize(tokens_.size(), 0);
    }
    if (defined_[static_cast<size_t>(id)] != 0 && tokens_[static_cast<size_t>(id)] != token) {
      detail::throw_format(file_, field, ": id ", id, " is given to both '", detail::printable(tokens_[static_cast<size_t>(id)]),
                           "' and '", detail::printable(token), "'");
    }
    tokens_[static_cast<size_t>(id)] = token;
    defined_[static_cast<size_t>(id)] = 1;
  }

  void read_model(const nlohmann::json& json, const LoadLimits& limits) {
    if (!json.contains("model") || !json.at("model").is_object()) detail::throw_format(file_, "model must be an object");
    const nlohmann::json& model = json.at("model");
    if (model.value("type", std::string("BPE")) != "BPE") unsupported("model.type", model.at("type"), "BPE");
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      if (model.contains(key) && !model.at(key).is_null() &&
          !(model.at(key).is_string() && model.at(key).get<std::string>().empty())) {
        unsupported(std::string("model.") + key, model.at(key), "null or \"\"");
      }
    }
    if (model.contains("dropout") && !model.at("dropout").is_null() &&
        !(model.at("dropout").is_number() && model.at("dropout").get<double>() == 0.0)) {
      unsupported("model.dropout", model.at("dropout"), "null or 0: encoding is deterministic");
    }
    if (!model.contains("vocab") || !model.at("vocab").is_object()) detail::throw_format(file_, "model.vocab must be an object");
    const nlohmann::json& vocab = model.at("vocab");
    vocab_.reserve(vocab.size());
    for (const auto& [token, value] : vocab.items()) {
      const int64_t id = id_at(value, "model.vocab['" + detail::printable(token) + "']", limits);
      if (!vocab_.emplace(token, id).second) continue;
      define(id, token, "model.vocab");
    }
    ignore_merges_ = bool_at(model, "model", "ignore_merges", false);
    byte_fallback_ = bool_at(model, "model", "byte_fallback", false);
    fuse_unk_ = bool_at(model, "model", "fuse_unk", false);
    if (model.contains("unk_token") && !model.at("unk_token").is_null()) {
      const std::string unk = string_at(model, "model", "unk_token");
      const auto id = vocab_id(unk);
      if (!id) detail::throw_format(file_, "model.unk_token '", detail::printable(unk), "' is not in model.vocab");
      unk_ = *id;
    }
    if (!model.contains("merges") || !model.at("merges").is_array()) detail::throw_format(file_, "model.merges must be an array");
    const nlohmann::json& merges = model.at("merges");
    merges_.reserve(merges.size());
    for (size_t rank = 0; rank < merges.size(); ++rank) {
      const nlohmann::json& entry = merges[rank];
      const std::string field = "model.merges[" + std::to_string(rank) + "]";
      std::string left, right;
      if (entry.is_string()) {
        const std::string text = entry.get<std::string>();
        const size_t space = text.find(' ');
        if (space == std::string::npos || text.find(' ', space + 1) != std::string::npos) {
          detail::throw_format(file_, field, " = ", detail::excerpt(entry), " is not two tokens separated by one space");
        }
        left = text.substr(0, space), right = text.substr(space + 1);
      } else if (entry.is_array() && entry.size() == 2 && entry[0].is_string() && entry[1].is_string()) {
        left = entry[0].get<std::string>(), right = entry[1].get<std::string>();
      } else {
        detail::throw_format(file_, field, " = ", detail::excerpt(entry), " is neither \"a b\" nor [\"a\", \"b\"]");
      }
      const auto a = vocab_id(left), b = vocab_id(right), merged = vocab_id(left + right);
      if (!a || !b || !merged) {
        detail::throw_format(file_, field, " = ", detail::excerpt(entry), ": ", !a ? "its first token" : !b ? "its second token" : "the merged token",
                             " is not in model.vocab");
      }
      merges_.emplace(pair_key(*a, *b), Merge{static_cast<int32_t>(rank), static_cast<int32_t>(*merged)});  // first rank wins
    }
    for (int b = 0; b < 256; ++b) {
      static constexpr char kHex[] = "0123456789ABCDEF";
      const std::string name = std::string("<0x") + kHex[b >> 4] + kHex[b & 15] + ">";
      byte_tokens_[static_cast<size_t>(b)] = vocab_id(name).value_or(-1);
    }
  }

  void read_added_tokens(const nlohmann::json& json, const LoadLimits& limits) {
    if (!json.contains("added_tokens") || json.at("added_tokens").is_null()) return;
    if (!json.at("added_tokens").is_array()) detail::throw_format(file_, "added_tokens must be an array");
    const nlohmann::json& added = json.at("added_tokens");
    for (size_t i = 0; i < added.size(); ++i) {
      const std::string field = "added_tokens[" + std::to_string(i) + "]";
      const nlohmann::json& entry = added[i];
      if (!entry.is_object() || !entry.contains("id")) detail::throw_format(file_, field, " must be an object with an id");
      const int64_t id = id_at(entry.at("id"), field + ".id", limits);
      const std::string content = string_at(entry, field, "content");
      if (content.empty()) detail::throw_format(file_, field, ".content is empty");
      define(id, content, field);
      special_[static_cast<size_t>(id)] = bool_at(entry, field, "special", false) ? 1 : 0;
      added_ids_[content] = id;
      added_.push_back({content, id, bool_at(entry, field, "lstrip", false), bool_at(entry, field, "rstrip", false),
                        bool_at(entry, field, "single_word", false)});
    }
    // Longest first, so the first match at a position is the longest.
    std::stable_sort(added_.begin(), added_.end(),
                     [](const Added& x, const Added& y) { return x.content.size() > y.content.size(); });
    for (size_t i = 0; i < added_.size(); ++i) {
      added_by_byte_[static_cast<unsigned char>(added_[i].content.front())].push_back(static_cast<uint32_t>(i));
    }
  }

  void read_normalizer(const nlohmann::json& value, const std::string& field) {
    if (value.is_null()) return;
    const std::string type = string_at(value, field, "type");
    if (type == "Sequence") {
      for_each_item(value, field, "normalizers", [&](const nlohmann::json& item, const std::string& where) { read_normalizer(item, where); });
    } else if (type == "NFC") {
      normalizers_.push_back({.kind = Kind::nfc});
    } else if (type == "Prepend") {
      normalizers_.push_back({.kind = Kind::prepend, .a = string_at(value, field, "prepend")});
    } else if (type == "Replace") {
      normalizers_.push_back(replace_step(value, field));
    } else {
      unsupported(field + ".type", value.at("type"), "NFC, Prepend, Replace, Sequence");
    }
  }

  // Calls read(item, "field.key[i]") for each item of the array value[key] of a Sequence.
  template <class Read>
  void for_each_item(const nlohmann::json& value, const std::string& field, const char* key, Read&& read) const {
    const nlohmann::json& list = value.value(key, nlohmann::json());
    if (!list.is_array()) detail::throw_format(file_, field, ".", key, " must be an array");
    for (size_t i = 0; i < list.size(); ++i) read(list[i], field + "." + key + "[" + std::to_string(i) + "]");
  }

  Step replace_step(const nlohmann::json& value, const std::string& field) const {
    const nlohmann::json pattern = value.value("pattern", nlohmann::json());
    if (!pattern.is_object() || !pattern.contains("String") || !pattern.at("String").is_string()) {
      unsupported(field + ".pattern", pattern, "{\"String\": ...}");
    }
    const std::string from = pattern.at("String").get<std::string>();
    if (from.empty()) detail::throw_format(file_, field, ".pattern.String is empty");
    return {.kind = Kind::replace, .a = from, .b = string_at(value, field, "content")};
  }

  Prepend prepend_scheme(const nlohmann::json& value, const std::string& field) const {
    if (value.contains("prepend_scheme")) {
      const std::string scheme = string_at(value, field, "prepend_scheme");
      if (scheme == "always") return Prepend::always;
      if (scheme == "first") return Prepend::first;
      if (scheme == "never") return Prepend::never;
      unsupported(field + ".prepend_scheme", value.at("prepend_scheme"), "always, first, never");
    }
    return bool_at(value, field, "add_prefix_space", true) ? Prepend::always : Prepend::never;
  }

  void read_pre_tokenizer(const nlohmann::json& value, const std::string& field) {
    if (value.is_null()) return;
    const std::string type = string_at(value, field, "type");
    if (type == "Sequence") {
      for_each_item(value, field, "pretokenizers", [&](const nlohmann::json& item, const std::string& where) { read_pre_tokenizer(item, where); });
    } else if (type == "Split") {
      const nlohmann::json pattern = value.value("pattern", nlohmann::json());
      const bool literal = pattern.is_object() && pattern.contains("String") && pattern.at("String").is_string();
      const bool regex = pattern.is_object() && pattern.contains("Regex") && pattern.at("Regex").is_string();
      if (!literal && !regex) unsupported(field + ".pattern", pattern, "{\"Regex\": ...} or {\"String\": ...}");
      if (bool_at(value, field, "invert", false)) unsupported(field + ".invert", value.at("invert"), "false");
      static const std::array<std::pair<const char*, SplitBehavior>, 4> kBehaviors{{
          {"Isolated", SplitBehavior::isolated}, {"Removed", SplitBehavior::removed},
          {"MergedWithPrevious", SplitBehavior::merged_with_previous}, {"MergedWithNext", SplitBehavior::merged_with_next}}};
      const std::string behavior = string_at(value, field, "behavior");
      const auto found = std::find_if(kBehaviors.begin(), kBehaviors.end(), [&](const auto& b) { return behavior == b.first; });
      if (found == kBehaviors.end()) {
        unsupported(field + ".behavior", value.at("behavior"), "Isolated, Removed, MergedWithPrevious, MergedWithNext");
      }
      Step step{.kind = Kind::split, .behavior = found->second};
      step.regex.emplace(pattern.at(literal ? "String" : "Regex").get<std::string>(), literal, file_, field + ".pattern");
      pre_tokenizers_.push_back(std::move(step));
    } else if (type == "ByteLevel") {
      Step step{.kind = Kind::byte_level, .flag = bool_at(value, field, "add_prefix_space", true),
                .use_regex = bool_at(value, field, "use_regex", true)};
      if (step.use_regex) {  // GPT-2's pattern
        step.regex.emplace(R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)", false, file_, field);
      }
      pre_tokenizers_.push_back(std::move(step));
    } else if (type == "Metaspace") {
      pre_tokenizers_.push_back({.kind = Kind::metaspace, .a = metaspace_replacement(value, field),
                                 .flag = bool_at(value, field, "split", true), .prepend = prepend_scheme(value, field)});
    } else {
      unsupported(field + ".type", value.at("type"), "Split, ByteLevel, Metaspace, Sequence");
    }
  }

  std::string metaspace_replacement(const nlohmann::json& value, const std::string& field) const {
    const std::string replacement = string_at(value, field, "replacement");
    if (replacement.empty()) detail::throw_format(file_, field, ".replacement is empty");
    return replacement;
  }

  void read_post_processor(const nlohmann::json& value, const std::string& field) {
    if (value.is_null()) return;
    const std::string type = string_at(value, field, "type");
    if (type == "Sequence") {
      for_each_item(value, field, "processors", [&](const nlohmann::json& item, const std::string& where) { read_post_processor(item, where); });
    } else if (type == "ByteLevel") {
      // Offsets only: the ids are unchanged.
    } else if (type == "TemplateProcessing") {
      const nlohmann::json& single = value.value("single", nlohmann::json());
      const nlohmann::json& specials = value.value("special_tokens", nlohmann::json::object());
      if (!single.is_array()) detail::throw_format(file_, field, ".single must be an array");
      if (!prefix_.empty() || !suffix_.empty()) detail::throw_format(file_, field, ": a second TemplateProcessing");
      bool sequence = false;
      for (size_t i = 0; i < single.size(); ++i) {
        const std::string item = field + ".single[" + std::to_string(i) + "]";
        if (single[i].contains("Sequence")) {
          if (sequence) detail::throw_format(file_, item, ": a second Sequence");
          sequence = true;
          continue;
        }
        if (!single[i].contains("SpecialToken")) unsupported(item, single[i], "SpecialToken, Sequence");
        const std::string name = string_at(single[i].at("SpecialToken"), item + ".SpecialToken", "id");
        if (!specials.is_object() || !specials.contains(name) || !specials.at(name).is_object() ||
            !specials.at(name).contains("ids") || !specials.at(name).at("ids").is_array()) {
          detail::throw_format(file_, item, ": special_tokens['", detail::printable(name), "'].ids is missing");
        }
        for (const nlohmann::json& id : specials.at(name).at("ids")) {
          const int64_t token = id_at(id, field + ".special_tokens['" + detail::printable(name) + "'].ids", {});
          if (token >= vocab_size() || defined_[static_cast<size_t>(token)] == 0) {
            detail::throw_format(file_, field, ".special_tokens['", detail::printable(name), "']: id ", token,
                                 " is neither in the vocabulary nor an added token");
          }
          (sequence ? suffix_ : prefix_).push_back(token);
        }
      }
      if (!sequence) detail::throw_format(file_, field, ".single has no Sequence");
    } else {
      unsupported(field + ".type", value.at("type"), "TemplateProcessing, ByteLevel, Sequence");
    }
  }

  void read_decoder(const nlohmann::json& value, const std::string& field) {
    if (value.is_null()) return;
    const std::string type = string_at(value, field, "type");
    if (type == "Sequence") {
      for_each_item(value, field, "decoders", [&](const nlohmann::json& item, const std::string& where) { read_decoder(item, where); });
    } else if (type == "ByteLevel") {
      decoders_.push_back({.kind = Kind::byte_level});
    } else if (type == "Replace") {
      decoders_.push_back(replace_step(value, field));
    } else if (type == "ByteFallback") {
      decoders_.push_back({.kind = Kind::byte_fallback});
    } else if (type == "Fuse") {
      decoders_.push_back({.kind = Kind::fuse});
    } else if (type == "Strip") {
      const std::string content = string_at(value, field, "content");
      const auto count = [&](const char* key) {
        if (!value.contains(key) || !value.at(key).is_number_unsigned() || value.at(key).get<uint64_t>() > 64) {
          detail::throw_format(file_, field, ".", key, " must be an integer in [0, 64]");
        }
        return value.at(key).get<int64_t>();
      };
      decoders_.push_back({.kind = Kind::strip, .a = content, .start = count("start"), .stop = count("stop")});
    } else if (type == "Metaspace") {
      decoders_.push_back({.kind = Kind::metaspace, .a = metaspace_replacement(value, field), .prepend = prepend_scheme(value, field)});
    } else {
      unsupported(field + ".type", value.at("type"), "ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace, Sequence");
    }
  }

  // The most input bytes one token stands for: its decoded length (a "▁" or a byte-level
  // character stands for one byte, an added token for its text).
  void measure_tokens() {
    int64_t most = 1;
    for (size_t id = 0; id < tokens_.size(); ++id) {
      if (defined_[id] != 0) most = std::max<int64_t>(most, static_cast<int64_t>(run_decoder({tokens_[id]}, false).size()));
    }
    const bool every_byte = std::all_of(byte_tokens_.begin(), byte_tokens_.end(), [](int64_t t) { return t >= 0; });
    const bool byte_level = std::any_of(pre_tokenizers_.begin(), pre_tokenizers_.end(), [](const Step& s) { return s.kind == Kind::byte_level; });
    if (unk_ >= 0 && !byte_level && !(byte_fallback_ && every_byte)) most = std::numeric_limits<int64_t>::max();
    max_token_bytes_ = most;
  }

  // ---- encoding ------------------------------------------------------------------------------

  static uint64_t pair_key(int64_t a, int64_t b) { return static_cast<uint64_t>(a) << 32 | static_cast<uint64_t>(b); }

  [[nodiscard]] std::optional<int64_t> vocab_id(std::string_view token) const {
    const auto it = vocab_.find(token);  // no string built per look-up
    return it == vocab_.end() ? std::nullopt : std::optional(it->second);
  }

  [[nodiscard]] size_t checked(int64_t id) const {
    if (id < 0 || id >= vocab_size() || defined_[static_cast<size_t>(id)] == 0) {
      throw std::invalid_argument("token must be an id of the tokenizer in [0, " + std::to_string(vocab_size()) +
                                  "), got " + std::to_string(id));
    }
    return static_cast<size_t>(id);
  }

  static bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }
  static bool is_word_byte(char c) {
    const auto b = static_cast<unsigned char>(c);
    return b >= 0x80 || (b >= '0' && b <= '9') || (b >= 'a' && b <= 'z') || (b >= 'A' && b <= 'Z') || b == '_';
  }

  // Calls f(text, -1) for the stretches between added tokens and f("", id) for each added token,
  // in order. Added tokens match leftmost, longest first; lstrip/rstrip take the whitespace before
  // or after them; a single_word token matches only between non-word characters.
  template <class F>
  void for_each_segment(std::string_view text, F&& f) const {
    size_t emitted = 0;
    for (size_t at = 0; at < text.size();) {
      const Added* match = nullptr;
      for (const uint32_t i : added_by_byte_[static_cast<unsigned char>(text[at])]) {
        const Added& a = added_[i];
        if (text.compare(at, a.content.size(), a.content) != 0) continue;
        if (a.single_word && ((at > 0 && is_word_byte(text[at - 1])) ||
                              (at + a.content.size() < text.size() && is_word_byte(text[at + a.content.size()])))) {
          continue;
        }
        match = &a;
        break;
      }
      if (match == nullptr) {
        ++at;
        continue;
      }
      size_t before = at, after = at + match->content.size();
      if (match->lstrip) while (before > emitted && is_space(text[before - 1])) --before;
      if (match->rstrip) while (after < text.size() && is_space(text[after])) ++after;
      if (before > emitted) f(text.substr(emitted, before - emitted), int64_t{-1});
      f(std::string_view(), match->id);
      emitted = at = after;
    }
    if (emitted < text.size()) f(text.substr(emitted), int64_t{-1});
  }

  static void replace_all(std::string& text, const std::string& from, const std::string& to) {
    std::string out;
    size_t at = 0;
    for (size_t hit; (hit = text.find(from, at)) != std::string::npos; at = hit + from.size()) {
      out.append(text, at, hit - at).append(to);
    }
    text = out.append(text, at, std::string::npos);
  }

  std::string normalize(std::string_view segment) const {
    std::string text(segment);
    for (const Step& step : normalizers_) {
      if (step.kind == Kind::nfc) {
        utf8proc_uint8_t* composed = utf8proc_NFC(reinterpret_cast<const utf8proc_uint8_t*>(text.c_str()));
        if (composed == nullptr) throw std::invalid_argument("the text could not be NFC-normalized");
        text.assign(reinterpret_cast<const char*>(composed));
        std::free(composed);
      } else if (step.kind == Kind::prepend) {
        if (!text.empty()) text.insert(0, step.a);
      } else {
        replace_all(text, step.a, step.b);
      }
    }
    return text;
  }

  // One pre-tokenizer step over `pieces`.
  void pre_tokenize(const Step& step, bool first, std::vector<std::string>& pieces) const {
    std::vector<std::string> out;
    // Split: matches and the gaps between them, kept apart (isolated), the matches dropped
    // (removed), or each match joined to the gap before it or the text after it.
    const auto split = [&](const detail::Regex& regex, SplitBehavior behavior, const std::string& piece) {
      std::string current;
      size_t last = 0;
      const auto flush = [&] {
        if (!current.empty()) out.push_back(std::move(current));
        current.clear();
      };
      regex.for_each_match(piece, [&](size_t begin, size_t end) {
        current += piece.substr(last, begin - last);
        const std::string hit = piece.substr(begin, end - begin);
        switch (behavior) {
          case SplitBehavior::isolated:
            flush();
            out.push_back(hit);
            break;
          case SplitBehavior::removed:
            flush();
            break;
          case SplitBehavior::merged_with_previous:
            current += hit;
            flush();
            break;
          case SplitBehavior::merged_with_next:
            flush();
            current = hit;
            break;
        }
        last = end;
      });
      current += piece.substr(last);
      flush();
    };
    for (std::string& piece : pieces) {
      if (step.kind == Kind::split) {
        split(*step.regex, step.behavior, piece);
      } else if (step.kind == Kind::byte_level) {
        if (step.flag && !piece.empty() && piece.front() != ' ') piece.insert(0, " ");
        std::vector<std::string> words;
        if (step.use_regex) {
          step.regex->for_each_match(piece, [&](size_t begin, size_t end) { words.push_back(piece.substr(begin, end - begin)); });
        } else {
          words.push_back(std::move(piece));
        }
        const auto& table = detail::byte_level_table();
        for (const std::string& word : words) {
          std::string mapped;
          for (const char c : word) mapped += table.to_char[static_cast<unsigned char>(c)];
          out.push_back(std::move(mapped));
        }
      } else {  // metaspace
        replace_all(piece, " ", step.a);
        if ((step.prepend == Prepend::always || (step.prepend == Prepend::first && first)) &&
            piece.compare(0, step.a.size(), step.a) != 0) {
          piece.insert(0, step.a);
        }
        if (!step.flag) {
          out.push_back(std::move(piece));
          continue;
        }
        size_t start = 0;  // split before each replacement character, keeping it
        for (size_t hit = piece.find(step.a, 1); hit != std::string::npos; hit = piece.find(step.a, hit + 1)) {
          if (hit > start) out.push_back(piece.substr(start, hit - start));
          start = hit;
        }
        out.push_back(piece.substr(start));
      }
    }
    pieces = std::move(out);
  }

  void encode_segment(std::string_view segment, bool first, std::vector<int64_t>& ids) const {
    std::vector<std::string> pieces{normalize(segment)};
    for (const Step& step : pre_tokenizers_) pre_tokenize(step, first, pieces);
    for (const std::string& piece : pieces) {
      if (!piece.empty()) bpe(piece, ids);
    }
  }

  // Byte-pair encoding of one pre-tokenized piece: its characters (or their byte tokens, or unk),
  // then repeatedly the adjacent pair of lowest merge rank, leftmost on ties.
  void bpe(const std::string& piece, std::vector<int64_t>& ids) const {
    if (ignore_merges_) {
      if (const auto whole = vocab_id(piece)) {
        ids.push_back(*whole);
        return;
      }
    }
    std::vector<int64_t> symbols;
    for (size_t i = 0; i < piece.size();) {
      const size_t n = detail::utf8_length(piece, i);
      if (const auto id = vocab_id(std::string_view(piece).substr(i, n))) {
        symbols.push_back(*id);
      } else if (byte_fallback_ && std::all_of(piece.begin() + static_cast<std::ptrdiff_t>(i),
                                               piece.begin() + static_cast<std::ptrdiff_t>(i + n),
                                               [&](char c) { return byte_tokens_[static_cast<unsigned char>(c)] >= 0; })) {
        for (size_t b = i; b < i + n; ++b) symbols.push_back(byte_tokens_[static_cast<unsigned char>(piece[b])]);
      } else if (unk_ >= 0) {
        if (!(fuse_unk_ && !symbols.empty() && symbols.back() == unk_)) symbols.push_back(unk_);
      } else {
        throw std::invalid_argument("the tokenizer has no token for the character '" + piece.substr(i, n) +
                                    "' and no byte-fallback or unk token");
      }
      i += n;
    }
    merge(symbols);
    ids.insert(ids.end(), symbols.begin(), symbols.end());
  }

  // Merges by rank: the lowest-ranked adjacent pair first, the leftmost on ties.
  void merge(std::vector<int64_t>& symbols) const {
    detail::merge_pairs(symbols, 0, [&](int64_t left, int64_t right) -> std::optional<detail::PairMerge> {
      const auto it = merges_.find(pair_key(left, right));
      if (it == merges_.end()) return std::nullopt;
      return detail::PairMerge{-static_cast<double>(it->second.rank), it->second.merged};
    });
  }

  // ---- decoding ------------------------------------------------------------------------------

  // The decoder chain over token strings, as `tokenizers` runs it; `at_start` says whether the
  // first piece begins the text (Strip's start count and Metaspace's first space apply there).
  std::string run_decoder(std::vector<std::string> pieces, bool at_start) const {
    for (const Step& step : decoders_) {
      switch (step.kind) {
        case Kind::byte_level: {
          const auto& table = detail::byte_level_table();
          std::string bytes;
          for (const std::string& piece : pieces) {
            const auto* data = reinterpret_cast<const utf8proc_uint8_t*>(piece.data());
            for (size_t i = 0; i < piece.size();) {
              utf8proc_int32_t c = 0;
              const auto n = utf8proc_iterate(data + i, static_cast<utf8proc_ssize_t>(piece.size() - i), &c);
              const size_t length = n > 0 ? static_cast<size_t>(n) : 1;
              const auto it = table.to_byte.find(c);
              if (n > 0 && it != table.to_byte.end()) bytes += static_cast<char>(it->second);
              else bytes.append(piece, i, length);  // not a byte-level character: as written
              i += length;
            }
          }
          pieces.assign(1, std::move(bytes));
          break;
        }
        case Kind::replace:
          for (std::string& piece : pieces) replace_all(piece, step.a, step.b);
          break;
        case Kind::byte_fallback:
          for (std::string& piece : pieces) {
            if (const auto byte = detail::byte_of(piece)) piece.assign(1, static_cast<char>(*byte));
          }
          break;
        case Kind::fuse: {
          std::string joined;
          for (const std::string& piece : pieces) joined += piece;
          pieces.assign(1, std::move(joined));
          break;
        }
        case Kind::strip:
          for (size_t i = 0; i < pieces.size(); ++i) {
            std::string& piece = pieces[i];
            for (int64_t k = 0; k < (at_start || i > 0 ? step.start : 0) && piece.compare(0, step.a.size(), step.a) == 0; ++k) {
              piece.erase(0, step.a.size());
            }
            for (int64_t k = 0; k < step.stop && piece.size() >= step.a.size() &&
                                piece.compare(piece.size() - step.a.size(), step.a.size(), step.a) == 0;
                 ++k) {
              piece.erase(piece.size() - step.a.size());
            }
          }
          break;
        case Kind::metaspace:
          for (size_t i = 0; i < pieces.size(); ++i) {
            replace_all(pieces[i], step.a, " ");
            if (i == 0 && at_start && step.prepend != Prepend::never && !pieces[i].empty() && pieces[i].front() == ' ') {
              pieces[i].erase(0, 1);
            }
          }
          break;
        default:
          break;
      }
    }
    std::string text;
    for (const std::string& piece : pieces) text += piece;
    return text;
  }

  std::filesystem::path file_;
  std::unordered_map<std::string, int64_t, detail::StringHash, std::equal_to<>> vocab_;
  std::unordered_map<uint64_t, Merge> merges_;
  std::vector<std::string> tokens_;  // id -> entry as written
  std::vector<uint8_t> defined_, special_;
  std::vector<Added> added_;
  std::unordered_map<std::string, int64_t, detail::StringHash, std::equal_to<>> added_ids_;
  std::array<std::vector<uint32_t>, 256> added_by_byte_;
  std::array<int64_t, 256> byte_tokens_{};
  std::vector<Step> normalizers_, pre_tokenizers_, decoders_;
  std::vector<int64_t> prefix_, suffix_;
  bool ignore_merges_ = false, byte_fallback_ = false, fuse_unk_ = false;
  int64_t unk_ = -1;
  int64_t max_token_bytes_ = 1;
};

// What a Hugging Face model folder says about its text beyond the tokenizer:
// tokenizer_config.json's add_bos_token, bos_token and eos_token, generation_config.json's
// bos_token_id and eos_token_id (one id or a list), and the chat format its template uses.
struct HfTextSettings {
  std::optional<bool> add_bos_token{};
  std::optional<int64_t> bos_token_id{};
  std::vector<int64_t> eos_token_ids{};
  std::optional<ChatTemplate> chat{};
};

namespace detail {

// A token of tokenizer_config.json: a string or an object with "content".
inline std::optional<int64_t> config_token(const nlohmann::json& config, const char* key, const HfTokenizer& tokenizer,
                                           const std::filesystem::path& file) {
  if (!config.contains(key) || config.at(key).is_null()) return std::nullopt;
  const nlohmann::json& value = config.at(key);
  const nlohmann::json& content = value.is_object() ? value.value("content", nlohmann::json()) : value;
  if (!content.is_string()) throw_format(file, key, " must be a string or an object with a string content");
  const auto id = tokenizer.token_to_id(content.get<std::string>());
  if (!id) throw_format(file, key, " '", printable(content.get<std::string>()), "' is not a token of ", tokenizer.file().string());
  return id;
}

inline int64_t token_id(const nlohmann::json& value, const HfTokenizer& tokenizer, const std::filesystem::path& file,
                        const char* key) {
  if (!value.is_number_integer() || (!value.is_number_unsigned() && value.get<int64_t>() < 0) ||
      value.get<uint64_t>() >= static_cast<uint64_t>(tokenizer.vocab_size())) {
    throw_format(file, key, " = ", excerpt(value), " is not an id in [0, ", tokenizer.vocab_size(), ")");
  }
  return value.get<int64_t>();
}

}  // namespace detail

// The chat format of a tokenizer: llama3 where it has <|start_header_id|>, chatml where it has
// <|im_start|> (Qwen2/2.5/3), zephyr where the template writes <|user|> (TinyLlama chat), inst
// ([INST] ... [/INST]) where it writes [INST] (Llama 2 chat, Mistral); none otherwise.
inline std::optional<ChatTemplate> detect_chat_template(const HfTokenizer& tokenizer, std::string_view template_text) {
  if (tokenizer.token_to_id("<|start_header_id|>")) return ChatTemplate::llama3;
  if (tokenizer.token_to_id("<|im_start|>")) return ChatTemplate::chatml;
  if (template_text.find("<|user|>") != std::string_view::npos) return ChatTemplate::zephyr;
  if (template_text.find("[INST]") != std::string_view::npos) return ChatTemplate::inst;
  return std::nullopt;
}

// One user turn and the opening of the assistant's, in `format`, without BOS (which the
// tokenizer's settings add). No system message is written.
inline std::string apply_chat_template(ChatTemplate format, std::string_view user) {
  const std::string text(user);
  switch (format) {
    case ChatTemplate::llama3:
      return "<|start_header_id|>user<|end_header_id|>\n\n" + text + "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n";
    case ChatTemplate::chatml:
      return "<|im_start|>user\n" + text + "<|im_end|>\n<|im_start|>assistant\n";
    case ChatTemplate::zephyr:
      return "<|user|>\n" + text + "</s>\n<|assistant|>\n";
    case ChatTemplate::inst:
      return "[INST] " + text + " [/INST]";
  }
  return text;
}

// Reads tokenizer_config.json and generation_config.json from `folder` where present (both are
// optional; a present one must be well formed, with tokens the tokenizer knows).
inline HfTextSettings read_text_settings(const std::filesystem::path& folder, const HfTokenizer& tokenizer,
                                         const LoadLimits& limits = {}) {
  HfTextSettings settings;
  std::string template_text;
  if (const auto file = folder / "tokenizer_config.json"; std::filesystem::exists(file)) {
    const nlohmann::json config = detail::read_json(file, detail::tokenizer_limits(limits));
    if (!config.is_object()) detail::throw_format(file, "the top level is not a JSON object");
    if (config.contains("add_bos_token") && !config.at("add_bos_token").is_null()) {
      if (!config.at("add_bos_token").is_boolean()) detail::throw_format(file, "add_bos_token must be true or false");
      settings.add_bos_token = config.at("add_bos_token").get<bool>();
    }
    settings.bos_token_id = detail::config_token(config, "bos_token", tokenizer, file);
    if (const auto eos = detail::config_token(config, "eos_token", tokenizer, file)) settings.eos_token_ids.push_back(*eos);
    if (config.contains("chat_template") && config.at("chat_template").is_string()) {
      template_text = config.at("chat_template").get<std::string>();
    }
  }
  if (const auto file = folder / "generation_config.json"; std::filesystem::exists(file)) {
    const nlohmann::json config = detail::read_json(file, limits);
    if (!config.is_object()) detail::throw_format(file, "the top level is not a JSON object");
    if (config.contains("bos_token_id") && !config.at("bos_token_id").is_null()) {
      settings.bos_token_id = detail::token_id(config.at("bos_token_id"), tokenizer, file, "bos_token_id");
    }
    if (config.contains("eos_token_id") && !config.at("eos_token_id").is_null()) {
      const nlohmann::json& eos = config.at("eos_token_id");
      settings.eos_token_ids.clear();  // generation_config.json's list is the one generation uses
      if (eos.is_array()) {
        for (const nlohmann::json& id : eos) settings.eos_token_ids.push_back(detail::token_id(id, tokenizer, file, "eos_token_id"));
      } else {
        settings.eos_token_ids.push_back(detail::token_id(eos, tokenizer, file, "eos_token_id"));
      }
    }
  }
  settings.chat = detect_chat_template(tokenizer, template_text);
  return settings;
}

// The ids of `text` as a model folder's settings say: the post-processor's tokens unless
// tokenizer_config.json sets add_bos_token, and then BOS exactly when it is true.
inline std::vector<int64_t> encode_prompt(const HfTokenizer& tokenizer, const HfTextSettings& settings, std::string_view text) {
  if (!settings.add_bos_token) return tokenizer.encode(text, true);
  std::vector<int64_t> ids = tokenizer.encode(text, false);
  if (*settings.add_bos_token && settings.bos_token_id && (ids.empty() || ids.front() != *settings.bos_token_id)) {
    ids.insert(ids.begin(), *settings.bos_token_id);
  }
  return ids;
}

}  // namespace specdec::io
