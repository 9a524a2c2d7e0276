// CUDA graphs for the decoding step (SpeculativeOptions::cuda_graph).
//
// On a GPU a small model's forward costs more in kernel launches than in arithmetic: a step of
// gamma drafts launches the drafter gamma times and the target once, each a few hundred kernels.
// A CUDA graph records those launches once and replays them with one call. A graph replays fixed
// shapes and fixed addresses, so the step it records is written in static shapes:
//   - inputs in fixed device buffers: the sequence's last two tokens and their positions, uploaded
//     from pinned memory without waiting;
//   - the drafter feeds both tokens (the first may already be cached: it is written again at the
//     same position), then its gamma - 1 drafts one by one, each the argmax of the last logits;
//   - the target scores the last token and the gamma drafts in one forward;
//   - forwards write their keys and values at positions given on the device and attend over the
//     cache's whole capacity under a mask built on the device (StaticForwardModel::forward_at);
//   - the greedy acceptance packs the target's argmax rows, the finiteness code and the drafts
//     into a fixed output buffer (verification.hpp's greedy layout).
// The host then makes the step's one device-to-host copy of that buffer, finds the accepted
// prefix, and tells each cache how many of the written positions it keeps.
//
// A step is replayed when all of these hold, and runs eagerly otherwise: SpeculativeOptions has
// cuda_graph set, gamma_policy fixed, no confidence stop (p_min 0, entropy_gate 1), rejection
// verification and use_cache; the processor is GreedyProcessor; the source is a ModelDraftSource
// whose drafter, like the target, models StaticForwardModel and lives on the target's CUDA device;
// one sequence; the target has room for gamma + 1 more positions and the drafter for gamma; the
// target caches all but the sequence's last token and the drafter all but its last one or two.
// So the prompt's prefill, a first target-only step and the steps near the length limit run
// eagerly. On a device other than CUDA, the steps that would replay run the same static-shape
// computation eagerly instead (slower than the usual step; it is how the tests check it). One
// graph is captured per generation call, at its first replayable step (after one eager warm-up
// run of the same step on a side stream), and recaptured if a cache's storage moves.
// Sampling runs eagerly: its random draws would have to come from generators registered with the
// graph.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <memory>
#include <span>
#include <type_traits>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/detail/model_runner.hpp"
#include "specdec/detail/torch_compat.hpp"
#include "specdec/device.hpp"
#include "specdec/kv_cache.hpp"
#include "specdec/logits_processor.hpp"
#include "specdec/options.hpp"
#include "specdec/verification.hpp"

#ifdef SPECDEC_HAVE_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace specdec {

// StaticForwardModel: a LanguageModel whose forward can run in static shapes, so that a CUDA graph
// can record it once and replay it at every step.
//
// A type M satisfies StaticForwardModel if it satisfies LanguageModel, its cache_type is
// StaticKVCache, and for `m` an M, `m.forward_at(ids, cache, positions)`, with ids int64 [1, T]
// and positions int64 [T] on m.device() (consecutive; the first at most cache.length(), the last
// below cache.capacity()):
//   1. writes the T tokens' keys and values at those positions of the cache and returns their
//      logits [1, T, vocab], each token attending to the cache's positions at or before its own;
//   2. leaves cache.length() unchanged (the caller commits what it keeps);
//   3. makes no host synchronisation and reads nothing from the host but shapes and addresses:
//      the same call replays correctly with other values in the same tensors.
// Not required: that forward_at() equals forward() to the last bit (it attends over the whole
// capacity under a mask, a different reduction).
template <class M>
concept StaticForwardModel =
    LanguageModel<M> && std::same_as<typename M::cache_type, StaticKVCache> &&
    requires(M& m, const at::Tensor& ids, StaticKVCache& cache, const at::Tensor& positions) {
      { m.forward_at(ids, cache, positions) } -> std::convertible_to<at::Tensor>;
    };

