"""Per-block int8 quantization of activations (llama.cpp's Q8_1), done by one warp per block.

Layout: `xq8` int8 [M, cols] (the GEMV reads it as uint32 words), `xs` float32 [M, 2 * nb]:
`xs[m, 2b] = dx = amax / 127` and `xs[m, 2b + 1] = dx * sum(q)`, with
`q = clamp(floor(x / dx + 0.5), -127, 127)` computed as `x * (1 / dx)`.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32

from ninfer.gpu.cuda.kernels.intrinsics import (
    SIMULATOR, device, grid_dep_launch, grid_dep_wait, group_max, group_sum, warp_max, warp_sum,
)
from ninfer.gpu.cuda.kernels.jit import compiled
from ninfer.gpu.cuda.kernels.pdl import aware


@device
def store_q8(v, valid, xq8, xs, m, blk, lane):
    """Quantize the warp's 32 values (lane i holds element 32 blk + i) into row m.

    Called by every thread of the block the same number of times (the reductions need it);
    `valid` (warp-uniform) says whether this warp's block exists.
    """
    amax = warp_max(abs(v))
    d = amax / float32(127.0)
    inv = float32(1.0) / d if d > float32(0.0) else float32(0.0)
    q = int32(math.floor(v * inv + float32(0.5)))
    q = min(max(q, -127), 127)
    total = warp_sum(float32(q))
    if not valid:
        return
    xq8[m, 32 * blk + lane] = q
    if lane == 0:
        xs[m, 2 * blk] = d
        xs[m, 2 * blk + 1] = d * total


@device
def quantize_quad(v0, v1, v2, v3):
    """Four consecutive columns, held by one thread of 8 aligned lanes that together hold one
    32-column block: (q0, q1, q2, q3, dx, dx * sum(q) of the block). Every lane of the 8 must
    call it (3-step shuffles for the block's max and code sum)."""
    amax = group_max(max(max(abs(v0), abs(v1)), max(abs(v2), abs(v3))), 8)
    d = amax / float32(127.0)
    inv = float32(1.0) / d if d > float32(0.0) else float32(0.0)
    q0 = min(max(int32(math.floor(v0 * inv + float32(0.5))), -127), 127)
    q1 = min(max(int32(math.floor(v1 * inv + float32(0.5))), -127), 127)
    q2 = min(max(int32(math.floor(v2 * inv + float32(0.5))), -127), 127)
    q3 = min(max(int32(math.floor(v3 * inv + float32(0.5))), -127), 127)
    total = group_sum(float32(q0 + q1 + q2 + q3), 8)
    return q0, q1, q2, q3, d, d * total


def quantize_q8_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """numpy twin of `store_q8` over whole rows: (xq8 int8 [M, cols], xs float32 [M, 2 nb])."""
    x = np.asarray(x, np.float32)
    m, cols = x.shape
    b = x.reshape(m, cols // 32, 32)
    d = np.abs(b).max(axis=-1) / np.float32(127.0)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
    q = np.clip(np.floor(b * inv[..., None] + np.float32(0.5)), -127, 127).astype(np.int8)
    xs = np.empty((m, 2 * (cols // 32)), np.float32)
    xs[:, 0::2] = d
    xs[:, 1::2] = d * q.astype(np.float32).sum(axis=-1)
    return q.reshape(m, cols), xs


def dequantize_q8_ref(xq8: np.ndarray, xs: np.ndarray) -> np.ndarray:
    """The real numbers the quantized activations stand for (float64)."""
    m, cols = xq8.shape
    return (xq8.reshape(m, -1, 32).astype(np.float64) * xs[:, 0::2, None]).reshape(m, cols)


THREADS = 64 if SIMULATOR else 256


def make_quantize_rows(threads: int = THREADS):
    nwarps = threads // 32

    @aware
    def quantize_rows(x, xq8, xs, num_cols):
        """Row blockIdx.x of float32 x[:, :num_cols] -> int8 blocks (one warp per block; the
        grid's y blocks take turns of `nwarps` blocks: a long row is many blocks' work, not
        one block's loop of dependent loads)."""
        grid_dep_launch()
        grid_dep_wait()
        m = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        lane = tid % 32
        nb = num_cols // 32
        for it in range(cuda.blockIdx.y, (nb + nwarps - 1) // nwarps, cuda.gridDim.y):
            blk = it * nwarps + tid // 32
            valid = blk < nb
            v = x[m, 32 * blk + lane] if valid else float32(0.0)
            store_q8(v, valid, xq8, xs, m, blk, lane)

    return quantize_rows


@compiled
def quantize_rows_kernel(threads: int):
    return cuda.jit(make_quantize_rows(threads))


def quantize_rows(x, xq8, xs, num_rows, num_cols, stream=0, threads=THREADS) -> None:
    turns = -(-(num_cols // 32) // (threads // 32))
    quantize_rows_kernel(threads)[(num_rows, turns), threads, stream](x, xq8, xs, num_cols)


def ptx_cases():
    from numba import types

    f2 = types.float32[:, ::1]
    return [("quantize_rows", make_quantize_rows(), (f2, types.int8[:, ::1], f2, types.int32))]
