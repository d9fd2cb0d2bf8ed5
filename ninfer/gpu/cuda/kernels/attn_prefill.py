"""Paged causal prefill attention, SIMT (exact, for float32 pools), and the tile planning.

Prefill covers rows of many tokens, or any mixed batch: a tile is up to TQ = 64 consecutive
tokens of one row. float16 pools take the tensor-core kernel of flash.py; this kernel runs
grid (query tile x 4, head), each block 16 of a tile's queries; keys stream through shared
memory 32 positions at a time, from position 0 to the block's last query (earlier pages
included), causal per query. The oracle is attn_decode.attention_ref.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, types

from ninfer.gpu.cuda.kernels.attn_decode import NEG_BIG
from ninfer.gpu.cuda.kernels.intrinsics import group_max, group_sum
from ninfer.gpu.cuda.kernels.jit import compiled

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


@compiled
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


def ptx_cases():
    f2 = types.float32[:, ::1]
    i1, i2 = types.int32[::1], types.int32[:, ::1]
    cases = []
    for kv_t in (types.float16, types.float32):
        cache = types.Array(kv_t, 4, "C")
        for hd in (64, 128):
            psig = (f2, cache, cache, i2, i1, i1, i1, i1, i1, f2, types.float32, types.int32)
            cases.append((f"attn_prefill_hd{hd}_{kv_t}", make_attn_prefill(hd), psig))
    return cases
