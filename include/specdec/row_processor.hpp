// Sampling with parameters of its own for every batch row: what a serving engine needs when the
// requests sharing a forward each bring their own temperature, top-k, top-p and min-p.
//
// RowProcessor models LogitsProcessor over batches: row r of logits [b, ..., vocab] is turned into
// the distribution that row r's parameters define, in one tensor expression for the whole batch
// (one sort), so a batch of mixed requests costs what a batch of one kind costs. The filters are
// those of the single-policy processors (logits_processor.hpp), in the same order: temperature,
// then top-k (ties with the k-th kept), then the nucleus of what remains, then min-p; a row with
// temperature 0 is greedy (GreedyProcessor's one-hot at the argmax). Row r of RowProcessor{{p}}
// therefore gives what MultinomialProcessor, TopKProcessor, NucleusProcessor or
// TopKNucleusProcessor with p's parameters give, up to float rounding.
//
// Seeds: a row with SamplingParams::seed draws every random number from its seed and the position
// the draw decides (the index in its sequence of the token accepted, sampled or drafted there),
// through a counter-based hash, in the same tensor expression as the other rows. Its tokens then
// depend on its seed, prompt, parameters and drafts only, never on the rows beside it or on how
// the steps fall. A draw for a position that a step leaves undecided (a draft after the first
// rejection) is made again for that position by a later step: it influenced nothing emitted, so
// every decision still sees a fresh uniform and the output keeps its distribution. Rows without a
// seed draw from the generator the caller passes.
//
// min-p (Nguyen et al., 2024, "Turning Up the Heat: Min-p Sampling") keeps the tokens whose
// probability is at least min_p times the most probable token's; it is applied to the
// temperature-scaled logits as a ratio, so it does not depend on the other filters.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <ostream>
#include <span>
#include <stdexcept>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/detail/check.hpp"
#include "specdec/detail/torch_compat.hpp"
#include "specdec/device.hpp"
#include "specdec/logits_processor.hpp"

namespace specdec {

namespace detail {

// A 32-bit integer mixer (xorshift-multiply rounds; a bijection with full avalanche), on the host.
constexpr uint32_t mix32(uint32_t x) noexcept {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

// x * c mod 2^32 for an int64 tensor of values in [0, 2^32) and c < 2^32, in 16-bit halves so
// that no int64 product overflows.
inline at::Tensor mul32(const at::Tensor& x, int64_t c) {
  const at::Tensor high = (x.bitwise_right_shift(16) * c).bitwise_and(0xFFFF).bitwise_left_shift(16);
  return (high + x.bitwise_and(0xFFFF) * c).bitwise_and(int64_t{0xFFFFFFFF});
}

// mix32 elementwise on an int64 tensor of values in [0, 2^32).
inline at::Tensor mix32(at::Tensor x) {
  x = x.bitwise_xor(x.bitwise_right_shift(16));
  x = mul32(x, 0x7feb352d);
  x = x.bitwise_xor(x.bitwise_right_shift(15));
  x = mul32(x, int64_t{0x846ca68b});
  return x.bitwise_xor(x.bitwise_right_shift(16));
}

// The key of a 64-bit seed: both halves mixed into 32 bits.
constexpr uint32_t seed_key(uint64_t seed) noexcept {
  return mix32(static_cast<uint32_t>(seed) ^ mix32(static_cast<uint32_t>(seed >> 32) ^ 0x9e3779b9U));
}

}  // namespace detail

// What a row's random number decides at a position (each draws its own, independent of the others).
enum class RandomUse : uint32_t { accept = 1, sample = 2, draft = 3 };

namespace detail {

// Uniforms in [0, 1) with 53 random bits, double, one per element of positions (int64, values in
// [0, 2^32)), for the row keys `keys` (int64 [b], seed_key values) broadcast over positions [b, ...].
inline at::Tensor keyed_uniforms(const at::Tensor& keys, const at::Tensor& positions, RandomUse use) {
  std::vector<int64_t> shape(static_cast<size_t>(positions.dim()), 1);
  shape.front() = keys.size(0);
  const at::Tensor x = mix32(keys.view(shape).bitwise_xor(mix32(positions.bitwise_and(int64_t{0xFFFFFFFF}))));
  const auto salt = [&](uint32_t half) { return static_cast<int64_t>(mix32(2U * static_cast<uint32_t>(use) + half)); };
  const at::Tensor high = mix32(x.bitwise_xor(salt(0))).bitwise_right_shift(5);  // 27 bits
  const at::Tensor low = mix32(x.bitwise_xor(salt(1))).bitwise_right_shift(6);   // 26 bits
  return (high.to(at::kDouble) * 67108864.0 + low.to(at::kDouble)) / 9007199254740992.0;
}

}  // namespace detail

// One request's sampling parameters. The neutral value of each filter keeps every token.
struct SamplingParams {
  double temperature = 0.0;  // 0: greedy (argmax); otherwise finite and > 0 (1: the model's own)
  int64_t top_k = 0;         // keep the k most probable tokens (>= 0); 0: all
  double top_p = 1.0;        // keep the smallest nucleus of mass top_p, in (0, 1]; 1: all
  double min_p = 0.0;        // keep tokens of probability >= min_p x the top token's, in [0, 1]; 0: all
  std::optional<uint64_t> seed{};  // draws from this seed and the positions (see the top of this
                                   // file); unset: from the batch's generator

