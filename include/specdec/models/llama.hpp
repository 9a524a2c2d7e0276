// A Llama-family decoder that models LanguageModel: token embedding, RMSNorm, rotary position
// embeddings on consecutive pairs (2i, 2i+1) as in llama2.c, grouped-query attention, a SwiGLU
// feed-forward block and an optional classifier tied to the embedding.
//
// The weight layout is llama2.c's (and PyTorch's nn.Linear): every projection is [out, in]. A
// checkpoint whose rotary embedding rotates the two halves of each head (Hugging Face) loads by
// permuting the rows of wq and wk, once, at load time.
//
// The forward attends over the cache and the new tokens with a causal mask; forward_with_mask()
// takes explicit positions and a mask over the new tokens (tree attention).
//
// On the CPU in fp32 the forward runs its norms, rotary embedding, attention and SwiGLU gate as
// fused loops (models/detail/llama_cpu.hpp) around oneDNN or BLAS products, over activations in one
// scratch buffer per thread: at decoding sizes a forward of ATen operations spends most of its
// time dispatching them and allocating. Every other device and dtype, rows of
// different lengths and sliding windows take the ATen forward; use_cpu_kernels(false) forces it.
//
// Tensor parallelism (parallel.hpp): a model constructed with a Collectives holds one rank's shard
// (llama_shard()), split as Megatron-LM splits it: q, k, v, gate and up by output rows (whole
// heads, a slice of the feed-forward width), o and down by input columns, each followed by one
// all-reduce of its partial sum; the embedding, the norms and the classifier are replicated, so
// every rank computes the whole logits. Its caches hold its own key/value heads only.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numbers>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/detail/check.hpp"
#include "specdec/detail/torch_compat.hpp"
#include "specdec/kv_cache.hpp"
#include "specdec/models/detail/cpu_linear.hpp"
#include "specdec/models/detail/llama_cpu.hpp"
#include "specdec/models/llama_config.hpp"
#include "specdec/parallel.hpp"
#include "specdec/tree.hpp"

namespace specdec::models {

// One decoder layer's weights, [out, in] for every projection.
struct LlamaLayerWeights {
  at::Tensor attention_norm{};  // [dim]
  at::Tensor wq{};              // [dim, dim]
  at::Tensor wk{};              // [kv_dim, dim]
  at::Tensor wv{};              // [kv_dim, dim]
  at::Tensor wo{};              // [dim, dim]
  at::Tensor ffn_norm{};        // [dim]
  at::Tensor w1{};              // [hidden_dim, dim]  gate
  at::Tensor w2{};              // [dim, hidden_dim]  down
  at::Tensor w3{};              // [hidden_dim, dim]  up
  // Biases, undefined where the family has none: q, k, v all three with config.qkv_bias (Qwen2),
  // o with config.o_bias.
  at::Tensor bq{};              // [dim]
  at::Tensor bk{};              // [kv_dim]
  at::Tensor bv{};              // [kv_dim]
  at::Tensor bo{};              // [dim]
};

struct LlamaWeights {
  at::Tensor token_embedding{};  // [vocab, dim]
  std::vector<LlamaLayerWeights> layers{};
  at::Tensor norm{};    // [dim]
  at::Tensor output{};  // [vocab, dim]; the token embedding itself when the classifier is tied

  // Random weights for `config`, scaled so that logits are well spread (for tests and benchmarks).
  static LlamaWeights random(const LlamaConfig& config, uint64_t seed,
                             const at::TensorOptions& options = at::kFloat,
                             bool tied_classifier = false) {
    config.validate();
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    const auto normal = [&](std::vector<int64_t> shape, double std) {
      return at::normal(0.0, std, shape, gen, at::TensorOptions(at::kFloat)).to(options);
    };
    const auto ones = [&](int64_t n) { return at::ones({n}, options); };
    const double d = static_cast<double>(config.dim);
    const double h = static_cast<double>(config.hidden_dim);
    // Each layer's residual update is small beside the embedding, as in trained models where
    // early layers already predict much of what the last layer does.
    const double residual = 0.2;
    LlamaWeights w;
    w.token_embedding = normal({config.vocab_size, config.dim}, 1.0);
    for (int64_t i = 0; i < config.n_layers; ++i) {
      w.layers.push_back(LlamaLayerWeights{
          ones(config.dim), normal({config.dim, config.dim}, 1.0 / std::sqrt(d)),
          normal({config.kv_dim(), config.dim}, 1.0 / std::sqrt(d)),
          normal({config.kv_dim(), config.dim}, 1.0 / std::sqrt(d)),
          normal({config.dim, config.dim}, residual / std::sqrt(d)), ones(config.dim),
          normal({config.hidden_dim, config.dim}, 1.0 / std::sqrt(d)),
          normal({config.dim, config.hidden_dim}, residual / std::sqrt(h)),
          normal({config.hidden_dim, config.dim}, 1.0 / std::sqrt(d))});
      LlamaLayerWeights& layer = w.layers.back();
      if (config.qkv_bias) {
        layer.bq = normal({config.dim}, 0.5);
        layer.bk = normal({config.kv_dim()}, 0.5);
        layer.bv = normal({config.kv_dim()}, 0.5);
      }
      if (config.o_bias) layer.bo = normal({config.dim}, 0.1);
    }
    w.norm = ones(config.dim);
    // Logits with a standard deviation of about 4: peaked but not one-hot distributions.
    w.output = tied_classifier ? w.token_embedding
                               : normal({config.vocab_size, config.dim}, 4.0 / std::sqrt(d));
    return w;
  }
};

// The reference Llama decoder. Cache is DynamicKVCache or StaticKVCache.
template <class Cache = DynamicKVCache>
class LlamaModel {
 public:
  using cache_type = Cache;

  // Requires: a valid config; weights of the shapes LlamaWeights documents, all of one floating
  //   dtype and on one device. Throws std::invalid_argument naming the first bad tensor.
  explicit LlamaModel(std::pair<LlamaConfig, LlamaWeights> config_and_weights)
      : LlamaModel(config_and_weights.first, std::move(config_and_weights.second)) {}

  LlamaModel(const LlamaConfig& config, LlamaWeights weights) : LlamaModel(config, std::move(weights), nullptr) {}

