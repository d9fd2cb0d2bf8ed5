"""GGML block quantizations, read a 32-weight block at a time from a stored row (uint8 bytes).

`block_header(src, base, qtype, b, table)` -> (c0, c1, scale, low) describes 32-block b of
a stored row: its float scale and additive term (min), and two integers its codes are read
with (a byte offset, high bits or a shift, depending on the type). `gemm.block_codes` reads
the codes as one vector; weight j is exactly `scale * code_j + low`, bit for bit what gguf's
numpy dequantizer gives (the formats are those of `gguf.quants`; the tests check every type).
K-quant super-blocks of 256 weights are read as their eight 32-blocks. fp16 scales go through
`simd.half` (F16C, else a 65,536-entry float32 table).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ninfer.cpu.simd import half

# Type codes the kernels dispatch on (each kernel is specialized per code), and bytes /
# weights per stored block of each.
QTYPES = {"Q4_0": 0, "Q4_1": 1, "Q5_0": 2, "Q5_1": 3, "Q8_0": 4, "Q4_K": 5, "Q6_K": 6}
SIGNED_QTYPES = (4, 6)  # codes read signed (Q8_0, Q6_K); the others unsigned
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q4_K": 144, "Q6_K": 210}
BLOCK_WEIGHTS = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "Q4_K": 256, "Q6_K": 256}
F16_TABLE = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
_ZERO = np.float32(0.0)


@njit(inline="always")
def _u32(src, at):
    return (np.int64(src[at]) | (np.int64(src[at + 1]) << 8)
            | (np.int64(src[at + 2]) << 16) | (np.int64(src[at + 3]) << 24))  # fmt: skip


@njit(inline="always")
def _signed(byte):
    return (np.int64(byte) ^ 128) - 128


@njit(inline="always")
def block_header(src, base, qtype, b, table):
    """(c0, c1, scale, low) of 32-block b of the stored row of type code `qtype` whose bytes
    start at src[base] (src: the whole matrix, flat, so no row view is made per row)."""
    if qtype == 0:  # Q4_0: d, 16 nibble bytes (low nibbles weights 0..15); w = d (q - 8)
        at = base + b * 18
        return at + 2, 0, half(src, at, table), _ZERO
    if qtype == 1:  # Q4_1: d, m, nibbles; w = d q + m
        at = base + b * 20
        return at + 4, 0, half(src, at, table), half(src, at + 2, table)
    if qtype == 2:  # Q5_0: d, 32 fifth bits, nibbles; w = d (q - 16)
        at = base + b * 22
        return at + 6, _u32(src, at + 2), half(src, at, table), _ZERO
    if qtype == 3:  # Q5_1: d, m, fifth bits, nibbles; w = d q + m
        at = base + b * 24
        return at + 8, _u32(src, at + 4), half(src, at, table), half(src, at + 2, table)
    if qtype == 4:  # Q8_0: d, 32 int8 codes; w = d q
        at = base + b * 34
        return at + 2, 0, half(src, at, table), _ZERO
    if qtype == 5:  # Q4_K: d, dmin, 12 bytes of 6-bit (scale, min) pairs, 128 nibble bytes
        at, j = base + (b >> 3) * 144, b & 7  # bytes 32c .. 32c + 31: block 2c low nibbles, 2c + 1 high
        s = at + 4
        if j < 4:
            sc, mn = np.int64(src[s + j]) & 63, np.int64(src[s + j + 4]) & 63
        else:
            sc = (np.int64(src[s + j + 4]) & 15) | ((np.int64(src[s + j - 4]) >> 6) << 4)
            mn = (np.int64(src[s + j + 4]) >> 4) | ((np.int64(src[s + j]) >> 6) << 4)
        scale, low = half(src, at, table) * np.float32(sc), -half(src, at + 2, table) * np.float32(mn)
        return at + 16 + 32 * (j >> 1), 4 * (j & 1), scale, low
    # Q6_K: 128 low-nibble bytes, 64 bytes of 2-bit highs, 16 int8 scales, d
    at = base + (b >> 3) * 210
    return at, b & 7, half(src, at + 208, table), _ZERO
