#!/usr/bin/env bash
# tp.sh GENERATE CASE ARGS...: specdec-generate's tensor parallelism, end to end.
#   same: the text of --tp 2 and --tp 4 equals one process's, token for token (greedy; the
#         header and statistics lines, which name the split and the times, are left out).
#   kill: a rank that --tp started is killed mid-generation; rank 0 then fails within 20 s with
#         an error naming tensor parallelism, status 2, and no rank is left running.
set -uo pipefail
generate="$1"
case_name="$2"
shift 2
text() { "$generate" "$@" 2>&1 | grep -Ev '^(target|drafter|head|heads|mode): | tokens in |tokens/s|scored in '; }
case "$case_name" in
  same)
    one="$(text "$@")" || exit 1
    for n in 2 4; do
      split="$(text "$@" --tp "$n")"
      if [ "$split" != "$one" ]; then
        echo "--tp $n differs from one process:"
        diff <(printf '%s\n' "$one") <(printf '%s\n' "$split")
        exit 1
      fi
    done
    printf '%s\n' "$one" | tail -n 3
    echo "--tp 2 and --tp 4: identical to one process"
    ;;
  kill)
    log="$(mktemp)"
    "$generate" "$@" --tp 2 --tp-timeout-ms 10000 >/dev/null 2>"$log" &
    rank0=$!
    # Wait for rank 1 to start and to have generated for a moment, then kill it.
    for _ in $(seq 100); do
      rank1="$(pgrep -P "$rank0" || true)"
      [ -n "$rank1" ] && break
      sleep 0.05
    done
    if [ -z "$rank1" ]; then echo "rank 1 never started"; kill "$rank0"; exit 1; fi
    sleep 1.5
    kill -9 "$rank1"
    start=$SECONDS
    wait "$rank0"
    status=$?
    elapsed=$((SECONDS - start))
    cat "$log"
    rm -f "$log"
    if [ "$status" -ne 2 ]; then echo "rank 0 exited with status $status, expected 2"; exit 1; fi
    if [ "$elapsed" -gt 20 ]; then echo "rank 0 took $elapsed s to fail"; exit 1; fi
    if pgrep -P "$rank0" >/dev/null; then echo "a rank is still running"; exit 1; fi
    echo "rank 0 failed with status 2 after $elapsed s"
    ;;
  *) echo "tp.sh: unknown case $case_name"; exit 2 ;;
esac
