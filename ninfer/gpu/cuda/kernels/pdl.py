"""Programmatic dependent launch (PDL) inside the captured step graphs (sm_90+).

Between two dependent kernels a graph normally waits for the first to finish and flush before
the second is even launched: a few microseconds a kernel boundary, which the one-stream decode
step (8 kernels a layer, most of them short) pays some 260 times. A *programmatic* edge lets
the second grid launch as soon as every block of the first has run `grid_dep_launch`; its
blocks then load what no kernel writes (step inputs such as page ids and positions, weights:
a GEMV's first weight loads, a norm's weight) and block in `grid_dep_wait` until the first
has completed and its writes are visible. Anything loaded after the wait is a serial round
trip in the step's chain of kernels, so whatever can be requested before it should be.

Capture records ordinary edges; `graphs.GraphCache` turns a kernel-to-kernel edge into a
programmatic one (where KernelPlan.pdl) when the dependent kernel is *aware*: its Python
function is decorated with `aware` here, which promises that every thread calls `grid_dep_wait` before it reads anything a
preceding kernel wrote or writes anything one may still read, and that every block reaches a
`grid_dep_wait` (so a grid never completes before the one it depends on: completion stays
transitive along a chain of programmatic edges). Edges into other kernels stay as captured.
"""

from __future__ import annotations

import re

KERNELS: set[str] = set()  # names of the aware kernels' Python functions


def aware(fn):
    """Mark a kernel's Python function as PDL-aware (see the module docstring)."""
    KERNELS.add(fn.__name__)
    return fn


_NAME = re.compile(r"(\d+)")


def python_name(mangled: str) -> str | None:
    """The Python function name inside a numba kernel's mangled symbol (the last length-prefixed
    identifier before the ABI tags 'B...' or the argument list 'E...'), None if not numba's."""
    if not mangled.startswith("_ZN"):
        return None
    i, last = 3, None
    while i < len(mangled):
        m = _NAME.match(mangled, i)
        if not m:
            break
        n = int(m.group(1))
        start = m.end()
        last = mangled[start : start + n]
        i = start + n
        if i < len(mangled) and mangled[i] in "BE":
            return last
    return last


def is_aware(mangled: str) -> bool:
    return python_name(mangled) in KERNELS
