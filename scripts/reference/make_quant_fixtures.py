#!/usr/bin/env python3
"""Writes tests/fixtures/quant/: blocks of ggml's formats with their values as ggml's own Python
package (`gguf`, pinned in requirements.txt; last run with gguf 0.19.0 and numpy 2.4.6) computes
them, for tests/quant.rs.

`source`: 1,024 f32 values. For each of F16, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1, `NAME.blocks` opens
with gguf's quantisation of `source` (1,024 blocks of F16, 32 of the others); for Q4_K, Q5_K and
Q6_K, which gguf reads but does not make, with 8 blocks of random bits with finite scales. Every
`NAME.blocks` then goes on with the edge cases below (zero, negative zero, subnormal, negative and
the largest finite f16 scales; the extreme quantised values; for the K-quants the extreme 6-bit
scales and minimums, Q6_K's extreme int8 scales), and `NAME.values` is gguf's dequantisation of
all of `NAME.blocks`. No f16 scale is infinite or NaN, so every value is finite. All
little-endian; the values are f32.

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
    size = {T.Q4_K: 144, T.Q5_K: 176, T.Q6_K: 210}[qtype]
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    def scale() -> np.ndarray:
        return np.array([rng.uniform(1e-4, 0.05)], dtype=np.float16).view(np.uint8)

    for b in raw:
        if qtype in (T.Q4_K, T.Q5_K):
            b[0:2], b[2:4] = scale(), scale()
        else:
            b[208:210] = scale()
    return raw


# --- edge cases -------------------------------------------------------------------------------

# f16 bit patterns: zeros, subnormals, the smallest normals, the largest finite, around one.
F16_EDGES = [
    0x0000, 0x8000, 0x0001, 0x8001, 0x0002, 0x01FF, 0x0200, 0x03FF,
    0x83FF, 0x0400, 0x8400, 0x0401, 0x07FF, 0x3BFF, 0x3C00, 0x3C01,
    0xBC00, 0x3800, 0x3555, 0x2E66, 0xC000, 0x1400, 0x9400, 0x6400,
    0xE400, 0x7800, 0xF800, 0x7BFE, 0x7BFF, 0xFBFF, 0x5BFF, 0x8002,
]

# Q8_0, Q4_0, Q5_0: (d, codes)
SYMMETRIC_EDGES = [
    (0x0000, "ramp"), (0x8000, "ramp"), (0x0001, "min"), (0x0001, "max"),
    (0x8001, "ramp"), (0x03FF, "alt"), (0x83FF, "random"), (0x0400, "ramp"),
    (0x7BFF, "min"), (0x7BFF, "max"), (0xFBFF, "min"), (0xFBFF, "max"),
    (0xBC00, "ramp"), (0x3C00, "alt"), (0x3555, "random"), (0x2E66, "random"),
]

# Q4_1, Q5_1: (d, m, codes)
MIN_EDGES = [
    (0x0000, 0x0000, "ramp"), (0x0000, 0xBC00, "ramp"), (0x8000, 0x8000, "ramp"),
    (0x3C00, 0x0000, "ramp"), (0x3C00, 0x8000, "alt"), (0x0001, 0x0001, "max"),
    (0x03FF, 0x83FF, "min"), (0x03FF, 0x83FF, "max"), (0x8001, 0x0400, "ramp"),
    (0x7BFF, 0x7BFF, "max"), (0x7BFF, 0xFBFF, "min"), (0x7BFF, 0xFBFF, "max"),
    (0xFBFF, 0x7BFF, "max"), (0xFBFF, 0xFBFF, "alt"), (0xBC00, 0x4000, "random"),
    (0x3555, 0xB555, "random"),
]

# 6-bit scales and minimums of Q4_K and Q5_K. The probes give sub-blocks 0..7 every value of the
# high two bits (which scale_min_k4 keeps apart for sub-blocks 4..7) with distinct low bits.
SC_PROBE = [1, 18, 35, 52, 53, 38, 23, 8]
M_PROBE = [60, 45, 30, 15, 9, 26, 43, 62]
ALL_63, ALL_0 = [63] * 8, [0] * 8
ALT_0_63, ALT_63_0 = [0, 63] * 4, [63, 0] * 4
LOW_0_HIGH_63, LOW_63_HIGH_0 = [0] * 4 + [63] * 4, [63] * 4 + [0] * 4
# Codes of the eight sub-blocks of 32 where one block mixes them.
MIXED = ["min", "max", "ramp", "alt", "random", "max", "min", "ramp"]

# Q4_K, Q5_K: (d, dmin, scales, minimums, codes); None: random 6-bit values.
K_EDGES = [
    (0x0000, 0x0000, None, None, "random"),
    (0x0000, 0x3C00, ALL_63, M_PROBE, "random"),
    (0x3C00, 0x8000, SC_PROBE, ALL_63, MIXED),
    (0x0001, 0x03FF, ALL_63, ALL_63, MIXED),
    (0x83FF, 0x8001, ALT_0_63, ALT_63_0, "max"),
    (0x7BFF, 0x7BFF, ALL_63, ALL_63, MIXED),
    (0xFBFF, 0xFBFF, LOW_0_HIGH_63, LOW_63_HIGH_0, "min"),
    (0xBC00, 0x0400, SC_PROBE, M_PROBE, "ramp"),
    (0xBC00, 0x3C00, ALL_0, ALL_0, "random"),
    (0x7BFF, 0x0000, LOW_63_HIGH_0, LOW_0_HIGH_63, "max"),
]

# Q6_K's int8 scales of its sixteen groups of 16.
I8_MIX = [-128, 127, 0, -1, 1, -128, 127, 64, -64, 127, -128, 2, -2, 0, 127, -128]
I8_ALT = [-128, 127] * 8
I8_RAMP = [-128, -111, -94, -77, -60, -43, -26, -9, 8, 25, 42, 59, 76, 93, 110, 127]
# Q6_K: (d, scales, codes); None: random scales.
Q6_K_EDGES = [
    (0x0000, None, "random"),
    (0x8000, I8_MIX, MIXED),
    (0x0001, [127] * 16, "max"),
    (0x03FF, [-128] * 16, "min"),
    (0x7BFF, I8_ALT, MIXED),
    (0xFBFF, [-128] * 16, "min"),
    (0xFBFF, [127] * 16, "max"),
    (0x8001, I8_MIX, "max"),
    (0xBC00, I8_RAMP, "ramp"),
    (0x0400, [0] * 16, "random"),
]


def codes(rng: np.random.Generator, pattern, lo: int, hi: int, n: int) -> np.ndarray:
    """n quantised values in lo..=hi: all the lowest, all the highest, both in turn, a ramp that
    visits every value (or for wide ranges both ends and the middle), random; or a list of those
    for successive sub-blocks of 32."""
    if isinstance(pattern, list):
        return np.concatenate([codes(rng, p, lo, hi, n // len(pattern)) for p in pattern])
    if pattern == "min":
        return np.full(n, lo)
    if pattern == "max":
        return np.full(n, hi)
    if pattern == "alt":
        return np.where(np.arange(n) % 2 == 0, lo, hi)
    if pattern == "random":
        return rng.integers(lo, hi + 1, size=n)
    assert pattern == "ramp"
    if hi - lo + 1 <= n:
        return lo + np.arange(n) % (hi - lo + 1)
    mid = (lo + hi + 1) // 2
    return np.concatenate([np.arange(lo, lo + n // 4), np.arange(mid - n // 4, mid + n // 4),
                           np.arange(hi + 1 - n // 4, hi + 1)])


def f16(bits: int) -> np.ndarray:
    return np.array([bits], dtype="<u2").view(np.uint8)


def nibbles(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    return ((low & 15) | ((high & 15) << 4)).astype(np.uint8)


def high_bits(q: np.ndarray) -> np.ndarray:
    """Q5_0 and Q5_1: bit 4 of value i in bit i of a u32."""
    return np.array([sum(int((v >> 4) & 1) << i for i, v in enumerate(q))], dtype="<u4").view(np.uint8)


def scale_min_k4(sc, m) -> np.ndarray:
    out = np.zeros(12, dtype=np.uint8)
    for j in range(4):
        out[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6)
        out[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6)
        out[j + 8] = (sc[j + 4] & 15) | ((m[j + 4] & 15) << 4)
    return out


def k4_nibbles(q: np.ndarray) -> np.ndarray:
    """Q4_K and Q5_K: 64 values a chunk, the first 32 in the low nibbles."""
    return np.concatenate([nibbles(q[c:c + 32], q[c + 32:c + 64]) for c in range(0, 256, 64)])


def edge_blocks(rng: np.random.Generator, qtype: T) -> np.ndarray:
    out = []
    if qtype == T.F16:
        return np.array(F16_EDGES, dtype="<u2").view(np.uint8)
    if qtype in (T.Q8_0, T.Q4_0, T.Q5_0):
        lo, hi = {T.Q8_0: (-128, 127), T.Q4_0: (0, 15), T.Q5_0: (0, 31)}[qtype]
        for d, pattern in SYMMETRIC_EDGES:
            q = codes(rng, pattern, lo, hi, 32)
            if qtype == T.Q8_0:
                out.append([f16(d), q.astype(np.int8).view(np.uint8)])
            elif qtype == T.Q4_0:
                out.append([f16(d), nibbles(q[:16], q[16:])])
            else:
                out.append([f16(d), high_bits(q), nibbles(q[:16], q[16:])])
    elif qtype in (T.Q4_1, T.Q5_1):
        for d, m, pattern in MIN_EDGES:
            q = codes(rng, pattern, 0, 15 if qtype == T.Q4_1 else 31, 32)
            if qtype == T.Q4_1:
                out.append([f16(d), f16(m), nibbles(q[:16], q[16:])])
            else:
                out.append([f16(d), f16(m), high_bits(q), nibbles(q[:16], q[16:])])
    elif qtype in (T.Q4_K, T.Q5_K):
        for d, dmin, sc, m, pattern in K_EDGES:
            sc = rng.integers(0, 64, 8) if sc is None else np.array(sc)
            m = rng.integers(0, 64, 8) if m is None else np.array(m)
            q = codes(rng, pattern, 0, 15 if qtype == T.Q4_K else 31, 256)
            head = [f16(d), f16(dmin), scale_min_k4(sc, m)]
            if qtype == T.Q4_K:
                out.append(head + [k4_nibbles(q)])
            else:
                # bit 4 of value 32 s + l in bit s of qh[l]
                qh = sum(((q[s * 32:(s + 1) * 32] >> 4) & 1) << s for s in range(8))
                out.append(head + [qh.astype(np.uint8), k4_nibbles(q)])
    else:
        assert qtype == T.Q6_K
        for d, scales, pattern in Q6_K_EDGES:
            scales = rng.integers(-128, 128, 16) if scales is None else np.array(scales)
            q = codes(rng, pattern, 0, 63, 256)
            ql, qh = np.zeros(128, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
            # value 128 h + 32 k + l: nibble k >> 1 of ql[64 h + 32 (k & 1) + l], bits 2 k of
            # qh[32 h + l]
            for h in range(2):
                for k in range(4):
                    v = q[128 * h + 32 * k:128 * h + 32 * (k + 1)]
                    ql[64 * h + 32 * (k & 1):][:32] |= ((v & 15) << (4 * (k >> 1))).astype(np.uint8)
                    qh[32 * h:][:32] |= ((v >> 4) << (2 * k)).astype(np.uint8)
            out.append([ql, qh, scales.astype(np.int8).view(np.uint8), f16(d)])
    return np.concatenate([np.concatenate(b) for b in out])


def write(qtype: T, blocks: np.ndarray) -> None:
    assert blocks.dtype == np.uint8, qtype.name
    blocks = blocks.reshape(1, -1)
    values = dequantize(blocks, qtype).astype(np.float32)
    assert np.isfinite(values).all(), qtype.name
    name = qtype.name.lower()
    blocks.tofile(os.path.join(OUT, f"{name}.blocks"))
    values.tofile(os.path.join(OUT, f"{name}.values"))


def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    rng = np.random.default_rng(20261203)
    edge_rng = np.random.default_rng(20261204)
    src = source_values(rng)
    src.tofile(os.path.join(OUT, "source"))
    for qtype in (T.F16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):
        # (gguf gives F16 as float16: its bytes)
        blocks = quantize(src.reshape(1, -1), qtype).view(np.uint8).reshape(-1)
        write(qtype, np.concatenate([blocks, edge_blocks(edge_rng, qtype)]))
    for qtype in (T.Q4_K, T.Q6_K, T.Q5_K):
        blocks = random_k_blocks(rng, qtype, 8).reshape(-1)
        write(qtype, np.concatenate([blocks, edge_blocks(edge_rng, qtype)]))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
