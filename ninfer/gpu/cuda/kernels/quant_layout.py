"""Weights repacked for the device: the same quantized bits, split into aligned planes.

GGML blocks are 18, 22 or 34 bytes long, so their fp16 scales and their quant bytes sit at
2-byte alignment. The device wants 16-byte loads of quant words, so each tensor is split into
up to four planes (structure of arrays). No bit is changed or widened; a block's bytes are just
stored in different places:

    qs   uint32 [rows, words]    quant words (nibbles / bytes) in block order
    d16  float16 [rows, n]       per-block scales (and mins: interleaved d, m)
    aux  uint32 [rows, n]        Q5_*: the 32 fifth bits; Q4_K: 12 scale bytes; Q6_K: qh words
    sc8  int8 [rows, n]          Q6_K: the 16 sub-block scales

Float tensors keep their element type in `qs` (float32, float16, or uint16 bf16 bits). Types
without a device kernel (Q5_K, Q2_K, Q3_K) are dequantized to F16 here, at twice to three
times their stored size; `PackedWeight.qtype` then says F16.

This module is numpy-only (no numba), so it can be tested and used anywhere.
"""

from __future__ import annotations

import attrs
import numpy as np

from ninfer.models.weights import StoredTensor

DEVICE_QTYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q6_K")
# elements per block and bytes per block of the GGML types that have a device kernel
BLOCK_SHAPE = {
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "Q4_K": (256, 144), "Q6_K": (256, 210),
}  # fmt: skip


@attrs.frozen(eq=False)
class PackedWeight:
    """One matrix [rows, cols] in device layout (numpy planes; see the module docstring)."""

    qtype: str
    rows: int
    cols: int
    qs: np.ndarray
    d16: np.ndarray
    aux: np.ndarray
    sc8: np.ndarray

    @property
    def planes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return (self.qs, self.d16, self.aux, self.sc8)

    @property
    def nbytes(self) -> int:
        """Bytes of real data (the 1-element placeholder planes are not counted)."""
        return sum(int(p.nbytes) for p in self.planes if p.size > 1)

    @property
    def num_blocks(self) -> int:
        """32-element blocks per row."""
        return self.cols // 32


def _dummy(dtype) -> np.ndarray:
    return np.zeros((1, 1), dtype=dtype)


def _planes(qtype: str, rows: int, cols: int, qs, d16=None, aux=None, sc8=None) -> PackedWeight:
    return PackedWeight(
        qtype, rows, cols,
        np.ascontiguousarray(qs),
        _dummy(np.float16) if d16 is None else np.ascontiguousarray(d16),
        _dummy(np.uint32) if aux is None else np.ascontiguousarray(aux),
        _dummy(np.int8) if sc8 is None else np.ascontiguousarray(sc8),
    )  # fmt: skip


def _words(b: np.ndarray, rows: int) -> np.ndarray:
    """[rows, nblocks, k] uint8 -> [rows, nblocks * k / 4] uint32 (little-endian words)."""
    return np.ascontiguousarray(b).reshape(rows, -1).view(np.uint32)


def _halves(b: np.ndarray, rows: int) -> np.ndarray:
    return np.ascontiguousarray(b).reshape(rows, -1).view(np.float16)


