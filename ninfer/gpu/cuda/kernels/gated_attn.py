"""Qwen3.5's gated full-attention layers and padded vocabularies: the kernels around attention.

    gated_qkv_post   after the QKV projection of a gated layer, whose q rows hold per head
                     head_dim query dims then head_dim gate dims: the gate out as is, q and k
                     RMSNorm'd per head and rotated over their first `rotary_dim` dims only
                     (split-half within those: element i pairs with i + rotary_dim / 2), K and V
                     written to `cache[tok_page[t], tok_slot[t], kv_head, :]`
    sigmoid_gate     attn[t, :] *= sigmoid(gate[t, :]) before the output projection
    mask_logits      logits[r, num_ids:] = -inf: the head's padding rows past the tokenizer's
                     ids are never sampled nor counted in log-probabilities

One block per (token, head) with one thread per element of the head in gated_qkv_post (the
rotation pairs elements that a split-half thread layout would give to different threads when
only part of the head rotates).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, types

from ninfer.gpu.cuda.kernels.intrinsics import SIMULATOR, block_sum
from ninfer.gpu.cuda.kernels.jit import compiled

THREADS = 32 if SIMULATOR else 128  # elementwise kernels (the simulator runs a thread per thread)


def make_gated_qkv_post(head_dim: int, rotary_dim: int):
    half = rotary_dim // 2

    def gated_qkv_post(qkv, q_norm, k_norm, cos, sin, tok_pos, tok_page, tok_slot, q_out, gate_out, k_cache, v_cache,
                       eps, num_heads, num_kv_heads, has_qk_norm):  # fmt: skip
        t = cuda.blockIdx.x
        j = cuda.blockIdx.y
        e = cuda.threadIdx.x
        scratch = cuda.shared.array(33, float32)
        head = cuda.shared.array(head_dim, float32)
        q_rows = 2 * num_heads * head_dim  # q and gate, interleaved per head
        kv_dim = num_kv_heads * head_dim
        page = tok_page[t]
        slot = tok_slot[t]
        if j >= num_heads + num_kv_heads:  # a V head: stored as is (the whole block returns)
            kvh = j - num_heads - num_kv_heads
            v_cache[page, slot, kvh, e] = qkv[t, q_rows + kv_dim + kvh * head_dim + e]
            return
        if j < num_heads:
            x = qkv[t, j * 2 * head_dim + e]
            gate_out[t, j * head_dim + e] = qkv[t, j * 2 * head_dim + head_dim + e]
        else:
            x = qkv[t, q_rows + (j - num_heads) * head_dim + e]
        if has_qk_norm:
            r = float32(1.0) / math.sqrt(block_sum(x * x, scratch) / float32(head_dim) + eps)
            x = x * r * (q_norm[e] if j < num_heads else k_norm[e])
        head[e] = x
        cuda.syncthreads()
        pos = tok_pos[t]
        y = x
        if e < half:
            y = x * cos[pos, e] - head[e + half] * sin[pos, e]
        elif e < 2 * half:
            y = x * cos[pos, e - half] + head[e - half] * sin[pos, e - half]
        if j < num_heads:
            q_out[t, j * head_dim + e] = y
        else:
            k_cache[page, slot, j - num_heads, e] = y

    return gated_qkv_post


@compiled
def gated_qkv_post_kernel(head_dim: int, rotary_dim: int):
    return cuda.jit(make_gated_qkv_post(head_dim, rotary_dim))


def gated_qkv_post(spec, qkv, q_norm, k_norm, cos, sin, tok_pos, tok_page, tok_slot, q_out, gate_out, k_cache, v_cache,
                   num_tokens, has_qk_norm, stream=0) -> None:  # fmt: skip
    """qkv [T, 2 q_dim + 2 kv_dim]; q_out, gate_out [T, q_dim]; cos, sin [positions,
    rotary_dim / 2]; absent norms: any float32 array and has_qk_norm False.
    Grid (num_tokens, heads + 2 kv_heads), head_dim threads."""
    grid = (num_tokens, spec.num_heads + 2 * spec.num_kv_heads)
    gated_qkv_post_kernel(spec.head_dim, spec.rotary_dim)[grid, spec.head_dim, stream](
        qkv, q_norm, k_norm, cos, sin, tok_pos, tok_page, tok_slot, q_out, gate_out, k_cache, v_cache,
        np.float32(spec.rms_eps), spec.num_heads, spec.num_kv_heads, has_qk_norm,
    )  # fmt: skip


def gated_qkv_post_ref(spec, qkv, q_norm, k_norm, cos, sin, tok_pos):
    """numpy twin: (q [T, q_dim], gate [T, q_dim], k [T, kv_heads, hd], v [T, kv_heads, hd])."""
    from ninfer.gpu.reference import apply_rope, rms_norm

    t, hd = qkv.shape[0], spec.head_dim
    x = np.asarray(qkv, np.float32)
    qg = x[:, : 2 * spec.q_dim].reshape(t, spec.num_heads, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(t, spec.q_dim)
    k = x[:, 2 * spec.q_dim : 2 * spec.q_dim + spec.kv_dim].reshape(t, spec.num_kv_heads, hd)
    v = x[:, 2 * spec.q_dim + spec.kv_dim :].reshape(t, spec.num_kv_heads, hd)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, spec.rms_eps), rms_norm(k, k_norm, spec.rms_eps)
    c, s = cos[tok_pos][:, None, :], sin[tok_pos][:, None, :]
    return apply_rope(q, c, s).reshape(t, spec.q_dim), gate, apply_rope(k, c, s), v


def _sigmoid_gate(x, gate, width):
    t = cuda.blockIdx.x
    c = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if c < width:
        x[t, c] = x[t, c] / (float32(1.0) + math.exp(-gate[t, c]))


@compiled
def sigmoid_gate_kernel():
    return cuda.jit(_sigmoid_gate)


def sigmoid_gate(x, gate, width, num_tokens, stream=0) -> None:
    """x[:num_tokens, :width] *= sigmoid(gate[:num_tokens, :width]), in place."""
    sigmoid_gate_kernel()[(num_tokens, -(-width // THREADS)), THREADS, stream](x, gate, width)


def _mask_logits(logits, num_ids):
    r = cuda.blockIdx.x
    c = num_ids + cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if c < logits.shape[1]:
        logits[r, c] = float32(-math.inf)


@compiled
def mask_logits_kernel():
    return cuda.jit(_mask_logits)


def mask_logits(logits, num_ids, num_rows, stream=0) -> None:
    """logits[:num_rows, num_ids:] = -inf (no launch when no column is padding)."""
    pad = logits.shape[1] - num_ids
    if pad > 0 and num_rows > 0:
        mask_logits_kernel()[(num_rows, -(-pad // THREADS)), THREADS, stream](logits, num_ids)


def ptx_cases():
    f1, f2, i1 = types.float32[::1], types.float32[:, ::1], types.int32[::1]
    cases = [("sigmoid_gate", _sigmoid_gate, (f2, f2, types.int32)), ("mask_logits", _mask_logits, (f2, types.int32))]
    for kv_t in (types.float16, types.float32):
        cache = types.Array(kv_t, 4, "C")
        sig = (f2, f1, f1, f2, f2, i1, i1, i1, f2, f2, cache, cache, types.float32, types.int32, types.int32,
               types.boolean)  # fmt: skip
        cases.append((f"gated_qkv_post_hd256_rot64_{kv_t}", make_gated_qkv_post(256, 64), sig))
    return cases