  // One rank's shard of a tensor-parallel model over `group` (see the header comment): `shard`
  // is what llama_shard(config, weights, group->rank(), group->world_size()) makes, `config` the
  // whole model's. Every rank of the group must construct its shard at the same time: the
  // construction checks, with two collectives, that every rank holds the same model (the config
  // and a checksum of the replicated weights) and throws std::invalid_argument on every rank
  // where one does not. Throws std::invalid_argument where the config does not divide by the
  // world size (check_tensor_parallel) or a tensor is not the shard's shape. A null group is
  // the whole model in one process.
  LlamaModel(const LlamaConfig& config, LlamaWeights shard, std::shared_ptr<Collectives> group)
      : config_(config), weights_(std::move(shard)), group_(std::move(group)) {
    config_.validate();
    const int64_t ranks = group_ ? group_->world_size() : 1;
    check_tensor_parallel(config_, ranks);
    heads_ = config_.n_heads / ranks;
    kv_heads_ = config_.n_kv_heads / ranks;
    hidden_ = config_.hidden_dim / ranks;
    check_weights();
    if (group_ && ranks > 1) {
      check_same_model();
      // o's bias is added once, to the sum: rank 0 holds it.
      if (group_->rank() != 0) {
        for (LlamaLayerWeights& w : weights_.layers) w.bo = at::Tensor();
      }
    }
    const auto options = weights_.token_embedding.options();
    const at::Tensor inv_freq = rope_inverse_frequencies(config_);
    const at::Tensor angles =
        at::outer(at::arange(config_.max_seq_len, at::kDouble), inv_freq);  // [max_seq, hd/2]
    // One table of rotations: e^(i angle) where the dtype has a complex type, cos and sin otherwise.
    if (complex_rope()) {
      rope_ = at::polar(at::ones_like(angles), angles).to(device()).to(at::toComplexType(dtype()));
    }
    if (!complex_rope()) {
      rope_cos_ = angles.cos().to(options).contiguous();
      rope_sin_ = angles.sin().to(options).contiguous();
    }
    if (device().is_cpu()) {  // the CPU loops read fp32 tables whatever the weights' dtype
      loop_cos_ = angles.cos().to(at::kFloat).contiguous();
      loop_sin_ = angles.sin().to(at::kFloat).contiguous();
    }
    // The causal bias of every short forward, built once (longer ones, prefills, build their own).
    for (int64_t count = 0; count <= kCachedMaskTokens; ++count) {
      causal_bias_.push_back(count < 2 ? at::Tensor() : grouped_causal_bias(count));
    }
    // The projections that read the same input, concatenated once: q|k|v and gate|up, so a layer
    // makes two products where it made five. The layer's own tensors become views of the fused
    // ones, so the weights are held once. On the CPU every matrix is also laid out once as
    // [in, out] in memory (still [out, in] as a tensor, a transposed view): BLAS then multiplies
    // x by it without repacking the weight in every call, 2-4x faster for a few rows here.
    const int64_t dim = heads_ * config_.head_dim(), kv_dim = kv_heads_ * config_.head_dim(), hidden = hidden_;
    const auto laid_out = [this](const at::Tensor& weight) {
      return device().is_cpu() ? weight.t().contiguous().t() : weight.contiguous();
    };
    for (LlamaLayerWeights& w : weights_.layers) {
      FusedLayer fused{laid_out(at::cat({w.wq, w.wk, w.wv}, 0)), laid_out(at::cat({w.w1, w.w3}, 0)),
                       config_.qkv_bias ? at::cat({w.bq, w.bk, w.bv}, 0) : at::Tensor()};
      w.wo = laid_out(w.wo);
      w.w2 = laid_out(w.w2);
      w.wq = fused.wqkv.narrow(0, 0, dim);
      w.wk = fused.wqkv.narrow(0, dim, kv_dim);
      w.wv = fused.wqkv.narrow(0, dim + kv_dim, kv_dim);
      if (config_.qkv_bias) {
        w.bq = fused.bqkv.narrow(0, 0, dim);
        w.bk = fused.bqkv.narrow(0, dim, kv_dim);
        w.bv = fused.bqkv.narrow(0, dim + kv_dim, kv_dim);
      }
      w.w1 = fused.w13.narrow(0, 0, hidden);
      w.w3 = fused.w13.narrow(0, hidden, hidden);
      w.attention_norm = w.attention_norm.contiguous();
      w.ffn_norm = w.ffn_norm.contiguous();
      fused_.push_back(std::move(fused));
    }
    weights_.norm = weights_.norm.contiguous();
    // The layers' q, k, v, gate and up are views of the fused products: they require gradients
    // where those do.
    const auto trains = [](const at::Tensor& t) { return t.defined() && t.requires_grad(); };
    trainable_ = trains(weights_.token_embedding) || trains(weights_.output) || trains(weights_.norm) ||
                 std::any_of(weights_.layers.begin(), weights_.layers.end(), [&](const LlamaLayerWeights& w) {
                   return std::ranges::any_of(std::array{w.attention_norm, w.wq, w.wk, w.wv, w.wo, w.ffn_norm, w.w1, w.w2,
                                                         w.w3, w.bq, w.bk, w.bv, w.bo},
                                              trains);
                 });
    // A classifier tied to the embedding keeps the embedding's layout (a second copy would cost
    // vocab x dim); an untied one is laid out like the layers.
    if (weights_.output.data_ptr() != weights_.token_embedding.data_ptr()) weights_.output = laid_out(weights_.output);
    if (kernels_apply()) {  // the CPU loops' products, each ready for oneDNN where it is built in
      for (size_t layer = 0; layer < fused_.size(); ++layer) {
        FusedLayer& fused = fused_[layer];
        const LlamaLayerWeights& w = weights_.layers[layer];
        fused.qkv = detail::CpuLinear(fused.wqkv, fused.bqkv);
        fused.o = detail::CpuLinear(w.wo, w.bo);
        fused.gate_up = detail::CpuLinear(fused.w13, at::Tensor());
        fused.down = detail::CpuLinear(w.w2, at::Tensor());
        onednn_built_ = onednn_built_ && fused.qkv.has_onednn() && fused.o.has_onednn() &&
                        fused.gate_up.has_onednn() && fused.down.has_onednn();
      }
      classifier_ = detail::CpuLinear(weights_.output, at::Tensor());
      onednn_built_ = onednn_built_ && classifier_.has_onednn();
      build_loop_parts();
    } else {
      onednn_built_ = false;
    }
  }

  // Packs the weight products of every layer (q|k|v, o, gate|up, down) and the classifier in
  // panels for the CPU forward's packed route (models/detail/packed_product.hpp), in `format`:
  //  - f32: the weights as they are (bf16 ones widened);
  //  - bf16: rounded to bfloat16 (half the bytes of fp32);
  //  - i8: int8 with one fp32 scale per output (weight-only, symmetric: scale = max |w| / 127
  //    over the output's weights, each weight rounded to the nearest step; a quarter of fp32).
  // Each forward then reads every weight once, in one sequential stream per thread, whatever the
  // number of new tokens: what a target larger than the CPU's caches needs (docs/performance.md).
  // The residual stream, norms and attention stay fp32 whatever the format; a bf16 product rounds
  // its input activations to bf16, an int8 product quantizes them to int16 per chunk of 128
  // inputs (packed_product.hpp says how). The layers' float matrices are released:
  // weights().layers then holds the norms and biases only; the embedding and the float
  // classifier stay (heads share them), though forwards multiply by the packed classifier.
  // Forwards that the CPU loops do not run (sliding windows that hide keys,
  // use_cpu_kernels(false)) unpack each product's weights through ATen, slowly. Packing twice in
  // the same format does nothing.
  // Requires: a CPU model in fp32 or bf16 whose weights do not require gradients, not packed in
  //   another format.
  // Throws: std::invalid_argument naming the model's device or dtype where it is not such a
  //   model, the formats where it is packed already, or the tensor (e.g. "layers.3.w13") whose
  //   values cannot be quantized (not finite).
  void pack_weights(detail::WeightFormat format) {
    if (packed_) {
      if (format == format_) return;
      detail::throw_invalid_message("pack_weights: the model's weights are packed as ", detail::to_string(format_),
                                    " already, not ", detail::to_string(format));
    }
    if (!device().is_cpu() || (dtype() != at::kFloat && dtype() != at::kBFloat16)) {
      detail::throw_invalid_message("pack_weights: packed weights run on the CPU in float32 or bfloat16 models, got ",
                                    dtype(), " on ", device());
    }
    if (trainable_) detail::throw_invalid_message("pack_weights: the model's weights require gradients (training)");
    // Every weight checked first (a bad tensor leaves the model as it was), then each layer packed
    // and its float matrices released before the next, so that memory holds one extra layer at
    // most rather than a second model.
    if (format == detail::WeightFormat::i8) {
      const auto check = [](const at::Tensor& t, const std::string& name) {
        if (!at::isfinite(t).all().template item<bool>()) {
          detail::throw_invalid_message(name, ": int8 weights need finite values; the matrix holds NaN or infinity");
        }
      };
      for (size_t layer = 0; layer < fused_.size(); ++layer) {
        const std::string prefix = "layers." + std::to_string(layer) + ".";
        check(fused_[layer].wqkv, prefix + "wqkv");
        check(weights_.layers[layer].wo, prefix + "wo");
        check(fused_[layer].w13, prefix + "w13");
        check(weights_.layers[layer].w2, prefix + "w2");
      }
      check(weights_.output, "output");
    }
    for (size_t layer = 0; layer < fused_.size(); ++layer) {
      FusedLayer& fused = fused_[layer];
      LlamaLayerWeights& w = weights_.layers[layer];
      const std::string prefix = "layers." + std::to_string(layer) + ".";
      fused.qkv = detail::CpuLinear::packed(fused.wqkv, fused.bqkv, format, prefix + "wqkv");
      fused.o = detail::CpuLinear::packed(w.wo, w.bo, format, prefix + "wo");
      fused.gate_up = detail::CpuLinear::packed(fused.w13, at::Tensor(), format, prefix + "w13");
      fused.down = detail::CpuLinear::packed(w.w2, at::Tensor(), format, prefix + "w2");
      fused.wqkv = fused.w13 = at::Tensor();
      w.wq = w.wk = w.wv = w.wo = w.w1 = w.w2 = w.w3 = at::Tensor();
    }
    classifier_ = detail::CpuLinear::packed(weights_.output, at::Tensor(), format, "output");
    packed_ = true;
    format_ = format;
    onednn_built_ = false;
    build_loop_parts();
  }

  // pack_weights(detail::WeightFormat::i8).
  void quantize_int8() { pack_weights(detail::WeightFormat::i8); }

  // Whether the weight products are packed (pack_weights()), and in which format (f32 where not).
  [[nodiscard]] bool packed() const noexcept { return packed_; }
  [[nodiscard]] detail::WeightFormat weight_format() const noexcept { return format_; }

