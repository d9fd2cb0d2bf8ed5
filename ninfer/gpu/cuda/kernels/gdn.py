"""Gated DeltaNet (Qwen3.5's linear-attention layers): the short causal conv and the delta rule.

A GDN layer projects each token to `qkv = [q (Hk dk) | k (Hk dk) | v (Hv dv)]` (conv_dim
columns), `z` (Hv dv), `a` and `b` (Hv each). Per sequence it keeps two states, in pools of
pre-allocated slots that every kernel here indexes by a per-sequence slot id:

    conv state  [num_slots, K - 1, conv_dim]  float32   the last K - 1 inputs, oldest first
    delta state [num_slots, Hv, dk, dv]       float32   S of each value head (HF's layout)

Kernels (the numpy twin of each is the `*_ref` below it):

    conv_decode / conv_prefill   y = silu(sum_k w[k] x[t - K + 1 + k]) per channel, depthwise,
                                 the window continuing from the conv state, which ends updated
    gdn_decode / gdn_prefill     per value head h, reading k-head h % Hk (`tiled`: the engine's
                                 and llama.cpp's order, GdnSpec) or h // (Hv / Hk) (HF's
                                 repeat_interleave, `tiled=False`):
                                   q, k = l2norm(q), l2norm(k)    (x / sqrt(sum x^2 + 1e-6)),
                                   g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b),
                                   S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q / sqrt(dk)
                                 reading the raw conv output (the l2norm and the gating are
                                 done in-kernel), S updated in place in its pool slot
    gated_rmsnorm                out = rmsnorm(o per head) * w * silu(z)

The delta rule is column-separable: column j of S needs only S[:, j], k, q, v[j]. One block
owns a tile of `cols` columns of one (sequence, head) and holds it in registers: thread
(group r, column c) keeps rows r*R .. r*R + R - 1 of its column, so the state is read once
and written once per launch — the bandwidth floor of a decode step. Prefill is the same
kernel looping over the sequence's tokens with the tile still in registers (a per-token
sequential scan, not transformers' chunked UT-transform form: exact, but latency-bound at
~3 barriers a token; a tensor-core chunked version is the next step).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, types

from ninfer.gpu.cuda.kernels.intrinsics import SIMULATOR, block_sum, device, warp_sum
from ninfer.gpu.cuda.kernels.jit import compiled

L2_EPS = 1e-6  # transformers' l2norm (FLA's convention)
CONV_THREADS = 32 if SIMULATOR else 128
CONV_TILE = 4 if SIMULATOR else 16  # prefill tokens a conv thread handles (>= K - 1)
MAX_GROUPS = 8  # row groups of a GDN block at most (shared-memory sizing)


@device
def silu(x):
    return x / (float32(1.0) + math.exp(-x))


@device
def softplus(x):
    """torch's softplus (threshold 20: linear above it)."""
    return x if x > float32(20.0) else math.log1p(math.exp(x))


# -- causal conv1d ------------------------------------------------------------------------------


def make_conv_decode(kernel_size: int, threads: int):
    taps = kernel_size - 1

    def conv_decode(x, w, slots, state, out):
        """Block (row, channel tile): one thread a channel."""
        row = cuda.blockIdx.x
        c = cuda.blockIdx.y * threads + cuda.threadIdx.x
        if c >= x.shape[1]:
            return
        slot = slots[row]
        xt = x[row, c]
        acc = w[taps, c] * xt
        for k in range(taps):
            acc += w[k, c] * state[slot, k, c]
        for k in range(taps - 1):  # shift the window: this thread alone owns its channel
            state[slot, k, c] = state[slot, k + 1, c]
        state[slot, taps - 1, c] = xt
        out[row, c] = silu(acc)

    return conv_decode


@compiled
def conv_decode_kernel(kernel_size: int, threads: int = CONV_THREADS):
    return cuda.jit(make_conv_decode(kernel_size, threads))


