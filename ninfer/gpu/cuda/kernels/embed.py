"""Embedding gather: each token's row of the (stored-form) embedding, as float32."""

from __future__ import annotations

import numpy as np
from numba import cuda, types

from ninfer.gpu.cuda.kernels.intrinsics import SIMULATOR, grid_dep_launch, grid_dep_wait
from ninfer.gpu.cuda.kernels.dequant import DQ_WORD
from ninfer.gpu.cuda.kernels.jit import compiled
from ninfer.gpu.cuda.kernels.pdl import aware

THREADS = 32 if SIMULATOR else 128
# A token id that says "the id is fed[t]": where a step's tokens are the step before's samples,
# still on the device. Fed and host-given tokens thus run the same kernels, and one captured
# graph serves both kinds of step.
FED = -1


def make_embed(qtype: str):
    dq = DQ_WORD[qtype]

    @aware
    def embed(qs, d16, aux, sc8, tokens, fed, out):
        """out[t, :] = embed[tokens[t], :], or embed[fed[t], :] where tokens[t] < 0 (FED); one
        block per token, one thread per 4 elements."""
        grid_dep_launch()
        grid_dep_wait()
        t = cuda.blockIdx.x
        tok = tokens[t]
        if tok < 0:
            tok = fed[t]
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


def embed(w, tokens, fed, out, num_tokens, stream=0) -> None:
    """Launch for `num_tokens` tokens of `tokens` (int32; FED: token t is fed[t]) from DeviceWeight `w`."""
    embed_kernel(w.qtype)[num_tokens, THREADS, stream](*w.planes, tokens, fed, out)


def embed_ref(w_f32: np.ndarray, tokens: np.ndarray, fed: np.ndarray | None = None) -> np.ndarray:
    tokens = np.asarray(tokens)
    if fed is not None:
        tokens = np.where(tokens == FED, np.asarray(fed)[: tokens.size], tokens)
    return np.asarray(w_f32, np.float32)[tokens]


def ptx_cases():
    from ninfer.gpu.cuda.device_weights import plane_types
    from ninfer.gpu.cuda.kernels.quant_layout import DEVICE_QTYPES

    sig = lambda q: (*plane_types(q), types.int32[::1], types.int32[::1], types.float32[:, ::1])  # noqa: E731
    return [(f"embed_{q}", make_embed(q), sig(q)) for q in DEVICE_QTYPES]
