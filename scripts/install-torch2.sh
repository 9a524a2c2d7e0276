#!/usr/bin/env bash
# Makes the Python virtual environment of the libtorch 2.x build and of the reference tests:
# PyTorch (its wheel carries libtorch's headers, libraries and CMake package), Hugging Face
# transformers, tokenizers and safetensors, at the versions pinned in
# scripts/python-requirements.txt. It lives outside the checkout, in $SPECDEC_VENV (default
# ~/.cache/specdec/venv), and is reused when it already holds those versions. Idempotent.
# Prints the folder of Torch's CMake package (TorchConfig.cmake) on its last line.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SPECDEC_VENV:-$HOME/.cache/specdec/venv}"
requirements="$root/scripts/python-requirements.txt"
stamp="$venv/.specdec-requirements"

if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends python3-venv >&2
fi
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv" >&2
fi
if ! cmp -s "$requirements" "$stamp"; then
  echo "install-torch2: installing $(grep -v '^#' "$requirements" | tr '\n' ' ')into $venv" >&2
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$requirements" >&2
  cp "$requirements" "$stamp"
fi
"$venv/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path + "/Torch")'
