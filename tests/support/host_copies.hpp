// The device-to-host copies a call makes: the tests' check of one copy per generation step.
#pragma once

#include <cstdint>

#include "specdec/device.hpp"

namespace specdec::test {

template <class Run>
int64_t copies_during(Run&& run) {
  const int64_t before = device_to_host_copies();
  run();
  return device_to_host_copies() - before;
}

}  // namespace specdec::test
