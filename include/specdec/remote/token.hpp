// The shared secret of remote verification, read and checked the same way by the server and the
// client. A token travels as gRPC metadata ("authorization: Bearer TOKEN"), which carries printable
// ASCII only: a token is one or more characters from '!' to '~' (no spaces, no control
// characters). A token with any other byte is refused here with a message naming where it came
// from, never passed to gRPC (which aborts the process on metadata it cannot send).
//
// Reading: a file's first line, or an environment variable's whole value, with leading and
// trailing spaces, tabs, CRs and LFs removed ("tok\r\n", "tok \n" and " tok" all read as "tok").
#pragma once

#include <cstddef>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <string_view>

#include "specdec/io/regular_file.hpp"

namespace specdec::remote {

// The environment variable both programs read the token from when no file is given.
inline constexpr const char* kTokenVariable = "SPECDEC_VERIFIER_TOKEN";

// The longest first line a token file may have.
inline constexpr size_t kMaxTokenFileLine = 4096;

// Throws std::invalid_argument naming `source` unless `token` is empty or a valid token (every
// byte from '!' to '~'). The message gives the offending byte's position and value, not the token.
inline void check_token(std::string_view token, const std::string& source) {
  for (size_t i = 0; i < token.size(); ++i) {
    const auto byte = static_cast<unsigned char>(token[i]);
    if (byte < 0x21 || byte > 0x7e) {
      constexpr const char* kHex = "0123456789abcdef";
      const std::string value = {'0', 'x', kHex[byte >> 4], kHex[byte & 15]};
      throw std::invalid_argument(source + ": the token holds byte " + value + " at position " + std::to_string(i) +
                                  ", which gRPC metadata cannot carry (a token is printable ASCII, '!' to '~', "
                                  "without spaces)");
    }
  }
}

// `text` without leading and trailing spaces, tabs, CRs and LFs.
inline std::string_view trim_token(std::string_view text) {
  constexpr std::string_view kBlank = " \t\r\n";
  const size_t first = text.find_first_not_of(kBlank);
  if (first == std::string_view::npos) return {};
  return text.substr(first, text.find_last_not_of(kBlank) - first + 1);
}

// The token: the first line of `file` (named `flag` in messages) when `file` is not empty, else the
// value of $SPECDEC_VERIFIER_TOKEN ("" when it is unset), both trimmed and checked.
// Throws std::invalid_argument naming the flag and file, or the variable, when the file does not
// exist, is not a regular file (a folder, a FIFO, a socket, a device), cannot be read, holds no
// token on its first line, or the token holds a byte gRPC cannot carry.
inline std::string read_token(const std::string& file, const std::string& flag) {
  if (file.empty()) {
    const char* value = std::getenv(kTokenVariable);
    if (value == nullptr) return {};
    std::string token(trim_token(value));
    if (token.empty()) throw std::invalid_argument(std::string("$") + kTokenVariable + " is set but holds no token");
    check_token(token, std::string("$") + kTokenVariable);
    return token;
  }
  // The first line, read in at most kMaxTokenFileLine + 1 bytes, from a regular file only (a FIFO
  // or a device that never ends a line cannot hold the reader).
  const std::string head = io::read_regular_file(file, flag, kMaxTokenFileLine);
  const size_t end = head.find('\n');
  if (end == std::string::npos && head.size() > kMaxTokenFileLine) {
    throw std::invalid_argument(flag + " " + file + ": its first line is longer than " +
                                std::to_string(kMaxTokenFileLine) + " bytes");
  }
  std::string token(trim_token(std::string_view(head).substr(0, end)));
  if (token.empty()) throw std::invalid_argument(flag + " " + file + " holds no token on its first line");
  check_token(token, flag + " " + file);
  return token;
}

}  // namespace specdec::remote
