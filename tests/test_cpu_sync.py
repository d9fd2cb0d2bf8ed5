"""The barrier that `ninfer.cpu.step.forward_layers`' threads meet at between stages.

Each thread marks a slot per round, waits, then reads every thread's mark of that round; a
second wait keeps a fast thread from marking the next round before the others have read.
A barrier that let a thread through early shows as a stale mark read, or as counters that do
not add up (one generation per wait, no arrival left counted)."""

from __future__ import annotations

import numba
import numpy as np
import pytest
from numba import njit, prange

from ninfer.cpu.sync import atomic_add, atomic_load, barrier, safe_layer


@njit(parallel=True)
def _rounds(num_threads, rounds, stale, sync):
    marks = np.zeros(num_threads * 8, np.int64)  # a cache line per thread
    for tid in prange(num_threads):
        for r in range(1, rounds + 1):
            marks[tid * 8] = r
            barrier(sync, num_threads)
            for other in range(num_threads):
                if marks[other * 8] != r:
                    stale[tid] += 1
            barrier(sync, num_threads)


@pytest.mark.parametrize("num_threads", [1, 2])
def test_every_thread_sees_every_mark_of_its_round(num_threads):
    if num_threads > numba.config.NUMBA_NUM_THREADS:
        pytest.skip(f"numba's pool has {numba.config.NUMBA_NUM_THREADS} threads")
    numba.set_num_threads(num_threads)
    stale, sync = np.zeros(num_threads, np.int64), np.zeros(2, np.int64)
    _rounds(num_threads, 2000, stale, sync)
    assert safe_layer()  # the pool runs one iteration a thread, as the barrier needs
    assert stale.tolist() == [0] * num_threads
    # one thread never waits: the barrier returns at once; with more, every wait is a generation
    assert sync.tolist() == [0, 0 if num_threads == 1 else 4000]


@njit
def _atomics(values):
    old = atomic_add(values, 1, 5)
    return old, atomic_load(values, 1), atomic_add(values, 0, -2)


def test_the_atomics_add_and_read():
    values = np.array([7, 3], np.int64)
    assert _atomics(values) == (3, 8, 7)
    assert values.tolist() == [5, 8]


def test_the_barrier_threads_follow_the_layer_and_openmp_settings(monkeypatch):
    """The step meets at barriers with as many threads as the region surely gets: all asked for
    under omp / workqueue, none more than OMP_THREAD_LIMIT, one under OMP_DYNAMIC=true (omp)."""
    from ninfer.cpu.sync import barrier_threads, layer_name

    for name in ("OMP_DYNAMIC", "OMP_THREAD_LIMIT"):
        monkeypatch.delenv(name, raising=False)
    assert barrier_threads(2) == 2 and barrier_threads(1) == 1
    monkeypatch.setenv("OMP_THREAD_LIMIT", "1")
    assert barrier_threads(2) == (1 if layer_name() == "omp" else 2)
    monkeypatch.delenv("OMP_THREAD_LIMIT")
    monkeypatch.setenv("OMP_DYNAMIC", "TRUE")
    assert barrier_threads(4) == (1 if layer_name() == "omp" else 4)
