"""RMSNorm, optionally fused with the residual add before it and the int8 quantization after.

`rmsnorm(x, res, w, eps, rows, out, xs, ...)`, one block per output row i reading source row
`src = rows[i]` (the LM head gathers each sampled row's last token) or `i`:

    if has_res: x[src] += res[src]             (written back: the residual stream)
    y = x[src] * (1 / sqrt(mean(x[src]^2) + eps)) * w
    mode f32: out[i] = y;  mode q8: out (int8) / xs[i] = quantize(y)   (act_quant.py)
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, types

from ninfer.gpu.cuda.kernels.act_quant import quantize_q8_ref, quantize_quad
from ninfer.gpu.cuda.kernels.intrinsics import SIMULATOR, block_sum, grid_dep_launch, grid_dep_wait, ld4_f32_pinned
from ninfer.gpu.cuda.kernels.jit import compiled
from ninfer.gpu.cuda.kernels.pdl import aware

# threads a block at most (read at launch; an A/B switch for `profile --variant`: fewer
# threads, more columns each, a block that finds room on an SM sooner beside the GEMV before)
MAX_THREADS = 64 if SIMULATOR else 1024


def plan_threads(d: int, max_threads: int | None = None) -> tuple[int, int]:
    """(threads, chunks): each thread keeps `chunks` runs of 4 consecutive columns in registers,
    so the whole row is read once, with every warp busy (d % 32 == 0)."""
    max_threads = max_threads or MAX_THREADS
    quads = d // 4
    chunks = -(-quads // max_threads)
    threads = -(-quads // chunks)
    return -(-threads // 32) * 32, chunks


def make_rmsnorm(mode: str, threads: int, chunks: int):
    """Thread t holds columns 4 (t + threads c) .. + 3 for c < chunks; in q8 mode the 8 lanes
    of an aligned lane group hold one 32-column quantization block, so the block's max and sum
    are 3-step shuffles and the whole row quantizes in one pass, without a serial loop."""
    n = 4 * chunks

    @aware
    def rmsnorm(x, res, w, eps, rows, out, xs, has_res, has_rows):
        grid_dep_launch()
        i = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        d = x.shape[1]
        wv = cuda.local.array(n, float32)
        for c in range(chunks):  # the weight is no kernel's output: requested before the PDL wait
            col = 4 * (tid + threads * c)
            for k in range(4):
                wv[4 * c + k] = w[col + k] if col < d else float32(0.0)
        grid_dep_wait()
        scratch = cuda.shared.array(33, float32)
        src = rows[i] if has_rows else i
        vals = cuda.local.array(n, float32)
        ss = float32(0.0)
        for c in range(chunks):
            col = 4 * (tid + threads * c)
            if col < d:
                v0, v1, v2, v3 = ld4_f32_pinned(x, src, col)  # coherent (pdl.py), before this thread writes
                if has_res:
                    r0, r1, r2, r3 = ld4_f32_pinned(res, src, col)
                    v0, v1, v2, v3 = v0 + r0, v1 + r1, v2 + r2, v3 + r3
                    x[src, col] = v0
                    x[src, col + 1] = v1
                    x[src, col + 2] = v2
                    x[src, col + 3] = v3
                vals[4 * c] = v0
                vals[4 * c + 1] = v1
                vals[4 * c + 2] = v2
                vals[4 * c + 3] = v3
                ss += v0 * v0 + v1 * v1 + v2 * v2 + v3 * v3
            else:
                for k in range(4):
                    vals[4 * c + k] = float32(0.0)
        total = block_sum(ss, scratch)
        r = float32(1.0) / math.sqrt(total / float32(d) + eps)
        lane = tid % 32
        for c in range(chunks):
            col = 4 * (tid + threads * c)
            valid = col < d
            for k in range(4):
                vals[4 * c + k] = vals[4 * c + k] * r * wv[4 * c + k]
            if mode == "f32":
                if valid:
                    for k in range(4):
                        out[i, col + k] = vals[4 * c + k]
            else:  # every lane takes part in the shuffles
                q0, q1, q2, q3, dq, dsum = quantize_quad(vals[4 * c], vals[4 * c + 1], vals[4 * c + 2], vals[4 * c + 3])
                if valid:
                    out[i, col], out[i, col + 1], out[i, col + 2], out[i, col + 3] = q0, q1, q2, q3
                    if lane % 8 == 0:
                        blk = col // 32
                        xs[i, 2 * blk] = dq
                        xs[i, 2 * blk + 1] = dsum

    return rmsnorm


@compiled
def rmsnorm_kernel(mode: str, threads: int, chunks: int):
    return cuda.jit(make_rmsnorm(mode, threads, chunks))


def rmsnorm(x, res, w, eps, rows, out, xs, num_rows, mode, has_res, has_rows, stream=0) -> None:
    """Launch over `num_rows` output rows. Every array argument must be given (device arrays
    on the GPU: a host array would be copied per launch); the flags say which ones count."""
    threads, chunks = plan_threads(x.shape[1])
    rmsnorm_kernel(mode, threads, chunks)[num_rows, threads, stream](
        x, res, w, np.float32(eps), rows, out, xs, has_res, has_rows
    )


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
    cases = [("rmsnorm_f32", make_rmsnorm("f32", *plan_threads(4096)), sig(f2)),
             ("rmsnorm_q8", make_rmsnorm("q8", *plan_threads(4096)), sig(i8))]
    for d in (576, 8192):  # partial last warp; two chunks per thread
        cases.append((f"rmsnorm_q8_d{d}", make_rmsnorm("q8", *plan_threads(d)), sig(i8)))
    return cases
