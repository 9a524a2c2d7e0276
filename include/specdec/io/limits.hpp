// The bounds the loaders put on what an untrusted file may make them allocate or compute. Every
// size a file declares is checked against the file's own size where the format implies one; the
// sizes no file implies (a context length, a vocabulary, a JSON document's depth) are checked
// against these limits before anything is allocated. Raise a limit for a model that needs more:
// the error names the field, its value and the limit to raise. Plain C++.
#pragma once

#include <cstdint>

namespace specdec::io {

struct LoadLimits {
  // The longest context a model may declare (llama2.c seq_len, config.json
  // max_position_embeddings). The rotary tables and a StaticKVCache grow with it. 131072 is the
  // context of Llama 3.1 and 3.2.
  int64_t max_sequence_length = 131072;
  // The largest vocabulary (Llama 3: 128256, Qwen2: 151936).
  int64_t max_vocab_size = int64_t{1} << 20;
  // The largest model width, feed-forward width, layer and head counts a config.json may declare.
  int64_t max_dimension = int64_t{1} << 20;
  // The largest JSON file (config.json, model.safetensors.index.json) and safetensors header.
  uint64_t max_json_bytes = uint64_t{64} << 20;
  uint64_t max_safetensors_header = uint64_t{100} << 20;  // as the reference reader
  // The deepest nesting of arrays and objects in any JSON document (real ones nest 3 or 4 deep).
  int max_json_depth = 32;
  // The most entries in one JSON object or array (tensors of a safetensors header, the
  // weight_map of an index).
  uint64_t max_json_entries = uint64_t{1} << 16;
};

}  // namespace specdec::io
