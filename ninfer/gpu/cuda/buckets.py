"""Shared small pieces of the CUDA runner and the hybrid forward: batch-size and token
buckets (the graph keys pad a step to them), warm-up rows, and zero-filled device arrays."""

from __future__ import annotations

import numpy as np
from numba import cuda

from ninfer.core.params import SamplingParams
from ninfer.core.runner import SampleSpec, StepRow
from ninfer.gpu.cuda.kernels.intrinsics import SIMULATOR


def zeros(shape, dtype, stream):
    """A zero-filled device array, cleared on the device (no host-sized temporary)."""
    if SIMULATOR:
        return cuda.to_device(np.zeros(shape, dtype), stream=stream)
    from ninfer.gpu.cuda.graphs import check, stream_handle
    from cuda.bindings import driver

    arr = cuda.device_array(shape, dtype=dtype, stream=stream)
    check(driver.cuMemsetD8Async(arr.__cuda_array_interface__["data"][0], 0, arr.nbytes, stream_handle(stream)))
    return arr


def warm_rows(num_rows: int, counts: list[int], start_pos: int, page_size: int) -> list[StepRow]:
    """Greedy rows of `counts` zero tokens from `start_pos` (warm-up steps: their results are dropped)."""
    spec = SampleSpec(params=SamplingParams(temperature=0.0), seed=0, token_index=0)
    return [
        StepRow(seq_id=i, token_ids=np.zeros(n, np.int32), start_pos=start_pos,
                page_table=np.arange(-(-(start_pos + n) // page_size), dtype=np.int32), sample=spec)
        for i, n in enumerate(counts)
    ]  # fmt: skip


def bucket(n: int, max_rows: int) -> int:
    return min(1 << (n - 1).bit_length(), max_rows)


def token_bucket(n: int) -> int:
    """Powers of two up to 512 tokens, then multiples of 512 (at most ~2x padding work)."""
    return 1 << (n - 1).bit_length() if n <= 512 else -(-n // 512) * 512
