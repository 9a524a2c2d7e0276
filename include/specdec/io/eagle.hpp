// Loading EAGLE heads (models/eagle.hpp) in their published layouts: a folder holding config.json
// and model.safetensors, as
//   EAGLE-3, the EAGLE project's layout: a Llama-style config.json (hidden_size,
//     intermediate_size, num_attention_heads, num_key_value_heads, rms_norm_eps, rope settings,
//     vocab_size = the target's) with draft_vocab_size and optionally target_hidden_size; tensors
//     fc.weight, midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight,
//     midlayer.self_attn.{q,k,v,o}_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight,
//     norm.weight, lm_head.weight, d2t (int64 offsets: target id = draft id + d2t[draft id]), t2d
//     (bool [vocab]), optionally embed_tokens.weight (otherwise the target's embedding);
//   EAGLE-3, vLLM's speculators layout: config.json with speculators_model_type "eagle3", the
//     layer's settings under transformer_layer_config, and draft_vocab_size,
//     norm_before_residual and target_hidden_size at the top; the same tensors with the layer
//     under layers.0. and fc.bias;
//   EAGLE-1 (EAGLE-2 checkpoints are the same heads): a Llama-style config.json of one layer;
//     fc.weight [H, 2H], fc.bias, layers.0.{self_attn, mlp, post_attention_layernorm} (no input
//     norm), optionally embed_tokens.weight; the target's classifier is the head's.
// Which target layers an EAGLE-3 head reads comes from eagle_aux_hidden_state_layer_ids (at the
// top of config.json, or under eagle_config, as vLLM reads it), else the default 2, L/2, L-3.
// Hugging Face's rotate-half order of q and k rows is permuted to LlamaModel's consecutive pairs.
// The files are untrusted: sizes are JSON integers within LoadLimits, every tensor must be
// present with its shape and dtype, a tensor the layout does not name is refused, and d2t and t2d
// must map into the target vocabulary and agree. Errors are FormatError naming the file and the
// field or tensor. pytorch_model.bin (pickle) is not read: convert it to safetensors.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "specdec/io/atomic_file.hpp"
#include "specdec/io/errors.hpp"
#include "specdec/io/hf_config.hpp"
#include "specdec/io/hf_llama.hpp"
#include "specdec/io/json.hpp"
#include "specdec/io/limits.hpp"
#include "specdec/io/safetensors.hpp"
#include "specdec/models/eagle.hpp"

namespace specdec::io {

// What a head takes from its target: its sizes, and the embedding and classifier ([vocab,
// hidden]) that checkpoints leave out.
struct EagleTarget {
  int64_t hidden_size = 0;
  int64_t vocab_size = 0;
  int64_t num_layers = 0;
  at::Tensor embedding{};
  at::Tensor classifier{};

