// Reading a checked run of a file straight into a new CPU tensor's storage.
#pragma once

#include <string>

#include "specdec/detail/torch_compat.hpp"
#include "specdec/io/binary_reader.hpp"

namespace specdec::io::detail {

// A tensor of `shape` stored contiguously as `type` at the reader's position.
inline at::Tensor read_tensor(BinaryReader& reader, at::IntArrayRef shape, at::ScalarType type,
                              const std::string& what) {
  const uint64_t bytes =
      reader.require_elements({shape.data(), shape.size()}, c10::elementSize(type), what);
  at::Tensor tensor = at::empty(shape, at::TensorOptions().dtype(type));
  reader.read_bytes(tensor.data_ptr(), bytes, what);
  return tensor;
}

}  // namespace specdec::io::detail
