"""One activation row (a one-token q8 step) with a neighbouring small kernel folded into the GEMV.

A one-token decode step is latency-bound: every kernel costs a few microseconds of launch-to-
launch time however little it reads. These kernels remove small kernels from the step
(forward.py takes them per `KernelPlan.folds` / `.epilogues`):

* epilogue folds, for matrices of any size: `gemv_rope` (the fused QKV of a model without q/k
  norm: a lane group owns one rotated pair of rows, adds the bias, rotates, writes q and the
  pools' K / V: rope.qkv_post) and `gemv_swiglu` (gate+up: a lane group owns gate row j and up
  row j + F, so its sums give h_j = silu(g_j) * u_j; one warp a block quantizes 32 of them
  into the down GEMV's int8 block);
* the prologue fold `gemv_fused`, for small matrices only (`fusable`): RMSNorm or SwiGLU and
  the int8 quantization of the GEMV's input built by each block itself in shared memory while
  its first weights load.

All build on gemv.py's split loop (every load of an iteration before its arithmetic).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, types, uint32

from ninfer.gpu.cuda.kernels.act_quant import quantize_quad, store_q8
from ninfer.gpu.cuda.kernels.gemv import (
    THREADS, WIDE_BLOCKS, _make_split_loop, _split_arrays, gemv_q8_ref, lanes_for,
)
from ninfer.gpu.cuda.kernels.intrinsics import (
    SIMULATOR, block_sum, device, grid_dep_launch, grid_dep_wait, group_sum, ld4_f32, ld4_f32_pinned,
)
from ninfer.gpu.cuda.kernels.jit import compiled
from ninfer.gpu.cuda.kernels.pdl import aware
from ninfer.gpu.cuda.kernels.qdot import SPLIT_QTYPES, WCOMP, WORDS, fns
from ninfer.gpu.cuda.kernels.rope import pair_elems, store_pair
from ninfer.gpu.cuda.kernels.swiglu import silu_mul
from ninfer.gpu.cuda.plan import DEFAULT, KernelPlan

# -- epilogue folds ------------------------------------------------------------------------------
#
# Folding RMSNorm into the O / down GEMV by its last block to finish (an atomic count after
# every block fenced its stores) was correct but slower on the H200 (8B Q8_0: 3.671 vs 3.447
# ms a step) and was removed, as were the O / down GEMVs writing the next RMSNorm's int8 input
# (measured neutral).

SWIGLU_GROUPS = 32  # lane groups of a gemv_swiglu block: one 32-column int8 block of h
SWIGLU_LANES = 2 if SIMULATOR else 8


def _make_pair_sums(qtype: str, lanes: int, U: int, evict_first: bool = True):
    """Device function: a lane group's two row sums, rows row_a and row_a + stride (0 where not
    `valid`); every thread calls it (the group's shuffles)."""
    nw, ns, na, nx = _split_arrays(qtype, 2, U)
    loop = _make_split_loop(qtype, lanes, 2, U, evict_first)

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
        return group_sum(acc[0], lanes), group_sum(acc[1], lanes)

    return pair_sums


def _make_gemv_swiglu(qtype: str, lanes: int, U: int, evict_first: bool = True):
    """Gate row j and up row j + F (F = num_f) per lane group, SWIGLU_GROUPS groups a block."""
    groups = SWIGLU_GROUPS
    qwarps = groups // 32
    sums = _make_pair_sums(qtype, lanes, U, evict_first)

    @aware
    def gemv_swiglu(qs, d16, aux, sc8, xa, xs, num_f, num_blocks, q_out, s_out):
        grid_dep_launch()
        tid = cuda.threadIdx.x
        gi = tid // lanes
        sub = tid % lanes
        j = cuda.blockIdx.y * groups + gi
        h_sh = cuda.shared.array(groups, float32)
        g, u = sums(qs, d16, xa, xs, j, num_f, 2 * num_f - 1, sub, num_blocks, j < num_f)
        if sub == 0:
            h_sh[gi] = silu_mul(g, u)
        cuda.syncthreads()
        w = tid // 32
        if w < qwarps:  # warp-uniform: the block's int8 blocks of h
            c = cuda.blockIdx.y * qwarps + w
            store_q8(h_sh[32 * w + tid % 32], 32 * c < num_f, q_out, s_out, 0, c, tid % 32)

    return gemv_swiglu


def _make_gemv_rope(qtype: str, lanes: int, U: int, head_dim: int, interleaved: bool, threads: int = THREADS,
                    evict_first: bool = True):  # fmt: skip
    """The fused QKV GEMV with rope.qkv_post's work for one token of a model without q/k
    norm: each lane group owns one rotated pair (rows j hd + ea, j hd + eb of head j), adds
    the bias, rotates q and k heads, and stores q to q_out and k / v into the pools at the
    token's page and slot."""
    sums = _make_pair_sums(qtype, lanes, U, evict_first)
    half = head_dim // 2
    pairs_per_block = threads // lanes
    stride = 1 if interleaved else half  # row eb - row ea

    @aware
    def gemv_rope(qs, d16, aux, sc8, xa, xs, num_blocks, bias, has_bias, cos, sin, tok_pos, tok_page, tok_slot,
                  q_out, k_cache, v_cache, num_heads, num_kv_heads):  # fmt: skip
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
            a = a + ba
            b = b + bb
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


@compiled
def gemv_rope_kernel(qtype: str, lanes: int, unroll: int, head_dim: int, interleaved: bool, evict_first: bool = True):
    return cuda.jit(_make_gemv_rope(qtype, lanes, unroll, head_dim, interleaved, evict_first=evict_first))


def gemv_rope(spec, w, xa, xs, bias, cos, sin, tok_pos, tok_page, tok_slot, q_out, k_cache, v_cache,
              interleaved=False, stream=0, lanes: int | None = None, plan: KernelPlan = DEFAULT) -> None:  # fmt: skip
    """q_out[0] and the K / V pools at token 0's (page, slot) = rope.qkv_post of
    q8 row 0 (xa, xs) @ w.T, for a fused QKV matrix `w` of a model without q/k norm (`bias`
    None or the fused QKV bias)."""
    lanes = lanes or lanes_for(w.num_blocks)
    pairs_per_block = THREADS // lanes
    num_pairs = w.rows // 2
    kernel = gemv_rope_kernel(w.qtype, lanes, plan.rope_unroll, spec.head_dim, interleaved, plan.evict_first)
    has_bias = bias is not None
    kernel[(1, -(-num_pairs // pairs_per_block)), THREADS, stream](
        *w.planes, xa, xs, w.num_blocks, bias if has_bias else cos[0], has_bias, cos, sin, tok_pos, tok_page, tok_slot,
        q_out, k_cache, v_cache, spec.num_heads, spec.num_kv_heads,
    )  # fmt: skip


@compiled
def gemv_swiglu_kernel(qtype: str, lanes: int, unroll: int, evict_first: bool = True):
    return cuda.jit(_make_gemv_swiglu(qtype, lanes, unroll, evict_first))


def gemv_swiglu(w, xa, xs, q_out, s_out, stream=0, lanes: int | None = None, plan: KernelPlan = DEFAULT) -> None:
    """h = silu(g) * u of (g | u) = q8 row 0 (xa, xs) @ w.T for the fused [gate; up] matrix w
    (2F rows), quantized into q_out (int8 [>= 1, F]) and s_out row 0."""
    lanes = lanes or SWIGLU_LANES
    num_f = w.rows // 2
    grid = (1, -(-num_f // SWIGLU_GROUPS))
    unroll = plan.swiglu_wide_unroll if w.num_blocks >= WIDE_BLOCKS else plan.swiglu_unroll
    kernel = gemv_swiglu_kernel(w.qtype, lanes, unroll, plan.evict_first)
    kernel[grid, SWIGLU_GROUPS * lanes, stream](*w.planes, xa, xs, num_f, w.num_blocks, q_out, s_out)


def gemv_swiglu_ref(w_f32, xq8, xs):
    """The separate kernels' references chained: the GEMV's product, then swiglu_ref's q8."""
    from ninfer.gpu.cuda.kernels.swiglu import swiglu_ref

    gu = gemv_q8_ref(w_f32, xq8, xs, None)
    return swiglu_ref(gu.astype(np.float32), "q8")


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


def _make_gemv_fused(qtype: str, lanes: int, R: int, unroll: int, prologue: str, cols: int, threads: int = THREADS,
                     evict_first: bool = True):  # fmt: skip
    """`gemv_split` over one activation row built by the block itself (`_make_prologue`)."""
    wload, wcomp = fns(evict_first).wload[qtype], WCOMP[qtype]
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


@compiled
def gemv_fused_kernel(qtype: str, prologue: str, lanes: int, cols: int, rows_per_group: int, unroll: int,
                      evict_first: bool = True):  # fmt: skip
    return cuda.jit(_make_gemv_fused(qtype, lanes, rows_per_group, unroll, prologue, cols, evict_first=evict_first))


def fusable(w) -> bool:
    """Whether `gemv_fused` takes this matrix: its types, a source row it can rebuild, and
    small enough that launches, not bytes, bound it."""
    return w.qtype in SPLIT_QTYPES and w.cols <= FUSE_MAX_COLS and w.nbytes <= FUSE_MAX_BYTES


def gemv_fused(w, src, norm_w, eps, out, res, prologue: str, stream=0, lanes: int | None = None,
               plan: KernelPlan = DEFAULT) -> None:  # fmt: skip
    """out[0] = q8(prologue(src)) @ w.T (+ res[0]) for one activation row.

    prologue 'norm': src is x [>= 1, cols] and norm_w the RMSNorm weight as [1, cols];
    'swiglu': src is the gate/up output [>= 1, 2 cols] (norm_w any [1, >= 1] float array)."""
    lanes = lanes or lanes_for(w.num_blocks)
    rpg, unroll = plan.one_row_shape
    rows_per_block = (THREADS // 32) * (32 // lanes) * rpg
    grid = (1, (w.rows + rows_per_block - 1) // rows_per_block)
    kernel = gemv_fused_kernel(w.qtype, prologue, lanes, w.cols, rpg, unroll, plan.evict_first)
    has_res = res is not None
    kernel[grid, THREADS, stream](*w.planes, src, norm_w, out, res if has_res else out, w.rows, np.float32(eps),
                                  has_res)  # fmt: skip


def gemv_fused_ref(w_f32, src, norm_w, eps, res, prologue: str):
    """float64 reference: the separate kernels' references chained (norm.py / swiglu.py, then
    the q8 GEMV's exact product of the quantized activations)."""
    from ninfer.gpu.cuda.kernels.norm import rmsnorm_ref
    from ninfer.gpu.cuda.kernels.swiglu import swiglu_ref

    if prologue == "norm":
        _, xq, xs = rmsnorm_ref(src[:1], None, norm_w.reshape(-1), eps, None, "q8")
    else:
        xq, xs = swiglu_ref(src[:1], "q8")
    return gemv_q8_ref(w_f32, xq, xs, res)


def ptx_cases():
    """The folds at the shapes the default plan launches (gemv_swiglu / gemv_rope pick their
    own), and gemv_fused at SmolLM2's and the 8B's widths."""
    from ninfer.gpu.cuda.device_weights import plane_types

    f2 = types.float32[:, ::1]
    u2 = types.uint32[:, ::1]
    cases = []
    for qtype in SPLIT_QTYPES:
        f1, i1, i8, cache = types.float32[::1], types.int32[::1], types.int8[:, ::1], types.float16[:, :, :, ::1]
        swiglu_sig = (*plane_types(qtype), u2, f2, int32, int32, i8, f2)
        for u in sorted({DEFAULT.swiglu_unroll, DEFAULT.swiglu_wide_unroll}):
            cases.append((f"gemv_swiglu_{qtype}_u{u}", _make_gemv_swiglu(qtype, SWIGLU_LANES, u), swiglu_sig))
        rope_sig = (*plane_types(qtype), u2, f2, int32, f1, types.boolean, f2, f2, i1, i1, i1, f2, cache, cache, int32,
                    int32)  # fmt: skip
        cases.append((f"gemv_rope_{qtype}_hd128", _make_gemv_rope(qtype, 32, DEFAULT.rope_unroll, 128, False), rope_sig))
    for qtype in SPLIT_QTYPES:
        sig = (*plane_types(qtype), f2, f2, f2, f2, int32, types.float32, types.boolean)
        for prologue, lanes, cols in (("norm", 16, 576), ("swiglu", 32, 1536), ("norm", 32, 4096), ("swiglu", 32, 14336)):
            name = f"gemv_fused_{prologue}_{qtype}_l{lanes}_c{cols}"
            cases.append((name, _make_gemv_fused(qtype, lanes, *DEFAULT.one_row_shape, prologue, cols), sig))
    return cases