namespace detail {

// Whether the options allow a step to replay a graph (see the header comment).
inline bool graph_options(const SpeculativeOptions& options) {
  return options.cuda_graph && options.gamma_policy == GammaPolicy::fixed && options.p_min == 0.0 &&
         options.entropy_gate >= 1.0 && options.verification == Verification::rejection && options.use_cache;
}

// The outcome of a static-shape step, on the host.
struct GraphedOutcome {
  VerifiedStep step{};
  std::vector<int64_t> drafts{};  // the gamma drafts
};

// One speculative step of a fixed gamma in static shapes, for a drafter D and a target T that
// model StaticForwardModel. On CUDA (built with SPECDEC_HAVE_CUDA) it is captured as a CUDA graph
// and replayed; elsewhere the same computation runs eagerly (the tests run it so on the CPU).
template <StaticForwardModel D, StaticForwardModel T>
class StaticChainStep {
 public:
  StaticChainStep(int64_t gamma, const at::Device& device)
      : gamma_(gamma),
        device_(device),
        host_inputs_(at::empty({3}, at::TensorOptions().dtype(at::kLong).pinned_memory(device.is_cuda()))),
        inputs_(at::zeros({3}, at::TensorOptions().dtype(at::kLong).device(device))),
        offsets_(at::arange(gamma + 1, at::TensorOptions().dtype(at::kLong).device(device))),
        packed_(at::zeros({2 * gamma + 2}, at::TensorOptions().dtype(at::kLong).device(device))) {}

  [[nodiscard]] int64_t gamma() const noexcept { return gamma_; }

  // Whether the step after `sequence` (length L >= 2) can run in static shapes with these runners.
  [[nodiscard]] bool applies(const ModelRunner<D>& drafter, const ModelRunner<T>& target,
                             std::span<const int64_t> sequence) const {
    const auto length = static_cast<int64_t>(sequence.size());
    if (length < 2 || !drafter.uses_cache() || !target.uses_cache()) return false;
    if (drafter.device() != device_ || target.device() != device_) return false;
    const StaticKVCache& drafter_cache = drafter.cache();
    const StaticKVCache& target_cache = target.cache();
    if (drafter_cache.shape().batch != 1 || target_cache.shape().batch != 1) return false;
    // The target writes positions L-1 .. L-1+gamma, the drafter L-2 .. L-2+gamma-1 (the caller
    // checks that the generation has room for gamma drafts).
    if (length + gamma_ > std::min(target_cache.capacity(), drafter_cache.capacity() + 1)) return false;
    const int64_t drafter_cached = drafter.cached();
    return target.cached() == length - 1 && (drafter_cached == length - 1 || drafter_cached == length - 2);
  }

  // Runs the step after `sequence` (applies() must hold): replayed from the graph on a CUDA
  // device, eagerly otherwise. Costs one device-to-host copy. Afterwards each
  // cache holds what the eager step would have left: the target the sequence's last token and
  // the accepted drafts, the drafter those of them it has fed.
  GraphedOutcome run(ModelRunner<D>& drafter, ModelRunner<T>& target, std::span<const int64_t> sequence) {
    const auto length = static_cast<int64_t>(sequence.size());
    int64_t* host = host_inputs_.data_ptr<int64_t>();
    host[0] = sequence[static_cast<size_t>(length - 2)];
    host[1] = sequence[static_cast<size_t>(length - 1)];
    host[2] = length - 2;
    inputs_.copy_(host_inputs_, /*non_blocking=*/device_.is_cuda());
    StaticKVCache& drafter_cache = drafter.writable_cache();
    StaticKVCache& target_cache = target.writable_cache();
    if (device_.is_cuda()) {
      replay_graph(drafter.model(), drafter_cache, target.model(), target_cache);
    } else {
      prepare(drafter_cache, target_cache);
      body(drafter.model(), drafter_cache, target.model(), target_cache);
    }
    const at::Tensor copied = to_host(packed_);
    const int64_t* values = copied.data_ptr<int64_t>();
    GraphedOutcome outcome{read_step(PendingStep{packed_, gamma_, "verify_drafts", /*argmax_rows=*/true}, values),
                           std::vector<int64_t>(values + gamma_ + 2, values + 2 * gamma_ + 2)};
    const int64_t accepted = outcome.step.accepted;
    target.hold(length + accepted);
    drafter.hold(length + std::min(accepted, gamma_ - 1));
    return outcome;
  }

