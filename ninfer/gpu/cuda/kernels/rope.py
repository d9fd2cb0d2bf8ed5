"""After the fused QKV projection: bias, qwen3 q/k RMSNorm, RoPE, and the paged K/V write.

One block per (token, head) over the q, k and v heads (in that order, as the QKV columns are
laid out), one thread per rotated pair. Split-half layout pairs element i with i + hd / 2
(Hugging Face `rotate_half`, the canonical weights); the interleaved layout pairs 2i with
2i + 1 (raw llama GGUF rows). Both rotate `(a, b) -> (a cos - b sin, b cos + a sin)` with the
angle table of `ninfer.gpu.reference.rope_angles`. K and V go to
`cache[tok_page[t], tok_slot[t], kv_head, :]` (float16 or float32 caches).

One-token q8 steps of models without q/k norm do this in the QKV GEMV's epilogue instead
(gemv_folds.gemv_rope, with the @device helpers below).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, types

from ninfer.gpu.cuda.kernels.intrinsics import block_sum, device, grid_dep_launch, grid_dep_wait
from ninfer.gpu.cuda.kernels.jit import compiled
from ninfer.gpu.cuda.kernels.pdl import aware

# -- the per-pair math, shared with gemv_folds.gemv_rope ------------------------------------------


@device
def pair_elems(i, half, interleaved):
    """The two elements of a head that rotated pair i holds."""
    if interleaved:
        return 2 * i, 2 * i + 1
    return i, i + half


@device
def load_pair(qkv, bias, t, col0, ea, eb, has_bias):
    """Elements ea, eb of the head at column col0 of token t's QKV row, bias added."""
    xa = qkv[t, col0 + ea]
    xb = qkv[t, col0 + eb]
    if has_bias:
        xa += bias[col0 + ea]
        xb += bias[col0 + eb]
    return xa, xb


@device
def rms_inv(ss, head_dim, eps):
    """1 / RMS of a head from its sum of squares."""
    return float32(1.0) / math.sqrt(ss / float32(head_dim) + eps)


@device
def norm_weights(wn, ea, eb, has_qk_norm):
    """The RMSNorm weights of elements ea, eb (1 without the norm: wn is then a dummy)."""
    if has_qk_norm:
        return wn[ea], wn[eb]
    return float32(1.0), float32(1.0)


@device
def norm_rotate(xa, xb, r, wa, wb, c, s):
    """A q or k pair RMSNorm'd (1 / RMS r, weights wa, wb; all 1 without the norm, exact) and
    rotated by the angle of cosine c, sine s."""
    xa = xa * r * wa
    xb = xb * r * wb
    return xa * c - xb * s, xb * c + xa * s


@device
def store_pair(cache, page, slot, kvh, ea, eb, a, b):
    cache[page, slot, kvh, ea] = a
    cache[page, slot, kvh, eb] = b


def make_qkv_post(head_dim: int, interleaved: bool = False):
    half = head_dim // 2

    @aware
    def qkv_post(qkv, bias, q_norm, k_norm, cos, sin, tok_pos, tok_page, tok_slot, q_out, k_cache, v_cache,
                 eps, num_heads, num_kv_heads, has_bias, has_qk_norm):  # fmt: skip
        grid_dep_launch()
        t = cuda.blockIdx.x
        j = cuda.blockIdx.y
        i = cuda.threadIdx.x
        col0 = j * head_dim
        ea, eb = pair_elems(i, half, interleaved)
        # step inputs, norm weights and RoPE tables (no kernel writes them): before the PDL wait
        page = tok_page[t]
        slot = tok_slot[t]
        pos = tok_pos[t]
        wa, wb = norm_weights(q_norm if j < num_heads else k_norm, ea, eb, has_qk_norm)
        c = cos[pos, i]
        sn = sin[pos, i]
        grid_dep_wait()
        scratch = cuda.shared.array(33, float32)
        xa, xb = load_pair(qkv, bias, t, col0, ea, eb, has_bias)
        if j >= num_heads + num_kv_heads:  # a V head: stored as is
            store_pair(v_cache, page, slot, j - num_heads - num_kv_heads, ea, eb, xa, xb)
            return
        r = float32(1.0)
        if has_qk_norm:
            r = rms_inv(block_sum(xa * xa + xb * xb, scratch), head_dim, eps)
        ra, rb = norm_rotate(xa, xb, r, wa, wb, c, sn)
        if j < num_heads:
            q_out[t, col0 + ea] = ra
            q_out[t, col0 + eb] = rb
        else:
            store_pair(k_cache, page, slot, j - num_heads, ea, eb, ra, rb)

    return qkv_post


@compiled
def qkv_post_kernel(head_dim: int, interleaved: bool = False):
    return cuda.jit(make_qkv_post(head_dim, interleaved))


def qkv_post(spec, qkv, bias, q_norm, k_norm, cos, sin, tok_pos, tok_page, tok_slot, q_out, k_cache, v_cache,
             num_tokens, has_bias, has_qk_norm, stream=0, interleaved=False) -> None:  # fmt: skip
    """Launch over `num_tokens` tokens; absent bias / norms are any float32 arrays + False."""
    grid = (num_tokens, spec.num_heads + 2 * spec.num_kv_heads)
    qkv_post_kernel(spec.head_dim, interleaved)[grid, spec.head_dim // 2, stream](
        qkv, bias, q_norm, k_norm, cos, sin, tok_pos, tok_page, tok_slot, q_out, k_cache, v_cache,
        np.float32(spec.rms_eps), spec.num_heads, spec.num_kv_heads, has_bias, has_qk_norm,
    )  # fmt: skip


def qkv_post_ref(spec, qkv, bias, q_norm, k_norm, cos, sin, tok_pos, interleaved=False):
    """numpy twin: (q [T, q_dim], k [T, kv_heads, hd], v [T, kv_heads, hd]) before the write."""
    from ninfer.gpu.reference import rms_norm

    t = qkv.shape[0]
    x = np.array(qkv, np.float32, copy=True)
    if bias is not None:
        x += bias
    hd = spec.head_dim
    q = x[:, : spec.q_dim].reshape(t, spec.num_heads, hd)
    k = x[:, spec.q_dim : spec.q_dim + spec.kv_dim].reshape(t, spec.num_kv_heads, hd)
    v = x[:, spec.q_dim + spec.kv_dim :].reshape(t, spec.num_kv_heads, hd)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, spec.rms_eps), rms_norm(k, k_norm, spec.rms_eps)
    c, s = cos[tok_pos][:, None, :], sin[tok_pos][:, None, :]
    q, k = _rotate(q, c, s, interleaved), _rotate(k, c, s, interleaved)
    return q.reshape(t, spec.q_dim), k, v


def _rotate(x, c, s, interleaved):
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * c - b * s, b * c + a * s
        return out
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def ptx_cases():
    f1, f2 = types.float32[::1], types.float32[:, ::1]
    i1 = types.int32[::1]
    cases = []
    for kv_t in (types.float16, types.float32):
        cache = types.Array(kv_t, 4, "C")
        sig = (f2, f1, f1, f1, f2, f2, i1, i1, i1, f2, cache, cache, types.float32, types.int32, types.int32,
               types.boolean, types.boolean)  # fmt: skip
        for hd, inter in ((64, False), (128, False), (128, True)):
            name = f"qkv_post_hd{hd}_{'inter' if inter else 'half'}_{kv_t}"
            cases.append((name, make_qkv_post(hd, inter), sig))
    return cases
