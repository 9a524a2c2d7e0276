// Reading and writing safetensors files as tensors (the format: safetensors_format.hpp).
//
// Files are untrusted: the header length, the JSON, every dtype, shape and offset are checked
// against the file before a tensor is allocated. Writing goes to a temporary file renamed into
// place, so a failed save leaves no half-written file.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "specdec/detail/torch_compat.hpp"
#include "specdec/io/atomic_file.hpp"
#include "specdec/io/binary_reader.hpp"
#include "specdec/io/detail/read_tensor.hpp"
#include "specdec/io/errors.hpp"
#include "specdec/io/safetensors_format.hpp"

namespace specdec::io {
namespace detail {

inline at::ScalarType safetensors_type(const std::string& name) {
  static const std::map<std::string, at::ScalarType> types{
      {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf},  {"BF16", at::kBFloat16},
      {"I64", at::kLong},   {"I32", at::kInt},   {"I16", at::kShort}, {"I8", at::kChar},
      {"U8", at::kByte},    {"BOOL", at::kBool}};
  return types.at(name);
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
  std::map<std::string, at::Tensor> tensors{};    // CPU tensors in their stored dtype
  std::map<std::string, std::string> metadata{};  // the "__metadata__" strings
};

// Reads every tensor of a safetensors file (the header is validated by parse_safetensors first).
// Throws FormatError naming the file and the problem.
inline SafetensorsContents load_safetensors(const std::filesystem::path& path, const LoadLimits& limits = {}) {
  const SafetensorsHeader header = parse_safetensors(path, limits);
  detail::BinaryReader reader(path);
  SafetensorsContents contents{{}, header.metadata};
  for (const auto& entry : header.entries) {
    reader.seek(header.data_start + entry.begin);
    contents.tensors[entry.name] = detail::read_tensor(reader, entry.shape, detail::safetensors_type(entry.dtype),
                                                       "tensor '" + detail::printable(entry.name) + "'");
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

  detail::write_atomically(path, [&](std::ofstream& out) {
    detail::put(out, static_cast<uint64_t>(text.size()));
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (const auto& tensor : ordered) {
      out.write(static_cast<const char*>(tensor.data_ptr()),
                static_cast<std::streamsize>(tensor.numel() * tensor.element_size()));
    }
  });
}

}  // namespace specdec::io
