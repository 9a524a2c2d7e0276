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
// min-p (Nguyen et al., 2024, "Turning Up the Heat: Min-p Sampling") keeps the tokens whose
// probability is at least min_p times the most probable token's; it is applied to the
// temperature-scaled logits as a ratio, so it does not depend on the other filters.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <ostream>
#include <span>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/detail/check.hpp"
#include "specdec/detail/torch_compat.hpp"
#include "specdec/device.hpp"
#include "specdec/logits_processor.hpp"

namespace specdec {

// One request's sampling parameters. The neutral value of each filter keeps every token.
struct SamplingParams {
  double temperature = 0.0;  // 0: greedy (argmax); otherwise finite and > 0 (1: the model's own)
  int64_t top_k = 0;         // keep the k most probable tokens (>= 0); 0: all
  double top_p = 1.0;        // keep the smallest nucleus of mass top_p, in (0, 1]; 1: all
  double min_p = 0.0;        // keep tokens of probability >= min_p x the top token's, in [0, 1]; 0: all

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
    return out << "SamplingParams{temperature=" << p.temperature << ", top_k=" << p.top_k << ", top_p=" << p.top_p
               << ", min_p=" << p.min_p << "}";
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
  [[nodiscard]] at::Tensor sample(const at::Tensor& probs, at::Generator& gen) const {
    return detail::sample_categorical(probs, gen);
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
    for (const SamplingParams& p : rows_) {
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
  }

  std::vector<SamplingParams> rows_;
  at::Device device_{at::kCPU};
  int64_t sampled_ = 0;  // rows that are not greedy
  at::Tensor temperature_, top_p_, log_min_p_, top_k_index_, greedy_, nucleus_;
};

static_assert(LogitsProcessor<RowProcessor>);

}  // namespace specdec
