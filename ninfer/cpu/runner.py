"""`CpuRunner`: the reference runner's forward, with its weights left in their stored form.

`ReferenceRunner` builds its layers through `_float` / `_transposed` and multiplies with `@`;
this runner hands its constructor a view of the weights in which every matrix "dequantizes"
to a `QuantMatrix` (`matrix.py`), so the same forward, paging, sampling and page copies run
unchanged while every linear (and the tied head) runs numba kernels over the GGUF blocks and
only looked-up embedding rows are ever dequantized. Norm vectors and biases are float32.
Attention over the paged KV is a numba kernel too (`attention.py`).

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
from ninfer.cpu.matrix import QuantMatrix
from ninfer.gpu.blas import available_cores
from ninfer.gpu.reference import ReferenceRunner, spec_and_weights
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
        if spec.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"the cpu backend runs {', '.join(SUPPORTED_ARCHS)} models, not {spec.arch}")
        self.num_threads = num_threads or default_num_threads()
        kept = ModelWeights({name: _Kept(t) for name, t in weights.items()}, weights.num_layers)
        super().__init__((spec, kept), num_pages=num_pages, page_size=page_size)

    def _transposed(self, *tensors: _Kept) -> object:
        """[in, out] operand of the fused linear (parts stacked along out, none copied)."""
        return QuantMatrix([t.stored for t in tensors]).T

    def _step(self, rows: Sequence[StepRow]) -> list[SampledToken | None]:
        numba.set_num_threads(self.num_threads)
        return super()._step(rows)

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
        paged_attention(self._k[slot], self._v[slot], q, np.ascontiguousarray(tables, np.int64),
                        table_of, np.asarray(lengths, np.int64), spec.group_size, scale, out)  # fmt: skip
        return out.reshape(q.shape[0], spec.q_dim)

