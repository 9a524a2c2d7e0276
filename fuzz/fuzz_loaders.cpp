// libFuzzer target for every loader of untrusted files and the tokenizer's encoder. The first
// input byte picks the loader (0 llama2.c, 1 tokenizer file, 2 safetensors, 3 config.json,
// 4 n-gram storage, 5 one-level n-gram storage, 6 STAND memory, 7 text to encode, 8 any JSON
// through the bounded parser, 9 tokenizer.json, 10 text to encode with a byte-level tokenizer.json),
// the rest is the file or text. A loader may only reject a file with io::FormatError (or
// std::invalid_argument for a well-formed but unusable model); any other exception, crash or
// sanitizer report is a bug.
// Only the parsers, which need no libtorch (clang cannot compile libtorch 1.13's operator
// headers as C++20), are fuzzed: they hold every check of the untrusted bytes.
#include <specdec/io/hf_config.hpp>
#include <specdec/io/hf_tokenizer.hpp>
#include <specdec/io/llama2c_format.hpp>
#include <specdec/io/safetensors_format.hpp>
#include <specdec/io/tokenizer.hpp>
#include <specdec/ngram_storage.hpp>

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace {

std::filesystem::path scratch() {
  static const std::filesystem::path folder =
      std::filesystem::temp_directory_path() / ("specdec_fuzz_" + std::to_string(getpid()));
  std::filesystem::create_directories(folder);
  return folder;
}

void write(const std::filesystem::path& path, const uint8_t* data, size_t size) {
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
}

// A tokenizer of 512 pieces: the 256 byte-fallback tokens <0xXX>, the 95 printable ASCII
// characters and 161 two- and three-character merges of them, with scores that favour longer
// pieces; written once, loaded once.
const specdec::io::Llama2cTokenizer& tokenizer() {
  static const specdec::io::Llama2cTokenizer loaded = [] {
    std::vector<std::string> pieces;
    for (int b = 0; b < 256; ++b) {
      static constexpr char kHex[] = "0123456789ABCDEF";
      pieces.push_back(std::string("<0x") + kHex[b >> 4] + kHex[b & 15] + ">");
    }
    for (char c = ' '; c <= '~'; ++c) pieces.emplace_back(1, c);
    for (size_t i = 0; pieces.size() < 512; ++i) {
      const char a = static_cast<char>(' ' + i % 95), b = static_cast<char>(' ' + (i * 7) % 95);
      pieces.push_back(i % 3 == 0 ? std::string{a, b, a} : std::string{a, b});
    }
    std::string bytes;
    const auto put = [&](const auto& value) { bytes.append(reinterpret_cast<const char*>(&value), sizeof(value)); };
    put(int32_t{3});
    for (size_t i = 0; i < pieces.size(); ++i) {
      put(static_cast<float>(i < 256 ? -1000.0 : static_cast<double>(pieces[i].size()) - 0.001 * static_cast<double>(i)));
      put(static_cast<int32_t>(pieces[i].size()));
      bytes += pieces[i];
    }
    const auto path = scratch() / "fuzz_tokenizer.bin";
    write(path, reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
    return specdec::io::Llama2cTokenizer::load(path, 512);
  }();
  return loaded;
}

// tests/data/byte_tokenizer: 256 byte-level tokens, GPT-2's pre-tokenizer regex.
const specdec::io::HfTokenizer& hf_tokenizer() {
  static const specdec::io::HfTokenizer loaded = specdec::io::HfTokenizer::load(SPECDEC_BYTE_TOKENIZER_DIR);
  return loaded;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t which = data[0] % 11;
  ++data;
  --size;
  const std::filesystem::path folder = scratch();
  try {
    switch (which) {
      case 0:
        write(folder / "model.bin", data, size);
        (void)specdec::io::parse_llama2c(folder / "model.bin");
        break;
      case 1:
        write(folder / "tok.bin", data, size);
        (void)specdec::io::Llama2cTokenizer::load(folder / "tok.bin", 512);
        break;
      case 2:
        write(folder / "x.safetensors", data, size);
        (void)specdec::io::parse_safetensors(folder / "x.safetensors");
        break;
      case 3:
        write(folder / "config.json", data, size);
        (void)specdec::io::load_hf_llama_config(folder / "config.json");
        break;
      case 4:
        write(folder / "ngram.bin", data, size);
        (void)specdec::NGramStorage::load(folder / "ngram.bin");
        break;
      case 5:
        write(folder / "one_level.bin", data, size);
        (void)specdec::OneLevelNGramStorage::load(folder / "one_level.bin");
        break;
      case 6:
        write(folder / "memory.bin", data, size);
        (void)specdec::ProbabilisticNGramStorage::load(folder / "memory.bin");
        break;
      case 7: {
        const std::string_view text(reinterpret_cast<const char*>(data), size);
        const std::vector<int64_t> tokens = tokenizer().encode(text);
        // Byte fallback makes every text encodable, and decoding gives the text back.
        if (tokenizer().decode(std::span(tokens).subspan(1), specdec::io::Llama2cTokenizer::kBos) != text) {
          __builtin_trap();
        }
        break;
      }
      case 8:
        (void)specdec::io::detail::parse_json_bounded(std::string_view(reinterpret_cast<const char*>(data), size),
                                                      "fuzz.json");
        break;
      case 9: {
        write(folder / "tokenizer.json", data, size);
        const auto loaded = specdec::io::HfTokenizer::load(folder / "tokenizer.json");
        try {
          (void)loaded.decode(loaded.encode("Hello, world! 123 \xc3\xa9\xe2\x9c\x93 <s>"));
        } catch (const std::runtime_error&) {
          // a file's own pattern may exhaust PCRE2's match limit: refused while encoding
        }
        break;
      }
      case 10: {
        // Every valid UTF-8 text is encodable and decodes back; anything else is refused.
        const std::string_view text(reinterpret_cast<const char*>(data), size);
        const std::vector<int64_t> tokens = hf_tokenizer().encode(text);
        if (hf_tokenizer().decode(tokens) != text) __builtin_trap();
        break;
      }
    }
  } catch (const specdec::io::FormatError&) {
  } catch (const std::invalid_argument&) {
  }
  return 0;
}
