#!/usr/bin/env bash
# Gathers, on a Debian machine where scripts/install-deps.sh has run, what scripts/gpu-check.sh
# needs to build on a GPU machine that has PyTorch, CMake and a compiler but no Debian -dev
# packages and no network: the header-only libraries (nlohmann-json, CLI11, xxHash) with their
# CMake packages, PCRE2's and utf8proc's headers and shared libraries, Gloo's headers (c10d's
# headers include them; a PyTorch wheel carries Gloo's code) and googletest's sources.
# Writes them to .gpu-deps in the checkout (ignored by git; about 6 MB), which gpu-check.sh uses
# where it exists. With the device tool: carry .gpu-deps.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
deps="${1:-$root/.gpu-deps}"
lib=/usr/lib/x86_64-linux-gnu
rm -rf "$deps"
mkdir -p "$deps/include" "$deps/lib" "$deps/share/cmake"
cp -r /usr/include/nlohmann /usr/include/CLI /usr/include/gloo "$deps/include/"
cp /usr/include/xxhash.h /usr/include/pcre2.h /usr/include/utf8proc.h "$deps/include/"
cp -r /usr/share/cmake/nlohmann_json /usr/share/cmake/CLI11 "$deps/share/cmake/"
cp -P "$lib"/libpcre2-8.so* "$lib"/libutf8proc.so* "$deps/lib/"
cp -r /usr/src/googletest "$deps/googletest"
echo "gpu-deps: $(du -sh "$deps" | cut -f1) in $deps"
