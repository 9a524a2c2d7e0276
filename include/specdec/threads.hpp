// One setting for the CPU threads generation uses: libtorch's intra-op pool and the BLAS library
// loaded in the process, which keeps a pool of its own. OpenBLAS starts its pool at load with as
// many threads as cores whatever at::set_num_threads says, so the two pools can oversubscribe the
// cores. set_threads(n) sets both; the BLAS is reached through the symbols it exports
// (openblas_set_num_threads, or mkl_set_num_threads for MKL), found with dlsym in whatever library
// the process actually loaded, so specdec links no BLAS itself.
//
//   specdec::set_threads(1);   // one thread in libtorch and in OpenBLAS
//   std::cout << specdec::thread_settings();   // torch 1, openblas 1 (SkylakeX)
//
// The name in parentheses is the kernel family OpenBLAS chose for this CPU at load. On a virtual
// machine whose CPU model it does not recognise it falls back to its generic SSE3 kernels
// ("Prescott"): on this project's machine (AVX-512) that makes a large fp32 product 5x slower.
// The choice is made once, when the library loads, from the environment variable
// OPENBLAS_CORETYPE (e.g. OPENBLAS_CORETYPE=SkylakeX or Haswell), so it is the process's
// environment, not a call, that fixes it.
#pragma once

#include <ATen/Parallel.h>

#include <optional>
#include <ostream>
#include <string>

#include <thread>

#if __has_include(<dlfcn.h>)
#include <dlfcn.h>
#define SPECDEC_HAS_DLSYM 1
#endif
#if __has_include(<sched.h>)
#include <sched.h>
#endif

#include "specdec/detail/check.hpp"

namespace specdec {

// The threads of libtorch's intra-op pool and of the loaded BLAS (none when no known BLAS exports
// its thread setting, e.g. a statically linked one).
struct ThreadSettings {
  int torch = 1;
  std::optional<int> blas{};
  std::string blas_name{};  // "openblas", "mkl" or empty
  std::string blas_core{};  // the kernels OpenBLAS chose for this CPU ("SkylakeX", "Prescott", ...)

  friend std::ostream& operator<<(std::ostream& out, const ThreadSettings& s) {
    out << "torch " << s.torch;
    if (s.blas) out << ", " << s.blas_name << " " << *s.blas;
    if (!s.blas_core.empty()) out << " (" << s.blas_core << ")";
    return out;
  }
};

namespace detail {

struct BlasThreads {
  void (*set)(int) = nullptr;
  int (*get)() = nullptr;
  char* (*core)() = nullptr;
  const char* name = "";
};

// The thread functions of the BLAS loaded in the process, looked up once.
inline const BlasThreads& blas_threads() {
  static const BlasThreads found = [] {
    BlasThreads blas;
#ifdef SPECDEC_HAS_DLSYM
    if (void* set = dlsym(RTLD_DEFAULT, "openblas_set_num_threads")) {
      blas.set = reinterpret_cast<void (*)(int)>(set);
      blas.get = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
      blas.core = reinterpret_cast<char* (*)()>(dlsym(RTLD_DEFAULT, "openblas_get_corename"));
      blas.name = "openblas";
    } else if (void* mkl = dlsym(RTLD_DEFAULT, "MKL_Set_Num_Threads")) {
      blas.set = reinterpret_cast<void (*)(int)>(mkl);
      blas.get = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "MKL_Get_Max_Threads"));
      blas.name = "mkl";
    }
#endif
    return blas;
  }();
  return found;
}

}  // namespace detail

// The current thread counts.
inline ThreadSettings thread_settings() {
  ThreadSettings settings{.torch = at::get_num_threads()};
  const detail::BlasThreads& blas = detail::blas_threads();
  if (blas.get != nullptr) {
    settings.blas = blas.get();
    settings.blas_name = blas.name;
  }
  if (blas.core != nullptr && blas.core() != nullptr) settings.blas_core = blas.core();
  return settings;
}

// The cores this process may run on: its CPU affinity where the system reports one (a container
// or taskset limits it), else the hardware's threads; at least 1. What a memory-bound target
// wants: its forward streams every weight once, and each core adds bandwidth.
inline int available_cores() noexcept {
#if defined(__linux__) && defined(CPU_COUNT)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int count = CPU_COUNT(&set);
    if (count > 0) return count;
  }
#endif
  const unsigned hardware = std::thread::hardware_concurrency();
  return hardware > 0 ? static_cast<int>(hardware) : 1;
}

// Sets libtorch's intra-op threads and the loaded BLAS's threads to `threads` (>= 1) and returns
// what took effect. Call it before the first generation: libtorch's pool size is fixed once it
// has started in some builds (then only the BLAS changes; the result says so).
// Throws std::invalid_argument for threads < 1.
inline ThreadSettings set_threads(int threads) {
  if (threads < 1) detail::throw_invalid("threads", "be >= 1", threads);
  at::set_num_threads(threads);
  const detail::BlasThreads& blas = detail::blas_threads();
  if (blas.set != nullptr) blas.set(threads);
  return thread_settings();
}

}  // namespace specdec
