#!/usr/bin/env bash
# Builds and runs the main example: speculative decoding beside autoregressive decoding.
# Usage: scripts/run-example.sh [specdec-demo options, see --help]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/install-deps.sh"
cmake -S "$root" -B "$root/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSPECDEC_BUILD_TESTS=OFF > /dev/null
cmake --build "$root/build" --target specdec-demo
"$root/build/examples/specdec-demo" "$@"
