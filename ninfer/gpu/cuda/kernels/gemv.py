"""Matrix-vector products for decode (up to 8 activation rows), weights in stored form.

One group of `lanes` threads (8, 16 or 32) owns one weight row; lane `l` walks the row's
32-element blocks l, l + lanes, ...; each loaded block is used for all M activation rows, so
the weights are read from memory once per step. Two flavours share the kernel body:

* `q8`: int8 activations (act_quant.py) and `dp4a` dot products (qdot.py): the fast path;
* `f32`: float32 activations and weights dequantized to float in registers (dequant.py):
  the float-activation path (logits within ~1e-3 of the CPU reference), also the only one
  for F32 / F16 / BF16 weights.

Epilogue: `out[m, r] = acc (+ res[m, r])`; `res` may be `out` itself (residual add in place).
One activation row on the q8 path takes the split loop (every load of an iteration before its
arithmetic), which gemv_folds.py's kernels build on. Shapes come from the `KernelPlan`.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32, types, uint32

from ninfer.gpu.cuda.kernels.act_quant import dequantize_q8_ref
from ninfer.gpu.cuda.kernels.dequant import DQ_WORD
from ninfer.gpu.cuda.kernels.intrinsics import (
    SIMULATOR, device, grid_dep_launch, grid_dep_wait, group_sum, ld2_f32_pinned, ld4_f32_pinned, ld4_u32_pinned,
)
from ninfer.gpu.cuda.kernels.jit import compiled
from ninfer.gpu.cuda.kernels.pdl import aware
from ninfer.gpu.cuda.kernels.qdot import SPLIT_QTYPES, WCOMP, WORDS, act_block, fns
from ninfer.gpu.cuda.plan import DEFAULT, KernelPlan

THREADS = 32 if SIMULATOR else 128  # the simulator runs a Python thread per CUDA thread
MAX_M = 64  # decode batches up to 64 rows stay on the GEMV (weights read once from memory)
MGROUP = 8  # activation rows per block (register accumulators)
FLOAT_QTYPES = ("F32", "F16", "BF16")
TALL_ROWS = 65536  # from this many rows up, one row per lane group (an 8B model's LM head measured faster)
WIDE_BLOCKS = 128  # rows of >= this many int8 blocks (an 8B model's 4,096 columns) take KernelPlan.wide_shape


def _make_fdot(dq):
    @device
    def fdot(qs, d16, aux, sc8, row, blk, x, xs, m):
        s = float32(0.0)
        for j in range(8):
            w0, w1, w2, w3 = dq(qs, d16, aux, sc8, row, blk, j)
            x0, x1, x2, x3 = ld4_f32_pinned(x, m, 32 * blk + 4 * j)
            s += w0 * x0 + w1 * x1 + w2 * x2 + w3 * x3
        return s

    return fdot


def make_gemv(qtype: str, mode: str, lanes: int, max_m: int, rows_per_group: int = 1, unroll: int = 0,
              split: bool = False, evict_first: bool = True):
    """The plain Python kernel (compile with cuda.jit or cuda.compile_ptx).

    A group of `lanes` threads owns `rows_per_group` (R) consecutive weight rows; lane `sub`
    walks blocks sub, sub + lanes, ... of all R rows, so (q8, one activation row) each loaded
    activation block serves R weight rows and R x unroll 16-byte weight loads are in flight
    per lane. Each lane handles `unroll` blocks per iteration with no branch between them (a
    block past the row's end is clamped and weighted 0); rows past `num_m` / `num_rows`
    repeat the last one instead of branching (their sums are never stored). A block covers
    activation rows 8 * blockIdx.x .. + max_m (max_m <= 8 accumulators stay in registers);
    neighbouring blocks share weight rows, so extra row groups re-read weights from L2.
    `split` (q8, one activation row, Q4_0 / Q4_1 / Q8_0): one weight row per group through
    the split loop too, whose first weight loads are issued before the PDL wait.
    `evict_first`: the weight loads' L2 policy (qdot.fns).
    """
    q8 = mode == "q8"
    wdot = fns(evict_first).wdot[qtype] if q8 else None
    dot = fns(evict_first).qdot[qtype] if q8 else _make_fdot(DQ_WORD[qtype])
    R = rows_per_group
    if R > 1 and max_m > 1:
        raise ValueError("several rows per lane group need a single activation row")
    if R > 1 and not q8:
        raise ValueError("several rows per lane group are a q8 path")
    rows_per_warp = (32 // lanes) * R
    unroll = unroll or (4 if max_m == 1 else 2)

    @aware
    def gemv(qs, d16, aux, sc8, xa, xs, out, res, num_rows, num_blocks, num_m, has_res):
        grid_dep_launch()
        grid_dep_wait()
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

    @aware
    def gemv_rows(qs, d16, aux, sc8, xa, xs, out, res, num_rows, num_blocks, num_m, has_res):
        """One activation row, R weight rows per lane group sharing each activation block."""
        grid_dep_launch()
        grid_dep_wait()
        lane = cuda.threadIdx.x % 32
        warp = (cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x) // 32
        row0 = warp * rows_per_warp + (lane // lanes) * R
        sub = lane % lanes
        acc = cuda.local.array(R, float32)
        for r in range(R):
            acc[r] = float32(0.0)
        if row0 < num_rows:
            last = num_blocks - 1
            last_row = num_rows - 1
            for blk0 in range(sub, num_blocks, lanes * unroll):
                for u in range(unroll):
                    b = blk0 + u * lanes
                    f = float32(1.0) if b <= last else float32(0.0)
                    bb = min(b, last)
                    a0, a1, a2, a3, a4, a5, a6, a7, dx, sx = act_block(xa, xs, 0, bb)
                    for r in range(R):
                        acc[r] += f * wdot(qs, d16, aux, sc8, min(row0 + r, last_row), bb,
                                           a0, a1, a2, a3, a4, a5, a6, a7, dx, sx)  # fmt: skip
        for r in range(R):
            row = row0 + r
            v = group_sum(acc[r], lanes)  # every thread takes part in the shuffles
            if sub == 0 and row < num_rows:
                if has_res:
                    v += res[0, row]
                out[0, row] = v

    if R == 1 and not (split and q8 and max_m == 1 and qtype in SPLIT_QTYPES):
        return gemv
    return _make_gemv_split(qtype, lanes, R, unroll, evict_first) if qtype in SPLIT_QTYPES else gemv_rows


def _make_first_loads(qtype: str, lanes: int, R: int, U: int, evict_first: bool = True):
    """Device function: the weight loads of a lane group's first split-loop iteration into W, S."""
    wload = fns(evict_first).wload[qtype]

    @device
    def first_loads(qs, d16, row0, rstride, last_row, sub, num_blocks, W, S):
        last = num_blocks - 1
        for u in range(U):
            bb = min(sub + u * lanes, last)
            for r in range(R):
                wload(qs, d16, min(row0 + r * rstride, last_row), bb, W, S, u * R + r)

    return first_loads


def _make_split_loop(qtype: str, lanes: int, R: int, U: int, evict_first: bool = True):
    """Device function: a lane group's dot products over its R weight rows row0, row0 +
    rstride, ... (clamped to last_row) with activation row 0 of xa / xs, into acc[0:R]; every
    load of an iteration (U activation blocks, R x U weight blocks) before any arithmetic
    (qdot WLOAD / WCOMP). W, S, A, X: the caller's register arrays (sizes from `_split_arrays`).
    The first iteration's weight loads are issued before the PDL wait."""
    wcomp = WCOMP[qtype]
    loads = _make_first_loads(qtype, lanes, R, U, evict_first)

    @device
    def split_loop(qs, d16, xa, xs, row0, rstride, last_row, sub, num_blocks, acc, W, S, A, X):
        last = num_blocks - 1
        for blk0 in range(sub, num_blocks, lanes * U):
            loads(qs, d16, row0, rstride, last_row, blk0, num_blocks, W, S)
            if blk0 == sub:  # PDL: the first weights load while the kernel before finishes
                grid_dep_wait()
            for u in range(U):
                bb = min(blk0 + u * lanes, last)
                A[8 * u], A[8 * u + 1], A[8 * u + 2], A[8 * u + 3] = ld4_u32_pinned(xa, 0, 8 * bb)
                A[8 * u + 4], A[8 * u + 5], A[8 * u + 6], A[8 * u + 7] = ld4_u32_pinned(xa, 0, 8 * bb + 4)
                X[2 * u], X[2 * u + 1] = ld2_f32_pinned(xs, 0, 2 * bb)
            for u in range(U):
                f = float32(1.0) if blk0 + u * lanes <= last else float32(0.0)
                for r in range(R):
                    acc[r] += f * wcomp(W, S, u * R + r, A, X, u)

    return split_loop


def _split_arrays(qtype: str, R: int, U: int) -> tuple[int, int, int, int]:
    """Sizes of split_loop's register arrays W (weight words), S (block scales), A (activation
    words), X (activation scales)."""
    return WORDS[qtype] * U * R, 2 * U * R, 8 * U, 2 * U


def _make_gemv_split(qtype: str, lanes: int, R: int, unroll: int, evict_first: bool = True):
    """`gemv_rows` for Q4_0 / Q4_1 / Q8_0 with every load of an iteration issued before any
    arithmetic (`_make_split_loop`)."""
    rows_per_warp = (32 // lanes) * R
    nw, ns, na, nx = _split_arrays(qtype, R, unroll)
    loop = _make_split_loop(qtype, lanes, R, unroll, evict_first)

    @aware
    def gemv_split(qs, d16, aux, sc8, xa, xs, out, res, num_rows, num_blocks, num_m, has_res):
        grid_dep_launch()
        lane = cuda.threadIdx.x % 32
        warp = (cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x) // 32
        row0 = warp * rows_per_warp + (lane // lanes) * R
        sub = lane % lanes
        acc = cuda.local.array(R, float32)
        W = cuda.local.array(nw, uint32)
        S = cuda.local.array(ns, float32)
        A = cuda.local.array(na, uint32)
        X = cuda.local.array(nx, float32)
        for r in range(R):
            acc[r] = float32(0.0)
        if row0 < num_rows:
            last_row = num_rows - 1
            loop(qs, d16, xa, xs, row0, 1, last_row, sub, num_blocks, acc, W, S, A, X)
        grid_dep_wait()  # (again, for threads without rows) before res is read and out written
        for r in range(R):
            row = row0 + r
            v = group_sum(acc[r], lanes)  # every thread takes part in the shuffles
            if sub == 0 and row < num_rows:
                if has_res:
                    v += res[0, row]
                out[0, row] = v

    return gemv_split


@compiled
def gemv_kernel(qtype: str, mode: str, lanes: int, max_m: int, rows_per_group: int = 1, unroll: int = 0,
                split: bool = False, evict_first: bool = True):
    return cuda.jit(make_gemv(qtype, mode, lanes, max_m, rows_per_group, unroll, split, evict_first))


def shape_for(qtype: str, mode: str, num_blocks: int, num_m: int, rows: int = 0,
              plan: KernelPlan = DEFAULT) -> tuple[int, int, int]:  # fmt: skip
    """(lanes, rows per lane group, unroll) for one launch. One activation row on the q8 path
    shares each activation load between two weight rows and issues all of an iteration's
    loads before its arithmetic (more weight bytes in flight per register), except for very
    tall matrices (an 8B model's LM head), where one row per group measured faster
    (tools/gemv_tune.py on the H200, docs/performance.md)."""
    lanes = lanes_for(num_blocks)
    if SIMULATOR or mode != "q8" or num_m != 1 or rows >= TALL_ROWS:
        return lanes, 1, 0
    wide = plan.wide_shape_of(qtype) if num_blocks >= WIDE_BLOCKS else None
    return (lanes, *wide) if wide else (lanes, *plan.one_row_shape)


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


def gemv(w, xa, xs, out, res, num_m: int, mode: str, stream=0, lanes: int | None = None, shape=None,
         split: bool | None = None, plan: KernelPlan = DEFAULT) -> None:  # fmt: skip
    """out[:num_m] = xa[:num_m] @ w.T (+ res); `w` a DeviceWeight; mode 'q8' or 'f32'.

    q8: xa is the uint32 view of the int8 activations and xs their scales; f32: xa is float32
    [M, cols] and xs is ignored. `res` None means no residual. `shape` = (rows per lane group,
    unroll) and `split` override the plan's (`shape_for`, plan.one_row_split; tests, tuning).
    """
    if mode == "q8" and w.qtype in FLOAT_QTYPES:
        raise ValueError(f"{w.qtype} weights have no int8 path; use mode 'f32'")
    auto_lanes, rpg, unroll = shape_for(w.qtype, mode, w.num_blocks, num_m, w.rows, plan)
    if shape is not None:
        rpg, unroll = shape
    lanes = lanes or auto_lanes
    # rpg > 1 takes the split loop anyway; other launches have none (one key, one compile)
    split = plan.one_row_split if split is None else split
    split = split and rpg == 1 and mode == "q8" and num_m == 1 and w.qtype in SPLIT_QTYPES
    rows_per_block = (THREADS // 32) * (32 // lanes) * rpg
    grid = (-(-num_m // MGROUP), (w.rows + rows_per_block - 1) // rows_per_block)
    kernel = gemv_kernel(w.qtype, mode, lanes, bucket_m(num_m), rpg, unroll, split, plan.evict_first)
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
    """(name, pyfunc, signature) for the PTX test: every type, both modes, the widths and the
    one-row shapes the default plan launches (and a few others), both weight-load policies."""
    from ninfer.gpu.cuda.device_weights import plane_types
    from ninfer.gpu.cuda.kernels.quant_layout import DEVICE_QTYPES

    f32_2d = types.float32[:, ::1]
    cases = []
    one_row = {DEFAULT.one_row_shape, *(s for _, s in DEFAULT.wide_shape), (2, 2), (4, 2)}
    for qtype in DEVICE_QTYPES:
        modes = ("f32",) if qtype in FLOAT_QTYPES else ("q8", "f32")
        for mode in modes:
            xa = types.uint32[:, ::1] if mode == "q8" else f32_2d
            sig = (*plane_types(qtype), xa, f32_2d, f32_2d, f32_2d, int32, int32, int32, types.boolean)
            for lanes, max_m in ((32, 1), (8, 8)):
                cases.append((f"gemv_{mode}_{qtype}_l{lanes}_m{max_m}", make_gemv(qtype, mode, lanes, max_m), sig))
            if mode == "q8":
                for lanes, rpg, unroll in sorted({(32, *s) for s in one_row} | {(16, 2, 4)}):
                    name = f"gemv_q8_{qtype}_l{lanes}_m1_r{rpg}_u{unroll}"
                    cases.append((name, make_gemv(qtype, mode, lanes, 1, rpg, unroll), sig))
                if qtype in SPLIT_QTYPES:  # KernelPlan.one_row_split, and the weights' plain L2 policy
                    cases.append((f"gemv_q8_{qtype}_l32_m1_r1_u4_split", make_gemv(qtype, mode, 32, 1, 1, 4, split=True),
                                  sig))  # fmt: skip
                    cases.append((f"gemv_q8_{qtype}_l32_m1_r2_u4_plain_loads",
                                  make_gemv(qtype, mode, 32, 1, 2, 4, evict_first=False), sig))  # fmt: skip
                cases.append((f"gemv_q8_{qtype}_l32_m1_u8", make_gemv(qtype, mode, 32, 1, 1, 8), sig))
    return cases
