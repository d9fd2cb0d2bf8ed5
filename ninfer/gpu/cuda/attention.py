"""Paged causal attention with grouped-query heads: split-K decode and tiled prefill.

Decode (one new token per row): grid (row, kv head, split); a split covers `split_len`
positions, so long contexts spread over many blocks (flash-decoding). Each of the 4 warps
walks every 4th position of its split with lanes over head_dim, scoring all `group` query
heads that share the KV head and keeping an online softmax (max m, sum l, weighted values).
`attn_combine` merges the splits per (row, head) and writes float32 or int8 (the o-proj input).
For few rows and short contexts (`use_one_launch`, by the graph bucket) `attn_decode_one`
does it all in one launch: one block of 8 warps per (row, KV head) walks the whole context.
`attn_decode_lp` scores a split of 32 positions one a lane (then attn_combine), and
`attn_decode_lpm` (off: LP_MERGED) runs up to 8 such splits as the warps of one block per
(row, KV head), merged in shared memory.
Both decode kernels can also do the step's rope.qkv_post (`post=`): each block rotates its
group's q from the raw QKV into shared memory and writes the new token's K / V (one block per
position) before a barrier and its attention loop; one kernel fewer per layer.

Prefill (rows of many tokens, or any mixed batch): a tile is up to TQ = 64 consecutive tokens
of one row. float16 pools take the tensor-core kernel of flash.py; this module's SIMT kernel
(exact, for float32 pools) runs grid (query tile x 4, head), each block 16 of a tile's
queries; keys stream through shared memory 32 positions at a time, from position 0 to the
block's last query (earlier pages included), causal per query.

Scores are scaled by `scale` = 1 / sqrt(head_dim); K/V caches are [pages, page_size, kv_heads,
head_dim] of one layer (float16 or float32; arithmetic in float32).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32, types, uint32

from ninfer.gpu.cuda.act_quant import store_q8
from ninfer.gpu.cuda.intrinsics import (
    SIMULATOR, device, grid_dep_launch, grid_dep_wait, group_max, group_sum, ld4_f32_pinned, ld8, ld8_cg, ld8_h_words,
    ld8_pinned, ld_f32_cg, shfl_xor, st8_f32, unpack_h2, warp_max, warp_sum,
)
from ninfer.gpu.cuda.pdl import aware
from ninfer.gpu.cuda.rope import DecodePost, decode_post_fn, post_arg_types

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


def _make_block_merge(group: int, head_dim: int, threads: int, mode: str):
    """Device function for the merging block of `attn_decode(counters=)`: the group's heads of
    row b merged over their `ns` splits and written to out / xs. Each thread owns `oi` of the
    group * head_dim outputs; the partials of MERGE_UNROLL splits for all of them are loaded
    (from L2: other blocks of the kernel wrote them) before any is used, so up to 8 splits
    cost one round trip, not one per output or per split (the splits' maxima and sums go
    through shared memory: they are the same for every output of a head)."""
    oi = -(-group * head_dim // threads)
    mu = MERGE_UNROLL
    n = oi * mu
    gdim = group * head_dim

    @device
    def block_merge(o_part, ml_part, out, xs, b, kvh, ns):
        tid = cuda.threadIdx.x
        os_ = cuda.local.array(n, float32)
        mls = cuda.shared.array((group, mu, 2), float32)  # (max, sum) of a round's splits per head
        mx = cuda.local.array(oi, float32)
        tot = cuda.local.array(oi, float32)
        val = cuda.local.array(oi, float32)
        for it in range(oi):
            mx[it] = float32(NEG_BIG)
            tot[it] = float32(0.0)
            val[it] = float32(0.0)
        last = ns - 1
        for s0 in range(0, ns, mu):
            for it in range(oi):
                idx = tid + it * threads
                h = kvh * group + min(idx // head_dim, group - 1)
                for j in range(mu):
                    os_[it * mu + j] = ld_f32_cg(o_part, b, h, min(s0 + j, last), idx % head_dim)
            for t in range(tid, group * mu * 2, threads):
                g = t // (2 * mu)
                j = (t // 2) % mu
                mls[g, j, t % 2] = ld_f32_cg(ml_part, b, kvh * group + g, min(s0 + j, last), t % 2)
            cuda.syncthreads()
            for it in range(oi):
                g = min((tid + it * threads) // head_dim, group - 1)
                for j in range(mu):
                    if s0 + j <= last:
                        m_new = max(mx[it], mls[g, j, 0])
                        c = math.exp(mx[it] - m_new)
                        f = math.exp(mls[g, j, 0] - m_new)
                        tot[it] = tot[it] * c + mls[g, j, 1] * f
                        val[it] = val[it] * c + os_[it * mu + j] * f
                        mx[it] = m_new
            cuda.syncthreads()  # mls is rewritten by the next round
        for it in range(oi):  # the same count for every thread (store_q8's reductions)
            idx = tid + it * threads
            col = kvh * gdim + idx
            v = val[it] / tot[it]
            if mode == "f32":
                if idx < gdim:
                    out[b, col] = v
            else:  # head_dim % 32 == 0: a warp's 32 columns are one int8 block of one head
                store_q8(v, idx < gdim, out, xs, b, col // 32, idx % 32)

    return block_merge


def decode_chunk(head_dim: int) -> int:
    """Positions per warp whose K / V the split kernel loads together: 16 floats of K each.
    A split's whole share of a warp (8 positions at splits of 32, 32 floats) measured slower
    on the H200 (8B, one row: merged split 15.35 vs 14.59 us a layer by attn_tune, 3.588 vs
    3.413 ms a step): its loops stay rolled and the K / V arrays go to local memory."""
    return max(1, 16 // (head_dim // 32))


def make_attn_decode(head_dim: int, group: int, split_len: int, threads: int = DECODE_THREADS, post: bool = False,
                     interleaved: bool = False, merge: str | None = None, ch: int = 0):  # fmt: skip
    """`post`: the kernel also does rope.qkv_post for its row's token (see `attn_decode`).
    `merge` ('f32' | 'q8'): the last split of each (row, KV head) to finish merges all of them
    and writes the output (no attn_combine launch); see `attn_decode`. `ch`: positions per
    warp loaded together (0: `decode_chunk`)."""
    epl = head_dim // 32
    nw = threads // 32
    ge = group * epl  # register array sizes must be compile-time constants
    ch = ch or decode_chunk(head_dim)
    num_chunks = -(-split_len // (nw * ch))
    che = ch * epl
    gd = group * head_dim  # the rotated q of the group (post)
    post_heads = decode_post_fn(head_dim, group, nw, interleaved) if post else None

    merging = merge is not None
    block_merge = _make_block_merge(group, head_dim, threads, merge) if merging else None

    @aware
    def attn_decode(q, k_cache, v_cache, tables, seq_lens, o_part, ml_part, scale, post_args, merge_args):
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
        if post:  # q is the raw QKV: every split rotates the group's q itself
            qs = cuda.shared.array(gd, float32)
            # only the split holding the new position n - 1 writes its K / V (no other reads it)
            post_heads(q, post_args, b, kvh, sp == (n - 1) // split_len, qs, k_cache, v_cache)
            cuda.syncthreads()  # qs and the block's pool writes visible to the whole block
        for g in range(group):
            h = kvh * group + g
            for e in range(epl):
                d = lane + 32 * e
                qr[g * epl + e] = (qs[g * head_dim + d] if post else q[b, h * head_dim + d]) * scale
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
        if merging:
            out, xs, counters = merge_args
            flag = cuda.shared.array(1, int32)
            cuda.syncthreads()  # every thread's partials stored
            ns = (n + split_len - 1) // split_len
            if cuda.threadIdx.x == 0:
                cuda.threadfence()  # cumulative over the barrier: the block's partials before its count
                flag[0] = int32(1) if cuda.atomic.add(counters, (b, kvh), 1) == ns - 1 else int32(0)
            cuda.syncthreads()
            if flag[0] == 1:  # block-uniform: every other split of (b, kvh) has stored its partials
                cuda.threadfence()
                block_merge(o_part, ml_part, out, xs, b, kvh, ns)
                if cuda.threadIdx.x == 0:
                    counters[b, kvh] = 0

    return attn_decode


def _decode_inputs(q, post):
    """The decode kernels' first argument (q, or with `post` the raw QKV) and their last one, the
    `post_args` tuple (empty without `post`; numba flattens a tuple argument at launch)."""
    return (q, ()) if post is None else (post.qkv, post.kernel_args())


def _interleaved(post) -> bool:
    return post is not None and post.interleaved


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


@functools.cache
def attn_decode_kernel(head_dim, group, split_len, post=False, interleaved=False, merge=None, ch=0):
    return cuda.jit(make_attn_decode(head_dim, group, split_len, post=post, interleaved=interleaved, merge=merge, ch=ch))


@functools.cache
def attn_combine_kernel(head_dim, split_len, mode):
    return cuda.jit(make_attn_combine(head_dim, split_len, mode))


def attn_decode(spec, q, k_cache, v_cache, tables, seq_lens, o_part, ml_part, out, xs, num_rows, split_len, mode,
                stream=0, num_splits: int | None = None, post: DecodePost | None = None, counters=None,
                ch: int = 0) -> None:  # fmt: skip
    """Both decode launches; o_part / ml_part are [B, H, max_splits, hd | 2] scratch.

    `num_splits` (default all) blocks per (row, kv head) are launched: it must cover the
    longest row, ceil(max(seq_lens) / split_len); fewer empty blocks for short contexts.
    With `post`, the step's rope.qkv_post is done here (q is not read, may be None): each
    block post-processes row b's token b, writes its K / V at the row's last position (seq_len
    - 1 = tok_pos[b], at tok_page[b], tok_slot[b]) and attends over it.
    With `counters` (int32 [>= num_rows, kv heads], zero; left zero) there is no combine
    launch: the last split of each (row, KV head) to finish (an atomic count; every split
    fences its partials first) merges them and writes out / xs. `ch`: see make_attn_decode.
    """
    max_splits = min(num_splits or o_part.shape[2], o_part.shape[2])
    scale = np.float32(1.0 / math.sqrt(spec.head_dim))
    src, extra = _decode_inputs(q, post)
    merge = None if counters is None else mode
    kernel = attn_decode_kernel(spec.head_dim, spec.group_size, split_len, post is not None, _interleaved(post), merge, ch)
    kernel[(num_rows, spec.num_kv_heads, max_splits), DECODE_THREADS, stream](
        src, k_cache, v_cache, tables, seq_lens, o_part, ml_part, scale, extra, () if merge is None else (out, xs, counters)
    )  # fmt: skip
    if merge is None:
        attn_combine_kernel(spec.head_dim, split_len, mode)[(num_rows, spec.num_heads), spec.head_dim, stream](
            o_part, ml_part, seq_lens, out, xs
        )


# -- decode, lanes over positions: a split of 32 positions, one a lane ---------------------------

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
LP_OVER_ONE = False  # A/B and checks: take it wherever it is supported, one launch included
# K / V loads before the PDL wait (make_attn_decode_lp `preload`). 8B Q8_0 one stream, H100,
# graph ms (13th session): neutral alone while the GEMVs' weights swept the KV out of L2 (3.296
# vs 3.301), but with those weights loaded evict-first (qdot.EVICT_FIRST) 3.161 / 3.156 vs
# 3.262 / 3.286: the early loads then hit L2.
LP_PRELOAD = True
# the pools' page size compiled into attn_decode_lp (False: read at run time). The run-time
# divisor made every position // page_size and % page_size a call to the 64-bit division
# routines (12 KB of the kernel's 58 KB of code); 8B Q8_0 one stream, H100 (13th session):
# 3.326 / 3.324 vs 3.429 / 3.450 ms a step.
LP_CONST_PAGE = True


def use_lp(head_dim: int, split_len: int, num_rows: int, context: int, one_launch: bool) -> bool:
    """Whether a decode bucket (`num_rows` rows of at most `context` positions) takes
    `attn_decode_lp`, given use_one_launch's answer `one_launch`: a function of the graph key."""
    if not lp_supported(head_dim, split_len) or num_rows > LP_MAX_ROWS:
        return False
    if LP_OVER_ONE:
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


