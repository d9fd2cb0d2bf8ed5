"""Embedding gather: each token's row of the (stored-form) embedding, as float32."""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, types

from ninfer.gpu.cuda.intrinsics import SIMULATOR, grid_dep_launch, grid_dep_wait
from ninfer.gpu.cuda.pdl import aware

from ninfer.gpu.cuda.dequant import DQ_WORD

THREADS = 32 if SIMULATOR else 128


def make_embed(qtype: str):
    dq = DQ_WORD[qtype]

    @aware
    def embed(qs, d16, aux, sc8, tokens, out, clear):
        """out[t, :] = embed[tokens[t], :]; one block per token, one thread per 4 elements.
        Block 0 also zeroes `clear` (the step's gemv_norm sums, or a dummy)."""
        grid_dep_launch()
        grid_dep_wait()
        t = cuda.blockIdx.x
        if t == 0:
            for i in range(cuda.threadIdx.x, clear.shape[0], cuda.blockDim.x):
                clear[i] = float32(0.0)
        tok = tokens[t]
        for w in range(cuda.threadIdx.x, out.shape[1] // 4, cuda.blockDim.x):
            a, b, c, d = dq(qs, d16, aux, sc8, tok, w // 8, w % 8)
            out[t, 4 * w] = a
            out[t, 4 * w + 1] = b
            out[t, 4 * w + 2] = c
            out[t, 4 * w + 3] = d

    return embed


@functools.cache
def embed_kernel(qtype: str):
    return cuda.jit(make_embed(qtype))


def embed(w, tokens, out, num_tokens, stream=0, clear=None) -> None:
    """Launch for `num_tokens` tokens of `tokens` (int32) from DeviceWeight `w`; zeroes the
    float32 vector `clear` too (None: a one-element scratch of its own)."""
    if clear is None:
        clear = _scratch()
    embed_kernel(w.qtype)[num_tokens, THREADS, stream](*w.planes, tokens, out, clear)


@functools.cache
def _scratch():
    return cuda.device_array(1, np.float32)


def embed_ref(w_f32: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    return np.asarray(w_f32, np.float32)[np.asarray(tokens)]


def ptx_cases():
    from ninfer.gpu.cuda.device_weights import plane_types
    from ninfer.gpu.cuda.quant_layout import DEVICE_QTYPES

    sig = lambda q: (*plane_types(q), types.int32[::1], types.float32[:, ::1], types.float32[::1])  # noqa: E731
    return [(f"embed_{q}", make_embed(q), sig(q)) for q in DEVICE_QTYPES]