  template <class Cache>
  static EagleTarget of(const models::LlamaModel<Cache>& model) {
    return {.hidden_size = model.config().dim,
            .vocab_size = model.config().vocab_size,
            .num_layers = model.config().n_layers,
            .embedding = model.weights().token_embedding,
            .classifier = model.weights().output};
  }
};

namespace detail {

// The head's decoder layer from a Llama-style config object (config.json itself, or speculators'
// transformer_layer_config).
inline models::LlamaConfig eagle_layer_config(const nlohmann::json& json,
                                              const std::filesystem::path& file,
                                              const LoadLimits& limits) {
  if (!json.is_object()) throw_format(file, "the layer's settings are not a JSON object");
  const auto dimension = [&](const char* key) {
    return config_integer(json, file, key, 1, limits.max_dimension, "max_dimension");
  };
  const auto hidden_act = config_value_or<std::string>(json, file, "hidden_act", "silu");
  if (hidden_act != "silu")
    throw_format(file, "hidden_act '", printable(hidden_act), "' is not supported (only silu)");
  if (config_value_or<bool>(json, file, "attention_bias", false))
    throw_format(file, "attention_bias: true is not supported");
  if (config_value_or<bool>(json, file, "mlp_bias", false))
    throw_format(file, "mlp_bias: true is not supported");
  if (json.contains("num_hidden_layers") && !json["num_hidden_layers"].is_null() &&
      config_integer(json, file, "num_hidden_layers", 1, limits.max_dimension) != 1) {
    throw_format(file, "num_hidden_layers = ", excerpt(json["num_hidden_layers"]),
                 ": a head has one layer");
  }
  models::LlamaConfig c;
  c.dim = dimension("hidden_size");
  c.hidden_dim = dimension("intermediate_size");
  c.n_layers = 1;
  c.n_heads = dimension("num_attention_heads");
  c.n_kv_heads = json.contains("num_key_value_heads") && !json["num_key_value_heads"].is_null()
                     ? dimension("num_key_value_heads")
                     : c.n_heads;
  c.vocab_size =
      config_integer(json, file, "vocab_size", 1, limits.max_vocab_size, "max_vocab_size");
  const RotarySettings rotary = rotary_settings(json, file);
  c.rope_theta = rotary.theta;
  c.rope_scaling = rotary.scaling;
  c.norm_eps = config_value_or<double>(json, file, "rms_norm_eps", 1e-6);
  if (json.contains("head_dim") && !json["head_dim"].is_null() &&
      dimension("head_dim") * c.n_heads != c.dim) {
    throw_format(file, "head_dim * num_attention_heads must equal hidden_size");
  }
  try {
    c.validate();
  } catch (const std::invalid_argument& e) {
    throw_format(file, e.what());
  }
  return c;
}

// eagle_aux_hidden_state_layer_ids, at the top or under eagle_config; empty when neither says.
inline std::vector<int64_t> eagle_layer_ids(const nlohmann::json& json,
                                            const std::filesystem::path& file, int64_t layers) {
  const nlohmann::json* ids = nullptr;
  std::string field = "eagle_aux_hidden_state_layer_ids";
  if (json.contains(field) && !json[field].is_null()) {
    ids = &json[field];
  } else if (json.contains("eagle_config") && json["eagle_config"].is_object() &&
             json["eagle_config"].contains(field) && !json["eagle_config"][field].is_null()) {
    ids = &json["eagle_config"][field];
    field = "eagle_config." + field;
  }
  if (ids == nullptr) return {};
  if (!ids->is_array() || ids->size() != 3)
    throw_format(file, field, " must be an array of 3 layer ids, got ", excerpt(*ids));
  std::vector<int64_t> result;
  for (size_t i = 0; i < ids->size(); ++i) {
    const nlohmann::json& id = (*ids)[i];
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > layers) {
      throw_format(file, field, "[", i, "] = ", excerpt(id),
                   " is not a hidden state of the target's (0 to ", layers, ")");
    }
    result.push_back(id.get<int64_t>());
  }
  return result;
}

}  // namespace detail

