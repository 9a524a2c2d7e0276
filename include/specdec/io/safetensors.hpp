// The safetensors format: an 8-byte little-endian header length N, N bytes of JSON
// {"name": {"dtype": "F16", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {...}},
// then the tensor data; offsets are relative to the end of the header.
//
// Files are untrusted: the header length, the JSON, every dtype, shape and offset are checked
// against the file before a tensor is allocated. Writing goes to a temporary file renamed into
// place, so a failed save leaves no half-written file.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "specdec/io/binary_reader.hpp"
#include "specdec/io/errors.hpp"

namespace specdec::io {
namespace detail {

inline constexpr uint64_t kMaxSafetensorsHeader = 100u << 20;  // 100 MiB, as the reference reader

inline std::optional<at::ScalarType> safetensors_type(const std::string& name) {
  static const std::map<std::string, at::ScalarType> types{
      {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf},  {"BF16", at::kBFloat16},
      {"I64", at::kLong},   {"I32", at::kInt},   {"I16", at::kShort}, {"I8", at::kChar},
      {"U8", at::kByte},    {"BOOL", at::kBool}};
  const auto it = types.find(name);
  return it == types.end() ? std::nullopt : std::optional(it->second);
}

inline std::string safetensors_name(at::ScalarType type) {
  switch (type) {
    case at::kDouble: return "F64";
    case at::kFloat: return "F32";
    case at::kHalf: return "F16";
    case at::kBFloat16: return "BF16";
    case at::kLong: return "I64";
    case at::kInt: return "I32";
    case at::kShort: return "I16";
    case at::kChar: return "I8";
    case at::kByte: return "U8";
    case at::kBool: return "BOOL";
    default: break;
  }
  throw std::invalid_argument(std::string("safetensors cannot store dtype ") + c10::toString(type));
}

}  // namespace detail

struct SafetensorsContents {
  std::map<std::string, at::Tensor> tensors;      // CPU tensors in their stored dtype
  std::map<std::string, std::string> metadata;    // the "__metadata__" strings
};

// Reads every tensor of a safetensors file. Throws FormatError naming the file and the problem.
inline SafetensorsContents load_safetensors(const std::filesystem::path& path) {
  detail::BinaryReader reader(path);
  const auto header_size = reader.read<uint64_t>("header length");
  if (header_size > detail::kMaxSafetensorsHeader) {
    detail::throw_format(path, "header length ", header_size, " exceeds the limit of ",
                         detail::kMaxSafetensorsHeader, " bytes");
  }
  const std::string header_text = reader.read_string(header_size, "JSON header");
  const uint64_t data_start = reader.position();
  const uint64_t data_size = reader.remaining();

  nlohmann::json header;
  try {
    header = nlohmann::json::parse(header_text);
  } catch (const nlohmann::json::exception& e) {
    detail::throw_format(path, "malformed JSON header: ", e.what());
  }
  if (!header.is_object()) detail::throw_format(path, "the JSON header is not an object");

  SafetensorsContents contents;
  // Every byte range, to check that tensors do not overlap.
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) detail::throw_format(path, "__metadata__ is not an object");
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string()) detail::throw_format(path, "__metadata__ value of '", key, "' is not a string");
        contents.metadata[key] = value.get<std::string>();
      }
      continue;
    }
    const auto fail = [&](const auto&... parts) { detail::throw_format(path, "tensor '", name, "': ", parts...); };
    if (!entry.is_object() || !entry.contains("dtype") || !entry.contains("shape") ||
        !entry.contains("data_offsets")) {
      fail("needs dtype, shape and data_offsets");
    }
    const auto& dtype = entry["dtype"];
    const auto type = dtype.is_string() ? detail::safetensors_type(dtype.get<std::string>()) : std::nullopt;
    if (!type) fail("unsupported dtype ", dtype.dump());
    const auto& shape_json = entry["shape"];
    const auto& offsets = entry["data_offsets"];
    if (!shape_json.is_array() || shape_json.size() > 16) fail("shape must be an array of at most 16 dimensions");
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
        !offsets[1].is_number_unsigned()) {
      fail("data_offsets must be two non-negative integers");
    }
    std::vector<int64_t> shape;
    uint64_t count = 1;
    for (const auto& dim : shape_json) {
      if (!dim.is_number_unsigned() || dim.get<uint64_t>() > (uint64_t{1} << 48)) fail("invalid dimension ", dim.dump());
      const auto value = dim.get<uint64_t>();
      if (value != 0 && count > data_size / value) fail("shape ", shape_json.dump(), " is larger than the file");
      count *= value;
      shape.push_back(static_cast<int64_t>(value));
    }
    const auto begin = offsets[0].get<uint64_t>();
    const auto end = offsets[1].get<uint64_t>();
    const auto element = static_cast<uint64_t>(c10::elementSize(*type));
    if (begin > end || end > data_size) {
      fail("data_offsets [", begin, ", ", end, "] outside the data buffer of ", data_size, " bytes");
    }
    if (end - begin != count * element) {
      fail("data_offsets span ", end - begin, " bytes but shape ", shape_json.dump(), " of ",
           dtype.get<std::string>(), " needs ", count * element);
    }
    ranges.emplace_back(begin, end);
    reader.seek(data_start + begin);
    contents.tensors[name] = reader.read_tensor(shape, *type, "tensor '" + name + "'");
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second) detail::throw_format(path, "tensor data ranges overlap");
  }
  return contents;
}

// Writes tensors (any device; written from CPU copies) and metadata as a safetensors file,
// atomically: a temporary file in the same folder is renamed over `path` once complete.
inline void save_safetensors(const std::filesystem::path& path,
                             const std::map<std::string, at::Tensor>& tensors,
                             const std::map<std::string, std::string>& metadata = {}) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<at::Tensor> ordered;
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    if (name == "__metadata__") throw std::invalid_argument("a tensor cannot be named __metadata__");
    const at::Tensor cpu = tensor.detach().to(at::kCPU).contiguous();
    const uint64_t bytes = static_cast<uint64_t>(cpu.numel()) * cpu.element_size();
    header[name] = {{"dtype", detail::safetensors_name(cpu.scalar_type())},
                    {"shape", cpu.sizes().vec()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    ordered.push_back(cpu);
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // align the data to 8 bytes

  std::filesystem::path temporary = path;
  temporary += ".partial";
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    if (!out) throw std::runtime_error("cannot write " + temporary.string());
    const uint64_t length = text.size();
    out.write(reinterpret_cast<const char*>(&length), sizeof(length));
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (const auto& tensor : ordered) {
      out.write(static_cast<const char*>(tensor.data_ptr()),
                static_cast<std::streamsize>(tensor.numel() * tensor.element_size()));
    }
    if (!out.flush()) {
      std::filesystem::remove(temporary);
      throw std::runtime_error("failed writing " + temporary.string());
    }
  }
  std::filesystem::rename(temporary, path);
}

}  // namespace specdec::io
