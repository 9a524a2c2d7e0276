// The four story openings the benchmarks on stories260K measure (bench_pairs.hpp's stories(),
// bench_cpu_target's trees against chains), encoded with stories260K's tokenizer.
#pragma once

#include <array>

namespace specdec::bench {

inline constexpr std::array<const char*, 4> kStoryOpenings{"Once upon a time", "The little dog",
                                                           "Tom and Sue went to the park", "One day, a girl named Mia"};

}  // namespace specdec::bench
