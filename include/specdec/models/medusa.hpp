// Medusa heads: K small heads on the target's last hidden state, head i proposing the token i + 2
// places after it (the target's own classifier proposes the next one). Each head is
// `num_layers` residual blocks h <- h + SiLU(W h + b) and a classifier [vocab, hidden] without
// bias, as the Medusa paper (Cai et al., 2024) and its published checkpoints define them.
//
// The network only: drafting with it (MedusaDraftSource's chains, MedusaTreeSource's static trees)
// is drafting/medusa.hpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "specdec/detail/check.hpp"
#include "specdec/detail/torch_compat.hpp"

namespace specdec::models {

struct MedusaConfig {
  int64_t hidden_size = 0;  // the target's hidden size
  int64_t vocab_size = 0;   // the target's vocabulary
  int64_t num_heads = 0;    // K: drafts per step at most
  int64_t num_layers = 1;   // residual blocks per head

  // Throws std::invalid_argument naming the first field out of range.
  void validate() const {
    const auto positive = [](const char* field, int64_t value, int64_t low) {
      if (value < low) detail::throw_invalid_message("medusa config: ", field, " = ", value, " must be >= ", low);
    };
    positive("hidden_size", hidden_size, 1);
    positive("vocab_size", vocab_size, 1);
    positive("medusa_num_heads", num_heads, 1);
    positive("medusa_num_layers", num_layers, 0);
  }
};

// One head's weights: its residual blocks' [hidden, hidden] weights and [hidden] biases, then its
// classifier [vocab, hidden].
struct MedusaHeadWeights {
  std::vector<at::Tensor> block_weights{};
  std::vector<at::Tensor> block_biases{};
  at::Tensor classifier{};
};

class MedusaHeads {
 public:
  // Throws std::invalid_argument naming the head, the tensor and its shape when a weight does not
  // fit `config`, or when the heads' count, dtypes or devices differ.
  MedusaHeads(MedusaConfig config, std::vector<MedusaHeadWeights> heads)
      : config_(config), heads_(std::move(heads)) {
    config_.validate();
    if (static_cast<int64_t>(heads_.size()) != config_.num_heads) {
      detail::throw_invalid_message("medusa: ", heads_.size(), " heads given, medusa_num_heads = ", config_.num_heads);
    }
    const at::Tensor& first = heads_.front().classifier;
    for (size_t i = 0; i < heads_.size(); ++i) {
      const MedusaHeadWeights& head = heads_[i];
      const std::string name = "medusa_head." + std::to_string(i);
      if (static_cast<int64_t>(head.block_weights.size()) != config_.num_layers ||
          head.block_biases.size() != head.block_weights.size()) {
        detail::throw_invalid_message(name, ": ", head.block_weights.size(), " blocks with ", head.block_biases.size(),
                                      " biases, medusa_num_layers = ", config_.num_layers);
      }
      const auto expect = [&](const at::Tensor& t, const std::string& what, std::vector<int64_t> shape) {
        if (!t.defined() || t.sizes() != at::IntArrayRef(shape) || !t.is_floating_point() ||
            (first.defined() && (t.scalar_type() != first.scalar_type() || t.device() != first.device()))) {
          detail::throw_invalid_message(name, ".", what, " must be a ", shape, " tensor of the heads' dtype and device, got ",
                                        t.defined() ? t.sizes() : at::IntArrayRef{});
        }
      };
      for (size_t b = 0; b < head.block_weights.size(); ++b) {
        expect(head.block_weights[b], std::to_string(b) + ".linear.weight", {config_.hidden_size, config_.hidden_size});
        expect(head.block_biases[b], std::to_string(b) + ".linear.bias", {config_.hidden_size});
      }
      expect(head.classifier, std::to_string(config_.num_layers) + ".weight", {config_.vocab_size, config_.hidden_size});
    }
  }

  // Random heads (tests and benchmarks): blocks N(0, 1/hidden) so that they change the state,
  // classifiers N(0, 16/hidden) so that logits are spread.
  static std::vector<MedusaHeadWeights> random(const MedusaConfig& config, uint64_t seed,
                                               const at::TensorOptions& options = at::kFloat) {
    config.validate();
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    const auto normal = [&](std::vector<int64_t> shape, double std) {
      return at::normal(0.0, std, shape, gen, at::TensorOptions(at::kFloat)).to(options);
    };
    const double h = static_cast<double>(config.hidden_size);
    std::vector<MedusaHeadWeights> heads(static_cast<size_t>(config.num_heads));
    for (MedusaHeadWeights& head : heads) {
      for (int64_t b = 0; b < config.num_layers; ++b) {
        head.block_weights.push_back(normal({config.hidden_size, config.hidden_size}, 1.0 / std::sqrt(h)));
        head.block_biases.push_back(normal({config.hidden_size}, 0.1));
      }
      head.classifier = normal({config.vocab_size, config.hidden_size}, 4.0 / std::sqrt(h));
    }
    return heads;
  }

  [[nodiscard]] const MedusaConfig& config() const noexcept { return config_; }
  [[nodiscard]] const std::vector<MedusaHeadWeights>& heads() const noexcept { return heads_; }
  [[nodiscard]] at::Device device() const { return heads_.front().classifier.device(); }

  // The first `count` heads' logits [count, vocab] at one hidden state [hidden] (any float dtype,
  // on the heads' device).
  [[nodiscard]] at::Tensor logits(const at::Tensor& hidden, int64_t count) const {
    return logits_rows(hidden.view({1, config_.hidden_size}), count).select(0, 0);
  }

  // logits() of a batch of hidden states [B, hidden] in one pass per head: [B, count, vocab].
  [[nodiscard]] at::Tensor logits_rows(const at::Tensor& hidden, int64_t count) const {
    if (count < 0 || count > config_.num_heads) {
      detail::throw_invalid_message("medusa: count = ", count, " must be in [0, ", config_.num_heads, "]");
    }
    if (hidden.dim() != 2 || hidden.size(1) != config_.hidden_size) {
      detail::throw_invalid_message("medusa: hidden must be [B, ", config_.hidden_size, "], got ",
                                    hidden.sizes());
    }
    const at::Tensor x = hidden.to(heads_.front().classifier.scalar_type());
    std::vector<at::Tensor> rows;
    for (int64_t i = 0; i < count; ++i) {
      const MedusaHeadWeights& head = heads_[static_cast<size_t>(i)];
      at::Tensor h = x;
      for (size_t b = 0; b < head.block_weights.size(); ++b) {
        h = h + at::silu(at::linear(h, head.block_weights[b], head.block_biases[b]));
      }
      rows.push_back(at::linear(h, head.classifier));
    }
    return count == 0 ? at::empty({x.size(0), 0, config_.vocab_size}, x.options())
                      : at::stack(rows, 1);
  }

 private:
  MedusaConfig config_;
  std::vector<MedusaHeadWeights> heads_;
};

}  // namespace specdec::models
