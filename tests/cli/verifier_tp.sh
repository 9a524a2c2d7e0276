#!/usr/bin/env bash
# verifier_tp.sh VERIFIER GENERATE CASE MODELS_DIR: specdec-verifier's tensor parallelism, end to
# end, on stories260K (8 heads: it splits over 2 and 4 ranks) with llama2xs drafting.
#   same:  a server split over 2 and over 4 ranks answers as one process does: a greedy client
#          gets the same text, three clients at once (batched verifications: --max-batch,
#          --batch-delay-us) each get their own text, a sampled client generates; the 2-rank
#          server's first client comes after it has idled past its --tp-timeout-ms (heartbeats
#          keep the group alive); SIGTERM stops every rank with status 0.
#   kill1: rank 1 is killed (SIGKILL) mid-generation: the client exits 1 naming the tensor-parallel
#          failure, rank 0 exits 2 within 20 s, and no rank is left running.
#   kill0: rank 0 is killed (SIGKILL) while idle: rank 1 exits 2 within 20 s naming tensor
#          parallelism, and a client then fails to connect.
set -u
verifier="$1"
generate="$2"
case_name="$3"
models="$4"
work="$(mktemp -d)"
server=""
cleanup() {
  if [ -n "$server" ]; then pkill -9 -P "$server" 2>/dev/null; kill -9 "$server" 2>/dev/null; fi
  rm -rf "$work"
}
trap cleanup EXIT
model=(--tokenizer "$models/stories260K/tok512.bin" --drafter "$models/llama2xs/model.bin")
start_server() {  # start_server LOG ARGS...: the server's port in $port, its process in $server
  local log="$1"
  shift
  "$verifier" --target "$models/stories260K/stories260K.bin" --address 127.0.0.1:0 "$@" > "$log" 2>&1 &
  server=$!
  port=""
  for _ in $(seq 1 600); do
    port="$(sed -n 's/^listening on 127.0.0.1:\([0-9]*\).*/\1/p' "$log")"
    if [ -n "$port" ]; then return 0; fi
    if ! kill -0 "$server" 2>/dev/null; then echo "the server exited:"; cat "$log"; exit 1; fi
    sleep 0.1
  done
  echo "the server did not start:"; cat "$log"; exit 1
}
stop_server() {  # stop_server LOG: SIGTERM, then status 0 and no rank left
  local log="$1" ranks
  ranks="$(pgrep -P "$server" | tr '\n' ' ')"
  kill -TERM "$server"
  wait "$server"
  local status=$?
  server=""
  if [ "$status" -ne 0 ]; then echo "the server exited with status $status on SIGTERM:"; cat "$log"; exit 1; fi
  for pid in $ranks; do
    if kill -0 "$pid" 2>/dev/null; then echo "rank process $pid is still running after rank 0 stopped"; exit 1; fi
  done
}
client() {  # client OUT ARGS...: the text of one remote generation (header and statistics left out)
  local out="$1"
  shift
  "$generate" --verifier "127.0.0.1:$port" "${model[@]}" "$@" > "$out.raw" 2>&1 || { echo "client failed:"; cat "$out.raw"; exit 1; }
  grep -Ev '^(mode|target|drafter|verifier): | tokens in |tokens/s| round trips' "$out.raw" > "$out"
}
serve_all() {  # serve_all DIR TP TIMEOUT_MS IDLE_S: the texts a server of TP ranks gives, into DIR
  local dir="$1" tp="$2" timeout_ms="$3" idle="$4"
  mkdir -p "$dir"
  start_server "$dir/server.log" --tp "$tp" --tp-timeout-ms "$timeout_ms" --max-batch 8 --batch-delay-us 20000
  sleep "$idle"  # idle past the timeout: only the heartbeats keep the ranks waiting
  client "$dir/greedy" --prompt "Once upon a time" --max-new-tokens 80
  local clients=()
  for i in 1 2 3; do
    client "$dir/batch.$i" --prompt "The little dog $i" --max-new-tokens 60 &
    clients+=($!)
  done
  for pid in "${clients[@]}"; do wait "$pid" || exit 1; done
  client "$dir/sampled" --prompt "Lily saw" --max-new-tokens 40 --temperature 0.8 --seed 5
  grep -q "split over $tp ranks" "$dir/server.log" || [ "$tp" -eq 1 ] || { cat "$dir/server.log"; exit 1; }
  stop_server "$dir/server.log"
  grep "stopping" "$dir/server.log"
}
case "$case_name" in
  same)
    serve_all "$work/1" 1 60000 0
    serve_all "$work/2" 2 5000 6  # idle past the group's timeout first
    serve_all "$work/4" 4 60000 0
    for tp in 2 4; do
      for text in greedy batch.1 batch.2 batch.3; do
        if ! cmp -s "$work/1/$text" "$work/$tp/$text"; then
          echo "--tp $tp: the $text text differs from one process:"
          diff "$work/1/$text" "$work/$tp/$text"
          exit 1
        fi
      done
    done
    tail -n 2 "$work/1/greedy"
    echo "--tp 2 and --tp 4: every client's text identical to one process"
    ;;
  kill1)
    start_server "$work/server.log" --tp 2 --tp-timeout-ms 5000
    rank1="$(pgrep -P "$server")"
    [ -n "$rank1" ] || { echo "rank 1 is not running"; exit 1; }
    "$generate" --verifier "127.0.0.1:$port" "${model[@]}" --prompt "Once upon a time" --max-new-tokens 400 \
      --added-latency-ms 10 --trace > "$work/client.out" 2>&1 &
    client_pid=$!
    # Mid-generation: once the client has made three steps (--trace prints one [k=...] per step).
    for _ in $(seq 1 600); do
      [ "$(grep -o '\[k=' "$work/client.out" | wc -l)" -ge 3 ] && break
      kill -0 "$client_pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -9 "$rank1"
    start=$SECONDS
    wait "$client_pid"
    client_status=$?
    wait "$server"
    server_status=$?
    elapsed=$((SECONDS - start))
    ranks_left="$(pgrep -P "$server")"
    server=""
    cat "$work/client.out" | tail -n 3
    cat "$work/server.log"
    [ "$client_status" -eq 1 ] || { echo "the client exited with status $client_status, expected 1"; exit 1; }
    grep -q "tensor-parallel group has failed" "$work/client.out" || { echo "the client does not name the failure"; exit 1; }
    [ "$server_status" -eq 2 ] || { echo "rank 0 exited with status $server_status, expected 2"; exit 1; }
    grep -q "the tensor-parallel group failed" "$work/server.log" || exit 1
    [ "$elapsed" -le 20 ] || { echo "the failure took $elapsed s"; exit 1; }
    [ -z "$ranks_left" ] || { echo "ranks still running: $ranks_left"; exit 1; }
    echo "client and rank 0 failed after $elapsed s"
    ;;
  kill0)
    start_server "$work/server.log" --tp 2 --tp-timeout-ms 3000
    rank1="$(pgrep -P "$server")"
    [ -n "$rank1" ] || { echo "rank 1 is not running"; exit 1; }
    kill -9 "$server"
    server=""
    start=$SECONDS
    while kill -0 "$rank1" 2>/dev/null && [ $((SECONDS - start)) -le 20 ]; do sleep 0.1; done
    elapsed=$((SECONDS - start))
    if kill -0 "$rank1" 2>/dev/null; then echo "rank 1 still runs $elapsed s after rank 0 was killed"; kill -9 "$rank1"; exit 1; fi
    cat "$work/server.log"
    grep -q "specdec-verifier (rank 1): tensor parallelism" "$work/server.log" || { echo "rank 1 did not name the failure"; exit 1; }
    if "$generate" --verifier "127.0.0.1:$port" "${model[@]}" --max-new-tokens 8 > "$work/client.out" 2>&1; then
      echo "a client reached the killed server"; exit 1
    fi
    echo "rank 1 failed $elapsed s after rank 0 was killed"
    ;;
  *) echo "verifier_tp.sh: unknown case $case_name"; exit 2 ;;
esac
