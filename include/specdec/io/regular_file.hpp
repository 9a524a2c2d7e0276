// Files an operator names on a command line (tokens, TLS certificates and keys, prompt lists),
// read so that nothing but a regular file can hold the reader: a FIFO without a writer, a socket
// or a device would block a plain open() or read() for ever. The path is checked before it is
// opened, and the open file again (it is opened without blocking, so a path swapped for a FIFO in
// between is caught too).
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <system_error>

namespace specdec::io {

namespace detail {

// What a file of mode `mode` is, in words, where it is not a regular file; empty where it is.
inline std::string not_regular(mode_t mode) {
  if (S_ISREG(mode)) return {};
  if (S_ISDIR(mode)) return "is a folder";
  if (S_ISFIFO(mode)) return "is a FIFO (named pipe), not a regular file";
  if (S_ISSOCK(mode)) return "is a socket, not a regular file";
  if (S_ISCHR(mode)) return "is a character device, not a regular file";
  if (S_ISBLK(mode)) return "is a block device, not a regular file";
  return "is not a regular file";
}

// Closes a descriptor when dropped.
struct FileDescriptor {
  int fd = -1;
  explicit FileDescriptor(int descriptor) noexcept : fd(descriptor) {}
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  ~FileDescriptor() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace detail

// The first `max_bytes` + 1 bytes of the regular file `path` (all of it when it is shorter: a
// caller that gets more than max_bytes knows the file is too large without reading it all).
// `what` names the file in messages (a flag: "--token-file"). Throws std::invalid_argument
// reading "<what> <path> <problem>" where the path does not exist, is a folder, a FIFO, a socket,
// a device or anything else that is not a regular file, cannot be opened (with the system's
// reason) or cannot be read.
inline std::string read_regular_file(const std::string& path, const std::string& what, size_t max_bytes) {
  const std::string named = what + " " + path;
  const auto fail = [&](const std::string& problem) { throw std::invalid_argument(named + " " + problem); };
  const auto reason = [] { return std::generic_category().message(errno); };
  struct stat status {};
  if (::stat(path.c_str(), &status) != 0) {
    if (errno == ENOENT || errno == ENOTDIR) fail("does not exist");
    fail("cannot be opened: " + reason());
  }
  if (const std::string kind = detail::not_regular(status.st_mode); !kind.empty()) fail(kind);
  detail::FileDescriptor file{::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC)};
  if (file.fd < 0) fail("cannot be opened: " + reason());
  if (::fstat(file.fd, &status) != 0) fail("cannot be read: " + reason());
  if (const std::string kind = detail::not_regular(status.st_mode); !kind.empty()) fail(kind);
  std::string bytes(max_bytes + 1, '\0');
  size_t filled = 0;
  while (filled < bytes.size()) {
    const ssize_t got = ::read(file.fd, bytes.data() + filled, bytes.size() - filled);
    if (got < 0) {
      if (errno == EINTR) continue;
      fail("cannot be read: " + reason());
    }
    if (got == 0) break;
    filled += static_cast<size_t>(got);
  }
  bytes.resize(filled);
  return bytes;
}

}  // namespace specdec::io
