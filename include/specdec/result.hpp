// What a generation function returns: the generated tokens and counters of the work it did.
#pragma once

#include <cstdint>
#include <vector>

#include "specdec/options.hpp"

namespace specdec {

// Counters of one generation. Times are host wall-clock seconds; on an asynchronous device a
// forward's time is the time to enqueue it, and the wait shows up in the step's synchronisation.
struct GenerationStats {
  int64_t drafted = 0;        // draft tokens proposed to the target
  int64_t accepted = 0;       // draft tokens the target accepted
  int64_t target_calls = 0;   // target forward calls
  int64_t drafter_calls = 0;  // drafter forward calls
  int64_t steps = 0;          // generation steps (each ends with one token sampled from the target)
  int64_t generated = 0;      // tokens generated (the size of GenerationResult::tokens)
  int64_t target_positions = 0;  // positions the target computed, over all its forwards: the
                                 // uncached context (prefill) plus every verified draft
  double total_seconds = 0;   // wall time of the whole call
  double target_seconds = 0;  // wall time inside target forward calls
  double drafter_seconds = 0; // wall time inside drafter forward calls
  double rtt_seconds = 0;     // remote verification: round trips, over all steps (0 locally)
  double prefill_seconds = 0; // remote verification: the server's target forwards within them
  int64_t graph_steps = 0;    // steps run in static shapes (SpeculativeOptions::cuda_graph):
                              // replayed from a CUDA graph on CUDA. Their drafter and target
                              // forwards are counted as usual, their time as target time

  // Adds another generation's counters and times: totals over several calls.
  GenerationStats& operator+=(const GenerationStats& other) noexcept {
    drafted += other.drafted;
    accepted += other.accepted;
    target_calls += other.target_calls;
    drafter_calls += other.drafter_calls;
    steps += other.steps;
    generated += other.generated;
    target_positions += other.target_positions;
    total_seconds += other.total_seconds;
    target_seconds += other.target_seconds;
    drafter_seconds += other.drafter_seconds;
    rtt_seconds += other.rtt_seconds;
    prefill_seconds += other.prefill_seconds;
    graph_steps += other.graph_steps;
    return *this;
  }

  // accepted / drafted; 0 when nothing was drafted.
  [[nodiscard]] double acceptance_rate() const noexcept {
    return drafted == 0 ? 0.0 : static_cast<double>(accepted) / static_cast<double>(drafted);
  }
  // generated / target_calls; 0 without target calls.
  [[nodiscard]] double tokens_per_target_call() const noexcept {
    return target_calls == 0 ? 0.0
                             : static_cast<double>(generated) / static_cast<double>(target_calls);
  }
  // drafted / steps: the mean number of drafts per step (the gamma actually used).
  [[nodiscard]] double drafts_per_step() const noexcept {
    return steps == 0 ? 0.0 : static_cast<double>(drafted) / static_cast<double>(steps);
  }
  // accepted / steps: the mean accepted length per step.
  [[nodiscard]] double accepted_per_step() const noexcept {
    return steps == 0 ? 0.0 : static_cast<double>(accepted) / static_cast<double>(steps);
  }
  // drafter_calls / generated: drafter work per emitted token.
  [[nodiscard]] double drafter_calls_per_token() const noexcept {
    return generated == 0 ? 0.0
                          : static_cast<double>(drafter_calls) / static_cast<double>(generated);
  }
  // Time spent outside model forwards: sampling, verification, cache pruning, bookkeeping.
  [[nodiscard]] double library_seconds() const noexcept {
    return total_seconds - target_seconds - drafter_seconds;
  }
};

struct GenerationResult {
  std::vector<int64_t> tokens{};  // generated tokens, prompt excluded; an end token is included
  GenerationStats stats{};
  StopReason stop_reason = StopReason::max_new_tokens;  // why generation ended
};

}  // namespace specdec
