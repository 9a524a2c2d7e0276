#!/usr/bin/env bash
# Builds and runs every test, once for each libtorch specdec supports:
#
#  1. Debian's libtorch 1.13 (CPU): the unit tests under AddressSanitizer and
#     UndefinedBehaviorSanitizer, but the sampled-distribution ones (below); the packaging tests.
#  2. The loaders' parsers under libFuzzer (clang), for 60 s.
#  3. The PyTorch 2.x wheel pinned in scripts/python-requirements.txt (a CUDA build: every CUDA
#     path compiles and links; the tests that need a GPU skip, saying so), optimised at -O1: all
#     the unit tests, every public header on its own, every program and its command-line cases,
#     tensor parallelism's processes, the packaging tests, the checks against transformers and
#     tokenizers (label reference) and the GPU check's benchmark against transformers on the
#     CPU. The Google Benchmark programs and the trainers (tools/) are not built here: they were
#     thirteen minutes of this leg's build on 2 cores, and ran only as smoke runs.
#     scripts/bench-compare.sh and scripts/bench-llamacpp.sh build the benchmarks;
#     -DSPECDEC_BUILD_TOOLS=ON builds the trainers and their smoke cases.
#
# A cold run (nothing in ccache) on a 2-core machine without AVX-512 took 2 h 30 min when every
# leg built and ran everything; CI allows 90 minutes. So: the unit tests are two unity
# translation units (tests/CMakeLists.txt); the second leg builds at -O1 (its -O3 build alone
# took 50 minutes there; nothing it runs is timed); the sanitized leg builds only the unit tests
# (specdec-generate under the sanitizers cost 390 s of one core to compile its main file and 396 s
# to run its cases; the loaders and parsers it calls are unit-tested and fuzzed here),
# and leaves out the sampled-distribution tests (a chi-square over thousands of samples, and the
# check that it catches a slightly wrong sampler): they spend their time in libtorch's sampling,
# which is not instrumented, and were 90% of the sanitized unit tests' time (60 of 67 minutes of
# one core). Everything left out there runs in the second leg.
#
# The wheel's virtual environment (scripts/install-torch2.sh) is made in the background while the
# first leg builds. Each leg builds only what it runs; the unit tests run as shards (run_shards).
# Compilers run through ccache: a rerun in the same checkout compiles only what changed
# (precompiled headers included); a fresh machine compiles everything.
# Leak detection is off under the sanitizers: libtorch keeps process-lifetime allocations
# (operator registries, thread pools) that LeakSanitizer reports.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/install-deps.sh"

# The real checkpoints and tokenizer.json files beside the checkout (../shared).
export SPECDEC_MODELS_DIR="${SPECDEC_MODELS_DIR:-$root/../shared/models}"
export SPECDEC_TOKENIZERS_DIR="${SPECDEC_TOKENIZERS_DIR:-$root/../shared/tokenizers}"
jobs="$(nproc)"
# Tests run `jobs` processes at once, so each takes one thread: libtorch's OpenMP teams of one
# thread per core in every process would oversubscribe the cores, and their spinning barriers
# make the many small operations of the statistical tests several times slower.
export OMP_NUM_THREADS=1
launcher=()
if command -v ccache > /dev/null; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  # Paths relative to the checkout (another clone still misses where a definition names a path
  # of the checkout: the tests' and examples' data folders); the precompiled headers' defines
  # and timestamps do not split the cache.
  export CCACHE_BASEDIR="$root" CCACHE_NOHASHDIR=1 CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-12G}"
  export CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
fi
logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT

"$root/scripts/install-torch2.sh" > "$logs/install-torch2.log" 2>&1 &
install_torch2=$!

