"""Paged decode attention (one new token a row) with grouped-query heads: split-K, one launch.

Split-K (flash-decoding): grid (row, kv head, split); a split covers `split_len` positions, so
long contexts spread over many blocks. Each of the 4 warps walks every 4th position of its
split with lanes over head_dim, scoring all `group` query heads that share the KV head and
keeping an online softmax (max m, sum l, weighted values). `attn_combine` merges the splits
per (row, head) and writes float32 or int8 (the o-proj input). For few rows and short
contexts (`use_one_launch`, by the graph bucket) `attn_decode_one` does it all in one launch:
one block of 8 warps per (row, KV head) walks the whole context. attn_lp.py has a third
kernel, lanes over positions, for few rows.

Scores are scaled by `scale` = 1 / sqrt(head_dim); K/V caches are [pages, page_size, kv_heads,
head_dim] of one layer (float16 or float32; arithmetic in float32). `attention_ref` is the
numpy oracle of every attention kernel (decode and prefill).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, types

from ninfer.gpu.cuda.kernels.act_quant import store_q8
from ninfer.gpu.cuda.kernels.intrinsics import (
    SIMULATOR, device, grid_dep_launch, grid_dep_wait, group_sum, ld8_pinned, ld_f32_cg, shfl_xor, warp_sum,
)
from ninfer.gpu.cuda.kernels.jit import compiled
from ninfer.gpu.cuda.kernels.pdl import aware

DECODE_THREADS = 128
NEG_BIG = -1.0e30  # running-max seed: exp(NEG_BIG - finite) == 0 without inf - inf


@device
def merge_warps(sm, sl, sa, nw, g, e):
    """(max, sum, weighted value) of element e of head g over the `nw` warps' online softmaxes
    (maxima sm[w, g], sums sl[w, g], unnormalised outputs sa[w, g, e])."""
    mx = sm[0, g]
    for w in range(1, nw):
        mx = max(mx, sm[w, g])
    tot = float32(0.0)
    val = float32(0.0)
    for w in range(nw):
        f = math.exp(sm[w, g] - mx)
        tot += sl[w, g] * f
        val += sa[w, g, e] * f
    return mx, tot, val


MERGE_UNROLL = 8  # splits whose partials one merge step loads before using any


@device
def _merge(o_part, ml_part, b, h, e, ns):
    """Element e of head h of row b merged over its `ns` splits (o_part, ml_part) by an online
    softmax. The partials of MERGE_UNROLL splits are loaded before any is used, so a merge
    waits one round trip per 8 splits, not one per split (from L2: the kernel before wrote
    them, under PDL)."""
    mu = MERGE_UNROLL
    mx = float32(NEG_BIG)
    tot = float32(0.0)
    val = float32(0.0)
    ms = cuda.local.array(mu, float32)
    ls = cuda.local.array(mu, float32)
    os_ = cuda.local.array(mu, float32)
    last = ns - 1
    for s0 in range(0, ns, mu):
        for j in range(mu):
            sp = min(s0 + j, last)
            ms[j] = ld_f32_cg(ml_part, b, h, sp, 0)
            ls[j] = ld_f32_cg(ml_part, b, h, sp, 1)
            os_[j] = ld_f32_cg(o_part, b, h, sp, e)
        for j in range(mu):
            if s0 + j <= last:
                m_new = max(mx, ms[j])
                c = math.exp(mx - m_new)
                f = math.exp(ms[j] - m_new)
                tot = tot * c + ls[j] * f
                val = val * c + os_[j] * f
                mx = m_new
    return val / tot


def decode_chunk(head_dim: int) -> int:
    """Positions per warp whose K / V the split kernel loads together: 16 floats of K each.
    A split's whole share of a warp (8 positions at splits of 32, 32 floats) measured slower
    on the H200 (8B, one row: merged split 15.35 vs 14.59 us a layer by attn_tune, 3.588 vs
    3.413 ms a step): its loops stay rolled and the K / V arrays go to local memory."""
    return max(1, 16 // (head_dim // 32))


def make_attn_decode(head_dim: int, group: int, split_len: int, threads: int = DECODE_THREADS, ch: int = 0):
    """`ch`: positions per warp loaded together (0: `decode_chunk`)."""
    epl = head_dim // 32
    nw = threads // 32
    ge = group * epl  # register array sizes must be compile-time constants
    ch = ch or decode_chunk(head_dim)
    num_chunks = -(-split_len // (nw * ch))
    che = ch * epl

    @aware
    def attn_decode(q, k_cache, v_cache, tables, seq_lens, o_part, ml_part, scale):
        grid_dep_launch()
        grid_dep_wait()
        b = cuda.blockIdx.x
        kvh = cuda.blockIdx.y
        sp = cuda.blockIdx.z
        n = seq_lens[b]
        start = sp * split_len
        if start >= n:
            return
        end = min(start + split_len, n)
        lane = cuda.threadIdx.x % 32
        warp = cuda.threadIdx.x // 32
        page_size = k_cache.shape[1]
        qr = cuda.local.array(ge, float32)
        acc = cuda.local.array(ge, float32)
        m = cuda.local.array(group, float32)
        lsum = cuda.local.array(group, float32)
        kc = cuda.local.array(che, float32)
        vc = cuda.local.array(che, float32)
        sc = cuda.local.array(ch, float32)
        for g in range(group):
            h = kvh * group + g
            for e in range(epl):
                d = lane + 32 * e
                qr[g * epl + e] = q[b, h * head_dim + d] * scale
                acc[g * epl + e] = float32(0.0)
            m[g] = float32(NEG_BIG)
            lsum[g] = float32(0.0)
        for c in range(num_chunks):
            first = start + c * ch * nw
            if first >= end:  # the same for the whole block
                break
            # every page index, then every K / V element of the chunk's positions, before any
            # arithmetic: one round trip per chunk instead of one per position
            for j in range(ch):
                p = first + j * nw + warp
                valid = p < end
                page = tables[b, p // page_size] if valid else 0
                slot = p % page_size
                for e in range(epl):
                    kc[j * epl + e] = float32(k_cache[page, slot, kvh, lane + 32 * e]) if valid else float32(0.0)
                    vc[j * epl + e] = float32(v_cache[page, slot, kvh, lane + 32 * e]) if valid else float32(0.0)
            for g in range(group):
                m_new = m[g]
                for j in range(ch):
                    part = float32(0.0)
                    for e in range(epl):
                        part += qr[g * epl + e] * kc[j * epl + e]
                    s = warp_sum(part)
                    s = s if first + j * nw + warp < end else float32(NEG_BIG)
                    sc[j] = s
                    m_new = max(m_new, s)
                corr = math.exp(m[g] - m_new)
                lsum[g] *= corr
                for e in range(epl):
                    acc[g * epl + e] *= corr
                for j in range(ch):
                    pe = math.exp(sc[j] - m_new) if first + j * nw + warp < end else float32(0.0)
                    lsum[g] += pe
                    for e in range(epl):
                        acc[g * epl + e] += pe * vc[j * epl + e]
                m[g] = m_new
        # merge the warps' partial softmaxes through shared memory
        sm = cuda.shared.array((nw, group), float32)
        sl = cuda.shared.array((nw, group), float32)
        sa = cuda.shared.array((nw, group, head_dim), float32)
        for g in range(group):
            if lane == 0:
                sm[warp, g] = m[g]
                sl[warp, g] = lsum[g]
            for e in range(epl):
                sa[warp, g, lane + 32 * e] = acc[g * epl + e]
        cuda.syncthreads()
        for idx in range(cuda.threadIdx.x, group * head_dim, threads):
            g = idx // head_dim
            e = idx % head_dim
            mx, tot, val = merge_warps(sm, sl, sa, nw, g, e)
            h = kvh * group + g
            o_part[b, h, sp, e] = val
            if e == 0:
                ml_part[b, h, sp, 0] = mx
                ml_part[b, h, sp, 1] = tot

    return attn_decode


def make_attn_combine(head_dim: int, split_len: int, mode: str):
    @aware
    def attn_combine(o_part, ml_part, seq_lens, out, xs):
        grid_dep_launch()
        b = cuda.blockIdx.x
        h = cuda.blockIdx.y
        e = cuda.threadIdx.x
        n = seq_lens[b]  # a step input (no kernel writes it): read before the PDL wait
        grid_dep_wait()
        ns = (n + split_len - 1) // split_len
        v = _merge(o_part, ml_part, b, h, e, ns)
        col = h * head_dim + e
        if mode == "f32":
            out[b, col] = v
        else:
            store_q8(v, True, out, xs, b, col // 32, e % 32)

    return attn_combine


@compiled
def attn_decode_kernel(head_dim, group, split_len, ch=0):
    return cuda.jit(make_attn_decode(head_dim, group, split_len, ch=ch))


@compiled
def attn_combine_kernel(head_dim, split_len, mode):
    return cuda.jit(make_attn_combine(head_dim, split_len, mode))


def attn_decode(spec, q, k_cache, v_cache, tables, seq_lens, o_part, ml_part, out, xs, num_rows, split_len, mode,
                stream=0, num_splits: int | None = None, ch: int = 0) -> None:  # fmt: skip
    """Both decode launches; o_part / ml_part are [B, H, max_splits, hd | 2] scratch.

    `num_splits` (default all) blocks per (row, kv head) are launched: it must cover the
    longest row, ceil(max(seq_lens) / split_len); fewer empty blocks for short contexts.
    `ch`: see make_attn_decode.
    """
    max_splits = min(num_splits or o_part.shape[2], o_part.shape[2])
    scale = np.float32(1.0 / math.sqrt(spec.head_dim))
    kernel = attn_decode_kernel(spec.head_dim, spec.group_size, split_len, ch)
    kernel[(num_rows, spec.num_kv_heads, max_splits), DECODE_THREADS, stream](
        q, k_cache, v_cache, tables, seq_lens, o_part, ml_part, scale
    )
    attn_combine_kernel(spec.head_dim, split_len, mode)[(num_rows, spec.num_heads), spec.head_dim, stream](
        o_part, ml_part, seq_lens, out, xs
    )


# -- decode in one launch ----------------------------------------------------------------------

# One block per (row, KV head) walks the whole context and writes the final output: no split
# scratch and no combine launch. Lanes are split into groups of L = head_dim / 8: a group holds
# one position, each lane 8 consecutive elements of it (one 16-byte load of float16 K and of
# V), so a score takes log2(L) shuffles and a warp scores 32 / L positions at once. Every lane
# group keeps its own online softmax; they merge by shuffles within the warp at the end, then
# across warps through shared memory. Page ids of the next chunk are loaded before the current
# chunk's arithmetic, so a chunk waits for one round trip (K / V), not two (table, then K / V).
ONE_VEC = 8  # head_dim elements per lane
ONE_WARPS = 8
ONE_CHUNK = 4  # positions per lane group whose K / V are loaded together
# When one launch is taken, from attn_tune on the H200 (2026-12-03, docs/performance.md): it
# wins where the split path's grid is small AND the context is short (a block walks at most
# 2 chunks: 1-4 rows at context 256 of SmolLM2, 9.7 vs 10.9 us), or where rows x KV heads
# blocks fill a good part of the GPU (16 rows: SmolLM2 12.4 vs 14.9 us, 8B 23 vs 34 us at
# context 256, 75 vs 124 us at 1,024); it loses for 1-4 rows of long contexts (8B, one row,
# context 1,024: 72 vs 21 us). A chunk is ONE_WARPS * (32 / (head_dim / 8)) * ONE_CHUNK
# positions: 128 at head_dim 64, 64 at 128. More than 16 rows keep split + combine (unmeasured).
ONE_MAX_ROWS = 16
ONE_SHORT_CHUNKS = 2
ONE_FULL_BLOCKS = 48  # rows x KV heads
ONE_MAX_CHUNKS = 16


def one_launch_supported(head_dim: int) -> bool:
    lanes = head_dim // ONE_VEC
    return head_dim % ONE_VEC == 0 and 1 <= lanes <= 32 and lanes & (lanes - 1) == 0


def one_launch_chunk(head_dim: int, warps: int = ONE_WARPS, ch: int = ONE_CHUNK) -> int:
    """Positions one block of `attn_decode_one` covers per chunk."""
    return warps * (32 // (head_dim // ONE_VEC)) * ch


def use_one_launch(head_dim: int, num_kv_heads: int, num_rows: int, context: int) -> bool:
    """Whether a decode step of `num_rows` rows (the graph bucket) whose rows are at most
    `context` long (the bucket's splits x split_len) takes `attn_decode_one`: a function of
    the graph key only, so a captured graph always holds the same kernels."""
    if not one_launch_supported(head_dim) or num_rows > ONE_MAX_ROWS:
        return False
    chunks = -(-context // one_launch_chunk(head_dim))
    return chunks <= ONE_SHORT_CHUNKS or (num_rows * num_kv_heads >= ONE_FULL_BLOCKS and chunks <= ONE_MAX_CHUNKS)


def make_attn_decode_one(head_dim: int, group: int, mode: str, warps: int = ONE_WARPS, ch: int = ONE_CHUNK):
    if not one_launch_supported(head_dim):
        raise ValueError(f"the one-launch decode attention needs head_dim / 8 a power of two <= 32, got {head_dim}")
    vec = ONE_VEC
    lanes = head_dim // vec  # lanes per position
    per_warp = 32 // lanes  # positions a warp scores at once
    nw = warps
    gv = group * vec
    cv = ch * vec
    gc = group * ch
    step = nw * per_warp * ch  # positions per chunk of the whole block
    nblk = group * head_dim // 32  # 32-column output blocks of the KV head's query heads
    out_iters = -(-nblk // nw)
    # K / V loads are coherent (ld8_pinned): the pool's new position is written by the kernel
    # before, which may still run when this one starts (pdl.py); `.nc`
    # is only for data that stays read-only during the kernel's whole lifetime

    @aware
    def attn_decode_one(q, k_cache, v_cache, tables, seq_lens, out, xs, scale):
        grid_dep_launch()
        b = cuda.blockIdx.x
        kvh = cuda.blockIdx.y
        lane = cuda.threadIdx.x % 32
        warp = cuda.threadIdx.x // 32
        slot = lane // lanes
        d0 = (lane % lanes) * vec
        page_size = k_cache.shape[1]
        last_t = tables.shape[1] - 1
        base = warp * per_warp + slot  # this lane group's position in a chunk, first round
        qr = cuda.local.array(gv, float32)
        acc = cuda.local.array(gv, float32)
        m = cuda.local.array(group, float32)
        lsum = cuda.local.array(group, float32)
        kc = cuda.local.array(cv, float32)
        vc = cuda.local.array(cv, float32)
        sc = cuda.local.array(gc, float32)
        pg = cuda.local.array(ch, types.int32)
        # the first chunk's page ids do not wait for seq_lens (clamped to the table, masked later)
        for j in range(ch):
            pg[j] = tables[b, min((j * nw * per_warp + base) // page_size, last_t)]
        grid_dep_wait()  # the page ids are step inputs; q and the pools' newest position are not
        for g in range(group):
            h = kvh * group + g
            for i in range(vec):
                qr[g * vec + i] = q[b, h * head_dim + d0 + i] * scale
                acc[g * vec + i] = float32(0.0)
            m[g] = float32(NEG_BIG)
            lsum[g] = float32(0.0)
        n = seq_lens[b]
        for c in range(max(1, (n + step - 1) // step)):  # the same for the whole block
            first = c * step + base
            for j in range(ch):
                p = first + j * nw * per_warp
                ok = p < n
                page = pg[j] if ok else 0
                k0, k1, k2, k3, k4, k5, k6, k7 = ld8_pinned(k_cache, page, p % page_size, kvh, d0)
                v0, v1, v2, v3, v4, v5, v6, v7 = ld8_pinned(v_cache, page, p % page_size, kvh, d0)
                kc[j * vec + 0], kc[j * vec + 1], kc[j * vec + 2], kc[j * vec + 3] = k0, k1, k2, k3
                kc[j * vec + 4], kc[j * vec + 5], kc[j * vec + 6], kc[j * vec + 7] = k4, k5, k6, k7
                zero = float32(0.0)
                vc[j * vec + 0] = v0 if ok else zero
                vc[j * vec + 1] = v1 if ok else zero
                vc[j * vec + 2] = v2 if ok else zero
                vc[j * vec + 3] = v3 if ok else zero
                vc[j * vec + 4] = v4 if ok else zero
                vc[j * vec + 5] = v5 if ok else zero
                vc[j * vec + 6] = v6 if ok else zero
                vc[j * vec + 7] = v7 if ok else zero
            for j in range(ch):  # the next chunk's page ids, in flight during this chunk's arithmetic
                pg[j] = tables[b, min((first + step + j * nw * per_warp) // page_size, last_t)]
            for g in range(group):  # every score of the chunk first: independent shuffle chains
                for j in range(ch):
                    part = float32(0.0)
                    for i in range(vec):
                        part += qr[g * vec + i] * kc[j * vec + i]
                    s = group_sum(part, lanes)
                    sc[g * ch + j] = s if first + j * nw * per_warp < n else float32(NEG_BIG)
            for g in range(group):
                m_new = m[g]
                for j in range(ch):
                    m_new = max(m_new, sc[g * ch + j])
                corr = math.exp(m[g] - m_new)
                lsum[g] *= corr
                for i in range(vec):
                    acc[g * vec + i] *= corr
                for j in range(ch):
                    pe = math.exp(sc[g * ch + j] - m_new) if first + j * nw * per_warp < n else float32(0.0)
                    lsum[g] += pe
                    for i in range(vec):
                        acc[g * vec + i] += pe * vc[j * vec + i]
                m[g] = m_new
        # merge the lane groups of the warp (butterfly over lanes L, 2L, ... apart)
        off = lanes
        while off < 32:
            for g in range(group):
                mo = shfl_xor(m[g], off)
                lo = shfl_xor(lsum[g], off)
                mn = max(m[g], mo)
                ca = math.exp(m[g] - mn)
                cb = math.exp(mo - mn)
                lsum[g] = lsum[g] * ca + lo * cb
                for i in range(vec):
                    ao = shfl_xor(acc[g * vec + i], off)
                    acc[g * vec + i] = acc[g * vec + i] * ca + ao * cb
                m[g] = mn
            off *= 2
        # then the warps, through shared memory
        sm = cuda.shared.array((nw, group), float32)
        sl = cuda.shared.array((nw, group), float32)
        sa = cuda.shared.array((nw, group, head_dim), float32)
        if slot == 0:
            for g in range(group):
                if lane == 0:
                    sm[warp, g] = m[g]
                    sl[warp, g] = lsum[g]
                for i in range(vec):
                    sa[warp, g, d0 + i] = acc[g * vec + i]
        cuda.syncthreads()
        for it in range(out_iters):  # warp w writes 32-column blocks w, w + nw, ...
            blk = it * nw + warp
            valid = blk < nblk
            idx = blk * 32 + lane if valid else lane
            g = idx // head_dim
            e = idx % head_dim
            mx, tot, val = merge_warps(sm, sl, sa, nw, g, e)
            v = val / tot
            col = kvh * group * head_dim + idx
            if mode == "f32":
                if valid:
                    out[b, col] = v
            else:
                store_q8(v, valid, out, xs, b, col // 32, lane)

    return attn_decode_one


@compiled
def attn_decode_one_kernel(head_dim, group, mode, warps, ch):
    fn = make_attn_decode_one(head_dim, group, mode, warps, ch)
    # launch bounds: 16 warps must fit 128 registers a thread (8 warps fit without a cap)
    return cuda.jit(fn) if SIMULATOR else cuda.jit(launch_bounds=32 * warps)(fn)


def attn_decode_one(spec, q, k_cache, v_cache, tables, seq_lens, out, xs, num_rows, mode, stream=0,
                    warps: int | None = None, ch: int | None = None) -> None:  # fmt: skip
    """Decode attention in one launch, grid (row, KV head): float32 `out` [B, q_dim], or int8
    blocks + scales (`xs`) for mode 'q8'. K / V caches must have 16-byte aligned rows."""
    warps, ch = warps or ONE_WARPS, ch or ONE_CHUNK
    scale = np.float32(1.0 / math.sqrt(spec.head_dim))
    attn_decode_one_kernel(spec.head_dim, spec.group_size, mode, warps, ch)[(num_rows, spec.num_kv_heads), 32 * warps,
                                                                            stream](
        q, k_cache, v_cache, tables, seq_lens, out, xs, scale
    )  # fmt: skip


def attention_ref(q, keys, values, positions, group, head_dim):
    """One row, float64: q [n, H*hd] at `positions`, keys / values [ctx, KV, hd] -> [n, H*hd]."""
    n = q.shape[0]
    heads = q.shape[1] // head_dim
    qh = q.reshape(n, heads, head_dim).astype(np.float64)
    out = np.empty_like(qh)
    for h in range(heads):
        k = keys[:, h // group].astype(np.float64)
        v = values[:, h // group].astype(np.float64)
        s = qh[:, h] @ k.T / math.sqrt(head_dim)
        s[np.arange(k.shape[0])[None, :] > np.asarray(positions)[:, None]] = -np.inf
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, h] = (p / p.sum(axis=1, keepdims=True)) @ v
    return out.reshape(n, heads * head_dim)


def ptx_cases():
    f2 = types.float32[:, ::1]
    f4 = types.float32[:, :, :, ::1]
    i1, i2 = types.int32[::1], types.int32[:, ::1]
    cases = []
    for kv_t in (types.float16, types.float32):
        cache = types.Array(kv_t, 4, "C")
        for hd, group in ((64, 3), (128, 2), (128, 4)):
            sig = (f2, cache, cache, i2, i1, f4, f4, types.float32)
            cases.append((f"attn_decode_hd{hd}_g{group}_{kv_t}", make_attn_decode(hd, group, 256), sig))
            cases.append((f"attn_decode_s32_hd{hd}_g{group}_{kv_t}", make_attn_decode(hd, group, 32), sig))
    for hd in (64, 128):
        for split in (32, 256):
            cases.append((f"attn_combine_f32_hd{hd}_s{split}", make_attn_combine(hd, split, "f32"), (f4, f4, i1, f2, f2)))
            cases.append((f"attn_combine_q8_hd{hd}_s{split}", make_attn_combine(hd, split, "q8"),
                          (f4, f4, i1, types.int8[:, ::1], f2)))  # fmt: skip
    for kv_t in (types.float16, types.float32):
        cache = types.Array(kv_t, 4, "C")
        for hd, group in ((64, 3), (128, 4), (128, 2)):
            for mode, out_t in (("f32", f2), ("q8", types.int8[:, ::1])):
                sig = (f2, cache, cache, i2, i1, out_t, f2, types.float32)
                name = f"attn_decode_one_{mode}_hd{hd}_g{group}_{kv_t}"
                cases.append((name, make_attn_decode_one(hd, group, mode), sig))
    return cases
