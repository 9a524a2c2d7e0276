// Writing files all or nothing: the content goes to a temporary file beside `path`, with a name
// unique to this process and call, which replaces `path` only once it is completely written. A
// failure never leaves a truncated file under the real name, and two processes saving to the same
// path leave one complete file (the last to finish), never a mix.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <system_error>

#include "specdec/io/checksum.hpp"

namespace specdec::io::detail {

// What `path` is when it exists and is not a regular file ("a folder", "a FIFO", "a character
// device", ...), following symbolic links; "" when it is a regular file or does not exist. A save
// renames its file over `path`: over a FIFO or a device node that would replace the special file
// with a regular one, so saves refuse them.
inline std::string special_file_kind(const std::filesystem::path& path) {
  std::error_code error;
  switch (std::filesystem::status(path, error).type()) {
    case std::filesystem::file_type::none:
    case std::filesystem::file_type::not_found:
    case std::filesystem::file_type::regular: return {};
    case std::filesystem::file_type::directory: return "a folder";
    case std::filesystem::file_type::fifo: return "a FIFO";
    case std::filesystem::file_type::block: return "a block device";
    case std::filesystem::file_type::character: return "a character device";
    case std::filesystem::file_type::socket: return "a socket";
    default: return "not a regular file";
  }
}

// Throws std::invalid_argument naming `what` and `path` unless a file can be saved at `path`: it
// is a regular file or does not exist, its folder exists, and this process may create files there
// (write and search permission, by the effective user). Lets a program refuse a bad output path
// before long work; write_atomically checks the kind again when it writes.
inline void require_writable_path(const std::filesystem::path& path, const std::string& what) {
  std::error_code error;
  if (path.empty()) throw std::invalid_argument(what + " must not be empty");
  if (const std::string kind = special_file_kind(path); !kind.empty()) {
    throw std::invalid_argument(what + " " + path.string() + " is " + kind + ", not a regular file");
  }
  const auto folder = path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path();
  if (!std::filesystem::is_directory(folder, error)) {
    throw std::invalid_argument(what + " " + path.string() + ": the folder " + folder.string() + " does not exist");
  }
  if (::faccessat(AT_FDCWD, folder.c_str(), W_OK | X_OK, AT_EACCESS) != 0) {
    const std::string reason = std::generic_category().message(errno);
    throw std::invalid_argument(what + " " + path.string() + ": the folder " + folder.string() +
                                " is not writable (" + reason + ")");
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
// std::runtime_error when `path` exists and is not a regular file (a folder, a FIFO, a device, a
// socket: see special_file_kind) or the file cannot be opened, written or renamed
// (the temporary file is removed); whatever `write` throws, after removing it.
template <class Write>
void write_atomically(const std::filesystem::path& path, Write write, bool checksum = false) {
  std::error_code error;
  if (const std::string kind = special_file_kind(path); !kind.empty()) {
    throw std::runtime_error("cannot write " + path.string() + ": it is " + kind + ", not a regular file");
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
