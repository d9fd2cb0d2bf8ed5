"""A spinning barrier for the threads of one parallel region (numba intrinsics over LLVM atomics).

A decode step's products are small (a SmolLM2 layer's four matrices are 0.2-1.1 MB each), so
one parallel launch per product (numba's gufunc scheduling: ~2.5-4.5 us on this kind of
machine, more when the pool's threads have gone to sleep) plus the serial glue between them
kept two threads at ~8 GB/s where one pass over the same rows runs at ~11-13. `step.py`
launches once per step instead: every thread walks all layers and the threads meet at
`barrier` between the stages that read each other's output.

The barrier is the central counter kind: `sync` [2] int64 holds the arrivals and a generation
number. Each thread reads the generation, then counts itself in; the last to arrive resets the
count and bumps the generation (both sequentially consistent, so every write before the
barrier is seen after it); the others spin on the generation, with the CPU's pause hint, and
give their core back (`sched_yield`) every `YIELD_EVERY` spins: a thread whose partner was
descheduled on a busy machine must not burn the core that partner needs.

It is only safe when each iteration of the enclosing `prange(num_threads)` runs on a thread of
its own: numba's omp and workqueue layers give each thread one equal chunk (`safe_layer`).
"""

from __future__ import annotations

import os
import platform
import sys

import numba
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

YIELD_EVERY = 4096  # pause hints between yields: ~100 us on x86 (the pause takes tens of cycles)
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
_HAS_YIELD = sys.platform != "win32"


def _item_pointer(context, builder, aryty, ary, idx):
    array = context.make_array(aryty)(context, builder, ary)
    return cgutils.get_item_pointer(context, builder, aryty, array, [idx])


def _int64_vector(arr) -> bool:
    return isinstance(arr, types.Array) and arr.ndim == 1 and arr.dtype == types.int64


@intrinsic
def atomic_add(typingctx, arr, idx, value):
    """arr[idx] += value atomically (sequentially consistent); returns the old value."""
    if not _int64_vector(arr):
        return None
    sig = types.int64(arr, types.intp, types.int64)

    def codegen(context, builder, sig, args):
        ptr = _item_pointer(context, builder, sig.args[0], args[0], args[1])
        return builder.atomic_rmw("add", ptr, args[2], "seq_cst")

    return sig, codegen


@intrinsic
def atomic_load(typingctx, arr, idx):
    """arr[idx], read atomically with acquire order (a spin loop's read is never hoisted)."""
    if not _int64_vector(arr):
        return None
    sig = types.int64(arr, types.intp)

    def codegen(context, builder, sig, args):
        ptr = _item_pointer(context, builder, sig.args[0], args[0], args[1])
        return builder.load_atomic(ptr, "acquire", 8)

    return sig, codegen


@intrinsic
def spin_hint(typingctx):
    """The CPU's spin-wait hint (x86 `pause`); nothing elsewhere."""

    def codegen(context, builder, sig, args):
        if _X86:
            pause = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                   "llvm.x86.sse2.pause")  # fmt: skip
            builder.call(pause, [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def yield_core(typingctx):
    """sched_yield(): let another runnable thread have this core (nothing on Windows)."""

    def codegen(context, builder, sig, args):
        if _HAS_YIELD:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen


@njit(inline="always")
def barrier(sync, num_threads):
    """Wait until all `num_threads` threads of the region arrived (`sync`: zeros(2, int64),
    shared by them; reusable at once)."""
    if num_threads <= 1:
        return
    generation = atomic_load(sync, 1)
    if atomic_add(sync, 0, 1) == num_threads - 1:
        atomic_add(sync, 0, -num_threads)
        atomic_add(sync, 1, 1)
        return
    spins = 0
    while atomic_load(sync, 1) == generation:
        spin_hint()
        spins += 1
        if spins >= YIELD_EVERY:
            yield_core()
            spins = 0


SAFE_LAYERS = ("omp", "workqueue")


def layer_name() -> str:
    """numba's threading layer (starting the pool first if no parallel region has run)."""
    try:
        return numba.threading_layer()
    except ValueError:  # no parallel region has run yet: start the pool to learn its layer
        from numba.np.ufunc import parallel

        parallel._launch_threads()
        return numba.threading_layer()


def safe_layer() -> bool:
    """Whether numba's threading layer runs each of `prange(num_threads)`'s iterations on a
    thread of its own (omp, workqueue: one static chunk a thread), as `barrier` needs; tbb's
    work stealing may run two on one thread, which would wait for itself."""
    return layer_name() in SAFE_LAYERS


def barrier_threads(requested: int) -> int:
    """How many threads may meet at `barrier` in one region: `requested` under a `safe_layer`,
    else 1. Under omp, OpenMP's own settings may give a region fewer threads than asked:
    OMP_DYNAMIC=true (the runtime sizes teams by the machine's load) makes it 1, and
    OMP_THREAD_LIMIT caps it."""
    if not safe_layer():
        return 1
    if layer_name() == "omp":
        if os.environ.get("OMP_DYNAMIC", "").strip().lower() == "true":
            return 1
        limit = os.environ.get("OMP_THREAD_LIMIT", "").strip()
        if limit.isdigit() and int(limit) >= 1:
            return max(1, min(requested, int(limit)))
    return max(1, requested)
