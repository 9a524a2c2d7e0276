// Logits processors: sampling policies that turn logits into a distribution and draw from it.
//
// Every processor applies the temperature first and then its top-k / top-p filter (the order of
// Hugging Face transformers and vLLM; the Python reference of the seeds filters first, which keeps
// the same tokens for top-k but can keep a different nucleus for top-p). Filtered tokens get
// probability exactly 0. Processors are small values: parameters are validated in the constructor,
// operator() is const, never modifies its input, and works on any leading shape [..., vocab] and
// any device. Probabilities are computed in at least float32.
//
// Sampling draws uniforms from the caller's at::Generator on the generator's own device and moves
// them to the distribution's device, then inverts the cumulative distribution: the same seed gives
// the same tokens on every device, and a token of probability 0 is never drawn.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <ostream>

#include "specdec/concepts.hpp"
#include "specdec/detail/check.hpp"
#include "specdec/detail/torch_compat.hpp"

namespace specdec {
namespace detail {

inline void check_temperature(double temperature) {
  if (!(temperature > 0.0) || !std::isfinite(temperature)) {
    throw_invalid("temperature", "be finite and > 0", temperature);
  }
}

inline void check_top_k(int64_t k) {
  if (k < 1) throw_invalid("k", "be >= 1", k);
}

inline void check_top_p(double top_p) {
  if (!(top_p > 0.0 && top_p <= 1.0)) throw_invalid("top_p", "be in (0, 1]", top_p);
}

inline void check_logits(const at::Tensor& logits) {
  if (!logits.defined() || logits.dim() < 1 || logits.size(-1) < 1) {
    throw_invalid_message("logits must have shape [..., vocab] with vocab >= 1, got ",
                          logits.defined() ? logits.sizes() : at::IntArrayRef{});
  }
  if (!at::isFloatingType(logits.scalar_type())) {
    throw_invalid("logits", "be a floating-point tensor", logits.scalar_type());
  }
}

// Logits divided by the temperature, promoted to at least float32. A new tensor.
inline at::Tensor scale_logits(const at::Tensor& logits, double temperature) {
  check_logits(logits);
  const auto type = at::promote_types(logits.scalar_type(), at::kFloat);
  return logits.to(type) / temperature;
}

// Keeps the k largest logits (every logit tied with the k-th largest too), -inf elsewhere.
inline at::Tensor mask_top_k(const at::Tensor& logits, int64_t k) {
  const int64_t vocab = logits.size(-1);
  if (k >= vocab) return logits;
  const at::Tensor kth = std::get<0>(logits.topk(k, -1)).narrow(-1, k - 1, 1);
  return logits.masked_fill(logits < kth, -std::numeric_limits<double>::infinity());
}

// Keeps the smallest set of most probable tokens whose probability reaches top_p (the token that
// crosses top_p is kept, and the most probable token always is), -inf elsewhere.
inline at::Tensor mask_top_p(const at::Tensor& logits, double top_p) {
  if (top_p >= 1.0) return logits;
  const auto [sorted, order] = logits.sort(-1, /*descending=*/true);
  const at::Tensor probs = sorted.softmax(-1);
  const at::Tensor mass_before = probs.cumsum(-1) - probs;
  const at::Tensor drop_sorted = mass_before >= top_p;
  const at::Tensor drop = at::empty_like(drop_sorted).scatter_(-1, order, drop_sorted);
  return logits.masked_fill(drop, -std::numeric_limits<double>::infinity());
}

// The token of each distribution of probs [..., vocab] at uniform [..., 1] in [0, 1): the inverse
// of its distribution function (a one-hot row gives its argmax). Returns int64 [..., 1].
inline at::Tensor sample_at_uniform(const at::Tensor& probs, const at::Tensor& uniform) {
  const at::Tensor cdf = probs.to(at::kDouble).cumsum(-1);
  const at::Tensor threshold = uniform.to(cdf.device()) * cdf.narrow(-1, cdf.size(-1) - 1, 1);
  // `side` given (it agrees with `right`): GCC 12 warns that the empty default may be used
  // uninitialized inside libtorch 1.13's optional.
  return at::searchsorted(cdf, threshold, /*out_int32=*/false, /*right=*/true, /*side=*/c10::string_view("right"))
      .clamp_max(cdf.size(-1) - 1);
}

// Draws one index per row of probs [..., vocab] by inverting the cumulative distribution with
// uniforms from `gen`. Returns int64 [..., 1] on probs' device.
inline at::Tensor sample_categorical(const at::Tensor& probs, at::Generator& gen) {
  check_logits(probs);
  auto shape = probs.sizes().vec();
  shape.back() = 1;
  return sample_at_uniform(probs, at::rand(shape, gen, at::TensorOptions().dtype(at::kDouble).device(gen.device())));
}

}  // namespace detail

// The temperature-0 limit: a one-hot distribution at the argmax (the first index among ties).
// With it every speculative method reproduces greedy autoregressive decoding token for token.
struct GreedyProcessor {
  // Returns the one-hot distribution [..., vocab] at the argmax of the last dimension. A row with
  // NaN or +inf logits, or only -inf, gives NaN probabilities (argmax alone would hide them), which
  // the generation loop reports as an error.
  [[nodiscard]] at::Tensor operator()(const at::Tensor& logits) const {
    detail::check_logits(logits);
    const auto type = at::promote_types(logits.scalar_type(), at::kFloat);
    const at::Tensor top = logits.amax(-1, /*keepdim=*/true).to(type);
    return at::zeros(logits.sizes(), logits.options().dtype(type))
               .scatter_(-1, logits.argmax(-1, /*keepdim=*/true), 1.0) +
           (top - top);
  }

