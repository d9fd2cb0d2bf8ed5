"""GGML block quantizations, read a 32-weight block at a time from a stored row (uint8 bytes).

Each supported type is described by two pieces:

* `block_header(src, qtype, b, table)` -> (c0, c1, scale, low): the block's float scale and
  additive term (min), and two integers the codes are read with (a byte offset, high bits or
  a shift, depending on the type);
* `block_code(src, qtype, c0, c1, j)` -> the integer code of weight j (0 .. 31),

such that weight j is exactly `scale * code_j + low`, bit for bit what gguf's numpy
dequantizer gives (the formats are those of `gguf.quants`; the tests check every type).
K-quant super-blocks of 256 weights are read as their eight 32-blocks; Q6_K's per-16 int8
scales are folded into its codes. fp16 scales are read through a 65,536-entry float32 table.

`block_dot` (integer dot of a block with activation codes) and `decode_block` (the codes into
a buffer) are the two uses, both straight-line integer code once their 32-step loops unroll,
which LLVM's SLP vectorizer packs into AVX2 lanes (`gemm.py` turns it on). The dot reads the
4- and 5-bit types a byte (two weights) at a time and takes their offset out of the sum, the
form the vectorizer packs best (about 4x faster than per-weight codes there).
"""

from __future__ import annotations

import numpy as np
from numba import njit

# Type codes the kernels dispatch on (each kernel is specialized per code), and bytes /
# weights per stored block of each.
QTYPES = {"Q4_0": 0, "Q4_1": 1, "Q5_0": 2, "Q5_1": 3, "Q8_0": 4, "Q4_K": 5, "Q6_K": 6}
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q4_K": 144, "Q6_K": 210}
BLOCK_WEIGHTS = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "Q4_K": 256, "Q6_K": 256}
F16_TABLE = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
_ZERO = np.float32(0.0)


@njit(inline="always")
def _f16(src, at, table):
    return table[np.int64(src[at]) | (np.int64(src[at + 1]) << 8)]


@njit(inline="always")
def _u32(src, at):
    return (np.int64(src[at]) | (np.int64(src[at + 1]) << 8)
            | (np.int64(src[at + 2]) << 16) | (np.int64(src[at + 3]) << 24))  # fmt: skip


@njit(inline="always")
def _signed(byte):
    return (np.int64(byte) ^ 128) - 128


@njit(inline="always")
def block_header(src, qtype, b, table):
    """(c0, c1, scale, low) of 32-block b of a stored row of type code `qtype`."""
    if qtype == 0:  # Q4_0: d, 16 nibble bytes (low nibbles weights 0..15); w = d (q - 8)
        return b * 18 + 2, 0, _f16(src, b * 18, table), _ZERO
    if qtype == 1:  # Q4_1: d, m, nibbles; w = d q + m
        return b * 20 + 4, 0, _f16(src, b * 20, table), _f16(src, b * 20 + 2, table)
    if qtype == 2:  # Q5_0: d, 32 fifth bits, nibbles; w = d (q - 16)
        return b * 22 + 6, _u32(src, b * 22 + 2), _f16(src, b * 22, table), _ZERO
    if qtype == 3:  # Q5_1: d, m, fifth bits, nibbles; w = d q + m
        return b * 24 + 8, _u32(src, b * 24 + 4), _f16(src, b * 24, table), _f16(src, b * 24 + 2, table)
    if qtype == 4:  # Q8_0: d, 32 int8 codes; w = d q
        return b * 34 + 2, 0, _f16(src, b * 34, table), _ZERO
    if qtype == 5:  # Q4_K: d, dmin, 12 bytes of 6-bit (scale, min) pairs, 128 nibble bytes
        at, j = (b >> 3) * 144, b & 7  # bytes 32c .. 32c + 31: block 2c low nibbles, 2c + 1 high
        s = at + 4
        if j < 4:
            sc, mn = np.int64(src[s + j]) & 63, np.int64(src[s + j + 4]) & 63
        else:
            sc = (np.int64(src[s + j + 4]) & 15) | ((np.int64(src[s + j - 4]) >> 6) << 4)
            mn = (np.int64(src[s + j + 4]) >> 4) | ((np.int64(src[s + j]) >> 6) << 4)
        scale, low = _f16(src, at, table) * np.float32(sc), -_f16(src, at + 2, table) * np.float32(mn)
        return at + 16 + 32 * (j >> 1), 4 * (j & 1), scale, low
    # Q6_K: 128 low-nibble bytes, 64 bytes of 2-bit highs, 16 int8 scales, d
    return (b >> 3) * 210, b & 7, _f16(src, (b >> 3) * 210 + 208, table), _ZERO


@njit(inline="always")
def block_code(src, qtype, c0, c1, j):
    """The integer code of weight j of the block `block_header` described by (c0, c1)."""
    if qtype == 0 or qtype == 1:
        return ((np.int64(src[c0 + (j & 15)]) >> (4 * (j >> 4))) & 15) - (8 if qtype == 0 else 0)
    if qtype == 2 or qtype == 3:
        nibble = (np.int64(src[c0 + (j & 15)]) >> (4 * (j >> 4))) & 15
        return (nibble | (((c1 >> j) & 1) << 4)) - (16 if qtype == 2 else 0)
    if qtype == 4:
        return _signed(src[c0 + j])
    if qtype == 5:
        return (np.int64(src[c0 + j]) >> c1) & 15
    # Q6_K, block (super-block at c0, quarter c1): weight e = 32 c1 + j of the super-block lies
    # in half h = e / 128; with r = e mod 128, its low nibble is byte 64h + r mod 64 (shift
    # 4 (r / 64)), its high bits byte 128 + 32h + r mod 32 (shift 2 (r / 32)), its scale byte
    # 192 + e / 16; w = d sc (q - 32).
    h, r = c1 >> 2, (c1 & 3) * 32 + j
    low = (np.int64(src[c0 + h * 64 + (r & 63)]) >> (4 * (r >> 6))) & 15
    high = (np.int64(src[c0 + 128 + h * 32 + (r & 31)]) >> (2 * (r >> 5))) & 3
    return _signed(src[c0 + 192 + c1 * 2 + (j >> 4)]) * ((low | (high << 4)) - 32)


@njit(inline="always")
def block_dot(src, qtype, b, x, xo, table):
    """(isum, scale, low) of block b against the integer codes x[xo .. xo + 31]:
    isum = sum_j code_j x_j."""
    c0, c1, scale, low = block_header(src, qtype, b, table)
    isum = 0
    if qtype <= 3:  # 4- and 5-bit: byte k holds weights k and k + 16; the offset comes out last
        xsum = 0
        for k in range(16):
            q = np.int64(src[c0 + k])
            lo, hi = q & 15, q >> 4
            if qtype >= 2:
                lo |= ((c1 >> k) & 1) << 4
                hi |= ((c1 >> (k + 16)) & 1) << 4
            isum += lo * x[xo + k] + hi * x[xo + 16 + k]
            if qtype == 0 or qtype == 2:
                xsum += x[xo + k] + x[xo + 16 + k]
        return isum - (8 if qtype == 0 else 16 if qtype == 2 else 0) * xsum, scale, low
    for j in range(32):
        isum += block_code(src, qtype, c0, c1, j) * x[xo + j]
    return isum, scale, low


@njit(inline="always")
def decode_block(src, qtype, b, table, codes, co):
    """Block b's codes into codes[co .. co + 31] (int16); returns (scale, low)."""
    c0, c1, scale, low = block_header(src, qtype, b, table)
    for j in range(32):
        codes[co + j] = block_code(src, qtype, c0, c1, j)
    return scale, low
