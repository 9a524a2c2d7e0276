#!/usr/bin/env bash
# remote.sh VERIFIER GENERATE CASE: runs specdec-verifier on a free loopback port and
# specdec-generate against it.
#   ok:   a traced remote generation ends normally, with per-step k, accepted, rtt_ms, prefill_ms;
#   kill: the server is killed (SIGKILL) mid-generation; the client must exit with status 1,
#         name the failed call and print the tokens generated before it;
#   batch: three clients at once against a server that batches verifications (--max-batch,
#          --batch-delay-us); each gets the output it gets alone, and the server reports on
#          SIGTERM that forwards served several verifications;
#   tls:   the server requires TLS client certificates (tests/data/tls); a client with one
#          generates, a client without one exits with status 1 and the failed call;
#   port:  a second server on the running one's port exits with status 2 and a message naming the
#          address; the first serves every client that connects afterwards.
set -u
verifier="$1"
generate="$2"
case="$3"
work="$(mktemp -d)"
server=""
cleanup() {
  if [ -n "$server" ]; then kill -9 "$server" 2>/dev/null; fi
  rm -rf "$work"
}
trap cleanup EXIT
server_flags=()
tls="$(cd "$(dirname "$0")/../data/tls" && pwd)"
if [ "$case" = "batch" ]; then server_flags=(--max-batch 8 --batch-delay-us 20000); fi
if [ "$case" = "tls" ]; then
  server_flags=(--tls-cert "$tls/server.pem" --tls-key "$tls/server.key" --tls-client-ca "$tls/ca.pem")
fi
"$verifier" --address 127.0.0.1:0 "${server_flags[@]}" > "$work/server.log" 2>&1 &
server=$!
port=""
for _ in $(seq 1 300); do
  port="$(sed -n 's/^listening on 127.0.0.1:\([0-9]*\).*/\1/p' "$work/server.log")"
  if [ -n "$port" ]; then break; fi
  if ! kill -0 "$server" 2>/dev/null; then echo "the server exited:"; cat "$work/server.log"; exit 1; fi
  sleep 0.1
done
if [ -z "$port" ]; then echo "the server did not start:"; cat "$work/server.log"; exit 1; fi

stop_server() {
  kill -TERM "$server"
  wait "$server"
  server=""
  grep -q "stopping" "$work/server.log" || { echo "the server did not stop on SIGTERM"; cat "$work/server.log"; exit 1; }
}

if [ "$case" = "port" ]; then
  timeout 60 "$verifier" --address "127.0.0.1:$port" > "$work/second.log" 2>&1
  status=$?
  cat "$work/second.log"
  [ "$status" -eq 2 ] || { echo "the second server's exit status is $status, expected 2"; exit 1; }
  grep -q "cannot listen on 127.0.0.1:$port" "$work/second.log" || exit 1
  for i in 1 2 3 4 5 6; do
    "$generate" --verifier "127.0.0.1:$port" --prompt "def f$i(x):" --max-new-tokens 12 > "$work/client.$i" 2>&1 ||
      { echo "client $i failed:"; cat "$work/client.$i"; exit 1; }
  done
  stop_server
  exit 0
fi

if [ "$case" = "ok" ]; then
  output="$("$generate" --verifier "127.0.0.1:$port" --prompt "def add(a, b):" --max-new-tokens 60 --trace 2>&1)"
  status=$?
  printf '%s\n' "$output" | tail -n 4
  [ "$status" -eq 0 ] || { echo "exit status $status"; exit 1; }
  printf '%s\n' "$output" | grep -Eq '\[k=[0-9]+ accepted=[0-9]+ rtt_ms=[0-9.]+ prefill_ms=[0-9.]+\]' || exit 1
  printf '%s\n' "$output" | grep -Eq '60 tokens in .* round trips' || exit 1
  stop_server
  exit 0
fi