  // Returns the argmax [..., 1]; the generator is not used.
  [[nodiscard]] at::Tensor sample(const at::Tensor& probs, at::Generator& /*gen*/) const {
    detail::check_logits(probs);
    return probs.argmax(-1, /*keepdim=*/true);
  }

  friend std::ostream& operator<<(std::ostream& out, const GreedyProcessor&) {
    return out << "GreedyProcessor{}";
  }
};

// Sampling from softmax(logits / temperature).
class MultinomialProcessor {
 public:
  // Requires temperature finite and > 0 (1 leaves the model's distribution unchanged).
  explicit MultinomialProcessor(double temperature = 1.0) : temperature_(temperature) {
    detail::check_temperature(temperature);
  }

  [[nodiscard]] at::Tensor operator()(const at::Tensor& logits) const {
    return detail::scale_logits(logits, temperature_).softmax(-1);
  }

  [[nodiscard]] at::Tensor sample(const at::Tensor& probs, at::Generator& gen) const {
    return detail::sample_categorical(probs, gen);
  }

  friend std::ostream& operator<<(std::ostream& out, const MultinomialProcessor& p) {
    return out << "MultinomialProcessor{temperature=" << p.temperature_ << "}";
  }

  [[nodiscard]] double temperature() const noexcept { return temperature_; }

 private:
  double temperature_;
};

// Sampling from the k most probable tokens (after the temperature), renormalised.
class TopKProcessor {
 public:
  // Requires k >= 1 (k >= vocab keeps every token) and temperature finite and > 0.
  explicit TopKProcessor(int64_t k, double temperature = 1.0) : k_(k), temperature_(temperature) {
    detail::check_top_k(k);
    detail::check_temperature(temperature);
  }

  [[nodiscard]] at::Tensor operator()(const at::Tensor& logits) const {
    return detail::mask_top_k(detail::scale_logits(logits, temperature_), k_).softmax(-1);
  }

  [[nodiscard]] at::Tensor sample(const at::Tensor& probs, at::Generator& gen) const {
    return detail::sample_categorical(probs, gen);
  }

  friend std::ostream& operator<<(std::ostream& out, const TopKProcessor& p) {
    return out << "TopKProcessor{k=" << p.k_ << ", temperature=" << p.temperature_ << "}";
  }

  [[nodiscard]] int64_t k() const noexcept { return k_; }
  [[nodiscard]] double temperature() const noexcept { return temperature_; }

 private:
  int64_t k_;
  double temperature_;
};

// Nucleus (top-p) sampling: the smallest set of most probable tokens whose mass reaches top_p.
class NucleusProcessor {
 public:
  // Requires top_p in (0, 1] (1 keeps every token) and temperature finite and > 0.
  explicit NucleusProcessor(double top_p, double temperature = 1.0)
      : top_p_(top_p), temperature_(temperature) {
    detail::check_top_p(top_p);
    detail::check_temperature(temperature);
  }

  [[nodiscard]] at::Tensor operator()(const at::Tensor& logits) const {
    return detail::mask_top_p(detail::scale_logits(logits, temperature_), top_p_).softmax(-1);
  }

  [[nodiscard]] at::Tensor sample(const at::Tensor& probs, at::Generator& gen) const {
    return detail::sample_categorical(probs, gen);
  }

  friend std::ostream& operator<<(std::ostream& out, const NucleusProcessor& p) {
    return out << "NucleusProcessor{top_p=" << p.top_p_ << ", temperature=" << p.temperature_ << "}";
  }

  [[nodiscard]] double top_p() const noexcept { return top_p_; }
  [[nodiscard]] double temperature() const noexcept { return temperature_; }

 private:
  double top_p_;
  double temperature_;
};

// Top-k filtering, then the nucleus of what remains (the order of Hugging Face's warpers).
class TopKNucleusProcessor {
 public:
  // Requires k >= 1, top_p in (0, 1] and temperature finite and > 0.
  TopKNucleusProcessor(int64_t k, double top_p, double temperature = 1.0)
      : k_(k), top_p_(top_p), temperature_(temperature) {
    detail::check_top_k(k);
    detail::check_top_p(top_p);
    detail::check_temperature(temperature);
  }

  [[nodiscard]] at::Tensor operator()(const at::Tensor& logits) const {
    const at::Tensor top_k = detail::mask_top_k(detail::scale_logits(logits, temperature_), k_);
    return detail::mask_top_p(top_k, top_p_).softmax(-1);
  }

  [[nodiscard]] at::Tensor sample(const at::Tensor& probs, at::Generator& gen) const {
    return detail::sample_categorical(probs, gen);
  }

  friend std::ostream& operator<<(std::ostream& out, const TopKNucleusProcessor& p) {
    return out << "TopKNucleusProcessor{k=" << p.k_ << ", top_p=" << p.top_p_
               << ", temperature=" << p.temperature_ << "}";
  }

  [[nodiscard]] int64_t k() const noexcept { return k_; }
  [[nodiscard]] double top_p() const noexcept { return top_p_; }
  [[nodiscard]] double temperature() const noexcept { return temperature_; }

 private:
  int64_t k_;
  double top_p_;
  double temperature_;
};

static_assert(LogitsProcessor<GreedyProcessor>);
static_assert(LogitsProcessor<MultinomialProcessor>);
static_assert(LogitsProcessor<TopKProcessor>);
static_assert(LogitsProcessor<NucleusProcessor>);
static_assert(LogitsProcessor<TopKNucleusProcessor>);

}  // namespace specdec
