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
from ninfer.cpu.gemm import gemm_half, gemm_q8, quantize_rows
from ninfer.models.weights import StoredTensor


def _kernel_ready(tensor: StoredTensor) -> StoredTensor:
    """The tensor as the kernels read it: plain-ndarray views of the stored bytes (a memmap
    stays a mapping); types without a kernel (Q2_K, Q3_K, Q5_K) are dequantized to F32."""
    if tensor.qtype in QTYPES or tensor.qtype in ("F16", "BF16"):
        data = np.asarray(tensor.data)
        return StoredTensor(tensor.qtype, tensor.shape, data.reshape(tensor.shape[0], -1))
    return StoredTensor("F32", tensor.shape, tensor.dequantize())


class QuantMatrix:
    """[out, in] weights stacked from stored tensors; `x @ m.T` and `m[rows]` like an array."""

    __array_ufunc__ = None  # numpy defers `@` to our __rmatmul__

    def __init__(self, parts: Sequence[StoredTensor]):
        self.parts = [_kernel_ready(p) for p in parts]
        if len({p.shape[1] for p in self.parts}) != 1:
            raise ValueError(f"stacked parts disagree on their input size: {[p.shape for p in self.parts]}")
        self.shape = (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])
        self._quantized = any(p.qtype in QTYPES for p in self.parts)

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
        """float32 rows (an embedding lookup); rows index the whole stack."""
        rows = np.atleast_1d(np.asarray(rows, np.int64))
        out = np.empty((rows.shape[0], self.shape[1]), np.float32)
        start = 0
        for part in self.parts:
            mine = (rows >= start) & (rows < start + part.shape[0])
            if mine.any():
                picked = part.data[rows[mine] - start]
                out[mine] = StoredTensor(part.qtype, (picked.shape[0], part.shape[1]), picked).dequantize()
            start += part.shape[0]
        return out

    def matmul_t(self, x: np.ndarray) -> np.ndarray:
        """x [T, in] @ W.T -> float32 [T, out]."""
        x = np.ascontiguousarray(x, np.float32).reshape(-1, self.shape[1])
        out = np.empty((x.shape[0], self.shape[0]), np.float32)
        threads = numba.get_num_threads()
        if self._quantized:  # quantize the activations once for every quantized part
            nb = self.shape[1] // 32
            xq = np.empty(x.shape, np.int16)
            xd, xs = np.empty((x.shape[0], nb), np.float32), np.empty((x.shape[0], nb), np.float32)
            quantize_rows(x, xq, xd, xs)
        col = 0
        for part in self.parts:
            if part.qtype in QTYPES:
                gemm_q8(xq, xd, xs, part.data, QTYPES[part.qtype], F16_TABLE, out, col, threads)
            elif part.qtype == "F32":
                out[:, col : col + part.shape[0]] = x @ part.data.T
            else:
                bits = part.data.view(np.uint16)
                gemm_half(x, bits, part.qtype == "BF16", F16_TABLE, out, col, threads)
            col += part.shape[0]
        return out


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
