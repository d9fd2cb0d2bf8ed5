"""Matrix products over stored weights: `y[T, out] = x[T, in] @ W[out, in].T`, W read in place.

Quantized W, llama.cpp's CPU scheme: each activation row is quantized per 32-block to int8
codes xq = round(x / xd), xd = max|x| / 127 (`quantize_rows`; the block sums xs = xd sum(xq)
serve the types with a min), and every 32-block of a weight row is dotted with them in
integers (`blocks.block_dot`):

    y[t, o] = sum_b  scale_b xd[t, b] (codes_b . xq[t]_b)  +  low_b xs[t, b]

which is exactly dequantize(xq) @ dequantize(W).T, up to float32 rounding of the sum over
blocks (the tests hold the kernel to that). A weight row (a few KB) is read from memory once
and stays in L1 while every activation row of the batch takes its dot: a few rows re-decode
its blocks as they go, a larger batch decodes it once to int16 codes first. Both paths give
the same integer block dots, so a row gets the same result batched as alone, to float32
rounding of the sum over blocks.

F16 / BF16 W: each row is widened to float32 once and dotted with float activations. F32 W
goes to BLAS.

Threads split the output rows into one contiguous range each (`num_threads`: the caller
passes `numba.get_num_threads()`, which a disk-cached function may not call itself).

Codegen: each block is read into one `<32 x i16>` codes vector and dotted into an 8-lane
float accumulator (`simd.py`, LLVM vector IR: vpmaddwd + vcvtdq2ps + vfmadd on AVX2), reduced
once per row. The SLP vectorizer stays on for the scalar kernels here (it changes code
generation, not results). Prefill products do not come here: `matrix.py` hands them to BLAS
over rows `dequantize_rows` decodes into a scratch.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from ninfer.cpu.blocks import _signed, block_header
from ninfer.cpu.simd import (
    acc_sum, acc_zero, codes_dequantize, codes_fifth_bits, codes_int8, codes_load, codes_nibbles, codes_q6k, codes_shifted,
    codes_store, dot_acc,
)

numba.config.SLP_VECTORIZE = True
# From this many activation rows a weight row is decoded once into int16 codes and reused;
# below it, the fused block dot (which decodes as it multiplies) is faster.
_DECODE_ONCE_FROM = 2


@njit(cache=True, fastmath=True)
def quantize_rows(x, xq, xd, xs):
    """Per-32-block int8 codes of float32 x [T, n] into xq int16 [T, n], scales xd and the
    quantized block sums xs = xd sum(xq), float32 [T, n / 32].

    The min term takes the quantized sum, not the float one: its rounding error then meets the
    whole centred weight (scale q + low), not only the unsigned code part (scale q), several
    times larger."""
    for t in range(x.shape[0]):
        for b in range(x.shape[1] // 32):
            amax = np.float32(0.0)
            for j in range(b * 32, b * 32 + 32):
                amax = max(amax, abs(x[t, j]))
            d = amax / np.float32(127.0)
            inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
            total = 0
            for j in range(b * 32, b * 32 + 32):
                code = np.int16(np.rint(x[t, j] * inv))
                xq[t, j] = code
                total += code
            xd[t, b] = d
            xs[t, b] = d * np.float32(total)


@njit(inline="always")
def block_codes(src, qtype, b, table):
    """(codes, scale, low) of 32-block b of a stored row: weight j = scale * codes[j] + low,
    codes as a `simd.Codes` vector (Q4_0 / Q5_0 read unsigned, their offset moved into low)."""
    c0, c1, scale, low = block_header(src, qtype, b, table)
    if qtype <= 3:
        codes = codes_nibbles(src, c0)
        if qtype >= 2:
            codes = codes_fifth_bits(codes, c1)
        if qtype == 0:
            low = np.float32(-8.0) * scale
        elif qtype == 2:
            low = np.float32(-16.0) * scale
    elif qtype == 4:
        codes = codes_int8(src, c0)
    elif qtype == 5:
        codes = codes_shifted(src, c0, c1)
    else:  # Q6_K: see blocks.block_code; quarter c1 of the super-block at c0
        h, r = c1 >> 2, (c1 & 3) * 32
        at = c0 + 192 + c1 * 2
        codes = codes_q6k(src, c0 + h * 64 + (r & 63), 4 * (r >> 6), c0 + 128 + h * 32, 2 * (c1 & 3),
                          np.int64(_signed(src[at])), np.int64(_signed(src[at + 1])))  # fmt: skip
    return codes, scale, low


@njit(inline="always", fastmath=True)
def _rows(xq, xd, xs, data, qtype, table, out, col0, lo, hi):
    num_tokens, n = xq.shape
    nb = n // 32
    if num_tokens < _DECODE_ONCE_FROM:  # each token re-reads the block's bytes (in L1)
        for o in range(lo, hi):
            src = data[o]
            for t in range(num_tokens):
                x = xq[t]
                acc, low_sum = acc_zero(), np.float32(0.0)
                for b in range(nb):
                    codes, scale, low = block_codes(src, qtype, b, table)
                    acc = dot_acc(acc, codes, x, b * 32, scale * xd[t, b])
                    low_sum += low * xs[t, b]
                out[t, col0 + o] = acc_sum(acc) + low_sum
        return
    codes_buf = np.empty(n, np.int16)  # batches and prefill: decode each row once, dot every token
    scales, lows = np.empty(nb, np.float32), np.empty(nb, np.float32)
    for o in range(lo, hi):
        src = data[o]
        for b in range(nb):
            codes, scales[b], lows[b] = block_codes(src, qtype, b, table)
            codes_store(codes_buf, b * 32, codes)
        for t in range(num_tokens):
            x = xq[t]
            acc, low_sum = acc_zero(), np.float32(0.0)
            for b in range(nb):
                acc = dot_acc(acc, codes_load(codes_buf, b * 32), x, b * 32, scales[b] * xd[t, b])
                low_sum += lows[b] * xs[t, b]
            out[t, col0 + o] = acc_sum(acc) + low_sum


# One compiled row loop per type, each with its type code constant, so each holds only its own
# decoder. They must stay separate functions: inlined into one dispatching function, the seven
# copies make a function LLVM no longer vectorizes (4x slower on a decode step).
@njit(cache=True, fastmath=True)
def _rows_q4_0(xq, xd, xs, data, table, out, col0, lo, hi):
    _rows(xq, xd, xs, data, 0, table, out, col0, lo, hi)


@njit(cache=True, fastmath=True)
def _rows_q4_1(xq, xd, xs, data, table, out, col0, lo, hi):
    _rows(xq, xd, xs, data, 1, table, out, col0, lo, hi)


@njit(cache=True, fastmath=True)
def _rows_q5_0(xq, xd, xs, data, table, out, col0, lo, hi):
    _rows(xq, xd, xs, data, 2, table, out, col0, lo, hi)


@njit(cache=True, fastmath=True)
def _rows_q5_1(xq, xd, xs, data, table, out, col0, lo, hi):
    _rows(xq, xd, xs, data, 3, table, out, col0, lo, hi)


@njit(cache=True, fastmath=True)
def _rows_q8_0(xq, xd, xs, data, table, out, col0, lo, hi):
    _rows(xq, xd, xs, data, 4, table, out, col0, lo, hi)


@njit(cache=True, fastmath=True)
def _rows_q4_k(xq, xd, xs, data, table, out, col0, lo, hi):
    _rows(xq, xd, xs, data, 5, table, out, col0, lo, hi)


@njit(cache=True, fastmath=True)
def _rows_q6_k(xq, xd, xs, data, table, out, col0, lo, hi):
    _rows(xq, xd, xs, data, 6, table, out, col0, lo, hi)


@njit(parallel=True, cache=True)
def gemm_q8(xq, xd, xs, data, qtype, table, out, col0, num_threads):
    """out[:, col0 + o] = the q8 product of every activation row with stored row o of `data`
    (uint8 [rows, bytes per row], type code `qtype`); xq / xd / xs from `quantize_rows`."""
    num_rows = data.shape[0]
    num_threads = max(1, min(num_threads, num_rows))
    for tid in prange(num_threads):
        lo, hi = tid * num_rows // num_threads, (tid + 1) * num_rows // num_threads
        if qtype == 0:
            _rows_q4_0(xq, xd, xs, data, table, out, col0, lo, hi)
        elif qtype == 1:
            _rows_q4_1(xq, xd, xs, data, table, out, col0, lo, hi)
        elif qtype == 2:
            _rows_q5_0(xq, xd, xs, data, table, out, col0, lo, hi)
        elif qtype == 3:
            _rows_q5_1(xq, xd, xs, data, table, out, col0, lo, hi)
        elif qtype == 4:
            _rows_q8_0(xq, xd, xs, data, table, out, col0, lo, hi)
        elif qtype == 5:
            _rows_q4_k(xq, xd, xs, data, table, out, col0, lo, hi)
        else:
            _rows_q6_k(xq, xd, xs, data, table, out, col0, lo, hi)


@njit(parallel=True, cache=True)
def dequantize_rows(data, qtype, table, out, lo, hi, num_threads):
    """out[o - lo] = float32 weights of stored row o (type code `qtype`), o in lo .. hi - 1:
    bit for bit what gguf's dequantizer gives. Prefill products dequantize a chunk of rows
    into a small scratch and hand it to BLAS."""
    n = out.shape[1]
    num_rows = hi - lo
    num_threads = max(1, min(num_threads, num_rows))
    for tid in prange(num_threads):
        for o in range(lo + tid * num_rows // num_threads, lo + (tid + 1) * num_rows // num_threads):
            src, row = data[o], out[o - lo]
            for b in range(n // 32):
                codes, scale, low = block_codes(src, qtype, b, table)
                codes_dequantize(row, b * 32, codes, scale, low)


@njit(cache=True, fastmath=True)
def _half_rows(x, bits, is_bf16, table, out, col0, lo, hi):
    """Rows lo .. hi - 1 of `gemm_half`."""
    num_tokens, n = x.shape
    wide = np.empty(n, np.uint32)
    w = wide.view(np.float32)
    for o in range(lo, hi):
        if is_bf16:
            for j in range(n):
                wide[j] = np.uint32(bits[o, j]) << 16
        else:
            for j in range(n):
                w[j] = table[bits[o, j]]
        for t in range(num_tokens):
            acc = np.float32(0.0)
            for j in range(n):
                acc += w[j] * x[t, j]
            out[t, col0 + o] = acc


@njit(parallel=True, cache=True)
def gemm_half(x, bits, is_bf16, table, out, col0, num_threads):
    """out[:, col0 + o] = x @ W[o] for W stored as F16 or BF16 bits (uint16 [rows, n])."""
    num_rows = bits.shape[0]
    num_threads = max(1, min(num_threads, num_rows))
    for tid in prange(num_threads):
        lo, hi = tid * num_rows // num_threads, (tid + 1) * num_rows // num_threads
        _half_rows(x, bits, is_bf16, table, out, col0, lo, hi)


def quantize_rows_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """numpy twin of `quantize_rows`: (xq int16 [T, n], xd, xs float32 [T, n / 32])."""
    blocks = np.asarray(x, np.float32).reshape(x.shape[0], -1, 32)
    d = np.abs(blocks).max(axis=-1) / np.float32(127.0)
    inv = np.divide(np.float32(1.0), d, out=np.zeros_like(d), where=d > 0)
    codes = np.rint(blocks * inv[..., None])
    return codes.reshape(x.shape).astype(np.int16), d, (d * codes.sum(-1)).astype(np.float32)
