"""Python's garbage collector on a serving process: fewer, shorter pauses of the event loop.

A warm server holds a few hundred thousand long-lived objects (the model's tables, numba's and
cuda-python's, every captured graph). Python's collector walks all of them in each full
collection, and the event loop, with the step task that feeds the GPU, stands still meanwhile;
its young generation fills every 700 allocations, a few times per streamed token. Once the
server is warm, `quiet` freezes what is alive (`gc.freeze`: the collector skips those objects
from then on) and lets the young generation grow to YOUNG_THRESHOLD objects between
collections. Objects made afterwards are collected as before, cycles included.

`PAUSES` counts every collection and the time it held the process, per generation, while a
server runs; `/metrics` reports them (`ninfer_gc_pause_seconds_total`).
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time

YOUNG_THRESHOLD = 20_000  # allocations between young-generation collections (Python's default: 700)


class PauseClock:
    """Collections and their seconds per generation, from `gc.callbacks`."""

    def __init__(self):
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            generation = info["generation"]
            self.collections[generation] += 1
            self.seconds[generation] += time.perf_counter() - self._started


PAUSES = PauseClock()
_lock = threading.Lock()
_users = {"clock": 0, "freeze": 0}
_saved_threshold: tuple[int, ...] = ()


@contextlib.contextmanager
def quiet(freeze: bool = True, collect: bool = False):
    """While inside: PAUSES counts collections; with `freeze`, the heap alive at entry is frozen
    and the young generation's threshold raised (`collect` first collects what is garbage
    already, so it is not frozen with the rest). Servers in one process may nest or overlap:
    the first to enter sets up, the last to leave restores Python's settings."""
    global _saved_threshold
    with _lock:
        if _users["clock"] == 0:
            gc.callbacks.append(PAUSES)
        _users["clock"] += 1
        if freeze:
            if collect:
                gc.collect()
            if _users["freeze"] == 0:
                _saved_threshold = gc.get_threshold()
                gc.set_threshold(max(YOUNG_THRESHOLD, _saved_threshold[0]), *_saved_threshold[1:])
            gc.freeze()  # what was made since another server froze its heap joins the frozen part
            _users["freeze"] += 1
    try:
        yield PAUSES
    finally:
        with _lock:
            if freeze:
                _users["freeze"] -= 1
                if _users["freeze"] == 0:
                    gc.set_threshold(*_saved_threshold)
                    gc.unfreeze()
            _users["clock"] -= 1
            if _users["clock"] == 0:
                gc.callbacks.remove(PAUSES)
