#!/usr/bin/env python3
"""Writes tests/fixtures/quant/kquant.source (32 super-blocks of 256 f32 values: `source`'s 4,
with its edge blocks, then 28 drawn here: normals at scales from 1e-4 to 1e2, heavy tails, all
positive or all negative values, sparse spikes, a ramp, mixtures within a block) and
{q4_k,q5_k,q6_k}.made: ggml's own quantisation of it to Q4_K, Q5_K and Q6_K, which the `gguf`
package cannot make. ggml's C library does it here: `ggml_quantize_chunk` without an importance matrix,
which runs `quantize_row_q{4,5,6}_K_ref`, as `llama-quantize` does for a file without one. The
library is the one llama-cpp-python ships (pinned in scripts/ci/requirements.txt; last run with
llama-cpp-python 0.3.36).

    python scripts/reference/make_kquant_fixtures.py
"""
import ctypes
import glob
import os

import numpy as np
import llama_cpp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "tests", "fixtures", "quant")
# ggml's type ids and block sizes (bytes per 256 values).
TYPES = {"q4_k": (12, 144), "q5_k": (13, 176), "q6_k": (14, 210)}


def drawn():
    """28 super-blocks that lead the quantisers' searches down different paths."""
    rng = np.random.default_rng(20261205)
    blocks = [rng.standard_normal(256) * s for s in np.logspace(-4, 2, 10)]
    blocks += [rng.standard_t(2, 256) * 0.1 for _ in range(4)]
    blocks += [np.abs(rng.standard_normal(256)) + 0.5, -np.abs(rng.standard_normal(256)) - 0.2]
    blocks += [rng.exponential(1.0, 256), -rng.exponential(0.01, 256)]
    for _ in range(3):
        b = np.zeros(256)
        b[rng.choice(256, 5, replace=False)] = rng.standard_normal(5) * 10
        blocks.append(b)
    blocks.append(np.linspace(-1.0, 3.0, 256))
    for _ in range(6):
        b = rng.standard_normal(256)
        b *= np.repeat(np.logspace(-2, 1, 8)[rng.permutation(8)], 32)
        blocks.append(b + rng.uniform(-1, 1))
    assert len(blocks) == 28
    return np.concatenate(blocks).astype(np.float32)


def main():
    lib_dir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    ggml = ctypes.CDLL(sorted(glob.glob(os.path.join(lib_dir, "libggml-base.so*")))[0])
    ggml.ggml_quantize_chunk.restype = ctypes.c_size_t
    ggml.ggml_quantize_chunk.argtypes = [
        ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
        ctypes.c_int64, ctypes.c_void_p,
    ]
    source = np.concatenate([np.fromfile(os.path.join(OUT, "source"), dtype="<f4"), drawn()])
    source.astype("<f4").tofile(os.path.join(OUT, "kquant.source"))
    rows, per_row = len(source) // 256, 256
    for name, (ty, block) in TYPES.items():
        out = np.zeros(rows * block, dtype=np.uint8)
        n = ggml.ggml_quantize_chunk(ty, source.ctypes.data, out.ctypes.data, 0, rows, per_row, None)
        assert n == out.size, (name, n, out.size)
        out.tofile(os.path.join(OUT, f"{name}.made"))
        print(f"{name}.made: {rows} blocks")


if __name__ == "__main__":
    main()
