#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU whose python3 holds a CUDA build of PyTorch and
# transformers (no network needed). In about 10 minutes it:
#   1. builds specdec's unit tests and specdec_gpu_bench against that PyTorch
#      (python3 -c 'import torch; print(torch.utils.cmake_prefix_path)'), with the libraries of
#      .gpu-deps (scripts/gpu-deps.sh) where the machine lacks them;
#   2. runs every CUDA test;
#   3. benchmarks a 1.1B-parameter random-weight Llama in bfloat16 (scripts/gpu_check.py) with a
#      self-drafter (its first two layers) and a small separate drafter: autoregressive against
#      speculative decoding, eager and with CUDA graphs, in one run of alternated rounds; then
#      transformers' greedy and assisted generation (assistant_model=) on the same weights;
#   4. runs the NCCL test (one rank in an NCCL group on the GPU, TensorParallelNccl in
#      tests/test_parallel.cpp), then the whole unit suite in shards of one thread each, each
#      shard stopped after SUITE_SECONDS (default 240);
#   5. prints one table: tokens/s, speedup, acceptance, tokens per target call, device-to-host
#      copies per step, the cost model's speedup, and whether the greedy tokens equal
#      transformers', with the tests' summary (a crashed or stopped shard names its last test).
# The unit suite reads ../shared/models and ../shared/tokenizers, or SPECDEC_MODELS_DIR and
# SPECDEC_TOKENIZERS_DIR (with the device tool: copy them into an ignored folder that travels).
# Usage: scripts/gpu-check.sh   (PYTHON=... to use another interpreter; SPECDEC_GPU_BUILD for the
# build folder, default build-gpu; ROUNDS, GAMMA, NEW_TOKENS for the benchmark, SUITE_SECONDS)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
build="${SPECDEC_GPU_BUILD:-$root/build-gpu}"
work="$build/check"
deps="${SPECDEC_GPU_DEPS:-$root/.gpu-deps}"
jobs="$(nproc)"
rounds="${ROUNDS:-3}" gamma="${GAMMA:-4}" new_tokens="${NEW_TOKENS:-128}"
suite_seconds="${SUITE_SECONDS:-240}"
start=$SECONDS
stage() { echo "== gpu-check [$((SECONDS - start)) s]: $*"; }

"$python" -c 'import torch, transformers
assert torch.version.cuda, "this PyTorch was built without CUDA"
assert torch.cuda.is_available(), "no CUDA device is visible"
print("gpu-check:", torch.cuda.get_device_name(0), "| torch", torch.__version__, "| transformers", transformers.__version__)'

generator=()
if command -v ninja > /dev/null; then generator=(-G Ninja); fi
if [ -d "$deps" ]; then
  stage "googletest from $deps"
  if [ ! -d "$build/deps" ]; then
    cmake -S "$deps/googletest" -B "$build/googletest" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_INSTALL_PREFIX="$build/deps" -DBUILD_GMOCK=OFF > /dev/null
    cmake --build "$build/googletest" -j "$jobs" > /dev/null
    cmake --install "$build/googletest" > /dev/null
  fi
  export CMAKE_PREFIX_PATH="$build/deps:$deps${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  export CMAKE_INCLUDE_PATH="$deps/include" CMAKE_LIBRARY_PATH="$deps/lib"
  export LD_LIBRARY_PATH="$deps/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

stage "configure and build against the machine's PyTorch"
mapfile -t torch_args < <("$root/scripts/torch-cmake-args.sh" "$python")
arch="$("$python" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability(0))')"
# nccl.h: the CUDA toolkit's where installed, else the one of PyTorch's nvidia-nccl package.
nccl_include="$("$python" -c 'import os, nvidia.nccl as n
for p in n.__path__:
    if os.path.exists(os.path.join(p, "include", "nccl.h")): print(os.path.join(p, "include")); break' 2>/dev/null || true)"
if [ -n "$nccl_include" ] && [ ! -f /usr/local/cuda/include/nccl.h ]; then
  torch_args+=("-DSPECDEC_NCCL_INCLUDE_DIR=$nccl_include")
fi
cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release "${torch_args[@]}" \
  -DTORCH_CUDA_ARCH_LIST="$arch" -DSPECDEC_BUILD_TESTS=ON -DSPECDEC_BUILD_EXAMPLES=OFF \
  -DSPECDEC_BUILD_GPU_BENCH=ON -DSPECDEC_BUILD_REMOTE=OFF > "$build.configure.log" 2>&1 \
  || { cat "$build.configure.log"; exit 1; }
cmake --build "$build" -j "$jobs" --target specdec_tests specdec_gpu_bench

