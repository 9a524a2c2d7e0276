// The real checkpoints of ../shared/models, found through SPECDEC_MODELS_DIR.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <optional>

namespace specdec::test {

// The folder named by SPECDEC_MODELS_DIR if it holds `relative`, else nullopt.
inline std::optional<std::filesystem::path> shared_model(const std::filesystem::path& relative) {
  const char* folder = std::getenv("SPECDEC_MODELS_DIR");
  if (folder == nullptr || *folder == '\0') return std::nullopt;
  const std::filesystem::path path = std::filesystem::path(folder) / relative;
  return std::filesystem::exists(path) ? std::optional(path) : std::nullopt;
}

#define SPECDEC_REQUIRE_MODEL(variable, relative)                                            \
  const auto variable##_found = ::specdec::test::shared_model(relative);                     \
  if (!variable##_found) {                                                                   \
    GTEST_SKIP() << "set SPECDEC_MODELS_DIR to the folder holding " << (relative)           \
                 << " (../shared/models) to run this test";                                  \
  }                                                                                          \
  const std::filesystem::path variable = *variable##_found

}  // namespace specdec::test