  // Throws std::invalid_argument naming the field, the rule and the value.
  void validate() const {
    if (!(temperature >= 0.0) || !std::isfinite(temperature)) {
      detail::throw_invalid("temperature", "be finite and >= 0 (0: greedy)", temperature);
    }
    if (top_k < 0) detail::throw_invalid("top_k", "be >= 0 (0: no top-k filter)", top_k);
    if (!(top_p > 0.0 && top_p <= 1.0)) detail::throw_invalid("top_p", "be in (0, 1]", top_p);
    if (!(min_p >= 0.0 && min_p <= 1.0)) detail::throw_invalid("min_p", "be in [0, 1]", min_p);
  }
  [[nodiscard]] bool greedy() const noexcept { return temperature == 0.0; }

  friend std::ostream& operator<<(std::ostream& out, const SamplingParams& p) {
    out << "SamplingParams{temperature=" << p.temperature << ", top_k=" << p.top_k << ", top_p=" << p.top_p
               << ", min_p=" << p.min_p;
    if (p.seed) out << ", seed=" << *p.seed;
    return out << "}";
  }
};

// Per-row sampling parameters as tensors on one device (see the top of this file).
class RowProcessor {
 public:
  RowProcessor() = default;  // no rows

  // Row r samples with rows[r]. Requires every row valid (SamplingParams::validate; the message
  // names the row). The parameters are uploaded to `device` once, here.
  RowProcessor(std::span<const SamplingParams> rows, const at::Device& device) : rows_(rows.begin(), rows.end()) {
    for (size_t r = 0; r < rows.size(); ++r) {
      try {
        rows[r].validate();
      } catch (const std::invalid_argument& e) {
        detail::throw_invalid_message("rows[", r, "]: ", e.what());
      }
    }
    upload(device);
  }

  [[nodiscard]] int64_t size() const noexcept { return static_cast<int64_t>(rows_.size()); }
  [[nodiscard]] std::span<const SamplingParams> params() const noexcept { return rows_; }
  // Whether every row is greedy (verification then needs no distributions).
  [[nodiscard]] bool greedy() const noexcept { return sampled_ == 0; }

  // The processor of the rows `rows` (indices into this one's rows), on the same device.
  [[nodiscard]] RowProcessor rows(std::span<const int64_t> rows) const {
    std::vector<SamplingParams> picked;
    picked.reserve(rows.size());
    for (const int64_t r : rows) {
      if (r < 0 || r >= size()) detail::throw_invalid_message("rows: a row must be in [0, ", size(), "), got ", r);
      picked.push_back(rows_[static_cast<size_t>(r)]);
    }
    RowProcessor result;
    result.rows_ = std::move(picked);
    result.upload(device_);
    return result;
  }