  // The rotary inverse frequencies theta^(-2i / head_dim), i < head_dim / 2 (float64), scaled
  // as config.rope_scaling says. linear divides every frequency by the factor. llama3 (Llama
  // 3.1/3.2) divides those whose wavelength 2 pi / f exceeds original / low_freq_factor, keeps
  // those below original / high_freq_factor, and in between blends the two with weight
  // s = (original / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor):
  // (1 - s) f / factor + s f.
  static at::Tensor rope_inverse_frequencies(const LlamaConfig& config) {
    const double head_dim = static_cast<double>(config.head_dim());
    const at::Tensor f = at::pow(config.rope_theta, -at::arange(0, config.head_dim(), 2, at::kDouble) / head_dim);
    const RopeScaling& r = config.rope_scaling;
    switch (r.type) {
      case RopeScaling::Type::none: return f;
      case RopeScaling::Type::linear: return f / r.factor;
      case RopeScaling::Type::llama3: {
        const double original = static_cast<double>(r.original_max_position_embeddings);
        const at::Tensor wavelength = 2 * std::numbers::pi / f;
        const at::Tensor s = (original / wavelength - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
        const at::Tensor blended = (1 - s) * f / r.factor + s * f;
        return at::where(wavelength > original / r.low_freq_factor, f / r.factor,
                         at::where(wavelength < original / r.high_freq_factor, f, blended));
      }
    }
    return f;
  }

  [[nodiscard]] const LlamaConfig& config() const noexcept { return config_; }
  [[nodiscard]] const LlamaWeights& weights() const noexcept { return weights_; }
  [[nodiscard]] int64_t vocab_size() const noexcept { return config_.vocab_size; }
  [[nodiscard]] int64_t max_sequence_length() const noexcept { return config_.max_seq_len; }
  [[nodiscard]] at::Device device() const { return weights_.token_embedding.device(); }
  [[nodiscard]] at::ScalarType dtype() const { return weights_.token_embedding.scalar_type(); }
  // The tensor-parallel group (null for a model in one process), and this shard's query heads,
  // key/value heads and feed-forward width (the whole model's without a group).
  [[nodiscard]] const std::shared_ptr<Collectives>& group() const noexcept { return group_; }
  [[nodiscard]] int64_t local_heads() const noexcept { return heads_; }
  [[nodiscard]] int64_t local_kv_heads() const noexcept { return kv_heads_; }
  [[nodiscard]] int64_t local_hidden_dim() const noexcept { return hidden_; }

  // Whether a forward of `count` new tokens attends through the loops of detail::attend rather
  // than batched products (detail::attend_batched): up to 8 tokens, and more for heads so small
  // that a batched product's inner dimension (the head size) is too short for BLAS, while count *
  // head_dim <= 512. Measured on a 2-core AMD EPYC (Zen 1), one thread, the loops' time over the
  // batched products': head size 8 (4 of 8 heads' keys, 100 cached positions) 0.23 at 8 tokens,
  // 0.39 at 16, 0.73 at 64; head size 32, 200 cached, 0.51 at 8, 0.72 at 16, 1.28 at 64; head
  // size 64 (4 of 32 heads' keys, 300 cached) 0.65 at 2 tokens, 0.8 to 1.4 at 8.
  static constexpr int64_t kLoopAttentionTokens = 8;
  static constexpr int64_t kLoopAttentionFloats = 512;
  [[nodiscard]] static constexpr bool loop_attention(int64_t count, int64_t head_dim) {
    return count <= kLoopAttentionTokens || count * head_dim <= kLoopAttentionFloats;
  }

  // Whether forwards on the CPU in fp32 run the fused loops (true by default; false runs the ATen
  // forward, e.g. to compare the two). Has no effect on other devices and dtypes, nor while
  // autograd records a forward of weights that require gradients (training): the loops write
  // through raw pointers, so such forwards always take the ATen forward.
  void use_cpu_kernels(bool enabled) noexcept { cpu_kernels_ = enabled; }
  [[nodiscard]] bool cpu_kernels() const {
    return cpu_kernels_ && kernels_apply() && !(trainable_ && at::GradMode::is_enabled());
  }

  // Whether the CPU loops' weight products may run through oneDNN's matmul (true by default where
  // specdec was built with oneDNN, see models/detail/cpu_linear.hpp; false runs them all as BLAS
  // products). Where they may, each product of up to 16 rows takes the route measured fastest for
  // its shape and row count on this machine, once per process (detail::ProductRoutes), of BLAS,
  // oneDNN and, for weights of at most 1 MiB, a packed copy; longer ones take oneDNN. onednn() is
  // false where oneDNN is not built in or the model is not CPU fp32.
  void use_onednn(bool enabled) noexcept {
    products_ = enabled ? detail::ProductChoice::automatic : detail::ProductChoice::blas;
  }
  [[nodiscard]] bool onednn() const noexcept {
    return onednn_built_ && (products_ == detail::ProductChoice::automatic || products_ == detail::ProductChoice::onednn);
  }

  // Which route the CPU loops' weight products take (models/detail/cpu_linear.hpp): automatic
  // (the default: packed weights take the packed route, others the fastest of BLAS, oneDNN and,
  // for weights of at most 1 MiB, a packed copy, measured for each shape and row count), or blas,
  // onednn or packed where the product has that route.
  // For tests and benchmarks.
  void use_products(detail::ProductChoice choice) noexcept { products_ = choice; }
  [[nodiscard]] detail::ProductChoice products() const noexcept { return products_; }

  // An empty cache for `batch` rows (a StaticKVCache of max_seq_len positions).
  [[nodiscard]] Cache make_cache(int64_t batch) const { return make_cache(batch, config_.max_seq_len); }

  // An empty cache for `batch` rows; `capacity` bounds a StaticKVCache (ignored by a dynamic one).
  [[nodiscard]] Cache make_cache(int64_t batch, int64_t capacity) const {
    if (batch < 1) detail::throw_invalid("batch", "be >= 1", batch);
    if constexpr (std::is_same_v<Cache, StaticKVCache>) {
      return StaticKVCache(StaticKVCacheShape{.num_layers = config_.n_layers,
                                              .batch = batch,
                                              .kv_heads = kv_heads_,
                                              .capacity = capacity,
                                              .head_dim = config_.head_dim()},
                           weights_.token_embedding.options());
    } else {
      return Cache(config_.n_layers);
    }
  }

  // Requires: ids int64 [batch, T] on device(), T >= 1, tokens in [0, vocab);
  //   cache.length() + T <= max_sequence_length().
  // Returns: logits [batch, T, vocab] in the model's dtype; appends T positions to the cache.
  // With a BatchedKVCache whose rows differ in length, row r's tokens sit at positions
  //   cache.row_lengths()[r] + t and attend to that row's positions only.
  at::Tensor forward(const at::Tensor& ids, Cache& cache) {
    check_ids(ids, cache);
    if constexpr (BatchedKVCache<Cache>) {
      if (cache.ragged()) {
        if (cpu_kernels() && !windowed(cache.length() + ids.size(1))) return forward_ragged_cpu(ids, cache);
        return forward_ragged(ids, cache);
      }
    }
    const int64_t past = cache.length();
    const int64_t count = ids.size(1);
    if (cpu_kernels() && !windowed(past + count)) {
      std::vector<int64_t> host(static_cast<size_t>(count));
      for (int64_t t = 0; t < count; ++t) host[static_cast<size_t>(t)] = past + t;
      return run_cpu(ids, cache, host, causal_mask(count));
    }
    const at::Tensor positions =
        at::arange(past, past + count, at::TensorOptions().dtype(at::kLong).device(device()));
    if (windowed(past + count)) {  // some query's window starts after position 0: a bias over every key
      const at::Tensor keys = at::arange(past + count, positions.options()).view({1, past + count});
      return run(ids, cache, positions, window_bias(keys <= positions.view({count, 1}), positions.view({count, 1}), keys));
    }
    return run(ids, cache, positions, causal_mask(count));
  }

  // FeatureTarget (concepts.hpp): forward() that also returns the hidden states `taps` names
  // (tap i < n_layers: the input of layer i; n_layers: the final normalised state), copied out
  // of the forward as it passes them.
  [[nodiscard]] int64_t hidden_size() const noexcept { return config_.dim; }
  [[nodiscard]] int64_t num_hidden_layers() const noexcept { return config_.n_layers; }

  TargetOutput forward_features(const at::Tensor& ids, Cache& cache, std::span<const int64_t> taps) {
    Tapping tapping(*this, taps);
    at::Tensor logits = forward(ids, cache);
    return {std::move(logits), tapping.features()};
  }

  // FeatureTreeTarget: forward_tree() with the features of forward_features().
  TargetOutput forward_tree_features(const at::Tensor& ids, Cache& cache, std::span<const int64_t> parents,
                                     std::span<const int64_t> taps) {
    Tapping tapping(*this, taps);
    at::Tensor logits = forward_tree(ids, cache, parents);
    return {std::move(logits), tapping.features()};
  }

  // forward_with_mask() with the features of forward_features() (a feature drafter's dynamic
  // tree: the target's forward over a tree shaped on the device).
  TargetOutput forward_with_mask_features(const at::Tensor& ids, Cache& cache, const at::Tensor& depth,
                                          const at::Tensor& visible, std::span<const int64_t> taps) {
    Tapping tapping(*this, taps);
    at::Tensor logits = forward_with_mask(ids, cache, depth, visible);
    return {std::move(logits), tapping.features()};
  }

  // Tree attention: like forward(), but new token i sits at position cache.length() + depth[i]
  // and sees every cached position and the new tokens j with visible[i][j] (its ancestors and
  // itself). Requires: depth int64 [T] on device(), visible bool [T, T] on device().
  at::Tensor forward_with_mask(const at::Tensor& ids, Cache& cache, const at::Tensor& depth,
                               const at::Tensor& visible) {
    check_ids(ids, cache);
    const int64_t count = ids.size(1);
    if (!depth.defined() || depth.dim() != 1 || depth.size(0) != count) {
      detail::throw_invalid_message("depth must be int64 [", count, "]");
    }
    if (!visible.defined() || visible.dim() != 2 || visible.size(0) != count ||
        visible.size(1) != count || visible.scalar_type() != at::kBool) {
      detail::throw_invalid_message("visible must be bool [", count, ", ", count, "]");
    }
    if (depth.scalar_type() != at::kLong) {
      detail::throw_invalid_message("depth must be int64, got ", depth.scalar_type());
    }
    const int64_t past = cache.length();
    if (cpu_kernels() && !windowed(past + count)) {
      const at::Tensor host_depth = depth.to(at::kCPU).contiguous();
      std::vector<int64_t> host(host_depth.data_ptr<int64_t>(), host_depth.data_ptr<int64_t>() + count);
      for (int64_t& position : host) {
        if (position < 0 || past + position >= config_.max_seq_len) {
          detail::throw_invalid_message("depth must be in [0, ", config_.max_seq_len - past, "), got ", position);
        }
        position += past;
      }
      const int64_t group = config_.n_heads / config_.n_kv_heads;
      return run_cpu(ids, cache, host, count > 1 ? new_token_bias(visible.to(device())).repeat({group, 1}) : at::Tensor());
    }
    const at::Tensor positions = depth.to(device()) + past;
    if (windowed(past + count)) {
      // Every key column's position: the cached ones in order, then the new tokens' own.
      const at::Tensor keys = at::cat({at::arange(past, positions.options()), positions}).view({1, past + count});
      const at::Tensor seen = at::cat({at::ones({count, past}, visible.options().device(device())), visible.to(device())}, 1);
      return run(ids, cache, positions, window_bias(seen, positions.view({count, 1}), keys));
    }
    const int64_t group = config_.n_heads / config_.n_kv_heads;
    return run(ids, cache, positions, new_token_bias(visible.to(device())).repeat({group, 1}));
  }

  // CachedMaskTreeModel: a round of a draft tree whose earlier rounds stay in the cache. New token
  // i sits at position positions[i] (int64 [T] on device(), below max_seq_len) and sees the
  // cache's entries before its newest W - T, and of the last W key columns (those W - T entries,
  // then the T new tokens) the ones where visible[i][j] (bool [T, W], T <= W <= cache.length() +
  // T). Requires cached_mask_applies(cache.length() + T).
  at::Tensor forward_with_cached_mask(const at::Tensor& ids, Cache& cache, const at::Tensor& positions,
                                      const at::Tensor& visible) {
    check_ids(ids, cache);
    const int64_t count = ids.size(1), past = cache.length();
    if (!positions.defined() || positions.dim() != 1 || positions.size(0) != count ||
        positions.scalar_type() != at::kLong) {
      detail::throw_invalid_message("positions must be int64 [", count, "]");
    }
    if (!visible.defined() || visible.dim() != 2 || visible.size(0) != count || visible.size(1) < count ||
        visible.size(1) > past + count || visible.scalar_type() != at::kBool) {
      detail::throw_invalid_message("visible must be bool [", count, ", W] with ", count, " <= W <= ", past + count,
                                    ", got ", visible.sizes());
    }
    if (!cached_mask_applies(past + count)) {
      detail::throw_invalid_message("forward_with_cached_mask: a sliding window of ", config_.sliding_window,
                                    " needs every key's position (", past + count, " keys)");
    }
    const int64_t group = config_.n_heads / config_.n_kv_heads;
    const at::Tensor bias = new_token_bias(visible.to(device())).repeat({group, 1});
    if (cpu_kernels()) {
      const at::Tensor host_positions = positions.to(at::kCPU).contiguous();
      std::vector<int64_t> host(host_positions.data_ptr<int64_t>(), host_positions.data_ptr<int64_t>() + count);
      for (const int64_t position : host) {
        if (position < 0 || position >= config_.max_seq_len) {
          detail::throw_invalid_message("positions must be in [0, ", config_.max_seq_len, "), got ", position);
        }
      }
      return run_cpu(ids, cache, host, bias);
    }
    return run(ids, cache, positions.to(device()), bias);
  }

  // Whether forward_with_cached_mask() may run with `keys` keys: attention that reads no key's
  // position (no sliding window shorter than them).
  [[nodiscard]] bool cached_mask_applies(int64_t keys) const noexcept { return !windowed(keys); }

  // TreeTarget: the draft tree given by parent indices (see concepts.hpp), through
  // forward_with_mask. Requires: ids [1, T]; parents.size() == T, parents[i] in [-1, i).
  at::Tensor forward_tree(const at::Tensor& ids, Cache& cache, std::span<const int64_t> parents) {
    check_ids(ids, cache);
    const TreeAttention tree = tree_attention(parents, ids.size(1), device());
    return forward_with_mask(ids, cache, tree.depth, tree.visible);
  }

  // A forward of static shape, for CUDA graphs (StaticForwardModel, cuda_graph.hpp): ids [1, T]
  // at the positions `positions` (int64 [T] on device(), consecutive, the first at most the
  // cache's length, the last below its capacity). Writes the tokens' keys and values there,
  // attends over the cache's whole capacity masked to the positions at or before each token's
  // own (and within the sliding window), and leaves cache.length() as it was: the caller commits
  // what it keeps. Makes no host synchronisation and reads nothing from the host but shapes, so
  // the same call replays with other positions and tokens in the same buffers. Always the ATen
  // forward.
  at::Tensor forward_at(const at::Tensor& ids, Cache& cache, const at::Tensor& positions)
    requires std::is_same_v<Cache, StaticKVCache>
  {
    if (!ids.defined() || ids.dim() != 2 || ids.size(0) != 1 || ids.size(1) < 1 || ids.scalar_type() != at::kLong ||
        ids.device() != device()) {
      detail::throw_invalid_message("ids must be int64 [1, T] with T >= 1 on ", device(), ", got ",
                                    ids.defined() ? ids.sizes() : at::IntArrayRef{});
    }
    const int64_t count = ids.size(1);
    if (!positions.defined() || positions.dim() != 1 || positions.size(0) != count ||
        positions.scalar_type() != at::kLong || positions.device() != device()) {
      detail::throw_invalid_message("positions must be int64 [", count, "] on ", device());
    }
    if (cache.capacity() > config_.max_seq_len) {
      detail::throw_invalid_message("forward_at: the cache's capacity ", cache.capacity(), " exceeds max_seq_len ",
                                    config_.max_seq_len);
    }
    const at::Tensor keys = at::arange(cache.capacity(), positions.options()).view({1, cache.capacity()});
    const at::Tensor query = positions.view({count, 1});
    at::Tensor visible = keys <= query;
    if (config_.sliding_window > 0) visible = visible.logical_and(keys > query - config_.sliding_window);
    const int64_t group = config_.n_heads / config_.n_kv_heads;
    const at::Tensor bias = new_token_bias(visible).repeat({group, 1}).view({1, 1, group * count, cache.capacity()});
    return run(ids, cache, positions, bias, positions);
  }

 private:
  // The hidden states a forward_features() call asks for, filled by the forward (run() or
  // run_cpu()) as it passes them: `features` [batch, T, taps * dim], made by the first tap.
  struct Taps {
    std::vector<int64_t> taps;
    at::Tensor features{};

    // Writes the residual stream `x` [batch, T, dim] (or the final normalised state) where tap
    // `index` asks for it.
    void put(int64_t index, const at::Tensor& x) {
      const int64_t dim = x.size(-1);
      for (size_t j = 0; j < taps.size(); ++j) {
        if (taps[j] != index) continue;
        if (!features.defined()) {
          features = at::empty({x.size(0), x.size(1), static_cast<int64_t>(taps.size()) * dim}, x.options());
        }
        features.narrow(-1, static_cast<int64_t>(j) * dim, dim).copy_(x);
      }
    }
    // put() for the CPU loops' fp32 rows [batch * count, dim] of a model in fp32, by host copies:
    // a forward that taps costs no ATen call per tap beyond the first tap's allocation.
    void put_rows(int64_t index, const float* rows, int64_t batch, int64_t count, int64_t dim) {
      const auto width = static_cast<int64_t>(taps.size()) * dim;
      for (size_t j = 0; j < taps.size(); ++j) {
        if (taps[j] != index) continue;
        if (!features.defined()) features = at::empty({batch, count, width}, at::TensorOptions().dtype(at::kFloat));
        float* out = features.data_ptr<float>() + static_cast<int64_t>(j) * dim;
        for (int64_t r = 0; r < batch * count; ++r) {
          std::memcpy(out + r * width, rows + r * dim, static_cast<size_t>(dim) * sizeof(float));
        }
      }
    }
  };

  // Sets the taps of the forward that follows for the scope of a forward_features() call, after
  // checking every index; the model forgets them however the forward ends.
  class Tapping {
   public:
    Tapping(LlamaModel& model, std::span<const int64_t> taps) : model_(model) {
      for (size_t j = 0; j < taps.size(); ++j) {
        if (taps[j] < 0 || taps[j] > model.config_.n_layers) {
          detail::throw_invalid_message("taps[", j, "] = ", taps[j], " is not a hidden state of a model of ",
                                        model.config_.n_layers, " layers: expected [0, ", model.config_.n_layers, "]");
        }
      }
      if (!taps.empty()) {
        taps_.taps.assign(taps.begin(), taps.end());
        model_.taps_ = &taps_;
      }
    }
    Tapping(const Tapping&) = delete;
    Tapping& operator=(const Tapping&) = delete;
    ~Tapping() { model_.taps_ = nullptr; }
    [[nodiscard]] at::Tensor features() const { return taps_.features; }

   private:
    LlamaModel& model_;
    Taps taps_;
  };

  void check_ids(const at::Tensor& ids, const Cache& cache) const {
    if (!ids.defined() || ids.dim() != 2 || ids.size(1) < 1 || ids.scalar_type() != at::kLong) {
      detail::throw_invalid_message("ids must be int64 [batch, T] with T >= 1, got ",
                                    ids.defined() ? ids.sizes() : at::IntArrayRef{});
    }
    if (ids.device() != device()) {
      detail::throw_invalid_message("ids must be on the model's device ", device(), ", got ",
                                    ids.device());
    }
    if (cache.length() + ids.size(1) > config_.max_seq_len) {
      detail::throw_invalid_message("cache length ", cache.length(), " + ", ids.size(1),
                                    " new tokens exceeds max_seq_len ", config_.max_seq_len);
    }
  }

  // Rows of different lengths: positions [B, T] from each row's length, and a bias [B, 1, group * T,
  // length + T] over every key column, hiding from row r's token t the keys past its position
  // (other rows' longer histories and the padding of shorter inputs).
  at::Tensor forward_ragged(const at::Tensor& ids, Cache& cache)
    requires BatchedKVCache<Cache>
  {
    const int64_t batch = ids.size(0);
    const int64_t count = ids.size(1);
    const at::Tensor& lengths = cache.device_row_lengths();
    if (lengths.size(0) != batch) {
      detail::throw_invalid_message("ids have ", batch, " rows, the cache ", lengths.size(0));
    }
    const auto long_options = at::TensorOptions().dtype(at::kLong).device(device());
    const at::Tensor positions = lengths.view({batch, 1}) + at::arange(count, long_options).view({1, count});
    const int64_t keys = cache.length() + count;
    const at::Tensor key_positions = at::arange(keys, long_options).view({1, 1, keys});
    at::Tensor visible = key_positions <= positions.unsqueeze(2);
    if (config_.sliding_window > 0) visible = visible.logical_and(key_positions > positions.unsqueeze(2) - config_.sliding_window);
    const int64_t group = config_.n_heads / config_.n_kv_heads;
    const at::Tensor bias = new_token_bias(visible).repeat({1, group, 1}).unsqueeze(1);
    return run(ids, cache, positions, bias);
  }

  // forward_ragged() through the CPU loops (the packed weights, read once for every row): row b's
  // token t at position lengths[b] + t, seeing that row's keys up to it, from a bias made on the
  // host ([B, group * T, keys], fp32) from the cache's host lengths (no device round trip).
  at::Tensor forward_ragged_cpu(const at::Tensor& ids, Cache& cache)
    requires BatchedKVCache<Cache>
  {
    const int64_t batch = ids.size(0), count = ids.size(1);
    const std::span<const int64_t> lengths = cache.row_lengths();
    if (static_cast<int64_t>(lengths.size()) != batch) {
      detail::throw_invalid_message("ids have ", batch, " rows, the cache ", lengths.size());
    }
    const int64_t keys = cache.length() + count, group = heads_ / kv_heads_;
    at::Tensor bias = at::empty({batch, group * count, keys}, at::TensorOptions().dtype(at::kFloat));
    float* const biases = bias.data_ptr<float>();
    std::vector<int64_t> positions(static_cast<size_t>(batch * count));
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t t = 0; t < count; ++t) {
        const int64_t position = lengths[static_cast<size_t>(b)] + t;
        positions[static_cast<size_t>(b * count + t)] = position;
        for (int64_t g = 0; g < group; ++g) {
          float* const row = biases + ((b * group + g) * count + t) * keys;
          std::fill(row, row + position + 1, 0.0F);
          std::fill(row + position + 1, row + keys, -std::numeric_limits<float>::infinity());
        }
      }
    }
    return run_cpu(ids, cache, positions, bias);
  }

