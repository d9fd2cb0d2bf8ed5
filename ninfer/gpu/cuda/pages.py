"""Whole-page moves inside the KV pool and to / from a staging area (all layers at once).

The pool of one of K / V is viewed as [layers, pages, page_elems]; `page_copy` duplicates
pages (copy-on-write of a shared tail), `page_gather` / `page_scatter` move pages to and from a
contiguous [layers, n, page_elems] staging array (snapshots to pinned host memory).
"""

from __future__ import annotations

import numpy as np
from numba import cuda, types

from ninfer.gpu.cuda.kernels.intrinsics import SIMULATOR
from ninfer.gpu.cuda.kernels.jit import compiled

THREADS = 32 if SIMULATOR else 256


def page_copy_fn(pool, src, dst):
    i = cuda.blockIdx.x
    layer = cuda.blockIdx.y
    for e in range(cuda.threadIdx.x, pool.shape[2], cuda.blockDim.x):
        pool[layer, dst[i], e] = pool[layer, src[i], e]


def page_gather_fn(pool, ids, stage):
    i = cuda.blockIdx.x
    layer = cuda.blockIdx.y
    for e in range(cuda.threadIdx.x, pool.shape[2], cuda.blockDim.x):
        stage[layer, i, e] = pool[layer, ids[i], e]


def page_scatter_fn(stage, ids, pool):
    i = cuda.blockIdx.x
    layer = cuda.blockIdx.y
    for e in range(cuda.threadIdx.x, pool.shape[2], cuda.blockDim.x):
        pool[layer, ids[i], e] = stage[layer, i, e]


@compiled
def _kernel(name):
    return cuda.jit({"copy": page_copy_fn, "gather": page_gather_fn, "scatter": page_scatter_fn}[name])


def page_copy(pool3, src, dst, n, stream=0):
    if n:
        _kernel("copy")[(n, pool3.shape[0]), THREADS, stream](pool3, src, dst)


def page_gather(pool3, ids, stage3, n, stream=0):
    if n:
        _kernel("gather")[(n, pool3.shape[0]), THREADS, stream](pool3, ids, stage3)


def page_scatter(stage3, ids, pool3, n, stream=0):
    if n:
        _kernel("scatter")[(n, pool3.shape[0]), THREADS, stream](stage3, ids, pool3)


def page_copy_ref(pool3: np.ndarray, src, dst) -> None:
    pool3[:, np.asarray(dst)] = pool3[:, np.asarray(src)]


def ptx_cases():
    cases = []
    for t in (types.float16, types.float32):
        a3 = types.Array(t, 3, "C")
        i1 = types.int32[::1]
        cases += [
            (f"page_copy_{t}", page_copy_fn, (a3, i1, i1)),
            (f"page_gather_{t}", page_gather_fn, (a3, i1, a3)),
            (f"page_scatter_{t}", page_scatter_fn, (a3, i1, a3)),
        ]
    return cases
