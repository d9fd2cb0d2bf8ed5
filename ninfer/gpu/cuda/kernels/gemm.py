"""Tiled GEMM for prefill and wide batches: out[M, N] = x[M, K] @ w[N, K].T (+ res), on tensor cores.

A block of 128 threads (4 warps in a 2 x 2 grid) computes a BM x BN tile of `out` (BM tokens x
BN weight rows) with `mma.sync.m16n8k16` (f16 inputs, f32 accumulation). Tiles: 64 x 64 (warp
32 x 32), 32 x 64 (warp 16 x 32) and 32 x 32 (warp 16 x 16); `pick_tile` takes the largest
whose grid still has about two blocks per SM, so small-N launches (N = 576 at 512 tokens) fill
the GPU. Each step covers 64 of K (two 32-element quant blocks): the block stages the
activations (float32 -> f16) and the dequantized weights (dequant.py, in registers, to f16) in
shared memory as f16 pairs; rows are padded to 36 words so the fragment loads hit 32 distinct
banks. The pipeline is software: the shared tiles are double-buffered and the global loads of
step s + 1 go out into registers before the tensor-core work of step s, so one syncthreads per
step and the load latency hides behind the mma. Rows past M / N are clamped (they only feed
outputs that are not written); an odd number of K blocks zeroes the weights of the missing
half-step. The result does not depend on the tile: every output is the same chain of k16 mma.

Under the simulator (no mma) the same tiles are multiplied by a scalar loop in which every
thread computes exactly the accumulator elements its mma fragment would hold, so staging,
ownership and the epilogue are what the simulated test checks.

The previous kernel (64 x 64 only, 32-wide K steps, two syncthreads per step, no overlap of
loads and mma) measured 1.5-2.5x slower on every SmolLM2 and 8B linear (docs/performance.md).
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, int32, int64, types, uint32

from ninfer.gpu.cuda.kernels.dequant import DQ_WORD
from ninfer.gpu.cuda.kernels.intrinsics import SIMULATOR, device, ld4_f32_pinned, mma_m16n8k16, pack_half2
from ninfer.gpu.cuda.kernels.jit import compiled

THREADS = 128
BK = 64  # K per pipelined step: two 32-element quant blocks
TILES = ((64, 64), (32, 64), (32, 32))  # (BM tokens, BN weight rows), largest first
DEFAULT_SMS = 132  # H200 / H100 SXM


def _row_words(bk: int) -> int:
    return bk // 2 + 4  # f16 pairs + 4 words of padding: rows 4 banks apart


if SIMULATOR:

    def _unpack(w):
        h = np.array([int(w) & 0xFFFF, (int(w) >> 16) & 0xFFFF], dtype=np.uint16).view(np.float16)
        return np.float32(h[0]), np.float32(h[1])

    def _make_tile_product(mt_n: int, nt_n: int, kwords: int):
        def tile_product(a_s, b_s, buf, acc, wm, wn, g, t):
            for mt in range(mt_n):
                for nt in range(nt_n):
                    for ci in range(4):
                        row = wm * 16 * mt_n + mt * 16 + g + 8 * (ci // 2)
                        col = wn * 8 * nt_n + nt * 8 + 2 * t + (ci % 2)
                        i = (mt * nt_n + nt) * 4 + ci
                        s = np.float32(acc[i])
                        for kw in range(kwords):
                            a0, a1 = _unpack(a_s[buf, row, kw])
                            b0, b1 = _unpack(b_s[buf, col, kw])
                            s = np.float32(s + a0 * b0 + a1 * b1)
                        acc[i] = s

        return tile_product

else:

    def _make_tile_product(mt_n: int, nt_n: int, kwords: int):
        @device
        def k16(a_s, b_s, buf, acc, wm, wn, g, t, kw):
            """One k16 slice (words kw .. kw + 7) of the warp's tile."""
            kw = kw + t
            for mt in range(mt_n):
                r0 = wm * 16 * mt_n + mt * 16 + g
                a0 = a_s[buf, r0, kw]
                a1 = a_s[buf, r0 + 8, kw]
                a2 = a_s[buf, r0, kw + 4]
                a3 = a_s[buf, r0 + 8, kw + 4]
                for nt in range(nt_n):
                    n0 = wn * 8 * nt_n + nt * 8 + g
                    b0 = b_s[buf, n0, kw]
                    b1 = b_s[buf, n0, kw + 4]
                    i = (mt * nt_n + nt) * 4
                    c0, c1, c2, c3 = mma_m16n8k16(a0, a1, a2, a3, b0, b1, acc[i], acc[i + 1], acc[i + 2], acc[i + 3])
                    acc[i] = c0
                    acc[i + 1] = c1
                    acc[i + 2] = c2
                    acc[i + 3] = c3

        # the k16 slices spelled out: LLVM does not unroll a 4-trip loop around this body
        assert kwords == 32

        @device
        def tile_product(a_s, b_s, buf, acc, wm, wn, g, t):
            k16(a_s, b_s, buf, acc, wm, wn, g, t, 0)
            k16(a_s, b_s, buf, acc, wm, wn, g, t, 8)
            k16(a_s, b_s, buf, acc, wm, wn, g, t, 16)
            k16(a_s, b_s, buf, acc, wm, wn, g, t, 24)

        return tile_product


