// Bad input: the call throws std::invalid_argument whose message contains every fragment (the
// parameter's name and value).
#pragma once

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

namespace specdec::test {

template <class F>
void expect_invalid(F call, const std::vector<std::string>& fragments) {
  try {
    call();
    ADD_FAILURE() << "no exception";
  } catch (const std::invalid_argument& e) {
    for (const auto& fragment : fragments) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  }
}

}  // namespace specdec::test
