#!/usr/bin/env bash
# --threads auto takes every core this process may run on: the header's torch thread count
# must equal nproc (which reads the same CPU affinity; without OMP_NUM_THREADS and
# OMP_THREAD_LIMIT, which nproc would honour and --threads auto does not read).
set -euo pipefail
generate="$1"
output=$("$generate" --threads auto --max-new-tokens 2)
header=${output%%$'\n'*}
torch=$(sed -n 's/.*threads: torch \([0-9]*\).*/\1/p' <<<"$header")
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
if [[ "$torch" == "$cores" ]]; then
  echo "threads auto: torch $torch = nproc"
else
  echo "threads auto: torch '$torch', nproc $cores: $header"
  exit 1
fi