  // Requires logits [b, ..., vocab] (floating point) with b == size(). Returns each row's
  // distribution, [b, ..., vocab] in at least float32.
  [[nodiscard]] at::Tensor operator()(const at::Tensor& logits) const {
    detail::check_logits(logits);
    if (logits.dim() < 2 || logits.size(0) != size()) {
      detail::throw_invalid_message("logits must have shape [", size(), ", ..., vocab] (one row per request), got ",
                                    logits.sizes());
    }
    if (greedy()) return GreedyProcessor{}(logits);
    const auto type = at::promote_types(logits.scalar_type(), at::kFloat);
    const double inf = std::numeric_limits<double>::infinity();
    std::vector<int64_t> shape(static_cast<size_t>(logits.dim()), 1);
    shape.front() = size();
    const auto per_row = [&](const at::Tensor& t) { return t.to(logits.device()).view(shape); };
    const at::Tensor scaled = logits.to(type) / per_row(temperature_).to(type);
    const auto [sorted, order] = scaled.sort(-1, /*descending=*/true);
    // top-k: everything below the k-th largest logit (ties with it are kept).
    auto index_shape = sorted.sizes().vec();
    index_shape.back() = 1;
    const at::Tensor kth = sorted.gather(-1, per_row(top_k_index_).clamp_max(logits.size(-1) - 1).expand(index_shape));
    at::Tensor drop = sorted < kth;
    // The nucleus of what top-k kept (rows with top_p 1 keep it whole, whatever the rounding).
    const at::Tensor probs = sorted.masked_fill(drop, -inf).softmax(-1);
    const at::Tensor mass_before = probs.cumsum(-1) - probs;
    drop = drop.logical_or((mass_before >= per_row(top_p_).to(type)).logical_and(per_row(nucleus_)));
    // min-p, as a ratio to the most probable token: log p - log p_max < log min_p.
    drop = drop.logical_or((sorted - sorted.narrow(-1, 0, 1)) < per_row(log_min_p_).to(type));
    const at::Tensor dropped = at::empty_like(drop).scatter_(-1, order, drop);
    at::Tensor result = scaled.masked_fill(dropped, -inf).softmax(-1);
    if (sampled_ < size()) result = at::where(per_row(greedy_), GreedyProcessor{}(logits), result);
    return result;
  }

  // Draws one token per distribution of probs [..., vocab] with uniforms from `gen` (as the
  // single-policy processors do; a one-hot row gives its argmax). Returns int64 [..., 1].
  // Throws std::logic_error where a row has a seed: its draws need their positions (sample_at).
  [[nodiscard]] at::Tensor sample(const at::Tensor& probs, at::Generator& gen) const {
    if (seeded()) {
      throw std::logic_error("RowProcessor::sample: a row with a seed draws at its positions: use sample_at()");
    }
    return detail::sample_categorical(probs, gen);
  }

  // Whether a row has a seed of its own.
  [[nodiscard]] bool seeded() const noexcept { return seeded_ > 0; }

  // Uniforms [b, count] (double, in [0, 1)) for the draws that decide positions positions[r] + j
  // of row r (positions int64 [b], on any device; undefined where no row has a seed): a seeded
  // row's from its seed, the others' from `gen`. On the device of positions, else of `gen`.
  [[nodiscard]] at::Tensor uniforms(at::Generator& gen, const at::Tensor& positions, int64_t count, RandomUse use) const {
    const auto b = size();
    const auto options = at::TensorOptions().dtype(at::kDouble);
    if (!seeded()) return at::rand({b, count}, gen, options.device(gen.device()));
    if (!positions.defined() || positions.dim() != 1 || positions.size(0) != b) {
      detail::throw_invalid_message("positions must be int64 [", b, "] where a row has a seed, got ",
                                    positions.defined() ? positions.sizes().vec() : std::vector<int64_t>{});
    }
    const at::Tensor decided =
        positions.to(at::kLong).view({b, 1}) + at::arange(count, positions.options().dtype(at::kLong));
    const at::Tensor keyed = detail::keyed_uniforms(seed_key_.to(positions.device()), decided, use);
    if (seeded_ == b) return keyed;
    const at::Tensor drawn = at::rand({b, count}, gen, options.device(gen.device())).to(positions.device());
    return at::where(seeded_rows_.to(positions.device()).view({b, 1}), keyed, drawn);
  }

