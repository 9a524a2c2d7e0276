#!/usr/bin/env python3
"""Writes a llama2.c (version 0) checkpoint of random weights of a given shape, for forward-speed
benchmarks of a real model's shape (scripts/bench-llamacpp.sh):

    random_llama2c.py OUT DIM LAYERS HEADS KV_HEADS HIDDEN VOCAB SEQ_LEN

Weights are normal with standard deviation 0.02 (norms 1), float32, with a separate classifier
(negative vocab_size in the header), in the order llama2.c reads them."""
import struct
import sys

import numpy as np


def main() -> None:
    out, dim, layers, heads, kv_heads, hidden, vocab, seq_len = sys.argv[1], *map(int, sys.argv[2:9])
    if dim % heads or heads % kv_heads:
        sys.exit("DIM must divide into HEADS heads, and HEADS into KV_HEADS groups")
    kv_dim = dim * kv_heads // heads
    rng = np.random.default_rng(0)

    def write(handle, *shape, ones=False):
        values = np.ones(shape, np.float32) if ones else (rng.standard_normal(shape, np.float32) * 0.02)
        handle.write(values.astype(np.float32).tobytes())

    with open(out, "wb") as f:
        f.write(struct.pack("7i", dim, hidden, layers, heads, kv_heads, -vocab, seq_len))
        write(f, vocab, dim)
        write(f, layers, dim, ones=True)
        for rows in (dim, kv_dim, kv_dim, dim):  # wq, wk, wv, wo
            for _ in range(layers):
                write(f, rows, dim)
        write(f, layers, dim, ones=True)
        for shape in ((hidden, dim), (dim, hidden), (hidden, dim)):  # w1, w2, w3
            for _ in range(layers):
                write(f, *shape)
        write(f, dim, ones=True)
        f.write(np.zeros((2, seq_len, dim // heads // 2), np.float32).tobytes())  # legacy RoPE tables
        write(f, vocab, dim)
    print(f"wrote {out}: dim {dim}, layers {layers}, heads {heads}/{kv_heads} (head size {dim // heads}), "
          f"hidden {hidden}, vocab {vocab}")


if __name__ == "__main__":
    main()
