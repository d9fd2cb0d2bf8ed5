"""Paged causal attention with grouped-query heads: split-K decode and tiled prefill.

Decode (one new token per row): grid (row, kv head, split); a split covers `split_len`
positions, so long contexts spread over many blocks (flash-decoding). Each of the 4 warps
walks every 4th position of its split with lanes over head_dim, scoring all `group` query
heads that share the KV head and keeping an online softmax (max m, sum l, weighted values).
`attn_combine` merges the splits per (row, head) and writes float32 or int8 (the o-proj input).

Prefill (rows of many tokens, or any mixed batch): grid (query tile, head); a tile is up to 16
consecutive tokens of one row; keys stream through shared memory 32 positions at a time, from
position 0 to the tile's last query (earlier pages included), causal per query.

Scores are scaled by `scale` = 1 / sqrt(head_dim); K/V caches are [pages, page_size, kv_heads,
head_dim] of one layer (float16 or float32; arithmetic in float32).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, types

from ninfer.gpu.cuda.act_quant import store_q8
from ninfer.gpu.cuda.intrinsics import group_max, group_sum, warp_sum

DECODE_THREADS = 128
NEG_BIG = -1.0e30  # running-max seed: exp(NEG_BIG - finite) == 0 without inf - inf


def make_attn_decode(head_dim: int, group: int, split_len: int, threads: int = DECODE_THREADS):
    epl = head_dim // 32
    nw = threads // 32
    ge = group * epl  # register array sizes must be compile-time constants
    ch = max(1, 16 // epl)  # positions per warp whose K / V are loaded together (16 floats each)
    num_chunks = -(-split_len // (nw * ch))
    che = ch * epl

    def attn_decode(q, k_cache, v_cache, tables, seq_lens, o_part, ml_part, scale):
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
                qr[g * epl + e] = q[b, h * head_dim + lane + 32 * e] * scale
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
            mx = sm[0, g]
            for w in range(1, nw):
                mx = max(mx, sm[w, g])
            tot = float32(0.0)
            val = float32(0.0)
            for w in range(nw):
                f = math.exp(sm[w, g] - mx)
                tot += sl[w, g] * f
                val += sa[w, g, e] * f
            h = kvh * group + g
            o_part[b, h, sp, e] = val
            if e == 0:
                ml_part[b, h, sp, 0] = mx
                ml_part[b, h, sp, 1] = tot

    return attn_decode


def make_attn_combine(head_dim: int, split_len: int, mode: str):
    def attn_combine(o_part, ml_part, seq_lens, out, xs):
        b = cuda.blockIdx.x
        h = cuda.blockIdx.y
        e = cuda.threadIdx.x
        ns = (seq_lens[b] + split_len - 1) // split_len
        mx = ml_part[b, h, 0, 0]
        for s in range(1, ns):
            mx = max(mx, ml_part[b, h, s, 0])
        tot = float32(0.0)
        val = float32(0.0)
        for s in range(ns):
            f = math.exp(ml_part[b, h, s, 0] - mx)
            tot += ml_part[b, h, s, 1] * f
            val += o_part[b, h, s, e] * f
        v = val / tot
        col = h * head_dim + e
        if mode == "f32":
            out[b, col] = v
        else:
            store_q8(v, True, out, xs, b, col // 32, e % 32)

    return attn_combine


@functools.cache
def attn_decode_kernel(head_dim, group, split_len):
    return cuda.jit(make_attn_decode(head_dim, group, split_len))


@functools.cache
def attn_combine_kernel(head_dim, split_len, mode):
    return cuda.jit(make_attn_combine(head_dim, split_len, mode))


def attn_decode(spec, q, k_cache, v_cache, tables, seq_lens, o_part, ml_part, out, xs, num_rows, split_len, mode,
                stream=0, num_splits: int | None = None) -> None:  # fmt: skip
    """Both decode launches; o_part / ml_part are [B, H, max_splits, hd | 2] scratch.

    `num_splits` (default all) blocks per (row, kv head) are launched: it must cover the
    longest row, ceil(max(seq_lens) / split_len); fewer empty blocks for short contexts.
    """
    max_splits = min(num_splits or o_part.shape[2], o_part.shape[2])
    scale = np.float32(1.0 / math.sqrt(spec.head_dim))
    attn_decode_kernel(spec.head_dim, spec.group_size, split_len)[
        (num_rows, spec.num_kv_heads, max_splits), DECODE_THREADS, stream
    ](q, k_cache, v_cache, tables, seq_lens, o_part, ml_part, scale)
    attn_combine_kernel(spec.head_dim, split_len, mode)[(num_rows, spec.num_heads), spec.head_dim, stream](
        o_part, ml_part, seq_lens, out, xs
    )


# -- prefill -----------------------------------------------------------------------------------

TQ = 16  # queries per tile
TK = 32  # keys per shared-memory step
PREFILL_THREADS = 128  # 16 queries x 8 threads


def make_attn_prefill(head_dim: int):
    per = head_dim // 8  # output elements per thread
    kc_per = TK // 8  # keys scored per thread per step
    hd1 = head_dim + 1  # padded rows: the 4 query rows of a warp hit different banks
    tk1 = TK + 1

    def attn_prefill(q, k_cache, v_cache, tables, tile_row, tile_tok0, tile_ntok, row_tok0, row_start, out,
                     scale, group):  # fmt: skip
        tile = cuda.blockIdx.x
        h = cuda.blockIdx.y
        kvh = h // group
        tid = cuda.threadIdx.x
        r = tile_row[tile]
        t0 = tile_tok0[tile]
        nt = tile_ntok[tile]
        page_size = k_cache.shape[1]
        qs = cuda.shared.array((TQ, hd1), float32)
        ks = cuda.shared.array((TK, hd1), float32)
        vs = cuda.shared.array((TK, head_dim), float32)
        ps = cuda.shared.array((TQ, tk1), float32)
        for idx in range(tid, TQ * head_dim, PREFILL_THREADS):
            i = idx // head_dim
            d = idx % head_dim
            qs[i, d] = q[t0 + i, h * head_dim + d] * scale if i < nt else float32(0.0)
        qi = tid // 8
        sub = tid % 8
        first_pos = row_start[r] + (t0 - row_tok0[r])
        my_pos = first_pos + qi if qi < nt else -1
        last_pos = first_pos + nt - 1
        m = float32(NEG_BIG)
        lsum = float32(0.0)
        acc = cuda.local.array(per, float32)
        sc = cuda.local.array(kc_per, float32)
        for k in range(per):
            acc[k] = float32(0.0)
        for kt in range(last_pos // TK + 1):
            k0 = kt * TK
            cuda.syncthreads()  # the previous step is done with ks / vs / ps
            for idx in range(tid, TK * head_dim, PREFILL_THREADS):
                j = idx // head_dim
                d = idx % head_dim
                p = k0 + j
                if p <= last_pos:
                    page = tables[r, p // page_size]
                    ks[j, d] = float32(k_cache[page, p % page_size, kvh, d])
                    vs[j, d] = float32(v_cache[page, p % page_size, kvh, d])
                else:
                    ks[j, d] = float32(0.0)
                    vs[j, d] = float32(0.0)
            cuda.syncthreads()
            tmax = float32(-math.inf)
            for c in range(kc_per):
                j = sub + 8 * c
                s = float32(0.0)
                for d in range(head_dim):
                    s += qs[qi, d] * ks[j, d]
                if k0 + j > my_pos:
                    s = float32(-math.inf)
                sc[c] = s
                tmax = max(tmax, s)
            tmax = group_max(tmax, 8)
            m_new = max(m, tmax)
            corr = math.exp(m - m_new)
            psum = float32(0.0)
            for c in range(kc_per):
                pe = math.exp(sc[c] - m_new)
                ps[qi, sub + 8 * c] = pe
                psum += pe
            psum = group_sum(psum, 8)
            lsum = lsum * corr + psum
            m = m_new
            for k in range(per):
                acc[k] *= corr
            cuda.syncthreads()
            for j in range(TK):
                pj = ps[qi, j]
                for k in range(per):
                    acc[k] += pj * vs[j, sub + 8 * k]
        if qi < nt:
            for k in range(per):
                out[t0 + qi, h * head_dim + sub + 8 * k] = acc[k] / lsum

    return attn_prefill


@functools.cache
def attn_prefill_kernel(head_dim):
    if head_dim > 128:
        raise ValueError(f"the prefill attention kernel supports head_dim up to 128, got {head_dim}")
    return cuda.jit(make_attn_prefill(head_dim))


def attn_prefill(spec, q, k_cache, v_cache, tables, tiles, out, num_tiles, stream=0) -> None:
    """tiles = (tile_row, tile_tok0, tile_ntok, row_tok0, row_start) device int32 arrays."""
    scale = np.float32(1.0 / math.sqrt(spec.head_dim))
    attn_prefill_kernel(spec.head_dim)[(num_tiles, spec.num_heads), PREFILL_THREADS, stream](
        q, k_cache, v_cache, tables, *tiles, out, scale, spec.group_size
    )


def plan_tiles(row_lengths, row_starts_pos):
    """Host planning: the (tile_row, tile_tok0, tile_ntok, row_tok0, row_start) arrays."""
    tile_row, tile_tok0, tile_ntok = [], [], []
    row_tok0 = np.concatenate([[0], np.cumsum(row_lengths)[:-1]]).astype(np.int32)
    for r, n in enumerate(row_lengths):
        for i in range(0, n, TQ):
            tile_row.append(r)
            tile_tok0.append(row_tok0[r] + i)
            tile_ntok.append(min(TQ, n - i))
    as32 = lambda a: np.asarray(a, np.int32)  # noqa: E731
    return as32(tile_row), as32(tile_tok0), as32(tile_ntok), row_tok0, as32(row_starts_pos)


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
            psig = (f2, cache, cache, i2, i1, i1, i1, i1, i1, f2, types.float32, types.int32)
            if group != 4:
                cases.append((f"attn_prefill_hd{hd}_{kv_t}", make_attn_prefill(hd), psig))
    for hd in (64, 128):
        cases.append((f"attn_combine_f32_hd{hd}", make_attn_combine(hd, 256, "f32"), (f4, f4, i1, f2, f2)))
        cases.append((f"attn_combine_q8_hd{hd}", make_attn_combine(hd, 256, "q8"), (f4, f4, i1, types.int8[:, ::1], f2)))
    return cases