 private:
  // Once per cache: positions no write has reached are zeroed (the forwards read the whole
  // capacity under a mask).
  void prepare(StaticKVCache& drafter_cache, StaticKVCache& target_cache) {
    if (prepared_drafter_ != drafter_cache.storage_address()) {
      drafter_cache.zero_unwritten();
      prepared_drafter_ = drafter_cache.storage_address();
    }
    if (prepared_target_ != target_cache.storage_address()) {
      target_cache.zero_unwritten();
      prepared_target_ = target_cache.storage_address();
    }
  }

  // The step itself, from inputs_ (s[L-2], s[L-1], L-2) to packed_.
  void body(D& drafter, StaticKVCache& drafter_cache, T& target, StaticKVCache& target_cache) {
    const at::Tensor context = inputs_.narrow(0, 0, 2).view({1, 2});
    const at::Tensor start = inputs_.narrow(0, 2, 1);  // L - 2
    at::Tensor logits = drafter.forward_at(context, drafter_cache, start + offsets_.narrow(0, 0, 2));
    std::vector<at::Tensor> drafts, maxima;
    for (int64_t i = 0; i < gamma_; ++i) {
      if (i > 0) logits = drafter.forward_at(drafts.back().view({1, 1}), drafter_cache, start + (i + 1));
      const at::Tensor last = logits.select(0, 0).select(0, logits.size(1) - 1);  // [vocab]
      drafts.push_back(last.argmax(0, /*keepdim=*/true));
      maxima.push_back(last.amax(0, /*keepdim=*/true));
    }
    const at::Tensor draft_ids = at::cat(drafts);  // [gamma]
    const at::Tensor verified = at::cat({context.narrow(1, 1, 1), draft_ids.view({1, gamma_})}, 1);
    const at::Tensor rows = target.forward_at(verified, target_cache, start + 1 + offsets_).select(0, 0);
    const PendingStep pending =
        verify_greedy_pending(rows, at::Tensor(), draft_ids, at::isfinite(at::cat(maxima)).all());
    packed_.copy_(pending.packed);
  }

#ifdef SPECDEC_HAVE_CUDA
  void replay_graph(D& drafter, StaticKVCache& drafter_cache, T& target, StaticKVCache& target_cache) {
    if (!graph_ || graph_drafter_ != drafter_cache.storage_address() ||
        graph_target_ != target_cache.storage_address()) {
      capture(drafter, drafter_cache, target, target_cache);
    }
    graph_->replay();
  }

  // Records body() in a graph on a side stream, after one eager run there (first uses of cuBLAS
  // and the allocator happen outside the capture); the current stream then waits for it.
  void capture(D& drafter, StaticKVCache& drafter_cache, T& target, StaticKVCache& target_cache) {
    graph_.reset();
    prepare(drafter_cache, target_cache);
    const c10::DeviceIndex index = device_.index() < 0 ? c10::cuda::current_device() : device_.index();
    const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(index);
    const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index);
    at::cuda::CUDAEvent ready;
    ready.record(current);
    ready.block(side);
    auto graph = std::make_unique<at::cuda::CUDAGraph>();
    {
      const c10::cuda::CUDAStreamGuard guard(side);
      body(drafter, drafter_cache, target, target_cache);
      graph->capture_begin();
      body(drafter, drafter_cache, target, target_cache);
      graph->capture_end();
    }
    at::cuda::CUDAEvent done;
    done.record(side);
    done.block(current);
    graph_ = std::move(graph);
    graph_drafter_ = drafter_cache.storage_address();
    graph_target_ = target_cache.storage_address();
  }

  std::unique_ptr<at::cuda::CUDAGraph> graph_;
  const void* graph_drafter_ = nullptr;
  const void* graph_target_ = nullptr;
#else
  void replay_graph(D& drafter, StaticKVCache& drafter_cache, T& target, StaticKVCache& target_cache) {
    prepare(drafter_cache, target_cache);
    body(drafter, drafter_cache, target, target_cache);
  }
#endif

  int64_t gamma_;
  at::Device device_;
  at::Tensor host_inputs_;  // int64 [3] (pinned on CUDA): s[L-2], s[L-1], L-2
  at::Tensor inputs_;       // the same on the device, read by the graph
  at::Tensor offsets_;      // 0 .. gamma on the device
  at::Tensor packed_;       // int64 [2 gamma + 2]: the greedy step's packed outcome
  const void* prepared_drafter_ = nullptr;
  const void* prepared_target_ = nullptr;
};

}  // namespace detail
}  // namespace specdec