  // Whether a sliding window hides some key of a sequence of `keys` positions.
  [[nodiscard]] bool windowed(int64_t keys) const noexcept {
    return config_.sliding_window > 0 && keys > config_.sliding_window;
  }

  // The bias [1, 1, group * T, keys] of a sliding window: query t (at position query[t], [T, 1])
  // sees key j (at position keys[0][j], [1, keys]) where `seen` [T, keys] allows it and
  // query[t] - sliding_window < keys[0][j].
  at::Tensor window_bias(const at::Tensor& seen, const at::Tensor& query, const at::Tensor& keys) const {
    const at::Tensor visible = seen.logical_and(keys > query - config_.sliding_window);
    const int64_t group = config_.n_heads / config_.n_kv_heads;
    return new_token_bias(visible).repeat({group, 1}).view({1, 1, group * query.size(0), keys.size(1)});
  }

  // An additive bias [T, T] over the new tokens: 0 where visible, -inf elsewhere. Cached positions
  // are always visible, so the bias applies to the last T key columns only and no step allocates
  // anything proportional to the sequence for it.
  at::Tensor new_token_bias(const at::Tensor& visible) const {
    return at::zeros(visible.sizes(), weights_.token_embedding.options())
        .masked_fill(visible.logical_not(), -std::numeric_limits<double>::infinity());
  }