def conv_decode(x, w, slots, state, out, num_rows, stream=0) -> None:
    """x, out: [rows, conv_dim]; w: [K, conv_dim] (HF's conv1d.weight[:, 0, :] transposed);
    slots: int32[rows], distinct; state: the conv pool [num_slots, K - 1, conv_dim], shifted in
    place. No bias (Qwen3.5's conv1d has none).
    Grid (num_rows, ceil(conv_dim / CONV_THREADS)), CONV_THREADS threads."""
    kernel = conv_decode_kernel(w.shape[0])
    kernel[(num_rows, -(-x.shape[1] // CONV_THREADS)), CONV_THREADS, stream](x, w, slots, state, out)


def make_conv_prefill(kernel_size: int, threads: int, tile: int):
    taps = kernel_size - 1
    span = taps + tile
    assert tile >= taps, "a tile past the first reads its window from x alone"

    def conv_prefill(x, w, starts, slots, fresh, state, out):
        """Block (sequence, channel tile, token tile). Only token tile 0 reads the old state,
        and each of its threads reads its channel before writing it: no block reads a state
        another block writes."""
        s = cuda.blockIdx.x
        c = cuda.blockIdx.y * threads + cuda.threadIdx.x
        start = starts[s]
        n = starts[s + 1] - start
        p0 = cuda.blockIdx.z * tile
        if c >= x.shape[1] or (p0 >= n and p0 > 0):  # tile 0 of an empty sequence still
            return  # writes its window (zeroed where fresh)
        slot = slots[s]
        is_fresh = fresh[s] != 0
        win = cuda.local.array(span, float32)  # x[p0 - taps] .. x[p0 + tile - 1]
        for k in range(taps):
            p = p0 - taps + k
            if p >= 0:
                win[k] = x[start + p, c]
            else:
                win[k] = float32(0.0) if is_fresh else state[slot, taps + p, c]
        for j in range(tile):
            win[taps + j] = x[start + p0 + j, c] if p0 + j < n else float32(0.0)
        wk = cuda.local.array(kernel_size, float32)
        for k in range(kernel_size):
            wk[k] = w[k, c]
        for j in range(tile):
            if p0 + j < n:
                acc = float32(0.0)
                for k in range(kernel_size):
                    acc += wk[k] * win[j + k]
                out[start + p0 + j, c] = silu(acc)
        if p0 == 0:  # the new window: the last taps inputs of [old state, x]
            for k in range(taps):
                p = n - taps + k  # p < 0: the old state (or zero), already in the window
                v = float32(0.0)
                for j in range(span):  # a select, not win[taps + p]: the window stays in registers
                    if j == taps + p:
                        v = win[j]
                state[slot, k, c] = x[start + p, c] if p >= tile else v

    return conv_prefill


@compiled
def conv_prefill_kernel(kernel_size: int, threads: int = CONV_THREADS, tile: int = CONV_TILE):
    return cuda.jit(make_conv_prefill(kernel_size, threads, tile))


def conv_prefill(x, w, starts, slots, fresh, state, out, num_seqs, max_tokens, stream=0) -> None:
    """x, out: [tokens, conv_dim], sequence s's tokens at rows starts[s] .. starts[s + 1] - 1;
    slots, fresh: int32[num_seqs] (fresh != 0: the window starts from zeros, the slot's old
    contents ignored); max_tokens: the longest sequence's count (sizes the grid).
    Grid (num_seqs, ceil(conv_dim / CONV_THREADS), ceil(max_tokens / CONV_TILE))."""
    kernel = conv_prefill_kernel(w.shape[0])
    grid = (num_seqs, -(-x.shape[1] // CONV_THREADS), max(1, -(-max_tokens // CONV_TILE)))
    kernel[grid, CONV_THREADS, stream](x, w, starts, slots, fresh, state, out)


def conv_ref(x, w, starts, slots, fresh, state):
    """numpy twin of both conv kernels (decode: starts = arange(rows + 1), fresh all 0):
    returns (out, new state pool) without touching the inputs."""
    x = np.asarray(x, np.float32)
    state = np.array(state, np.float32, copy=True)
    out = np.zeros_like(x)
    taps = w.shape[0] - 1
    for s, slot in enumerate(slots):
        seq = x[starts[s] : starts[s + 1]]
        old = np.zeros_like(state[slot]) if fresh[s] else state[slot]
        full = np.concatenate([old, seq], axis=0)
        for t in range(seq.shape[0]):
            acc = np.sum(full[t : t + taps + 1] * w, axis=0, dtype=np.float32)
            out[starts[s] + t] = acc / (np.float32(1.0) + np.exp(-acc))
        state[slot] = full[-taps:]
    return out, state


# -- the gated delta rule ---------------------------------------------------------------------


def plan_gdn(dk: int, dv: int) -> tuple[int, int]:
    """(cols, groups): a warp-wide column tile (coalesced 128-byte rows of S) and 4 row groups
    (32 state registers a thread at dk = 128; 128 threads, one q / k element each); smaller
    under the simulator's tiny heads. Launchers take another plan for A/B timing."""
    cols = min(32, dv)
    groups = min(4, dk)
    return cols, groups


def make_gdn(mode: str, dk: int, dv: int, cols: int, groups: int, tiled: bool = True):
    """mode "decode": block (row, head, column tile), row = the sequence's one token;
    "prefill": block (sequence, head, column tile), looping over the sequence's tokens with the
    next token's inputs loaded while this one computes (the scan is latency-bound)."""
    rows_per = dk // groups
    threads = cols * groups
    nwarps = -(-threads // 32)
    scale = float32(dk**-0.5)
    assert dk % groups == 0 and dv % cols == 0 and groups <= MAX_GROUPS
    assert threads >= dk, "one thread stages each q / k element"

    @device
    def block_sum3(x, y, z, red3, lane, warp):
        """Sums of three values over the block (every thread gets them)."""
        x = warp_sum(x)
        y = warp_sum(y)
        z = warp_sum(z)
        if lane == 0:
            red3[0, warp] = x
            red3[1, warp] = y
            red3[2, warp] = z
        cuda.syncthreads()
        x = float32(0.0)
        y = float32(0.0)
        z = float32(0.0)
        for wi in range(nwarps):
            x += red3[0, wi]
            y += red3[1, wi]
            z += red3[2, wi]
        return x, y, z

    def gdn(qkv, a, b, a_log, dt_bias, starts, slots, fresh, state, out):
        s = cuda.blockIdx.x
        h = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        c = tid % cols
        grp = tid // cols
        row0 = grp * rows_per
        col = cuda.blockIdx.z * cols + c
        num_v = a.shape[1]
        key_dim = (qkv.shape[1] - num_v * dv) // 2
        num_k = key_dim // dk
        hk = h % num_k if tiled else h // (num_v // num_k)
        qi_col = hk * dk + min(tid, dk - 1)  # threads past dk stage nothing (they load a valid
        ki_col = key_dim + qi_col  # column, and add zeros)
        v_col = 2 * key_dim + h * dv + col
        if mode == "decode":
            t0 = s
            t1 = s + 1
            is_fresh = False
        else:
            t0 = starts[s]
            t1 = starts[s + 1]
            is_fresh = fresh[s] != 0
        slot = slots[s]
        sq = cuda.shared.array(dk, float32)
        sk = cuda.shared.array(dk, float32)
        red3 = cuda.shared.array((3, 32), float32)
        part = cuda.shared.array((2, MAX_GROUPS, cols), float32)
        neg_a = -math.exp(a_log[h])
        bias = dt_bias[h]
        st = cuda.local.array(rows_per, float32)  # S[row0 + r, col]: the state tile in registers
        for r in range(rows_per):
            st[r] = float32(0.0) if is_fresh else state[slot, h, row0 + r, col]
        nq = nk = nv = na = nb = float32(0.0)
        if t0 < t1:  # this token's inputs; the loop loads the next ones before computing
            nq, nk, nv, na, nb = qkv[t0, qi_col], qkv[t0, ki_col], qkv[t0, v_col], a[t0, h], b[t0, h]
        for t in range(t0, t1):
            qi, ki, vi, ai, bi = nq, nk, nv, na, nb
            if t + 1 < t1:
                nq, nk, nv, na, nb = qkv[t + 1, qi_col], qkv[t + 1, ki_col], qkv[t + 1, v_col], a[t + 1, h], b[t + 1, h]
            if tid >= dk:
                qi = float32(0.0)
                ki = float32(0.0)
            else:
                sq[tid] = qi
                sk[tid] = ki
            # the squared norms of q and k and their dot, over the block
            qq, kk, qk = block_sum3(qi * qi, ki * ki, qi * ki, red3, tid % 32, tid // 32)
            rq = float32(1.0) / math.sqrt(qq + float32(L2_EPS))
            rk = float32(1.0) / math.sqrt(kk + float32(L2_EPS))
            decay = math.exp(neg_a * softplus(ai + bias))  # exp(g)
            beta = float32(1.0) / (float32(1.0) + math.exp(-bi))
            # S^T k and S^T q over this thread's rows, then over the row groups
            acc_k = float32(0.0)
            acc_q = float32(0.0)
            for r in range(rows_per):
                acc_k += st[r] * sk[row0 + r]
                acc_q += st[r] * sq[row0 + r]
            part[0, grp, c] = acc_k
            part[1, grp, c] = acc_q
            cuda.syncthreads()
            acc_k = float32(0.0)
            acc_q = float32(0.0)
            for gi in range(groups):
                acc_k += part[0, gi, c]
                acc_q += part[1, gi, c]
            # the delta rule on the decayed state: write the part of v that S does not predict
            delta = beta * (vi - decay * acc_k * rk)
            for r in range(rows_per):
                st[r] = decay * st[r] + (sk[row0 + r] * rk) * delta
            if grp == 0:  # o = S_new^T q = decay S^T q + delta (k . q), q scaled by 1/sqrt(dk)
                out[t, h * dv + col] = scale * rq * (decay * acc_q + delta * qk * rk)
            cuda.syncthreads()  # sq, sk, part and red3 are rewritten by the next token
        for r in range(rows_per):
            state[slot, h, row0 + r, col] = st[r]

    gdn.__name__ = gdn.__qualname__ = f"gdn_{mode}"  # the name profiles and PTX reports show
    return gdn


@compiled
def gdn_kernel(mode: str, dk: int, dv: int, cols: int, groups: int, tiled: bool = True):
    return cuda.jit(make_gdn(mode, dk, dv, cols, groups, tiled))


def _launch_gdn(mode, num_blocks, args, state, plan, tiled, stream):
    num_v, dk, dv = state.shape[1:]
    cols, groups = plan or plan_gdn(dk, dv)
    kernel = gdn_kernel(mode, dk, dv, cols, groups, tiled)
    kernel[(num_blocks, num_v, dv // cols), cols * groups, stream](*args)


def gdn_decode(qkv, a, b, a_log, dt_bias, slots, state, out, num_rows, plan=None, tiled=True, stream=0) -> None:
    """One token per row: qkv [rows, conv_dim] (the conv output: raw q, k, v), a, b [rows, Hv]
    (raw projections), a_log, dt_bias [Hv], slots int32[rows], state the pool [num_slots, Hv,
    dk, dv] (updated in place), out [rows, Hv dv]. Grid (num_rows, Hv, dv / cols), cols *
    groups threads (plan_gdn)."""
    args = (qkv, a, b, a_log, dt_bias, slots, slots, slots, state, out)  # starts / fresh unused
    _launch_gdn("decode", num_rows, args, state, plan, tiled, stream)


def gdn_prefill(qkv, a, b, a_log, dt_bias, starts, slots, fresh, state, out, num_seqs, plan=None, tiled=True,
                stream=0) -> None:  # fmt: skip
    """Sequences' tokens packed as in conv_prefill (starts int32[num_seqs + 1]); fresh != 0
    starts a sequence from S = 0. Grid (num_seqs, Hv, dv / cols): a block scans its sequence."""
    args = (qkv, a, b, a_log, dt_bias, starts, slots, fresh, state, out)
    _launch_gdn("prefill", num_seqs, args, state, plan, tiled, stream)


def gating_ref(a, b, a_log, dt_bias):
    """(g, beta) of transformers' Qwen3_5GatedDeltaNet, float32."""
    x = np.asarray(a, np.float32) + dt_bias
    with np.errstate(over="ignore"):
        sp = np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20)))).astype(np.float32)
        beta = (1.0 / (1.0 + np.exp(-np.asarray(b, np.float32)))).astype(np.float32)
    return (-np.exp(np.asarray(a_log, np.float32)) * sp).astype(np.float32), beta


def split_qkv(qkv, num_v, dk, dv, tiled=True):
    """q, k [tokens, Hv, dk] (each value head's k-head, l2-normalised) and v [tokens, Hv, dv]."""
    qkv = np.asarray(qkv, np.float32)
    key_dim = (qkv.shape[1] - num_v * dv) // 2
    num_k = key_dim // dk
    q = qkv[:, :key_dim].reshape(-1, num_k, dk)
    k = qkv[:, key_dim : 2 * key_dim].reshape(-1, num_k, dk)
    v = qkv[:, 2 * key_dim :].reshape(-1, num_v, dv)
    l2 = lambda x: x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + np.float32(L2_EPS))  # noqa: E731
    heads = np.arange(num_v) % num_k if tiled else np.arange(num_v) // (num_v // num_k)
    return l2(q)[:, heads], l2(k)[:, heads], v


def gdn_ref(qkv, a, b, a_log, dt_bias, starts, slots, fresh, state, tiled=True):
    """numpy twin of gdn_decode / gdn_prefill (decode: starts = arange(rows + 1), fresh 0):
    the recurrent form token by token; returns (out [tokens, Hv dv], new state pool)."""
    state = np.array(state, np.float32, copy=True)
    num_v, dk, dv = state.shape[1:]
    q, k, v = split_qkv(qkv, num_v, dk, dv, tiled)
    q = q * np.float32(dk**-0.5)
    g, beta = gating_ref(a, b, a_log, dt_bias)
    out = np.zeros((q.shape[0], num_v, dv), np.float32)
    for s, slot in enumerate(slots):
        S = np.zeros_like(state[slot]) if fresh[s] else state[slot]
        for t in range(starts[s], starts[s + 1]):
            S = S * np.exp(g[t])[:, None, None]
            kv_mem = np.einsum("hij,hi->hj", S, k[t])
            delta = (v[t] - kv_mem) * beta[t][:, None]
            S = S + k[t][:, :, None] * delta[:, None, :]
            out[t] = np.einsum("hij,hi->hj", S, q[t])
        state[slot] = S
    return out.reshape(q.shape[0], num_v * dv), state


# -- the gated RMSNorm on the output --------------------------------------------------------------


def make_gated_rmsnorm(dv: int, threads: int):
    per = -(-dv // threads)

    def gated_rmsnorm(o, z, w, eps, out):
        """Block (token, head): out = o * rsqrt(mean(o^2) + eps) * w * silu(z) over the head."""
        t = cuda.blockIdx.x
        base = cuda.blockIdx.y * dv
        tid = cuda.threadIdx.x
        scratch = cuda.shared.array(33, float32)
        vals = cuda.local.array(per, float32)
        ss = float32(0.0)
        for r in range(per):
            j = tid + r * threads
            vals[r] = o[t, base + j] if j < dv else float32(0.0)
            ss += vals[r] * vals[r]
        inv = float32(1.0) / math.sqrt(block_sum(ss, scratch) / float32(dv) + eps)
        for r in range(per):
            j = tid + r * threads
            if j < dv:
                out[t, base + j] = vals[r] * inv * w[j] * silu(z[t, base + j])

    return gated_rmsnorm


@compiled
def gated_rmsnorm_kernel(dv: int, threads: int):
    return cuda.jit(make_gated_rmsnorm(dv, threads))


def gated_rmsnorm(o, z, w, eps, out, num_tokens, stream=0) -> None:
    """o, z, out [tokens, Hv dv]; w [dv] (one weight for every head). Grid (num_tokens, Hv)."""
    dv = w.shape[0]
    threads = -(-min(dv, 32 if SIMULATOR else 128) // 32) * 32
    gated_rmsnorm_kernel(dv, threads)[(num_tokens, o.shape[1] // dv), threads, stream](o, z, w, np.float32(eps), out)


def gated_rmsnorm_ref(o, z, w, eps):
    dv = w.shape[0]
    o = np.asarray(o, np.float32).reshape(o.shape[0], -1, dv)
    z = np.asarray(z, np.float32).reshape(o.shape)
    y = o / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + np.float32(eps)) * w
    return (y * (z / (1.0 + np.exp(-z)))).astype(np.float32).reshape(o.shape[0], -1)


def ptx_cases():
    f1, f2, i1 = types.float32[::1], types.float32[:, ::1], types.int32[::1]
    f3, f4 = types.float32[:, :, ::1], types.float32[:, :, :, ::1]
    gdn_sig = (f2, f2, f2, f1, f1, i1, i1, i1, f4, f2)
    cols, groups = plan_gdn(128, 128)
    return [
        ("gdn_conv_decode", make_conv_decode(4, 128), (f2, f2, i1, f3, f2)),
        ("gdn_conv_prefill", make_conv_prefill(4, 128, 16), (f2, f2, i1, i1, i1, f3, f2)),
        ("gdn_decode", make_gdn("decode", 128, 128, cols, groups), gdn_sig),
        ("gdn_prefill", make_gdn("prefill", 128, 128, cols, groups), gdn_sig),
        ("gdn_decode_grouped", make_gdn("decode", 128, 128, cols, groups, tiled=False), gdn_sig),
        ("gdn_gated_rmsnorm", make_gated_rmsnorm(128, 128), (f2, f2, f1, types.float32, f2)),
    ]
