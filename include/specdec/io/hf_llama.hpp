// Hugging Face checkpoints of the Llama, Mistral and Qwen2 families: config.json plus
// model.safetensors, or shards listed in model.safetensors.index.json, with the tensor names of
// LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM (the same names; Qwen2 adds q, k, v
// biases). Loads fp32, fp16 and bf16 weights into the reference model, and writes the same layout.
//
// Hugging Face stores wq and wk with the two halves of every head rotated together ("rotate
// half"); the reference model rotates consecutive pairs as llama2.c does, so the rows of wq and wk
// are permuted once here, on load and on save.
#pragma once

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <utility>

#include "specdec/detail/torch_compat.hpp"
#include "specdec/io/atomic_file.hpp"
#include "specdec/io/errors.hpp"
#include "specdec/io/json.hpp"
#include "specdec/io/limits.hpp"
#include "specdec/io/hf_config.hpp"
#include "specdec/io/safetensors.hpp"
#include "specdec/models/llama.hpp"

namespace specdec::io {
namespace detail {

// Rows of a [heads * head_dim, in] projection from rotate-half order to consecutive pairs.
inline at::Tensor unpermute_rotary(const at::Tensor& w, int64_t heads) {
  const int64_t rows = w.size(0), columns = w.size(1);
  return w.reshape({heads, 2, rows / heads / 2, columns}).transpose(1, 2).reshape({rows, columns});
}

// The same for a bias [heads * head_dim].
inline at::Tensor unpermute_rotary_bias(const at::Tensor& b, int64_t heads) {
  return unpermute_rotary(b.view({b.size(0), 1}), heads).view({b.size(0)});
}

// The inverse: consecutive pairs to rotate-half order.
inline at::Tensor permute_rotary(const at::Tensor& w, int64_t heads) {
  const int64_t rows = w.size(0), columns = w.size(1);
  return w.reshape({heads, rows / heads / 2, 2, columns}).transpose(1, 2).reshape({rows, columns});
}
inline at::Tensor permute_rotary_bias(const at::Tensor& b, int64_t heads) {
  return permute_rotary(b.view({b.size(0), 1}), heads).view({b.size(0)});
}

// Whether `path` lies under `root` (both canonical).
inline bool is_under(const std::filesystem::path& root, const std::filesystem::path& path) {
  return std::mismatch(root.begin(), root.end(), path.begin(), path.end()).first == root.end();
}

// Throws FormatError unless `file`, links resolved, lies inside `folder`, links resolved. The one
// exception is the Hugging Face hub cache, whose snapshot folders REPO/snapshots/REV hold links
// into REPO/blobs: those are followed.
inline void require_inside(const std::filesystem::path& folder, const std::filesystem::path& file) {
  std::error_code error;
  const auto root = std::filesystem::weakly_canonical(folder, error);
  const auto target = error ? std::filesystem::path() : std::filesystem::weakly_canonical(file, error);
  if (error) throw_format(file, "cannot resolve the path: ", error.message());
  if (is_under(root, target)) return;
  const auto repository = root.parent_path().parent_path();
  if (root.parent_path().filename() == "snapshots" && is_under(repository / "blobs", target)) return;
  throw_format(file, "resolves to ", printable(target.string(), 200), ", outside the checkpoint folder");
}

}  // namespace detail

struct HfLlamaCheckpoint {
  models::LlamaConfig config{};
  models::LlamaWeights weights{};
  bool tied_classifier = false;
};

// Which part of a checkpoint a loader reads: all of it (world_size 1), or rank `rank`'s shard of
// a model split over world_size ranks, as models::llama_shard cuts it.
struct Shard {
  int64_t rank = 0;
  int64_t world_size = 1;
};

// Loads a Hugging Face Llama checkpoint folder into weights of `options` (dtype, device).
// Every file must lie inside the folder (a shard that is a link to elsewhere is refused), and the
// JSON and headers are bounded by `limits`. With shard.world_size > 1 the weights are rank
// shard.rank's shard (models::llama_shard's layout; the config stays the whole model's), and only
// the shard's bytes of the split tensors are read: rows of q, k, v, gate and up, each row's slice
// of o and down.
// Throws FormatError naming the file for anything missing, malformed or of the wrong shape;
// std::invalid_argument for a shard out of range or a model that does not divide over it.
inline HfLlamaCheckpoint load_hf_llama(const std::filesystem::path& folder,
                                       const at::TensorOptions& options = at::kFloat, const LoadLimits& limits = {},
                                       const Shard& shard = {}) {
  HfLlamaCheckpoint checkpoint;
  std::tie(checkpoint.config, checkpoint.tied_classifier) = load_hf_llama_config(folder / "config.json", limits);
  const models::LlamaConfig& c = checkpoint.config;
  check_tensor_parallel(c, shard.world_size);
  if (shard.rank < 0 || shard.rank >= shard.world_size) {
    specdec::detail::throw_invalid_message("Shard::rank must be in [0, world_size = ", shard.world_size, "), got ",
                                           shard.rank);
  }
  const bool sharded = shard.world_size > 1;

  // The shard files: one model.safetensors or those of the index.
  std::set<std::string> files;
  const auto index_path = folder / "model.safetensors.index.json";
  if (std::filesystem::exists(folder / "model.safetensors")) {
    files.insert("model.safetensors");
  } else if (std::filesystem::exists(index_path)) {
    const nlohmann::json index = detail::read_json(index_path, limits);
    if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
      detail::throw_format(index_path, "needs an object 'weight_map'");
    }
    for (const auto& [name, file] : index["weight_map"].items()) {
      const std::string shard = file.is_string() ? file.get<std::string>() : std::string();
      if (shard.empty() || shard.find('/') != std::string::npos || shard.find('\\') != std::string::npos ||
          shard.find('\0') != std::string::npos || shard == "." || shard == "..") {
        detail::throw_format(index_path, "tensor '", detail::printable(name), "' maps to an invalid file name ",
                             detail::excerpt(file));
      }
      files.insert(shard);
    }
  } else {
    detail::throw_format(folder, "has neither model.safetensors nor model.safetensors.index.json");
  }
  // Whole: every tensor read now. Sharded: only the headers now, each tensor's part when taken.
  std::map<std::string, std::pair<at::Tensor, std::filesystem::path>> tensors;
  struct Stored {
    SafetensorsEntry entry;
    std::filesystem::path file;
    uint64_t data_start = 0;
  };
  std::map<std::string, Stored> stored;
  for (const auto& file : files) {
    detail::require_inside(folder, folder / file);
    if (sharded) {
      const SafetensorsHeader header = parse_safetensors(folder / file, limits);
      for (const SafetensorsEntry& entry : header.entries) stored[entry.name] = {entry, folder / file, header.data_start};
      continue;
    }
    for (auto& [name, tensor] : load_safetensors(folder / file, limits).tensors) {
      tensors[name] = {std::move(tensor), folder / file};
    }
  }
  // The shard's part of a stored tensor of the whole model's `shape`: equal parts along `split`
  // (0: rows, 1: each row's columns; -1: all of it), part shard.rank, read from the file.
  const auto read_part = [&](const Stored& s, const std::string& name, at::IntArrayRef shape, int split) {
    const at::ScalarType type = detail::safetensors_type(s.entry.dtype);
    const uint64_t element = c10::elementSize(type);
    const std::string what = "tensor '" + detail::printable(name) + "'";
    detail::BinaryReader reader(s.file);
    const uint64_t start = s.data_start + s.entry.begin;
    if (split < 0) {
      reader.seek(start);
      return detail::read_tensor(reader, shape, type, what);
    }
    const int64_t rows = shape[0], columns = shape.size() > 1 ? shape[1] : 1;
    if (split == 0) {
      const int64_t part = rows / shard.world_size;
      reader.seek(start + static_cast<uint64_t>(shard.rank * part * columns) * element);
      std::vector<int64_t> sizes(shape.begin(), shape.end());
      sizes[0] = part;
      return detail::read_tensor(reader, sizes, type, what);
    }
    const int64_t part = columns / shard.world_size;
    at::Tensor out = at::empty({rows, part}, at::TensorOptions().dtype(type));
    auto* bytes = static_cast<char*>(out.data_ptr());
    for (int64_t row = 0; row < rows; ++row) {
      reader.seek(start + static_cast<uint64_t>(row * columns + shard.rank * part) * element);
      reader.read_bytes(bytes + static_cast<uint64_t>(row * part) * element, static_cast<uint64_t>(part) * element, what);
    }
    return out;
  };
  const auto take = [&](const std::string& name, std::vector<int64_t> shape, int split = -1) {
    at::IntArrayRef sizes;
    at::ScalarType type = at::kFloat;
    std::filesystem::path file;
    if (sharded) {
      const auto it = stored.find(name);
      if (it == stored.end()) detail::throw_format(folder, "tensor '", name, "' is missing");
      sizes = it->second.entry.shape;
      type = detail::safetensors_type(it->second.entry.dtype);
      file = it->second.file;
    } else {
      const auto it = tensors.find(name);
      if (it == tensors.end()) detail::throw_format(folder, "tensor '", name, "' is missing");
      sizes = it->second.first.sizes();
      type = it->second.first.scalar_type();
      file = it->second.second;
    }
    if (!sizes.equals(shape)) {
      detail::throw_format(file, "tensor '", name, "' has shape ", sizes, ", expected ", at::IntArrayRef(shape));
    }
    if (!at::isFloatingType(type)) detail::throw_format(file, "tensor '", name, "' is not floating point");
    if (!sharded) return tensors.find(name)->second.first.to(options);
    return read_part(stored.find(name)->second, name, shape, split).to(options);
  };
  // Heads of q and k per rank, for the rotary permutation (within each head, so per slice alike).
  const int64_t heads = c.n_heads / shard.world_size, kv_heads = c.n_kv_heads / shard.world_size;
  models::LlamaWeights& w = checkpoint.weights;
  w.token_embedding = take("model.embed_tokens.weight", {c.vocab_size, c.dim});
  for (int64_t i = 0; i < c.n_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    w.layers.push_back(models::LlamaLayerWeights{
        take(p + "input_layernorm.weight", {c.dim}),
        detail::unpermute_rotary(take(p + "self_attn.q_proj.weight", {c.dim, c.dim}, 0), heads),
        detail::unpermute_rotary(take(p + "self_attn.k_proj.weight", {c.kv_dim(), c.dim}, 0), kv_heads),
        take(p + "self_attn.v_proj.weight", {c.kv_dim(), c.dim}, 0),
        take(p + "self_attn.o_proj.weight", {c.dim, c.dim}, 1),
        take(p + "post_attention_layernorm.weight", {c.dim}),
        take(p + "mlp.gate_proj.weight", {c.hidden_dim, c.dim}, 0),
        take(p + "mlp.down_proj.weight", {c.dim, c.hidden_dim}, 1),
        take(p + "mlp.up_proj.weight", {c.hidden_dim, c.dim}, 0)});
    models::LlamaLayerWeights& layer = w.layers.back();
    if (c.qkv_bias) {
      layer.bq = detail::unpermute_rotary_bias(take(p + "self_attn.q_proj.bias", {c.dim}, 0), heads);
      layer.bk = detail::unpermute_rotary_bias(take(p + "self_attn.k_proj.bias", {c.kv_dim()}, 0), kv_heads);
      layer.bv = take(p + "self_attn.v_proj.bias", {c.kv_dim()}, 0);
    }
    if (c.o_bias) layer.bo = take(p + "self_attn.o_proj.bias", {c.dim});
  }
  w.norm = take("model.norm.weight", {c.dim});
  w.output = checkpoint.tied_classifier && !tensors.count("lm_head.weight") && !stored.count("lm_head.weight")
                 ? w.token_embedding
                 : take("lm_head.weight", {c.vocab_size, c.dim});
  return checkpoint;
}

