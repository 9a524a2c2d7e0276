// Writing files all or nothing: the content goes to `path.partial`, which replaces `path` only once
// it is completely written, so a failure never leaves a truncated file under the real name.
#pragma once

#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>

namespace specdec::io::detail {

// Calls write(out) on a binary stream to `path` + ".partial", then renames it over `path`.
// Throws std::runtime_error when the file cannot be opened or written (the partial file is
// removed); whatever `write` throws, after removing the partial file.
template <class Write>
void write_atomically(const std::filesystem::path& path, Write write) {
  std::filesystem::path temporary = path;
  temporary += ".partial";
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    if (!out) throw std::runtime_error("cannot write " + temporary.string());
    try {
      write(out);
    } catch (...) {
      out.close();
      std::filesystem::remove(temporary);
      throw;
    }
    if (!out.flush()) {
      out.close();
      std::filesystem::remove(temporary);
      throw std::runtime_error("failed writing " + temporary.string());
    }
  }
  std::filesystem::rename(temporary, path);
}

// Writes the bytes of a trivially copyable value.
template <class T>
void put(std::ofstream& out, const T& value) {
  out.write(reinterpret_cast<const char*>(&value), sizeof(value));
}

}  // namespace specdec::io::detail
