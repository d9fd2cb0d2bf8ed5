"""`QuantMatrix`: a weight matrix left in its stored form that numpy's `@` hands to the kernels.

The reference forward multiplies `x @ w` (w as [in, out]) and looks up `embed[tokens]`; a
`QuantMatrix` ([out, in], the stored layout) answers both without a float copy: `.T` is the
[in, out] operand whose `__rmatmul__` runs `gemm.py`'s kernels, and indexing dequantizes only
the rows asked for. Setting `__array_ufunc__ = None` makes numpy's `ndarray @ obj` return
NotImplemented, so Python calls `obj.__rmatmul__`.

A matrix is a stack of parts along the output rows (q / k / v, gate / up), each its own stored
tensor (memory-mapped from the file where it allows) with its own type: no concatenated copy,
and per-tensor types (a Q4_K_M file mixes Q4_K and Q6_K within a role) just work.
"""

from __future__ import annotations

from collections.abc import Sequence

import numba
import numpy as np

from ninfer.cpu.blocks import F16_TABLE, QTYPES
from ninfer.cpu.gemm import dequantize_rows, gemm_half, gemm_q8, part_list, quantize_rows
from ninfer.models.weights import StoredTensor

# From this many activation rows (a prefill) a product dequantizes W chunk by chunk for BLAS,
# whose float32 GEMM then beats the q8 kernels (which pay per row and token); fewer rows
# (decode, batches of streams) take the q8 kernels, which read each weight byte once.
BLAS_FROM = 16
SCRATCH_BYTES = 1 << 20


def _kernel_ready(tensor: StoredTensor) -> StoredTensor:
    """The tensor as the kernels read it: plain-ndarray views of the stored bytes (a memmap
    stays a mapping); types without a kernel (Q2_K, Q3_K, Q5_K) are dequantized to F32."""
    if tensor.qtype in QTYPES or tensor.qtype in ("F16", "BF16"):
        data = np.ascontiguousarray(tensor.data).reshape(tensor.shape[0], -1).view()
        data.flags.writeable = False  # one compiled kernel for file maps and copies alike
        return StoredTensor(tensor.qtype, tensor.shape, data)
    return StoredTensor("F32", tensor.shape, tensor.dequantize())


def _root(a: np.ndarray):
    while isinstance(a, np.ndarray) and a.base is not None:
        a = a.base
    return a


def _merged(parts: list[StoredTensor]) -> list[StoredTensor]:
    """Neighbouring quantized parts of one type that lie back to back in one buffer (gate /
    up in a GGUF file) as one part: a view over both, no copy, one kernel call."""
    out = parts[:1]
    for part in parts[1:]:
        last = out[-1]
        a, b = last.data, part.data
        if (part.qtype == last.qtype and part.qtype in QTYPES and a.shape[1] == b.shape[1]
                and a.flags.c_contiguous and b.flags.c_contiguous and _root(a) is _root(b)
                and a.__array_interface__["data"][0] + a.nbytes == b.__array_interface__["data"][0]):  # fmt: skip
            rows = a.shape[0] + b.shape[0]
            both = np.lib.stride_tricks.as_strided(a, (rows, a.shape[1]), a.strides, writeable=False)
            out[-1] = StoredTensor(part.qtype, (rows, last.shape[1]), both)
        else:
            out.append(part)
    return out


