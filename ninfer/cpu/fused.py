"""The small steps between the products, fused into one numba call each.

A SmolLM2 decode step is ~30 layers x a dozen numpy ops between the products; at a few
microseconds per op that is milliseconds a token, as much as the products themselves. These
kernels do the same math as the reference forward's numpy (`ninfer.gpu.reference`: rms_norm,
apply_rope, the KV write, silu, the residual adds) in one pass each, and quantize the result
for the next product when it asks for it (`xq` with rows; with none, as for a prefill that
goes to BLAS, the float result is all). Their numpy twins are the reference runner's
functions; the tests compare the two runners.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ninfer.cpu.gemm import quantize_rows


@njit(cache=True, fastmath=True)
def _rms_into(x, weight, eps, h):
    for t in range(x.shape[0]):
        total = np.float32(0.0)
        for j in range(x.shape[1]):
            total += x[t, j] * x[t, j]
        inv = np.float32(1.0) / np.sqrt(total / np.float32(x.shape[1]) + eps)
        for j in range(x.shape[1]):
            h[t, j] = x[t, j] * inv * weight[j]


@njit(cache=True)
def add_norm_quant(x, add, weight, eps, new_x, h, xq, xd, xs):
    """new_x = x + add (when add has rows; else new_x is x), h = rms_norm(new_x) * weight, and
    h's q8 codes into xq / xd / xs when xq has rows."""
    if add.shape[0]:
        for t in range(x.shape[0]):
            for j in range(x.shape[1]):
                new_x[t, j] = x[t, j] + add[t, j]
        _rms_into(new_x, weight, eps, h)
    else:
        _rms_into(x, weight, eps, h)
    if xq.shape[0]:
        quantize_rows(h, xq, xd, xs)


@njit(cache=True, fastmath=True)
def rope_store(qkv, q_rows, kv_dim, num_heads, num_kv_heads, head_dim, cos, sin, k_pool, v_pool,
               pages, slots, q):  # fmt: skip
    """Split-half RoPE of q (qkv[:, :q_rows] as [T, heads, head_dim]) into q, and of k (the
    next kv_dim columns) into k_pool[pages[t], slots[t]]; v (the kv_dim after) copied into
    v_pool alike. cos / sin [T, rotary half]: dims past 2 * half pass unrotated."""
    half = cos.shape[1]
    for t in range(qkv.shape[0]):
        c, s = cos[t], sin[t]
        for h in range(num_heads):
            at = h * head_dim
            for i in range(half):
                a, b = qkv[t, at + i], qkv[t, at + half + i]
                q[t, h, i] = a * c[i] - b * s[i]
                q[t, h, half + i] = b * c[i] + a * s[i]
            for i in range(2 * half, head_dim):
                q[t, h, i] = qkv[t, at + i]
        page, slot = pages[t], slots[t]
        for h in range(num_kv_heads):
            at = q_rows + h * head_dim
            key = k_pool[page, slot, h]
            for i in range(half):
                a, b = qkv[t, at + i], qkv[t, at + half + i]
                key[i] = a * c[i] - b * s[i]
                key[half + i] = b * c[i] + a * s[i]
            for i in range(2 * half, head_dim):
                key[i] = qkv[t, at + i]
            value = v_pool[page, slot, h]
            for i in range(head_dim):
                value[i] = qkv[t, at + kv_dim + i]


@njit(cache=True)  # no fastmath: exp(-g) may overflow to inf (silu -> -0)
def swiglu_quant(gate_up, d_ffn, act, xq, xd, xs):
    """act = silu(gate) * up (gate_up = [gate | up]), and its q8 codes when xq has rows."""
    for t in range(gate_up.shape[0]):
        for j in range(d_ffn):
            g = gate_up[t, j]
            act[t, j] = g / (np.float32(1.0) + np.exp(-g)) * gate_up[t, d_ffn + j]
    if xq.shape[0]:
        quantize_rows(act, xq, xd, xs)
