// io::HfTokenizer (tokenizer.json): small hand-made tokenizers whose ids follow from the BPE
// rules by hand, every refusal of a malformed file, the model folder's text settings, and the
// real Llama 3, Qwen3 and Llama 2 tokenizers against ids made by @lenml/tokenizers
// (tests/data/hf_tokenizer_fixtures.json, scripts/make-tokenizer-fixtures.mjs).
#include <gtest/gtest.h>

#include <specdec/io/hf_tokenizer.hpp>

#include "support/shared_files.hpp"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

// One namespace a file: specdec_tests is compiled as a unity build (tests/CMakeLists.txt).
namespace test_hf_tokenizer {

namespace {

using specdec::io::ChatTemplate;
using specdec::io::FormatError;
using specdec::io::HfTokenizer;
using Ids = std::vector<int64_t>;
namespace fs = std::filesystem;

// A fresh folder under the system's temporary folder, removed at the end of the test.
class TempFolder {
 public:
  TempFolder() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() / (std::string("specdec_hf_tokenizer_") + info->name() + "_" +
                                         std::to_string(reinterpret_cast<uintptr_t>(this)));
    fs::create_directories(path_);
  }
  ~TempFolder() { fs::remove_all(path_); }
  fs::path write(const std::string& name, const std::string& text) const {
    std::ofstream(path_ / name, std::ios::binary) << text;
    return path_ / name;
  }
  [[nodiscard]] const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

// Byte-level: the 256 byte characters as ids 0..255, then Ġt, he, Ġthe, th. "t h" ranks after
// "h e", so "the" becomes t + he, not th + e.
nlohmann::json byte_level_json() {
  nlohmann::json vocab = nlohmann::json::object();
  const auto& table = specdec::io::detail::byte_level_table();
  for (int b = 0; b < 256; ++b) vocab[table.to_char[static_cast<size_t>(b)]] = b;
  vocab["Ġt"] = 256, vocab["he"] = 257, vocab["Ġthe"] = 258, vocab["th"] = 259;
  return {{"version", "1.0"},
          {"added_tokens", {{{"id", 260}, {"content", "<|end|>"}, {"special", true}},
                            {{"id", 261}, {"content", "<pad>"}, {"special", false}, {"lstrip", true}, {"rstrip", true}}}},
          {"normalizer", nullptr},
          {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
          {"post_processor", {{"type", "ByteLevel"}}},
          {"decoder", {{"type", "ByteLevel"}}},
          {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", {"Ġ t", "h e", "Ġt he", "t h"}}}}};
}

// SentencePiece style: ▁ for spaces, byte fallback for é, BOS from the template.
nlohmann::json sentencepiece_json() {
  nlohmann::json vocab{{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
  static constexpr char kHex[] = "0123456789ABCDEF";
  for (int b = 0; b < 256; ++b) vocab[std::string("<0x") + kHex[b >> 4] + kHex[b & 15] + ">"] = 3 + b;
  vocab["▁"] = 259, vocab["a"] = 260, vocab["b"] = 261, vocab["▁a"] = 262, vocab["ab"] = 263, vocab["▁ab"] = 264;
  return {{"added_tokens", {{{"id", 0}, {"content", "<unk>"}, {"special", true}},
                            {{"id", 1}, {"content", "<s>"}, {"special", true}},
                            {{"id", 2}, {"content", "</s>"}, {"special", true}}}},
          {"normalizer", {{"type", "Sequence"}, {"normalizers", {{{"type", "Prepend"}, {"prepend", "▁"}},
                                                                  {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "▁"}}}}}},
          {"pre_tokenizer", nullptr},
          {"post_processor", {{"type", "TemplateProcessing"},
                              {"single", {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
                              {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}}}}}},
          {"decoder", {{"type", "Sequence"}, {"decoders", {{{"type", "Replace"}, {"pattern", {{"String", "▁"}}}, {"content", " "}},
                                                            {{"type", "ByteFallback"}}, {{"type", "Fuse"}},
                                                            {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}}},
          {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", {"▁ a", "▁a b", "a b"}}, {"unk_token", "<unk>"},
                     {"byte_fallback", true}, {"fuse_unk", true}}}};
}

HfTokenizer load(const TempFolder& folder, const nlohmann::json& json) {
  return HfTokenizer::load(folder.write("tokenizer.json", json.dump()));
}

TEST(HfTokenizer, ByteLevelMergesByRankNotByPosition) {
  TempFolder folder;
  const HfTokenizer tokenizer = load(folder, byte_level_json());
  EXPECT_EQ(tokenizer.vocab_size(), 262);
  // "the" -> t h e: (h, e) has rank 1, (t, h) rank 3 -> t + he. " the" -> Ġthe through Ġt, he.
  EXPECT_EQ(tokenizer.encode("the the"), (Ids{'t', 257, 258}));
  EXPECT_EQ(tokenizer.decode(Ids{'t', 257, 258}), "the the");
  // A byte outside printable ASCII goes through the byte-to-unicode table and back.
  const std::string text = "tab\there\n\xc3\xa9";
  EXPECT_EQ(tokenizer.decode(tokenizer.encode(text)), text);
  EXPECT_EQ(tokenizer.encode("\n"), Ids{'\n'});
  EXPECT_EQ(tokenizer.id_to_token('\n'), "Ċ");
}

TEST(HfTokenizer, AddedTokensAreMatchedFirstAndStripWhatTheySay) {
  TempFolder folder;
  const HfTokenizer tokenizer = load(folder, byte_level_json());
  EXPECT_EQ(tokenizer.encode("the<|end|>the"), (Ids{'t', 257, 260, 't', 257}));
  // <pad> takes the whitespace on both sides (lstrip, rstrip).
  EXPECT_EQ(tokenizer.encode("he  <pad>  he"), (Ids{257, 261, 257}));
  EXPECT_TRUE(tokenizer.is_special(260));
  EXPECT_FALSE(tokenizer.is_special(261));
  EXPECT_EQ(tokenizer.decode(Ids{257, 260, 257}, /*skip_special_tokens=*/true), "hehe");
  EXPECT_EQ(tokenizer.decode(Ids{257, 260, 257}), "he<|end|>he");
  EXPECT_EQ(tokenizer.token_to_id("<|end|>"), 260);
  EXPECT_EQ(tokenizer.token_to_id("Ġthe"), 258);
  EXPECT_FALSE(tokenizer.token_to_id("nope").has_value());
}

TEST(HfTokenizer, SentencePieceStyleWithByteFallbackAndTemplate) {
  TempFolder folder;
  const HfTokenizer tokenizer = load(folder, sentencepiece_json());
  // "ab é" -> "▁ab▁é": (▁, a) rank 0, then (▁a, b) rank 1; é has no token: bytes C3 A9.
  const Ids ids{264, 259, 3 + 0xC3, 3 + 0xA9};
  EXPECT_EQ(tokenizer.encode("ab é", false), ids);
  Ids with_bos{1};
  with_bos.insert(with_bos.end(), ids.begin(), ids.end());
  EXPECT_EQ(tokenizer.encode("ab é"), with_bos);
  EXPECT_EQ(tokenizer.prefix_tokens(), Ids{1});
  EXPECT_EQ(tokenizer.decode(ids), "ab é");
  // The stream: the first piece after BOS loses its space, later ones keep theirs.
  std::string streamed;
  int64_t previous = 1;
  for (const int64_t id : ids) streamed += tokenizer.decode_piece(previous, id), previous = id;
  EXPECT_EQ(streamed, "ab é");
  EXPECT_EQ(tokenizer.decode_piece(264, 262), " a");
  // A ▁ stands for one byte; "<unk>" is the longest piece.
  EXPECT_EQ(tokenizer.max_token_bytes(), 5);
}

TEST(HfTokenizer, UnknownCharactersWithoutFallbackFuseIntoOneUnk) {
  TempFolder folder;
  nlohmann::json json = sentencepiece_json();
  json["model"]["byte_fallback"] = false;
  const HfTokenizer tokenizer = load(folder, json);
  EXPECT_EQ(tokenizer.encode("aéé", false), (Ids{262, 0}));
  EXPECT_EQ(tokenizer.max_token_bytes(), std::numeric_limits<int64_t>::max());  // unk: no bound
  json["model"]["unk_token"] = nullptr;
  const HfTokenizer strict = load(folder, json);
  try {
    (void)strict.encode("aé", false);
    FAIL() << "a character without a token was encoded";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("no token for the character"), std::string::npos) << e.what();
  }
}

TEST(HfTokenizer, BadTextAndIdsAreNamed) {
  TempFolder folder;
  const HfTokenizer tokenizer = load(folder, byte_level_json());
  try {
    (void)tokenizer.encode("ok\xff");
    FAIL() << "invalid UTF-8 was encoded";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("not valid UTF-8 at byte 2"), std::string::npos) << e.what();
  }
  EXPECT_THROW((void)tokenizer.decode(Ids{262}), std::invalid_argument);
  EXPECT_THROW((void)tokenizer.decode(Ids{-1}), std::invalid_argument);
  EXPECT_THROW((void)tokenizer.decode_piece(-1, 1000), std::invalid_argument);
}

// Each malformed file is refused with a FormatError naming the file and the field.
TEST(HfTokenizer, MalformedFilesAreRefusedNamingTheField) {
  TempFolder folder;
  struct Case {
    std::string name;
    std::function<void(nlohmann::json&)> change;
    std::string field;
  };
  const std::vector<Case> cases{
      {"unigram", [](auto& j) { j["model"]["type"] = "Unigram"; }, "model.type"},
      {"digits", [](auto& j) { j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", {{{"type", "Digits"}}}}}; },
       "pre_tokenizer.pretokenizers[0].type"},
      {"nfkc", [](auto& j) { j["normalizer"] = {{"type", "NFKC"}}; }, "normalizer.type"},
      {"ctc", [](auto& j) { j["decoder"] = {{"type", "CTC"}}; }, "decoder.type"},
      {"roberta", [](auto& j) { j["post_processor"] = {{"type", "RobertaProcessing"}}; }, "post_processor.type"},
      {"merge", [](auto& j) { j["model"]["merges"].push_back("x yz"); }, "model.merges[4]"},
      {"merge shape", [](auto& j) { j["model"]["merges"].push_back(7); }, "model.merges[4]"},
      {"negative id", [](auto& j) { j["model"]["vocab"]["Ġt"] = -1; }, "model.vocab"},
      {"huge id", [](auto& j) { j["model"]["vocab"]["Ġt"] = 1 << 30; }, "max_vocab_size"},
      {"clash", [](auto& j) { j["added_tokens"][0]["id"] = 5; }, "added_tokens[0]"},
      {"regex", [](auto& j) { j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(ab"}}}, {"behavior", "Isolated"}}; },
       "pre_tokenizer.pattern"},
      {"behavior", [](auto& j) { j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"String", " "}}}, {"behavior", "Contiguous"}}; },
       "pre_tokenizer.behavior"},
      {"template", [](auto& j) { j["post_processor"] = {{"type", "TemplateProcessing"}, {"single", {{{"SpecialToken", {{"id", "<bos>"}}}}, {{"Sequence", {{"id", "A"}}}}}}, {"special_tokens", nlohmann::json::object()}}; },
       "post_processor.single[0]"},
      {"suffix", [](auto& j) { j["model"]["end_of_word_suffix"] = "</w>"; }, "model.end_of_word_suffix"},
      {"dropout", [](auto& j) { j["model"]["dropout"] = 0.1; }, "model.dropout"},
      {"unk", [](auto& j) { j["model"]["unk_token"] = "<nope>"; }, "model.unk_token"},
  };
  for (const Case& c : cases) {
    nlohmann::json json = byte_level_json();
    c.change(json);
    try {
      (void)load(folder, json);
      ADD_FAILURE() << c.name << ": loaded";
    } catch (const FormatError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("tokenizer.json"), std::string::npos) << c.name << ": " << what;
      EXPECT_NE(what.find(c.field), std::string::npos) << c.name << ": " << what;
    }
  }
  try {
    (void)HfTokenizer::load(folder.write("tokenizer.json", "{\"model\": "));
    ADD_FAILURE() << "truncated JSON loaded";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("malformed JSON"), std::string::npos) << e.what();
  }
  EXPECT_THROW((void)HfTokenizer::load(folder.path() / "missing.json"), FormatError);
}

TEST(HfTokenizer, SplitBehaviorsCutAsDefined) {
  TempFolder folder;
  nlohmann::json json = byte_level_json();
  const auto pieces = [&](const char* behavior) {
    json["pre_tokenizer"] = {{"type", "Sequence"},
                             {"pretokenizers", {{{"type", "Split"}, {"pattern", {{"String", "-"}}}, {"behavior", behavior}},
                                                {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
    json["model"]["merges"] = nlohmann::json::array();
    json["model"]["ignore_merges"] = true;  // whole pieces that are tokens come out as one
    json["model"]["vocab"]["a-"] = 262, json["model"]["vocab"]["-b"] = 263;
    return load(folder, json).encode("a-b", false);
  };
  EXPECT_EQ(pieces("Isolated"), (Ids{'a', '-', 'b'}));
  EXPECT_EQ(pieces("Removed"), (Ids{'a', 'b'}));
  EXPECT_EQ(pieces("MergedWithPrevious"), (Ids{262, 'b'}));
  EXPECT_EQ(pieces("MergedWithNext"), (Ids{'a', 263}));
}

TEST(HfTokenizer, FolderSettingsGiveBosEosAndChat) {
  TempFolder folder;
  const HfTokenizer tokenizer = load(folder, sentencepiece_json());
  folder.write("tokenizer_config.json",
               R"({"add_bos_token": true, "bos_token": {"content": "<s>", "lstrip": false}, "eos_token": "</s>",
                   "chat_template": "{{ bos_token }}[INST] {{ m }} [/INST]"})");
  folder.write("generation_config.json", R"({"bos_token_id": 1, "eos_token_id": [2, 0]})");
  specdec::io::HfTextSettings settings = specdec::io::read_text_settings(folder.path(), tokenizer);
  EXPECT_EQ(settings.add_bos_token, true);
  EXPECT_EQ(settings.bos_token_id, 1);
  EXPECT_EQ(settings.eos_token_ids, (Ids{2, 0}));  // generation_config.json's list wins
  EXPECT_EQ(settings.chat, ChatTemplate::inst);
  EXPECT_EQ(specdec::io::encode_prompt(tokenizer, settings, "a"), (Ids{1, 262}));  // one BOS, not two
  settings.add_bos_token = false;
  EXPECT_EQ(specdec::io::encode_prompt(tokenizer, settings, "a"), (Ids{262}));
  settings.add_bos_token.reset();  // the post-processor decides
  EXPECT_EQ(specdec::io::encode_prompt(tokenizer, settings, "a"), (Ids{1, 262}));
  EXPECT_EQ(specdec::io::apply_chat_template(ChatTemplate::inst, "hi"), "[INST] hi [/INST]");

  folder.write("generation_config.json", R"({"eos_token_id": 99999})");
  try {
    (void)specdec::io::read_text_settings(folder.path(), tokenizer);
    ADD_FAILURE() << "an eos_token_id outside the vocabulary was read";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("generation_config.json"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("eos_token_id"), std::string::npos) << e.what();
  }
  folder.write("generation_config.json", "{}");
  folder.write("tokenizer_config.json", R"({"eos_token": "<nope>"})");
  try {
    (void)specdec::io::read_text_settings(folder.path(), tokenizer);
    ADD_FAILURE() << "an unknown eos_token was read";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("tokenizer_config.json"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("eos_token"), std::string::npos) << e.what();
  }
}

// ---- real tokenizers -----------------------------------------------------------------------

using specdec::test::tokenizers_dir;

nlohmann::json fixtures() {
  std::ifstream in(fs::path(SPECDEC_TEST_DATA_DIR) / "hf_tokenizer_fixtures.json");
  return nlohmann::json::parse(in);
}

class RealTokenizer : public ::testing::TestWithParam<std::string> {
 protected:
  // The folder of the parameter's real tokenizer, or "" (the test then skips) when it is absent.
  [[nodiscard]] fs::path models() const {
    const fs::path folder = tokenizers_dir() / ("tokenizer-" + GetParam()) / "package/models";
    return fs::exists(folder / "tokenizer.json") ? folder : fs::path();
  }
};

// Absent files skip the test with the reason, except in CI (CI=true), where they fail it.
#define SPECDEC_REQUIRE_REAL_TOKENIZER(folder)                                                               \
  const fs::path folder = models();                                                                          \
  if (folder.empty()) {                                                                                      \
    const std::string reason = "the " + GetParam() + " tokenizer.json is absent under " +                    \
                               tokenizers_dir().string() + " (../shared/tokenizers, or SPECDEC_TOKENIZERS_DIR)"; \
    if (specdec::test::in_ci()) FAIL() << reason;                                                            \
    GTEST_SKIP() << reason;                                                                                  \
  }

TEST_P(RealTokenizer, MatchesTheReferenceEncodingAndDecoding) {
  SPECDEC_REQUIRE_REAL_TOKENIZER(folder);
  const HfTokenizer tokenizer = HfTokenizer::load(folder);
  const nlohmann::json data = fixtures();
  const nlohmann::json& texts = data.at("texts");
  const nlohmann::json& expected = data.at("tokenizers").at(GetParam());
  ASSERT_EQ(texts.size(), expected.size());
  for (size_t i = 0; i < texts.size(); ++i) {
    const std::string text = texts[i].get<std::string>();
    const nlohmann::json& e = expected[i];
    SCOPED_TRACE("text " + std::to_string(i) + ": " + text);
    const Ids ids = tokenizer.encode(text, false);
    EXPECT_EQ(ids, e.at("ids").get<Ids>());
    EXPECT_EQ(tokenizer.encode(text), e.at("ids_with_special_tokens").get<Ids>());
    EXPECT_EQ(tokenizer.decode(ids), e.at("decoded").get<std::string>());
    EXPECT_EQ(tokenizer.decode(ids, true), e.at("decoded_skipping_special").get<std::string>());
    // The length bound a caller may check before encoding holds.
    EXPECT_GE(static_cast<int64_t>(ids.size()) * tokenizer.max_token_bytes(), static_cast<int64_t>(text.size()));
    // Piece by piece, a text without added tokens decodes to the same bytes.
    if (std::none_of(ids.begin(), ids.end(), [&](int64_t id) { return tokenizer.is_special(id); })) {
      std::string streamed;
      int64_t previous = -1;
      for (const int64_t id : ids) streamed += tokenizer.decode_piece(previous, id), previous = id;
      EXPECT_EQ(streamed, e.at("decoded").get<std::string>());
    }
  }
}

TEST_P(RealTokenizer, ChatFormatFollowsTheTokens) {
  SPECDEC_REQUIRE_REAL_TOKENIZER(folder);
  const HfTokenizer tokenizer = HfTokenizer::load(folder);
  const specdec::io::HfTextSettings settings = specdec::io::read_text_settings(folder, tokenizer);
  if (GetParam() == "llama3") {
    ASSERT_EQ(settings.chat, ChatTemplate::llama3);
    const Ids ids = tokenizer.encode(specdec::io::apply_chat_template(*settings.chat, "Hi"), false);
    // <|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n
    ASSERT_GE(ids.size(), 4U);
    EXPECT_EQ(ids.front(), *tokenizer.token_to_id("<|start_header_id|>"));
    EXPECT_EQ(ids[ids.size() - 2], *tokenizer.token_to_id("<|end_header_id|>"));
    EXPECT_EQ(tokenizer.decode(std::span(ids).last(1)), "\n\n");
    EXPECT_EQ(std::count(ids.begin(), ids.end(), *tokenizer.token_to_id("<|eot_id|>")), 1);
  } else if (GetParam() == "qwen3") {
    ASSERT_EQ(settings.chat, ChatTemplate::chatml);
    EXPECT_FALSE(settings.add_bos_token.value_or(true));
    const Ids ids = specdec::io::encode_prompt(tokenizer, settings, specdec::io::apply_chat_template(*settings.chat, "Hi"));
    EXPECT_EQ(ids.front(), 151644);  // <|im_start|>
  } else {
    EXPECT_EQ(settings.add_bos_token, true);
    EXPECT_EQ(settings.eos_token_ids, Ids{2});
    EXPECT_EQ(specdec::io::encode_prompt(tokenizer, settings, "Hello").front(), 1);
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, RealTokenizer, ::testing::Values("llama3", "qwen3", "llama2"));

}  // namespace

}  // namespace test_hf_tokenizer
