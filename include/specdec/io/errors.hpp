// The error every loader throws for a file it cannot use: names the file and what is wrong.
#pragma once

#include <filesystem>
#include <sstream>
#include <stdexcept>
#include <string>

namespace specdec::io {

// A file that is missing, truncated, oversized or malformed. what() reads "<file>: <problem>".
class FormatError : public std::runtime_error {
 public:
  FormatError(const std::filesystem::path& file, const std::string& problem)
      : std::runtime_error(file.string() + ": " + problem), file_(file) {}

  [[nodiscard]] const std::filesystem::path& file() const noexcept { return file_; }

 private:
  std::filesystem::path file_;
};

namespace detail {

template <class... Parts>
[[noreturn]] void throw_format(const std::filesystem::path& file, const Parts&... parts) {
  std::ostringstream problem;
  (problem << ... << parts);
  throw FormatError(file, problem.str());
}

}  // namespace detail
}  // namespace specdec::io
