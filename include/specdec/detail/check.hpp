// Argument validation helpers: every public entry point throws std::invalid_argument whose message
// names the parameter, the rule it broke and the value it had.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace specdec::detail {

// Throws std::invalid_argument("<name> must <rule>, got <value>").
template <class Value>
[[noreturn]] void throw_invalid(std::string_view name, std::string_view rule, const Value& value) {
  std::ostringstream message;
  message << name << " must " << rule << ", got " << value;
  throw std::invalid_argument(message.str());
}

// Throws std::invalid_argument with a message composed of all arguments streamed in order.
template <class... Parts>
[[noreturn]] void throw_invalid_message(const Parts&... parts) {
  std::ostringstream message;
  (message << ... << parts);
  throw std::invalid_argument(message.str());
}

// Throws unless every token is in [0, vocab): "<name>[i] must be in [0, vocab_size = V), got t".
inline void check_tokens(std::string_view name, std::span<const int64_t> tokens, int64_t vocab) {
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= vocab) {
      throw_invalid_message(name, "[", i, "] must be in [0, vocab_size = ", vocab, "), got ", tokens[i]);
    }
  }
}

// The entries of `values` at `rows`, in that order (batch rows kept as requests finish).
template <class T>
std::vector<T> pick_rows(const std::vector<T>& values, std::span<const int64_t> rows) {
  std::vector<T> picked;
  picked.reserve(rows.size());
  for (const int64_t r : rows) picked.push_back(values[static_cast<size_t>(r)]);
  return picked;
}

// Throws std::invalid_argument("<caller>: the <model>'s ... NaN or infinity ..."): the one message
// of every generation function for non-finite values. `model` is "target" or "drafter";
// `logits_finite` says whether that model's logits were finite, when known: finite logits whose
// distribution is not were made so by the logits processor's temperature.
[[noreturn]] inline void throw_non_finite(std::string_view caller, std::string_view model,
                                          std::optional<bool> logits_finite = std::nullopt) {
  if (logits_finite.has_value() && *logits_finite) {
    throw_invalid_message(caller, ": the ", model, "'s logits are finite but its distribution contains NaN or ",
                          "infinity: the temperature is too small for the range of its logits");
  }
  if (logits_finite.has_value()) {
    throw_invalid_message(caller, ": the ", model, " model's logits contain NaN or infinity");
  }
  throw_invalid_message(caller, ": the ", model, "'s distribution contains NaN or infinity (non-finite logits from the ",
                        model, " model, or a temperature too small for their range)");
}

}  // namespace specdec::detail
