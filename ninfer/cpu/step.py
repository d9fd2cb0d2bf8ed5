"""Every layer of a small batch in one numba call: the decode forward without Python between ops.

`CpuRunner._layer_forward` runs a layer as ~10 numba calls glued by Python (buffers, the
products' dispatch, the attention's tables). At one SmolLM2 stream that glue cost about as
much per step as all the attention: a third of a step on top of the products. `forward_layers`
runs the same calls for all layers inside one compiled function, in the same order and with
the same kernels (`gemm.gemm_q8`'s row loops, `fused.py`, `attention.paged_attention`'s
tasks), so its result is bit for bit the per-layer path's (the tests hold it there).

Threads: one parallel launch per step, not one per product. Each thread walks every layer,
takes its share of each product's rows and of the attention's (query, head) tasks, and waits
for the others at a spinning barrier (`sync.py`) where a stage reads what another wrote;
thread 0 runs the short glue between. A SmolLM2 decode step has 120 products of 0.2-1.1 MB:
a launch each (~3-5 us, more when the pool's threads slept) held two threads to ~8 GB/s of
weights, against ~11-13 GB/s in one launch.

The weights travel as one typed list of every quantized part of every layer (`LayerTables`,
built once per runner) with per-part type codes and output columns, and per layer and matrix
the range of its parts. Only models whose matrices are all stored in a q8-kernel type take it,
and only batches below `matrix.BLAS_FROM` tokens (prefill goes to BLAS per layer).
"""

from __future__ import annotations

import attrs
import numpy as np
from numba import njit, prange, typed

from ninfer.cpu.attention import attend_tasks
from ninfer.cpu.fused import add_norm_quant, rope_store, swiglu_quant
from ninfer.cpu.gemm import PART_TYPE, gemm_share, quantize_rows
from ninfer.cpu.sync import barrier

MATRICES = 4  # per layer: qkv, o, gate_up, down


@attrs.frozen(eq=False)
class LayerTables:
    """The layers' weights as `forward_layers` takes them."""

    parts: typed.List  # every quantized part of every layer's matrices, in order
    qtypes: np.ndarray  # int64 [parts]: each part's type code (`blocks.QTYPES`)
    cols: np.ndarray  # int64 [parts]: its first output column within its matrix
    bounds: np.ndarray  # int64 [layers, MATRICES + 1]: matrix m of layer l is parts bounds[l, m] .. bounds[l, m + 1] - 1
    norms: np.ndarray  # float32 [layers, 2, d_model]: attention and feed-forward RMSNorm weights
    biases: np.ndarray  # float32 [layers, qkv rows] (q / k / v biases), or [layers, 0]
    slots: np.ndarray  # int64 [layers]: each layer's index into the KV pools

    @classmethod
    def build(cls, layers) -> LayerTables | None:
        """From the runner's layers, or None when a matrix holds a part without a q8 kernel
        (F16 / F32) or of another layout (those take the per-layer path)."""
        parts, qtypes, cols, bounds = typed.List.empty_list(PART_TYPE), [], [], []
        for layer in layers:
            row = []
            for matrix in (layer.mixer.w_qkv.matrix, layer.mixer.w_o.matrix, layer.w_gate_up.matrix, layer.w_down.matrix):
                row.append(len(qtypes))
                if len(matrix._q8_parts) != len(matrix.parts):
                    return None
                for data, qtype, col in zip(matrix._q8_parts, matrix._q8_types, matrix._q8_cols, strict=True):
                    if data.dtype != np.uint8 or data.ndim != 2 or not data.flags.c_contiguous or data.flags.writeable:
                        return None
                    parts.append(data)
                    qtypes.append(qtype)
                    cols.append(col)
            bounds.append([*row, len(qtypes)])
        has_bias = layers[0].mixer.b_qkv is not None
        qkv_rows = layers[0].mixer.w_qkv.matrix.shape[0]
        return cls(
            parts=parts,
            qtypes=np.array(qtypes, np.int64),
            cols=np.array(cols, np.int64),
            bounds=np.array(bounds, np.int64),
            norms=np.array([[layer.attn_norm, layer.ffn_norm] for layer in layers], np.float32),
            biases=np.array([layer.mixer.b_qkv for layer in layers], np.float32) if has_bias
            else np.zeros((len(layers), 0), np.float32),
            slots=np.array([layer.slot for layer in layers], np.int64),
        )  # fmt: skip


