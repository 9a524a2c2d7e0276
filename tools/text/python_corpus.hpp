// The bundled models' text: the top-level *.py files of a Python standard library folder
// (Debian's /usr/lib/python3.11), sorted by name; every tenth file (index % 10 == 0) is held out
// for evaluation, the rest is training text. Files are joined as raw bytes. A helper of the
// trainer (tools/train_bundled_pair.cpp), the tests and the benchmarks, not a public header.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "specdec/io/errors.hpp"

namespace specdec::text {

struct PythonCorpus {
  std::vector<uint8_t> train{};
  std::vector<uint8_t> held_out{};
  std::vector<std::filesystem::path> held_out_paths{};
  int64_t train_files = 0;
  int64_t held_out_files = 0;
};

// Throws io::FormatError when the folder holds no *.py file.
inline PythonCorpus load_python_corpus(const std::filesystem::path& folder) {
  std::vector<std::filesystem::path> files;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(folder, error)) {
    if (entry.is_regular_file() && entry.path().extension() == ".py") files.push_back(entry.path());
  }
  if (error || files.empty()) io::detail::throw_format(folder, "no *.py files to read");
  std::sort(files.begin(), files.end());
  PythonCorpus corpus;
  for (size_t i = 0; i < files.size(); ++i) {
    std::ifstream in(files[i], std::ios::binary);
    const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const bool held_out = i % 10 == 0;
    auto& target = held_out ? corpus.held_out : corpus.train;
    target.insert(target.end(), bytes.begin(), bytes.end());
    if (held_out) corpus.held_out_paths.push_back(files[i]);
    ++(held_out ? corpus.held_out_files : corpus.train_files);
  }
  return corpus;
}

}  // namespace specdec::text