stage "CUDA tests"
mkdir -p "$work"
cuda_filter='*Cuda*:*CUDA*:*OnDevice*:CudaGraph.*:StaticChain.*:*StaticForward*'
"$build/tests/specdec_tests" --gtest_filter="$cuda_filter" 2>&1 | tee "$work/cuda-tests.log" | grep -E '^\[ +(OK|FAILED|SKIPPED) ' || true
passed=$(grep -c '^\[       OK \]' "$work/cuda-tests.log" || true)
failed=$(grep -c '^\[  FAILED  \].*(' "$work/cuda-tests.log" || true)
skipped=$(grep -c '^\[  SKIPPED \].*(' "$work/cuda-tests.log" || true)
echo "$passed passed, $failed failed, $skipped skipped (filter $cuda_filter)" > "$work/cuda-tests.txt"

stage "models (scripts/gpu_check.py make)"
if [ ! -f "$work/models/prompt.json" ]; then "$python" "$root/scripts/gpu_check.py" make "$work/models"; fi
stage "specdec_gpu_bench"
"$build/benchmarks/specdec_gpu_bench" --models "$work/models" --device cuda --dtype bfloat16 --gamma "$gamma" \
  --max-new-tokens "$new_tokens" --rounds "$rounds" --json "$work/models/specdec.json"
stage "transformers"
"$python" "$root/scripts/gpu_check.py" transformers "$work/models" --device cuda --dtype bfloat16 \
  --gamma "$gamma" --max-new-tokens "$new_tokens" --rounds "$rounds"
stage "NCCL: one rank in an NCCL group on the GPU"
nccl=0
grep -E "tensor parallelism over|Gloo headers" "$build.configure.log" || true
if cmake --build "$build" -j "$jobs" --target specdec_parallel_tests specdec_parallel_worker > "$work/nccl-build.log" 2>&1; then
  "$build/tests/specdec_parallel_tests" --gtest_filter='TensorParallelNccl.*' > "$work/nccl.log" 2>&1 || nccl=1
  grep -E '^\[ +(OK|FAILED|SKIPPED) |skipped' "$work/nccl.log" || true
  if [ "$nccl" -ne 0 ]; then
    echo "nccl: FAILED (see below)" >> "$work/cuda-tests.txt"
    tail -n 30 "$work/nccl.log"
  elif grep -q '^\[  SKIPPED \]' "$work/nccl.log"; then
    echo "nccl: skipped: $(grep -m1 'skipped:' "$work/nccl.log" || echo 'see nccl.log')" >> "$work/cuda-tests.txt"
  else
    echo "nccl: one rank over NCCL equals the GPU without a group (speculative, batch)" >> "$work/cuda-tests.txt"
  fi
else
  nccl=1
  echo "nccl: FAILED: the tensor-parallel tests did not build (nccl-build.log)" >> "$work/cuda-tests.txt"
  tail -n 30 "$work/nccl-build.log"
fi

stage "the whole unit suite, $jobs shards of one thread each, at most $suite_seconds s"
# One intra-op thread per shard, as CTest runs them (tests/CMakeLists.txt): sixteen shards of sixteen
# threads each would share 16 cores. Full logs, so a crash names the test it was in.
pids=()
for ((i = 0; i < jobs; i++)); do
  OMP_NUM_THREADS=1 GTEST_TOTAL_SHARDS="$jobs" GTEST_SHARD_INDEX="$i" timeout "$suite_seconds" \
    "$build/tests/specdec_tests" > "$work/shard$i.log" 2>&1 &
  pids+=("$!")
done
suite=0
for ((i = 0; i < jobs; i++)); do
  status=0
  wait "${pids[$i]}" || status=$?
  if [ "$status" -ne 0 ]; then
    suite=1
    last="$(grep -E '^\[ RUN      \]' "$work/shard$i.log" | tail -n 1 | sed 's/^\[ RUN      \] //')"
    if [ "$status" -eq 124 ]; then why="still running after $suite_seconds s"; else why="exit status $status"; fi
    echo "unit suite shard $i: $why, in ${last:-no test}" | tee -a "$work/cuda-tests.txt"
    grep -E '^\[  FAILED  \].*\(' "$work/shard$i.log" || tail -n 20 "$work/shard$i.log"
  fi
done
echo "unit suite: $(cat "$work"/shard*.log | grep -c '^\[  FAILED  \].*(' || true) failed, \
$(cat "$work"/shard*.log | grep -c '^\[       OK \]' || true) passed of \
$(cat "$work"/shard*.log | grep -oE '^\[==========\] Running [0-9]+ tests' | awk '{s += $3} END {print s}') tests" \
  >> "$work/cuda-tests.txt"

stage "summary"
table=0
"$python" "$root/scripts/gpu_check.py" table "$work/models" --checks "$work/cuda-tests.txt" || table=1
if [ -n "${OUT:-}" ]; then cp "$work/models/specdec.json" "$work/models/transformers.json" "$work/cuda-tests.log" "$OUT/"; fi
if [ "$failed" -ne 0 ] || [ "$suite" -ne 0 ] || [ "$nccl" -ne 0 ] || [ "$table" -ne 0 ]; then echo "gpu-check: tests failed" >&2; exit 1; fi
