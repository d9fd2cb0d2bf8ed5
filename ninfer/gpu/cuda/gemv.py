"""Matrix-vector products for decode (up to 8 activation rows), weights in stored form.

One group of `lanes` threads (8, 16 or 32) owns one weight row; lane `l` walks the row's
32-element blocks l, l + lanes, ...; each loaded block is used for all M activation rows, so
the weights are read from memory once per step. Two flavours share the kernel body:

* `q8`: int8 activations (act_quant.py) and `dp4a` dot products (qdot.py): the fast path;
* `f32`: float32 activations and weights dequantized to float in registers (dequant.py):
  the exact path, also the only one for F32 / F16 / BF16 weights.

Epilogue: `out[m, r] = acc (+ res[m, r])`; `res` may be `out` itself (residual add in place).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32, types, uint32

from ninfer.gpu.cuda.act_quant import dequantize_q8_ref, quantize_quad, store_q8
from ninfer.gpu.cuda.dequant import DQ_WORD
from ninfer.gpu.cuda.intrinsics import (
    SIMULATOR, block_sum, device, grid_dep_launch, grid_dep_wait, group_sum, ld2_f32_pinned, ld4_f32, ld4_f32_pinned,
    ld4_u32_pinned, prefetch_l2, warp_sum,
)
from ninfer.gpu.cuda.pdl import aware
from ninfer.gpu.cuda.rope import pair_elems, store_pair
from ninfer.gpu.cuda.swiglu import silu_mul
from ninfer.gpu.cuda.qdot import QDOT, WDOT, WLOAD, WCOMP, WORDS, act_block

THREADS = 32 if SIMULATOR else 128  # the simulator runs a Python thread per CUDA thread
MAX_M = 64  # decode batches up to 64 rows stay on the GEMV (weights read once from memory)
MGROUP = 8  # activation rows per block (register accumulators)
FLOAT_QTYPES = ("F32", "F16", "BF16")


def _make_fdot(dq):
    @device
    def fdot(qs, d16, aux, sc8, row, blk, x, xs, m):
        s = float32(0.0)
        for j in range(8):
            w0, w1, w2, w3 = dq(qs, d16, aux, sc8, row, blk, j)
            x0, x1, x2, x3 = ld4_f32_pinned(x, m, 32 * blk + 4 * j)
            s += w0 * x0 + w1 * x1 + w2 * x2 + w3 * x3
        return s

    return fdot


def make_gemv(qtype: str, mode: str, lanes: int, max_m: int, rows_per_group: int = 1, unroll: int = 0,
              prefetch: bool = False, split: bool = False):
    """The plain Python kernel (compile with cuda.jit or cuda.compile_ptx).

    A group of `lanes` threads owns `rows_per_group` (R) consecutive weight rows; lane `sub`
    walks blocks sub, sub + lanes, ... of all R rows, so (q8, one activation row) each loaded
    activation block serves R weight rows and R x unroll 16-byte weight loads are in flight
    per lane. Each lane handles `unroll` blocks per iteration with no branch between them (a
    block past the row's end is clamped and weighted 0); rows past `num_m` / `num_rows`
    repeat the last one instead of branching (their sums are never stored). A block covers
    activation rows 8 * blockIdx.x .. + max_m (max_m <= 8 accumulators stay in registers);
    neighbouring blocks share weight rows, so extra row groups re-read weights from L2.
    `split` (q8, one activation row, Q4_0 / Q4_1 / Q8_0): one weight row per group through
    the split loop too, whose first weight loads are issued before the PDL wait.
    """
    q8 = mode == "q8"
    wdot = WDOT[qtype] if q8 else None
    dot = QDOT[qtype] if q8 else _make_fdot(DQ_WORD[qtype])
    R = rows_per_group
    if R > 1 and max_m > 1:
        raise ValueError("several rows per lane group need a single activation row")
    if R > 1 and not q8:
        raise ValueError("several rows per lane group are a q8 path")
    rows_per_warp = (32 // lanes) * R
    unroll = unroll or (4 if max_m == 1 else 2)

    @aware
    def gemv(qs, d16, aux, sc8, xa, xs, out, res, num_rows, num_blocks, num_m, has_res):
        grid_dep_launch()
        grid_dep_wait()
        lane = cuda.threadIdx.x % 32
        warp = (cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x) // 32
        row = warp * rows_per_warp + lane // lanes
        sub = lane % lanes
        m0 = cuda.blockIdx.x * MGROUP
        acc = cuda.local.array(max_m, float32)
        for i in range(max_m):
            acc[i] = float32(0.0)
        if row < num_rows:
            last = num_blocks - 1
            if prefetch and q8:
                wpb = qs.shape[1] // num_blocks  # quant words per block
                for b in range(sub, num_blocks, lanes):
                    prefetch_l2(qs, row, wpb * b)
            for blk0 in range(sub, num_blocks, lanes * unroll):
                for u in range(unroll):
                    b = blk0 + u * lanes
                    f = float32(1.0) if b <= last else float32(0.0)
                    bb = min(b, last)
                    for i in range(max_m):
                        acc[i] += f * dot(qs, d16, aux, sc8, row, bb, xa, xs, min(m0 + i, num_m - 1))
        for i in range(max_m):
            v = group_sum(acc[i], lanes)  # every thread takes part in the shuffles
            if sub == 0 and row < num_rows and m0 + i < num_m:
                if has_res:
                    v += res[m0 + i, row]
                out[m0 + i, row] = v

    @aware
    def gemv_rows(qs, d16, aux, sc8, xa, xs, out, res, num_rows, num_blocks, num_m, has_res):
        """One activation row, R weight rows per lane group sharing each activation block."""
        grid_dep_launch()
        grid_dep_wait()
        lane = cuda.threadIdx.x % 32
        warp = (cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x) // 32
        row0 = warp * rows_per_warp + (lane // lanes) * R
        sub = lane % lanes
        acc = cuda.local.array(R, float32)
        for r in range(R):
            acc[r] = float32(0.0)
        if row0 < num_rows:
            last = num_blocks - 1
            last_row = num_rows - 1
            for blk0 in range(sub, num_blocks, lanes * unroll):
                for u in range(unroll):
                    b = blk0 + u * lanes
                    f = float32(1.0) if b <= last else float32(0.0)
                    bb = min(b, last)
                    a0, a1, a2, a3, a4, a5, a6, a7, dx, sx = act_block(xa, xs, 0, bb)
                    for r in range(R):
                        acc[r] += f * wdot(qs, d16, aux, sc8, min(row0 + r, last_row), bb,
                                           a0, a1, a2, a3, a4, a5, a6, a7, dx, sx)  # fmt: skip
        for r in range(R):
            row = row0 + r
            v = group_sum(acc[r], lanes)  # every thread takes part in the shuffles
            if sub == 0 and row < num_rows:
                if has_res:
                    v += res[0, row]
                out[0, row] = v

    if R == 1 and not (split and q8 and max_m == 1 and qtype in WLOAD):
        return gemv
    return _make_gemv_split(qtype, lanes, R, unroll, prefetch) if qtype in WLOAD else gemv_rows


def _make_first_loads(qtype: str, lanes: int, R: int, U: int):
    """Device function: the weight loads of a lane group's first split-loop iteration into W, S."""
    wload = WLOAD[qtype]

    @device
    def first_loads(qs, d16, row0, rstride, last_row, sub, num_blocks, W, S):
        last = num_blocks - 1
        for u in range(U):
            bb = min(sub + u * lanes, last)
            for r in range(R):
                wload(qs, d16, min(row0 + r * rstride, last_row), bb, W, S, u * R + r)

    return first_loads


def _make_split_loop(qtype: str, lanes: int, R: int, U: int, shared: bool = False):
    """Device function: a lane group's dot products over its R weight rows row0, row0 +
    rstride, ... (clamped to last_row) with activation row 0 of xa / xs, into acc[0:R]; every
    load of an iteration (U activation blocks, R x U weight blocks) before any arithmetic
    (qdot.WLOAD / WCOMP). W, S, A, X: the caller's register arrays (sizes from `_split_arrays`).
    `shared`: xa / xs are the block's shared-memory copy of the activations (int8x4 words, then
    dx, dx * sum(q) per block; `_make_prologue`), which the caller built after the PDL wait,
    having issued the first iteration's weight loads (`_make_first_loads`) before it: the loop
    neither waits nor loads those again."""
    wcomp = WCOMP[qtype]
    loads = _make_first_loads(qtype, lanes, R, U)

    @device
    def split_loop(qs, d16, xa, xs, row0, rstride, last_row, sub, num_blocks, acc, W, S, A, X):
        last = num_blocks - 1
        for blk0 in range(sub, num_blocks, lanes * U):
            if not (shared and blk0 == sub):
                loads(qs, d16, row0, rstride, last_row, blk0, num_blocks, W, S)
            if not shared and blk0 == sub:  # PDL: the first weights load while the kernel before finishes
                grid_dep_wait()
            for u in range(U):
                bb = min(blk0 + u * lanes, last)
                if shared:
                    for k in range(8):
                        A[8 * u + k] = xa[8 * bb + k]
                    X[2 * u], X[2 * u + 1] = xs[2 * bb], xs[2 * bb + 1]
                else:
                    A[8 * u], A[8 * u + 1], A[8 * u + 2], A[8 * u + 3] = ld4_u32_pinned(xa, 0, 8 * bb)
                    A[8 * u + 4], A[8 * u + 5], A[8 * u + 6], A[8 * u + 7] = ld4_u32_pinned(xa, 0, 8 * bb + 4)
                    X[2 * u], X[2 * u + 1] = ld2_f32_pinned(xs, 0, 2 * bb)
            for u in range(U):
                f = float32(1.0) if blk0 + u * lanes <= last else float32(0.0)
                for r in range(R):
                    acc[r] += f * wcomp(W, S, u * R + r, A, X, u)

    return split_loop


def _split_arrays(qtype: str, R: int, U: int) -> tuple[int, int, int, int]:
    """Sizes of split_loop's register arrays W (weight words), S (block scales), A (activation
    words), X (activation scales)."""
    return WORDS[qtype] * U * R, 2 * U * R, 8 * U, 2 * U


def _make_gemv_split(qtype: str, lanes: int, R: int, unroll: int, prefetch: bool):
    """`gemv_rows` for Q4_0 / Q4_1 / Q8_0 with every load of an iteration issued before any
    arithmetic (`_make_split_loop`)."""
    rows_per_warp = (32 // lanes) * R
    nw, ns, na, nx = _split_arrays(qtype, R, unroll)
    loop = _make_split_loop(qtype, lanes, R, unroll)

    @aware
    def gemv_split(qs, d16, aux, sc8, xa, xs, out, res, num_rows, num_blocks, num_m, has_res):
        grid_dep_launch()
        lane = cuda.threadIdx.x % 32
        warp = (cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x) // 32
        row0 = warp * rows_per_warp + (lane // lanes) * R
        sub = lane % lanes
        acc = cuda.local.array(R, float32)
        W = cuda.local.array(nw, uint32)
        S = cuda.local.array(ns, float32)
        A = cuda.local.array(na, uint32)
        X = cuda.local.array(nx, float32)
        for r in range(R):
            acc[r] = float32(0.0)
        if row0 < num_rows:
            last_row = num_rows - 1
            if prefetch:  # the lane's whole share of its rows on its way to L2 before any load
                wpb = qs.shape[1] // num_blocks
                for b in range(sub, num_blocks, lanes):
                    for r in range(R):
                        prefetch_l2(qs, min(row0 + r, last_row), wpb * b)
            loop(qs, d16, xa, xs, row0, 1, last_row, sub, num_blocks, acc, W, S, A, X)
        grid_dep_wait()  # (again, for threads without rows) before res is read and out written
        for r in range(R):
            row = row0 + r
            v = group_sum(acc[r], lanes)  # every thread takes part in the shuffles
            if sub == 0 and row < num_rows:
                if has_res:
                    v += res[0, row]
                out[0, row] = v

    return gemv_split


# -- one activation row with the next small kernel done in the epilogue ------------------------
#
# For matrices too large for `gemv_fused` (every block would rebuild a 16-56 KB row), the
# small kernel after a GEMV is folded into the GEMV's end instead, where each lane group's two
# row sums are all it needs:
#
# * `gemv_rope` (the fused QKV, models without q/k norm): a lane group owns one rotated pair
#   of rows, so it adds the bias, rotates, and writes q and the pools' K / V (rope.qkv_post);
# * `gemv_swiglu` (gate+up): a lane group owns gate row j and up row j + F, so its sums give
#   h_j = silu(g_j) * u_j; a block holds 32 consecutive j (32 groups of `lanes` threads) and
#   one warp quantizes them into the down GEMV's int8 block.
#
# Each saves a launch and a DRAM-latency-bound small kernel per layer (forward.py EPILOGUES).
# Folding RMSNorm into the O / down GEMV by its last block to finish (an atomic count after
# every block fenced its stores) was correct but slower on the H200 (8B Q8_0: 3.671 vs 3.447
# ms a step) and was removed; `gemv_norm` below does it without a last block (off by default).

SWIGLU_GROUPS = 32  # lane groups of a gemv_swiglu block: one 32-column int8 block of h
SWIGLU_LANES = 2 if SIMULATOR else 8
SWIGLU_UNROLL = 2
# rows of >= WIDE_BLOCKS int8 blocks (an 8B model's 4,096): all four of a lane's first loads
# before the PDL wait; 8B Q8_0 one stream on an H100 (12th session): -0.10 ms a step alone,
# and part of the -0.27 ms of this + WIDE_SHAPE Q8_0 (2, 4) + ONE_ROW_SPLIT
SWIGLU_WIDE_UNROLL = 4
ROPE_UNROLL = 2  # two rows a group (the pair): (2, 2) timed best for the 8B QKV in Q4_1 and Q8_0


@device
def norm_factor(nsum, slot, cols, eps):
    """1 / sqrt(mean(x^2) + eps) of the row whose sum of squares `gemv_norm` accumulated in
    nsum[slot] (its int8 input is x * w unnormalized); 1 where slot < 0 (a normalized input)."""
    if slot < 0:
        return float32(1.0)
    return float32(1.0) / math.sqrt(nsum[slot] / float32(cols) + eps)


def _make_pair_sums(qtype: str, lanes: int, U: int, R: int = 2):
    """Device function: a lane group's two row sums, rows row_a and row_a + stride (0 where not
    `valid`); every thread calls it (the group's shuffles). R = 1: row_a only (the second sum
    is 0)."""
    nw, ns, na, nx = _split_arrays(qtype, R, U)
    loop = _make_split_loop(qtype, lanes, R, U)

    @device
    def pair_sums(qs, d16, xa, xs, row_a, stride, last_row, sub, num_blocks, valid):
        acc = cuda.local.array(2, float32)
        W = cuda.local.array(nw, uint32)
        S = cuda.local.array(ns, float32)
        A = cuda.local.array(na, uint32)
        X = cuda.local.array(nx, float32)
        acc[0] = float32(0.0)
        acc[1] = float32(0.0)
        if valid:
            loop(qs, d16, xa, xs, row_a, stride, last_row, sub, num_blocks, acc, W, S, A, X)
        grid_dep_wait()  # (again, for threads without rows) before the caller's reads and writes
        if R == 1:
            return group_sum(acc[0], lanes), float32(0.0)
        return group_sum(acc[0], lanes), group_sum(acc[1], lanes)

    return pair_sums


def _make_folded_sums(qtype: str, lanes: int, U: int, cols: int, threads: int):
    """Device function: gemv_swiglu's (gate, up) row sums over the block's own RMSNorm of x
    (FOLD_FFN_NORM): the first iteration's weight loads, the PDL wait, the block builds the int8
    input in shared memory (`_make_prologue`), then the split loop reads it from there. Every
    thread calls it (the build synchronises the block)."""
    build = _make_prologue("norm", cols, threads)
    first = _make_first_loads(qtype, lanes, 2, U)
    loop = _make_split_loop(qtype, lanes, 2, U, shared=True)
    nw, ns, na, nx = _split_arrays(qtype, 2, U)
    n_words, n_scales = cols // 4, cols // 16

    @device
    def folded_sums(qs, d16, x, nwt, j, num_f, sub, num_blocks, eps):
        A_sh = cuda.shared.array(n_words, uint32)
        X_sh = cuda.shared.array(n_scales, float32)
        scratch = cuda.shared.array(33, float32)
        acc = cuda.local.array(2, float32)
        W = cuda.local.array(nw, uint32)
        S = cuda.local.array(ns, float32)
        A = cuda.local.array(na, uint32)
        X = cuda.local.array(nx, float32)
        valid = j < num_f
        if valid:
            first(qs, d16, j, num_f, 2 * num_f - 1, sub, num_blocks, W, S)
        grid_dep_wait()  # x is the kernel before's output
        build(x, nwt, eps, A_sh, X_sh, scratch)
        acc[0] = float32(0.0)
        acc[1] = float32(0.0)
        if valid:
            loop(qs, d16, A_sh, X_sh, j, num_f, 2 * num_f - 1, sub, num_blocks, acc, W, S, A, X)
        return group_sum(acc[0], lanes), group_sum(acc[1], lanes)

    return folded_sums


def _make_gemv_swiglu(qtype: str, lanes: int, U: int, fold_cols: int = 0):
    """Gate row j and up row j + F (F = num_f) per lane group, SWIGLU_GROUPS groups a block.
    fold_cols > 0: the RMSNorm before it folded in (FOLD_FFN_NORM): xa is then x [>= 1,
    fold_cols] (float32) and xs the norm weight [1, fold_cols]; each block builds the int8
    input in shared memory after the PDL wait, its first weight loads issued before it."""
    groups = SWIGLU_GROUPS
    qwarps = groups // 32
    fold = fold_cols > 0
    sums = None if fold else _make_pair_sums(qtype, lanes, U)
    folded_sums = _make_folded_sums(qtype, lanes, U, fold_cols, groups * lanes) if fold else None

    @aware
    def gemv_swiglu(qs, d16, aux, sc8, xa, xs, num_f, num_blocks, q_out, s_out, nsum, nslot, eps):
        grid_dep_launch()
        tid = cuda.threadIdx.x
        gi = tid // lanes
        sub = tid % lanes
        j = cuda.blockIdx.y * groups + gi
        h_sh = cuda.shared.array(groups, float32)
        if fold:
            g, u = folded_sums(qs, d16, xa, xs, j, num_f, sub, num_blocks, eps)
        else:
            g, u = sums(qs, d16, xa, xs, j, num_f, 2 * num_f - 1, sub, num_blocks, j < num_f)
        if sub == 0:
            r = norm_factor(nsum, nslot, 32 * num_blocks, eps)
            h_sh[gi] = silu_mul(g * r, u * r)
        cuda.syncthreads()
        w = tid // 32
        if w < qwarps:  # warp-uniform: the block's int8 blocks of h
            c = cuda.blockIdx.y * qwarps + w
            store_q8(h_sh[32 * w + tid % 32], 32 * c < num_f, q_out, s_out, 0, c, tid % 32)

    return gemv_swiglu


def _make_gemv_rope(qtype: str, lanes: int, U: int, head_dim: int, interleaved: bool, threads: int = THREADS):
    """The fused QKV GEMV with rope.qkv_post's work for one token of a model without q/k
    norm: each lane group owns one rotated pair (rows j hd + ea, j hd + eb of head j), adds
    the bias, rotates q and k heads, and stores q to q_out and k / v into the pools at the
    token's page and slot."""
    sums = _make_pair_sums(qtype, lanes, U)
    half = head_dim // 2
    pairs_per_block = threads // lanes
    stride = 1 if interleaved else half  # row eb - row ea

    @aware
    def gemv_rope(qs, d16, aux, sc8, xa, xs, num_blocks, bias, has_bias, cos, sin, tok_pos, tok_page, tok_slot,
                  q_out, k_cache, v_cache, num_heads, num_kv_heads, nsum, nslot, eps):  # fmt: skip
        grid_dep_launch()
        tid = cuda.threadIdx.x
        p = cuda.blockIdx.y * pairs_per_block + tid // lanes  # the rotated pair
        sub = tid % lanes
        j = p // half  # the head: q heads, then k, then v
        i = p % half
        ea, eb = pair_elems(i, half, interleaved)
        num_pairs = (num_heads + 2 * num_kv_heads) * half
        row_a = j * head_dim + ea
        lead = sub == 0 and p < num_pairs
        # the epilogue's step inputs and bias (no kernel's outputs) are requested before the PDL
        # wait in `sums`, so they are not DRAM round trips after it; cos / sin follow pos, later
        page = tok_page[0]
        slot = tok_slot[0]
        pos = tok_pos[0]
        ba = bias[row_a] if has_bias and lead else float32(0.0)
        bb = bias[row_a + stride] if has_bias and lead else float32(0.0)
        a, b = sums(qs, d16, xa, xs, row_a, stride, 2 * num_pairs - 1, sub, num_blocks, p < num_pairs)
        if lead:
            r = norm_factor(nsum, nslot, 32 * num_blocks, eps)
            a = a * r + ba
            b = b * r + bb
            if j >= num_heads + num_kv_heads:
                store_pair(v_cache, page, slot, j - num_heads - num_kv_heads, ea, eb, a, b)
            else:
                c = cos[pos, i]
                sn = sin[pos, i]
                ra = a * c - b * sn
                rb = b * c + a * sn
                if j < num_heads:
                    q_out[0, row_a] = ra
                    q_out[0, row_a + stride] = rb
                else:
                    store_pair(k_cache, page, slot, j - num_heads, ea, eb, ra, rb)

    return gemv_rope


@functools.cache
def gemv_rope_kernel(qtype: str, lanes: int, unroll: int, head_dim: int, interleaved: bool):
    return cuda.jit(_make_gemv_rope(qtype, lanes, unroll, head_dim, interleaved))


def gemv_rope(spec, w, xa, xs, bias, cos, sin, tok_pos, tok_page, tok_slot, q_out, k_cache, v_cache,
              interleaved=False, stream=0, lanes: int | None = None, norm=None) -> None:  # fmt: skip
    """q_out[0] and the K / V pools at token 0's (page, slot) = rope.qkv_post of
    q8 row 0 (xa, xs) @ w.T, for a fused QKV matrix `w` of a model without q/k norm (`bias`
    None or the fused QKV bias). `norm` = (sums, slot, eps): the input is gemv_norm's
    unnormalized x * w, its sum of squares in sums[slot] (None: a normalized input)."""
    lanes = lanes or lanes_for(w.num_blocks)
    pairs_per_block = THREADS // lanes
    num_pairs = w.rows // 2
    kernel = gemv_rope_kernel(w.qtype, lanes, ROPE_UNROLL, spec.head_dim, interleaved)
    has_bias = bias is not None
    kernel[(1, -(-num_pairs // pairs_per_block)), THREADS, stream](
        *w.planes, xa, xs, w.num_blocks, bias if has_bias else cos[0], has_bias, cos, sin, tok_pos, tok_page, tok_slot,
        q_out, k_cache, v_cache, spec.num_heads, spec.num_kv_heads, *_norm_args(norm, cos[0]),
    )  # fmt: skip


def _norm_args(norm, dummy):
    """(sums, slot, eps) kernel arguments of a consumer's `norm` (None: slot -1, unread)."""
    if norm is None:
        return dummy, -1, np.float32(0.0)
    sums, slot, eps = norm
    return sums, slot, np.float32(eps)


@functools.cache
def gemv_swiglu_kernel(qtype: str, lanes: int, unroll: int, fold_cols: int = 0):
    return cuda.jit(_make_gemv_swiglu(qtype, lanes, unroll, fold_cols))


def gemv_swiglu(w, xa, xs, q_out, s_out, stream=0, lanes: int | None = None, norm=None, fold=None) -> None:
    """h = silu(g) * u of (g | u) = q8 row 0 (xa, xs) @ w.T for the fused [gate; up] matrix w
    (2F rows), quantized into q_out (int8 [>= 1, F]) and s_out row 0. `norm`: see gemv_rope.
    `fold` = (x, norm weight [1, cols], eps): the input is RMSNorm(x row 0) instead, built by
    each block itself (xa / xs unused)."""
    lanes = lanes or SWIGLU_LANES
    num_f = w.rows // 2
    grid = (1, -(-num_f // SWIGLU_GROUPS))
    unroll = SWIGLU_WIDE_UNROLL if w.num_blocks >= WIDE_BLOCKS else SWIGLU_UNROLL
    if fold is not None:
        x, nwt, eps = fold
        kernel = gemv_swiglu_kernel(w.qtype, lanes, unroll, w.cols)
        kernel[grid, SWIGLU_GROUPS * lanes, stream](*w.planes, x, nwt, num_f, w.num_blocks, q_out, s_out,
                                                    *_norm_args((nwt[0], -1, eps), None))  # fmt: skip
        return
    kernel = gemv_swiglu_kernel(w.qtype, lanes, unroll)
    kernel[grid, SWIGLU_GROUPS * lanes, stream](*w.planes, xa, xs, num_f, w.num_blocks, q_out, s_out,
                                                *_norm_args(norm, xs[0]))  # fmt: skip


def gemv_swiglu_ref(w_f32, xq8, xs, r: float = 1.0):
    """The separate kernels' references chained: the GEMV's product (times the norm factor r
    of an unnormalized input), then swiglu_ref's q8."""
    from ninfer.gpu.cuda.swiglu import swiglu_ref

    gu = gemv_q8_ref(w_f32, xq8, xs, None) * r
    return swiglu_ref(gu.astype(np.float32), "q8")


# -- one activation row whose output is the next RMSNorm's int8 input ------------------------
#
# `gemv_norm` is the O / down GEMV of a one-token step (x += W h) that also writes the next
# GEMV's int8 input, so there is no RMSNorm launch: RMSNorm's y = x * w * r (r = 1 / sqrt(mean
# (x^2) + eps)) quantizes to the same int8 codes as x * w (the codes of a block do not change
# with a common factor, only its scale does), and r is one number for the whole row. A block
# owns 32 consecutive rows (NORM_GROUPS lane groups), so one warp quantizes x * w of its rows
# into one int8 block and adds their sum of squares into sums[slot] (one atomic a block); the
# consumer (gemv_rope / gemv_swiglu, `norm=`) multiplies its row sums by r from sums[slot].
# sums is cleared by the step's embed launch (forward.py: one slot per fold of the step).

NORM_GROUPS = 32  # rows a gemv_norm block owns: one int8 block of the next input
NORM_LANES = 2 if SIMULATOR else 32  # 1,024 threads (<= 64 registers each); 16 lanes measured slower
NORM_UNROLL = 4


def _make_gemv_norm(qtype: str, lanes: int, U: int):
    sums_of = _make_pair_sums(qtype, lanes, U, R=1)
    groups = NORM_GROUPS

    @aware
    def gemv_norm(qs, d16, aux, sc8, xa, xs, num_rows, num_blocks, out, res, norm_w, q_out, s_out, sums, slot):
        grid_dep_launch()
        tid = cuda.threadIdx.x
        gi = tid // lanes
        sub = tid % lanes
        j = cuda.blockIdx.y * groups + gi
        y_sh = cuda.shared.array(groups, float32)
        sq_sh = cuda.shared.array(groups, float32)
        v, _ = sums_of(qs, d16, xa, xs, j, 1, num_rows - 1, sub, num_blocks, j < num_rows)
        if sub == 0:
            x = float32(0.0)
            if j < num_rows:
                x = v + res[0, j]
                out[0, j] = x
                y_sh[gi] = x * norm_w[j]
            else:
                y_sh[gi] = float32(0.0)
            sq_sh[gi] = x * x
        cuda.syncthreads()
        if tid < 32:  # one warp: the block's int8 block and its share of the sum of squares
            c = cuda.blockIdx.y
            store_q8(y_sh[tid], 32 * c < num_rows, q_out, s_out, 0, c, tid)
            total = warp_sum(sq_sh[tid])
            if tid == 0:
                cuda.atomic.add(sums, slot, total)

    return gemv_norm


@functools.cache
def gemv_norm_kernel(qtype: str, lanes: int, unroll: int):
    fn = _make_gemv_norm(qtype, lanes, unroll)
    # launch bounds: 1,024 threads must fit 64 registers each (the PDL wait after the first
    # weight loads raised the count past that: CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES)
    return cuda.jit(fn) if SIMULATOR else cuda.jit(launch_bounds=NORM_GROUPS * lanes)(fn)


def gemv_norm(w, xa, xs, out, res, norm_w, q_out, s_out, sums, slot: int, stream=0, lanes: int | None = None) -> None:
    """out[0] = q8 row 0 (xa, xs) @ w.T + res[0], and the next RMSNorm's input without its
    factor: int8 blocks of out[0] * norm_w into q_out / s_out row 0, sum(out[0]^2) added to
    sums[slot] (which must start at zero). w.rows must be a multiple of 32."""
    lanes = lanes or NORM_LANES
    kernel = gemv_norm_kernel(w.qtype, lanes, NORM_UNROLL)
    kernel[(1, -(-w.rows // NORM_GROUPS)), NORM_GROUPS * lanes, stream](
        *w.planes, xa, xs, w.rows, w.num_blocks, out, res, norm_w, q_out, s_out, sums, slot
    )


def gemv_norm_ref(w_f32, xq8, xs, res, norm_w):
    """(out, int8 codes, scales, sum of squares): the q8 GEMV's product plus res, then the
    codes of out * norm_w (act_quant's reference) and sum(out^2)."""
    from ninfer.gpu.cuda.act_quant import quantize_q8_ref

    out = gemv_q8_ref(w_f32, xq8, xs, res).astype(np.float32)
    q, s = quantize_q8_ref(out * norm_w.reshape(1, -1))
    return out, q, s, float(np.sum(np.square(out.astype(np.float64))))


# -- one activation row with its producer folded in -------------------------------------------
#
# A one-token decode step is latency-bound: every kernel costs a few microseconds of launch-
# to-launch time however little it reads, and a GEMV cannot start loading weights until the
# kernel that produced its input has finished. `gemv_fused` folds that producer into the GEMV:
# RMSNorm + int8 quantization (prologue "norm": y = x * r * w, r = 1 / sqrt(mean(x^2) + eps))
# or SwiGLU + quantization ("swiglu": y = silu(g) * u from the fused gate/up output). Each
# block first issues its first weight loads, then all its threads build the int8 activation
# row together in shared memory (four columns a thread, one block reduction for the norm, a
# 32-column quantization block per 8 aligned lanes: norm.py's arithmetic), so the prologue's
# L2 round trips overlap the weights' DRAM latency; then the GEMV reads its activation blocks
# from shared memory. Every block rebuilds the row: 8 bytes of L2 reads per source column (x
# and the norm weight, or gate and up) against 16 weight rows x 0.625 bytes (Q4_1) per column,
# so the fold pays where launches bound the GEMV, not bytes: matrices up to FUSE_MAX_BYTES
# (on the 8B shape, where every matrix is larger, folding all three anyway measured 228 tok/s
# against 366 for one stream: the re-reads cost more than the launches saved).

FUSE_MAX_COLS = 16384  # widest source row a block rebuilds (its int8 copy: 1.25 bytes a column of shared memory)
FUSE_MAX_BYTES = 4 << 20  # larger matrices are bandwidth-bound: the re-reads would cost more


@device
def _store_quad(v0, v1, v2, v3, qd, valid, A_sh, X_sh):
    """Four columns 4 qd .. + 3 -> int8x4 word A_sh[qd] and, from the block's first thread,
    the 32-column block's dx, dx * sum(q) (act_quant.quantize_quad; every thread calls it)."""
    q0, q1, q2, q3, d, dsum = quantize_quad(v0, v1, v2, v3)
    if valid:
        A_sh[qd] = (uint32(q0 & 0xFF) | (uint32(q1 & 0xFF) << uint32(8)) | (uint32(q2 & 0xFF) << uint32(16))
                    | (uint32(q3 & 0xFF) << uint32(24)))  # fmt: skip
        if cuda.threadIdx.x % 8 == 0:
            X_sh[2 * (qd // 8)] = d
            X_sh[2 * (qd // 8) + 1] = dsum


def _make_prologue(prologue: str, cols: int, threads: int):
    """Device function: the block's threads write q8(prologue(src row 0)) to shared memory
    (A_sh: cols / 4 int8x4 words, X_sh: dx, dx * sum(q) per 32-column block), then sync.
    Thread t takes quads t, t + threads, ...; a 32-column block is 8 aligned threads, all in
    or all out. Nothing is held across quads (the norm reads x twice, the second time from
    L1), so registers do not grow with the width."""
    quads = cols // 4
    chunks = -(-quads // threads)
    norm = prologue == "norm"

    @device
    def build(src, nwt, eps, A_sh, X_sh, scratch):
        tid = cuda.threadIdx.x
        r = float32(1.0)
        if norm:
            ss = float32(0.0)
            for c in range(chunks):
                qd = tid + threads * c
                if qd < quads:
                    v0, v1, v2, v3 = ld4_f32_pinned(src, 0, 4 * qd)
                    ss += v0 * v0 + v1 * v1 + v2 * v2 + v3 * v3
            r = float32(1.0) / math.sqrt(block_sum(ss, scratch) / float32(cols) + eps)
        for c in range(chunks):
            qd = tid + threads * c
            col = 4 * min(qd, quads - 1)  # past the row: a repeated quad, never stored
            if norm:
                x0, x1, x2, x3 = ld4_f32_pinned(src, 0, col)
                w0, w1, w2, w3 = ld4_f32(nwt, 0, col)
                v0, v1, v2, v3 = x0 * r * w0, x1 * r * w1, x2 * r * w2, x3 * r * w3
            else:
                g0, g1, g2, g3 = ld4_f32_pinned(src, 0, col)
                u0, u1, u2, u3 = ld4_f32_pinned(src, 0, cols + col)
                v0, v1, v2, v3 = silu_mul(g0, u0), silu_mul(g1, u1), silu_mul(g2, u2), silu_mul(g3, u3)
            _store_quad(v0, v1, v2, v3, qd, qd < quads, A_sh, X_sh)
        cuda.syncthreads()

    return build


def _make_gemv_fused(qtype: str, lanes: int, R: int, unroll: int, prologue: str, cols: int, threads: int = THREADS):
    """`gemv_split` over one activation row built by the block itself (`_make_prologue`)."""
    wload, wcomp = WLOAD[qtype], WCOMP[qtype]
    rows_per_warp = (32 // lanes) * R
    U = unroll
    nw = WORDS[qtype] * U * R
    ns = 2 * U * R
    na = 8 * U
    nx = 2 * U
    nb = cols // 32
    n_words = cols // 4  # shared-array sizes must be closure constants
    n_scales = 2 * nb
    build = _make_prologue(prologue, cols, threads)

    @aware
    def gemv_fused(qs, d16, aux, sc8, src, nwt, out, res, num_rows, eps, has_res):
        grid_dep_launch()
        lane = cuda.threadIdx.x % 32
        warp = (cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x) // 32
        row0 = warp * rows_per_warp + (lane // lanes) * R
        sub = lane % lanes
        last = nb - 1
        last_row = num_rows - 1
        A_sh = cuda.shared.array(n_words, uint32)
        X_sh = cuda.shared.array(n_scales, float32)
        scratch = cuda.shared.array(33, float32)
        acc = cuda.local.array(R, float32)
        W = cuda.local.array(nw, uint32)
        S = cuda.local.array(ns, float32)
        A = cuda.local.array(na, uint32)
        X = cuda.local.array(nx, float32)
        for r in range(R):
            acc[r] = float32(0.0)
        # the first iteration's weights are on their way while the block builds its input
        for u in range(U):
            bb = min(sub + u * lanes, last)
            for r in range(R):
                wload(qs, d16, min(row0 + r, last_row), bb, W, S, u * R + r)
        grid_dep_wait()  # src is the kernel before's output (PDL: the weights above load meanwhile)
        build(src, nwt, eps, A_sh, X_sh, scratch)
        for blk0 in range(sub, nb, lanes * U):
            if blk0 != sub:
                for u in range(U):
                    bb = min(blk0 + u * lanes, last)
                    for r in range(R):
                        wload(qs, d16, min(row0 + r, last_row), bb, W, S, u * R + r)
            for u in range(U):
                bb = min(blk0 + u * lanes, last)
                for j in range(8):
                    A[8 * u + j] = A_sh[8 * bb + j]
                X[2 * u] = X_sh[2 * bb]
                X[2 * u + 1] = X_sh[2 * bb + 1]
            for u in range(U):
                f = float32(1.0) if blk0 + u * lanes <= last else float32(0.0)
                for r in range(R):
                    acc[r] += f * wcomp(W, S, u * R + r, A, X, u)
        for r in range(R):
            row = row0 + r
            v = group_sum(acc[r], lanes)  # every thread takes part in the shuffles
            if sub == 0 and row < num_rows:
                if has_res:
                    v += res[0, row]
                out[0, row] = v

    return gemv_fused


@functools.cache
def gemv_fused_kernel(qtype: str, prologue: str, lanes: int, cols: int, rows_per_group: int, unroll: int):
    return cuda.jit(_make_gemv_fused(qtype, lanes, rows_per_group, unroll, prologue, cols))


def fusable(w) -> bool:
    """Whether `gemv_fused` takes this matrix: its types, a source row it can rebuild, and
    small enough that launches, not bytes, bound it."""
    return w.qtype in WLOAD and w.cols <= FUSE_MAX_COLS and w.nbytes <= FUSE_MAX_BYTES


def gemv_fused(w, src, norm_w, eps, out, res, prologue: str, stream=0, lanes: int | None = None) -> None:
    """out[0] = q8(prologue(src)) @ w.T (+ res[0]) for one activation row.

    prologue 'norm': src is x [>= 1, cols] and norm_w the RMSNorm weight as [1, cols];
    'swiglu': src is the gate/up output [>= 1, 2 cols] (norm_w any [1, >= 1] float array)."""
    lanes = lanes or lanes_for(w.num_blocks)
    rpg, unroll = ONE_ROW_SHAPE
    rows_per_block = (THREADS // 32) * (32 // lanes) * rpg
    grid = (1, (w.rows + rows_per_block - 1) // rows_per_block)
    kernel = gemv_fused_kernel(w.qtype, prologue, lanes, w.cols, rpg, unroll)
    has_res = res is not None
    kernel[grid, THREADS, stream](*w.planes, src, norm_w, out, res if has_res else out, w.rows, np.float32(eps),
                                  has_res)  # fmt: skip


def gemv_fused_ref(w_f32, src, norm_w, eps, res, prologue: str):
    """float64 reference: the separate kernels' references chained (norm.py / swiglu.py, then
    the q8 GEMV's exact product of the quantized activations)."""
    from ninfer.gpu.cuda.norm import rmsnorm_ref
    from ninfer.gpu.cuda.swiglu import swiglu_ref

    if prologue == "norm":
        _, xq, xs = rmsnorm_ref(src[:1], None, norm_w.reshape(-1), eps, None, "q8")
    else:
        xq, xs = swiglu_ref(src[:1], "q8")
    return gemv_q8_ref(w_f32, xq, xs, res)


@functools.cache
def gemv_kernel(qtype: str, mode: str, lanes: int, max_m: int, rows_per_group: int = 1, unroll: int = 0,
                prefetch: bool = False, split: bool = False):
    return cuda.jit(make_gemv(qtype, mode, lanes, max_m, rows_per_group, unroll, prefetch, split))


def shape_for(qtype: str, mode: str, num_blocks: int, num_m: int, rows: int = 0) -> tuple[int, int, int, bool]:
    """(lanes, rows per lane group, unroll, L2 prefetch) for one launch. One activation row on
    the q8 path shares each activation load between two weight rows and issues all of an
    iteration's loads before its arithmetic (more weight bytes in flight per register),
    except for very tall matrices (an 8B model's LM head), where one row per group measured
    faster. From `python -m ninfer.gpu.cuda.gemv_tune` on the H200 (docs/performance.md):
    the L2 prefetch lost 5-20 % everywhere, so it stays off."""
    lanes = lanes_for(num_blocks)
    if SIMULATOR or mode != "q8" or num_m != 1 or rows >= TALL_ROWS:
        return lanes, 1, 0, False
    if num_blocks >= WIDE_BLOCKS and qtype in WIDE_SHAPE:
        return lanes, *WIDE_SHAPE[qtype], False
    return lanes, ONE_ROW_SHAPE[0], ONE_ROW_SHAPE[1], False


ONE_ROW_SHAPE = (2, 4)  # (rows per lane group, unroll) of the q8 one-activation-row GEMV
TALL_ROWS = 65536  # from this many rows up, one row per lane group
# rows of >= 4,096 columns (an 8B model's linears): of 11 shapes gemv_tune timed on the H200
# (2026-12-03, fourth session), the least time over the four 8B linears together
WIDE_BLOCKS = 128
# (Q8_0 was (1, 4) until the 12th session: in the 8B Q8_0 step on an H100, (2, 4) took 0.16 ms
# off (3.606 vs 3.773 ms), (2, 2) 0.12, (2, 8) 0.09, (4, 4) 0.06; (4, 2) lost 0.04)
WIDE_SHAPE = {"Q4_0": (2, 2), "Q4_1": (2, 2), "Q8_0": (2, 4)}
# One weight row per lane group (Q8_0's wide shape, the tall LM head) through the split loop,
# which issues an iteration's weight loads before the PDL wait (`make_gemv` split): with (1, 4)
# a lane's whole share of an 8B O row loads while the attention before it runs. The plain
# kernel (False) waits first. 8B Q8_0 step on an H100 (12th session): -0.07 ms with the old
# (1, 4) wide shape; with (2, 4) it only reaches the LM head, where it is neutral (3.606 /
# 3.625 vs 3.612 / 3.605 ms). On, as measured with SWIGLU_WIDE_UNROLL (the whole set: 3.500 ms).
ONE_ROW_SPLIT = True


def lanes_for(num_blocks: int) -> int:
    """Threads per weight row: enough to cover short rows without idling most lanes.

    The simulator's cost is per thread, so there two lanes share a row (the cross-lane
    reduction still runs); tests exercise the GPU widths explicitly.
    """
    if SIMULATOR:
        return 2
    return 32 if num_blocks >= 32 else 16 if num_blocks >= 16 else 8


def bucket_m(num_m: int) -> int:
    """Accumulators per block: the next power of two, at most MGROUP."""
    if not 1 <= num_m <= MAX_M:
        raise ValueError(f"the GEMV takes 1 to {MAX_M} activation rows, got {num_m}")
    return min(1 << (num_m - 1).bit_length(), MGROUP)


def gemv(w, xa, xs, out, res, num_m: int, mode: str, stream=0, lanes: int | None = None, shape=None,
         prefetch: bool | None = None, split: bool | None = None) -> None:
    """out[:num_m] = xa[:num_m] @ w.T (+ res); `w` a DeviceWeight; mode 'q8' or 'f32'.

    q8: xa is the uint32 view of the int8 activations and xs their scales; f32: xa is float32
    [M, cols] and xs is ignored. `res` None means no residual. `shape` = (rows per lane group,
    unroll), `prefetch` and `split` (ONE_ROW_SPLIT) override `shape_for` (tests, tuning).
    """
    if mode == "q8" and w.qtype in FLOAT_QTYPES:
        raise ValueError(f"{w.qtype} weights have no int8 path; use mode 'f32'")
    auto_lanes, rpg, unroll, pf = shape_for(w.qtype, mode, w.num_blocks, num_m, w.rows)
    if shape is not None:
        rpg, unroll = shape
    if prefetch is not None:
        pf = prefetch
    lanes = lanes or auto_lanes
    # rpg > 1 takes the split loop anyway; other launches have none (one key, one compile)
    split = ONE_ROW_SPLIT if split is None else split
    split = split and rpg == 1 and mode == "q8" and num_m == 1 and w.qtype in WLOAD
    rows_per_block = (THREADS // 32) * (32 // lanes) * rpg
    grid = (-(-num_m // MGROUP), (w.rows + rows_per_block - 1) // rows_per_block)
    kernel = gemv_kernel(w.qtype, mode, lanes, bucket_m(num_m), rpg, unroll, pf, split)
    has_res = res is not None
    kernel[grid, THREADS, stream](*w.planes, xa, xs, out, res if has_res else out, w.rows, w.num_blocks, num_m, has_res)


def gemv_ref(w_f32: np.ndarray, x: np.ndarray, res: np.ndarray | None) -> np.ndarray:
    """float64 reference: x @ w.T (+ res) for float activations."""
    y = np.asarray(x, np.float64) @ np.asarray(w_f32, np.float64).T
    return y if res is None else y + res


def gemv_q8_ref(w_f32: np.ndarray, xq8: np.ndarray, xs: np.ndarray, res: np.ndarray | None) -> np.ndarray:
    """float64 reference of the q8 path: the quantized activations' exact product."""
    return gemv_ref(w_f32, dequantize_q8_ref(xq8, xs), res)


def ptx_cases():
    """(name, pyfunc, signature) for the PTX test: every type, both modes, all widths."""
    from ninfer.gpu.cuda.device_weights import plane_types
    from ninfer.gpu.cuda.quant_layout import DEVICE_QTYPES

    f32_2d = types.float32[:, ::1]
    cases = []
    for qtype in DEVICE_QTYPES:
        modes = ("f32",) if qtype in FLOAT_QTYPES else ("q8", "f32")
        for mode in modes:
            xa = types.uint32[:, ::1] if mode == "q8" else f32_2d
            sig = (*plane_types(qtype), xa, f32_2d, f32_2d, f32_2d, int32, int32, int32, types.boolean)
            for lanes, max_m in ((32, 1), (8, 8)):
                cases.append((f"gemv_{mode}_{qtype}_l{lanes}_m{max_m}", make_gemv(qtype, mode, lanes, max_m), sig))
            if mode == "q8":
                for lanes, rpg, unroll in ((32, *ONE_ROW_SHAPE), (16, 2, 4), (32, 4, 2), (32, 2, 2)):
                    name = f"gemv_q8_{qtype}_l{lanes}_m1_r{rpg}_u{unroll}"
                    cases.append((name, make_gemv(qtype, mode, lanes, 1, rpg, unroll, True), sig))
                if qtype in WLOAD:  # ONE_ROW_SPLIT
                    cases.append((f"gemv_q8_{qtype}_l32_m1_r1_u4_split", make_gemv(qtype, mode, 32, 1, 1, 4, split=True),
                                  sig))  # fmt: skip
                cases.append((f"gemv_q8_{qtype}_l8_m8_pf", make_gemv(qtype, mode, 8, 8, 1, 0, True), sig))
                cases.append((f"gemv_q8_{qtype}_l32_m1_u8_pf", make_gemv(qtype, mode, 32, 1, 1, 8, True), sig))
    f2 = types.float32[:, ::1]
    u2 = types.uint32[:, ::1]
    for qtype in WLOAD:  # the epilogue folds (their own shapes, as gemv_swiglu / gemv_rope pick)
        f1, i1, i8, cache = types.float32[::1], types.int32[::1], types.int8[:, ::1], types.float16[:, :, :, ::1]
        norm = (f1, types.int64, types.float32)  # the consumer's (sums, slot, eps)
        swiglu_sig = (*plane_types(qtype), u2, f2, int32, int32, i8, f2, *norm)
        for u in (SWIGLU_UNROLL, SWIGLU_WIDE_UNROLL):
            cases.append((f"gemv_swiglu_{qtype}_u{u}", _make_gemv_swiglu(qtype, SWIGLU_LANES, u), swiglu_sig))
        fold_sig = (*plane_types(qtype), f2, f2, int32, int32, i8, f2, *norm)  # x and the norm weight
        cases.append((f"gemv_swiglu_fold_{qtype}", _make_gemv_swiglu(qtype, SWIGLU_LANES, SWIGLU_WIDE_UNROLL, 4096),
                      fold_sig))  # fmt: skip
        rope_sig = (*plane_types(qtype), u2, f2, int32, f1, types.boolean, f2, f2, i1, i1, i1, f2, cache, cache, int32,
                    int32, *norm)  # fmt: skip
        cases.append((f"gemv_rope_{qtype}_hd128", _make_gemv_rope(qtype, 32, ROPE_UNROLL, 128, False), rope_sig))
        norm_sig = (*plane_types(qtype), u2, f2, int32, int32, f2, f2, f1, i8, f2, f1, types.int64)
        cases.append((f"gemv_norm_{qtype}", _make_gemv_norm(qtype, NORM_LANES, NORM_UNROLL), norm_sig))
    for qtype in WLOAD:
        sig = (*plane_types(qtype), f2, f2, f2, f2, int32, types.float32, types.boolean)
        for prologue, lanes, cols in (("norm", 16, 576), ("swiglu", 32, 1536), ("norm", 32, 4096), ("swiglu", 32, 14336)):
            name = f"gemv_fused_{prologue}_{qtype}_l{lanes}_c{cols}"
            cases.append((name, _make_gemv_fused(qtype, lanes, *ONE_ROW_SHAPE, prologue, cols), sig))
    return cases
