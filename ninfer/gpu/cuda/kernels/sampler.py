"""On-device sampling with the semantics of `ninfer.gpu.sampling` (steps 1-7 there).

Blocks per sampled row: the raw log-softmax statistics come first (logprob read-out), one
pass split over `stat_splits` blocks of the row (the greedy arg-max of a row with no mask and
no penalty on the way); the last of them to finish merges the splits' partials and does the
rest of the row alone: the penalised and masked copy of the logits (`scores`), then greedy
arg-max or the filtered draw. Filters and the draw never sort: the draw order (z desc, id asc) is a total order on
64-bit keys (`order_key`), every filter keeps a prefix of it, and a prefix is found as the
largest key threshold whose mass (count, or fixed-point weight) reaches a target, by binary
search over the 32-bit value half of the key plus a tie step over ids. Weights are summed as
exact integers (w * 2^40), so results do not depend on thread order; they differ from the
reference's float32 running sums only when a draw lands within ~1e-7 of a boundary, and
tokens whose weight is under 2^-40 of the top one are never drawn.

Per-row inputs (host packed): `fpar` [S, 8] float32 = temperature, top_p, min_p, presence,
frequency, repetition; `ipar` [S, 8] int32 = top_k, num_top_logprobs, has_mask, pen_start,
pen_end; `seeds` [S, 2] uint64 = seed, token_index; penalty entries `pen_ids` / `pen_counts`
(unique ids of prompt + output, with their output counts); `masks` [S, ceil(V / 32)] uint32
bit masks (bit i of word i // 32: token allowed).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, float64, int32, types, uint32, uint64

from ninfer.gpu.cuda.kernels.intrinsics import (
    device,
    grid_dep_launch,
    grid_dep_wait,
    block_max,
    block_max_u64,
    block_sum,
    block_sum_u64,
    f32_to_bits,
    ld4_f32_pinned,
    ld_f32_cg,
    order_key,
    uniform,
)
from ninfer.gpu.cuda.kernels.jit import compiled
from ninfer.gpu.cuda.kernels.pdl import aware
from ninfer.gpu.cuda.plan import DEFAULT, KernelPlan
from ninfer.core.params import MAX_TOP_LOGPROBS

THREADS = 512  # the kernel needs ~71 registers: 1024 threads would exceed the 64k-register file
FIXED_ONE = float64(2.0**40)
NUM_FPAR = 8
NUM_IPAR = 8


@device
def value_key(z):
    """The order-preserving uint32 of a float (larger z -> larger key)."""
    b = f32_to_bits(z)
    if b & uint32(0x80000000):
        return ~b
    return b | uint32(0x80000000)


@device
def element(scores, r, i, temp, zmax):
    """(value key, weight, fixed-point weight) of token i in the draw."""
    z = scores[r, i] / temp
    w = math.exp(z - zmax)
    return value_key(z), w, uint64(float64(w) * FIXED_ONE)


@cuda.jit(device=True)
def partial_mass(scores, r, temp, zmax, min_p, tau_min, weighted, cmp, v_thr, id_thr, threads):
    """This thread's share of the mass of kept tokens passing the comparison `cmp`.

    kept: w > 0, w >= min_p (when min_p > 0) and key >= tau_min. cmp 0: value key >= v_thr;
    cmp 1: value key == v_thr; cmp 2: value key == v_thr and id <= id_thr.
    """
    acc = uint64(0)
    for i in range(cuda.threadIdx.x, scores.shape[1], threads):
        vk, w, wfp = element(scores, r, i, temp, zmax)
        if w <= float32(0.0) or (min_p > float32(0.0) and w < min_p):
            continue
        if ((uint64(vk) << uint64(32)) | uint64(uint32(0xFFFFFFFF) - uint32(i))) < tau_min:
            continue
        ok = vk >= v_thr if cmp == 0 else (vk == v_thr and (cmp == 1 or i <= id_thr))
        if ok:
            acc += wfp if weighted else uint64(1)
    return acc


@cuda.jit(device=True)
def select_prefix(scores, r, temp, zmax, min_p, tau_min, weighted, target, scratch, threads):
    """Key of the last token of the shortest prefix (among kept tokens) with mass >= target.

    Returns 0 (keep everything) when the kept tokens' whole mass is below target.
    """
    total = block_sum_u64(partial_mass(scores, r, temp, zmax, min_p, tau_min, weighted, 0, uint32(0), 0, threads), scratch)
    if total < target:
        return uint64(0)
    lo = uint64(0)
    hi = uint64(0xFFFFFFFF)
    while lo < hi:
        mid = lo + (hi - lo + uint64(1)) // uint64(2)
        f = block_sum_u64(partial_mass(scores, r, temp, zmax, min_p, tau_min, weighted, 0, uint32(mid), 0, threads), scratch)
        if f >= target:
            lo = mid
        else:
            hi = mid - uint64(1)
    v = uint32(lo)
    above = uint64(0)
    if lo < uint64(0xFFFFFFFF):
        above = block_sum_u64(
            partial_mass(scores, r, temp, zmax, min_p, tau_min, weighted, 0, uint32(lo + uint64(1)), 0, threads), scratch
        )
    need = target - above
    count = block_sum_u64(partial_mass(scores, r, temp, zmax, min_p, tau_min, False, 1, v, 0, threads), scratch)
    if count == uint64(1):
        best = uint64(0)
        for i in range(cuda.threadIdx.x, scores.shape[1], threads):
            vk, w, wfp = element(scores, r, i, temp, zmax)
            key = (uint64(vk) << uint64(32)) | uint64(uint32(0xFFFFFFFF) - uint32(i))
            if vk == v and w > float32(0.0) and not (min_p > float32(0.0) and w < min_p) and key >= tau_min:
                best = key
        return block_max_u64(best, scratch)
    # ties on the value: the lowest ids of the group, as many as the remaining mass needs
    a = 0
    b = scores.shape[1] - 1
    while a < b:
        mid = (a + b) // 2
        g = block_sum_u64(partial_mass(scores, r, temp, zmax, min_p, tau_min, weighted, 2, v, mid, threads), scratch)
        if g >= need:
            b = mid
        else:
            a = mid + 1
    return (uint64(v) << uint64(32)) | uint64(uint32(0xFFFFFFFF) - uint32(a))


STATS_UNROLL = 4  # 16-byte loads of logits in flight per thread in the statistics pass
_STATS_VALS = 4 * STATS_UNROLL


@device
def _add_quad(m, s, best, v0, v1, v2, v3, i, plain):
    """(max, sum of exp(v - max), best order key) after four more logits, ids i .. i + 3."""
    qm = max(max(v0, v1), max(v2, v3))
    if qm > m:
        s *= math.exp(m - qm)
        m = qm
    if qm > float32(-math.inf):
        s += math.exp(v0 - m) + math.exp(v1 - m) + math.exp(v2 - m) + math.exp(v3 - m)
    if plain:
        best = max(best, max(max(order_key(v0, i), order_key(v1, i + 1)), max(order_key(v2, i + 2), order_key(v3, i + 3))))
    return m, s, best


@device
def logit_stats(logits, r, threads, plain, lo, hi):
    """This thread's share of logits [lo, hi) of row r in one pass: (max, sum of exp(x - max),
    and when `plain` the best order key). Rows of a multiple of 4 logits (lo, hi then multiples
    of 4) are read as 16-byte quads, STATS_UNROLL of them in flight at once: the row is in L2,
    so the pass waits on ~(hi - lo) / (16 threads) round trips spread over the block instead of
    one per logit."""
    tid = cuda.threadIdx.x
    m = float32(-math.inf)
    s = float32(0.0)
    best = uint64(0)
    if logits.shape[1] % 4 == 0:  # every row starts 16-byte aligned
        q_lo = lo // 4
        nq = hi // 4
        vals = cuda.local.array(_STATS_VALS, float32)
        for q0 in range(q_lo + tid, nq, threads * STATS_UNROLL):
            for u in range(STATS_UNROLL):
                q = min(q0 + u * threads, nq - 1)  # past the end: the last quad again (same max, not summed)
                vals[4 * u], vals[4 * u + 1], vals[4 * u + 2], vals[4 * u + 3] = ld4_f32_pinned(logits, r, 4 * q)
            for u in range(STATS_UNROLL):
                if q0 + u * threads < nq:
                    m, s, best = _add_quad(m, s, best, vals[4 * u], vals[4 * u + 1], vals[4 * u + 2], vals[4 * u + 3],
                                           4 * (q0 + u * threads), plain)  # fmt: skip
    else:
        ninf = float32(-math.inf)
        for i in range(lo + tid, hi, threads):
            m, s, best = _add_quad(m, s, best, logits[r, i], ninf, ninf, ninf, i, False)
            if plain:
                best = max(best, order_key(logits[r, i], i))
    return m, s, best


# The statistics pass over a large vocabulary is split over `stat_splits` blocks a row (one
# round of STATS_UNROLL quads a thread each): every block stores its (max, sum) and folds its
# best key into the row's by an atomic max, then counts itself in; the last block of the row
# to count merges the partials and does the rest of the row alone (steps 2-7, and the top
# log-probabilities from the splits' own top keys, which each split finds over its slice when
# a row asks for them), as one block did before. One block over Llama-3's 128,256 logits took
# 24.9 us on the H200 (sixth session), ~16 round trips a thread in sequence; split 16 ways
# it is one round trip plus the fence / atomic tail (KernelPlan.split_stats; False: one block a row).
MAX_STAT_SPLITS = 32
MAX_TOP = MAX_TOP_LOGPROBS
_CANDIDATES = MAX_STAT_SPLITS * MAX_TOP  # the splits' top keys the last block picks from


def stat_splits(vocab: int, threads: int, split: bool = True) -> int:
    """Blocks a row's statistics pass takes: one unrolled round of quads a thread each (1
    where not `split`)."""
    if not split:
        return 1
    return max(1, min(MAX_STAT_SPLITS, threads, -(-vocab // (threads * _STATS_VALS))))


@device
def stat_slice(vocab, p, splits):
    """Logits [lo, hi) of split p: multiples of 4 (whole quads) but the end."""
    per = 4 * (-(-vocab // (4 * splits)))
    return min(p * per, vocab), min((p + 1) * per, vocab)


def scratch(max_rows: int):
    """The statistics splits' scratch, zeroed: (max, sum) partials [rows, 1, MAX_STAT_SPLITS,
    2], best keys [rows] and arrival counts [rows] (the last block of a row resets both), and
    each split's top keys [rows, MAX_STAT_SPLITS, MAX_TOP]."""
    return (cuda.to_device(np.zeros((max_rows, 1, MAX_STAT_SPLITS, 2), np.float32)),
            cuda.to_device(np.zeros(max_rows, np.uint64)), cuda.to_device(np.zeros(max_rows, np.int32)),
            cuda.to_device(np.zeros((max_rows, MAX_STAT_SPLITS, MAX_TOP), np.uint64)))  # fmt: skip


