// Strict command-line numbers for the example programs and tools, on CLI11 (Debian's
// libcli11-dev). CLI11 parses the flags; these validators make every number strict: the whole
// text must be a decimal number of the option's type ("12abc", "1.9" or "1e6" for an integer,
// "-1" for an unsigned one, "nan" anywhere are refused) within a range, and the message names
// the flag, the value and the range.
#pragma once

#include <CLI/CLI.hpp>

#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

namespace cli {

// Parses the command line: after --help, prints the help and exits with status 0; a bad flag or
// value throws CLI::ParseError (the caller prints it and exits with status 2).
inline void parse_or_help(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success&) {
    std::cout << app.help();
    std::exit(0);
  }
}

// The value of `text` if it is exactly one decimal integer of type T.
template <class T>
bool parse_integer(const std::string& text, T& value) {
  if (text.empty() || text.front() == '+') return false;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value, 10);
  return error == std::errc() && end == text.data() + text.size();
}

// The value of `text` if it is exactly one finite decimal number.
inline bool parse_real(const std::string& text, double& value) {
  if (text.empty() || text.front() == '+') return false;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  return error == std::errc() && end == text.data() + text.size() && std::isfinite(value);
}

template <class T>
std::string describe_range(T low, T high) {
  std::ostringstream out;
  out << "[" << low << ", " << high << "]";
  return out.str();
}

// An integer of type T in [low, high].
template <class T>
CLI::Validator integer(T low, T high) {
  const std::string range = describe_range(low, high);
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        T value{};
        if (!parse_integer(text, value)) return "'" + text + "' is not an integer in " + range;
        if (value < low || value > high) return text + " is outside " + range;
        return {};
      },
      range);
}

// A finite real in [low, high] (`low_open`: in (low, high]; `high_open`: in [low, high)).
inline CLI::Validator real(double low, double high, bool low_open = false, bool high_open = false) {
  std::ostringstream described;
  described << (low_open ? "(" : "[") << low << ", " << high << (high_open ? ")" : "]");
  const std::string range = described.str();
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        double value = 0;
        if (!parse_real(text, value)) return "'" + text + "' is not a finite number";
        if (value < low || value > high || (low_open && value == low) || (high_open && value == high)) {
          return text + " is outside " + range;
        }
        return {};
      },
      range);
}

// A comma-separated list of finite reals in [low, high]: "0.1,0.2". Throws CLI::ValidationError
// naming `flag` for an empty item or a bad number.
inline std::vector<double> real_list(const std::string& flag, const std::string& text, double low, double high) {
  std::vector<double> values;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) {
    double value = 0;
    if (!parse_real(item, value) || value < low || value > high) {
      throw CLI::ValidationError(flag, "'" + item + "' in '" + text + "' is not a number in " +
                                           describe_range(low, high));
    }
    values.push_back(value);
  }
  if (values.empty() || text.back() == ',') {
    throw CLI::ValidationError(flag, "'" + text + "' is not a comma-separated list of numbers");
  }
  return values;
}

}  // namespace cli
