#!/usr/bin/env bash
# Prints the CMake arguments that build specdec against the PyTorch of a Python interpreter
# (default: the virtual environment of scripts/install-torch2.sh), one per line:
#   -DCMAKE_PREFIX_PATH=<torch>/share/cmake  so that Torch and Caffe2 come from that wheel, not
#                                            from another libtorch on the system (Debian's);
#   -DCUDA_cudart_LIBRARY=<wheel's cudart>   for a CUDA wheel that carries its own CUDA runtime
#                                            (the nvidia-* wheels): the program then links the
#                                            runtime libtorch_cuda was built against, not the
#                                            system toolkit's, which may be an older minor
#                                            version (this machine: 13.0 beside the wheel's 13.2).
# Usage: scripts/torch-cmake-args.sh [python]
set -euo pipefail
python="${1:-${SPECDEC_VENV:-$HOME/.cache/specdec/venv}/bin/python}"
"$python" - <<'PY'
import glob, os, torch
print("-DCMAKE_PREFIX_PATH=" + torch.utils.cmake_prefix_path)
if torch.version.cuda:
    site = os.path.dirname(os.path.dirname(torch.__file__))
    major = torch.version.cuda.split(".")[0]
    for pattern in (f"nvidia/cu{major}/lib/libcudart.so.{major}", f"nvidia/cuda_runtime/lib/libcudart.so.{major}"):
        found = sorted(glob.glob(os.path.join(site, pattern)))
        if found:
            print("-DCUDA_cudart_LIBRARY=" + found[0])
            break
PY