@functools.cache
def attn_decode_lp_kernel(head_dim, group, preload=False, page_size=16, cols=None):
    return cuda.jit(make_attn_decode_lp(head_dim, group, preload, page_size, cols))


def attn_decode_lp(spec, q, k_cache, v_cache, tables, seq_lens, o_part, ml_part, out, xs, num_rows, mode, stream=0,
                   num_splits: int | None = None) -> None:  # fmt: skip
    """Decode attention over splits of LP_SPLIT positions, one warp each, then attn_combine:
    the same inputs and outputs as `attn_decode` at split_len 32 (o_part / ml_part [B, H,
    max_splits, hd | 2] scratch; `num_splits` must cover the longest row)."""
    max_splits = min(num_splits or o_part.shape[2], o_part.shape[2])
    scale = np.float32(1.0 / math.sqrt(spec.head_dim))
    kernel = attn_decode_lp_kernel(spec.head_dim, spec.group_size, LP_PRELOAD,
                                  k_cache.shape[1] if LP_CONST_PAGE else 0, LP_COLS)
    kernel[(num_rows, spec.num_kv_heads, max_splits), 32 * lp_warps(spec.head_dim, LP_COLS), stream](
        q, k_cache, v_cache, tables, seq_lens, o_part, ml_part, scale
    )
    attn_combine_kernel(spec.head_dim, LP_SPLIT, mode)[(num_rows, spec.num_heads), spec.head_dim, stream](
        o_part, ml_part, seq_lens, out, xs
    )