  // Causal: new token i sees every cached position and new tokens 0..i. The grouped causal bias
  // of `count` new tokens (undefined for one), built at construction for short forwards.
  at::Tensor causal_mask(int64_t count) const {
    if (count < 2) return {};
    return count <= kCachedMaskTokens ? causal_bias_[static_cast<size_t>(count)] : grouped_causal_bias(count);
  }

  // The causal bias of `count` new tokens, repeated for the query heads that share a key/value
  // head: [group * count, count].
  at::Tensor grouped_causal_bias(int64_t count) const {
    const at::Tensor lower = at::ones({count, count}, at::TensorOptions().dtype(at::kBool).device(device())).tril();
    return new_token_bias(lower).repeat({config_.n_heads / config_.n_kv_heads, 1});
  }

  // Whether the fused CPU loops can run this model: fp32 weights on the CPU, or packed ones.
  [[nodiscard]] bool kernels_apply() const { return packed_ || (device().is_cpu() && dtype() == at::kFloat); }

  // The loops' fp32 copies of the norms' weights (views where they are fp32 already).
  void build_loop_parts() {
    const auto fp32 = [](const at::Tensor& t) { return t.to(at::kFloat).contiguous(); };
    for (size_t layer = 0; layer < fused_.size(); ++layer) {
      fused_[layer].attention_norm = fp32(weights_.layers[layer].attention_norm);
      fused_[layer].ffn_norm = fp32(weights_.layers[layer].ffn_norm);
    }
    loop_norm_ = fp32(weights_.norm);
  }

