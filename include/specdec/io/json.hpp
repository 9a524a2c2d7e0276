// Parsing untrusted JSON with bounded depth and width, and quoting it in messages without
// serializing it whole. nlohmann-json's parser callback sees every value as it is built: a
// document nested deeper than LoadLimits::max_json_depth or with an object or array wider than
// max_json_entries is refused there, before it takes memory or stack in later processing.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "specdec/io/errors.hpp"
#include "specdec/io/limits.hpp"

namespace specdec::io::detail {

// At most `max_chars` characters of `text`, non-printable bytes as \xNN, "..." when cut.
inline std::string printable(std::string_view text, size_t max_chars = 80) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (const char c : text) {
    if (out.size() >= max_chars) return out + "...";
    const auto byte = static_cast<unsigned char>(c);
    if (byte < 0x20 || byte == 0x7f) {
      out += "\\x";
      out += kHex[byte >> 4];
      out += kHex[byte & 15];
    } else {
      out += c;
    }
  }
  return out;
}

// A JSON value for an error message: its compact text, at most `max_chars` characters. The value
// came through parse_json_bounded, so its nesting is bounded and dump() cannot recurse deeply.
inline std::string excerpt(const nlohmann::json& value, size_t max_chars = 80) {
  return printable(value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace), max_chars);
}

// Parses `text` as JSON. Throws FormatError naming `path` for malformed JSON, nesting deeper than
// limits.max_json_depth, or an object or array of more than limits.max_json_entries entries.
inline nlohmann::json parse_json_bounded(std::string_view text, const std::filesystem::path& path,
                                         const LoadLimits& limits = {}) {
  std::vector<uint64_t> widths;  // entries so far in each open object or array
  const auto count_entry = [&] {
    if (!widths.empty() && ++widths.back() > limits.max_json_entries) {
      throw_format(path, "a JSON object or array holds more than ", limits.max_json_entries,
                   " entries (LoadLimits::max_json_entries)");
    }
  };
  const auto bounded = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json&) {
    using Event = nlohmann::json::parse_event_t;
    if (event == Event::object_start || event == Event::array_start) {
      if (depth >= limits.max_json_depth) {
        throw_format(path, "JSON nested deeper than ", limits.max_json_depth,
                     " levels (LoadLimits::max_json_depth)");
      }
      count_entry();  // a nested object or array is an entry of its parent
      widths.push_back(0);
    } else if (event == Event::object_end || event == Event::array_end) {
      if (!widths.empty()) widths.pop_back();
    } else if (event == Event::value) {
      count_entry();
    }
    return true;
  };
  try {
    return nlohmann::json::parse(text.begin(), text.end(), bounded);
  } catch (const nlohmann::json::exception& e) {
    throw_format(path, "malformed JSON: ", printable(e.what(), 200));
  }
}

// Reads and parses a JSON file of at most limits.max_json_bytes. Throws FormatError.
inline nlohmann::json read_json(const std::filesystem::path& path, const LoadLimits& limits = {}) {
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error)) {
    throw_format(path, std::filesystem::exists(path, error) ? "is not a regular file" : "no such file");
  }
  const uint64_t size = std::filesystem::file_size(path, error);
  if (error) throw_format(path, "cannot read file size: ", error.message());
  if (size > limits.max_json_bytes) {
    throw_format(path, "JSON file of ", size, " bytes exceeds the limit of ", limits.max_json_bytes,
                 " bytes (LoadLimits::max_json_bytes)");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw_format(path, "cannot open file");
  std::string text(size, '\0');
  if (!in.read(text.data(), static_cast<std::streamsize>(size))) throw_format(path, "cannot read file");
  return parse_json_bounded(text, path, limits);
}

}  // namespace specdec::io::detail
