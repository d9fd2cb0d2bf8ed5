"""Embedding gather: each token's row of the (stored-form) embedding, as float32."""

from __future__ import annotations

import numpy as np
from numba import cuda, types

from ninfer.gpu.cuda.kernels.intrinsics import SIMULATOR, grid_dep_launch, grid_dep_wait
from ninfer.gpu.cuda.kernels.dequant import DQ_WORD
from ninfer.gpu.cuda.kernels.jit import compiled
from ninfer.gpu.cuda.kernels.pdl import aware

THREADS = 32 if SIMULATOR else 128


def make_embed(qtype: str):
    dq = DQ_WORD[qtype]

    @aware
    def embed(qs, d16, aux, sc8, tokens, out):
        """out[t, :] = embed[tokens[t], :]; one block per token, one thread per 4 elements."""
        grid_dep_launch()
        grid_dep_wait()
        t = cuda.blockIdx.x
        tok = tokens[t]
        for w in range(cuda.threadIdx.x, out.shape[1] // 4, cuda.blockDim.x):
            a, b, c, d = dq(qs, d16, aux, sc8, tok, w // 8, w % 8)
            out[t, 4 * w] = a
            out[t, 4 * w + 1] = b
            out[t, 4 * w + 2] = c
            out[t, 4 * w + 3] = d

    return embed


@compiled
def embed_kernel(qtype: str):
    return cuda.jit(make_embed(qtype))


def embed(w, tokens, out, num_tokens, stream=0) -> None:
    """Launch for `num_tokens` tokens of `tokens` (int32) from DeviceWeight `w`."""
    embed_kernel(w.qtype)[num_tokens, THREADS, stream](*w.planes, tokens, out)


def embed_ref(w_f32: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    return np.asarray(w_f32, np.float32)[np.asarray(tokens)]


def ptx_cases():
    from ninfer.gpu.cuda.device_weights import plane_types
    from ninfer.gpu.cuda.kernels.quant_layout import DEVICE_QTYPES

    sig = lambda q: (*plane_types(q), types.int32[::1], types.float32[:, ::1])  # noqa: E731
    return [(f"embed_{q}", make_embed(q), sig(q)) for q in DEVICE_QTYPES]
