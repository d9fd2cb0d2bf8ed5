"""Warm L2 with weights ahead of a GEMV: `cp.async.bulk.prefetch.L2` requests (sm_90+).

A one-row decode step alternates bandwidth-bound GEMVs with kernels that move almost no bytes
(RMSNorm, decode attention), so the idea was to fill those idle windows with the next matrix.
Measured on the H200 (8B shape, Q8_0; `gemv_tune --l2 GAP_US`, docs/performance.md): a CTA does
not retire before its bulk prefetches land (17.8 MB took ~8 us from 32 one-warp blocks, ~2.2
TB/s), the O GEMV runs 4.1 us hot against 6.9 cold, and forked on a side stream of the decode
graph (after the QKV GEMV, for the O matrix) the step did not get faster; forked before the
down GEMV, for the next QKV, it was 0.23 ms slower (the down GEMV's stream evicts the lines).
So the forward pass does not use it; the kernel stays as gemv_tune's instrument.

`ranges` is int64 [n, 2]: (16-byte aligned device address, bytes: a multiple of 16). Every
range is cut into PIECE_BYTES pieces, dealt round-robin over all threads of the grid.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, types

from ninfer.gpu.cuda.intrinsics import SIMULATOR, bulk_prefetch_l2

PIECE_BYTES = 1 << 15
# each SM's copy engine takes its block's requests: spread them over many SMs (the simulator
# runs a Python thread per CUDA thread: a few do)
BLOCKS = 2 if SIMULATOR else 32
THREADS = 4 if SIMULATOR else 32


def make_l2_prefetch(piece: int = PIECE_BYTES):
    def l2_prefetch(ranges):
        t = cuda.grid(1)
        nt = cuda.gridsize(1)
        first = 0  # global index of the current range's first piece
        for r in range(ranges.shape[0]):
            addr = ranges[r, 0]
            n = ranges[r, 1]
            num = (n + piece - 1) // piece
            j = (t - first % nt + nt) % nt  # this thread's first piece of the range
            while j < num:
                off = j * piece
                bulk_prefetch_l2(addr + off, min(piece, n - off))
                j += nt
            first += num

    return l2_prefetch


@functools.cache
def l2_prefetch_kernel(piece: int = PIECE_BYTES):
    return cuda.jit(make_l2_prefetch(piece))


def prefetch(ranges, stream=0) -> None:
    """Launch the requests for `ranges` (a device int64 [n, 2] array) on `stream`."""
    l2_prefetch_kernel(PIECE_BYTES)[BLOCKS, THREADS, stream](ranges)


def _address(arr) -> int:
    face = getattr(arr, "__cuda_array_interface__", None) or arr.__array_interface__
    return int(face["data"][0])


def weight_ranges(weights, fraction: float = 1.0) -> np.ndarray:
    """(address, bytes) of the first `fraction` of every plane of these DeviceWeights, trimmed
    to 16-byte boundaries (a row-major plane's first rows: what a GEMV's first blocks read)."""
    out = []
    for w in weights:
        for plane in w.planes:
            if plane.size <= 1:  # a placeholder plane
                continue
            start = _address(plane)
            end = start + int(plane.size * plane.dtype.itemsize * fraction)
            lo, hi = -(-start // 16) * 16, end // 16 * 16
            if hi > lo:
                out.append((lo, hi - lo))
    return np.asarray(out, np.int64).reshape(-1, 2)


def covered(calls) -> list[tuple[int, int]]:
    """numpy-side reference: the (start, end) byte intervals a list of (addr, bytes) prefetch
    calls covers, merged; each call must be at most a piece long and none may overlap."""
    piece = PIECE_BYTES
    spans = sorted((a, a + n) for a, n in calls if 0 < n <= piece)
    if len(spans) != len(calls):
        raise AssertionError(f"a prefetch call was empty or longer than {piece} bytes")
    merged: list[list[int]] = []
    for a, b in spans:
        if merged and a < merged[-1][1]:
            raise AssertionError(f"prefetch pieces overlap at {a}")
        if merged and a == merged[-1][1]:
            merged[-1][1] = b
        else:
            merged.append([a, b])
    return [tuple(m) for m in merged]


def ptx_cases():
    return [("l2_prefetch", make_l2_prefetch(), (types.int64[:, ::1],))]
