"""Decode attention with lanes over positions: a split of 32 positions, one a lane.

For few rows, the split kernel of attn_decode.py spends its time in latency chains (every
score a 5-shuffle warp sum). Here lane i of every warp owns position i of the block's split;
the partials merge in attn_decode.attn_combine. `use_lp` says which graph buckets take it.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, types, uint32

from ninfer.gpu.cuda.kernels.attn_decode import (
    NEG_BIG, ONE_SHORT_CHUNKS, ONE_VEC, attn_combine_kernel, one_launch_chunk,
)
from ninfer.gpu.cuda.kernels.intrinsics import (
    device, grid_dep_launch, grid_dep_wait, ld4_f32_pinned, ld8, ld8_cg, ld8_pinned, shfl_xor, st8_f32, warp_max,
    warp_sum,
)
from ninfer.gpu.cuda.kernels.jit import compiled
from ninfer.gpu.cuda.kernels.pdl import aware
from ninfer.gpu.cuda.plan import DEFAULT, KernelPlan

# For few rows, the split kernel above spends its time in latency chains: 4 warps walk a split's
# positions with lanes over head_dim, so every score is a 5-shuffle warp sum, for every query
# head and position in turn. Here lane i of every warp owns position i of the block's split of
# 32: warp w scores it against the group's q (from shared memory) over columns [w c, (w + 1) c)
# of head_dim (c = LP_COLS) with plain FMAs, the warps' partial scores add up through shared
# memory, one warp max and one warp sum per head give the split's softmax, and the P V pass
# turns to lanes over columns: warp w accumulates columns [w c, (w + 1) c), 8 a lane, over the
# split's positions (32 / (c / 8) rows a warp load). Page ids are loaded before seq_lens is
# known, and every K and V load of the split is issued before the first score: one round trip
# for the ids, one for K / V. The partials merge in attn_combine, as for `attn_decode`.
LP_SPLIT = 32
LP_COLS = 64  # head_dim columns a warp covers: its V share is 32 x 64 / 32 = 64 floats a lane
# (8B Q8_0 one stream, H100, 13th session, with PRELOAD and evict-first weights: 32 columns
# 3.209 / 3.206 ms a step, 16 columns 3.209 / 3.206, 64 columns 3.161 / 3.156)


# When it is taken, from attn_tune on the H200 (2026-12-04, docs/performance.md; us a layer, lp
# vs split + combine vs one launch): at head_dim 128 (8B) it is at or below split + combine for
# 1 to 16 rows and contexts 128 to 1,024 (1 row: 12.25 vs 12.45 at 128, 17.47 vs 18.25 at
# 1,024; 16 rows at 1,024: 93.6 vs 121.5), but one launch wins where use_one_launch picks it.
# At head_dim 64 (SmolLM2) it loses to split + combine for 1 row (13.8 vs 13.0 at 1,024) and
# wins from 4 rows at long contexts, where it also beats one launch (16 rows at 1,024: 20.8 vs
# 36.0 one launch, 37.2 split). More than 16 rows are unmeasured and keep split + combine.
LP_MAX_ROWS = 16
# KernelPlan.lp_preload: K / V loads before the PDL wait (make_attn_decode_lp `preload`); neutral
# alone while the GEMVs' weights swept the KV out of L2, faster with those loaded evict-first.
# KernelPlan.lp_const_page: the pools' page size compiled in (a run-time divisor made every
# position // page_size and % page_size a call to the 64-bit division routines: 12 KB of the
# kernel's 58 KB of code).


def use_lp(head_dim: int, split_len: int, num_rows: int, context: int, one_launch: bool,
           plan: KernelPlan = DEFAULT) -> bool:  # fmt: skip
    """Whether a decode bucket (`num_rows` rows of at most `context` positions) takes
    `attn_decode_lp`, given use_one_launch's answer `one_launch`: a function of the graph key
    (and the plan: `lp_over_one` takes it wherever it is supported, one launch included)."""
    if not lp_supported(head_dim, split_len) or num_rows > LP_MAX_ROWS:
        return False
    if plan.lp_over_one:
        return True
    if one_launch:  # kept where one launch covers the context in a few chunks, or at head_dim 128
        return head_dim <= 64 and -(-context // one_launch_chunk(head_dim)) > ONE_SHORT_CHUNKS
    return head_dim >= 128 or num_rows >= 4


def lp_supported(head_dim: int, split_len: int) -> bool:
    """The lanes-over-positions kernel needs splits of 32 and head_dim 32, 64 or a multiple of 64."""
    return split_len == LP_SPLIT and (head_dim in (32, 64) or head_dim % LP_COLS == 0)


def lp_warps(head_dim: int, cols: int | None = None) -> int:
    return max(1, head_dim // (cols or LP_COLS))


@device
def split_softmax(s, valid):
    """One split's softmax over a warp whose lane i holds position i's score `s`: (max, this
    lane's exp(s - max), 0 past the row, and their sum over the warp)."""
    s = s if valid else float32(NEG_BIG)
    mx = warp_max(s)
    e = math.exp(s - mx) if valid else float32(0.0)
    return mx, e, warp_sum(e)


def _make_rows_sum(n: int, lpr: int):
    """Device function: acc[0:n] summed over the lanes lpr, 2 lpr, ... apart (the P V pass's
    rows of the same columns), every lane getting the sums."""

    @device
    def rows_sum(acc):
        off = lpr
        while off < 32:
            for i in range(n):
                acc[i] += shfl_xor(acc[i], off)
            off *= 2

    return rows_sum


def _page_split(page_size: int):
    """Device functions (position -> page index, position -> slot) for a page size compiled
    in (`page_size` > 0; shift and mask where it is a power of two) or read at run time (0:
    the functions' second argument). Positions are >= 0: a shift equals the floor division."""
    if page_size > 0 and page_size & (page_size - 1) == 0:
        sh, mask = page_size.bit_length() - 1, page_size - 1

        @device
        def page_of(p, psz):
            return p >> sh

        @device
        def slot_of(p, psz):
            return p & mask

        return page_of, slot_of

    @device
    def page_div(p, psz):
        return p // psz

    @device
    def slot_mod(p, psz):
        return p % psz

    return page_div, slot_mod


def make_attn_decode_lp(head_dim: int, group: int, preload: bool = False, page_size: int = 16,
                        cols: int | None = None):
    """`preload`: K / V of every position but the newest load before the grid dependency wait
    (PDL), on the read-only path (no kernel in flight writes them); the newest after it.
    `page_size`: the pools' (a compile-time constant: position // page_size and % page_size
    are shifts and masks, not calls to the 64-bit division routines; 0: read at run time)."""
    if not lp_supported(head_dim, LP_SPLIT):
        raise ValueError(f"the lanes-over-positions decode attention needs head_dim 32, 64 or a multiple of 64, got {head_dim}")
    vec = ONE_VEC
    nw = lp_warps(head_dim, cols)
    cols = head_dim // nw  # a warp's columns
    lpr = cols // vec  # lanes over one V row (and 16-byte pieces of a warp's K columns)
    rpw = 32 // lpr  # V rows a warp loads at once
    npl = 32 // rpw  # positions a lane accumulates in the P V pass
    gd = group * head_dim
    gv = group * vec
    rows_sum = _make_rows_sum(gv, lpr)
    nv = npl * vec
    threads = 32 * nw
    q_rounds = -(-gd // (4 * threads))
    # preloaded K / V are read-only while this kernel lives; otherwise the newest position may
    # still be in flight from the kernel before when it starts (pdl.py): coherent loads
    load = ld8 if preload else ld8_pinned
    page_of, slot_of = _page_split(page_size)

    @device
    def lp_loads(k_cache, v_cache, vpg, page, slot, p, start, r0, kvh, c0, d0, lim, vv, kk, psz):
        """The lane's V rows (P V pass) and its position's K columns, positions below `lim`
        (others read as zeros from page 0: table entries past a row are stale or unset)."""
        zero = float32(0.0)
        for k in range(npl):  # V first: its latency overlaps the K pass
            pj = start + r0 + k * rpw
            ok = pj < lim
            v0, v1, v2, v3, v4, v5, v6, v7 = load(v_cache, vpg[k] if ok else 0, slot_of(pj, psz), kvh, d0)
            vv[k * vec + 0], vv[k * vec + 1] = (v0, v1) if ok else (zero, zero)
            vv[k * vec + 2], vv[k * vec + 3] = (v2, v3) if ok else (zero, zero)
            vv[k * vec + 4], vv[k * vec + 5] = (v4, v5) if ok else (zero, zero)
            vv[k * vec + 6], vv[k * vec + 7] = (v6, v7) if ok else (zero, zero)
        pg = page if p < lim else 0
        for c in range(lpr):
            k0, k1, k2, k3, k4, k5, k6, k7 = load(k_cache, pg, slot, kvh, c0 + vec * c)
            kk[c * vec + 0], kk[c * vec + 1], kk[c * vec + 2], kk[c * vec + 3] = k0, k1, k2, k3
            kk[c * vec + 4], kk[c * vec + 5], kk[c * vec + 6], kk[c * vec + 7] = k4, k5, k6, k7

    @aware
    def attn_decode_lp(q, k_cache, v_cache, tables, seq_lens, o_part, ml_part, scale):
        grid_dep_launch()
        b = cuda.blockIdx.x
        kvh = cuda.blockIdx.y
        sp = cuda.blockIdx.z
        tid = cuda.threadIdx.x
        lane = tid % 32
        warp = tid // 32
        last_t = tables.shape[1] - 1
        psz = page_size if page_size > 0 else k_cache.shape[1]
        start = sp * LP_SPLIT
        c0 = warp * cols  # this warp's columns
        r0 = lane // lpr  # the P V pass: this lane's first row and its 8 columns
        d0 = c0 + (lane % lpr) * vec
        # page ids first, clamped to the table; they do not wait for seq_lens (lp_loads reads page 0
        # for positions past the row: entries past a row's pages are stale or unset)
        page = tables[b, uint32(min(page_of(start + lane, psz), last_t))]
        vpg = cuda.local.array(npl, int32)
        for k in range(npl):
            vpg[k] = tables[b, uint32(min(page_of(start + r0 + k * rpw, psz), last_t))]
        n = seq_lens[b]  # tables and seq_lens are step inputs: no kernel writes them
        newest = n - 1  # the position the kernel before (QKV + K / V write) is writing now
        zero = float32(0.0)
        vv = cuda.local.array(nv, float32)  # this lane's V rows (P V pass)
        kk = cuda.local.array(nv, float32)  # the K row's columns of this warp at this lane's position
        p = start + lane
        valid = p < n
        slot = slot_of(p, psz)
        # every K / V load of the split before any arithmetic; with `preload` before the grid
        # dependency wait too (PDL), but for the newest position, loaded after it
        lim = newest if preload else n
        if preload:
            lp_loads(k_cache, v_cache, vpg, page, slot, p, start, r0, kvh, c0, d0, lim, vv, kk, psz)
        grid_dep_wait()  # q (and the pools' newest position) come from the kernels before
        qs = cuda.shared.array(gd, float32)
        part = cuda.shared.array((nw, group, LP_SPLIT), float32)
        ps = cuda.shared.array((group, LP_SPLIT), float32)
        for it in range(q_rounds):  # the group's q, scaled, in 16-byte loads
            i = uint32(4 * tid + it * 4 * threads)
            if i < gd:
                a0, a1, a2, a3 = ld4_f32_pinned(q, b, uint32(kvh * gd) + i)
                qs[i], qs[i + 1], qs[i + 2], qs[i + 3] = a0 * scale, a1 * scale, a2 * scale, a3 * scale
        if start >= n:  # the whole block
            return
        cuda.syncthreads()  # qs
        if preload:  # the newest position, written by the kernel before: from L2, not L1
            for k in range(npl):
                pj = start + r0 + k * rpw
                if pj == newest:
                    v0, v1, v2, v3, v4, v5, v6, v7 = ld8_cg(v_cache, vpg[k], slot_of(pj, psz), kvh, d0)
                    vv[k * vec + 0], vv[k * vec + 1], vv[k * vec + 2], vv[k * vec + 3] = v0, v1, v2, v3
                    vv[k * vec + 4], vv[k * vec + 5], vv[k * vec + 6], vv[k * vec + 7] = v4, v5, v6, v7
            if p == newest:
                for c in range(lpr):
                    k0, k1, k2, k3, k4, k5, k6, k7 = ld8_cg(k_cache, page, slot, kvh, c0 + vec * c)
                    kk[c * vec + 0], kk[c * vec + 1], kk[c * vec + 2], kk[c * vec + 3] = k0, k1, k2, k3
                    kk[c * vec + 4], kk[c * vec + 5], kk[c * vec + 6], kk[c * vec + 7] = k4, k5, k6, k7
        else:
            lp_loads(k_cache, v_cache, vpg, page, slot, p, start, r0, kvh, c0, d0, lim, vv, kk, psz)
        for g in range(group):
            sg = float32(0.0)
            q0 = uint32(g * head_dim + c0)
            for i in range(nv):  # kk's index is constant once this inner loop is unrolled
                sg += qs[q0 + i] * kk[i]
            part[uint32(warp), g, uint32(lane)] = sg
        cuda.syncthreads()  # part
        # the split's softmax per head (every warp, redundantly): (max, sum) over the warp
        mg = cuda.local.array(group, float32)
        lg = cuda.local.array(group, float32)
        for g in range(group):
            s = part[0, g, uint32(lane)]
            for w in range(1, nw):
                s += part[w, g, uint32(lane)]
            mg[g], e, lg[g] = split_softmax(s, valid)
            if warp == 0:
                ps[g, uint32(lane)] = e
        cuda.syncthreads()  # ps
        acc = cuda.local.array(gv, float32)
        for i in range(gv):
            acc[i] = zero
        for k in range(npl):
            j = uint32(r0 + k * rpw)
            for g in range(group):
                w8 = ps[g, j]
                for e in range(vec):
                    acc[g * vec + e] += w8 * vv[k * vec + e]
        rows_sum(acc)  # the rows' partial sums: lanes lpr, 2 lpr, ... apart hold the same columns
        for g in range(group):
            h = kvh * group + g
            if r0 == 0:
                a = g * vec
                st8_f32(o_part, b, h, sp, d0, (acc[a], acc[a + 1], acc[a + 2], acc[a + 3], acc[a + 4], acc[a + 5],
                                               acc[a + 6], acc[a + 7]))  # fmt: skip
            if tid == 0:
                ml_part[b, h, sp, 0] = mg[g]
                ml_part[b, h, sp, 1] = lg[g]

    return attn_decode_lp


@compiled
def attn_decode_lp_kernel(head_dim, group, preload=False, page_size=16, cols=None):
    return cuda.jit(make_attn_decode_lp(head_dim, group, preload, page_size, cols))


def attn_decode_lp(spec, q, k_cache, v_cache, tables, seq_lens, o_part, ml_part, out, xs, num_rows, mode, stream=0,
                   num_splits: int | None = None, plan: KernelPlan = DEFAULT) -> None:  # fmt: skip
    """Decode attention over splits of LP_SPLIT positions, one warp each, then attn_combine:
    the same inputs and outputs as `attn_decode` at split_len 32 (o_part / ml_part [B, H,
    max_splits, hd | 2] scratch; `num_splits` must cover the longest row)."""
    max_splits = min(num_splits or o_part.shape[2], o_part.shape[2])
    scale = np.float32(1.0 / math.sqrt(spec.head_dim))
    kernel = attn_decode_lp_kernel(spec.head_dim, spec.group_size, plan.lp_preload,
                                   k_cache.shape[1] if plan.lp_const_page else 0, LP_COLS)
    kernel[(num_rows, spec.num_kv_heads, max_splits), 32 * lp_warps(spec.head_dim, LP_COLS), stream](
        q, k_cache, v_cache, tables, seq_lens, o_part, ml_part, scale
    )
    attn_combine_kernel(spec.head_dim, LP_SPLIT, mode)[(num_rows, spec.num_heads), spec.head_dim, stream](
        o_part, ml_part, seq_lens, out, xs
    )


def ptx_cases():
    f2 = types.float32[:, ::1]
    f4 = types.float32[:, :, :, ::1]
    i1, i2 = types.int32[::1], types.int32[:, ::1]
    cases = []
    for kv_t in (types.float16, types.float32):
        cache = types.Array(kv_t, 4, "C")
        for hd, group in ((64, 3), (128, 4), (128, 2), (256, 4)):
            sig = (f2, cache, cache, i2, i1, f4, f4, types.float32)
            cases.append((f"attn_decode_lp_hd{hd}_g{group}_{kv_t}", make_attn_decode_lp(hd, group), sig))
            cases.append((f"attn_decode_lp_pre_hd{hd}_g{group}_{kv_t}", make_attn_decode_lp(hd, group, True), sig))
    return cases
