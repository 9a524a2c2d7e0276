#!/usr/bin/env bash
# specdec beside llama.cpp on this CPU, on a target larger than its caches: stories260K widened to
# TinyLlama-1.1B's shape (../shared/benchmarks/widen_llama2c.py: 1.04B parameters, 4.16 GB in
# fp32, the same greedy output as stories260K) with llama2xs as drafter, the same models in both
# (converted to GGUF for llama.cpp), the same precisions (fp32, bf16, 8-bit weights), threads and
# prompt, greedy. Both sides run alternately, ROUNDS times; the table takes each figure's best.
# Then autoregressive decoding runs PAIRS more times in pairs, one precision at a time, specdec and
# llama.cpp back to back (the order reversed every other pair): the memory's speed on a shared
# machine drifts within minutes, and a ratio within a pair is steadier than one across a round.
# Not run in CI: it downloads llama.cpp's source, builds it, and writes about 12 GB of models.
#
#   scripts/bench-llamacpp.sh                 (ROUNDS=2 PAIRS=4 THREADS=2 TOKENS=64)
#   ROUNDS=0 PAIRS=6 scripts/bench-llamacpp.sh   (the pairs alone: about 2 minutes a pair)
#
# Cache folder (made once, reused): $SPECDEC_BENCH_CACHE, default ~/.cache/specdec/bench. llama.cpp
# is the one that llama-cpp-python 0.3.36's source distribution vendors (vendor/llama.cpp), built
# for this CPU; its llama2.c converter's 2 GB context pool (mem_model_gb) is raised to 8 in the
# build tree, since the target is 4 GB. The 8-bit rows also run a random-weight model of a real
# shape (TinyLlama's: head size 64, 32 heads, 4 key/value heads) autoregressively on both sides,
# because llama.cpp's Q8_0 kernels are shaped for head sizes the widened model (8) does not have.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
shared="${SPECDEC_SHARED_DIR:-$root/../shared}"
cache="${SPECDEC_BENCH_CACHE:-$HOME/.cache/specdec/bench}"
rounds="${ROUNDS:-2}"
pairs="${PAIRS:-4}"
threads="${THREADS:-2}"
tokens="${TOKENS:-64}"
llama_version=0.3.36
numpy_version=2.4.6
mkdir -p "$cache"
"$root/scripts/install-deps.sh"

# Python with numpy, for the widening script and the random model.
if [ ! -x "$cache/venv/bin/python" ]; then
  python3 -m venv "$cache/venv" || { apt-get install -y python3-venv >/dev/null && python3 -m venv "$cache/venv"; }
fi
"$cache/venv/bin/python" -c "import numpy" 2>/dev/null || "$cache/venv/bin/pip" install -q "numpy==$numpy_version"
py="$cache/venv/bin/python"

target="$cache/w1b.bin"
drafter="$shared/models/llama2xs/model.bin"
tokenizer="$shared/models/stories260K/tok512.bin"
if [ ! -f "$target" ]; then
  echo "making the widened target (4.16 GB) in $cache"
  "$py" "$shared/benchmarks/widen_llama2c.py" "$shared/models/stories260K/stories260K.bin" "$target.part" 2048 22 5632
  mv "$target.part" "$target"
fi
random64="$cache/random64.bin"
if [ ! -f "$random64" ]; then
  echo "making the random-weight model of TinyLlama's shape (head size 64) in $cache"
  "$py" "$root/scripts/random_llama2c.py" "$random64.part" 2048 22 32 4 5632 512 256
  mv "$random64.part" "$random64"
fi

# llama.cpp from the llama-cpp-python source distribution.
src="$cache/llama_cpp_python-$llama_version/vendor/llama.cpp"
bin="$src/build/bin"
if [ ! -x "$bin/llama-speculative-simple" ] || [ ! -x "$bin/llama-convert-llama2c-to-ggml" ]; then
  echo "building llama.cpp from llama-cpp-python $llama_version's source distribution"
  "$cache/venv/bin/pip" download -q --no-deps --no-binary :all: "llama-cpp-python==$llama_version" -d "$cache"
  tar -xzf "$cache/llama_cpp_python-$llama_version.tar.gz" -C "$cache"
  sed -i 's/params.mem_model_gb    = 2;/params.mem_model_gb    = 8;/' \
    "$src/examples/convert-llama2c-to-ggml/convert-llama2c-to-ggml.cpp"
  cmake -S "$src" -B "$src/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF >/dev/null
  cmake --build "$src/build" --target llama-bench llama-speculative-simple llama-quantize \
    llama-convert-llama2c-to-ggml >/dev/null
