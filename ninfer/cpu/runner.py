"""`CpuRunner`: the reference runner's forward, with its weights left in their stored form.

`ReferenceRunner` builds its layers through `_float` / `_transposed` and multiplies with `@`;
this runner hands its constructor a view of the weights in which every matrix "dequantizes"
to a `QuantMatrix` (`matrix.py`), so the same forward, paging, sampling and page copies run
unchanged while every linear (and the tied head) runs numba kernels over the GGUF blocks and
only looked-up embedding rows are ever dequantized. Norm vectors and biases are float32.
Attention over the paged KV is a numba kernel too (`attention.py`). Decode batches (fewer than
`BLAS_FROM` tokens) of llama / qwen2 models go through all layers in one numba call
(`step.py`), bit for bit the per-layer path.

Threads: numba's pool, sized per step to `num_threads` (numba's count is per calling thread,
and steps run on trio's worker threads; see `default_num_threads`). BLAS (F32 weights) keeps
the single thread `ninfer.gpu.blas` gives it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import attrs
import numba
import numpy as np

from ninfer.core.runner import SampledToken, StepRow
from ninfer.cpu.attention import paged_attention
from ninfer.cpu.fused import add_norm_quant, rope_store, swiglu_quant
from ninfer.cpu.blocks import F16_TABLE
from ninfer.cpu.matrix import BLAS_FROM, QuantMatrix
from ninfer.cpu.step import LayerTables, forward_layers, query_tables
from ninfer.cpu.sync import barrier_threads
from ninfer.gpu.blas import available_cores
from ninfer.gpu.reference import ReferenceRunner, rms_norm, spec_and_weights
from ninfer.models.weights import ModelWeights, StoredTensor

logger = logging.getLogger(__name__)
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")  # the reference forward's dense decoders


def default_num_threads() -> int:
    """`$NINFER_CPU_THREADS`, else one thread fewer than the cores this process may use (at
    least one, at most numba's pool): as for BLAS (`ninfer.gpu.blas`), a core is left to the
    event loop and the rest of the machine. On a busy 2-core machine a parallel region whose
    second thread waits for a core took milliseconds per product: one thread ran a SmolLM2
    decode step 30x faster than two there."""
    chosen = os.environ.get("NINFER_CPU_THREADS", "").strip()
    if chosen.isdigit() and int(chosen) >= 1:
        return min(int(chosen), numba.config.NUMBA_NUM_THREADS)
    if chosen:
        logger.warning("ignoring NINFER_CPU_THREADS=%r: it takes a whole number of threads >= 1", chosen)
    return max(1, min(available_cores() - 1, numba.config.NUMBA_NUM_THREADS))


_NO_ROWS = np.zeros((0, 0), np.float32)
REFINE_MARGIN, REFINE_MAX = 1.0, 64  # `CpuRunner._head_logits`: ten times q8's largest error seen


def runs_on_cpu(spec) -> bool:
    """Whether `CpuRunner` runs a model of this spec (the reference forward's dense decoders)."""
    return spec.arch in SUPPORTED_ARCHS and not spec.is_hybrid


def _q8(num_tokens: int, width: int, quantize: bool):
    """Buffers for the q8 codes of [num_tokens, width] activations (no rows: not wanted)."""
    rows = num_tokens if quantize else 0
    return np.empty((rows, width), np.int8), np.empty((rows, width // 32), np.float32), np.empty(
        (rows, width // 32), np.float32
    )


@attrs.frozen(eq=False)
class _Kept:
    """A stored tensor whose `dequantize()` keeps matrices stored (as a `QuantMatrix`)."""

    stored: StoredTensor

    def dequantize(self):
        if len(self.stored.shape) == 1:
            return self.stored.dequantize()
        return QuantMatrix([self.stored])


class CpuRunner(ReferenceRunner):
    """`Runner` on the CPU: stored (quantized) weights, numba kernels, the reference's forward."""

    def __init__(self, model, *, num_pages: int, page_size: int = 16, num_threads: int | None = None):
        spec, weights = spec_and_weights(model)
        if not runs_on_cpu(spec):
            raise ValueError(f"the cpu backend runs {', '.join(SUPPORTED_ARCHS)} models, not {spec.arch}")
        self.num_threads = num_threads or default_num_threads()
        kept = ModelWeights({name: _Kept(t) for name, t in weights.items()}, weights.num_layers)
        super().__init__((spec, kept), num_pages=num_pages, page_size=page_size)
        self._fused_glue = self._fusable()  # asked once, not per layer and step
        self._layer_tables = LayerTables.build(self._layers) if self._fused_glue else None
        self._step_threads: int | None = None  # forward_layers' threads (`sync.barrier_threads`)

    def warm_up(self, *, progress: bool = False) -> None:
        """Compile every kernel a step can reach, or load it from numba's disk cache (a first
        start compiles for minutes on a small machine; later ones load in about a second): a
        greedy-sampled prompt of `BLAS_FROM` tokens (the prefill path) and one decode token (the
        one-call forward) on the first pages, which no sequence owns before the engine opens."""
        import time

        from ninfer.core.params import SamplingParams
        from ninfer.core.runner import SampleSpec

        started = time.perf_counter()
        if progress:
            logger.info("cpu backend: loading its kernels (the first start compiles them: minutes)")
        length = min(BLAS_FROM, self.spec.max_context - 1, self.num_pages * self.page_size - 1)
        table = np.arange(self.num_pages, dtype=np.int32)
        sample = SampleSpec(params=SamplingParams(temperature=0.0), seed=0, token_index=0)
        if length >= 1:
            self.step([StepRow(seq_id=0, token_ids=np.zeros(length, np.int32), start_pos=0, page_table=table,
                               sample=sample)])  # fmt: skip
            self.step([StepRow(seq_id=0, token_ids=np.zeros(1, np.int32), start_pos=length, page_table=table,
                               sample=sample)])  # fmt: skip
        if progress:
            logger.info("cpu backend: kernels ready in %.1f s", time.perf_counter() - started)

    def _fusable(self) -> bool:
        """Whether `_layer_forward` fuses this model's glue (llama / qwen2 attention layers)."""
        spec = self.spec
        mixer = self._layers[0].mixer
        return mixer.q_norm is None and not spec.has_attn_gate and spec.rotary_dim == spec.head_dim

    def _transposed(self, *tensors: _Kept) -> object:
        """[in, out] operand of the fused linear (parts stacked along out, none copied)."""
        return QuantMatrix([t.stored for t in tensors]).T

    def _step(self, rows: Sequence[StepRow]) -> list[SampledToken | None]:
        numba.set_num_threads(self.num_threads)
        return super()._step(rows)

    def _layers_forward(self, x: np.ndarray, rows, batch, kept: set[int]) -> tuple[np.ndarray, dict]:
        """A batch below `BLAS_FROM` tokens (decode) goes through every layer in one numba call
        (`step.py`) unless a layer's output is asked for; prefill takes `_layer_forward`."""
        if self._layer_tables is None or kept or x.shape[0] >= BLAS_FROM:
            return super()._layers_forward(x, rows, batch, kept)
        spec, t = self.spec, self._layer_tables
        if self._step_threads is None:  # asked once the pool exists (the first step starts it)
            self._step_threads = barrier_threads(self.num_threads)
        # never more threads than the region will have: two iterations on one thread would
        # wait at the first barrier for themselves (`_step` sets the count; direct callers may not)
        threads = min(self._step_threads, numba.get_num_threads())
        tables, table_of, lengths = query_tables(rows, self.page_size)
        x = forward_layers(np.ascontiguousarray(x, np.float32), t.parts, t.qtypes, t.cols, t.bounds, t.norms,
                           t.biases, t.slots, self._k, self._v, np.ascontiguousarray(batch.cos[:, 0]),
                           np.ascontiguousarray(batch.sin[:, 0]), batch.pages, batch.slots, tables, table_of, lengths,
                           spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.d_ffn, np.float32(spec.rms_eps),
                           np.float32(1.0 / np.sqrt(spec.head_dim)), F16_TABLE, threads)  # fmt: skip
        return x, {}

    def _layer_forward(self, layer, x: np.ndarray, rows, batch) -> np.ndarray:
        """The reference's layer (same math, same order), its steps between the products fused
        (`fused.py`) and each product's input quantized once, by the step that makes it."""
        spec, mixer = self.spec, layer.mixer
        if not self._fused_glue:
            return super()._layer_forward(layer, x, rows, batch)  # qwen3's q/k norms: numpy glue
        num_tokens, eps, threads = x.shape[0], np.float32(spec.rms_eps), self.num_threads
        quantize = num_tokens < BLAS_FROM  # else the products take float x (BLAS)
        q8_model, q8_ffn = _q8(num_tokens, spec.d_model, quantize), _q8(num_tokens, spec.d_ffn, quantize)
        h = np.empty_like(x)
        add_norm_quant(x, _NO_ROWS, layer.attn_norm, eps, x, h, *q8_model)
        qkv = mixer.w_qkv.matrix.matmul_t(h, q8_model, threads)
        if mixer.b_qkv is not None:
            qkv += mixer.b_qkv
        q = np.empty((num_tokens, spec.num_heads, spec.head_dim), np.float32)
        rope_store(qkv, spec.q_dim, spec.kv_dim, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                   np.ascontiguousarray(batch.cos[:, 0]), np.ascontiguousarray(batch.sin[:, 0]),
                   self._k[layer.slot], self._v[layer.slot], batch.pages, batch.slots, q)  # fmt: skip
        attn = np.empty((num_tokens, spec.q_dim), np.float32)
        for r in batch.multi_rows:
            lo, hi = batch.row_starts[r], batch.row_starts[r + 1]
            attn[lo:hi] = self._attend(layer.slot, rows[r], q[lo:hi])
        if batch.single_tokens.size:
            attn[batch.single_tokens] = self._attend_singles(layer.slot, q[batch.single_tokens], batch)
        new_x = np.empty_like(x)
        add_norm_quant(x, mixer.w_o.matrix.matmul_t(attn, None, threads), layer.ffn_norm, eps, new_x, h, *q8_model)
        gate_up = layer.w_gate_up.matrix.matmul_t(h, q8_model, threads)
        act = np.empty((num_tokens, spec.d_ffn), np.float32)
        swiglu_quant(gate_up, spec.d_ffn, act, *q8_ffn)
        new_x += layer.w_down.matrix.matmul_t(act, q8_ffn, threads)
        return new_x

    def _head_logits(self, x_last: np.ndarray) -> np.ndarray:
        """The reference's head over q8 activations, then each token's contenders recomputed
        in float32: q8 logits stray up to ~0.1 from the float ones, enough to flip a near-tie
        at the top (a chat prompt's first token: 'The' 0.09 nats above 'L'). Every logit
        within `REFINE_MARGIN` of a token's best (at most `REFINE_MAX` of them) gets the
        float32 product of its dequantized head row: greedy picks and the top log-probabilities
        are the float head's, for the price of a few rows."""
        hidden = rms_norm(x_last, self._final_norm, self.spec.rms_eps)
        logits = (hidden @ self._head.T).astype(np.float32, copy=False)
        if not isinstance(self._head, QuantMatrix) or hidden.shape[0] >= BLAS_FROM:
            return logits  # float weights, or BLAS over float activations: exact already
        for t in range(logits.shape[0]):
            near = np.flatnonzero(logits[t] >= logits[t].max() - REFINE_MARGIN)
            if near.size > REFINE_MAX:
                near = near[np.argpartition(logits[t, near], -REFINE_MAX)[-REFINE_MAX:]]
            logits[t, near] = self._head[near] @ hidden[t]
        return logits

    def _attend(self, slot: int, row: StepRow, q: np.ndarray) -> np.ndarray:
        """A prefill row's causal attention: query i (position start_pos + i) sees positions
        0 .. start_pos + i of the row's pages."""
        num_new = q.shape[0]
        lengths = row.start_pos + 1 + np.arange(num_new, dtype=np.int64)
        table = np.asarray(row.page_table, dtype=np.int64)[None, : -(-int(lengths[-1]) // self.page_size)]
        return self._paged(slot, q, table, np.zeros(num_new, np.int64), lengths)

    def _attend_singles(self, slot: int, q: np.ndarray, batch) -> np.ndarray:
        """Decode rows: row r's one query sees its first single_lengths[r] positions."""
        rows = np.arange(q.shape[0], dtype=np.int64)
        return self._paged(slot, q, batch.single_tables, rows, batch.single_lengths)

    def _paged(self, slot, q, tables, table_of, lengths) -> np.ndarray:
        spec = self.spec
        q = np.ascontiguousarray(q, np.float32)
        out = np.empty_like(q)
        scale = np.float32(1.0 / np.sqrt(spec.head_dim))
        paged_attention(self._k[slot], self._v[slot], q, np.ascontiguousarray(tables, np.int64), table_of,
                        np.asarray(lengths, np.int64), spec.group_size, scale, out, self.num_threads)  # fmt: skip
        return out.reshape(q.shape[0], spec.q_dim)

