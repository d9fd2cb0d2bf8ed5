"""Causal GQA attention over the paged KV pool, one (query token, head) pair per task.

`paged_attention` serves both of the reference runner's cases: a prefill row's queries (all
sharing one page table, each seeing the positions up to its own) and a batch of decode rows
(one table each). Query head h reads KV head h // group; position p of a table lives in page
table[p // page_size], slot p % page_size. Scores are scaled by `scale`, softmaxed in float32
(max-subtracted), and weight the values; the reference runner's numpy `_attend` /
`_attend_singles` are its twins (the tests compare the runners).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

_LOWEST = np.float32(-3.0e38)  # fastmath assumes no infinities: start the running max here


@njit(cache=True, fastmath=True)
def attend_one(k_pool, v_pool, q, i, h, table, n, group, scale, out):
    """out[i, h]: query i's head h over positions 0 .. n - 1 of page table `table` (one task of
    `paged_attention`)."""
    head_dim, page_size, kv = q.shape[2], k_pool.shape[1], h // group
    scores = np.empty(n, np.float32)
    best = _LOWEST
    for p in range(n):  # indexed in place: a view per position costs two runtime calls
        page, slot = table[p // page_size], p % page_size
        s = np.float32(0.0)
        for d in range(head_dim):
            s += q[i, h, d] * k_pool[page, slot, kv, d]
        scores[p] = s * scale
        best = max(best, scores[p])
    total = np.float32(0.0)
    for p in range(n):
        scores[p] = np.exp(scores[p] - best)
        total += scores[p]
    acc = np.zeros(head_dim, np.float32)
    for p in range(n):
        page, slot, weight = table[p // page_size], p % page_size, scores[p]
        for d in range(head_dim):
            acc[d] += weight * v_pool[page, slot, kv, d]
    for d in range(head_dim):
        out[i, h, d] = acc[d] / total


# Below this many multiply-adds (queries x heads x positions x head_dim) one thread attends:
# a parallel launch costs microseconds to tens of them on a busy machine, about the work of one
# short-context decode token.
PARALLEL_FROM = 1 << 18


@njit(parallel=True, cache=True)
def paged_attention(k_pool, v_pool, q, tables, table_of, lengths, group, scale, out, num_threads):
    """out[i, h] = softmax(q[i, h] . K * scale) V over positions 0 .. lengths[i] - 1 of
    page table tables[table_of[i]]; k_pool / v_pool [pages, page_size, kv heads, head_dim],
    q / out [N, heads, head_dim]. One (query, head) task per iteration; one thread runs them
    without the parallel launch (one thread asked for, or less than `PARALLEL_FROM` work)."""
    num_queries, num_heads, head_dim = q.shape
    tasks = num_queries * num_heads
    if num_threads == 1 or tasks * lengths.max() * head_dim < PARALLEL_FROM:
        attend_tasks(k_pool, v_pool, q, tables, table_of, lengths, group, scale, out, 0, tasks)
        return
    for task in prange(tasks):
        attend_tasks(k_pool, v_pool, q, tables, table_of, lengths, group, scale, out, task, task + 1)


@njit(cache=True)
def attend_tasks(k_pool, v_pool, q, tables, table_of, lengths, group, scale, out, first, stop):
    """Tasks first .. stop - 1 of `paged_attention` (task = query x heads + head)."""
    num_heads = q.shape[1]
    for task in range(first, stop):
        i, h = task // num_heads, task % num_heads
        attend_one(k_pool, v_pool, q, i, h, tables[table_of[i]], lengths[i], group, scale, out)