// The EAGLE head in `folder` for `target`, its tensors converted with `options` (float32 on the
// CPU unless told otherwise).
inline models::EagleHead load_eagle(const std::filesystem::path& folder, const EagleTarget& target,
                                    const at::TensorOptions& options = at::kFloat,
                                    const LoadLimits& limits = {}) {
  const std::filesystem::path config_file = folder / "config.json";
  const nlohmann::json json = detail::read_json(config_file, limits);
  if (!json.is_object()) detail::throw_format(config_file, "not a JSON object");
  const std::filesystem::path weights_file = folder / "model.safetensors";
  if (!std::filesystem::exists(weights_file)) {
    if (std::filesystem::exists(folder / "pytorch_model.bin")) {
      detail::throw_format(
          folder,
          "holds pytorch_model.bin, a pickle, which is not read: convert it to model.safetensors");
    }
    detail::throw_format(folder, "holds no model.safetensors");
  }
  std::map<std::string, at::Tensor> tensors = load_safetensors(weights_file, limits).tensors;

  models::EagleConfig config;
  const bool speculators = json.contains("speculators_model_type");
  if (speculators) {
    const auto type =
        detail::config_value<std::string>(json, config_file, "speculators_model_type");
    if (type != "eagle3") {
      detail::throw_format(config_file, "speculators_model_type '", detail::printable(type),
                           "' is not supported (only eagle3)");
    }
    if (!json.contains("transformer_layer_config"))
      detail::throw_format(config_file, "missing key 'transformer_layer_config'");
    config.layer =
        detail::eagle_layer_config(json["transformer_layer_config"], config_file, limits);
    config.kind = models::EagleKind::eagle3;
  } else {
    config.layer = detail::eagle_layer_config(json, config_file, limits);
    const bool eagle3 = json.contains("draft_vocab_size") || tensors.contains("d2t") ||
                        tensors.contains("midlayer.hidden_norm.weight") ||
                        tensors.contains("layers.0.hidden_norm.weight");
    config.kind = eagle3 ? models::EagleKind::eagle3 : models::EagleKind::eagle1;
  }
  const bool eagle3 = config.kind == models::EagleKind::eagle3;
  if (config.layer.vocab_size != target.vocab_size) {
    detail::throw_format(config_file, "vocab_size = ", config.layer.vocab_size,
                         " but the target's vocabulary is ", target.vocab_size);
  }
  config.draft_vocab_size =
      eagle3 && json.contains("draft_vocab_size") && !json["draft_vocab_size"].is_null()
          ? detail::config_integer(json, config_file, "draft_vocab_size", 1,
                                   config.layer.vocab_size)
          : config.layer.vocab_size;
  config.target_hidden_size =
      eagle3 && json.contains("target_hidden_size") && !json["target_hidden_size"].is_null()
          ? detail::config_integer(json, config_file, "target_hidden_size", 1, limits.max_dimension,
                                   "max_dimension")
          : config.layer.dim;
  if (config.target_hidden_size != target.hidden_size) {
    detail::throw_format(
        config_file,
        eagle3 && json.contains("target_hidden_size") ? "target_hidden_size = " : "hidden_size = ",
        config.target_hidden_size, " but the target's hidden size is ", target.hidden_size);
  }
  config.norm_before_residual =
      eagle3 && detail::config_value_or<bool>(json, config_file, "norm_before_residual", false);
  if (eagle3) {
    config.feature_layers = detail::eagle_layer_ids(json, config_file, target.num_layers);
    if (config.feature_layers.empty()) {
      try {
        config.feature_layers = models::EagleConfig::eagle3_default_layers(target.num_layers);
      } catch (const std::invalid_argument& e) {
        detail::throw_format(config_file, e.what(), " (eagle_aux_hidden_state_layer_ids)");
      }
    }
  } else {
    config.feature_layers = {target.num_layers};
  }

  // The layer's tensors under one prefix: midlayer. or layers.0., not both.
  const bool midlayer = std::any_of(tensors.begin(), tensors.end(), [](const auto& t) {
    return t.first.rfind("midlayer.", 0) == 0;
  });
  const bool layers0 = std::any_of(tensors.begin(), tensors.end(), [](const auto& t) {
    return t.first.rfind("layers.0.", 0) == 0;
  });
  if (midlayer && layers0)
    detail::throw_format(weights_file, "holds both midlayer.* and layers.0.* tensors");
  const std::string layer = midlayer ? "midlayer." : "layers.0.";
  const int64_t h = config.layer.dim, in = config.attention_inputs();
  std::set<std::string> used;
  const auto find = [&](const std::string& name) -> const at::Tensor* {
    const auto it = tensors.find(name);
    return it == tensors.end() ? nullptr : &it->second;
  };
  const auto take = [&](const std::string& name, std::vector<int64_t> shape) {
    const at::Tensor* t = find(name);
    if (t == nullptr) detail::throw_format(weights_file, "missing tensor '", name, "'");
    if (t->sizes() != at::IntArrayRef(shape)) {
      detail::throw_format(weights_file, "tensor '", name, "' has shape ", t->sizes(),
                           ", expected ", at::IntArrayRef(shape));
    }
    if (!t->is_floating_point())
      detail::throw_format(weights_file, "tensor '", name,
                           "' is not floating point: ", t->scalar_type());
    used.insert(name);
    return t->to(options);
  };
  const models::LlamaConfig& c = config.layer;
  models::EagleWeights w;
  w.fc = take("fc.weight", {h, config.fc_inputs()});
  if (!eagle3 || find("fc.bias") != nullptr) w.fc_bias = take("fc.bias", {h});
  w.wq = io::detail::unpermute_rotary(
      take(layer + "self_attn.q_proj.weight", {c.n_heads * c.head_dim(), in}), c.n_heads);
  w.wk = io::detail::unpermute_rotary(take(layer + "self_attn.k_proj.weight", {c.kv_dim(), in}),
                                      c.n_kv_heads);
  w.wv = take(layer + "self_attn.v_proj.weight", {c.kv_dim(), in});
  w.wo = take(layer + "self_attn.o_proj.weight", {h, c.n_heads * c.head_dim()});
  w.ffn_norm = take(layer + "post_attention_layernorm.weight", {h});
  w.w_gate = take(layer + "mlp.gate_proj.weight", {c.hidden_dim, h});
  w.w_up = take(layer + "mlp.up_proj.weight", {c.hidden_dim, h});
  w.w_down = take(layer + "mlp.down_proj.weight", {h, c.hidden_dim});
  if (find("embed_tokens.weight") != nullptr) {
    w.embedding = take("embed_tokens.weight", {c.vocab_size, h});
  } else if (target.embedding.defined() &&
             target.embedding.sizes() == at::IntArrayRef{c.vocab_size, h}) {
    w.embedding = target.embedding.to(options);
  } else {
    detail::throw_format(weights_file, "has no embed_tokens.weight [", c.vocab_size, ", ", h,
                         "], and the target's embedding does not have that shape");
  }
  if (eagle3) {
    w.input_norm = take(layer + "input_layernorm.weight", {h});
    w.hidden_norm = take(layer + "hidden_norm.weight", {h});
    w.norm = take("norm.weight", {h});
    w.lm_head = take("lm_head.weight", {config.draft_vocab_size, h});
    const at::Tensor* d2t = find("d2t");
    if (d2t != nullptr) {
      if (d2t->sizes() != at::IntArrayRef{config.draft_vocab_size} || d2t->is_floating_point() ||
          d2t->scalar_type() == at::kBool) {
        detail::throw_format(weights_file, "tensor 'd2t' must be integer [",
                             config.draft_vocab_size, "], got ", d2t->sizes(), " ",
                             d2t->scalar_type());
      }
      used.insert("d2t");
      const at::Tensor offsets = d2t->to(at::kLong);
      const at::Tensor targets = at::arange(config.draft_vocab_size, at::kLong) + offsets;
      const at::Tensor outside = ((targets < 0) | (targets >= c.vocab_size)).nonzero();
      if (outside.numel() > 0) {
        const int64_t d = outside[0][0].item<int64_t>();
        detail::throw_format(weights_file, "d2t[", d, "] = ", offsets[d].item<int64_t>(),
                             " maps draft id ", d, " to ", targets[d].item<int64_t>(),
                             ", outside the target vocabulary [0, ", c.vocab_size, ")");
      }
      const at::Tensor sorted = std::get<0>(targets.sort());
      if (config.draft_vocab_size > 1 && (sorted.narrow(0, 1, config.draft_vocab_size - 1) ==
                                          sorted.narrow(0, 0, config.draft_vocab_size - 1))
                                             .any()
                                             .item<bool>()) {
        detail::throw_format(weights_file, "d2t maps two draft ids to the same target id");
      }
      if (const at::Tensor* t2d = find("t2d")) {
        if (t2d->sizes() != at::IntArrayRef{c.vocab_size}) {
          detail::throw_format(weights_file, "tensor 't2d' has shape ", t2d->sizes(),
                               ", expected [", c.vocab_size, "]");
        }
        used.insert("t2d");
        const at::Tensor marked = t2d->to(at::kBool);
        if (marked.sum().item<int64_t>() != config.draft_vocab_size ||
            !marked.index_select(0, targets).all().item<bool>()) {
          detail::throw_format(weights_file,
                               "t2d does not mark exactly the target ids d2t maps to");
        }
      }
      w.d2t = offsets.to(options.device());
    } else if (config.draft_vocab_size != c.vocab_size) {
      detail::throw_format(weights_file, "missing tensor 'd2t' (draft_vocab_size ",
                           config.draft_vocab_size, " < vocab_size ", c.vocab_size, ")");
    }
  } else {
    if (!target.classifier.defined() ||
        target.classifier.sizes() != at::IntArrayRef{c.vocab_size, h}) {
      detail::throw_format(folder, "an EAGLE-1 head needs the target's classifier [", c.vocab_size,
                           ", ", h, "]");
    }
    w.lm_head = target.classifier.to(options);
  }
  for (const auto& [name, tensor] : tensors) {
    if (!used.contains(name)) {
      detail::throw_format(weights_file, "unexpected tensor '", detail::printable(name),
                           "' for an ", models::to_string(config.kind), " head");
    }
  }
  try {
    return models::EagleHead(std::move(config), std::move(w));
  } catch (const std::invalid_argument& e) {
    detail::throw_format(folder, e.what());
  }
}