  // One token per row of probs [b, vocab], row r's for position positions[r] (see uniforms()).
  // Returns int64 [b, 1].
  [[nodiscard]] at::Tensor sample_at(const at::Tensor& probs, at::Generator& gen, const at::Tensor& positions,
                                     RandomUse use = RandomUse::sample) const {
    detail::check_logits(probs);
    if (probs.dim() != 2 || probs.size(0) != size()) {
      detail::throw_invalid_message("probs must have shape [", size(), ", vocab], got ", probs.sizes());
    }
    if (!seeded()) return detail::sample_categorical(probs, gen);
    return detail::sample_at_uniform(probs, uniforms(gen, positions, 1, use));
  }

  friend std::ostream& operator<<(std::ostream& out, const RowProcessor& p) {
    out << "RowProcessor{";
    for (size_t r = 0; r < p.rows_.size(); ++r) out << (r > 0 ? ", " : "") << p.rows_[r];
    return out << "}";
  }

 private:
  void upload(const at::Device& device) {
    device_ = device;
    const auto b = static_cast<int64_t>(rows_.size());
    std::vector<double> temperature, top_p, log_min_p;
    std::vector<int64_t> top_k_index;
    std::vector<uint8_t> greedy, nucleus;
    sampled_ = 0;
    seeded_ = 0;
    std::vector<int64_t> keys;
    std::vector<uint8_t> seeded;
    for (const SamplingParams& p : rows_) {
      keys.push_back(p.seed ? static_cast<int64_t>(detail::seed_key(*p.seed)) : 0);
      seeded.push_back(p.seed ? 1 : 0);
      seeded_ += p.seed ? 1 : 0;
      temperature.push_back(p.greedy() ? 1.0 : p.temperature);
      top_k_index.push_back(p.top_k > 0 ? p.top_k - 1 : std::numeric_limits<int64_t>::max());
      top_p.push_back(p.top_p);
      nucleus.push_back(p.top_p < 1.0 ? 1 : 0);
      log_min_p.push_back(p.min_p > 0.0 ? std::log(p.min_p) : -std::numeric_limits<double>::infinity());
      greedy.push_back(p.greedy() ? 1 : 0);
      sampled_ += p.greedy() ? 0 : 1;
    }
    temperature_ = detail::to_device<double>(temperature, {b}, device);
    top_p_ = detail::to_device<double>(top_p, {b}, device);
    log_min_p_ = detail::to_device<double>(log_min_p, {b}, device);
    top_k_index_ = detail::to_device<int64_t>(top_k_index, {b}, device);
    greedy_ = detail::to_device<uint8_t>(greedy, {b}, device).to(at::kBool);
    nucleus_ = detail::to_device<uint8_t>(nucleus, {b}, device).to(at::kBool);
    seed_key_ = detail::to_device<int64_t>(keys, {b}, device);
    seeded_rows_ = detail::to_device<uint8_t>(seeded, {b}, device).to(at::kBool);
  }

  std::vector<SamplingParams> rows_;
  at::Device device_{at::kCPU};
  int64_t sampled_ = 0;  // rows that are not greedy
  int64_t seeded_ = 0;   // rows with a seed
  at::Tensor temperature_, top_p_, log_min_p_, top_k_index_, greedy_, nucleus_, seed_key_, seeded_rows_;
};

static_assert(LogitsProcessor<RowProcessor>);

}  // namespace specdec
