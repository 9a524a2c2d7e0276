// Writing files all or nothing: the content goes to a temporary file beside `path`, with a name
// unique to this process and call, which replaces `path` only once it is completely written. A
// failure never leaves a truncated file under the real name, and two processes saving to the same
// path leave one complete file (the last to finish), never a mix.
#pragma once

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <system_error>

#include "specdec/io/checksum.hpp"

namespace specdec::io::detail {

// Throws std::invalid_argument naming `what` unless a file can be written at `path`: it is not a
// folder and its folder exists. Lets a program refuse a bad output path before long work.
inline void require_writable_path(const std::filesystem::path& path, const std::string& what) {
  std::error_code error;
  if (path.empty()) throw std::invalid_argument(what + " must not be empty");
  if (std::filesystem::is_directory(path, error)) {
    throw std::invalid_argument(what + " " + path.string() + " is a folder, not a file name");
  }
  const auto folder = path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path();
  if (!std::filesystem::is_directory(folder, error)) {
    throw std::invalid_argument(what + " " + path.string() + ": the folder " + folder.string() + " does not exist");
  }
}

// `path` + ".partial-<pid>-<counter>-<clock>": unique among processes and calls.
inline std::filesystem::path temporary_name(const std::filesystem::path& path) {
  static std::atomic<uint64_t> counter{0};
  std::filesystem::path temporary = path;
  temporary += ".partial-" + std::to_string(::getpid()) + "-" + std::to_string(counter++) + "-" +
               std::to_string(std::chrono::steady_clock::now().time_since_epoch().count());
  return temporary;
}

// Calls write(out) on a binary stream to a temporary file beside `path`, then (with `checksum`)
// appends the checksum trailer of io/checksum.hpp, then renames the file over `path`. Throws
// std::runtime_error when `path` is a folder or the file cannot be opened, written or renamed
// (the temporary file is removed); whatever `write` throws, after removing it.
template <class Write>
void write_atomically(const std::filesystem::path& path, Write write, bool checksum = false) {
  std::error_code error;
  if (std::filesystem::is_directory(path, error)) {
    throw std::runtime_error("cannot write " + path.string() + ": it is a folder");
  }
  const std::filesystem::path temporary = temporary_name(path);
  const auto discard = [&] {
    std::error_code ignored;
    std::filesystem::remove(temporary, ignored);
  };
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    if (!out) throw std::runtime_error("cannot write " + temporary.string());
    try {
      write(out);
      if (checksum && out.flush()) append_checksum(temporary, out);
    } catch (...) {
      out.close();
      discard();
      throw;
    }
    if (!out.flush()) {
      out.close();
      discard();
      throw std::runtime_error("failed writing " + temporary.string());
    }
  }
  std::filesystem::rename(temporary, path, error);
  if (error) {
    const std::string reason = error.message();
    discard();
    throw std::runtime_error("cannot replace " + path.string() + ": " + reason);
  }
}

// write_atomically with the checksum trailer.
template <class Write>
void write_atomically_checksummed(const std::filesystem::path& path, Write write) {
  write_atomically(path, write, /*checksum=*/true);
}

// Writes the bytes of a trivially copyable value.
template <class T>
void put(std::ofstream& out, const T& value) {
  out.write(reinterpret_cast<const char*>(&value), sizeof(value));
}

}  // namespace specdec::io::detail
