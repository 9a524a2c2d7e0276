// What differs between the libtorch versions specdec supports (1.13 to 2.x), in one place.
//
// The library's headers include ATen through this header: <ATen/ATen.h> and the few headers it
// stopped including on its own, the version of the libtorch being compiled against, and whether
// that libtorch has CUDA (SPECDEC_HAVE_CUDA, defined by the build where Torch's CMake package
// reports CUDA; CUDA-only code is compiled only then).
//
// Differences met so far, and how they are met here:
// - 2.x's <ATen/ATen.h> no longer brings at::NoGradGuard and at::GradMode: included from
//   <ATen/core/grad_mode.h>, which both versions have.
// - c10::optional became an alias of std::optional (2.4) and is being removed: the library
//   spells std::optional everywhere, which 1.13's c10::optional converts from.
// - Tensor::data<T>() is deprecated: the library reads through data_ptr<T>(), in both.
// - The headers of 2.13 and later require C++20, which the library requires anyway.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include <torch/version.h>

#include <string>

#if !defined(TORCH_VERSION_MAJOR) || !defined(TORCH_VERSION_MINOR)
#error "specdec: <torch/version.h> did not define TORCH_VERSION_MAJOR and TORCH_VERSION_MINOR"
#endif
#if TORCH_VERSION_MAJOR < 1 || (TORCH_VERSION_MAJOR == 1 && TORCH_VERSION_MINOR < 13)
#error "specdec needs libtorch 1.13 or later"
#endif

// Whether the libtorch being compiled against is version major.minor or later.
#define SPECDEC_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace specdec {

// The libtorch version specdec was compiled against, "major.minor.patch".
[[nodiscard]] inline std::string torch_version() {
  return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
         std::to_string(TORCH_VERSION_PATCH);
}

// Whether specdec was compiled against a libtorch with CUDA (SPECDEC_HAVE_CUDA): the CUDA-only
// paths (CUDA graphs) exist in this build. Whether a GPU is present is at::hasCUDA().
[[nodiscard]] constexpr bool built_with_cuda() noexcept {
#ifdef SPECDEC_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace specdec