  // The forward of the CPU fp32 path: the same computation as run() for rows of one length, new
  // token t of every row at positions[t] (validated by the caller), seeing the cached positions and
  // the new tokens that `grouped_bias` [group * T, W] leaves at 0 over the last W key columns
  // (W = T: the new tokens'; needed for T > 1 or W > T; contiguous, its first T rows are the
  // [T, W] bias). Rows of different lengths (forward_ragged_cpu): positions [B * T] (row b's
  // token t at b * T + t) and grouped_bias [B, group * T, keys], each row's own. New tokens
  // attend through the loops of detail::attend or through batched products, as loop_attention()
  // chooses. The keys and values of a layer reach the cache in one write where the cache takes
  // them stacked (StaticKVCache::update_stacked).
  at::Tensor run_cpu(const at::Tensor& ids, Cache& cache, std::span<const int64_t> positions, const at::Tensor& bias) {
    const detail::FlushSubnormals flush;
    // The loops read the bias as fp32 (a bf16 model's is bf16; 0 and -inf either way).
    const at::Tensor grouped_bias = bias.defined() && bias.scalar_type() != at::kFloat ? bias.to(at::kFloat) : bias;
    const detail::ProductChoice choice = products_;
    const int64_t batch = ids.size(0), count = ids.size(1), rows = batch * count;
    const int64_t heads = heads_, kv_heads = kv_heads_, head_dim = config_.head_dim();
    const int64_t dim = config_.dim, hidden = hidden_;
    const int64_t q_width = heads * head_dim, kv_width = kv_heads * head_dim, qkv_width = q_width + 2 * kv_width;
    const detail::AttentionShape shape{.batch = batch, .count = count, .past = cache.length(), .heads = heads,
                                       .kv_heads = kv_heads, .head_dim = head_dim,
                                       .bias_width = grouped_bias.defined() ? grouped_bias.size(-1) : 0,
                                       .bias_row_stride = grouped_bias.defined() && grouped_bias.dim() == 3
                                                              ? grouped_bias.stride(0) : 0};
    const bool row_positions = static_cast<int64_t>(positions.size()) == rows;
    // Every activation of the forward lies in one scratch buffer (see Scratch): the residual
    // stream x, its norm, q | k | v, the attention's output, a product's output, gate | up and
    // the gated hidden state, [rows, width] each.
    Scratch scratch(rows * (4 * dim + qkv_width + 3 * hidden));
    float* const x = scratch.data();
    float* const normed = x + rows * dim;
    float* const qkv = normed + rows * dim;
    float* const attended = qkv + rows * qkv_width;
    float* const product = attended + rows * dim;
    float* const gate_up = product + rows * dim;
    float* const gated = gate_up + rows * 2 * hidden;
    const auto fp32 = at::TensorOptions().dtype(at::kFloat);
    at::Tensor embedded = at::from_blob(x, {rows, dim}, fp32);
    if (dtype() == at::kFloat) {
      at::index_select_out(embedded, weights_.token_embedding, 0, ids.reshape({rows}));
    } else {
      embedded.copy_(weights_.token_embedding.index_select(0, ids.reshape({rows})));
    }
    const float* const cos = loop_cos_.data_ptr<float>();
    const float* const sin = loop_sin_.data_ptr<float>();
    // The features a tap asks for, in the model's dtype.
    const auto tap = [&](int64_t index, const float* rows_of) {
      if (dtype() == at::kFloat) {
        taps_->put_rows(index, rows_of, batch, count, dim);
        return;
      }
      taps_->put(index, at::from_blob(const_cast<float*>(rows_of), {batch, count, dim}, fp32).to(dtype()));
    };
    for (int64_t layer = 0; layer < config_.n_layers; ++layer) {
      const FusedLayer& fused = fused_[static_cast<size_t>(layer)];
      if (taps_ != nullptr) tap(layer, x);
      detail::rms_norm_rows(x, fused.attention_norm.template data_ptr<float>(), normed, rows, dim, config_.norm_eps);
      fused.qkv.into(normed, rows, qkv, choice);  // [rows, q | k | v]
      for (int64_t r = 0; r < rows; ++r) {  // q and k heads lie side by side: rotate them together
        detail::rotate_heads(qkv + r * qkv_width, heads + kv_heads, head_dim,
                             positions[static_cast<size_t>(row_positions ? r : r % count)], cos, sin);
      }
      // k | v as [2, batch, kv_heads, T, head_dim], a view of the scratch rows: both caches copy
      // what they keep.
      const at::Tensor keys_and_values =
          at::from_blob(qkv + q_width, {2, batch, kv_heads, count, head_dim},
                        {kv_width, count * qkv_width, head_dim, qkv_width, 1}, fp32);
      auto [keys, values] = write_layer(cache, layer, keys_and_values);
      // A cache of the caller's own making may hold another dtype; the loops read fp32 rows.
      if (keys.scalar_type() != at::kFloat || keys.stride(3) != 1) keys = keys.to(at::kFloat).contiguous();
      if (values.scalar_type() != at::kFloat || values.stride(3) != 1) values = values.to(at::kFloat).contiguous();
      if (loop_attention(count, head_dim)) {
        detail::attend(shape, qkv, qkv_width, keys, values, grouped_bias.defined() ? grouped_bias.data_ptr<float>() : nullptr,
                       attended);
      } else {
        detail::attend_batched(shape, at::from_blob(qkv, {rows, q_width}, {qkv_width, 1}, fp32), keys, values,
                               grouped_bias, at::from_blob(attended, {rows, q_width}, fp32));
      }
      fused.o.into(attended, rows, product, choice);
      if (group_) reduce(at::from_blob(product, {rows * dim}, fp32));
      detail::add_into(x, product, rows * dim);
      detail::rms_norm_rows(x, fused.ffn_norm.template data_ptr<float>(), normed, rows, dim, config_.norm_eps);
      fused.gate_up.into(normed, rows, gate_up, choice);
      detail::swiglu_rows(gate_up, rows, hidden, gated);
      fused.down.into(gated, rows, product, choice);
      if (group_) reduce(at::from_blob(product, {rows * dim}, fp32));
      detail::add_into(x, product, rows * dim);
    }
    cache.commit(count);
    detail::rms_norm_rows(x, loop_norm_.data_ptr<float>(), normed, rows, dim, config_.norm_eps);
    if (taps_ != nullptr) tap(config_.n_layers, normed);
    at::Tensor logits = at::empty({batch, count, config_.vocab_size}, fp32);
    classifier_.into(normed, rows, logits.data_ptr<float>(), choice);
    return dtype() == at::kFloat ? logits : logits.to(dtype());
  }

  // The CPU forward's scratch floats: a buffer kept per thread and reused by every forward on
  // it (no allocation per forward) up to kKeptScratchFloats, a buffer of this forward's own
  // beyond (long prefills of large models).
  class Scratch {
   public:
    explicit Scratch(int64_t floats) {
      if (floats <= kKeptScratchFloats) {
        thread_local std::vector<float> kept;
        if (static_cast<int64_t>(kept.size()) < floats) kept.resize(static_cast<size_t>(floats));
        data_ = kept.data();
      } else {
        own_ = std::make_unique_for_overwrite<float[]>(static_cast<size_t>(floats));
        data_ = own_.get();
      }
    }
    [[nodiscard]] float* data() const noexcept { return data_; }

   private:
    static constexpr int64_t kKeptScratchFloats = int64_t{4} << 20;  // 16 MiB
    std::unique_ptr<float[]> own_;
    float* data_ = nullptr;
  };

  // One layer's new keys and values into the cache: in one write where the cache takes them
  // stacked, otherwise as two.
  static std::pair<at::Tensor, at::Tensor> write_layer(Cache& cache, int64_t layer, const at::Tensor& keys_and_values) {
    if constexpr (requires { cache.update_stacked(layer, keys_and_values); }) {
      return cache.update_stacked(layer, keys_and_values);
    } else {
      return cache.update(layer, keys_and_values[0], keys_and_values[1]);
    }
  }