# Runs a gtest binary's tests as shards, `jobs` at once, each started as one ends: for each gtest
# filter given (no spaces), in order, the tests it selects as 2 x `jobs` shards. Prints each
# shard's summary, and a failing shard's whole output. gtest deals a filter's tests out to its shards in turn, so a
# few long tests can still fall in one shard; given first, under a filter of their own, they start
# first and the short ones fill in around them. (One shard a core over all the tests left a core
# idle for 4 of the 9 minutes of the second leg's unit tests.)
run_shards() {
  local binary="$1" status=0 f i count
  shift
  local filters=("$@")
  count=$((2 * jobs))
  for ((f = 0; f < ${#filters[@]}; f++)); do
    for ((i = 0; i < count; i++)); do echo "$f $i ${filters[$f]}"; done
  done | SHARD_BINARY="$binary" SHARD_TOTAL="$count" SHARD_LOGS="$logs" xargs -P "$jobs" -n 3 sh -c \
    'GTEST_FILTER="$3" GTEST_TOTAL_SHARDS="$SHARD_TOTAL" GTEST_SHARD_INDEX="$2" "$SHARD_BINARY" --gtest_brief=1 \
       > "$SHARD_LOGS/shard$1.$2.log" 2>&1
     echo "$?" > "$SHARD_LOGS/shard$1.$2.rc"' sh
  for ((f = 0; f < ${#filters[@]}; f++)); do
    for ((i = 0; i < count; i++)); do
      if [ "$(cat "$logs/shard$f.$i.rc" 2> /dev/null)" = 0 ]; then
        grep -E '^\[  (PASSED|SKIPPED) ' "$logs/shard$f.$i.log" | sed "s/^/shard $f.$i: /"
      else
        echo "shard $f.$i of $binary failed:"
        cat "$logs/shard$f.$i.log" 2> /dev/null || true
        status=1
      fi
    done
  done
  return "$status"
}

# ---- 1. libtorch 1.13 (Debian), sanitizers ----------------------------------------------------
cmake -S "$root" -B "$root/build-sanitize" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "${launcher[@]}" \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1" -DSPECDEC_SANITIZE=ON -DSPECDEC_REQUIRE_ONEDNN=ON -DSPECDEC_BUILD_TESTS=ON \
  -DSPECDEC_BUILD_EXAMPLES=ON -DSPECDEC_BUILD_BENCHMARKS=OFF -DSPECDEC_BUILD_TOOLS=OFF
# The unit tests: the library, its loaders and parsers, and the remote service's units
# (test_remote.cpp, test_admission.cpp). The programs, their command-line cases and examples and
# tensor parallelism's processes run in the second leg; the packaging tests build the quickstart
# against this libtorch.
cmake --build "$root/build-sanitize" -j "$jobs" --target specdec_tests
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
statistical='*Distribution.*:*HarnessHasPower:*OwnDistribution:*AsTheTarget:*WrongQFails:*FollowsTheResidual'
statistical+=':*SampledAndDeterministicDrafts:*IsTheQuantizedTarget'
run_shards "$root/build-sanitize/tests/specdec_tests" "-$statistical"
unset ASAN_OPTIONS UBSAN_OPTIONS
ctest --test-dir "$root/build-sanitize" -L package --output-on-failure -j "$jobs"

# ---- 2. the parsers under libFuzzer -----------------------------------------------------------
"$root/scripts/run-fuzz.sh" 60

# ---- 3. libtorch 2.x (the PyTorch wheel), -O1 -------------------------------------------------
if ! wait "$install_torch2"; then
  cat "$logs/install-torch2.log"
  echo "run-tests: scripts/install-torch2.sh failed" >&2
  exit 1
fi
venv="${SPECDEC_VENV:-$HOME/.cache/specdec/venv}"
mapfile -t torch_args < <("$root/scripts/torch-cmake-args.sh" "$venv/bin/python")
cmake -S "$root" -B "$root/build-torch2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="-O1 -DNDEBUG" \
  "${launcher[@]}" "${torch_args[@]}" \
  -DSPECDEC_PYTHON="$venv/bin/python" -DSPECDEC_BUILD_TESTS=ON -DSPECDEC_BUILD_EXAMPLES=ON \
  -DSPECDEC_BUILD_BENCHMARKS=OFF -DSPECDEC_BUILD_GPU_BENCH=ON -DSPECDEC_BUILD_TOOLS=OFF
cmake --build "$root/build-torch2" -j "$jobs"
run_shards "$root/build-torch2/tests/specdec_tests" "$statistical" "-$statistical"
ctest --test-dir "$root/build-torch2" -LE unit --output-on-failure -j "$jobs"
