// The files the tests read from ../shared beside the checkout: the real checkpoints (../shared/models,
// or SPECDEC_MODELS_DIR) and the real tokenizer.json files (../shared/tokenizers, or
// SPECDEC_TOKENIZERS_DIR). The build passes the defaults as SPECDEC_DEFAULT_MODELS_DIR and
// SPECDEC_DEFAULT_TOKENIZERS_DIR.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>

namespace specdec::test {

// The folder named by the environment variable `variable` when it is set, else `fallback`.
inline std::filesystem::path folder_setting(const char* variable, const char* fallback) {
  const char* folder = std::getenv(variable);
  return folder != nullptr && *folder != '\0' ? std::filesystem::path(folder) : std::filesystem::path(fallback);
}

#ifndef SPECDEC_DEFAULT_MODELS_DIR
#define SPECDEC_DEFAULT_MODELS_DIR ""
#endif
#ifndef SPECDEC_DEFAULT_TOKENIZERS_DIR
#define SPECDEC_DEFAULT_TOKENIZERS_DIR ""
#endif

// The folder of the real checkpoints: SPECDEC_MODELS_DIR when set, else the configured default.
inline std::filesystem::path models_dir() {
  return folder_setting("SPECDEC_MODELS_DIR", SPECDEC_DEFAULT_MODELS_DIR);
}

// The folder of the real tokenizers (<name>/package/models/tokenizer.json): SPECDEC_TOKENIZERS_DIR
// when set, else the configured default.
inline std::filesystem::path tokenizers_dir() {
  return folder_setting("SPECDEC_TOKENIZERS_DIR", SPECDEC_DEFAULT_TOKENIZERS_DIR);
}

// models_dir() / relative if it exists, else nullopt.
inline std::optional<std::filesystem::path> shared_model(const std::filesystem::path& relative) {
  const std::filesystem::path folder = models_dir();
  if (folder.empty()) return std::nullopt;
  const std::filesystem::path path = folder / relative;
  return std::filesystem::exists(path) ? std::optional(path) : std::nullopt;
}

// In CI (CI=true) a checkpoint that is absent fails the test: a skip there would hide it.
inline bool in_ci() {
  const char* ci = std::getenv("CI");
  return ci != nullptr && std::string(ci) == "true";
}

#define SPECDEC_REQUIRE_MODEL(variable, relative)                                                      \
  const auto variable##_found = ::specdec::test::shared_model(relative);                               \
  if (!variable##_found) {                                                                             \
    if (::specdec::test::in_ci()) {                                                                    \
      FAIL() << (relative) << " is absent from '" << ::specdec::test::models_dir().string()            \
             << "' (../shared/models, or SPECDEC_MODELS_DIR); a skip is a failure in CI";              \
    }                                                                                                  \
    GTEST_SKIP() << "set SPECDEC_MODELS_DIR to the folder holding " << (relative)                     \
                 << " (../shared/models) to run this test";                                            \
  }                                                                                                    \
  const std::filesystem::path variable = *variable##_found

}  // namespace specdec::test