class QuantMatrix:
    """[out, in] weights stacked from stored tensors; `x @ m.T` and `m[rows]` like an array."""

    __array_ufunc__ = None  # numpy defers `@` to our __rmatmul__

    def __init__(self, parts: Sequence[StoredTensor]):
        self.parts = _merged([_kernel_ready(p) for p in parts])
        if len({p.shape[1] for p in self.parts}) != 1:
            raise ValueError(f"stacked parts disagree on their input size: {[p.shape for p in self.parts]}")
        self.shape = (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])
        # the quantized parts, for one kernel call: their data, type codes and first columns
        starts = np.cumsum([0] + [p.shape[0] for p in self.parts])[:-1]
        mine = [i for i, p in enumerate(self.parts) if p.qtype in QTYPES]
        self._q8_parts = part_list(self.parts[i].data for i in mine)
        self._q8_types = np.array([QTYPES[self.parts[i].qtype] for i in mine], np.int64)
        self._q8_cols = np.array([starts[i] for i in mine], np.int64)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def T(self) -> _Transposed:  # noqa: N802 (numpy's name)
        return _Transposed(self)

    def astype(self, dtype, copy: bool = False) -> QuantMatrix:
        """Itself: the weights stay stored (the reference constructor casts what it loads)."""
        return self

    def __getitem__(self, rows) -> np.ndarray:
        """float32 rows (an embedding lookup, the head's refined rows); rows index the whole
        stack. Quantized rows go through `dequantize_rows` (gguf's values bit for bit; gguf's
        numpy dequantizer took ~1 ms for the head's 64 refined rows, 7 % of a decode step)."""
        rows = np.atleast_1d(np.asarray(rows, np.int64))
        out = np.empty((rows.shape[0], self.shape[1]), np.float32)
        start = 0
        for part in self.parts:
            mine = (rows >= start) & (rows < start + part.shape[0])
            if mine.any():
                picked = part.data[rows[mine] - start]
                if part.qtype in QTYPES:
                    picked.flags.writeable = False  # the kernel's one compiled signature (_kernel_ready)
                    got = np.empty((picked.shape[0], self.shape[1]), np.float32)
                    dequantize_rows(picked, QTYPES[part.qtype], F16_TABLE, got, 0, picked.shape[0], 1)
                    out[mine] = got
                else:
                    out[mine] = StoredTensor(part.qtype, (picked.shape[0], part.shape[1]), picked).dequantize()
            start += part.shape[0]
        return out

    def matmul_t(self, x: np.ndarray, q8=None, threads: int | None = None) -> np.ndarray:
        """x [T, in] @ W.T -> float32 [T, out]: the q8 kernels for a few rows (decode), BLAS
        over dequantized chunks of W from `BLAS_FROM` rows on (prefill). `q8`: x's codes
        (xq, xd, xs) when the caller quantized it already (`fused.py`); `threads`: numba's
        thread count (asked of numba when not given)."""
        x = np.ascontiguousarray(x, np.float32).reshape(-1, self.shape[1])
        out = np.empty((x.shape[0], self.shape[0]), np.float32)
        threads = threads or numba.get_num_threads()
        if x.shape[0] >= BLAS_FROM:
            self._matmul_blas(x, out, threads)
            return out
        if q8 is not None and q8[0].shape[0] == x.shape[0]:
            xq, xd, xs = q8
        elif self._q8_parts:  # quantize the activations once for every quantized part
            nb = self.shape[1] // 32
            xq = np.empty(x.shape, np.int8)
            xd, xs = np.empty((x.shape[0], nb), np.float32), np.empty((x.shape[0], nb), np.float32)
            quantize_rows(x, xq, xd, xs)
        if self._q8_parts:
            gemm_q8(xq, xd, xs, self._q8_parts, self._q8_types, F16_TABLE, out, self._q8_cols, threads, 0,
                    len(self._q8_parts))  # fmt: skip
        col = 0
        for part in self.parts:
            if part.qtype == "F32":
                out[:, col : col + part.shape[0]] = x @ part.data.T
            elif part.qtype not in QTYPES:
                bits = part.data.view(np.uint16)
                gemm_half(x, bits, part.qtype == "BF16", F16_TABLE, out, col, threads)
            col += part.shape[0]
        return out

    def _matmul_blas(self, x: np.ndarray, out: np.ndarray, threads: int) -> None:
        """Float activations against chunks of rows dequantized into one small scratch (about
        `SCRATCH_BYTES`), each chunk one BLAS product: memory stays at the stored size."""
        n = self.shape[1]
        chunk = max(8, SCRATCH_BYTES // (4 * n))
        scratch = None
        col = 0
        for part in self.parts:
            rows = part.shape[0]
            if part.qtype == "F32":
                out[:, col : col + rows] = x @ part.data.T
            else:
                if scratch is None:
                    scratch = np.empty((min(chunk, max(p.shape[0] for p in self.parts)), n), np.float32)
                for lo in range(0, rows, chunk):
                    hi = min(rows, lo + chunk)
                    w = scratch[: hi - lo]
                    if part.qtype in QTYPES:
                        dequantize_rows(part.data, QTYPES[part.qtype], F16_TABLE, w, lo, hi, threads)
                    else:
                        w[:] = StoredTensor(part.qtype, (hi - lo, n), part.data[lo:hi]).dequantize()
                    out[:, col + lo : col + hi] = x @ w.T
            col += rows


class _Transposed:
    """`m.T`: the [in, out] right operand of `x @ w`."""

    __array_ufunc__ = None

    def __init__(self, matrix: QuantMatrix):
        self.matrix = matrix
        self.shape = matrix.shape[::-1]

    @property
    def nbytes(self) -> int:
        return self.matrix.nbytes

    def __rmatmul__(self, x: np.ndarray) -> np.ndarray:
        lead = x.shape[:-1]
        return self.matrix.matmul_t(x).reshape(*lead, self.shape[1])
