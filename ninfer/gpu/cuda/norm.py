"""RMSNorm, optionally fused with the residual add before it and the int8 quantization after.

`rmsnorm(x, res, w, eps, rows, out, xs, ...)`, one block per output row i reading source row
`src = rows[i]` (the LM head gathers each sampled row's last token) or `i`:

    if has_res: x[src] += res[src]             (written back: the residual stream)
    y = x[src] * (1 / sqrt(mean(x[src]^2) + eps)) * w
    mode f32: out[i] = y;  mode q8: out (int8) / xs[i] = quantize(y)   (act_quant.py)
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, types

from ninfer.gpu.cuda.act_quant import quantize_q8_ref, store_q8
from ninfer.gpu.cuda.intrinsics import SIMULATOR, block_sum

THREADS = 64 if SIMULATOR else 256


def make_rmsnorm(mode: str, threads: int = THREADS):
    nwarps = threads // 32

    def rmsnorm(x, res, w, eps, rows, out, xs, has_res, has_rows):
        i = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        scratch = cuda.shared.array(33, float32)
        src = rows[i] if has_rows else i
        d = x.shape[1]
        ss = float32(0.0)
        for c in range(tid, d, threads):
            v = x[src, c]
            if has_res:
                v += res[src, c]
                x[src, c] = v
            ss += v * v
        total = block_sum(ss, scratch)
        r = float32(1.0) / math.sqrt(total / float32(d) + eps)
        if mode == "f32":
            for c in range(tid, d, threads):
                out[i, c] = x[src, c] * r * w[c]
        else:
            lane = tid % 32
            nb = d // 32
            for it in range((nb + nwarps - 1) // nwarps):
                blk = it * nwarps + tid // 32
                valid = blk < nb
                c = 32 * blk + lane
                v = x[src, c] * r * w[c] if valid else float32(0.0)
                store_q8(v, valid, out, xs, i, blk, lane)

    return rmsnorm


@functools.cache
def rmsnorm_kernel(mode: str, threads: int = THREADS):
    return cuda.jit(make_rmsnorm(mode, threads))


def rmsnorm(x, res, w, eps, rows, out, xs, num_rows, mode, has_res, has_rows, stream=0, threads=THREADS) -> None:
    """Launch over `num_rows` output rows. Every array argument must be given (device arrays
    on the GPU: a host array would be copied per launch); the flags say which ones count."""
    rmsnorm_kernel(mode, threads)[num_rows, threads, stream](x, res, w, np.float32(eps), rows, out, xs, has_res, has_rows)


def rmsnorm_ref(x, res, w, eps, rows, mode):
    """numpy twin: returns (new x, out[, xs]) without touching the inputs."""
    x = np.array(x, np.float32, copy=True)
    if res is not None:
        x += res
    src = x if rows is None else x[rows]
    mean_sq = np.mean(np.square(src), axis=-1, keepdims=True)
    y = src * (1.0 / np.sqrt(mean_sq + np.float32(eps))).astype(np.float32) * w
    if mode == "f32":
        return x, y
    return (x, *quantize_q8_ref(y))


def ptx_cases():
    f2 = types.float32[:, ::1]
    i8 = types.int8[:, ::1]
    sig = lambda o: (f2, f2, types.float32[::1], types.float32, types.int32[::1], o, f2, types.boolean, types.boolean)  # noqa: E731
    return [("rmsnorm_f32", make_rmsnorm("f32"), sig(f2)), ("rmsnorm_q8", make_rmsnorm("q8"), sig(i8))]