@njit(parallel=True, cache=True)
def forward_layers(x, parts, qtypes, cols, bounds, norms, biases, slots, k_pools, v_pools, cos, sin, pages,
                   page_slots, tables, table_of, lengths, num_heads, num_kv_heads, head_dim, d_ffn, eps, scale,
                   f16_table, num_threads):  # fmt: skip
    """x [T, d] through every layer -> the last layer's output [T, d] (as `CpuRunner`'s
    per-layer forward: same kernels, same order). k_pools / v_pools: the runner's pools
    [layer slots, pages, page_size, kv heads, head_dim]; cos / sin [T, rotary half]; pages /
    page_slots: where each token's K / V go; query t attends positions 0 .. lengths[t] - 1 of
    page table tables[table_of[t]].

    One parallel launch for the whole step: each of `num_threads` threads (numba's pool must
    have that many, and at most `sync.barrier_threads`) walks every layer, takes its share of each
    product and of the attention, and meets the others at `sync.barrier` between stages;
    thread 0 alone runs the short serial glue (norms, RoPE, SwiGLU, the quantizations)."""
    num_tokens, d = x.shape
    q_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
    # every buffer is made here, before the threads start, and shared by them
    h = np.empty_like(x)
    xq, xd, xs = np.empty((num_tokens, d), np.int8), np.empty((num_tokens, d // 32), np.float32), np.empty(
        (num_tokens, d // 32), np.float32
    )
    fq, fd, fs = np.empty((num_tokens, d_ffn), np.int8), np.empty((num_tokens, d_ffn // 32), np.float32), np.empty(
        (num_tokens, d_ffn // 32), np.float32
    )
    aq, ad, as_ = np.empty((num_tokens, q_dim), np.int8), np.empty((num_tokens, q_dim // 32), np.float32), np.empty(
        (num_tokens, q_dim // 32), np.float32
    )
    qkv = np.empty((num_tokens, q_dim + 2 * kv_dim), np.float32)
    q = np.empty((num_tokens, num_heads, head_dim), np.float32)
    attn = np.empty((num_tokens, num_heads, head_dim), np.float32)
    o = np.empty((num_tokens, d), np.float32)
    gate_up = np.empty((num_tokens, 2 * d_ffn), np.float32)
    act = np.empty((num_tokens, d_ffn), np.float32)
    down = np.empty((num_tokens, d), np.float32)
    residual = np.empty((2, num_tokens, d), np.float32)  # layer l writes residual[l % 2]
    sync = np.zeros(2, np.int64)
    num_threads = max(1, num_threads)
    if num_threads == 1:
        _layers_share(0, 1, sync, x, residual, h, xq, xd, xs, fq, fd, fs, aq, ad, as_, qkv, q, attn, o, gate_up,
                      act, down, parts, qtypes, cols, bounds, norms, biases, slots, k_pools, v_pools, cos, sin,
                      pages, page_slots, tables, table_of, lengths, num_heads, num_kv_heads, head_dim, d_ffn, eps,
                      scale, f16_table)  # fmt: skip
    else:
        for tid in prange(num_threads):
            _layers_share(tid, num_threads, sync, x, residual, h, xq, xd, xs, fq, fd, fs, aq, ad, as_, qkv, q, attn,
                          o, gate_up, act, down, parts, qtypes, cols, bounds, norms, biases, slots, k_pools, v_pools,
                          cos, sin, pages, page_slots, tables, table_of, lengths, num_heads, num_kv_heads, head_dim,
                          d_ffn, eps, scale, f16_table)  # fmt: skip
    return residual[(bounds.shape[0] - 1) % 2]


@njit(cache=True)
def _layers_share(tid, num_threads, sync, x0, residual, h, xq, xd, xs, fq, fd, fs, aq, ad, as_, qkv, q, attn, o,
                  gate_up, act, down, parts, qtypes, cols, bounds, norms, biases, slots, k_pools, v_pools, cos, sin,
                  pages, page_slots, tables, table_of, lengths, num_heads, num_kv_heads, head_dim, d_ffn, eps, scale,
                  f16_table):  # fmt: skip
    """Thread tid's walk through every layer of `forward_layers` (stages apart by barriers)."""
    num_tokens, d = x0.shape
    q_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
    group, tasks = num_heads // num_kv_heads, num_tokens * num_heads
    no_rows = np.zeros((0, 0), np.float32)
    lead = tid == 0
    for layer in range(bounds.shape[0]):
        b, k_pool, v_pool = bounds[layer], k_pools[slots[layer]], v_pools[slots[layer]]
        x = x0 if layer == 0 else residual[(layer - 1) % 2]
        new_x = residual[layer % 2]
        if lead:
            add_norm_quant(x, no_rows, norms[layer, 0], eps, x, h, xq, xd, xs)
        barrier(sync, num_threads)
        gemm_share(tid, num_threads, xq, xd, xs, parts, qtypes, f16_table, qkv, cols, b[0], b[1])
        barrier(sync, num_threads)
        if lead:
            if biases.shape[1]:
                for t in range(num_tokens):
                    for j in range(qkv.shape[1]):
                        qkv[t, j] += biases[layer, j]
            rope_store(qkv, q_dim, kv_dim, num_heads, num_kv_heads, head_dim, cos, sin, k_pool, v_pool, pages,
                       page_slots, q)  # fmt: skip
        barrier(sync, num_threads)
        attend_tasks(k_pool, v_pool, q, tables, table_of, lengths, group, scale, attn,
                     tid * tasks // num_threads, (tid + 1) * tasks // num_threads)  # fmt: skip
        barrier(sync, num_threads)
        if lead:
            quantize_rows(attn.reshape(num_tokens, q_dim), aq, ad, as_)
        barrier(sync, num_threads)
        gemm_share(tid, num_threads, aq, ad, as_, parts, qtypes, f16_table, o, cols, b[1], b[2])
        barrier(sync, num_threads)
        if lead:
            add_norm_quant(x, o, norms[layer, 1], eps, new_x, h, xq, xd, xs)
        barrier(sync, num_threads)
        gemm_share(tid, num_threads, xq, xd, xs, parts, qtypes, f16_table, gate_up, cols, b[2], b[3])
        barrier(sync, num_threads)
        if lead:
            swiglu_quant(gate_up, d_ffn, act, fq, fd, fs)
        barrier(sync, num_threads)
        gemm_share(tid, num_threads, fq, fd, fs, parts, qtypes, f16_table, down, cols, b[3], b[4])
        barrier(sync, num_threads)
        if lead:  # the next layer's first stage is thread 0's too: no barrier between
            for t in range(num_tokens):
                for j in range(d):
                    new_x[t, j] += down[t, j]


def query_tables(rows, page_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tables [rows, max pages], table_of [T], lengths [T]) for `forward_layers`: token i of
    a row (position start_pos + i) sees positions 0 .. start_pos + i of its row's pages."""
    ends = [row.start_pos + len(row.token_ids) for row in rows]
    tables = np.zeros((len(rows), -(-max(ends) // page_size)), np.int64)
    table_of, lengths = [], []
    for r, (row, end) in enumerate(zip(rows, ends, strict=True)):
        used = -(-end // page_size)
        tables[r, :used] = row.page_table[:used]
        table_of.append(np.full(len(row.token_ids), r, np.int64))
        lengths.append(np.arange(row.start_pos + 1, end + 1, dtype=np.int64))
    return tables, np.concatenate(table_of), np.concatenate(lengths)