# -- decode, lanes over positions, merged in the block ------------------------------------------
#
# attn_decode_lp's splits of 32 positions (lane i scores position i), but all of a row's
# splits in one block per (row, KV head), one warp each, merged through shared memory: no
# split scratch and no combine launch, for contexts of at most LPM_MAX_SPLITS splits (the
# graph bucket's). One warp covers a split's whole head_dim, so a lane holds its position's
# K row and its share of V rows: 2 x head_dim values. As float32 that would not fit (256
# positions x 128 x 2 = the whole 64k-register file of an SM at head_dim 128); they stay as
# float16 pairs in uint32 registers (ld8_h_words) and are converted at use (unpack_h2).
# float16 pools only. Unmeasured (written without a GPU in the tenth session): off; A/B it by
# `profile --variant "lpm:attention.LP_MERGED=True"` where `--remove combine` shows the
# combine launch costing more than a few us a layer.
LP_MERGED = False
LPM_MAX_SPLITS = 8  # warps a block (256 threads): ptxas's registers x 256 must fit 64k


def use_lpm(head_dim: int, split_len: int, num_rows: int, context: int, kv_dtype) -> bool:
    """Whether a decode bucket takes attn_decode_lpm (LP_MERGED; a function of the graph key)."""
    return (LP_MERGED and split_len == LP_SPLIT and np.dtype(kv_dtype) == np.float16 and head_dim in (32, 64, 128)
            and num_rows <= LP_MAX_ROWS and context <= LPM_MAX_SPLITS * LP_SPLIT)  # fmt: skip


