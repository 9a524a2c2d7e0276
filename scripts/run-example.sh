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
  # gamma 3, not the library's default 4: the bundled drafter is accepted about 85% of the time
  # at about a quarter of the target's cost, but on a CPU a verification forward costs more with
  # every token it checks (its small products are compute-bound: 5 tokens cost about twice one),
  # so short drafts pay best. On a GPU, where a forward of a few tokens costs about one, longer
  # drafts pay (docs/performance.md).
  echo "default run: speculative decoding with the bundled drafter, gamma 3 (on a CPU each verified token adds to"
  echo "the target's forward, so short drafts pay best; see docs/performance.md), beside autoregressive decoding"
  set -- --compare --trace --gamma 3
fi
"$root/build/examples/specdec-generate" "$@"
