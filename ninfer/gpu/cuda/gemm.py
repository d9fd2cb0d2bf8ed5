"""Tiled GEMM for prefill and wide batches: out[M, N] = x[M, K] @ w[N, K].T (+ res), on tensor cores.

A block computes a 64 x 64 tile of `out` (64 tokens x 64 weight rows) with 4 warps, each a
32 x 32 quarter of `mma.sync.m16n8k16` (f16 inputs, f32 accumulation). Per 32-wide step of K
the block stages the activations (float32 -> f16) and one 32-element block of each of the 64
weight rows, dequantized in registers (dequant.py) to f16, in shared memory as f16 pairs; rows
are padded to 20 words so the fragment loads hit 32 distinct banks.

Under the simulator (no mma) the same tiles are multiplied by a scalar loop in which every
thread computes exactly the accumulator elements its mma fragment would hold, so staging,
ownership and the epilogue are what the simulated test checks.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, int32, types, uint32

from ninfer.gpu.cuda.dequant import DQ_WORD
from ninfer.gpu.cuda.intrinsics import SIMULATOR, ld4_f32, mma_m16n8k16, pack_half2, device

BM = 64
BN = 64
BK = 32
THREADS = 128
ROW_WORDS = 20  # 16 words of f16 pairs + 4 of padding


if SIMULATOR:

    def _unpack(w):
        h = np.array([int(w) & 0xFFFF, (int(w) >> 16) & 0xFFFF], dtype=np.uint16).view(np.float16)
        return np.float32(h[0]), np.float32(h[1])

    def _tile_product(a_s, b_s, acc, wm, wn, g, t):
        for mt in range(2):
            for nt in range(4):
                for ci in range(4):
                    row = wm * 32 + mt * 16 + g + 8 * (ci // 2)
                    col = wn * 32 + nt * 8 + 2 * t + (ci % 2)
                    s = np.float32(acc[(mt * 4 + nt) * 4 + ci])
                    for kw in range(16):
                        a0, a1 = _unpack(a_s[row, kw])
                        b0, b1 = _unpack(b_s[col, kw])
                        s = np.float32(s + a0 * b0 + a1 * b1)
                    acc[(mt * 4 + nt) * 4 + ci] = s

else:

    @device
    def _tile_product(a_s, b_s, acc, wm, wn, g, t):
        for kk in range(2):
            kw = kk * 8 + t
            for mt in range(2):
                r0 = wm * 32 + mt * 16 + g
                a0 = a_s[r0, kw]
                a1 = a_s[r0 + 8, kw]
                a2 = a_s[r0, kw + 4]
                a3 = a_s[r0 + 8, kw + 4]
                for nt in range(4):
                    n0 = wn * 32 + nt * 8 + g
                    b0 = b_s[n0, kw]
                    b1 = b_s[n0, kw + 4]
                    i = (mt * 4 + nt) * 4
                    c0, c1, c2, c3 = mma_m16n8k16(a0, a1, a2, a3, b0, b1, acc[i], acc[i + 1], acc[i + 2], acc[i + 3])
                    acc[i] = c0
                    acc[i + 1] = c1
                    acc[i + 2] = c2
                    acc[i + 3] = c3


def make_gemm(qtype: str):
    dq = DQ_WORD[qtype]

    def gemm(qs, d16, aux, sc8, x, out, res, num_m, num_n, num_kblocks, has_res):
        tid = cuda.threadIdx.x
        n_base = cuda.blockIdx.x * BN
        m_base = cuda.blockIdx.y * BM
        warp = tid // 32
        lane = tid % 32
        wm = warp // 2
        wn = warp % 2
        g = lane // 4
        t = lane % 4
        a_s = cuda.shared.array((BM, ROW_WORDS), uint32)
        b_s = cuda.shared.array((BN, ROW_WORDS), uint32)
        acc = cuda.local.array(32, float32)
        for i in range(32):
            acc[i] = float32(0.0)
        srow = tid // 2  # staging: each thread fills half a row of each tile
        shalf = tid % 2
        for kb in range(num_kblocks):
            am = m_base + srow
            for q4 in range(4):
                col = kb * BK + shalf * 16 + 4 * q4
                if am < num_m:
                    v0, v1, v2, v3 = ld4_f32(x, am, col)
                else:
                    v0 = v1 = v2 = v3 = float32(0.0)
                a_s[srow, shalf * 8 + 2 * q4] = pack_half2(v0, v1)
                a_s[srow, shalf * 8 + 2 * q4 + 1] = pack_half2(v2, v3)
            wr = n_base + srow
            for jj in range(4):
                j = shalf * 4 + jj
                if wr < num_n:
                    w0, w1, w2, w3 = dq(qs, d16, aux, sc8, wr, kb, j)
                else:
                    w0 = w1 = w2 = w3 = float32(0.0)
                b_s[srow, 2 * j] = pack_half2(w0, w1)
                b_s[srow, 2 * j + 1] = pack_half2(w2, w3)
            cuda.syncthreads()
            _tile_product(a_s, b_s, acc, wm, wn, g, t)
            cuda.syncthreads()
        for mt in range(2):
            for nt in range(4):
                for ci in range(4):
                    row = m_base + wm * 32 + mt * 16 + g + 8 * (ci // 2)
                    col = n_base + wn * 32 + nt * 8 + 2 * t + (ci % 2)
                    if row < num_m and col < num_n:
                        v = acc[(mt * 4 + nt) * 4 + ci]
                        if has_res:
                            v += res[row, col]
                        out[row, col] = v

    return gemm


@functools.cache
def gemm_kernel(qtype: str):
    return cuda.jit(make_gemm(qtype))


def gemm(w, x, out, res, num_m: int, stream=0) -> None:
    """out[:num_m] = x[:num_m] @ w.T (+ res; may be out itself); w a DeviceWeight."""
    grid = ((w.rows + BN - 1) // BN, (num_m + BM - 1) // BM)
    has_res = res is not None
    gemm_kernel(w.qtype)[grid, THREADS, stream](*w.planes, x, out, res if has_res else out, num_m, w.rows, w.num_blocks, has_res)


def gemm_ref(w_f32, x, res):
    """float64 product of the f16-rounded operands (the tensor cores' inputs) (+ res)."""
    a = np.asarray(x, np.float32).astype(np.float16).astype(np.float64)
    b = np.asarray(w_f32, np.float32).astype(np.float16).astype(np.float64)
    y = a @ b.T
    return y if res is None else y + res


def ptx_cases():
    from ninfer.gpu.cuda.device_weights import plane_types
    from ninfer.gpu.cuda.quant_layout import DEVICE_QTYPES

    f2 = types.float32[:, ::1]
    sig = lambda q: (*plane_types(q), f2, f2, f2, int32, int32, int32, types.boolean)  # noqa: E731
    return [(f"gemm_{q}", make_gemm(q), sig(q)) for q in DEVICE_QTYPES]
