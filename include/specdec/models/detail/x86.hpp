// The x86 instruction sets the CPU forward's loops are compiled for, and which of them this CPU
// has. The AVX2/FMA and AVX-512 loops are compiled for their instructions whatever the caller's
// flags (a build for generic x86-64 gets SSE2 from its compiler) and chosen at run time where the
// CPU has them; elsewhere (another architecture or compiler) only the portable loops exist.
#pragma once

#include <cstdint>
#include <utility>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define SPECDEC_X86_KERNELS 1
#define SPECDEC_TARGET_AVX2 __attribute__((target("avx2,fma")))
#define SPECDEC_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))
#define SPECDEC_TARGET_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))
#define SPECDEC_TARGET_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma")))
#endif

namespace specdec::detail {

// Calls run.template operator()<N>() with N = n for n in [1, Most] (Most for any larger n): the
// loops keep one register per row, so each row count is a function of its own.
template <int Most, class Run>
inline void with_count(int64_t n, Run&& run) {
  [&]<int... I>(std::integer_sequence<int, I...>) {
    (void)((n == I + 1 || (I + 1 == Most && n > Most) ? (run.template operator()<I + 1>(), true) : false) || ...);
  }(std::make_integer_sequence<int, Most>{});
}

// Whether this CPU has AVX2 and FMA (asked once per process).
inline bool cpu_has_avx2_fma() {
#ifdef SPECDEC_X86_KERNELS
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
#else
  return false;
#endif
}

// Whether this CPU has AVX-512 (F, BW, VL) and FMA (asked once per process).
inline bool cpu_has_avx512() {
#ifdef SPECDEC_X86_KERNELS
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
  return has;
#else
  return false;
#endif
}

// Whether this CPU also has AVX512-BF16's dot products (CPUID leaf 7, subleaf 1, EAX bit 5; asked
// once per process).
inline bool cpu_has_avx512_bf16() {
#ifdef SPECDEC_X86_KERNELS
  static const bool has = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    return cpu_has_avx512() && __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) != 0 && (eax & (1U << 5)) != 0;
  }();
  return has;
#else
  return false;
#endif
}

// Whether this CPU also has AVX512-VNNI's integer dot products (`vpdpwssd`: two int16 products
// added to an int32 lane; asked once per process).
inline bool cpu_has_avx512_vnni() {
#ifdef SPECDEC_X86_KERNELS
  static const bool has = cpu_has_avx512() && __builtin_cpu_supports("avx512vnni");
  return has;
#else
  return false;
#endif
}

}  // namespace specdec::detail
