"""The CUDA runner's warm-up covers every graph key a server can ask for (no GPU needed: the
keys are computed by the runner's own bucketing, on random engine-like steps)."""

from __future__ import annotations

import types

import numpy as np
import pytest

from ninfer.core.runner import StepRow
from ninfer.gpu.cuda.buffers import Limits
from ninfer.gpu.cuda.runner import CudaRunner, _split_len, _warm_rows, _warm_shapes
from ninfer.gpu.cuda.staging import plan_pieces


def fake_runner(*, max_context: int, num_pages: int, page_size: int = 16, max_rows: int = 64, max_tokens: int = 4096):
    r = types.SimpleNamespace(max_context=max_context, num_pages=num_pages, page_size=page_size)
    split = _split_len(max_context)
    r.limits = Limits(max_tokens=max_tokens, max_rows=max_rows, max_pages_per_row=-(-max_context // page_size),
                      max_splits=-(-max_context // split))  # fmt: skip
    r.forward = types.SimpleNamespace(split_len=split)
    r._splits = types.MethodType(CudaRunner._splits, r)
    return r


def keys_of(runner, rows) -> set:
    keys = set()
    for batch in plan_pieces(rows, runner.limits, runner.page_size):
        decode = all(p.count == 1 for p in batch)
        keys.add(CudaRunner._graph_key(runner, rows, batch, decode))
    return keys


def warm_keys(runner, max_rows: int) -> set:
    keys = set()
    for kind, num_rows, length in _warm_shapes(runner, max_rows, runner.max_context):
        if kind == "decode":
            for start in (length - 2, length - 1):
                keys |= keys_of(runner, _warm_rows(num_rows, [1] * num_rows, start, runner.page_size))
        else:
            counts = [length // num_rows + (i < length % num_rows) for i in range(num_rows)]
            keys |= keys_of(runner, _warm_rows(num_rows, counts, 0, runner.page_size))
    return keys


def random_step(rng, runner, max_rows: int) -> list[StepRow]:
    num_rows = int(rng.integers(1, max_rows + 1))
    budget = runner.limits.max_tokens
    rows = []
    for i in range(num_rows):
        prefill = rng.random() < 0.3 and budget > num_rows
        count = int(rng.integers(2, min(budget - (num_rows - i), runner.max_context) + 1)) if prefill else 1
        count = max(1, min(count, budget - (num_rows - i - 1)))
        budget -= count
        start = int(rng.integers(0, runner.max_context - count + 1))
        rows.append(StepRow(seq_id=i, token_ids=np.zeros(count, np.int32), start_pos=start,
                            page_table=np.arange(-(-(start + count) // runner.page_size), dtype=np.int32)))  # fmt: skip
    return rows


@pytest.mark.parametrize("max_context, max_rows, max_tokens", [(8192, 64, 4096), (256, 8, 4096), (3000, 16, 1000)])
def test_warm_up_covers_every_key_a_step_can_take(max_context, max_rows, max_tokens):
    runner = fake_runner(max_context=max_context, num_pages=1 << 16, max_rows=64, max_tokens=max_tokens)
    warm = warm_keys(runner, max_rows)
    rng = np.random.default_rng(max_context)
    for _ in range(3000):
        step = random_step(rng, runner, max_rows)
        missing = keys_of(runner, step) - warm
        assert not missing, f"not warmed: {missing} (rows {[(r.start_pos, len(r.token_ids)) for r in step]})"


def test_warm_rows_fit_a_small_pool():
    runner = fake_runner(max_context=8192, num_pages=32, page_size=16)
    for kind, num_rows, length in _warm_shapes(runner, 64, 8192):
        assert length <= 32 * 16 and (kind == "decode" or length <= num_rows * 32 * 16)
