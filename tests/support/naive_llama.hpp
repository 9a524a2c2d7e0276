// An independent, deliberately plain Llama forward (loops over doubles, one token at a time, as
// llama2.c's run.c computes it) to check the reference model against.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "specdec/models/llama.hpp"

namespace specdec::test {

class NaiveLlama {
 public:
  NaiveLlama(const models::LlamaConfig& config, const models::LlamaWeights& w) : c_(config) {
    const auto flat = [](const at::Tensor& t) {
      const at::Tensor d = t.to(at::kDouble).contiguous();
      return std::vector<double>(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
    };
    embedding_ = flat(w.token_embedding);
    output_ = flat(w.output);
    norm_ = flat(w.norm);
    for (const auto& l : w.layers) {
      layers_.push_back({flat(l.attention_norm), flat(l.wq), flat(l.wk), flat(l.wv), flat(l.wo),
                         flat(l.ffn_norm), flat(l.w1), flat(l.w2), flat(l.w3)});
    }
    keys_.assign(static_cast<size_t>(c_.n_layers), {});
    values_.assign(static_cast<size_t>(c_.n_layers), {});
  }

  // Logits after feeding `token` at the next position.
  std::vector<double> step(int64_t token) {
    const auto D = static_cast<size_t>(c_.dim), H = static_cast<size_t>(c_.hidden_dim);
    const auto heads = static_cast<size_t>(c_.n_heads), hd = static_cast<size_t>(c_.head_dim());
    const auto kv_dim = static_cast<size_t>(c_.kv_dim()), group = heads / static_cast<size_t>(c_.n_kv_heads);
    const size_t pos = position_++;
    std::vector<double> x(embedding_.begin() + static_cast<long>(token * c_.dim),
                          embedding_.begin() + static_cast<long>((token + 1) * c_.dim));
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& w = layers_[l];
      std::vector<double> h = rms_norm(x, w.attention_norm);
      std::vector<double> q = matvec(w.wq, h, D, D), k = matvec(w.wk, h, kv_dim, D), v = matvec(w.wv, h, kv_dim, D);
      for (size_t i = 0; i < D; i += 2) {
        const double freq = 1.0 / std::pow(c_.rope_theta, static_cast<double>(i % hd) / static_cast<double>(hd));
        const double angle = static_cast<double>(pos) * freq, cs = std::cos(angle), sn = std::sin(angle);
        for (std::vector<double>* vec : {&q, &k}) {
          if (i >= vec->size()) continue;
          const double a = (*vec)[i], b = (*vec)[i + 1];
          (*vec)[i] = a * cs - b * sn;
          (*vec)[i + 1] = a * sn + b * cs;
        }
      }
      keys_[l].push_back(k);
      values_[l].push_back(v);
      std::vector<double> attended(D, 0.0);
      for (size_t head = 0; head < heads; ++head) {
        const size_t kv = head / group;
        std::vector<double> scores(pos + 1);
        for (size_t t = 0; t <= pos; ++t) {
          double s = 0;
          for (size_t i = 0; i < hd; ++i) s += q[head * hd + i] * keys_[l][t][kv * hd + i];
          scores[t] = s / std::sqrt(static_cast<double>(hd));
        }
        const double top = *std::max_element(scores.begin(), scores.end());
        double total = 0;
        for (double& s : scores) total += (s = std::exp(s - top));
        for (size_t t = 0; t <= pos; ++t) {
          for (size_t i = 0; i < hd; ++i) attended[head * hd + i] += scores[t] / total * values_[l][t][kv * hd + i];
        }
      }
      const std::vector<double> o = matvec(w.wo, attended, D, D);
      for (size_t i = 0; i < D; ++i) x[i] += o[i];
      const std::vector<double> f = rms_norm(x, w.ffn_norm);
      std::vector<double> gate = matvec(w.w1, f, H, D);
      const std::vector<double> up = matvec(w.w3, f, H, D);
      for (size_t i = 0; i < H; ++i) gate[i] = gate[i] / (1.0 + std::exp(-gate[i])) * up[i];
      const std::vector<double> down = matvec(w.w2, gate, D, H);
      for (size_t i = 0; i < D; ++i) x[i] += down[i];
    }
    return matvec(output_, rms_norm(x, norm_), static_cast<size_t>(c_.vocab_size), D);
  }

 private:
  struct Layer {
    std::vector<double> attention_norm, wq, wk, wv, wo, ffn_norm, w1, w2, w3;
  };

  std::vector<double> rms_norm(const std::vector<double>& x, const std::vector<double>& weight) const {
    double ss = 0;
    for (double v : x) ss += v * v;
    const double scale = 1.0 / std::sqrt(ss / static_cast<double>(x.size()) + c_.norm_eps);
    std::vector<double> out(x.size());
    for (size_t i = 0; i < x.size(); ++i) out[i] = x[i] * scale * weight[i];
    return out;
  }

  static std::vector<double> matvec(const std::vector<double>& m, const std::vector<double>& x, size_t rows, size_t columns) {
    std::vector<double> out(rows, 0.0);
    for (size_t r = 0; r < rows; ++r) {
      for (size_t col = 0; col < columns; ++col) out[r] += m[r * columns + col] * x[col];
    }
    return out;
  }

  models::LlamaConfig c_;
  std::vector<double> embedding_, output_, norm_;
  std::vector<Layer> layers_;
  std::vector<std::vector<std::vector<double>>> keys_, values_;
  size_t position_ = 0;
};

// Greedy continuation of `prompt` by the naive model.
inline std::vector<int64_t> naive_greedy(NaiveLlama model, const std::vector<int64_t>& prompt, size_t count) {
  std::vector<double> logits;
  for (const int64_t t : prompt) logits = model.step(t);
  std::vector<int64_t> out;
  while (out.size() < count) {
    out.push_back(std::max_element(logits.begin(), logits.end()) - logits.begin());
    logits = model.step(out.back());
  }
  return out;
}

}  // namespace specdec::test