@device
def next_key(logits, r, lo, hi, prev, threads, us):
    """The largest order key below `prev` among logits [lo, hi) of row r (0: none); block-wide."""
    best = uint64(0)
    for i in range(lo + cuda.threadIdx.x, hi, threads):
        key = order_key(logits[r, i], i)
        if key < prev:
            best = max(best, key)
    return block_max_u64(best, us)


@device
def merge_stats(logits, r, threads, plain, ntop, part, keys, counters, tops, fs, us, flag):
    """(last, max, sum of exp(x - max), best key) of row r: this block's share of the
    statistics pass, and where the row is split, the merge of every split's partials by the
    last block of the row to arrive (`last`; the others stop there, their statistics unset).
    A split block also stores its slice's top `ntop` order keys in tops[r, split]."""
    tid = cuda.threadIdx.x
    p = cuda.blockIdx.y
    splits = cuda.gridDim.y
    lo, hi = stat_slice(logits.shape[1], p, splits)
    mx, s, best = logit_stats(logits, r, threads, plain, lo, hi)
    big = block_max(mx, fs)
    total = block_sum(s * math.exp(mx - big) if mx > float32(-math.inf) else float32(0.0), fs)
    if splits == 1:
        return True, big, total, block_max_u64(best, us)
    best = block_max_u64(best, us)
    prev = uint64(0xFFFFFFFFFFFFFFFF)
    for k in range(ntop):
        prev = next_key(logits, r, lo, hi, prev, threads, us)
        if tid == 0:
            tops[r, p, k] = prev
    if tid == 0:
        part[r, 0, p, 0] = big
        part[r, 0, p, 1] = total
        if plain:
            cuda.atomic.max(keys, r, best)
        cuda.threadfence()  # the partials, the key and the top keys before the count
        flag[0] = int32(1) if cuda.atomic.add(counters, r, 1) == splits - 1 else int32(0)
    cuda.syncthreads()
    if flag[0] == 0:
        return False, big, total, best
    cuda.threadfence()
    m_p = ld_f32_cg(part, r, 0, tid, 0) if tid < splits else float32(-math.inf)
    s_p = ld_f32_cg(part, r, 0, tid, 1) if tid < splits else float32(0.0)
    big = block_max(m_p, fs)
    total = block_sum(s_p * math.exp(m_p - big) if m_p > float32(-math.inf) else float32(0.0), fs)  # (empty splits)
    if tid == 0:
        us[32] = cuda.atomic.exch(keys, r, uint64(0))  # the row's best key, and the reset for the next launch
        counters[r] = 0
    cuda.syncthreads()
    best = us[32]
    cuda.syncthreads()
    return True, big, total, best