def make_gemm(qtype: str, bm: int = 64, bn: int = 64):
    """The pipelined kernel for one weight type and tile (BK = 64)."""
    assert (bm, bn) in TILES
    dq = DQ_WORD[qtype]
    mt_n, nt_n = bm // 32, bn // 16  # m16 / n8 tiles per warp
    nacc = mt_n * nt_n * 4
    rw = _row_words(BK)
    gpr = BK // 4  # ld4 groups per activation row
    pa = bm * gpr // THREADS  # ld4 per thread per step
    a_pass = THREADS // gpr  # activation rows per pass of the block
    tpr = THREADS // bn  # threads per weight row
    pb = (BK // 4) // tpr  # dequantized words per thread per step
    nxv, nwv = 4 * pa, 2 * pb
    tile_product = _make_tile_product(mt_n, nt_n, BK // 2)

    @device
    def _load_x(x, xv, s, m_base, ar0, ahalf, acol, last_m, last_blk):
        """Step s's activations into registers (raw float32)."""
        ablk = min(2 * s + ahalf, last_blk)  # an odd K's missing half: any valid column ...
        for i in range(pa):
            am = min(m_base + ar0 + a_pass * i, last_m)  # rows past M feed unwritten outputs
            v0, v1, v2, v3 = ld4_f32_pinned(x, am, 32 * ablk + acol)
            xv[4 * i] = v0
            xv[4 * i + 1] = v1
            xv[4 * i + 2] = v2
            xv[4 * i + 3] = v3

    @device
    def _load_w(qs, d16, aux, sc8, wv, s, wrow, bu0, last_blk):
        """Step s's weights, dequantized, into registers (f16 pairs)."""
        for i in range(pb):
            u = bu0 + i
            blk = 2 * s + u // 8
            w0, w1, w2, w3 = dq(qs, d16, aux, sc8, wrow, min(blk, last_blk), u % 8)
            p0 = pack_half2(w0, w1)
            p1 = pack_half2(w2, w3)
            if blk > last_blk:  # ... times zero weights
                p0 = uint32(0)
                p1 = uint32(0)
            wv[2 * i] = p0
            wv[2 * i + 1] = p1

    def gemm(qs, d16, aux, sc8, x, out, res, num_m, num_n, num_kblocks, has_res):
        # indices built from values the compiler knows are >= 0 (zero-extended, clamped at 0):
        # numba's negative-index wraparound then folds away instead of costing selects per access
        tid = int64(uint32(cuda.threadIdx.x))
        n_base = int64(uint32(cuda.blockIdx.x)) * bn
        m_base = int64(uint32(cuda.blockIdx.y)) * bm
        last_m = max(num_m - 1, 0)
        last_blk = max(num_kblocks - 1, 0)
        warp = tid // 32
        lane = tid % 32
        wm = warp // 2
        wn = warp % 2
        g = lane // 4
        t = lane % 4
        a_s = cuda.shared.array((2, bm, rw), uint32)
        b_s = cuda.shared.array((2, bn, rw), uint32)
        acc = cuda.local.array(nacc, float32)
        for i in range(nacc):
            acc[i] = float32(0.0)
        xv = cuda.local.array(nxv, float32)  # the next step's activations (raw float32)
        wv = cuda.local.array(nwv, uint32)  # the next step's weights (f16 pairs)
        # staging roles: activations by 4-column groups (a row's 64 columns = 16 lanes, coalesced),
        # weights by (row, word) with the thread's words consecutive (Q4 words j, j + 4 share a load)
        ac4 = tid % gpr
        ar0 = tid // gpr
        ahalf = ac4 // 8  # which 32-block of the step
        acol = 4 * (ac4 % 8)
        brow = tid // tpr
        bu0 = (tid % tpr) * pb
        wrow = min(n_base + brow, max(num_n - 1, 0))  # clamped: rows past N feed unwritten columns only
        nsteps = (num_kblocks + 1) // 2
        # registers <- step 0; then per step: registers -> shared, registers <- the next step's
        # activations, one barrier, registers <- the next step's weights, mma on shared. The
        # activation loads sit before the barrier so that ptxas cannot sink them below the mma;
        # the weights' dequantization is scheduled among the mma (one basic block: the last step
        # loads itself again, harmlessly, instead of branching)
        _load_x(x, xv, 0, m_base, ar0, ahalf, acol, last_m, last_blk)
        _load_w(qs, d16, aux, sc8, wv, 0, wrow, bu0, last_blk)
        for s in range(nsteps):
            buf = s & 1
            for i in range(pa):
                row = ar0 + a_pass * i
                a_s[buf, row, 2 * ac4] = pack_half2(xv[4 * i], xv[4 * i + 1])
                a_s[buf, row, 2 * ac4 + 1] = pack_half2(xv[4 * i + 2], xv[4 * i + 3])
            for i in range(pb):
                u = bu0 + i
                b_s[buf, brow, 16 * (u // 8) + 2 * (u % 8)] = wv[2 * i]
                b_s[buf, brow, 16 * (u // 8) + 2 * (u % 8) + 1] = wv[2 * i + 1]
            nxt = min(s + 1, nsteps - 1)
            _load_x(x, xv, nxt, m_base, ar0, ahalf, acol, last_m, last_blk)
            cuda.syncthreads()
            _load_w(qs, d16, aux, sc8, wv, nxt, wrow, bu0, last_blk)
            tile_product(a_s, b_s, buf, acc, wm, wn, g, t)
        for mt in range(mt_n):
            for nt in range(nt_n):
                for ci in range(4):
                    row = m_base + wm * 16 * mt_n + mt * 16 + g + 8 * (ci // 2)
                    col = n_base + wn * 8 * nt_n + nt * 8 + 2 * t + (ci % 2)
                    if row < num_m and col < num_n:
                        v = acc[(mt * nt_n + nt) * 4 + ci]
                        if has_res:
                            v += res[row, col]
                        out[row, col] = v

    return gemm


@compiled
def gemm_kernel(qtype: str, tile=(64, 64)):
    """The compiled kernel for a weight type and a tile (BM, BN)."""
    return cuda.jit(make_gemm(qtype, *tile))


@functools.cache
def _num_sms() -> int:
    return int(getattr(cuda.get_current_device(), "MULTIPROCESSOR_COUNT", DEFAULT_SMS))  # the simulator: none


def pick_tile(num_m: int, num_n: int, sms: int | None = None) -> tuple[int, int]:
    """The largest tile whose grid has at least two blocks per SM (else the smallest);
    32-token tiles when there are at most 32 tokens."""
    target = 2 * (sms or _num_sms())
    tiles = TILES[1:] if num_m <= 32 else TILES
    for bm, bn in tiles:
        if -(-num_n // bn) * -(-num_m // bm) >= target:
            return bm, bn
    return tiles[-1]


def gemm(w, x, out, res, num_m: int, stream=0, tile=None) -> None:
    """out[:num_m] = x[:num_m] @ w.T (+ res; may be out itself); w a DeviceWeight.
    `tile`: (BM, BN) from TILES to force a kernel; None picks one (pick_tile)."""
    bm, bn = tile = pick_tile(num_m, w.rows) if tile is None else tile
    grid = ((w.rows + bn - 1) // bn, (num_m + bm - 1) // bm)
    has_res = res is not None
    gemm_kernel(w.qtype, tile)[grid, THREADS, stream](
        *w.planes, x, out, res if has_res else out, num_m, w.rows, w.num_blocks, has_res
    )


def gemm_ref(w_f32, x, res):
    """float64 product of the f16-rounded operands (the tensor cores' inputs) (+ res)."""
    a = np.asarray(x, np.float32).astype(np.float16).astype(np.float64)
    b = np.asarray(w_f32, np.float32).astype(np.float16).astype(np.float64)
    y = a @ b.T
    return y if res is None else y + res


def ptx_cases():
    from ninfer.gpu.cuda.device_weights import plane_types
    from ninfer.gpu.cuda.kernels.quant_layout import DEVICE_QTYPES

    f2 = types.float32[:, ::1]
    sig = lambda q: (*plane_types(q), f2, f2, f2, int32, int32, int32, types.boolean)  # noqa: E731
    cases = [(f"gemm_{q}", make_gemm(q), sig(q)) for q in DEVICE_QTYPES]
    cases += [(f"gemm_{q}_{bm}x{bn}", make_gemm(q, bm, bn), sig(q)) for bm, bn in TILES[1:] for q in DEVICE_QTYPES]
    return cases
