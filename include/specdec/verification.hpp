// The verification core: one rejection-sampling step shared by every generation function.
//
// Given the target's distributions at the gamma drafted positions and the one after them, and the
// drafter's distributions at the drafted positions, it decides how many leading drafts to accept
// and samples the token that follows them, so that the emitted tokens are distributed exactly as
// the target's (Leviathan et al. 2023, Chen et al. 2023; seed 001):
//   draft i is accepted with probability min(1, p_i(d_i) / q_i(d_i)), in order, until one fails;
//   after a rejection at i the token is drawn from the residual max(0, p_i - q_i) / sum(...);
//   when all gamma drafts are accepted it is drawn from p_gamma.
// A deterministic drafter (n-gram, prompt lookup) is a one-hot q at its draft. With gamma = 0 the
// step is plain sampling from p_0: autoregressive decoding uses the same core.
//
// The acceptance tests of all gamma positions are one tensor expression on the target's device,
// and the step costs exactly one device-to-host copy (detail::to_host, counted by
// device_to_host_copies()).
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/detail/check.hpp"
#include "specdec/detail/torch_compat.hpp"
#include "specdec/device.hpp"

namespace specdec {

// The outcome of verify_drafts, on the host.
struct VerifiedStep {
  int64_t accepted = 0;           // leading drafts accepted, in [0, gamma]
  int64_t token = 0;              // the token sampled after the accepted drafts
  std::vector<int64_t> drafts{};  // the drafts that were verified (host copy)
};

namespace detail {

// Checks drafts int64 [gamma] and target_probs floating point [gamma + 1, vocab]; returns gamma.
inline int64_t check_verify_inputs(const at::Tensor& target_probs, const at::Tensor& drafts) {
  if (!drafts.defined() || drafts.dim() != 1 || drafts.scalar_type() != at::kLong) {
    throw_invalid_message("drafts must be a 1-D int64 tensor [gamma]");
  }
  const int64_t gamma = drafts.size(0);
  if (!target_probs.defined() || target_probs.dim() != 2 || target_probs.size(0) != gamma + 1 ||
      !at::isFloatingType(target_probs.scalar_type())) {
    throw_invalid_message("target_probs must be floating point [gamma + 1 = ", gamma + 1,
                          ", vocab], got ",
                          target_probs.defined() ? target_probs.sizes() : at::IntArrayRef{});
  }
  return gamma;
}

// A verification's outcome still on the device, before the step's one host copy: packed holds
// int64 [3 + gamma] = accepted, token, finite, then the gamma drafts. finite is
// kFiniteTarget | kFiniteDrafter when both distributions are finite (a missing drafter counts as
// finite). The generation step appends what else it needs from the device to the same copy.
inline constexpr int64_t kFiniteTarget = 1, kFiniteDrafter = 2, kFinite = kFiniteTarget | kFiniteDrafter;

// The finite code of a target and an optional drafter finiteness (bool tensors of one element).
inline at::Tensor finite_code(const at::Tensor& target_finite, const at::Tensor& drafter_finite) {
  const at::Tensor target = target_finite.to(at::kLong).view({1});
  if (!drafter_finite.defined()) return target + kFiniteDrafter;
  return target + drafter_finite.to(target.device()).to(at::kLong).view({1}) * kFiniteDrafter;
}

// Throws for a finite code other than kFinite, naming the model; `target_logits` (when defined)
// tells whether the target's logits or the processor made its distribution non-finite. An error
// path: the check costs a host copy.
[[noreturn]] inline void throw_step_non_finite(const char* caller, int64_t code, const at::Tensor& target_logits) {
  if ((code & kFiniteTarget) == 0) {
    std::optional<bool> logits_finite;
    if (target_logits.defined()) logits_finite = at::isfinite(target_logits).all().item<bool>();
    throw_non_finite(caller, "target", logits_finite);
  }
  throw_non_finite(caller, "drafter");
}
//
// A greedy step packs instead the target's argmax at every row, then the finite code, then the
// drafts ([2 gamma + 2]), and read_step finds the first mismatch on the host: a dozen fewer
// dispatched operations per step than computing it on the device, for the same single copy.
struct PendingStep {
  at::Tensor packed{};
  int64_t gamma = 0;
  const char* caller = "";
  bool argmax_rows = false;  // packed holds the greedy layout

