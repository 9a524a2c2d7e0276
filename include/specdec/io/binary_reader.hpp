// Bounds-checked reading of untrusted binary files: every size and offset is checked against the
// file before anything is read or allocated. Plain C++: the parsers built on it need no libtorch.
#pragma once

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <span>
#include <string>
#include <type_traits>

#include "specdec/io/checksum.hpp"
#include "specdec/io/errors.hpp"

namespace specdec::io::detail {

// Reads a file front to back with a cursor; any read past the end throws FormatError.
class BinaryReader {
 public:
  explicit BinaryReader(const std::filesystem::path& path) : path_(path) {
    std::error_code error;
    const auto size = std::filesystem::file_size(path, error);
    if (error) throw_format(path, "cannot read file size: ", error.message());
    size_ = static_cast<uint64_t>(size);
    stream_.open(path, std::ios::binary);
    if (!stream_) throw_format(path, "cannot open file");
  }

  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }
  [[nodiscard]] uint64_t size() const noexcept { return size_; }
  [[nodiscard]] uint64_t position() const noexcept { return position_; }
  [[nodiscard]] uint64_t remaining() const noexcept { return size_ - position_; }

  // Checks the file's checksum trailer (io/checksum.hpp) and from then on reads only the content
  // before it, from the current position. Throws FormatError on a missing trailer or mismatch.
  void verify_checksum() {
    size_ = detail::verify_checksum(path_, stream_, size_);
    if (position_ > size_) throw_format(path_, "truncated: the header runs into the checksum trailer");
    stream_.seekg(static_cast<std::streamoff>(position_));
  }

  void seek(uint64_t position) {
    if (position > size_) throw_format(path_, "offset ", position, " is past the end of the file (", size_, " bytes)");
    stream_.seekg(static_cast<std::streamoff>(position));
    position_ = position;
  }

  // Throws unless `bytes` more bytes exist; `what` names the field for the message.
  void require(uint64_t bytes, const std::string& what) const {
    if (bytes > remaining()) {
      throw_format(path_, "truncated: ", what, " needs ", bytes, " bytes at offset ", position_,
                   " but only ", remaining(), " remain");
    }
  }

  void read_bytes(void* destination, uint64_t bytes, const std::string& what) {
    require(bytes, what);
    stream_.read(static_cast<char*>(destination), static_cast<std::streamsize>(bytes));
    if (!stream_) throw_format(path_, "read error in ", what, " at offset ", position_);
    position_ += bytes;
  }

  // A little-endian scalar (the machines libtorch runs on are little-endian).
  template <class T>
  T read(const std::string& what) {
    static_assert(std::is_trivially_copyable_v<T>);
    T value;
    read_bytes(&value, sizeof(T), what);
    return value;
  }

  std::string read_string(uint64_t bytes, const std::string& what) {
    require(bytes, what);
    std::string text(static_cast<size_t>(bytes), '\0');
    read_bytes(text.data(), bytes, what);
    return text;
  }

  // The bytes of `shape` elements of `element_size` bytes each, checked to fit in the rest of the
  // file before any allocation: negative dimensions, overflow and truncation throw.
  uint64_t require_elements(std::span<const int64_t> shape, uint64_t element_size, const std::string& what) const {
    uint64_t count = 1;
    for (const int64_t dim : shape) {
      if (dim < 0) throw_format(path_, what, " has a negative dimension ", dim);
      if (dim != 0 && count > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(dim)) {
        throw_format(path_, what, " has an element count that overflows");
      }
      count *= static_cast<uint64_t>(dim);
    }
    if (count > remaining() / element_size) {
      throw_format(path_, "truncated: ", what, " needs ", count, " elements of ", element_size,
                   " bytes at offset ", position_, " but only ", remaining(), " bytes remain");
    }
    return count * element_size;
  }

 private:
  std::filesystem::path path_;
  std::ifstream stream_;
  uint64_t size_ = 0;
  uint64_t position_ = 0;
};

}  // namespace specdec::io::detail
