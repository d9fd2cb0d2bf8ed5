"""SwiGLU between the fused gate/up projection and the down projection.

`gate_up[t] = [g_0 .. g_{F-1}, u_0 .. u_{F-1}]`; `h = silu(g) * u` with silu(g) = g / (1 +
exp(-g)), written as float32 (mode f32) or quantized to int8 blocks (mode q8).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, types

from ninfer.gpu.cuda.kernels.intrinsics import SIMULATOR, device, grid_dep_launch, grid_dep_wait
from ninfer.gpu.cuda.kernels.jit import compiled
from ninfer.gpu.cuda.kernels.pdl import aware

from ninfer.gpu.cuda.kernels.act_quant import quantize_q8_ref, store_q8

THREADS = 64 if SIMULATOR else 256


@device
def silu_mul(g, u):
    return g / (float32(1.0) + math.exp(-g)) * u


def make_swiglu(mode: str, threads: int = THREADS):
    nwarps = threads // 32

    @aware
    def swiglu(gate_up, out, xs):
        grid_dep_launch()
        grid_dep_wait()
        t = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        f = gate_up.shape[1] // 2
        if mode == "f32":
            for c in range(tid, f, threads):
                out[t, c] = silu_mul(gate_up[t, c], gate_up[t, f + c])
        else:
            # one warp per 32-element block; blockIdx.y picks the group of nwarps blocks
            lane = tid % 32
            nb = f // 32
            for it in range(1):
                blk = cuda.blockIdx.y * nwarps + tid // 32
                valid = blk < nb
                c = 32 * blk + lane
                v = silu_mul(gate_up[t, c], gate_up[t, f + c]) if valid else float32(0.0)
                store_q8(v, valid, out, xs, t, blk, lane)

    return swiglu


@compiled
def swiglu_kernel(mode: str, threads: int = THREADS):
    return cuda.jit(make_swiglu(mode, threads))


def swiglu(gate_up, out, xs, num_tokens, mode, stream=0, threads=THREADS) -> None:
    """f32: one block per token; q8: (token, group of threads / 32 blocks) so a short batch
    still spreads over many SMs."""
    chunks = 1 if mode == "f32" else -(-(gate_up.shape[1] // 64) // (threads // 32))
    swiglu_kernel(mode, threads)[(num_tokens, chunks), threads, stream](gate_up, out, xs)


def swiglu_ref(gate_up, mode):
    gate_up = np.asarray(gate_up, np.float32)
    f = gate_up.shape[1] // 2
    g, u = gate_up[:, :f], gate_up[:, f:]
    with np.errstate(over="ignore"):
        h = (g / (np.float32(1.0) + np.exp(-g)) * u).astype(np.float32)
    return h if mode == "f32" else quantize_q8_ref(h)


def ptx_cases():
    f2 = types.float32[:, ::1]
    return [
        ("swiglu_f32", make_swiglu("f32"), (f2, f2, f2)),
        ("swiglu_q8", make_swiglu("q8"), (f2, types.int8[:, ::1], f2)),
    ]
