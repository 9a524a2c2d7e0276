// Linked into the consumer beside the quickstart: how many of libtorch's intra-op threads an
// at::parallel_for in the consumer's own code reaches, as specdec's CPU loops (packed products,
// attention) call it from its headers. A target that does not carry OpenMP's flags (where
// libtorch's threads are OpenMP's) leaves every such loop on the calling thread: 1.
#include <specdec/threads.hpp>

#include <ATen/Parallel.h>

#include <atomic>
#include <iostream>

namespace {

const bool reported = [] {
  specdec::set_threads(2);
  std::atomic<int> used{0};
  at::parallel_for(0, 2, 1, [&](int64_t, int64_t) { used.fetch_add(1); });
  std::cout << "header loops on " << used.load() << " threads\n";
  return true;
}();

}  // namespace
