// Parsing and validating a safetensors header without reading any tensor: an 8-byte
// little-endian header length N, N bytes of JSON
// {"name": {"dtype": "F16", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {...}},
// then the data, offsets relative to the end of the header. Plain C++ and nlohmann-json.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "specdec/io/binary_reader.hpp"
#include "specdec/io/errors.hpp"
#include "specdec/io/json.hpp"
#include "specdec/io/limits.hpp"

namespace specdec::io {

struct SafetensorsEntry {
  std::string name{};
  std::string dtype{};          // "F32", "F16", "BF16", ...
  std::vector<int64_t> shape{};
  uint64_t begin = 0;           // byte range in the data buffer
  uint64_t end = 0;
};

struct SafetensorsHeader {
  std::vector<SafetensorsEntry> entries{};
  std::map<std::string, std::string> metadata{};
  uint64_t data_start = 0;  // file offset of the data buffer
};

namespace detail {

// Bytes per element of a safetensors dtype; 0 for a dtype specdec does not read.
inline uint64_t safetensors_element_size(const std::string& dtype) {
  static const std::map<std::string, uint64_t> sizes{{"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2},
                                                     {"I64", 8}, {"I32", 4}, {"I16", 2}, {"I8", 1},
                                                     {"U8", 1},  {"BOOL", 1}};
  const auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

}  // namespace detail

// Reads and checks the header of a safetensors file: valid JSON, known dtypes, shapes whose size
// matches their byte ranges, ranges inside the data buffer and not overlapping.
// The header's size, nesting and tensor count are bounded by `limits`.
// Throws FormatError naming the file and the problem.
inline SafetensorsHeader parse_safetensors(const std::filesystem::path& path, const LoadLimits& limits = {}) {
  detail::BinaryReader reader(path);
  const auto header_size = reader.read<uint64_t>("header length");
  if (header_size > limits.max_safetensors_header) {
    detail::throw_format(path, "header length ", header_size, " exceeds the limit of ",
                         limits.max_safetensors_header, " bytes (LoadLimits::max_safetensors_header)");
  }
  const std::string header_text = reader.read_string(header_size, "JSON header");
  SafetensorsHeader header;
  header.data_start = reader.position();
  const uint64_t data_size = reader.remaining();

  const nlohmann::json json = detail::parse_json_bounded(header_text, path, limits);
  if (!json.is_object()) detail::throw_format(path, "the JSON header is not an object");

  for (const auto& [key, entry] : json.items()) {
    const std::string name = detail::printable(key);
    if (key == "__metadata__") {
      if (!entry.is_object()) detail::throw_format(path, "__metadata__ is not an object");
      for (const auto& [meta_key, value] : entry.items()) {
        if (!value.is_string()) detail::throw_format(path, "__metadata__ value of '", detail::printable(meta_key), "' is not a string");
        header.metadata[meta_key] = value.get<std::string>();
      }
      continue;
    }
    const auto fail = [&](const auto&... parts) { detail::throw_format(path, "tensor '", name, "': ", parts...); };
    if (!entry.is_object() || !entry.contains("dtype") || !entry.contains("shape") ||
        !entry.contains("data_offsets")) {
      fail("needs dtype, shape and data_offsets");
    }
    SafetensorsEntry parsed;
    parsed.name = key;
    const auto& dtype = entry["dtype"];
    parsed.dtype = dtype.is_string() ? dtype.get<std::string>() : std::string();
    const uint64_t element = detail::safetensors_element_size(parsed.dtype);
    if (element == 0) fail("unsupported dtype ", detail::excerpt(dtype));
    const auto& shape = entry["shape"];
    const auto& offsets = entry["data_offsets"];
    if (!shape.is_array() || shape.size() > 16) fail("shape must be an array of at most 16 dimensions");
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
        !offsets[1].is_number_unsigned()) {
      fail("data_offsets must be two non-negative integers");
    }
    uint64_t count = 1;
    for (const auto& dim : shape) {
      if (!dim.is_number_unsigned() || dim.get<uint64_t>() > (uint64_t{1} << 48)) fail("invalid dimension ", detail::excerpt(dim));
      const auto value = dim.get<uint64_t>();
      if (value != 0 && count > data_size / value) fail("shape ", detail::excerpt(shape), " is larger than the file");
      count *= value;
      parsed.shape.push_back(static_cast<int64_t>(value));
    }
    parsed.begin = offsets[0].get<uint64_t>();
    parsed.end = offsets[1].get<uint64_t>();
    if (parsed.begin > parsed.end || parsed.end > data_size) {
      fail("data_offsets [", parsed.begin, ", ", parsed.end, "] outside the data buffer of ", data_size, " bytes");
    }
    if (count > data_size / element || parsed.end - parsed.begin != count * element) {
      fail("data_offsets span ", parsed.end - parsed.begin, " bytes but shape ", detail::excerpt(shape), " of ",
           parsed.dtype, " needs ", count, " elements of ", element, " bytes");
    }
    header.entries.push_back(std::move(parsed));
  }
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& e : header.entries) {
    if (e.end > e.begin) ranges.emplace_back(e.begin, e.end);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second) detail::throw_format(path, "tensor data ranges overlap");
  }
  return header;
}

}  // namespace specdec::io
