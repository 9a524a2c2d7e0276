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

# Seeds: the first byte picks the parser (0 llama2.c, 1 tokenizer, 2 safetensors, 3 config.json).
corpus="$(mktemp -d)"
trap 'rm -rf "$corpus"' EXIT
printf '\003{"hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 512, "max_position_embeddings": 256, "rope_theta": 10000.0, "tie_word_embeddings": true}' > "$corpus/config"
header='{"t": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}, "__metadata__": {"format": "pt"}}'
{ printf '\002'; printf "$(printf '\\x%02x' ${#header})\\0\\0\\0\\0\\0\\0\\0"; printf '%s' "$header"; head -c 16 /dev/zero; } > "$corpus/safetensors"
if [ -f "$models/stories260K/tok512.bin" ]; then
  { printf '\001'; cat "$models/stories260K/tok512.bin"; } > "$corpus/tokenizer"
  { printf '\000'; head -c 4096 "$models/stories260K/stories260K.bin"; } > "$corpus/llama2c"
fi
ASAN_OPTIONS=detect_leaks=1 "$root/build-fuzz/fuzz/fuzz_loaders" -max_total_time="$seconds" \
  -max_len=65536 -timeout=10 -print_final_stats=1 "$corpus" 2>&1 | tail -n 12
