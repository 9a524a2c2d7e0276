// Whole-file checksums for the files specdec writes (n-gram storages, STAND memories): a 16-byte
// trailer, the marker "SDXXH3\0\0" and the XXH3-64 hash of every byte before it (xxHash, Debian's
// libxxhash-dev, used header-only). A flipped bit anywhere is detected on load, before parsing.
#pragma once

#ifndef XXH_INLINE_ALL
#define XXH_INLINE_ALL
#endif
#include <xxhash.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "specdec/io/errors.hpp"

namespace specdec::io::detail {

inline constexpr char kChecksumMarker[8] = {'S', 'D', 'X', 'X', 'H', '3', '\0', '\0'};
inline constexpr uint64_t kChecksumBytes = 16;

// XXH3-64 of the first `bytes` bytes of the open stream `in`, read from its start in chunks.
inline uint64_t hash_prefix(std::istream& in, uint64_t bytes, const std::filesystem::path& path) {
  XXH3_state_t* state = XXH3_createState();
  if (state == nullptr) throw std::bad_alloc();
  XXH3_64bits_reset(state);
  std::vector<char> chunk(1 << 20);
  in.clear();
  in.seekg(0);
  for (uint64_t left = bytes; left > 0;) {
    const auto n = static_cast<std::streamsize>(std::min<uint64_t>(left, chunk.size()));
    if (!in.read(chunk.data(), n)) {
      XXH3_freeState(state);
      throw_format(path, "read error while checking the checksum");
    }
    XXH3_64bits_update(state, chunk.data(), static_cast<size_t>(n));
    left -= static_cast<uint64_t>(n);
  }
  const uint64_t hash = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return hash;
}

// Appends the trailer to the complete file `path` (open for writing as `out`, flushed).
inline void append_checksum(const std::filesystem::path& path, std::ofstream& out) {
  out.flush();
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read back " + path.string() + " for its checksum");
  const uint64_t size = std::filesystem::file_size(path);
  const uint64_t hash = hash_prefix(in, size, path);
  out.write(kChecksumMarker, sizeof(kChecksumMarker));
  out.write(reinterpret_cast<const char*>(&hash), sizeof(hash));
}

// Checks the trailer of the file `path` of `size` bytes (open as `in`). Returns the size of the
// content before it. Throws FormatError when the trailer is missing or the hash differs.
inline uint64_t verify_checksum(const std::filesystem::path& path, std::istream& in, uint64_t size) {
  if (size < kChecksumBytes) throw_format(path, "truncated: no checksum trailer");
  std::array<char, kChecksumBytes> trailer{};
  in.clear();
  in.seekg(static_cast<std::streamoff>(size - kChecksumBytes));
  if (!in.read(trailer.data(), trailer.size())) throw_format(path, "read error in the checksum trailer");
  if (std::memcmp(trailer.data(), kChecksumMarker, sizeof(kChecksumMarker)) != 0) {
    throw_format(path, "no checksum trailer at the end of the file (truncated or not written by specdec)");
  }
  uint64_t stored = 0;
  std::memcpy(&stored, trailer.data() + sizeof(kChecksumMarker), sizeof(stored));
  const uint64_t computed = hash_prefix(in, size - kChecksumBytes, path);
  if (computed != stored) {
    throw_format(path, "checksum mismatch: the file is corrupt (XXH3-64 stored ", stored, ", computed ", computed, ")");
  }
  in.clear();
  in.seekg(0);
  return size - kChecksumBytes;
}

}  // namespace specdec::io::detail
