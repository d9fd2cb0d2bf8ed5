"""Causal paged attention for prefill chunks on tensor cores (flash-attention style).

Grid (query tile, head): a tile is up to `attn_prefill.TQ` = 64 consecutive tokens of one row;
each of the 4 warps owns 16 of them as `mma.sync.m16n8k16` A fragments of Q (float16, the
1 / sqrt(head_dim) scale folded in). Keys and values stream through shared memory 64
positions at a time (32, double-buffered, above head_dim 64: `kv_tile`, `make_flash_prefill`),
from position 0 to the tile's last query (earlier pages included):

    S = Q K^T  (16 x 64 per warp; K rows as f16 pairs, padded so fragment loads hit 32 banks)
    online softmax per query row: running max m, running sum l (each lane keeps its share of
        l; the 4 lanes of a row add theirs at the end), O *= exp(m_old - m_new)
    O += P V  (P re-packed from S's accumulators into A fragments in registers; V staged
        transposed, dims x key pairs, so its B fragments are single 32-bit loads)

Only float16 KV pools take this path (their words are read as-is); float32 pools keep the
exact SIMT kernel in attn_prefill.py. Scores and the running softmax are float32.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, types, uint32

from ninfer.gpu.cuda.kernels.attn_decode import NEG_BIG
from ninfer.gpu.cuda.kernels.intrinsics import SIMULATOR, group_max, group_sum, ld4_u32, mma_m16n8k16, pack_half2
from ninfer.gpu.cuda.kernels.jit import compiled

if SIMULATOR:
    fexp = math.exp
else:
    from numba.cuda.libdevice import fast_expf as fexp  # ex2.approx: 2 instructions, ~2 ulp

THREADS = 128  # 4 warps x 16 queries = TQ
LO16 = 0xFFFF
HI16 = 0xFFFF0000


def kv_tile(head_dim: int) -> int:
    """Keys per shared-memory tile: 64, or 32 above head_dim 64 (sm_90 then holds the S and O
    accumulators without spilling)."""
    return 64 if head_dim <= 64 else 32


def make_flash_prefill(head_dim: int):
    bkv = kv_tile(head_dim)
    vt_words = bkv // 2 + 4  # a transposed V row: key pairs + 4 words of padding (conflict-free)
    kq = head_dim // 2 // (THREADS // bkv)  # K words each lane stages per tile
    vq = head_dim // 2 // (THREADS // (bkv // 2))  # V words of each of its two keys
    hw = head_dim // 2  # f16 pairs per K / V position
    k_words = hw + 4  # padded K row: rows 8 apart land 4 banks apart
    nkc = head_dim // 16  # 16-wide chunks of head_dim (the k of S = Q K^T)
    ndt = head_dim // 8  # 8-wide tiles of head_dim (the n of O = P V)
    nst = bkv // 8  # 8-key tiles of S
    n_qa, n_o, n_s = 4 * nkc, 4 * ndt, 4 * nst  # register arrays (sizes must be constants)
    # shared K / V buffers: two above head_dim 64, so one barrier per tile suffices and (what
    # matters on sm_90) the fragment addresses depend on the tile: NVVM 7 otherwise hoists
    # each of them out of the key loop into registers of its own and spills at head_dim 128.
    # head_dim 64 keeps one buffer (the kernel measured on the H200, 250 registers, no spill).
    nbuf = 2 if head_dim > 64 else 1
    n_ks, n_vt = bkv * k_words, head_dim * vt_words  # one buffer of each
    n_ksb, n_vtb = nbuf * n_ks, nbuf * n_vt

    def flash_prefill(q, k_cache, v_cache, tables, tile_row, tile_tok0, tile_ntok, row_tok0, row_start, out,
                      scale, group, page_size, num_kv):  # fmt: skip
        tile = cuda.gridDim.x - 1 - cuda.blockIdx.x  # a row's later tiles (more keys) start first
        h = cuda.blockIdx.y
        nt = tile_ntok[tile]
        if nt == 0:  # a padding tile of a graph bucket (uniform over the block)
            return
        kvh = h // group
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        r = tile_row[tile]
        t0 = tile_tok0[tile]
        # flat shared tiles: each lane's fragment loads are its base index plus constants
        ks = cuda.shared.array(n_ksb, uint32)
        vt = cuda.shared.array(n_vtb, uint32)
        kb = g * k_words + t
        vb = g * vt_words + t
        first_pos = row_start[r] + (t0 - row_tok0[r])
        last_pos = first_pos + nt - 1
        wq0 = 16 * warp  # this warp's first query in the tile
        row_a = wq0 + g  # the lane's two query rows (fragment rows g and g + 8)
        row_b = row_a + 8
        pos_a = first_pos + row_a if row_a < nt else -1
        pos_b = first_pos + row_b if row_b < nt else -1
        warp_last = min(first_pos + wq0 + 15, last_pos)
        busy = wq0 < nt
        qa = cuda.local.array(n_qa, uint32)
        for kc in range(nkc):
            col = h * head_dim + 16 * kc + 2 * t
            for half in range(2):
                c = col + 8 * half
                va0 = q[t0 + row_a, c] * scale if row_a < nt else float32(0.0)
                va1 = q[t0 + row_a, c + 1] * scale if row_a < nt else float32(0.0)
                vb0 = q[t0 + row_b, c] * scale if row_b < nt else float32(0.0)
                vb1 = q[t0 + row_b, c + 1] * scale if row_b < nt else float32(0.0)
                qa[4 * kc + 2 * half] = pack_half2(va0, va1)
                qa[4 * kc + 2 * half + 1] = pack_half2(vb0, vb1)
        o = cuda.local.array(n_o, float32)
        for i in range(n_o):
            o[i] = float32(0.0)
        s = cuda.local.array(n_s, float32)
        m_a = float32(NEG_BIG)
        m_b = float32(NEG_BIG)
        l_a = float32(0.0)
        l_b = float32(0.0)
        for kt in range(last_pos // bkv + 1):
            k0 = kt * bkv
            if nbuf == 1:
                cuda.syncthreads()  # the previous tile's fragments are all read
            # else buffer kt % 2: every warp is past tile kt - 1's barrier, so none still reads
            # tile kt - 2 from it
            kbuf = (kt % nbuf) * n_ks
            vbuf = (kt % nbuf) * n_vt
            # K: THREADS / bkv lanes per key, each kq words of its row in 16-byte loads
            p = k0 + tid // (THREADS // bkv)
            kbase = (tid % (THREADS // bkv)) * kq
            krow = ((tables[r, p // page_size] * page_size + p % page_size) * num_kv + kvh) if p <= last_pos else -1
            for c in range(0, kq, 4):
                w0 = w1 = w2 = w3 = uint32(0)
                if krow >= 0:
                    w0, w1, w2, w3 = ld4_u32(k_cache, krow, kbase + c)
                at = kbuf + (tid // (THREADS // bkv)) * k_words + kbase + c
                ks[at] = w0
                ks[at + 1] = w1
                ks[at + 2] = w2
                ks[at + 3] = w3
            # V transposed: THREADS / (bkv / 2) lanes per key pair, each vq words of both rows
            jp = tid // (THREADS // (bkv // 2))
            vbase = (tid % (THREADS // (bkv // 2))) * vq
            pa = k0 + 2 * jp
            pb = pa + 1
            rowa = ((tables[r, pa // page_size] * page_size + pa % page_size) * num_kv + kvh) if pa <= last_pos else -1
            rowb = ((tables[r, pb // page_size] * page_size + pb % page_size) * num_kv + kvh) if pb <= last_pos else -1
            for c in range(0, vq, 4):
                a0 = a1 = a2 = a3 = uint32(0)
                b0 = b1 = b2 = b3 = uint32(0)
                if rowa >= 0:
                    a0, a1, a2, a3 = ld4_u32(v_cache, rowa, vbase + c)
                if rowb >= 0:
                    b0, b1, b2, b3 = ld4_u32(v_cache, rowb, vbase + c)
                at = vbuf + 2 * (vbase + c) * vt_words + jp  # dims 2w .. 2w + 7 of key pair jp
                vt[at] = (a0 & uint32(LO16)) | (b0 << uint32(16))
                vt[at + vt_words] = (a0 >> uint32(16)) | (b0 & uint32(HI16))
                vt[at + 2 * vt_words] = (a1 & uint32(LO16)) | (b1 << uint32(16))
                vt[at + 3 * vt_words] = (a1 >> uint32(16)) | (b1 & uint32(HI16))
                vt[at + 4 * vt_words] = (a2 & uint32(LO16)) | (b2 << uint32(16))
                vt[at + 5 * vt_words] = (a2 >> uint32(16)) | (b2 & uint32(HI16))
                vt[at + 6 * vt_words] = (a3 & uint32(LO16)) | (b3 << uint32(16))
                vt[at + 7 * vt_words] = (a3 >> uint32(16)) | (b3 & uint32(HI16))
            cuda.syncthreads()
            if busy and k0 <= warp_last:  # uniform over the warp
                for n8 in range(nst):
                    c0 = c1 = c2 = c3 = float32(0.0)
                    for kc in range(nkc):
                        b0 = ks[kbuf + kb + (8 * n8 * k_words + 8 * kc)]
                        b1 = ks[kbuf + kb + (8 * n8 * k_words + 8 * kc + 4)]
                        c0, c1, c2, c3 = mma_m16n8k16(qa[4 * kc], qa[4 * kc + 1], qa[4 * kc + 2], qa[4 * kc + 3],
                                                      b0, b1, c0, c1, c2, c3)  # fmt: skip
                    kp = k0 + 8 * n8 + 2 * t
                    s[4 * n8] = c0 if kp <= pos_a else float32(-math.inf)
                    s[4 * n8 + 1] = c1 if kp + 1 <= pos_a else float32(-math.inf)
                    s[4 * n8 + 2] = c2 if kp <= pos_b else float32(-math.inf)
                    s[4 * n8 + 3] = c3 if kp + 1 <= pos_b else float32(-math.inf)
                mx_a = m_a
                mx_b = m_b
                for n8 in range(nst):
                    mx_a = max(mx_a, max(s[4 * n8], s[4 * n8 + 1]))
                    mx_b = max(mx_b, max(s[4 * n8 + 2], s[4 * n8 + 3]))
                mx_a = group_max(mx_a, 4)
                mx_b = group_max(mx_b, 4)
                corr_a = fexp(m_a - mx_a)
                corr_b = fexp(m_b - mx_b)
                m_a = mx_a
                m_b = mx_b
                l_a *= corr_a
                l_b *= corr_b
                for dt in range(ndt):
                    o[4 * dt] *= corr_a
                    o[4 * dt + 1] *= corr_a
                    o[4 * dt + 2] *= corr_b
                    o[4 * dt + 3] *= corr_b
                for kc in range(bkv // 16):  # 16 keys: S tiles 2kc and 2kc + 1 are P's A fragment
                    pa0 = fexp(s[8 * kc] - m_a)
                    pa1 = fexp(s[8 * kc + 1] - m_a)
                    pb0 = fexp(s[8 * kc + 2] - m_b)
                    pb1 = fexp(s[8 * kc + 3] - m_b)
                    pa2 = fexp(s[8 * kc + 4] - m_a)
                    pa3 = fexp(s[8 * kc + 5] - m_a)
                    pb2 = fexp(s[8 * kc + 6] - m_b)
                    pb3 = fexp(s[8 * kc + 7] - m_b)
                    l_a += (pa0 + pa1) + (pa2 + pa3)
                    l_b += (pb0 + pb1) + (pb2 + pb3)
                    a0 = pack_half2(pa0, pa1)
                    a1 = pack_half2(pb0, pb1)
                    a2 = pack_half2(pa2, pa3)
                    a3 = pack_half2(pb2, pb3)
                    for dt in range(ndt):
                        b0 = vt[vbuf + vb + (8 * dt * vt_words + 8 * kc)]
                        b1 = vt[vbuf + vb + (8 * dt * vt_words + 8 * kc + 4)]
                        i = 4 * dt
                        o[i], o[i + 1], o[i + 2], o[i + 3] = mma_m16n8k16(a0, a1, a2, a3, b0, b1,
                                                                          o[i], o[i + 1], o[i + 2], o[i + 3])  # fmt: skip
        if busy:
            l_a = group_sum(l_a, 4)
            l_b = group_sum(l_b, 4)
            for dt in range(ndt):
                col = h * head_dim + 8 * dt + 2 * t
                if row_a < nt:
                    out[t0 + row_a, col] = o[4 * dt] / l_a
                    out[t0 + row_a, col + 1] = o[4 * dt + 1] / l_a
                if row_b < nt:
                    out[t0 + row_b, col] = o[4 * dt + 2] / l_b
                    out[t0 + row_b, col + 1] = o[4 * dt + 3] / l_b

    return flash_prefill


def supports(head_dim: int, kv_dtype) -> bool:
    """Whether the tensor-core path serves this shape and pool type."""
    return np.dtype(kv_dtype) == np.float16 and head_dim % 16 == 0 and 16 <= head_dim <= 256


@compiled
def flash_prefill_kernel(head_dim):
    return cuda.jit(make_flash_prefill(head_dim))


def words(cache):
    """A float16 KV array [pages, page_size, kv_heads, head_dim] as rows of f16 pairs (no copy):
    [pages * page_size * kv_heads, head_dim / 2] uint32, row (page * page_size + slot) *
    kv_heads + kv_head."""
    return cache.view(np.uint32).reshape(-1, cache.shape[3] // 2)


def flash_prefill(spec, q, k_words, v_words, tables, tiles, out, num_tiles, page_size, stream=0) -> None:
    """k_words / v_words: one layer's pools through `words`; tiles as attn_prefill.attn_prefill."""
    scale = np.float32(1.0 / math.sqrt(spec.head_dim))
    flash_prefill_kernel(spec.head_dim)[(num_tiles, spec.num_heads), THREADS, stream](
        q, k_words, v_words, tables, *tiles, out, scale, spec.group_size, page_size, spec.num_kv_heads
    )


def ptx_cases():
    f2 = types.float32[:, ::1]
    cache = types.uint32[:, ::1]
    i1, i2 = types.int32[::1], types.int32[:, ::1]
    sig = (f2, cache, cache, i2, i1, i1, i1, i1, i1, f2, types.float32, int32, int32, int32)
    return [(f"flash_prefill_hd{hd}", make_flash_prefill(hd), sig) for hd in (64, 128)]
