#!/usr/bin/env bash
# Fetches the source distribution of arctic-inference from PyPI into a cache folder outside the
# checkout, once (its URL and SHA-256 from PyPI's simple index, checked before unpacking; pip would
# build its metadata, which imports torch), and prints the folder of its C++ suffix tree,
# csrc/suffix_decoding, for -DSPECDEC_ARCTIC_SOURCE_DIR=... (bench_suffix compiles it in to
# compare on the same streams). Its code is a reference to compare with, never part of specdec.
# Usage: scripts/fetch-arctic.sh [cache folder, default ~/.cache/specdec/arctic]
set -euo pipefail
version=0.3.0
cache="${1:-$HOME/.cache/specdec/arctic}"
folder="$cache/arctic_inference-$version/csrc/suffix_decoding"
if [ ! -f "$folder/suffix_tree.cc" ]; then
  mkdir -p "$cache"
  python3 - "$version" "$cache" <<'PY'
import hashlib, json, os, sys, tarfile, urllib.request
version, cache = sys.argv[1], sys.argv[2]
index = urllib.request.Request("https://pypi.org/simple/arctic-inference/",
                               headers={"Accept": "application/vnd.pypi.simple.v1+json"})  # PEP 691
with urllib.request.urlopen(index, timeout=60) as r:
    files = json.load(r)["files"]
sdist = next(f for f in files if f["filename"] == f"arctic_inference-{version}.tar.gz")
with urllib.request.urlopen(sdist["url"], timeout=120) as r:
    data = r.read()
if hashlib.sha256(data).hexdigest() != sdist["hashes"]["sha256"]:
    sys.exit(f"fetch-arctic: {sdist['filename']}: SHA-256 differs from PyPI's")
path = os.path.join(cache, sdist["filename"])
with open(path, "wb") as f:
    f.write(data)
with tarfile.open(path) as tar:
    tar.extractall(cache, filter="data") if hasattr(tarfile, "data_filter") else tar.extractall(cache)
PY
fi
[ -f "$folder/suffix_tree.cc" ] || { echo "fetch-arctic: no $folder/suffix_tree.cc in the sdist" >&2; exit 1; }
echo "$folder"
