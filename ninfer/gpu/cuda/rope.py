"""After the fused QKV projection: bias, qwen3 q/k RMSNorm, RoPE, and the paged K/V write.

One block per (token, head) over the q, k and v heads (in that order, as the QKV columns are
laid out), one thread per rotated pair. Split-half layout pairs element i with i + hd / 2
(Hugging Face `rotate_half`, the canonical weights); the interleaved layout pairs 2i with
2i + 1 (raw llama GGUF rows). Both rotate `(a, b) -> (a cos - b sin, b cos + a sin)` with the
angle table of `ninfer.gpu.reference.rope_angles`. K and V go to
`cache[tok_page[t], tok_slot[t], kv_head, :]` (float16 or float32 caches).

Decode steps may skip this kernel: the decode-attention kernels do the same per-pair math
(the @device helpers below) for their row's token when given a `DecodePost` (attention.py).
"""

from __future__ import annotations

import functools
import math

import attrs
import numpy as np
from numba import cuda, float32, types

from ninfer.gpu.cuda.intrinsics import block_sum, device, grid_dep_launch, grid_dep_wait, warp_sum
from ninfer.gpu.cuda.pdl import aware

# -- the per-pair math, shared with the decode-attention kernels that fold this step in ----------


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


@functools.cache
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


# -- folded into the decode attention -----------------------------------------------------------
#
# In a decode step every row has one token and token t is row t (staging._stage_single_tokens;
# graph buckets pad with one dummy token per dummy row), so the decode-attention block of
# (row b, KV head) can do this step itself for token b: the q heads of its group into shared
# memory, and the KV head's k and v into the pool, before its barrier and attention loop.


@attrs.frozen(kw_only=True)
class DecodePost:
    """`qkv_post`'s inputs, for `attention.attn_decode(_one)(..., post=)`. Absent bias / norms:
    any float32 1-D array with has_bias / has_qk_norm False."""

    qkv: object  # [T, q_dim + 2 kv_dim] float32, the QKV projection
    bias: object
    q_norm: object
    k_norm: object
    cos: object  # [max_context, head_dim / 2]
    sin: object
    tok_pos: object  # int32 per token
    tok_page: object
    tok_slot: object
    eps: float
    has_bias: bool
    has_qk_norm: bool
    interleaved: bool = False

    def kernel_args(self) -> tuple:
        """The decode kernels' `post_args` tuple (qkv goes in q's place)."""
        return (self.bias, self.q_norm, self.k_norm, self.cos, self.sin, self.tok_pos, self.tok_page, self.tok_slot,
                np.float32(self.eps), self.has_bias, self.has_qk_norm)  # fmt: skip


def post_arg_types():
    """numba types of `DecodePost.kernel_args()` (for compile_ptx signatures)."""
    f1, f2, i1 = types.float32[::1], types.float32[:, ::1], types.int32[::1]
    return types.Tuple((f1, f1, f1, f2, f2, i1, i1, i1, types.float32, types.boolean, types.boolean))


@functools.cache
def decode_post_fn(head_dim: int, group: int, warps: int, interleaved: bool):
    """Device function: the post-processing of row b's token for KV head kvh by a block of
    `warps` warps, one warp per head (the group's q heads into qs [group * head_dim], then with
    `write_kv` the k and v heads into the pools), lanes over the rotated pairs, the q / k
    RMSNorm a warp sum. Called by the whole block (exactly `warps` warps) from uniform control
    flow; the caller syncs the block before reading qs or the pool."""
    half = head_dim // 2
    ppl = -(-half // 32)  # pairs per lane
    rounds = -(-(group + 2) // warps)  # heads per warp, at most

    def decode_post(qkv, post, b, kvh, write_kv, qs, k_cache, v_cache):
        bias, q_norm, k_norm, cos, sin, tok_pos, tok_page, tok_slot, eps, has_bias, has_qk_norm = post
        lane = cuda.threadIdx.x % 32
        kv_dim = k_cache.shape[2] * head_dim
        pos = tok_pos[b]
        page = tok_page[b]
        slot = tok_slot[b]
        # every load of a head before its reduction: one round trip, not one per dependent step
        xa = cuda.local.array(ppl, float32)
        xb = cuda.local.array(ppl, float32)
        wa = cuda.local.array(ppl, float32)
        wb = cuda.local.array(ppl, float32)
        ca = cuda.local.array(ppl, float32)
        sa = cuda.local.array(ppl, float32)
        for rnd in range(rounds):
            j = rnd * warps + cuda.threadIdx.x // 32
            # j < group: the group's q heads; j = group: the k head, group + 1: the v head, at
            # columns q_dim (= group * kv_dim) and q_dim + kv_dim onwards
            if j >= (group + 2 if write_kv else group):  # uniform over the warp
                continue
            col0 = (kvh * group + j) * head_dim if j < group else j * kv_dim + kvh * head_dim
            rot = j <= group  # q and k are normed and rotated; v is stored as is
            ss = float32(0.0)
            for u in range(ppl):
                i = lane + 32 * u
                xa[u], xb[u], ca[u], sa[u] = float32(0.0), float32(0.0), float32(1.0), float32(0.0)
                wa[u], wb[u] = float32(1.0), float32(1.0)
                if i < half:  # head_dim < 64: lanes past the pairs idle
                    ea, eb = pair_elems(i, half, interleaved)
                    xa[u], xb[u] = load_pair(qkv, bias, b, col0, ea, eb, has_bias)
                    if rot:
                        ca[u], sa[u] = cos[pos, i], sin[pos, i]
                        wa[u], wb[u] = norm_weights(q_norm if j < group else k_norm, ea, eb, has_qk_norm)
                ss += xa[u] * xa[u] + xb[u] * xb[u]
            r = float32(1.0)
            if has_qk_norm and rot:  # uniform over the warp
                r = rms_inv(warp_sum(ss), head_dim, eps)
            for u in range(ppl):
                i = lane + 32 * u
                if i < half:
                    ea, eb = pair_elems(i, half, interleaved)
                    if not rot:
                        store_pair(v_cache, page, slot, kvh, ea, eb, xa[u], xb[u])
                        continue
                    ra, rb = norm_rotate(xa[u], xb[u], r, wa[u], wb[u], ca[u], sa[u])
                    if j < group:
                        qs[j * head_dim + ea] = ra
                        qs[j * head_dim + eb] = rb
                    else:
                        store_pair(k_cache, page, slot, kvh, ea, eb, ra, rb)

    # cuda.jit, not `device`: under the simulator only a jitted function sees the block's threadIdx
    return cuda.jit(device=True)(decode_post)


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
