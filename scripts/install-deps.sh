#!/usr/bin/env bash
# Installs what specdec needs on Debian 12 (bookworm): a C++20 compiler, CMake, Ninja, libtorch
# (CPU), OpenBLAS (without it libtorch falls back to a reference BLAS about 25x slower),
# oneDNN with the OpenCL headers its CMake config asks for (the CPU forward's weight products),
# GoogleTest, Google Benchmark, nlohmann-json (for the checkpoint loaders), CLI11 (the programs'
# command lines), xxHash (checksums of saved storages, header-only), tsl-hopscotch-map (only for the
# benchmark that compares it with the n-gram storages' own table; header-only), PCRE2 and utf8proc
# (tokenizer.json: pre-tokenizer regexes, UTF-8 and NFC), gRPC and protobuf with their compilers
# (the remote verification service), OpenSSL (the verifier's check of its TLS key), nghttp2 (the
# HTTP/2 client of the verifier's rapid-reset test), clang with its
# libFuzzer runtime (for the loaders' fuzz target and the headers' clang check), libpython3.11-stdlib
# (the Python sources the bundled models were trained and are evaluated on) and python3 (the
# check of --compare's arithmetic), ccache (the test script's compiler cache). Idempotent: installs
# only what is missing.
set -euo pipefail

packages=(g++ cmake ninja-build libtorch-dev libopenblas0-pthread libgtest-dev libbenchmark-dev
  nlohmann-json3-dev libpcre2-dev libutf8proc-dev libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libssl-dev libnghttp2-dev libtsl-hopscotch-map-dev libcli11-dev libxxhash-dev libgloo-dev libdnnl-dev ocl-icd-opencl-dev clang libclang-rt-14-dev libpython3.11-stdlib python3 ccache)

missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$package")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

echo "installing: ${missing[*]}"
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  sudo="sudo"
fi
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