if [ "$case" = "tls" ]; then
  grep -q "TLS with client certificates" "$work/server.log" || { cat "$work/server.log"; exit 1; }
  "$generate" --verifier "127.0.0.1:$port" --verifier-tls-ca "$tls/ca.pem" --verifier-tls-cert "$tls/client.pem" \
    --verifier-tls-key "$tls/client.key" --max-new-tokens 20 > "$work/client.out" 2>&1 || { cat "$work/client.out"; exit 1; }
  grep -m1 'round trips' "$work/client.out" || { cat "$work/client.out"; exit 1; }
  "$generate" --verifier "127.0.0.1:$port" --verifier-tls-ca "$tls/ca.pem" --max-new-tokens 20 > "$work/refused.out" 2>&1
  status=$?
  grep -m1 'failed' "$work/refused.out"
  [ "$status" -eq 1 ] || { echo "a client without a certificate: exit status $status, expected 1"; cat "$work/refused.out"; exit 1; }
  grep -Eq 'Open failed \(UNAVAILABLE\)' "$work/refused.out" || { cat "$work/refused.out"; exit 1; }
  stop_server
  exit 0
fi

if [ "$case" = "batch" ]; then
  # The generated text: the lines after the "mode:" line up to the statistics.
  body() { awk '/^mode:/ { on = 1; next } on && / tokens in [0-9.]+ s:/ { exit } on { print }' "$1"; }
  prompts=("def add(a, b):" "class Queue:" "import sys")
  for i in 0 1 2; do
    "$generate" --prompt "${prompts[$i]}" --max-new-tokens 40 > "$work/alone.$i" 2>&1 || { cat "$work/alone.$i"; exit 1; }
  done
  pids=()
  for i in 0 1 2; do
    "$generate" --verifier "127.0.0.1:$port" --prompt "${prompts[$i]}" --max-new-tokens 40 > "$work/remote.$i" 2>&1 &
    pids+=($!)
  done
  for i in 0 1 2; do
    wait "${pids[$i]}" || { echo "client $i failed:"; cat "$work/remote.$i"; exit 1; }
    [ -n "$(body "$work/alone.$i")" ] || { echo "no text in the local run:"; cat "$work/alone.$i"; exit 1; }
    if [ "$(body "$work/remote.$i")" != "$(body "$work/alone.$i")" ]; then
      echo "client $i differs from its local run:"; cat "$work/remote.$i" "$work/alone.$i"; exit 1
    fi
    printf 'client %d: %s\n' "$i" "$(grep -m1 'round trips' "$work/remote.$i")"
  done
  stop_server
  tail -n 1 "$work/server.log"
  grep -Eq 'largest batch [2-9]' "$work/server.log" || { echo "no forward served two clients"; exit 1; }
  exit 0
fi

# kill: a slow client (20 ms added per call), the server killed once the client has streamed some
# tokens (polled, not a fixed sleep: a loaded machine may take seconds to load the drafter).
"$generate" --verifier "127.0.0.1:$port" --max-new-tokens 400 --added-latency-ms 20 > "$work/client.out" 2> "$work/client.err" &
client=$!
header=""
for _ in $(seq 1 600); do
  if [ -z "$header" ] && grep -q "^mode:" "$work/client.out"; then header="$(wc -c < "$work/client.out")"; fi
  if [ -n "$header" ] && [ "$(wc -c < "$work/client.out")" -gt $((header + 8)) ]; then break; fi
  sleep 0.1
done
kill -9 "$server"
wait "$server" 2>/dev/null
server=""
wait "$client"
status=$?
cat "$work/client.err"
[ "$status" -eq 1 ] || { echo "client exit status $status, expected 1"; exit 1; }
grep -Eq 'Verify failed \((UNAVAILABLE|CANCELLED|INTERNAL)\)' "$work/client.err" || exit 1
grep -Eq '[1-9][0-9]* tokens were generated before the failure' "$work/client.err" || exit 1
