"""How many threads the reference backend's BLAS may use.

OpenBLAS spins its threads while it waits for work. With one thread per core and the event
loop, the HTTP server and tests also wanting a core, those spinning threads steal the cores the
other threads need: on the 2-core CI machine, with one other busy process, a decode step took
12x longer with two BLAS threads than with one (docs/performance.md). So the reference backend
leaves one core free (at least one BLAS thread), unless the user chose:
`$NINFER_BLAS_THREADS`, or the BLAS libraries' own `OPENBLAS_NUM_THREADS` /
`OMP_NUM_THREADS` / `MKL_NUM_THREADS`.

`limit_blas_threads` changes process-wide state, so it is a start-up step
(`ninfer.runtime.create_runner` calls it for the reference backend), not something a runner
does when constructed.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

logger = logging.getLogger(__name__)
_USER_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
_CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def cgroup_cpu_limit(path: Path = _CGROUP_CPU_MAX) -> int | None:
    """Whole CPUs a cgroup v2 quota allows (`cpu.max` = "quota period"), or None without one."""
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return max(1, math.ceil(int(quota) / int(period)))
    except (ValueError, ZeroDivisionError):
        return None


def available_cores() -> int:
    """Cores this process may run on: its affinity mask, capped by a container's CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_limit()
    return min(cores, quota) if quota is not None else cores


def default_num_blas_threads() -> int | None:
    """Threads to use, or None to leave BLAS as the user's environment configured it."""
    chosen = os.environ.get("NINFER_BLAS_THREADS", "").strip()
    if chosen:
        if chosen.isdigit() and int(chosen) >= 1:
            return int(chosen)
        logger.warning("ignoring NINFER_BLAS_THREADS=%r: it takes a whole number of threads >= 1", chosen)
    if any(os.environ.get(name) for name in _USER_VARIABLES):
        return None
    return max(1, available_cores() - 1)


def limit_blas_threads(num_threads: int | None = None) -> int | None:
    """Apply `num_threads` (default: `default_num_blas_threads()`) to every BLAS loaded so far.

    threadpoolctl sets the libraries' own thread counts, which stay until changed again.
    Returns the count applied (None: left alone).
    """
    import numpy  # noqa: F401  (loads numpy's BLAS, so the limit reaches it)
    from threadpoolctl import threadpool_limits

    num_threads = default_num_blas_threads() if num_threads is None else num_threads
    if num_threads is not None:
        threadpool_limits(limits=num_threads, user_api="blas")
    return num_threads


def num_blas_threads_in_use() -> list[int]:
    """Thread count of each BLAS library loaded in this process."""
    from threadpoolctl import threadpool_info

    return [int(pool["num_threads"]) for pool in threadpool_info() if pool.get("user_api") == "blas"]