@device
def key_id(key):
    return int32(uint32(0xFFFFFFFF) - uint32(key & uint64(0xFFFFFFFF)))


def make_sampler(threads: int = THREADS):
    @aware
    def sample_rows(logits, scores, fpar, ipar, seeds, pen_ids, pen_counts, masks, out_tok, out_lp, top_ids, top_lp,
                    part, keys, counters, tops):  # fmt: skip
        grid_dep_launch()
        r = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        vocab = logits.shape[1]
        temp = fpar[r, 0]  # the row's parameters are step inputs (no kernel writes them): before the PDL wait
        has_mask = ipar[r, 2] != 0
        plain = not has_mask and ipar[r, 3] == ipar[r, 4]  # no mask, no penalty: scores = logits
        grid_dep_wait()
        fs = cuda.shared.array(33, float32)
        us = cuda.shared.array(33, types.uint64)
        flag = cuda.shared.array(1, int32)
        # 1. raw log-softmax statistics (and, when plain, the arg-max on the way): one pass,
        # split over the row's blocks; the last of them to finish goes on alone
        last, big, total, best = merge_stats(logits, r, threads, plain, ipar[r, 1], part, keys, counters, tops, fs, us,
                                             flag)  # fmt: skip
        if not last:
            return
        log_total = math.log(total)
        # 2.-4. scores: grammar mask, then penalties over unique ids (one thread per id)
        src = logits
        if not plain:
            for i in range(tid, vocab, threads):
                v = logits[r, i]
                if has_mask and ((masks[r, i >> 5] >> uint32(i & 31)) & uint32(1)) == 0:
                    v = float32(-math.inf)
                scores[r, i] = v
            cuda.syncthreads()
            rep = fpar[r, 5]
            for e in range(ipar[r, 3] + tid, ipar[r, 4], threads):
                i = pen_ids[e]
                c = pen_counts[e]
                v = scores[r, i]
                if rep != float32(1.0):
                    v = v / rep if v > float32(0.0) else v * rep
                if c > 0:
                    v = v - (fpar[r, 4] * float32(c) + fpar[r, 3])
                scores[r, i] = v
            cuda.syncthreads()
            src = scores
        # 5.-7. greedy, or filter and draw
        if temp == float32(0.0):
            if not plain:  # (plain: the statistics pass found it)
                for i in range(tid, vocab, threads):
                    best = max(best, order_key(src[r, i], i))
                best = block_max_u64(best, us)
            tok = key_id(best)
        else:
            zm = float32(-math.inf)
            for i in range(tid, vocab, threads):
                zm = max(zm, src[r, i] / temp)
            zmax = block_max(zm, fs)
            top_p = fpar[r, 1]
            min_p = fpar[r, 2]
            top_k = ipar[r, 0]
            tau = uint64(0)
            if top_k > 0:
                tau = select_prefix(src, r, temp, zmax, float32(0.0), uint64(0), False, uint64(top_k), us, threads)
            if top_p < float32(1.0):
                wk = block_sum_u64(partial_mass(src, r, temp, zmax, float32(0.0), tau, True, 0, uint32(0), 0, threads), us)
                target = uint64(max(math.ceil(float64(top_p) * float64(wk)), 1.0))
                tau = max(tau, select_prefix(src, r, temp, zmax, float32(0.0), tau, True, target, us, threads))
            kept = block_sum_u64(partial_mass(src, r, temp, zmax, min_p, tau, True, 0, uint32(0), 0, threads), us)
            u = uniform(seeds[r, 0], seeds[r, 1])
            target = uint64(float64(u) * float64(kept)) + uint64(1)
            tok = key_id(select_prefix(src, r, temp, zmax, min_p, tau, True, target, us, threads))
        if tid == 0:
            out_tok[r] = tok
            out_lp[r] = logits[r, tok] - big - log_total
        # top log-probabilities of the raw distribution, best first, ties to the lower id: from
        # the splits' own top keys where the row is split (the row's top k are among them)
        ntop = ipar[r, 1]
        splits = cuda.gridDim.y
        nc = splits * ntop
        cand = cuda.shared.array(_CANDIDATES, types.uint64)
        if splits > 1 and ntop > 0:
            for c in range(tid, nc, threads):  # other blocks' stores: an atomic read is coherent
                cand[c] = cuda.atomic.max(tops, (r, c // ntop, c % ntop), uint64(0))
            cuda.syncthreads()
        prev = uint64(0xFFFFFFFFFFFFFFFF)
        for k in range(ntop):
            if splits > 1:
                best = uint64(0)
                for c in range(tid, nc, threads):
                    if cand[c] < prev:
                        best = max(best, cand[c])
                prev = block_max_u64(best, us)
            else:
                prev = next_key(logits, r, 0, vocab, prev, threads, us)
            if tid == 0:
                t = key_id(prev)
                top_ids[r, k] = t
                top_lp[r, k] = logits[r, t] - big - log_total

    return sample_rows


@compiled
def sampler_kernel(threads: int = THREADS):
    return cuda.jit(make_sampler(threads))


def sample(bufs, num_rows: int, stream=0, threads: int = THREADS, splits: int | None = None,
           plan: KernelPlan = DEFAULT) -> None:  # fmt: skip
    """Launch over `num_rows` rows; `bufs` holds the arrays named in the kernel signature (the
    last four: `scratch`). `splits`: blocks a row's statistics pass takes (default
    stat_splits, as plan.split_stats says)."""
    splits = splits or stat_splits(bufs[0].shape[1], threads, plan.split_stats)
    if not 1 <= splits <= min(MAX_STAT_SPLITS, threads):  # the merge: a thread a split, into the scratch
        raise ValueError(f"{splits} statistics splits: 1 to {min(MAX_STAT_SPLITS, threads)} at {threads} threads")
    sampler_kernel(threads)[(num_rows, splits), threads, stream](*bufs)


def pack_mask(allowed: np.ndarray, num_words: int) -> np.ndarray:
    """bool [vocab] -> uint32 [num_words], bit i of word i // 32 set when token i is allowed."""
    bits = np.packbits(np.asarray(allowed, bool), bitorder="little")
    out = np.zeros(num_words * 4, np.uint8)
    out[: bits.size] = bits
    return out.view(np.uint32)


def penalty_entries(spec) -> tuple[np.ndarray, np.ndarray]:
    """(unique ids, output counts) a SampleSpec's penalties touch (empty when none apply)."""
    params = spec.params
    out = np.zeros(0, np.int64) if spec.output_ids is None else np.asarray(spec.output_ids, np.int64).reshape(-1)
    prompt = np.zeros(0, np.int64) if spec.prompt_ids is None else np.asarray(spec.prompt_ids, np.int64).reshape(-1)
    use_rep = params.repetition_penalty != 1.0
    use_out = bool(params.presence_penalty or params.frequency_penalty)
    if not use_rep and not (use_out and out.size):
        return np.zeros(0, np.int32), np.zeros(0, np.int32)
    ids = np.unique(np.concatenate([prompt, out]) if use_rep else out)
    counts = np.zeros(ids.size, np.int32)
    if use_out and out.size:
        uo, co = np.unique(out, return_counts=True)
        counts[np.searchsorted(ids, uo)] = co
    return ids.astype(np.int32), counts


def ptx_cases():
    f2 = types.float32[:, ::1]
    i1, i2 = types.int32[::1], types.int32[:, ::1]
    sig = (f2, f2, f2, i2, types.uint64[:, ::1], i1, i1, types.uint32[:, ::1], i1, types.float32[::1], i2, f2,
           types.float32[:, :, :, ::1], types.uint64[::1], i1, types.uint64[:, :, ::1])  # fmt: skip
    return [("sample_rows", make_sampler(), sig)]
