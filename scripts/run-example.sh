#!/usr/bin/env bash
# Builds and runs the main example: specdec-generate on the bundled pair, speculative decoding
# beside autoregressive decoding. Usage: scripts/run-example.sh [specdec-generate options]
# (without options: --compare --trace on the default prompt; see --help).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/install-deps.sh"
cmake -S "$root" -B "$root/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSPECDEC_BUILD_TESTS=OFF > /dev/null
cmake --build "$root/build" --target specdec-generate
if [ $# -eq 0 ]; then
  set -- --compare --trace
fi
"$root/build/examples/specdec-generate" "$@"
