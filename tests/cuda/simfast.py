"""Make numba's CUDA simulator 3-4x faster for the kernel tests.

The simulator runs one Python thread per CUDA thread, and its block manager polls every
thread in a tight loop to detect `syncthreads`, holding the GIL half the time. A 0.2 ms sleep
per polling round hands the GIL to the simulated threads; behaviour is otherwise unchanged.
"""

from __future__ import annotations

import time

import numpy as np


def speed_up_simulator() -> None:
    from numba.cuda.simulator import kernel as sim

    def run(self, grid_point, *args):
        threads, live, blocked = set(), set(), set()
        for block_point in np.ndindex(*self._block_dim):

            def target():
                self._f(*args)

            t = sim.BlockThread(target, self, grid_point, block_point, self._debug)
            t.start()
            threads.add(t)
            live.add(t)
        while live:
            time.sleep(0)
            for t in live:
                if t.syncthreads_blocked:
                    blocked.add(t)
                elif t.exception:
                    for other in threads:
                        other.abort = True
                        other.syncthreads_blocked = False
                        other.syncthreads_event.set()
                    raise t.exception[0].with_traceback(t.exception[1])
            if live == blocked:
                for t in blocked:
                    t.syncthreads_blocked = False
                    t.syncthreads_event.set()
                blocked = set()
            live = {t for t in live if t.is_alive()}
        for t in threads:
            if t.exception:
                raise t.exception[0].with_traceback(t.exception[1])

    sim.BlockManager.run = run
