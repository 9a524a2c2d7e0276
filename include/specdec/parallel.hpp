// Tensor parallelism: the collectives a sharded model needs, and one decision per step.
//
// A target too large for one device runs as N shards, one per process (rank), in lockstep: every
// rank runs the same generation loop, with the same prompt, options and seed, and the same
// drafter (replicated: it is small, and running it on every rank costs no wall time, since the
// ranks run in parallel). The sharded model (models::LlamaModel given a Collectives) all-reduces
// twice per layer, so every rank computes the same logits.
//
// What must not differ between the ranks is every decision taken from device results: how many
// drafts were accepted, which token was sampled, how long the next draft is. Every such decision
// reaches the host through one function, detail::to_host (device.hpp), the counted copy of each
// step. While a SharedDecisions is alive, that copy is rank 0's on every rank: the tensor is
// broadcast from rank 0 first. So the ranks emit the same tokens by construction, one collective
// per step, even where their own results would differ (a sampler seeded differently, logits that
// differ in the last bit). The tests give the ranks different seeds to show it.
//
// Collectives is the interface the library calls; distributed.hpp implements it over PyTorch's
// c10d process groups (Gloo on the CPU, NCCL on GPUs). It is kept out of this header, which the
// models include, because c10d's headers need Gloo's.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include "specdec/detail/check.hpp"
#include "specdec/detail/torch_compat.hpp"

namespace specdec {

// A group of ranks that can sum and broadcast tensors. Every rank must make the same calls, in
// the same order, with tensors of the same shape and dtype; a call fails (throws) when a rank
// is gone or the group's timeout passes.
class Collectives {
 public:
  virtual ~Collectives() = default;
  [[nodiscard]] virtual int64_t rank() const = 0;
  [[nodiscard]] virtual int64_t world_size() const = 0;
  // The element-wise sum of every rank's `tensor` (contiguous), in place: every rank gets the
  // same bits.
  virtual void all_reduce(at::Tensor& tensor) = 0;
  // Rank `root`'s `tensor` (contiguous) into every rank's, in place.
  virtual void broadcast(at::Tensor& tensor, int64_t root) = 0;
};

namespace detail {

inline std::atomic<Collectives*>& decision_group() noexcept {
  static std::atomic<Collectives*> group{nullptr};
  return group;
}

}  // namespace detail

// While alive, every decision the library takes from device results in this process, on any
// thread, is rank 0's (see above): a process runs its tensor-parallel generations one at a time,
// and no other generation beside them. One at a time per process; the group must outlive it. A
// group of one rank changes nothing.
class SharedDecisions {
 public:
  explicit SharedDecisions(Collectives& group) : previous_(detail::decision_group().exchange(&group)) {}
  ~SharedDecisions() { detail::decision_group().store(previous_); }
  SharedDecisions(const SharedDecisions&) = delete;
  SharedDecisions& operator=(const SharedDecisions&) = delete;

 private:
  Collectives* previous_;
};

}  // namespace specdec
