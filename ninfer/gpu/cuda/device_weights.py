"""Weights on the device: the four planes of a `PackedWeight` as device arrays."""

from __future__ import annotations

import attrs
import numpy as np
from numba import cuda, types
from numba.np import numpy_support

from ninfer.gpu.cuda.kernels.quant_layout import PackedWeight

_QS_DTYPE = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def plane_dtypes(qtype: str) -> tuple:
    return (_QS_DTYPE.get(qtype, np.uint32), np.float16, np.uint32, np.int8)


def plane_types(qtype: str) -> tuple:
    """numba types of the planes (C-contiguous 2-D arrays), for explicit signatures."""
    return tuple(types.Array(numpy_support.from_dtype(np.dtype(d)), 2, "C") for d in plane_dtypes(qtype))


@attrs.frozen(eq=False)
class DeviceWeight:
    """A matrix [rows, cols] whose planes live on the device (or are numpy arrays in tests)."""

    qtype: str
    rows: int
    cols: int
    planes: tuple

    @property
    def num_blocks(self) -> int:
        return self.cols // 32

    @property
    def nbytes(self) -> int:
        return sum(int(p.size) * p.dtype.itemsize for p in self.planes if p.size > 1)


def upload_weight(packed: PackedWeight, stream=0) -> DeviceWeight:
    planes = tuple(cuda.to_device(p, stream=stream) for p in packed.planes)
    return DeviceWeight(packed.qtype, packed.rows, packed.cols, planes)


def host_weight(packed: PackedWeight) -> DeviceWeight:
    """The same record over numpy planes (the simulator takes host arrays)."""
    return DeviceWeight(packed.qtype, packed.rows, packed.cols, packed.planes)
