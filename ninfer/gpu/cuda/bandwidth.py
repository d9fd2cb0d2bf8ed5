"""The GPU's device-to-device copy bandwidth: the decode floor's denominator (`ninfer bench`).

A decode step that reads its weights once cannot beat a copy of the same bytes, so the bench
divides a step's bytes by this, measured on the GPU it runs on (an H200 measures ~4,070-4,270
GB/s, an H100 80GB HBM3 ~3,020). Under the simulator nothing can be measured: there is no floor.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from ninfer.gpu.cuda.kernels.intrinsics import SIMULATOR


def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 10) -> float | None:
    """Bytes read + written a second by the fastest of `repeats` device-to-device copies of
    `nbytes` (after one untimed copy); None under the simulator, whose copies are host memcpys."""
    if SIMULATOR:
        return None
    src = cuda.device_array(nbytes, np.uint8)
    dst = cuda.device_array(nbytes, np.uint8)
    start, end = cuda.event(), cuda.event()
    dst.copy_to_device(src)
    best = float("inf")
    for _ in range(repeats):
        start.record()
        dst.copy_to_device(src)
        end.record()
        end.synchronize()
        best = min(best, cuda.event_elapsed_time(start, end) / 1e3)
    return 2 * nbytes / best
