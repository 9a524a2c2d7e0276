#!/usr/bin/env bash
# expect.sh CODE REGEX COMMAND [ARGS...]: runs COMMAND and passes only when it exits with status
# CODE and its output (stdout and stderr together) matches the extended regular expression REGEX.
# The CLI cases of CTest use it to check a bad input's exit status and message together. An
# argument @EMPTY@ stands for the empty string, which CMake drops from argument lists.
set -u
code="$1"
regex="$2"
shift 2
arguments=()
for argument in "$@"; do
  if [ "$argument" = "@EMPTY@" ]; then arguments+=(""); else arguments+=("$argument"); fi
done
output="$("${arguments[@]}" 2>&1)"
status=$?
if [ "$status" -ne "$code" ]; then
  echo "exit status $status, expected $code; output:"
  printf '%s\n' "$output" | tail -n 20
  exit 1
fi
if ! printf '%s\n' "$output" | grep -Eq -- "$regex"; then
  echo "the output does not match /$regex/; output:"
  printf '%s\n' "$output" | tail -n 20
  exit 1
fi
printf '%s\n' "$output" | tail -n 3