// Writes config.json and model.safetensors for `weights` stored as `storage` (fp32, fp16, bf16).
// The classifier is written as tied when weights.output is the token embedding tensor itself.
// `extra_config` entries (bos_token_id, eos_token_id, ...) are added to config.json.
inline void save_hf_llama(const std::filesystem::path& folder, const models::LlamaConfig& c,
                          const models::LlamaWeights& w, at::ScalarType storage = at::kFloat,
                          const nlohmann::json& extra_config = nlohmann::json::object(),
                          const std::map<std::string, std::string>& metadata = {}) {
  c.validate();
  std::filesystem::create_directories(folder);
  const bool tied = w.output.is_same(w.token_embedding);
  const auto stored = [&](const at::Tensor& t) { return t.detach().to(at::kCPU, storage).contiguous(); };
  std::map<std::string, at::Tensor> tensors;
  tensors["model.embed_tokens.weight"] = stored(w.token_embedding);
  for (size_t i = 0; i < w.layers.size(); ++i) {
    const auto& l = w.layers[i];
    const std::string p = "model.layers." + std::to_string(i) + ".";
    tensors[p + "input_layernorm.weight"] = stored(l.attention_norm);
    tensors[p + "self_attn.q_proj.weight"] = stored(detail::permute_rotary(l.wq, c.n_heads));
    tensors[p + "self_attn.k_proj.weight"] = stored(detail::permute_rotary(l.wk, c.n_kv_heads));
    tensors[p + "self_attn.v_proj.weight"] = stored(l.wv);
    tensors[p + "self_attn.o_proj.weight"] = stored(l.wo);
    tensors[p + "post_attention_layernorm.weight"] = stored(l.ffn_norm);
    tensors[p + "mlp.gate_proj.weight"] = stored(l.w1);
    tensors[p + "mlp.down_proj.weight"] = stored(l.w2);
    tensors[p + "mlp.up_proj.weight"] = stored(l.w3);
    if (c.qkv_bias) {
      tensors[p + "self_attn.q_proj.bias"] = stored(detail::permute_rotary_bias(l.bq, c.n_heads));
      tensors[p + "self_attn.k_proj.bias"] = stored(detail::permute_rotary_bias(l.bk, c.n_kv_heads));
      tensors[p + "self_attn.v_proj.bias"] = stored(l.bv);
    }
    if (c.o_bias) tensors[p + "self_attn.o_proj.bias"] = stored(l.bo);
  }
  tensors["model.norm.weight"] = stored(w.norm);
  if (!tied) tensors["lm_head.weight"] = stored(w.output);
  auto meta = metadata;
  meta.emplace("format", "pt");
  save_safetensors(folder / "model.safetensors", tensors, meta);

  // The family whose layout the config has: q, k, v biases alone are Qwen2's; a sliding window
  // Mistral's; anything else Llama's (attention_bias for biases on q, k, v and o together).
  if (c.o_bias && !c.qkv_bias) {
    throw std::invalid_argument("save_hf_llama: an o_proj bias without q, k, v biases has no Hugging Face family");
  }
  const bool qwen2 = c.qkv_bias && !c.o_bias;
  if (qwen2 && c.sliding_window > 0) {
    throw std::invalid_argument("save_hf_llama: q, k, v biases with a sliding window have no Hugging Face family");
  }
  const std::string model_type = qwen2 ? "qwen2" : c.sliding_window > 0 ? "mistral" : "llama";
  nlohmann::json config = {
      {"architectures", {hf_architecture(model_type)}},
      {"model_type", model_type},
      {"hidden_size", c.dim},
      {"intermediate_size", c.hidden_dim},
      {"num_hidden_layers", c.n_layers},
      {"num_attention_heads", c.n_heads},
      {"num_key_value_heads", c.n_kv_heads},
      {"vocab_size", c.vocab_size},
      {"max_position_embeddings", c.max_seq_len},
      {"rope_theta", c.rope_theta},
      {"rms_norm_eps", c.norm_eps},
      {"hidden_act", "silu"},
      {"tie_word_embeddings", tied},
      {"torch_dtype", storage == at::kHalf ? "float16" : storage == at::kBFloat16 ? "bfloat16" : "float32"}};
  if (model_type == "llama") config["attention_bias"] = c.qkv_bias;
  if (model_type == "mistral") config["sliding_window"] = c.sliding_window;
  const models::RopeScaling& r = c.rope_scaling;
  if (r.type == models::RopeScaling::Type::linear) {
    config["rope_scaling"] = {{"rope_type", "linear"}, {"factor", r.factor}};
  } else if (r.type == models::RopeScaling::Type::llama3) {
    config["rope_scaling"] = {{"rope_type", "llama3"},
                              {"factor", r.factor},
                              {"low_freq_factor", r.low_freq_factor},
                              {"high_freq_factor", r.high_freq_factor},
                              {"original_max_position_embeddings", r.original_max_position_embeddings}};
  }
  config.update(extra_config);
  detail::write_atomically(folder / "config.json", [&](std::ofstream& out) { out << config.dump(2) << "\n"; });
}

}  // namespace specdec::io