def make_attn_decode_lpm(head_dim: int, group: int, splits: int, mode: str):
    vec = ONE_VEC
    lpr = head_dim // vec  # lanes over one V row
    rpw = 32 // lpr  # V rows a warp loads at once
    npl = 32 // rpw  # V rows a lane accumulates
    kw = head_dim // 2  # K words of a lane's position
    vw = npl * vec // 2  # V words of a lane
    gd = group * head_dim
    gv = group * vec
    rows_sum = _make_rows_sum(gv, lpr)
    threads = 32 * splits
    oi = -(-gd // threads)  # outputs a thread writes

    @aware
    def attn_decode_lpm(q, k_cache, v_cache, tables, seq_lens, out, xs, scale):
        grid_dep_launch()
        b = cuda.blockIdx.x
        kvh = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        lane = tid % 32
        sp = tid // 32  # this warp's split
        page_size = k_cache.shape[1]
        last_t = tables.shape[1] - 1
        start = sp * LP_SPLIT
        r0 = lane // lpr  # the P V pass: this lane's first row and its 8 columns
        d0 = (lane % lpr) * vec
        page = tables[b, min((start + lane) // page_size, last_t)]  # step inputs: before the PDL wait
        vpg = cuda.local.array(npl, int32)
        for k in range(npl):
            vpg[k] = tables[b, min((start + r0 + k * rpw) // page_size, last_t)]
        n = seq_lens[b]
        grid_dep_wait()  # q and the newest position's K / V come from the kernels before
        zero = float32(0.0)
        p = start + lane
        valid = p < n
        vv = cuda.local.array(vw, uint32)
        kk = cuda.local.array(kw, uint32)
        for k in range(npl):  # V first: its latency overlaps the scores (zero words: 0.0 halves)
            pj = start + r0 + k * rpw
            ok = pj < n
            w0, w1, w2, w3 = ld8_h_words(v_cache, vpg[k] if ok else 0, pj % page_size, kvh, d0)
            vv[4 * k], vv[4 * k + 1] = (w0, w1) if ok else (uint32(0), uint32(0))
            vv[4 * k + 2], vv[4 * k + 3] = (w2, w3) if ok else (uint32(0), uint32(0))
        pg = page if valid else 0  # past the row: page 0, masked (entries past a row are stale)
        for c in range(lpr):
            kk[4 * c], kk[4 * c + 1], kk[4 * c + 2], kk[4 * c + 3] = ld8_h_words(k_cache, pg, p % page_size, kvh,
                                                                                 vec * c)  # fmt: skip
        qs = cuda.shared.array(gd, float32)
        ps = cuda.shared.array((splits, group, LP_SPLIT), float32)
        sm = cuda.shared.array((splits, group), float32)
        sl = cuda.shared.array((splits, group), float32)
        sa = cuda.shared.array((splits, group, head_dim), float32)
        for i in range(4 * tid, gd, 4 * threads):  # the group's q, scaled, in 16-byte loads
            a0, a1, a2, a3 = ld4_f32_pinned(q, b, kvh * gd + i)
            qs[i], qs[i + 1], qs[i + 2], qs[i + 3] = a0 * scale, a1 * scale, a2 * scale, a3 * scale
        cuda.syncthreads()  # qs
        for g in range(group):  # the split's softmax per head: (max, sum) over the warp
            s = zero
            for i in range(kw):  # kk's index is constant once this inner loop is unrolled
                lo, hi = unpack_h2(kk[i])
                s += qs[g * head_dim + 2 * i] * lo + qs[g * head_dim + 2 * i + 1] * hi
            mx, e, total = split_softmax(s, valid)
            ps[sp, g, lane] = e
            if lane == 0:
                sm[sp, g] = mx
                sl[sp, g] = total
        cuda.syncthreads()  # ps
        acc = cuda.local.array(gv, float32)
        for i in range(gv):
            acc[i] = zero
        for k in range(npl):
            j = r0 + k * rpw
            for h2 in range(vec // 2):
                lo, hi = unpack_h2(vv[4 * k + h2])
                for g in range(group):
                    w8 = ps[sp, g, j]
                    acc[g * vec + 2 * h2] += w8 * lo
                    acc[g * vec + 2 * h2 + 1] += w8 * hi
        rows_sum(acc)  # the rows' partial sums: lanes lpr, 2 lpr, ... apart hold the same columns
        if r0 == 0:
            for g in range(group):
                for e in range(vec):
                    sa[sp, g, d0 + e] = acc[g * vec + e]
        cuda.syncthreads()  # sa, sm, sl: every split's partials
        for it in range(oi):  # the same count for every thread (store_q8's reductions)
            idx = tid + it * threads
            mx, tot, val = merge_warps(sm, sl, sa, splits, min(idx // head_dim, group - 1), idx % head_dim)
            v = val / tot
            col = kvh * gd + idx
            if mode == "f32":
                if idx < gd:
                    out[b, col] = v
            else:  # head_dim % 32 == 0: a warp's 32 columns are one int8 block of one head
                store_q8(v, idx < gd, out, xs, b, col // 32, idx % 32)

    return attn_decode_lpm


@functools.cache
def attn_decode_lpm_kernel(head_dim, group, splits, mode):
    return cuda.jit(make_attn_decode_lpm(head_dim, group, splits, mode))


def attn_decode_lpm(spec, q, k_cache, v_cache, tables, seq_lens, out, xs, num_rows, mode, splits, stream=0) -> None:
    """Decode attention of rows of at most `splits` x 32 positions in one launch (float16
    pools): the same inputs and outputs as attn_decode_lp, without its scratch."""
    if not 1 <= splits <= LPM_MAX_SPLITS:
        raise ValueError(f"attn_decode_lpm covers 1 to {LPM_MAX_SPLITS} splits of {LP_SPLIT}, got {splits}")
    scale = np.float32(1.0 / math.sqrt(spec.head_dim))
    kernel = attn_decode_lpm_kernel(spec.head_dim, spec.group_size, splits, mode)
    kernel[(num_rows, spec.num_kv_heads), 32 * splits, stream](q, k_cache, v_cache, tables, seq_lens, out, xs, scale)


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


def make_attn_decode_one(head_dim: int, group: int, mode: str, warps: int = ONE_WARPS, ch: int = ONE_CHUNK,
                         post: bool = False, interleaved: bool = False):  # fmt: skip
    """`post`: the kernel also does rope.qkv_post for its row's token (see `attn_decode_one`)."""
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
    gd = group * head_dim  # the rotated q of the group (post)
    post_heads = decode_post_fn(head_dim, group, nw, interleaved) if post else None
    # K / V loads are coherent (ld8_pinned): the pool's new position is written by this very block
    # (post) or by the kernel before, which may still run when this one starts (pdl.py); `.nc`
    # is only for data that stays read-only during the kernel's whole lifetime

    @aware
    def attn_decode_one(q, k_cache, v_cache, tables, seq_lens, out, xs, scale, post_args):
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
        if post:  # q is the raw QKV; the page ids (not written here) are in flight meanwhile
            n = seq_lens[b]  # read before the barrier too, so the first chunk does not wait for it
            qs = cuda.shared.array(gd, float32)
            post_heads(q, post_args, b, kvh, True, qs, k_cache, v_cache)
            cuda.syncthreads()  # qs and the block's pool writes visible to the whole block
        for g in range(group):
            h = kvh * group + g
            for i in range(vec):
                qr[g * vec + i] = (qs[g * head_dim + d0 + i] if post else q[b, h * head_dim + d0 + i]) * scale
                acc[g * vec + i] = float32(0.0)
            m[g] = float32(NEG_BIG)
            lsum[g] = float32(0.0)
        if not post:
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


@functools.cache
def attn_decode_one_kernel(head_dim, group, mode, warps, ch, post=False, interleaved=False):
    fn = make_attn_decode_one(head_dim, group, mode, warps, ch, post, interleaved)
    # launch bounds: 16 warps must fit 128 registers a thread (8 warps fit without a cap)
    return cuda.jit(fn) if SIMULATOR else cuda.jit(launch_bounds=32 * warps)(fn)


def attn_decode_one(spec, q, k_cache, v_cache, tables, seq_lens, out, xs, num_rows, mode, stream=0,
                    warps: int | None = None, ch: int | None = None,
                    post: DecodePost | None = None) -> None:  # fmt: skip
    """Decode attention in one launch, grid (row, KV head): float32 `out` [B, q_dim], or int8
    blocks + scales (`xs`) for mode 'q8'. K / V caches must have 16-byte aligned rows. With
    `post`, rope.qkv_post for the step's tokens is done here too, as in `attn_decode`."""
    warps, ch = warps or ONE_WARPS, ch or ONE_CHUNK
    scale = np.float32(1.0 / math.sqrt(spec.head_dim))
    src, extra = _decode_inputs(q, post)
    attn_decode_one_kernel(spec.head_dim, spec.group_size, mode, warps, ch, post is not None, _interleaved(post))[
        (num_rows, spec.num_kv_heads), 32 * warps, stream
    ](src, k_cache, v_cache, tables, seq_lens, out, xs, scale, extra)


# -- prefill -----------------------------------------------------------------------------------

TQ = 64  # queries per tile (flash.py's block; this kernel takes a tile in SUB_TQ-query blocks)
SUB_TQ = 16  # queries per block of the SIMT kernel
TK = 32  # keys per shared-memory step
PREFILL_THREADS = 128  # 16 queries x 8 threads


def make_attn_prefill(head_dim: int):
    per = head_dim // 8  # output elements per thread
    kc_per = TK // 8  # keys scored per thread per step
    hd1 = head_dim + 1  # padded rows: the 4 query rows of a warp hit different banks
    tk1 = TK + 1

    def attn_prefill(q, k_cache, v_cache, tables, tile_row, tile_tok0, tile_ntok, row_tok0, row_start, out,
                     scale, group):  # fmt: skip
        tile = cuda.blockIdx.x // (TQ // SUB_TQ)
        sub = cuda.blockIdx.x % (TQ // SUB_TQ)
        h = cuda.blockIdx.y
        kvh = h // group
        tid = cuda.threadIdx.x
        r = tile_row[tile]
        t0 = tile_tok0[tile] + SUB_TQ * sub
        nt = min(tile_ntok[tile] - SUB_TQ * sub, SUB_TQ)
        if nt <= 0:  # uniform over the block
            return
        page_size = k_cache.shape[1]
        qs = cuda.shared.array((SUB_TQ, hd1), float32)
        ks = cuda.shared.array((TK, hd1), float32)
        vs = cuda.shared.array((TK, head_dim), float32)
        ps = cuda.shared.array((SUB_TQ, tk1), float32)
        for idx in range(tid, SUB_TQ * head_dim, PREFILL_THREADS):
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
    attn_prefill_kernel(spec.head_dim)[(num_tiles * (TQ // SUB_TQ), spec.num_heads), PREFILL_THREADS, stream](
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
    plain, post = types.Tuple(()), post_arg_types()  # the decode kernels' `post_args` tuple
    cases = []
    for kv_t in (types.float16, types.float32):
        cache = types.Array(kv_t, 4, "C")
        for hd, group in ((64, 3), (128, 2), (128, 4)):
            sig = (f2, cache, cache, i2, i1, f4, f4, types.float32)
            cases.append((f"attn_decode_hd{hd}_g{group}_{kv_t}", make_attn_decode(hd, group, 256), (*sig, plain, plain)))
            inter = group == 4
            name = f"attn_decode_post_{'inter' if inter else 'half'}_hd{hd}_g{group}_{kv_t}"
            fn = make_attn_decode(hd, group, 256, post=True, interleaved=inter)
            cases.append((name, fn, (*sig, post, plain)))
            for mode, out_t in (("f32", f2), ("q8", types.int8[:, ::1])):  # the merge in the last split
                merge_t = types.Tuple((out_t, f2, i2))
                fn = make_attn_decode(hd, group, 32, merge=mode)
                cases.append((f"attn_decode_merge_{mode}_hd{hd}_g{group}_{kv_t}", fn, (*sig, plain, merge_t)))
            psig = (f2, cache, cache, i2, i1, i1, i1, i1, i1, f2, types.float32, types.int32)
            if group != 4:
                cases.append((f"attn_prefill_hd{hd}_{kv_t}", make_attn_prefill(hd), psig))
    for kv_t in (types.float16, types.float32):
        cache = types.Array(kv_t, 4, "C")
        for hd, group in ((64, 3), (128, 4), (128, 2), (256, 4)):
            sig = (f2, cache, cache, i2, i1, f4, f4, types.float32)
            cases.append((f"attn_decode_lp_hd{hd}_g{group}_{kv_t}", make_attn_decode_lp(hd, group), sig))
            cases.append((f"attn_decode_lp_pre_hd{hd}_g{group}_{kv_t}", make_attn_decode_lp(hd, group, True), sig))
    h16 = types.Array(types.float16, 4, "C")
    for hd, group, splits, mode in ((32, 2, 2, "q8"), (64, 3, 8, "q8"), (128, 4, 8, "q8"), (128, 4, 6, "f32"),
                                    (128, 2, 8, "f32")):  # fmt: skip
        out_t = f2 if mode == "f32" else types.int8[:, ::1]
        sig = (f2, h16, h16, i2, i1, out_t, f2, types.float32)
        cases.append((f"attn_decode_lpm_{mode}_hd{hd}_g{group}_s{splits}", make_attn_decode_lpm(hd, group, splits, mode),
                      sig))  # fmt: skip
    for hd in (64, 128):
        cases.append((f"attn_combine_f32_hd{hd}", make_attn_combine(hd, 256, "f32"), (f4, f4, i1, f2, f2)))
        cases.append((f"attn_combine_q8_hd{hd}", make_attn_combine(hd, 256, "q8"), (f4, f4, i1, types.int8[:, ::1], f2)))
    for kv_t in (types.float16, types.float32):
        cache = types.Array(kv_t, 4, "C")
        for hd, group in ((64, 3), (128, 4), (128, 2)):
            for mode, out_t in (("f32", f2), ("q8", types.int8[:, ::1])):
                sig = (f2, cache, cache, i2, i1, out_t, f2, types.float32)
                name = f"attn_decode_one_{mode}_hd{hd}_g{group}_{kv_t}"
                cases.append((name, make_attn_decode_one(hd, group, mode), (*sig, plain)))
                if mode == "q8" or hd == 64:  # the post variants: every shape in q8, one in f32
                    inter = group == 4
                    name = f"attn_decode_one_post_{'inter' if inter else 'half'}_{mode}_hd{hd}_g{group}_{kv_t}"
                    fn = make_attn_decode_one(hd, group, mode, post=True, interleaved=inter)
                    cases.append((name, fn, (*sig, post)))
    return cases
