#!/usr/bin/env python3
"""Writes tests/fixtures/quant/: blocks of ggml's formats with their values as ggml's own Python
package (`gguf`, pinned in requirements.txt) computes them, for tests/quant.rs.

`source`: f32 values; for each of F16, Q8_0, Q4_0 and Q4_1, `NAME.blocks` (gguf's quantisation of
them) and `NAME.values` (gguf's dequantisation of the blocks). For Q4_K and Q6_K, which gguf
reads but does not make: `NAME.blocks` of random bits with finite scales, and `NAME.values`.
All little-endian; the values are f32.

    python scripts/reference/make_quant_fixtures.py
"""
import os

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "tests", "fixtures", "quant")


def source_values(rng: np.random.Generator) -> np.ndarray:
    """32 blocks of 32: plain normals, then blocks that probe the edges of the formats."""
    blocks = [rng.standard_normal(32) * s for s in np.logspace(-3, 2, 24)]
    blocks.append(np.zeros(32))  # a zero scale
    blocks.append(-np.abs(rng.standard_normal(32)))  # the largest magnitude negative
    blocks.append(np.full(32, 0.75))  # a constant block (Q4_1: zero range)
    blocks.append(np.arange(32) - 15.5)  # values on half steps: rounding ties
    blocks.append((np.arange(32) - 16) / 127.0)  # exact multiples of the Q8_0 step
    blocks.append(rng.standard_normal(32) * 1e-6)  # scales in the f16 subnormals
    blocks.append(np.concatenate([[60000.0], rng.standard_normal(31)]))  # one large value
    blocks.append(rng.uniform(-1, 1, 32))
    return np.concatenate(blocks).astype(np.float32)


def random_k_blocks(rng: np.random.Generator, qtype: T, n: int) -> np.ndarray:
    size = {T.Q4_K: 144, T.Q6_K: 210}[qtype]
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    def scale() -> np.ndarray:
        return np.array([rng.uniform(1e-4, 0.05)], dtype=np.float16).view(np.uint8)

    for b in raw:
        if qtype == T.Q4_K:
            b[0:2], b[2:4] = scale(), scale()
        else:
            b[208:210] = scale()
    return raw


def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    rng = np.random.default_rng(20261203)
    src = source_values(rng)
    src.tofile(os.path.join(OUT, "source"))
    for qtype in (T.F16, T.Q8_0, T.Q4_0, T.Q4_1):
        blocks = quantize(src.reshape(1, -1), qtype)
        values = dequantize(blocks, qtype).astype(np.float32)
        name = qtype.name.lower()
        blocks.tofile(os.path.join(OUT, f"{name}.blocks"))
        values.tofile(os.path.join(OUT, f"{name}.values"))
    for qtype in (T.Q4_K, T.Q6_K):
        blocks = random_k_blocks(rng, qtype, 8)
        values = dequantize(blocks.reshape(1, -1), qtype).astype(np.float32)
        name = qtype.name.lower()
        blocks.tofile(os.path.join(OUT, f"{name}.blocks"))
        values.tofile(os.path.join(OUT, f"{name}.values"))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
