// Host values as a tensor on a device: one owned copy, no synchronisation (an asynchronous
// host-to-device transfer on accelerators).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <span>

namespace specdec::detail {

// A [shape] tensor of `values` on `device`, copied (the span may go away afterwards).
template <class T>
at::Tensor host_tensor(std::span<const T> values, at::IntArrayRef shape, const at::Device& device) {
  return at::from_blob(const_cast<T*>(values.data()), shape, at::CppTypeToScalarType<T>::value)
      .to(device, /*non_blocking=*/false, /*copy=*/true);
}

// Ids [1, n] on `device` for host tokens.
inline at::Tensor host_ids(std::span<const int64_t> tokens, const at::Device& device) {
  return host_tensor(tokens, {1, static_cast<int64_t>(tokens.size())}, device);
}

}  // namespace specdec::detail