// Writes `head` in the EAGLE project's layout (config.json, model.safetensors), which load_eagle()
// reads back: EAGLE-3 with midlayer., d2t and t2d, and the target layers it reads as
// eagle_aux_hidden_state_layer_ids; EAGLE-1 with layers.0. and without the target's classifier.
// The embedding is written as embed_tokens.weight only with `with_embedding` (a head trained with
// its own). Each file is written atomically.
inline void save_eagle(const std::filesystem::path& folder, const models::EagleHead& head,
                       bool with_embedding = false) {
  const models::EagleConfig& config = head.config();
  const models::EagleWeights& w = head.weights();
  const models::LlamaConfig& c = config.layer;
  const bool eagle3 = config.kind == models::EagleKind::eagle3;
  const std::string layer = eagle3 ? "midlayer." : "layers.0.";
  std::filesystem::create_directories(folder);
  std::map<std::string, at::Tensor> tensors{
      {"fc.weight", w.fc},
      {layer + "self_attn.q_proj.weight", detail::permute_rotary(w.wq, c.n_heads)},
      {layer + "self_attn.k_proj.weight", detail::permute_rotary(w.wk, c.n_kv_heads)},
      {layer + "self_attn.v_proj.weight", w.wv},
      {layer + "self_attn.o_proj.weight", w.wo},
      {layer + "post_attention_layernorm.weight", w.ffn_norm},
      {layer + "mlp.gate_proj.weight", w.w_gate},
      {layer + "mlp.up_proj.weight", w.w_up},
      {layer + "mlp.down_proj.weight", w.w_down}};
  if (w.fc_bias.defined()) tensors["fc.bias"] = w.fc_bias;
  if (with_embedding) tensors["embed_tokens.weight"] = w.embedding;
  nlohmann::json json{{"architectures", {eagle3 ? "LlamaForCausalLMEagle3" : "LlamaForCausalLM"}},
                      {"model_type", "llama"},
                      {"hidden_act", "silu"},
                      {"hidden_size", c.dim},
                      {"intermediate_size", c.hidden_dim},
                      {"num_attention_heads", c.n_heads},
                      {"num_key_value_heads", c.n_kv_heads},
                      {"num_hidden_layers", 1},
                      {"vocab_size", c.vocab_size},
                      {"max_position_embeddings", c.max_seq_len},
                      {"rms_norm_eps", c.norm_eps},
                      {"rope_theta", c.rope_theta},
                      {"torch_dtype", "float32"}};
  if (c.rope_scaling.type == models::RopeScaling::Type::linear) {
    json["rope_scaling"] = {{"rope_type", "linear"}, {"factor", c.rope_scaling.factor}};
  } else if (c.rope_scaling.type == models::RopeScaling::Type::llama3) {
    json["rope_scaling"] = {
        {"rope_type", "llama3"},
        {"factor", c.rope_scaling.factor},
        {"low_freq_factor", c.rope_scaling.low_freq_factor},
        {"high_freq_factor", c.rope_scaling.high_freq_factor},
        {"original_max_position_embeddings", c.rope_scaling.original_max_position_embeddings}};
  }
  if (eagle3) {
    tensors[layer + "input_layernorm.weight"] = w.input_norm;
    tensors[layer + "hidden_norm.weight"] = w.hidden_norm;
    tensors["norm.weight"] = w.norm;
    tensors["lm_head.weight"] = w.lm_head;
    const at::Tensor d2t =
        w.d2t.defined() ? w.d2t.cpu() : at::zeros({config.draft_vocab_size}, at::kLong);
    at::Tensor t2d = at::zeros({c.vocab_size}, at::kBool);
    t2d.index_fill_(0, at::arange(config.draft_vocab_size, at::kLong) + d2t, true);
    tensors["d2t"] = d2t;
    tensors["t2d"] = t2d;
    json["draft_vocab_size"] = config.draft_vocab_size;
    if (config.target_hidden_size != c.dim) json["target_hidden_size"] = config.target_hidden_size;
    if (config.norm_before_residual) json["norm_before_residual"] = true;
    json["eagle_aux_hidden_state_layer_ids"] = config.feature_layers;
  }
  save_safetensors(folder / "model.safetensors", tensors, {{"format", "pt"}});
  detail::write_atomically(folder / "config.json",
                           [&](std::ofstream& out) { out << json.dump(2) << "\n"; });
}

}  // namespace specdec::io
