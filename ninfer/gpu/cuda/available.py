"""`cuda_available()`: is there a usable CUDA GPU here? Never raises, never imports numba."""

from __future__ import annotations

import functools
import os


@functools.cache
def cuda_available() -> bool:
    """True when a CUDA driver and at least one device answer (the simulator does not count)."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return False
    try:
        from cuda.bindings import driver

        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return False
        err, count = driver.cuDeviceGetCount()
        return err == driver.CUresult.CUDA_SUCCESS and count > 0
    except Exception:  # no driver library, no bindings, broken install: all mean "no GPU"
        return False