def pack_tensor(t: StoredTensor) -> PackedWeight:
    """Split a 2-D stored tensor into device planes (1-D tensors become one row)."""
    rows = t.shape[0] if len(t.shape) == 2 else 1
    cols = t.shape[-1]
    if cols % 32:
        raise ValueError(f"the device kernels need rows of whole 32-element blocks, got {cols} columns")
    if t.qtype == "F32":
        return _planes("F32", rows, cols, np.asarray(t.data, np.float32).reshape(rows, cols))
    if t.qtype == "F16":
        return _planes("F16", rows, cols, np.asarray(t.data, np.float16).reshape(rows, cols))
    if t.qtype == "BF16":
        return _planes("BF16", rows, cols, np.asarray(t.data, np.uint16).reshape(rows, cols))
    if t.qtype not in BLOCK_SHAPE:
        f16 = t.dequantize().astype(np.float16).reshape(rows, cols)
        return _planes("F16", rows, cols, f16)
    per_block, nbytes = BLOCK_SHAPE[t.qtype]
    b = np.asarray(t.data, np.uint8).reshape(rows, cols // per_block, nbytes)
    return _SPLIT[t.qtype](b, rows, cols)


def _q4_0(b, rows, cols):
    return _planes("Q4_0", rows, cols, _words(b[..., 2:18], rows), _halves(b[..., 0:2], rows))


def _q4_1(b, rows, cols):
    return _planes("Q4_1", rows, cols, _words(b[..., 4:20], rows), _halves(b[..., 0:4], rows))


def _q5_0(b, rows, cols):
    return _planes("Q5_0", rows, cols, _words(b[..., 6:22], rows), _halves(b[..., 0:2], rows), _words(b[..., 2:6], rows))


def _q5_1(b, rows, cols):
    return _planes("Q5_1", rows, cols, _words(b[..., 8:24], rows), _halves(b[..., 0:4], rows), _words(b[..., 4:8], rows))


def _q8_0(b, rows, cols):
    return _planes("Q8_0", rows, cols, _words(b[..., 2:34], rows), _halves(b[..., 0:2], rows))


def _q4_k(b, rows, cols):
    return _planes("Q4_K", rows, cols, _words(b[..., 16:144], rows), _halves(b[..., 0:4], rows), _words(b[..., 4:16], rows))


def _q6_k(b, rows, cols):
    sc8 = np.ascontiguousarray(b[..., 192:208]).reshape(rows, -1).view(np.int8)
    return _planes(
        "Q6_K", rows, cols, _words(b[..., 0:128], rows), _halves(b[..., 208:210], rows), _words(b[..., 128:192], rows), sc8
    )


_SPLIT = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q6_K": _q6_k}


def concat_rows(parts: list[PackedWeight]) -> PackedWeight | None:
    """Stack matrices of one type and width (fused QKV, gate+up); None when they differ."""
    first = parts[0]
    if any(p.qtype != first.qtype or p.cols != first.cols for p in parts):
        return None

    def cat(i):
        planes = [p.planes[i] for p in parts]
        return planes[0] if planes[0].size == 1 else np.concatenate(planes, axis=0)

    return PackedWeight(first.qtype, sum(p.rows for p in parts), first.cols, cat(0), cat(1), cat(2), cat(3))


def random_stored(qtype: str, rows: int, cols: int, rng: np.random.Generator, scale: float = 0.02) -> StoredTensor:
    """A random tensor of a stored type: random quant bits with finite fp16 scales.

    Every bit pattern of the quant bytes is a valid block, so K-quants (which gguf cannot
    quantize to) are produced directly; scale fields are small positive halves.
    """
    if qtype == "F32":
        return StoredTensor("F32", (rows, cols), (rng.standard_normal((rows, cols)) * scale).astype(np.float32))
    if qtype == "F16":
        return StoredTensor("F16", (rows, cols), (rng.standard_normal((rows, cols)) * scale).astype(np.float16))
    if qtype == "BF16":
        f = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        return StoredTensor("BF16", (rows, cols), (f.view(np.uint32) >> 16).astype(np.uint16))
    per_block, nbytes = BLOCK_SHAPE[qtype]
    b = rng.integers(0, 256, size=(rows, cols // per_block, nbytes), dtype=np.uint8)
    for lo, hi, div in _SCALE_FIELDS[qtype]:
        n = (hi - lo) // 2
        vals = (rng.uniform(0.5, 1.5, size=(rows, cols // per_block, n)) * scale / div).astype(np.float16)
        if qtype in ("Q4_1", "Q5_1") and lo == 2:
            vals = -vals * (7.5 if qtype == "Q4_1" else 15.5)  # the block minimum: centres the values
        b[..., lo:hi] = vals.view(np.uint8).reshape(rows, cols // per_block, hi - lo)
    return StoredTensor(qtype, (rows, cols), b.reshape(rows, -1))


# (first byte, end byte, divisor) of each fp16 scale field: scales about scale / divisor
_SCALE_FIELDS = {
    "Q4_0": [(0, 2, 4)], "Q4_1": [(0, 2, 8), (2, 4, 8)], "Q5_0": [(0, 2, 8)], "Q5_1": [(0, 2, 16), (2, 4, 16)],
    "Q8_0": [(0, 2, 64)], "Q4_K": [(0, 2, 256), (2, 4, 256)], "Q6_K": [(208, 210, 1024)],
}  # fmt: skip
