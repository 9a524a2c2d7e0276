// Counts the top-level ATen calls a piece of code makes: the tests' check that the library's own
// work on a CPU stays a few calls (each a few hundred nanoseconds of dispatch whatever its size).
#pragma once

#include <ATen/record_function.h>

#include <cstdint>
#include <memory>

namespace specdec::test {

// Counts the top-level ATen calls made on this thread while it lives (nested calls, an operator
// calling others, are not counted).
class AtenCallCounter {
 public:
  AtenCallCounter()
      : handle_(at::addThreadLocalCallback(
            at::RecordFunctionCallback(&AtenCallCounter::enter, &AtenCallCounter::leave)
                .scopes({at::RecordScope::FUNCTION}))) {
    calls() = 0;
    depth() = 0;
  }
  ~AtenCallCounter() { at::removeCallback(handle_); }
  AtenCallCounter(const AtenCallCounter&) = delete;
  AtenCallCounter& operator=(const AtenCallCounter&) = delete;

  [[nodiscard]] static int64_t& calls() {
    thread_local int64_t count = 0;
    return count;
  }

 private:
  static int64_t& depth() {
    thread_local int64_t level = 0;
    return level;
  }
  static std::unique_ptr<at::ObserverContext> enter(const at::RecordFunction& /*fn*/) {
    if (depth()++ == 0) ++calls();
    return nullptr;
  }
  static void leave(const at::RecordFunction& /*fn*/, at::ObserverContext* /*context*/) { --depth(); }

  at::CallbackHandle handle_;
};

}  // namespace specdec::test
