// specdec version. CMake reads the project version from the three macros below.
#pragma once

#define SPECDEC_VERSION_MAJOR 0
#define SPECDEC_VERSION_MINOR 1
#define SPECDEC_VERSION_PATCH 0

namespace specdec {

inline constexpr int kVersionMajor = SPECDEC_VERSION_MAJOR;
inline constexpr int kVersionMinor = SPECDEC_VERSION_MINOR;
inline constexpr int kVersionPatch = SPECDEC_VERSION_PATCH;

}  // namespace specdec