fi
gguf() {  # llama2.c checkpoint, GGUF base name: writes NAME-f32, NAME-BF16 and NAME-Q8_0.gguf
  [ -f "$cache/$2-f32.gguf" ] || "$bin/llama-convert-llama2c-to-ggml" --copy-vocab-from-model "$tokenizer" \
    --llama2c-model "$1" --llama2c-output-model "$cache/$2-f32.gguf" >/dev/null 2>&1
  for type in BF16 Q8_0; do
    [ -f "$cache/$2-$type.gguf" ] || "$bin/llama-quantize" "$cache/$2-f32.gguf" "$cache/$2-$type.gguf" "$type" \
      "$threads" >/dev/null 2>&1
  done
}
gguf "$target" w1b
gguf "$drafter" llama2xs
gguf "$random64" random64

# specdec's side.
cmake -S "$root" -B "$root/build-bench" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSPECDEC_BUILD_BENCHMARKS=ON >/dev/null
cmake --build "$root/build-bench" --target bench_cpu_target >/dev/null

out="$cache/results"
rm -rf "$out" && mkdir -p "$out"
prompt="Once upon a time, there was a"
for round in $(seq "$rounds"); do
  echo "round $round of $rounds: specdec"
  for model in "$target" "$random64"; do
    name=$(basename "$model" .bin)
    filter='BM_Floor|BM_Ceiling|BM_Forward|BM_Generate'
    [ "$name" = random64 ] && filter='BM_Forward/[0-3]/1/|BM_Generate/[0-3]/0/'
    SPECDEC_BENCH_TARGET="$model" SPECDEC_BENCH_DRAFTER="$drafter" "$root/build-bench/benchmarks/bench_cpu_target" \
      --threads "$threads" --benchmark_filter="$filter" --benchmark_format=json \
      --benchmark_out="$out/specdec-$name-$round.json" >/dev/null 2>"$out/specdec-$name-$round.log"
  done
  echo "round $round of $rounds: llama.cpp"
  for type in f32 BF16 Q8_0; do
    "$bin/llama-bench" -m "$cache/w1b-$type.gguf" -p 1,2,3,4,5,6,7,8,9 -n "$tokens" -t "$threads" -r 3 -o json \
      >"$out/llamabench-w1b-$type-$round.json" 2>/dev/null
    "$bin/llama-bench" -m "$cache/random64-$type.gguf" -p 1 -n "$tokens" -t "$threads" -r 3 -o json \
      >"$out/llamabench-random64-$type-$round.json" 2>/dev/null
    for n in 1 2 3 4 5 6 8; do
      log="$out/speculative-$type-$n-$round.log"
      "$bin/llama-speculative-simple" -m "$cache/w1b-$type.gguf" -md "$cache/llama2xs-$type.gguf" --spec-type draft-simple \
        -p "$prompt" -n "$tokens" --spec-draft-n-max "$n" --spec-draft-n-min 0 -t "$threads" -td "$threads" --temp 0 \
        -c 512 >"$log" 2>&1 || echo "exit $?" >>"$log"
    done
  done
done
# Autoregressive decoding in alternated pairs (see the top of this file).
for pair in $(seq "$pairs"); do
  echo "pair $pair of $pairs: autoregressive decoding, both sides, each precision"
  for format in "1 f32" "2 BF16" "3 Q8_0"; do
    read -r id type <<<"$format"
    specdec_side() {
      SPECDEC_BENCH_TARGET="$target" SPECDEC_BENCH_DRAFTER="$drafter" "$root/build-bench/benchmarks/bench_cpu_target" \
        --threads "$threads" --benchmark_filter="BM_Generate/$id/0/" --benchmark_format=json \
        --benchmark_out="$out/pair-specdec-$type-$pair.json" >/dev/null 2>"$out/pair-specdec-$type-$pair.log"
    }
    llama_side() {
      "$bin/llama-bench" -m "$cache/w1b-$type.gguf" -p 0 -n "$tokens" -t "$threads" -r 1 -o json \
        >"$out/pair-llamabench-$type-$pair.json" 2>/dev/null
    }
    if ((pair % 2)); then specdec_side && llama_side; else llama_side && specdec_side; fi
  done
done
"$py" "$root/scripts/bench_llamacpp_table.py" "$out" "$threads"
