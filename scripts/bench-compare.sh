#!/usr/bin/env bash
# Builds bench_models at a base revision and at the working tree, side by side, and runs both on
# the bundled pair in alternation (base, current, base, current, ...), so that both see the same
# machine state. Prints autoregressive and speculative (gamma 4) tokens/s per run and the ratio
# of the medians.
#
#   scripts/bench-compare.sh [BASE_REV] [RUNS]     (defaults: HEAD~1, 3)
#
# Extra environment: BENCH_FILTERS (benchmark filters, one program run each; default the two
# bundled-pair benchmarks), BENCH_ARGS (passed to both programs, e.g. "--threads 1").
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
base_rev="${1:-HEAD~1}"
runs="${2:-3}"
filters="${BENCH_FILTERS:-^BM_Autoregressive/bundled/ ^BM_Speculative/bundled/4/}"
"$root/scripts/install-deps.sh"

base_sha="$(git -C "$root" rev-parse --verify "$base_rev^{commit}")"
work="$root/build-compare"
mkdir -p "$work"
if [ ! -d "$work/base-src" ]; then
  git -C "$root" worktree add --detach "$work/base-src" "$base_sha" >/dev/null
else
  git -C "$work/base-src" checkout -q --detach "$base_sha"
fi

build() {  # source folder, build folder
  cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSPECDEC_BUILD_TESTS=OFF \
    -DSPECDEC_BUILD_EXAMPLES=OFF -DSPECDEC_BUILD_BENCHMARKS=ON >/dev/null
  cmake --build "$2" --target bench_models >/dev/null
}
echo "building bench_models at $base_sha and at the working tree"
build "$work/base-src" "$work/base"
build "$root" "$work/current"

# One run of a build: "name tokens_per_second" lines from Google Benchmark's CSV output (one
# program run per filter: the CSV reporter wants the same counters in every row).
run() {
  for filter in $filters; do
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
    "$1/benchmarks/bench_models" --benchmark_filter="$filter" --benchmark_format=csv ${BENCH_ARGS:-} 2>/dev/null |
      awk -F, 'NR == 1 { for (i = 1; i <= NF; ++i) if ($i == "\"tokens_per_second\"" || $i == "tokens_per_second") c = i; next }
               c { gsub(/"/, "", $1); print $1, $c }'
  done
}
results="$work/results.txt"
: >"$results"
for i in $(seq "$runs"); do
  run "$work/base" | sed 's/^/base /' >>"$results"
  run "$work/current" | sed 's/^/current /' >>"$results"
done

echo
echo "tokens/s per run; base = $base_sha"
awk '
  { values[$1 " " $2] = values[$1 " " $2] " " $3; names[$2] = 1 }
  function median(list,   n, a, i, j, t) {
    n = split(list, a, " ")
    for (i = 1; i <= n; ++i) for (j = i + 1; j <= n; ++j) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
    return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
  }
  END {
    printf "%-52s %-30s %-30s %s\n", "benchmark", "base", "current", "current/base (medians)"
    for (name in names) {
      b = median(values["base " name]); c = median(values["current " name])
      printf "%-52s %-30s %-30s %.2f\n", name, values["base " name], values["current " name], c / b
    }
  }' "$results"
