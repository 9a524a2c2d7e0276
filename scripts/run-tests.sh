#!/usr/bin/env bash
# Builds and runs every test, once for each libtorch specdec supports:
#
#  1. Debian's libtorch 1.13 (CPU), under AddressSanitizer and UndefinedBehaviorSanitizer: the
#     unit tests but the sampled-distribution ones (below), specdec-generate's command-line cases
#     of bad input and its examples, and the packaging tests.
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
# took 50 minutes there; nothing it runs is timed); the sanitized leg builds only what must run
# under the sanitizers (the unit tests, and specdec-generate for its command-line cases), and
# leaves out the sampled-distribution tests (a chi-square over thousands of samples, and the
# check that it catches a slightly wrong sampler): they spend their time in libtorch's sampling,
# which is not instrumented, and were 90% of the sanitized unit tests' time (60 of 67 minutes of
# one core). Everything left out there runs in the second leg.
#
# The wheel's virtual environment (scripts/install-torch2.sh) is made in the background while the
# first leg builds. Each leg builds only what it runs; the unit tests run as two shards at once.
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

# Runs a gtest binary (and its further arguments) as `jobs` shards at once; prints each shard's
# summary, and a failing shard's whole output.
run_shards() {
  local binary="$1" pids=() status=0 i
  shift
  for ((i = 0; i < jobs; i++)); do
    GTEST_TOTAL_SHARDS="$jobs" GTEST_SHARD_INDEX="$i" "$binary" --gtest_brief=1 "$@" > "$logs/shard$i.log" 2>&1 &
    pids+=("$!")
  done
  for ((i = 0; i < jobs; i++)); do
    if wait "${pids[$i]}"; then
      grep -E '^\[  (PASSED|SKIPPED) ' "$logs/shard$i.log" | sed "s/^/shard $i: /"
    else
      echo "shard $i of $binary failed:"
      cat "$logs/shard$i.log"
      status=1
    fi
  done
  return "$status"
}

# ---- 1. libtorch 1.13 (Debian), sanitizers ----------------------------------------------------
cmake -S "$root" -B "$root/build-sanitize" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "${launcher[@]}" \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1" -DSPECDEC_SANITIZE=ON -DSPECDEC_REQUIRE_ONEDNN=ON -DSPECDEC_BUILD_TESTS=ON \
  -DSPECDEC_BUILD_EXAMPLES=ON -DSPECDEC_BUILD_BENCHMARKS=OFF -DSPECDEC_BUILD_TOOLS=OFF
# The unit tests and specdec-generate (its bad-input cases and examples). The other programs
# (specdec-demo, specdec-verifier, the library examples) and tensor parallelism's processes run in
# the second leg; the packaging tests build the quickstart against this libtorch. The remote
# service's unit tests (test_remote.cpp, test_admission.cpp) run here.
sanitized=(specdec_tests specdec-generate)
cmake --build "$root/build-sanitize" -j "$jobs" --target "${sanitized[@]}"
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
statistical='*Distribution.*:*HarnessHasPower:*OwnDistribution:*AsTheTarget:*WrongQFails:*FollowsTheResidual'
statistical+=':*SampledAndDeterministicDrafts:*IsTheQuantizedTarget'
run_shards "$root/build-sanitize/tests/specdec_tests" --gtest_filter="-$statistical"
# Undefined behaviour or a memory error in any case changes its exit status and fails it.
ctest --test-dir "$root/build-sanitize" -L "cli|example|package" --output-on-failure -j "$jobs" \
  -E '^(example\.(quickstart|serving_loop|custom_model|custom_drafter|demo.*|remote_.*|verifier_.*|generate_tp_.*)|cli\.(demo_.*|verifier_.*|server_.*))$'
unset ASAN_OPTIONS UBSAN_OPTIONS

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
run_shards "$root/build-torch2/tests/specdec_tests"
ctest --test-dir "$root/build-torch2" -LE unit --output-on-failure -j "$jobs"