  // RMSNorm computed in at least float32 whatever the activations' dtype (fp16 squares overflow
  // on real checkpoints), scaled by the weight in the activations' dtype.
  static at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
    const at::Tensor wide = x.to(at::promote_types(x.scalar_type(), at::kFloat));
    return (wide * at::rsqrt(wide.pow(2).mean(-1, /*keepdim=*/true) + eps)).to(x.scalar_type()) * weight;
  }

  // Whether rotary embeddings run as one complex product (float32 and float64; ATen has no
  // complex half types on every device).
  [[nodiscard]] bool complex_rope() const { return dtype() == at::kFloat || dtype() == at::kDouble; }

  // Rotates consecutive pairs (2i, 2i+1) of x [B, T, heads, head_dim] by the angles of positions:
  // pair (a, b) is the complex number a + ib times e^(i angle), given as `rotation`
  // [rows, T, 1, hd/2]. One product and two views.
  static at::Tensor rotate_complex(const at::Tensor& x, const at::Tensor& rotation) {
    const auto sizes = x.sizes();
    const at::Tensor pairs = at::view_as_complex(x.reshape({sizes[0], sizes[1], sizes[2], sizes[3] / 2, 2}));
    return at::view_as_real(pairs * rotation).view(sizes);
  }

  // Rotates consecutive pairs (2i, 2i+1) of x [B, T, heads, head_dim] by the angles of positions.
  at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) const {
    const auto sizes = x.sizes();
    const at::Tensor pairs = x.reshape({sizes[0], sizes[1], sizes[2], sizes[3] / 2, 2});
    const at::Tensor even = pairs.select(-1, 0);
    const at::Tensor odd = pairs.select(-1, 1);
    return at::stack({even * cos - odd * sin, even * sin + odd * cos}, -1).reshape(sizes);
  }

  // The ATen forward: new token t of row b at positions [T] (or [B, T]) seeing what `bias` leaves
  // at 0 (see below). `written_at` (defined only by forward_at): the tokens' keys and values are
  // written at those positions of a StaticKVCache, which is not committed, and `bias` spans its
  // whole capacity.
  at::Tensor run(const at::Tensor& ids, Cache& cache, const at::Tensor& positions,
                 const at::Tensor& bias, const at::Tensor& written_at = at::Tensor()) {
    const int64_t batch = ids.size(0);
    const int64_t count = ids.size(1);
    const int64_t heads = heads_;
    const int64_t kv_heads = kv_heads_;
    const int64_t group = heads / kv_heads;
    const int64_t head_dim = config_.head_dim();
    const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
    // [1 or B, T, 1, hd/2] to broadcast over batch (positions [T]) or rows (positions [B, T]) and heads.
    const int64_t rows = positions.dim() == 2 ? batch : 1;
    const std::vector<int64_t> rope_shape{rows, count, 1, head_dim / 2};
    at::Tensor cos, sin, rotation;
    if (complex_rope()) {
      rotation = rope_.index_select(0, positions.flatten()).view(rope_shape);
    } else {
      cos = rope_cos_.index_select(0, positions.flatten()).view(rope_shape);
      sin = rope_sin_.index_select(0, positions.flatten()).view(rope_shape);
    }
    const auto rotate_heads = [&](const at::Tensor& x) {
      return complex_rope() ? rotate_complex(x, rotation) : rotate(x, cos, sin);
    };
    const int64_t q_width = heads * head_dim, kv_width = kv_heads * head_dim;
    // The bias over the new tokens' columns, repeated for the query heads that share a key/value
    // head ([group * T, T]), or given whole over every key column ([B, 1, group * T, keys]).
    const bool full_bias = bias.defined() && bias.dim() == 4;

    at::Tensor x = at::embedding(weights_.token_embedding, ids);
    for (int64_t layer = 0; layer < config_.n_layers; ++layer) {
      const LlamaLayerWeights& w = weights_.layers[static_cast<size_t>(layer)];
      const FusedLayer& fused = fused_[static_cast<size_t>(layer)];
      if (taps_ != nullptr) taps_->put(layer, x);
      const at::Tensor h = rms_norm(x, w.attention_norm, config_.norm_eps);
      // q and k rotate together: [B, T, heads + kv_heads, hd].
      const at::Tensor qkv = at::linear(h, packed_ ? fused.qkv.dense().to(dtype()) : fused.wqkv, fused.bqkv);
      const at::Tensor qk =
          rotate_heads(qkv.narrow(-1, 0, q_width + kv_width).reshape({batch, count, heads + kv_heads, head_dim}));
      const at::Tensor q = qk.narrow(2, 0, heads);
      const at::Tensor k = qk.narrow(2, heads, kv_heads);
      const at::Tensor v = qkv.narrow(-1, q_width + kv_width, kv_width).view({batch, count, kv_heads, head_dim});
      const auto [keys, values] = write_positions(cache, layer, k.transpose(1, 2), v.transpose(1, 2), written_at);
      // Queries grouped by their key/value head: [B, kv_heads, group * T, hd].
      const at::Tensor grouped = q.transpose(1, 2).reshape({batch, kv_heads, group * count, head_dim});
      at::Tensor scores = at::matmul(grouped, keys.transpose(2, 3)).mul_(scale);
      if (full_bias) {
        scores.add_(bias);
      } else if (bias.defined()) {
        scores.narrow(-1, scores.size(-1) - bias.size(-1), bias.size(-1)).add_(bias);
      }
      // Softmax in at least float32, as the reference implementations do for fp16 and bf16.
      const at::Tensor weights = scores.softmax(-1, at::promote_types(scores.scalar_type(), at::kFloat));
      const at::Tensor attended = at::matmul(weights.to(values.scalar_type()), values)
                                      .view({batch, heads, count, head_dim})
                                      .transpose(1, 2)
                                      .reshape({batch, count, q_width});
      x = x + reduce(at::linear(attended, packed_ ? fused.o.dense().to(dtype()) : w.wo, w.bo));
      const at::Tensor f = rms_norm(x, w.ffn_norm, config_.norm_eps);
      const at::Tensor gate_up = at::linear(f, packed_ ? fused.gate_up.dense().to(dtype()) : fused.w13);
      const int64_t hidden = hidden_;
      x = x + reduce(at::linear(at::silu(gate_up.narrow(-1, 0, hidden)) * gate_up.narrow(-1, hidden, hidden),
                                packed_ ? fused.down.dense().to(dtype()) : w.w2));
    }
    if (!written_at.defined()) cache.commit(count);
    const at::Tensor normed = rms_norm(x, weights_.norm, config_.norm_eps);
    if (taps_ != nullptr) taps_->put(config_.n_layers, normed);
    return at::linear(normed, packed_ ? classifier_.dense().to(dtype()) : weights_.output);
  }

  // A layer's new keys and values [B, kv_heads, T, hd] into the cache: appended (update()), or at
  // the positions `written_at` of a StaticKVCache (update_at()).
  static std::pair<at::Tensor, at::Tensor> write_positions(Cache& cache, int64_t layer, const at::Tensor& keys,
                                                           const at::Tensor& values, const at::Tensor& written_at) {
    if constexpr (std::is_same_v<Cache, StaticKVCache>) {
      if (written_at.defined()) return cache.update_at(layer, at::stack({keys, values}), written_at);
    }
    return cache.update(layer, keys, values);
  }

  // A row-parallel product's partial sum made whole: summed over the ranks, in place.
  at::Tensor reduce(at::Tensor partial) const {
    if (group_) group_->all_reduce(partial);
    return partial;
  }

  // Every rank holds the same model: rank 0's config and checksums of the replicated weights are
  // broadcast, each rank compares them with its own, and the count of ranks that differ is summed,
  // so that every rank throws, rather than one throwing and the others waiting for it.
  void check_same_model() const {
    const auto sum = [](const at::Tensor& t) { return t.defined() ? t.to(at::kDouble).sum().item<double>() : 0.0; };
    const LlamaConfig& c = config_;
    std::vector<double> print{static_cast<double>(c.dim), static_cast<double>(c.hidden_dim), static_cast<double>(c.n_layers),
                              static_cast<double>(c.n_heads), static_cast<double>(c.n_kv_heads),
                              static_cast<double>(c.vocab_size), static_cast<double>(c.max_seq_len), c.rope_theta,
                              c.norm_eps, static_cast<double>(c.sliding_window), static_cast<double>(c.qkv_bias),
                              static_cast<double>(c.o_bias), sum(weights_.token_embedding), sum(weights_.norm),
                              sum(weights_.output)};
    for (const LlamaLayerWeights& w : weights_.layers) {
      print.push_back(sum(w.attention_norm));
      print.push_back(sum(w.ffn_norm));
      print.push_back(sum(w.bo));
    }
    const at::Tensor mine = at::tensor(print, at::TensorOptions().dtype(at::kDouble)).to(device());
    at::Tensor first = mine.clone();
    group_->broadcast(first, 0);
    const bool differs = !at::equal(first, mine);
    at::Tensor differing = at::full({1}, differs ? 1.0 : 0.0, mine.options());
    group_->all_reduce(differing);
    const auto count = static_cast<int64_t>(differing.item<double>());
    if (count > 0) {
      detail::throw_invalid_message("tensor parallelism: ", count, " of ", group_->world_size(),
                                    " ranks hold a model other than rank 0's (its config or its replicated weights: "
                                    "token_embedding, norms, output, o's bias differ)",
                                    differs ? "; this rank, " + std::to_string(group_->rank()) + ", is one of them" : "");
    }
  }

  void check_weights() const {
    const auto& c = config_;
    const at::Tensor& reference = weights_.token_embedding;
    if (!reference.defined() || !at::isFloatingType(reference.scalar_type())) {
      throw std::invalid_argument("LlamaWeights::token_embedding must be a floating-point tensor");
    }
    const auto expect = [&](const at::Tensor& t, const std::string& name,
                            std::vector<int64_t> shape) {
      if (!t.defined() || !t.sizes().equals(shape)) {
        detail::throw_invalid_message("LlamaWeights::", name, " must have shape ",
                                      at::IntArrayRef(shape), ", got ",
                                      t.defined() ? t.sizes() : at::IntArrayRef{});
      }
      if (t.scalar_type() != reference.scalar_type() || t.device() != reference.device()) {
        detail::throw_invalid_message("LlamaWeights::", name, " must be ", reference.scalar_type(),
                                      " on ", reference.device(), " like token_embedding, got ",
                                      t.scalar_type(), " on ", t.device());
      }
    };
    expect(weights_.token_embedding, "token_embedding", {c.vocab_size, c.dim});
    if (static_cast<int64_t>(weights_.layers.size()) != c.n_layers) {
      detail::throw_invalid_message("LlamaWeights::layers must hold n_layers = ", c.n_layers,
                                    " layers, got ", weights_.layers.size());
    }
    const int64_t q_dim = heads_ * c.head_dim(), kv_dim = kv_heads_ * c.head_dim(), hidden = hidden_;
    for (size_t i = 0; i < weights_.layers.size(); ++i) {
      const auto& l = weights_.layers[i];
      const std::string prefix = "layers[" + std::to_string(i) + "].";
      expect(l.attention_norm, prefix + "attention_norm", {c.dim});
      expect(l.wq, prefix + "wq", {q_dim, c.dim});
      expect(l.wk, prefix + "wk", {kv_dim, c.dim});
      expect(l.wv, prefix + "wv", {kv_dim, c.dim});
      expect(l.wo, prefix + "wo", {c.dim, q_dim});
      expect(l.ffn_norm, prefix + "ffn_norm", {c.dim});
      expect(l.w1, prefix + "w1", {hidden, c.dim});
      expect(l.w2, prefix + "w2", {c.dim, hidden});
      expect(l.w3, prefix + "w3", {hidden, c.dim});
      const auto expect_bias = [&](const at::Tensor& t, const std::string& name, bool present, int64_t size) {
        if (present) {
          expect(t, prefix + name, {size});
        } else if (t.defined()) {
          detail::throw_invalid_message("LlamaWeights::", prefix, name, " is given but the config has no such bias");
        }
      };
      expect_bias(l.bq, "bq", c.qkv_bias, q_dim);
      expect_bias(l.bk, "bk", c.qkv_bias, kv_dim);
      expect_bias(l.bv, "bv", c.qkv_bias, kv_dim);
      expect_bias(l.bo, "bo", c.o_bias, c.dim);
    }
    expect(weights_.norm, "norm", {c.dim});
    expect(weights_.output, "output", {c.vocab_size, c.dim});
  }

  struct FusedLayer {
    at::Tensor wqkv{};  // [dim + 2 kv_dim, dim]: wq, wk, wv
    at::Tensor w13{};   // [2 hidden_dim, dim]: w1 (gate), w3 (up)
    at::Tensor bqkv{};  // [dim + 2 kv_dim]: bq, bk, bv (undefined without qkv_bias)
    // The CPU loops' products (kernels_apply()): q|k|v, o, gate|up, down; the norms' weights
    // as fp32.
    detail::CpuLinear qkv{}, o{}, gate_up{}, down{};
    at::Tensor attention_norm{}, ffn_norm{};
  };

  // Forwards of up to this many new tokens use a causal bias built at construction.
  static constexpr int64_t kCachedMaskTokens = 32;

  LlamaConfig config_;
  LlamaWeights weights_;
  std::shared_ptr<Collectives> group_;  // the tensor-parallel group, if any
  int64_t heads_ = 0, kv_heads_ = 0, hidden_ = 0;  // this shard's (the whole model's without a group)
  std::vector<FusedLayer> fused_;
  std::vector<at::Tensor> causal_bias_;  // [count]: grouped_causal_bias(count), count in [2, kCachedMaskTokens]
  bool cpu_kernels_ = true;
  detail::ProductChoice products_ = detail::ProductChoice::automatic;  // use_products()
  bool packed_ = false;                            // pack_weights()
  detail::WeightFormat format_ = detail::WeightFormat::f32;  // pack_weights()' format
  bool onednn_built_ = detail::kOneDnnBuilt;       // every CpuLinear has its oneDNN primitive
  detail::CpuLinear classifier_;                   // the CPU loops' classifier product
  bool trainable_ = false;  // some weight requires gradients
  at::Tensor rope_;      // complex e^(i angle) [max_seq_len, head_dim / 2] (complex_rope())
  at::Tensor rope_cos_;  // [max_seq_len, head_dim / 2] (no complex type, or the CPU loops)
  at::Tensor rope_sin_;
  at::Tensor loop_cos_;   // fp32 [max_seq_len, head_dim / 2] for the CPU loops (kernels_apply())
  at::Tensor loop_sin_;
  at::Tensor loop_norm_;  // the final norm's weight as fp32, for the CPU loops
  Taps* taps_ = nullptr;  // the forward_features() call in progress (Tapping), if any
};

