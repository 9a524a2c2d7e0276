#!/usr/bin/env bash
# Builds the libFuzzer target of the checkpoint/tokenizer parsers with clang and runs it for a
# bounded time (default 60 s) from a small seed corpus. Usage: scripts/run-fuzz.sh [seconds]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
seconds="${1:-60}"
models="${SPECDEC_MODELS_DIR:-$root/../shared/models}"

CC=clang CXX=clang++ cmake -S "$root" -B "$root/build-fuzz" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DSPECDEC_BUILD_TESTS=OFF -DSPECDEC_BUILD_EXAMPLES=OFF -DSPECDEC_BUILD_FUZZERS=ON > /dev/null
cmake --build "$root/build-fuzz" --target fuzz_loaders

# Seeds: the first byte picks the parser (0 llama2.c, 1 tokenizer, 2 safetensors, 3 config.json,
# 4 n-gram storage, 5 one-level n-gram storage, 6 STAND memory, 7 text to encode, 8 JSON,
# 9 tokenizer.json, 10 text for a tokenizer.json).
corpus="$(mktemp -d)"
trap 'rm -rf "$corpus"' EXIT
printf '\003{"hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 512, "max_position_embeddings": 256, "rope_theta": 10000.0, "tie_word_embeddings": true}' > "$corpus/config"
header='{"t": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}, "__metadata__": {"format": "pt"}}'
{ printf '\002'; printf "$(printf '\\x%02x' ${#header})\\0\\0\\0\\0\\0\\0\\0"; printf '%s' "$header"; head -c 16 /dev/zero; } > "$corpus/safetensors"
# A config with 6,000 levels of nesting (12 KB): refused while parsing, never serialized.
{ printf '\003{"hidden_size": '; head -c 6000 /dev/zero | tr '\0' '['; head -c 6000 /dev/zero | tr '\0' ']'; printf '}'; } > "$corpus/deep_config"
{ printf '\010'; head -c 6000 /dev/zero | tr '\0' '{' | sed 's/{/{"a":/g'; printf '1'; head -c 6000 /dev/zero | tr '\0' '}'; } > "$corpus/deep_json"
# Empty storages (header only): magic, version 1, kind, n = 3, reserved, vocab 256, no entries.
u32() { printf "$(printf '\\x%02x\\x%02x\\x%02x\\x%02x' $(($1 & 255)) $(($1 >> 8 & 255)) $(($1 >> 16 & 255)) $(($1 >> 24 & 255)))"; }
u64() { u32 "$1"; u32 0; }
{ printf '\004SDNGRAM\0'; u32 1; u32 2; u32 3; u32 0; u64 256; u64 0; u64 0; } > "$corpus/ngram"
{ printf '\005SDNGRAM\0'; u32 1; u32 1; u32 3; u32 0; u64 256; u64 0; u64 0; } > "$corpus/one_level"
{ printf '\006SDPNGRAM'; u32 1; u32 3; u64 256; u64 0; } > "$corpus/memory"
printf '\007def f(x):\n    return x * 2  # caf\xc3\xa9 \xe2\x9c\x93 \xff' > "$corpus/text"
{ printf '\011'; cat "$root/tests/data/byte_tokenizer/tokenizer.json"; } > "$corpus/tokenizer_json"
printf '\012Hello,  world!\n\tcaf\xc3\xa9 \xf0\x9f\xa4\x96 12345' > "$corpus/hf_text"
# Inputs that once found a bug (fuzz/regressions) stay in the corpus.
cp "$root"/fuzz/regressions/* "$corpus/"
if [ -f "$models/stories260K/tok512.bin" ]; then
  { printf '\001'; cat "$models/stories260K/tok512.bin"; } > "$corpus/tokenizer"
  { printf '\000'; head -c 4096 "$models/stories260K/stories260K.bin"; } > "$corpus/llama2c"
fi
ASAN_OPTIONS=detect_leaks=1 "$root/build-fuzz/fuzz/fuzz_loaders" -max_total_time="$seconds" \
  -max_len=65536 -timeout=10 -print_final_stats=1 "$corpus" 2>&1 | tail -n 12
