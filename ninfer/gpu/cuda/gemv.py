"""Matrix-vector products for decode (up to 8 activation rows), weights in stored form.

One group of `lanes` threads (8, 16 or 32) owns one weight row; lane `l` walks the row's
32-element blocks l, l + lanes, ...; each loaded block is used for all M activation rows, so
the weights are read from memory once per step. Two flavours share the kernel body:

* `q8`: int8 activations (act_quant.py) and `dp4a` dot products (qdot.py): the fast path;
* `f32`: float32 activations and weights dequantized to float in registers (dequant.py):
  the exact path, also the only one for F32 / F16 / BF16 weights.

Epilogue: `out[m, r] = acc (+ res[m, r])`; `res` may be `out` itself (residual add in place).
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, int32, types

from ninfer.gpu.cuda.act_quant import dequantize_q8_ref
from ninfer.gpu.cuda.dequant import DQ_WORD
from ninfer.gpu.cuda.intrinsics import SIMULATOR, device, group_sum, ld4_f32
from ninfer.gpu.cuda.qdot import QDOT

THREADS = 32 if SIMULATOR else 128  # the simulator runs a Python thread per CUDA thread
MAX_M = 64  # decode batches up to 64 rows stay on the GEMV (weights read once from memory)
MGROUP = 8  # activation rows per block (register accumulators)
FLOAT_QTYPES = ("F32", "F16", "BF16")


def _make_fdot(dq):
    @device
    def fdot(qs, d16, aux, sc8, row, blk, x, xs, m):
        s = float32(0.0)
        for j in range(8):
            w0, w1, w2, w3 = dq(qs, d16, aux, sc8, row, blk, j)
            x0, x1, x2, x3 = ld4_f32(x, m, 32 * blk + 4 * j)
            s += w0 * x0 + w1 * x1 + w2 * x2 + w3 * x3
        return s

    return fdot


def make_gemv(qtype: str, mode: str, lanes: int, max_m: int):
    """The plain Python kernel (compile with cuda.jit or cuda.compile_ptx).

    Each lane handles `unroll` blocks per iteration with no branch between them (a block past
    the row's end is clamped and weighted 0), so their loads are in flight together; rows past
    `num_m` repeat the last row instead of branching (their sums are never stored). A block
    covers activation rows 8 * blockIdx.x .. + max_m (max_m <= 8 accumulators stay in
    registers); neighbouring blocks share weight rows, so extra row groups re-read weights
    from L2, not from memory.
    """
    dot = QDOT[qtype] if mode == "q8" else _make_fdot(DQ_WORD[qtype])
    rows_per_warp = 32 // lanes
    unroll = 4 if max_m == 1 else 2

    def gemv(qs, d16, aux, sc8, xa, xs, out, res, num_rows, num_blocks, num_m, has_res):
        lane = cuda.threadIdx.x % 32
        warp = (cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x) // 32
        row = warp * rows_per_warp + lane // lanes
        sub = lane % lanes
        m0 = cuda.blockIdx.x * MGROUP
        acc = cuda.local.array(max_m, float32)
        for i in range(max_m):
            acc[i] = float32(0.0)
        if row < num_rows:
            last = num_blocks - 1
            for blk0 in range(sub, num_blocks, lanes * unroll):
                for u in range(unroll):
                    b = blk0 + u * lanes
                    f = float32(1.0) if b <= last else float32(0.0)
                    bb = min(b, last)
                    for i in range(max_m):
                        acc[i] += f * dot(qs, d16, aux, sc8, row, bb, xa, xs, min(m0 + i, num_m - 1))
        for i in range(max_m):
            v = group_sum(acc[i], lanes)  # every thread takes part in the shuffles
            if sub == 0 and row < num_rows and m0 + i < num_m:
                if has_res:
                    v += res[m0 + i, row]
                out[m0 + i, row] = v

    return gemv


@functools.cache
def gemv_kernel(qtype: str, mode: str, lanes: int, max_m: int):
    return cuda.jit(make_gemv(qtype, mode, lanes, max_m))


def lanes_for(num_blocks: int) -> int:
    """Threads per weight row: enough to cover short rows without idling most lanes.

    The simulator's cost is per thread, so there two lanes share a row (the cross-lane
    reduction still runs); tests exercise the GPU widths explicitly.
    """
    if SIMULATOR:
        return 2
    return 32 if num_blocks >= 32 else 16 if num_blocks >= 16 else 8


def bucket_m(num_m: int) -> int:
    """Accumulators per block: the next power of two, at most MGROUP."""
    if not 1 <= num_m <= MAX_M:
        raise ValueError(f"the GEMV takes 1 to {MAX_M} activation rows, got {num_m}")
    return min(1 << (num_m - 1).bit_length(), MGROUP)


def gemv(w, xa, xs, out, res, num_m: int, mode: str, stream=0, lanes: int | None = None) -> None:
    """out[:num_m] = xa[:num_m] @ w.T (+ res); `w` a DeviceWeight; mode 'q8' or 'f32'.

    q8: xa is the uint32 view of the int8 activations and xs their scales; f32: xa is float32
    [M, cols] and xs is ignored. `res` None means no residual.
    """
    if mode == "q8" and w.qtype in FLOAT_QTYPES:
        raise ValueError(f"{w.qtype} weights have no int8 path; use mode 'f32'")
    lanes = lanes or lanes_for(w.num_blocks)
    rows_per_block = (THREADS // 32) * (32 // lanes)
    grid = (-(-num_m // MGROUP), (w.rows + rows_per_block - 1) // rows_per_block)
    kernel = gemv_kernel(w.qtype, mode, lanes, bucket_m(num_m))
    has_res = res is not None
    kernel[grid, THREADS, stream](*w.planes, xa, xs, out, res if has_res else out, w.rows, w.num_blocks, num_m, has_res)


def gemv_ref(w_f32: np.ndarray, x: np.ndarray, res: np.ndarray | None) -> np.ndarray:
    """float64 reference: x @ w.T (+ res) for float activations."""
    y = np.asarray(x, np.float64) @ np.asarray(w_f32, np.float64).T
    return y if res is None else y + res


def gemv_q8_ref(w_f32: np.ndarray, xq8: np.ndarray, xs: np.ndarray, res: np.ndarray | None) -> np.ndarray:
    """float64 reference of the q8 path: the quantized activations' exact product."""
    return gemv_ref(w_f32, dequantize_q8_ref(xq8, xs), res)


def ptx_cases():
    """(name, pyfunc, signature) for the PTX test: every type, both modes, all widths."""
    from ninfer.gpu.cuda.device_weights import plane_types
    from ninfer.gpu.cuda.quant_layout import DEVICE_QTYPES

    f32_2d = types.float32[:, ::1]
    cases = []
    for qtype in DEVICE_QTYPES:
        modes = ("f32",) if qtype in FLOAT_QTYPES else ("q8", "f32")
        for mode in modes:
            xa = types.uint32[:, ::1] if mode == "q8" else f32_2d
            sig = (*plane_types(qtype), xa, f32_2d, f32_2d, f32_2d, int32, int32, int32, types.boolean)
            for lanes, max_m in ((32, 1), (8, 8)):
                cases.append((f"gemv_{mode}_{qtype}_l{lanes}_m{max_m}", make_gemv(qtype, mode, lanes, max_m), sig))
    return cases
