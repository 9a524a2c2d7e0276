// Moving data between the host and a model's device, the one way the library does it.
//
// Every device-to-host copy the library makes goes through detail::to_host(), which counts it:
// device_to_host_copies() lets an engine (and the tests) check that a generation step costs the
// one synchronisation it is documented to cost. Host values go up through detail::to_device(),
// which on CUDA stages them in pinned memory and copies without blocking the host. Generators
// live on the model's device, so sampling draws no uniforms on the host.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <random>
#include <span>

#include "specdec/detail/torch_compat.hpp"
#include "specdec/parallel.hpp"

namespace specdec {
namespace detail {

inline std::atomic<int64_t>& host_copy_counter() noexcept {
  static std::atomic<int64_t> copies{0};
  return copies;
}

}  // namespace detail

// The number of device-to-host copies (each one a synchronisation on an asynchronous device) the
// library has made in this process so far, from all threads. A generation step makes one; see
// docs/architecture.md for the documented extras (the EGAG and confidence-stop signals).
[[nodiscard]] inline int64_t device_to_host_copies() noexcept {
  return detail::host_copy_counter().load(std::memory_order_relaxed);
}

namespace detail {

// A contiguous host copy of `tensor`, counted by device_to_host_copies(). On CPU it is a plain
// copy; on an accelerator it waits for the work that produces `tensor`. While a SharedDecisions
// is alive (parallel.hpp) it is rank 0's tensor, broadcast to every rank first.
inline at::Tensor to_host(const at::Tensor& tensor) {
  host_copy_counter().fetch_add(1, std::memory_order_relaxed);
  if (Collectives* group = decision_group().load(std::memory_order_relaxed); group != nullptr && group->world_size() > 1) {
    at::Tensor shared = tensor.contiguous().clone();  // the broadcast writes in place: not into the caller's
    group->broadcast(shared, 0);
    return shared.is_cpu() ? shared : shared.to(at::kCPU).contiguous();
  }
  return tensor.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true).contiguous();
}

// A [shape] tensor of `values` on `device`, owning its data (the span may go away afterwards).
// On CUDA the values are staged in pinned memory and copied asynchronously: the host does not
// wait, and the caching host allocator keeps the staging buffer alive until the copy is done.
template <class T>
at::Tensor to_device(std::span<const T> values, at::IntArrayRef shape, const at::Device& device) {
  const auto type = at::CppTypeToScalarType<T>::value;
  const bool pinned = device.is_cuda();
  at::Tensor staging = at::empty(shape, at::TensorOptions().dtype(type).pinned_memory(pinned));
  if (!values.empty()) std::memcpy(staging.data_ptr(), values.data(), values.size_bytes());
  return device.is_cpu() ? staging : staging.to(device, /*non_blocking=*/pinned);
}

// Ids [1, n] on `device` for host tokens.
inline at::Tensor to_device_ids(std::span<const int64_t> tokens, const at::Device& device) {
  return to_device(tokens, {1, static_cast<int64_t>(tokens.size())}, device);
}

// A 64-bit seed from the system's entropy source, for runs without options.seed. While a
// SharedDecisions is alive it is rank 0's, broadcast: ranks that draft by sampling (a replicated
// drafter, a STAND tree) then draft alike, so their target forwards see the same tokens.
inline uint64_t random_seed() {
  uint64_t seed = (uint64_t{std::random_device{}()} << 32) ^ std::random_device{}();
  if (Collectives* group = decision_group().load(std::memory_order_relaxed); group != nullptr && group->world_size() > 1) {
    at::Tensor shared = at::full({1}, static_cast<int64_t>(seed), at::TensorOptions().dtype(at::kLong));
    group->broadcast(shared, 0);
    seed = static_cast<uint64_t>(shared.item<int64_t>());
  }
  return seed;
}

// A generator of its own on `device`, seeded with `seed` (random when unset). On CPU it is the
// same Mersenne Twister stream for the same seed as at::make_generator<at::CPUGeneratorImpl>.
inline at::Generator make_generator(std::optional<uint64_t> seed, const at::Device& device = at::kCPU) {
  const uint64_t value = seed ? *seed : random_seed();
  if (device.is_cpu()) return at::make_generator<at::CPUGeneratorImpl>(value);
  at::Generator generator = at::globalContext().defaultGenerator(device).clone();
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_current_seed(value);
  return generator;
}

// Adds the wall time of its scope to *total.
class ScopedTimer {
 public:
  explicit ScopedTimer(double& total) noexcept : total_(total), start_(std::chrono::steady_clock::now()) {}
  ~ScopedTimer() { total_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }
  ScopedTimer(const ScopedTimer&) = delete;
  ScopedTimer& operator=(const ScopedTimer&) = delete;

 private:
  double& total_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace detail
}  // namespace specdec
