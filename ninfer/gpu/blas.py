"""How many threads the reference backend's BLAS may use.

OpenBLAS spins its threads while it waits for work. With one thread per core and the event
loop, the HTTP server and tests also wanting a core, those spinning threads steal the cores the
other threads need: on the 2-core CI machine a decode step took 3x longer with two BLAS threads
than with one while another process was busy. So the reference backend leaves one core free
(at least one BLAS thread), unless the user chose: `$NINFER_BLAS_THREADS`, or the BLAS
libraries' own `OPENBLAS_NUM_THREADS` / `OMP_NUM_THREADS` / `MKL_NUM_THREADS`.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)
_USER_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
_limiter = None  # keeps the applied limit alive for the process


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_blas_threads() -> int | None:
    """Threads to use, or None to leave BLAS as the user's environment configured it."""
    chosen = os.environ.get("NINFER_BLAS_THREADS", "").strip()
    if chosen:
        if chosen.isdigit() and int(chosen) >= 1:
            return int(chosen)
        logger.warning("ignoring NINFER_BLAS_THREADS=%r: it takes a whole number of threads >= 1", chosen)
    if any(os.environ.get(name) for name in _USER_VARIABLES):
        return None
    return max(1, available_cores() - 1)


def limit_blas_threads(threads: int | None = None) -> int | None:
    """Apply `threads` (default: `default_blas_threads()`) to every BLAS numpy loaded."""
    global _limiter
    from threadpoolctl import threadpool_limits

    threads = default_blas_threads() if threads is None else threads
    if threads is not None:
        _limiter = threadpool_limits(limits=threads, user_api="blas")
    return threads


def blas_threads_in_use() -> list[int]:
    from threadpoolctl import threadpool_info

    return [int(pool["num_threads"]) for pool in threadpool_info() if pool.get("user_api") == "blas"]
