// Argument validation helpers: every public entry point throws std::invalid_argument whose message
// names the parameter, the rule it broke and the value it had.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

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

}  // namespace specdec::detail
