"""Dequantization in registers: four weights at a time, for every device weight type.

`DQ_WORD[qtype](qs, d16, aux, sc8, row, blk, j)` returns elements 4j .. 4j+3 (j = 0..7) of
32-element block `blk` of `row` as four float32, from the planes of `quant_layout`. The float
formulas follow gguf's numpy dequantizers operation by operation. Users: the prefill GEMM's
tile loader, the float-activation GEMV, and the embedding gather. `dequantize_rows` is a
kernel over whole matrices (tests, debugging); its reference is `StoredTensor.dequantize`.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32, uint32

from ninfer.gpu.cuda.kernels.intrinsics import bits_to_f32, device

LOW_NIBBLES = 0x0F0F0F0F


@device
def byte_of(w, i):
    return (uint32(w) >> uint32(8 * i)) & uint32(0xFF)


@device
def sbyte_of(w, i):
    b = int32(byte_of(w, i))
    return b - 256 if b > 127 else b


@device
def _scaled4(w, d, bias):
    """(d * (byte_i - bias)) for the four bytes of w (the symmetric types)."""
    return (
        d * float32(int32(byte_of(w, 0)) - bias),
        d * float32(int32(byte_of(w, 1)) - bias),
        d * float32(int32(byte_of(w, 2)) - bias),
        d * float32(int32(byte_of(w, 3)) - bias),
    )


@device
def _affine4(w, d, m):
    """(d * byte_i + m) for the four bytes of w (the types with a block minimum)."""
    return (
        d * float32(byte_of(w, 0)) + m,
        d * float32(byte_of(w, 1)) + m,
        d * float32(byte_of(w, 2)) + m,
        d * float32(byte_of(w, 3)) + m,
    )


@device
def nibbles(qs, row, blk, j):
    """Word j (0..7) of a 16-byte nibble block as four bytes 0..15 (elements 4j..4j+3)."""
    w = uint32(qs[row, 4 * blk + (j & 3)])
    if j >= 4:
        w = w >> uint32(4)
    return w & uint32(LOW_NIBBLES)


@device
def spread_bits4(h):
    """Bits 0..3 of h moved to bit 4 of bytes 0..3 (the Q5 fifth bits)."""
    return ((uint32(h) * uint32(0x00204081)) & uint32(0x01010101)) << uint32(4)


@device
def dq_f32(qs, d16, aux, sc8, row, blk, j):
    c = 32 * blk + 4 * j
    return (float32(qs[row, c]), float32(qs[row, c + 1]), float32(qs[row, c + 2]), float32(qs[row, c + 3]))


@device
def dq_bf16(qs, d16, aux, sc8, row, blk, j):
    c = 32 * blk + 4 * j
    return (
        bits_to_f32(uint32(qs[row, c]) << uint32(16)),
        bits_to_f32(uint32(qs[row, c + 1]) << uint32(16)),
        bits_to_f32(uint32(qs[row, c + 2]) << uint32(16)),
        bits_to_f32(uint32(qs[row, c + 3]) << uint32(16)),
    )


@device
def dq_q4_0(qs, d16, aux, sc8, row, blk, j):
    return _scaled4(nibbles(qs, row, blk, j), float32(d16[row, blk]), 8)


@device
def dq_q4_1(qs, d16, aux, sc8, row, blk, j):
    return _affine4(nibbles(qs, row, blk, j), float32(d16[row, 2 * blk]), float32(d16[row, 2 * blk + 1]))


@device
def q5_word(qs, aux, row, blk, j):
    """Word j of a Q5 block as four bytes 0..31."""
    h = (uint32(aux[row, blk]) >> uint32(4 * j)) & uint32(0xF)
    return nibbles(qs, row, blk, j) | spread_bits4(h)


@device
def dq_q5_0(qs, d16, aux, sc8, row, blk, j):
    return _scaled4(q5_word(qs, aux, row, blk, j), float32(d16[row, blk]), 16)


@device
def dq_q5_1(qs, d16, aux, sc8, row, blk, j):
    return _affine4(q5_word(qs, aux, row, blk, j), float32(d16[row, 2 * blk]), float32(d16[row, 2 * blk + 1]))


@device
def dq_q8_0(qs, d16, aux, sc8, row, blk, j):
    w = uint32(qs[row, 8 * blk + j])
    d = float32(d16[row, blk])
    return (
        float32(sbyte_of(w, 0)) * d,
        float32(sbyte_of(w, 1)) * d,
        float32(sbyte_of(w, 2)) * d,
        float32(sbyte_of(w, 3)) * d,
    )


@device
def k4_scale_min(aux, row, sb, s):
    """6-bit (scale, min) of sub-block s (0..7) of Q4_K super-block sb (12 packed bytes)."""
    base = 3 * sb
    if s < 4:
        sc = byte_of(aux[row, base + s // 4], s % 4) & uint32(63)
        m = byte_of(aux[row, base + (s + 4) // 4], (s + 4) % 4) & uint32(63)
    else:
        hi = byte_of(aux[row, base + (s + 4) // 4], (s + 4) % 4)
        lo_s = byte_of(aux[row, base + (s - 4) // 4], (s - 4) % 4)
        lo_m = byte_of(aux[row, base + s // 4], s % 4)
        sc = (hi & uint32(0xF)) | ((lo_s >> uint32(6)) << uint32(4))
        m = (hi >> uint32(4)) | ((lo_m >> uint32(6)) << uint32(4))
    return sc, m


@device
def q4k_word(qs, row, blk, j):
    """Word j of 32-element sub-block blk of a Q4_K row as four bytes 0..15."""
    sb = blk >> 3
    s = blk & 7
    w = uint32(qs[row, 32 * sb + 8 * (s >> 1) + j])
    return (w >> uint32(4 * (s & 1))) & uint32(LOW_NIBBLES)


@device
def dq_q4_k(qs, d16, aux, sc8, row, blk, j):
    sb = blk >> 3
    sc, m = k4_scale_min(aux, row, sb, blk & 7)
    dl = float32(d16[row, 2 * sb]) * float32(sc)
    ml = float32(d16[row, 2 * sb + 1]) * float32(m)
    w = q4k_word(qs, row, blk, j)
    return (
        dl * float32(byte_of(w, 0)) - ml,
        dl * float32(byte_of(w, 1)) - ml,
        dl * float32(byte_of(w, 2)) - ml,
        dl * float32(byte_of(w, 3)) - ml,
    )


@device
def q6k_word(qs, aux, row, blk, j):
    """Word j of 32-element sub-block blk of a Q6_K row as four bytes 0..63."""
    sb = blk >> 3
    s = blk & 7
    n = s >> 2
    g = s & 3
    ql = uint32(qs[row, 32 * sb + 16 * n + 8 * (g & 1) + j])
    qh = uint32(aux[row, 16 * sb + 8 * n + j])
    lo = (ql >> uint32(4 * (g >> 1))) & uint32(LOW_NIBBLES)
    hi = (qh >> uint32(2 * g)) & uint32(0x03030303)
    return lo | (hi << uint32(4))


@device
def dq_q6_k(qs, d16, aux, sc8, row, blk, j):
    sb = blk >> 3
    ds = float32(d16[row, sb]) * float32(sc8[row, 16 * sb + 2 * (blk & 7) + (j >> 2)])
    return _scaled4(q6k_word(qs, aux, row, blk, j), ds, 32)


DQ_WORD = {
    "F32": dq_f32, "F16": dq_f32, "BF16": dq_bf16,
    "Q4_0": dq_q4_0, "Q4_1": dq_q4_1, "Q5_0": dq_q5_0, "Q5_1": dq_q5_1, "Q8_0": dq_q8_0,
    "Q4_K": dq_q4_k, "Q6_K": dq_q6_k,
}  # fmt: skip


def _make_dequantize_rows(qtype: str):
    dq = DQ_WORD[qtype]

    def dequantize_rows(qs, d16, aux, sc8, out):
        """out[r, 32b + 4j + i] = element i of word j of block b; one thread per word."""
        t = cuda.grid(1)
        num_words = out.shape[1] // 4
        row = t // num_words
        if row < out.shape[0]:
            w = t % num_words
            a, b, c, d = dq(qs, d16, aux, sc8, row, w // 8, w % 8)
            out[row, 4 * w] = a
            out[row, 4 * w + 1] = b
            out[row, 4 * w + 2] = c
            out[row, 4 * w + 3] = d

    return dequantize_rows


_KERNELS: dict[str, object] = {}


def dequantize_rows_kernel(qtype: str):
    if qtype not in _KERNELS:
        _KERNELS[qtype] = cuda.jit(_make_dequantize_rows(qtype))
    return _KERNELS[qtype]


def dequantize_rows(w, out, stream=0) -> None:
    """Launch: dequantize device weight `w` (DeviceWeight) into float32 out[rows, cols]."""
    n = out.shape[0] * out.shape[1] // 4
    dequantize_rows_kernel(w.qtype)[(n + 127) // 128, 128, stream](*w.planes, out)


def dequantize_rows_ref(stored, out: np.ndarray) -> None:
    """Reference with the same signature shape: gguf's numpy dequantizer."""
    out[...] = stored.dequantize().reshape(out.shape)


def ptx_cases():
    from numba import types

    from ninfer.gpu.cuda.device_weights import plane_types
    from ninfer.gpu.cuda.kernels.quant_layout import DEVICE_QTYPES

    return [(f"dequantize_rows_{q}", _make_dequantize_rows(q), (*plane_types(q), types.float32[:, ::1])) for q in DEVICE_QTYPES]