// The config and weights of the model's first `n_layers` layers with the same embedding, final
// norm and classifier: a cheap self-speculative drafter ("layer skip") that shares the target's
// tensors without copying them. Requires 1 <= n_layers <= config.n_layers.
inline std::pair<LlamaConfig, LlamaWeights> truncated(const LlamaConfig& config,
                                                      const LlamaWeights& weights,
                                                      int64_t n_layers) {
  if (n_layers < 1 || n_layers > config.n_layers) {
    detail::throw_invalid_message("n_layers must be in [1, ", config.n_layers, "], got ", n_layers);
  }
  LlamaConfig shallow = config;
  shallow.n_layers = n_layers;
  LlamaWeights kept = weights;
  kept.layers.resize(static_cast<size_t>(n_layers));
  return {shallow, std::move(kept)};
}

// Rank `rank`'s shard of `weights` for a model split over `world_size` ranks (see the header
// comment): heads [rank * n_heads / N, (rank + 1) * n_heads / N) of q and of o's columns, the
// same slice of the key/value heads and of the feed-forward width, copied out (contiguous) so the
// whole weights can be released; the replicated tensors are shared with `weights`. Throws
// std::invalid_argument where the config does not divide (check_tensor_parallel) or the rank is
// out of range.
inline LlamaWeights llama_shard(const LlamaConfig& config, const LlamaWeights& weights, int64_t rank, int64_t world_size) {
  config.validate();
  check_tensor_parallel(config, world_size);
  if (rank < 0 || rank >= world_size) {
    detail::throw_invalid_message("rank must be in [0, world_size = ", world_size, "), got ", rank);
  }
  if (static_cast<int64_t>(weights.layers.size()) != config.n_layers) {
    detail::throw_invalid_message("LlamaWeights::layers must hold n_layers = ", config.n_layers, " layers, got ",
                                  weights.layers.size());
  }
  const int64_t head_dim = config.head_dim();
  const int64_t q = config.n_heads / world_size * head_dim, kv = config.n_kv_heads / world_size * head_dim;
  const int64_t hidden = config.hidden_dim / world_size;
  // Rows [rank * n, (rank + 1) * n) of dimension `dim`, where the tensor is given (biases may not be).
  const auto slice = [&](const at::Tensor& t, int64_t dim, int64_t n) {
    return t.defined() ? t.narrow(dim, rank * n, n).contiguous() : at::Tensor();
  };
  LlamaWeights shard = weights;
  for (LlamaLayerWeights& w : shard.layers) {
    w.wq = slice(w.wq, 0, q);
    w.wk = slice(w.wk, 0, kv);
    w.wv = slice(w.wv, 0, kv);
    w.bq = slice(w.bq, 0, q);
    w.bk = slice(w.bk, 0, kv);
    w.bv = slice(w.bv, 0, kv);
    w.wo = slice(w.wo, 1, q);
    w.w1 = slice(w.w1, 0, hidden);
    w.w3 = slice(w.w3, 0, hidden);
    w.w2 = slice(w.w2, 1, hidden);
  }
  return shard;
}

static_assert(FeatureTreeTarget<LlamaModel<DynamicKVCache>>);
static_assert(FeatureTreeTarget<LlamaModel<StaticKVCache>>);
static_assert(MaskedFeatureTreeTarget<LlamaModel<DynamicKVCache>> && MaskedFeatureTreeTarget<LlamaModel<StaticKVCache>>);
static_assert(MaskedTreeTarget<LlamaModel<DynamicKVCache>> && MaskedTreeTarget<LlamaModel<StaticKVCache>>);
static_assert(CachedMaskTreeModel<LlamaModel<DynamicKVCache>> && CachedMaskTreeModel<LlamaModel<StaticKVCache>>);

}  // namespace specdec::models