  // Entries of packed (the offset of what a step appends after them).
  [[nodiscard]] int64_t size() const noexcept { return argmax_rows ? 2 * gamma + 2 : 3 + gamma; }
};

inline PendingStep pack_step(const char* caller, const at::Tensor& accepted, const at::Tensor& token,
                             const at::Tensor& target_finite, const at::Tensor& drafter_finite,
                             const at::Tensor& draft_index) {
  const int64_t gamma = draft_index.size(0);
  return PendingStep{at::cat({accepted, token.to(at::kLong).view({1}), finite_code(target_finite, drafter_finite),
                              draft_index.view({gamma})}),
                     gamma, caller};
}

// Reads a PendingStep from host values (its packed entries, copied). Throws
// std::invalid_argument naming the model when a distribution was not finite; `target_logits`,
// when given, tells whether the target's logits were.
inline VerifiedStep read_step(const PendingStep& pending, const int64_t* values,
                              const at::Tensor& target_logits = at::Tensor()) {
  if (pending.argmax_rows) {
    const int64_t gamma = pending.gamma;
    const int64_t* best = values;
    const int64_t* drafts = values + gamma + 2;
    if (values[gamma + 1] != kFinite) throw_step_non_finite(pending.caller, values[gamma + 1], target_logits);
    int64_t accepted = 0;
    while (accepted < gamma && best[accepted] == drafts[accepted]) ++accepted;
    return VerifiedStep{accepted, best[accepted], std::vector<int64_t>(drafts, drafts + gamma)};
  }
  if (values[2] != kFinite) throw_step_non_finite(pending.caller, values[2], target_logits);
  return VerifiedStep{values[0], values[1], std::vector<int64_t>(values + 3, values + 3 + pending.gamma)};
}

// verify_drafts without its host copy; see verify_drafts.
template <LogitsProcessor P>
PendingStep verify_drafts_pending(const at::Tensor& target_probs, const at::Tensor& draft_probs,
                                  const at::Tensor& drafts, const P& processor, at::Generator& gen,
                                  bool skip_sample_adjustment);

// The first maximum of a row of n fp32 logits (`stride` apart) and whether the row is finite as
// GreedyProcessor sees it: no NaN, no +inf, and not every entry -inf. Where the row is finite the
// index is what at::argmax returns (the first among ties). Entry `skip` (if in [0, n)) is left
// out, as if its logit were -inf.
struct RowMax {
  int64_t index = 0;
  bool finite = false;
};
inline RowMax row_max(const float* row, int64_t n, int64_t stride, int64_t skip = -1) {
  RowMax best;
  float value = -std::numeric_limits<float>::infinity();
  bool nan = false;
  for (int64_t j = 0; j < n; ++j) {
    if (j == skip) continue;
    const float x = row[j * stride];
    nan = nan || x != x;
    if (x > value) {
      value = x;
      best.index = j;
    }
  }
  best.finite = !nan && value > -std::numeric_limits<float>::infinity() && value < std::numeric_limits<float>::infinity();
  return best;
}

// Whether the host reads a tensor where it lies: fp32 on the CPU.
inline bool host_readable(const at::Tensor& t) { return t.device().is_cpu() && t.scalar_type() == at::kFloat; }

// verify_greedy_pending for logits the host reads where they lie (fp32 on the CPU): the same packed
// layout, decoded by one pass over each row instead of a dozen small ATen calls.
inline PendingStep verify_greedy_on_host(const at::Tensor& target_logits, int64_t gamma, const at::Tensor& drafts,
                                         std::optional<bool> drafter_finite) {
  at::Tensor packed = at::empty({2 * gamma + 2}, at::TensorOptions().dtype(at::kLong));
  int64_t* values = packed.data_ptr<int64_t>();
  const float* rows = target_logits.data_ptr<float>();
  bool target_finite = true;
  for (int64_t i = 0; i <= gamma; ++i) {
    const RowMax best = row_max(rows + i * target_logits.stride(0), target_logits.size(1), target_logits.stride(1));
    values[i] = best.index;
    target_finite = target_finite && best.finite;
  }
  values[gamma + 1] = (target_finite ? kFiniteTarget : 0) | (drafter_finite.value_or(true) ? kFiniteDrafter : 0);
  const int64_t* draft_values = drafts.data_ptr<int64_t>();
  for (int64_t i = 0; i < gamma; ++i) values[gamma + 2 + i] = draft_values[i * drafts.stride(0)];
  return PendingStep{packed, gamma, "verify_drafts", /*argmax_rows=*/true};
}

// verify_drafts for GreedyProcessor, from the target's logits [gamma + 1, vocab] rather than its
// one-hot distributions: draft i is accepted while it equals the target's argmax (the first among
// ties), and the token after the accepted drafts is the argmax there (found by read_step). This is what rejection
// sampling computes for one-hot p, whatever q; no distribution, uniform or residual is built.
// Non-finite rows (NaN, +inf, or all -inf) are reported as GreedyProcessor's NaN would be.
// `drafter_finite` (bool []), when given and draft_probs is not, says whether the deterministic
// drafts came from finite drafter logits.
inline PendingStep verify_greedy_pending(const at::Tensor& target_logits, const at::Tensor& draft_probs,
                                         const at::Tensor& drafts, const at::Tensor& drafter_finite = {}) {
  const int64_t gamma = check_verify_inputs(target_logits, drafts);
  if (host_readable(target_logits) && drafts.device().is_cpu() &&
      (!draft_probs.defined() || draft_probs.device().is_cpu()) &&
      (!drafter_finite.defined() || drafter_finite.device().is_cpu())) {
    std::optional<bool> drafter;
    if (draft_probs.defined()) {
      drafter = at::isfinite(draft_probs.sum()).item<bool>();
    } else if (drafter_finite.defined()) {
      drafter = drafter_finite.item<bool>();
    }
    return verify_greedy_on_host(target_logits, gamma, drafts, drafter);
  }
  const at::Tensor target_finite = at::isfinite(target_logits.amax(1)).all();
  const at::Tensor drafter = draft_probs.defined()      ? at::isfinite(draft_probs.sum())
                             : drafter_finite.defined() ? drafter_finite.to(target_logits.device())
                                                        : at::Tensor();
  return PendingStep{at::cat({target_logits.argmax(1), finite_code(target_finite, drafter), drafts.to(target_logits.device())}),
                     gamma, "verify_drafts", /*argmax_rows=*/true};
}

// verify_threshold without its host copy; see verify_threshold.
template <LogitsProcessor P>
PendingStep verify_threshold_pending(const at::Tensor& target_probs, const at::Tensor& drafts, double threshold,
                                     const P& processor, at::Generator& gen);

}  // namespace detail

struct VerifyOptions {
  bool skip_sample_adjustment = false;  // sample a rejected position from p instead of the
                                        // residual: biased, for experiments only (seed 002)
};

// Verifies gamma drafts against the target in one vectorised rejection-sampling step.
//
// Requires: target_probs [gamma + 1, vocab], the processed target distributions predicting the
//   gamma drafted positions and the one after them; draft_probs [gamma, vocab], the processed
//   drafter distributions the drafts were sampled from, or an undefined tensor for deterministic
//   drafts (q one-hot at each draft); drafts int64 [gamma] in [0, vocab); all on one device.
//   `processor` is the policy that produced target_probs; uniforms come from `gen`.
// Returns: the accepted count, the sampled token and the drafts, after one synchronisation.
// Throws: std::invalid_argument on mismatched shapes, and when either distribution holds NaN or
//   infinity (the model produced non-finite logits).
template <LogitsProcessor P>
[[nodiscard]] VerifiedStep verify_drafts(const at::Tensor& target_probs,
                                         const at::Tensor& draft_probs, const at::Tensor& drafts,
                                         const P& processor, at::Generator& gen,
                                         const VerifyOptions& options = {}) {
  const detail::PendingStep pending = detail::verify_drafts_pending(
      target_probs, draft_probs, drafts, processor, gen, options.skip_sample_adjustment);
  return detail::read_step(pending, detail::to_host(pending.packed).data_ptr<int64_t>());
}

// Threshold verification (seed 003): keeps draft i while p_i(d_i) >= threshold and samples the
// token after the kept drafts from p at that position (the first failure's correction, or the
// bonus token when every draft passed). LOSSY under sampling: the emitted tokens are not
// distributed as the target's. With a greedy processor and 0 < threshold <= 1 it keeps exactly
// the drafts equal to the target's argmax, as verify_drafts does. threshold = 0 keeps every draft;
// threshold > 1 keeps none, and the step is plain sampling from p_0.
//
// Requires: target_probs and drafts as for verify_drafts; threshold >= 0.
// Returns: the kept count, the sampled token and the drafts, after one synchronisation.
// Throws: std::invalid_argument on mismatched shapes, a negative or NaN threshold, and when the
//   target distribution holds NaN or infinity.
template <LogitsProcessor P>
[[nodiscard]] VerifiedStep verify_threshold(const at::Tensor& target_probs, const at::Tensor& drafts,
                                            double threshold, const P& processor, at::Generator& gen) {
  const detail::PendingStep pending = detail::verify_threshold_pending(target_probs, drafts, threshold, processor, gen);
  return detail::read_step(pending, detail::to_host(pending.packed).data_ptr<int64_t>());
}

// Definitions of the pending verifications declared above.
namespace detail {
template <LogitsProcessor P>
PendingStep verify_drafts_pending(const at::Tensor& target_probs, const at::Tensor& draft_probs,
                                          const at::Tensor& drafts, const P& processor, at::Generator& gen,
                                          bool skip_sample_adjustment) {
  const int64_t gamma = check_verify_inputs(target_probs, drafts);
  const int64_t vocab = target_probs.size(1);
  if (draft_probs.defined() &&
      (draft_probs.dim() != 2 || draft_probs.size(0) != gamma || draft_probs.size(1) != vocab)) {
    throw_invalid_message("draft_probs must be [gamma = ", gamma, ", vocab = ", vocab,
                                  "], got ", draft_probs.sizes());
  }

  const at::Device device = target_probs.device();
  const auto as_double = at::TensorOptions().dtype(at::kDouble).device(device);
  const at::Tensor draft_index = drafts.to(device).view({gamma, 1});

  // Accept draft i when r_i < p_i(d_i) / q_i(d_i), written without the division; a deterministic
  // draft has q_i(d_i) = 1.
  const at::Tensor p_drafted =
      target_probs.narrow(0, 0, gamma).gather(1, draft_index).view({gamma}).to(at::kDouble);
  const at::Tensor q_drafted =
      draft_probs.defined()
          ? draft_probs.to(device).gather(1, draft_index).view({gamma}).to(at::kDouble)
          : at::ones({gamma}, as_double);
  const at::Tensor uniforms =
      at::rand({gamma}, gen, at::TensorOptions().dtype(at::kDouble).device(gen.device())).to(device);
  const at::Tensor accepted = (uniforms * q_drafted < p_drafted).to(at::kLong).cumprod(0).sum().view({1});

  // The distribution of the next token, built for the accepted row only: the normalised residual
  // max(0, p_n - q_n) after a rejection at n, p_gamma when every draft was accepted (q_gamma = 0).
  const at::Tensor p_row = target_probs.index_select(0, accepted).to(at::kDouble);
  at::Tensor next = p_row;
  if (gamma > 0 && !skip_sample_adjustment) {
    const at::Tensor row = accepted.clamp_max(gamma - 1);
    const at::Tensor q_row =
        draft_probs.defined()
            ? draft_probs.to(device).index_select(0, row).to(at::kDouble)
            : at::zeros({1, vocab}, as_double).scatter_(1, draft_index.index_select(0, row), 1.0);
    const at::Tensor residual = (p_row - q_row * (accepted < gamma)).clamp_min(0.0);
    const at::Tensor mass = residual.sum(1, /*keepdim=*/true);
    next = at::where(mass > 0, residual / mass.clamp_min(1e-300), p_row);
  }
  const at::Tensor token = processor.sample(next, gen).view({1});

  // Probabilities are non-negative, so a sum is finite exactly when every entry is.
  const at::Tensor drafter_finite = draft_probs.defined() ? at::isfinite(draft_probs.sum()) : at::Tensor();
  return pack_step("verify_drafts", accepted, token, at::isfinite(target_probs.sum()), drafter_finite, draft_index);
}

template <LogitsProcessor P>
PendingStep verify_threshold_pending(const at::Tensor& target_probs, const at::Tensor& drafts,
                                             double threshold, const P& processor, at::Generator& gen) {
  if (!(threshold >= 0.0)) throw_invalid("threshold", "be >= 0", threshold);
  const int64_t gamma = check_verify_inputs(target_probs, drafts);
  const at::Tensor draft_index = drafts.to(target_probs.device()).view({gamma, 1});
  const at::Tensor p_drafted =
      target_probs.narrow(0, 0, gamma).gather(1, draft_index).view({gamma}).to(at::kDouble);
  const at::Tensor accepted = (p_drafted >= threshold).to(at::kLong).cumprod(0).sum().view({1});
  const at::Tensor token = processor.sample(target_probs.index_select(0, accepted), gen).view({1});
  return pack_step("verify_threshold", accepted, token, at::isfinite(target_probs.sum()), at::Tensor(), draft_index);
}

}  // namespace detail

}  // namespace specdec
