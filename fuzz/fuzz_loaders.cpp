// libFuzzer target for every loader of untrusted files. The first input byte picks the loader,
// the rest is the file. A loader may only reject a file with io::FormatError (or
// std::invalid_argument for a well-formed but unusable model); any other exception, crash or
// sanitizer report is a bug.
// Only the parsers, which need no libtorch (clang cannot compile libtorch 1.13's operator
// headers as C++20), are fuzzed: they hold every check of the untrusted bytes.
#include <specdec/io/hf_config.hpp>
#include <specdec/io/llama2c_format.hpp>
#include <specdec/io/safetensors_format.hpp>
#include <specdec/io/tokenizer.hpp>

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

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

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t which = data[0] % 4;
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
    }
  } catch (const specdec::io::FormatError&) {
  } catch (const std::invalid_argument&) {
  }
  return 0;
}
