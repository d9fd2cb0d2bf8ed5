"""The numpy reference backend: the oracle every other backend matches, and the CPU path.

The forward is the plain dense decoder (llama / qwen2 / qwen3), computed in float32:

    x = embed[token]
    per layer:
        h = rmsnorm(x) * attn_norm                      rmsnorm(x) = x / sqrt(mean(x^2) + eps)
        q, k, v = h @ wq.T (+ bq), h @ wk.T (+ bk), h @ wv.T (+ bv)        per head of head_dim
        q, k = rmsnorm(q) * q_norm, rmsnorm(k) * k_norm                    qwen3 only
        q, k = rope(q, pos), rope(k, pos)    split-half: x * cos + rotate_half(x) * sin,
                                             angle[pos, i] = pos * theta^(-2i / head_dim)
        K/V of every new position are written into its page, then each row attends over
        positions 0 .. its last (causal); query head h reads KV head h // group_size;
        scores scaled by 1 / sqrt(head_dim), softmax in float32
        x = x + attn @ wo.T
        h = rmsnorm(x) * ffn_norm
        x = x + (silu(h @ w_gate.T) * (h @ w_up.T)) @ w_down.T
    logits = (rmsnorm(x) * final_norm) @ head.T          only at rows' last positions
                                                         (the hidden row, when a row wants it)

A row whose SampleSpec asks for them also gets the logits of every position
(`want_all_logits`) and the residual x after chosen layers at every position
(`hidden_layers`; -1 = the final hidden row).

All rows' tokens go through each linear as one [T, d] matmul (BLAS); only attention loops over
rows. Weights are dequantized once at construction. The KV pool holds, per full-attention layer,
`k[num_pages, page_size, num_kv_heads, head_dim]` and `v` alike; position p of a row lives in
page `page_table[p // page_size]`, slot `p % page_size`.

Hybrid models (qwen35, `spec.is_hybrid`) differ in three places: full-attention layers rotate
only the first `spec.rotary_dim` dims of each head and gate their output
(`attn * sigmoid(gate)`, the gate coming out of wq beside q); linear-attention layers run
Gated DeltaNet (`gdn.py`: the chunked form over a prefill row, the recurrent form over the
batch's decode rows) instead of attention; and each sequence carries recurrent state, kept here
by sequence id (`gdn.StateStore`): a row at position 0 starts it, each later row must continue
exactly where it ends, `release_sequence` drops it, `snapshot_state` / `restore_state` copy it
out and back (into the same sequence or another). A step's new states are committed only
once the whole forward succeeded.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from ninfer.core.runner import (
    CheckpointSlots, PageSnapshot, SampledToken, StateSnapshot, StepRow, SyncSubmit, check_hidden_layers,
)
from ninfer.gpu import gdn, sampling
from ninfer.models.spec import LINEAR_ATTENTION, ModelSpec
from ninfer.models.weights import ModelWeights


@attrs.frozen(eq=False)
class _Attention:
    """A full-attention mixer's float weights, each matrix transposed to [in, out] for `x @ w`."""

    w_qkv: np.ndarray  # [d_model, q rows + 2 * kv_dim]: q (with its gate rows), k, v fused
    b_qkv: np.ndarray | None
    q_norm: np.ndarray | None
    k_norm: np.ndarray | None
    w_o: np.ndarray  # [q_dim, d_model]


@attrs.frozen(eq=False)
class _Layer:
    """One decoder block: a token mixer (attention or GDN) and the SwiGLU feed-forward."""

    attn_norm: np.ndarray
    mixer: _Attention | gdn.GdnLayer
    slot: int  # index among layers of its kind: in the KV pool, or in a sequence's GDN states
    ffn_norm: np.ndarray
    w_gate_up: np.ndarray  # [d_model, 2 * d_ffn]: gate then up, fused
    w_down: np.ndarray  # [d_ffn, d_model]


@attrs.frozen(eq=False)
class _Batch:
    """Per-step indices shared by every layer."""

    positions: np.ndarray  # int64 [T]: absolute position of each token
    pages: np.ndarray  # int64 [T]: page holding each token's K/V
    slots: np.ndarray  # int64 [T]: slot within that page
    row_starts: np.ndarray  # int64 [num_rows + 1]: token offsets of each row in the batch
    cos: np.ndarray  # [T, 1, rotary_dim // 2] RoPE cosines at each token's position
    sin: np.ndarray
    multi_rows: tuple[int, ...]  # rows with several new tokens: attended one row at a time
    single_rows: tuple[int, ...]  # rows with one new token (decode): batched
    single_tokens: np.ndarray  # int64 [R]: batch index of each single-token row's token
    single_tables: np.ndarray  # int64 [R, max pages]: their page tables, padded with page 0
    single_lengths: np.ndarray  # int64 [R]: their context lengths (start_pos + 1)
    # per row, per linear-attention layer (hybrids; else empty): advanced layer by layer during
    # the forward, committed to the runner only once the whole step succeeded
    gdn_states: list[list[gdn.GdnState]]


class ReferenceRunner(SyncSubmit):
    """`Runner` on numpy: float32 weights, a preallocated paged KV pool, the reference sampler."""

    def __init__(self, model, *, num_pages: int, page_size: int = 16, dtype=np.float32, checkpoint_slots: int = 0):
        """`checkpoint_slots` (hybrid models): state checkpoints the runner keeps itself
        (`save_checkpoint`); here they are host arrays like any other, so the default is none."""
        spec, weights = spec_and_weights(model)
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be positive, got {num_pages} and {page_size}")
        self.spec: ModelSpec = spec
        self.page_size = page_size
        self.num_pages = num_pages
        self.dtype = np.dtype(dtype)
        self._embed = weights["embed"].dequantize().astype(self.dtype, copy=False)
        # Tied heads reuse the embedding ([vocab, d]); BLAS reads it transposed without a copy.
        self._head = self._embed if spec.tie_embeddings else self._float(weights["lm_head"])
        self._final_norm = self._float(weights["final_norm"])
        self._layers = [self._load_layer(weights, i) for i in range(spec.num_layers)]
        kv_shape = (len(spec.attention_layers), num_pages, page_size, spec.num_kv_heads, spec.head_dim)
        self._k = np.zeros(kv_shape, dtype=self.dtype)
        self._v = np.zeros(kv_shape, dtype=self.dtype)
        self._states = gdn.StateStore(spec.gdn, len(spec.gdn_layers), self.dtype) if spec.is_hybrid else None
        self._checkpoints = CheckpointSlots(checkpoint_slots if spec.is_hybrid else 0)
        self._checkpoint_arrays: dict[int, tuple[np.ndarray, ...]] = {}

    @property
    def page_nbytes(self) -> int:
        """Bytes one page holds over all layers (K and V)."""
        return self.page_size * self.spec.kv_bytes_per_token(self.dtype.itemsize)

    @property
    def weight_nbytes(self) -> int:
        """Bytes of the float weights this runner reads per forward."""
        arrays = [self._embed, self._final_norm, *([] if self._head is self._embed else [self._head])]
        for layer in self._layers:
            parts = [*attrs.astuple(layer, recurse=False), *attrs.astuple(layer.mixer, recurse=False)]
            arrays += [a for a in parts if hasattr(a, "nbytes")]  # arrays (or a subclass's matrices)
        return sum(int(a.nbytes) for a in arrays)

    @property
    def step_weight_nbytes(self) -> int:
        """Weight bytes one decode step reads: the embedding table only where it is the head."""
        untied = self._head is not self._embed
        return self.weight_nbytes - (int(self._embed.nbytes) if untied else 0)

    # -- the forward ---------------------------------------------------------------------

    def _step(self, rows: Sequence[StepRow]) -> list[SampledToken | None]:
        """One forward over the batch (`step`, through SyncSubmit); one result per row."""
        if not rows:
            return []
        batch = self._plan(rows)
        tokens = np.concatenate([np.asarray(r.token_ids, dtype=np.int64) for r in rows])
        x = self._embed[tokens]
        kept = {k for row in rows if row.sample is not None for k in row.sample.hidden_layers if k >= 0}
        x, layer_x = self._layers_forward(x, rows, batch, kept)
        results = self._sample(x, rows, batch, layer_x)
        for row, states in zip(rows, batch.gdn_states):  # the forward succeeded: keep the new states
            self._states.commit(row.seq_id, row.start_pos + len(row.token_ids), states)
        return results

    def _layers_forward(self, x: np.ndarray, rows, batch: _Batch, kept: set[int]) -> tuple[np.ndarray, dict]:
        """x through every layer -> (the last layer's output, {layer in kept: its output})."""
        layer_x = {}  # each layer makes a new array
        for index, layer in enumerate(self._layers):
            x = self._layer_forward(layer, x, rows, batch)
            if index in kept:
                layer_x[index] = x
        return x, layer_x

    def _layer_forward(self, layer: _Layer, x: np.ndarray, rows, batch: _Batch) -> np.ndarray:
        spec = self.spec
        # Token mixer: attention over the KV pages, or Gated DeltaNet over the recurrent state.
        h = rms_norm(x, layer.attn_norm, spec.rms_eps)
        if isinstance(layer.mixer, _Attention):
            x = x + self._attention(layer.mixer, layer.slot, h, rows, batch)
        else:
            x = x + self._gdn(layer.mixer, layer.slot, h, batch)
        # Feed-forward block: SwiGLU.
        gate_up = rms_norm(x, layer.ffn_norm, spec.rms_eps) @ layer.w_gate_up
        gate, up = gate_up[:, : spec.d_ffn], gate_up[:, spec.d_ffn :]
        return x + (silu(gate) * up) @ layer.w_down

    def _attention(self, mixer: _Attention, slot: int, h: np.ndarray, rows, batch: _Batch) -> np.ndarray:
        spec = self.spec
        num_tokens = h.shape[0]
        # Fused q/k/v projection for every token of every row at once.
        qkv = h @ mixer.w_qkv
        if mixer.b_qkv is not None:
            qkv += mixer.b_qkv
        q_rows = 2 * spec.q_dim if spec.has_attn_gate else spec.q_dim
        q = qkv[:, :q_rows].reshape(num_tokens, spec.num_heads, -1)
        gate = None
        if spec.has_attn_gate:  # per head: head_dim query dims, then head_dim gate dims
            q, gate = q[..., : spec.head_dim], q[..., spec.head_dim :].reshape(num_tokens, spec.q_dim)
        k = qkv[:, q_rows : q_rows + spec.kv_dim].reshape(num_tokens, spec.num_kv_heads, spec.head_dim)
        v = qkv[:, q_rows + spec.kv_dim :].reshape(num_tokens, spec.num_kv_heads, spec.head_dim)
        if mixer.q_norm is not None:  # qwen3 / qwen35: per-head RMSNorm before RoPE
            q = rms_norm(q, mixer.q_norm, spec.rms_eps)
            k = rms_norm(k, mixer.k_norm, spec.rms_eps)
        q, k = apply_rope(q, batch.cos, batch.sin), apply_rope(k, batch.cos, batch.sin)
        self._k[slot, batch.pages, batch.slots] = k
        self._v[slot, batch.pages, batch.slots] = v
        attn = np.empty((num_tokens, spec.q_dim), dtype=self.dtype)
        for r in batch.multi_rows:
            lo, hi = batch.row_starts[r], batch.row_starts[r + 1]
            attn[lo:hi] = self._attend(slot, rows[r], q[lo:hi])
        if batch.single_tokens.size:
            attn[batch.single_tokens] = self._attend_singles(slot, q[batch.single_tokens], batch)
        if gate is not None:
            attn *= gdn.sigmoid(gate)
        return attn @ mixer.w_o

    def _gdn(self, mixer: gdn.GdnLayer, j: int, h: np.ndarray, batch: _Batch) -> np.ndarray:
        """Gated DeltaNet: prefill rows one at a time (chunked form), decode rows batched
        (recurrent form); each row's state in this layer (slot j) moves past its tokens."""
        spec = self.spec
        out = np.empty_like(h)
        for r in batch.multi_rows:
            lo, hi = batch.row_starts[r], batch.row_starts[r + 1]
            out[lo:hi], batch.gdn_states[r][j] = gdn.layer_forward(
                spec.gdn, mixer, h[lo:hi], batch.gdn_states[r][j], spec.rms_eps
            )
        singles = batch.single_rows
        if singles:
            states = [batch.gdn_states[r][j] for r in singles]
            out[batch.single_tokens], states = gdn.decode_forward(
                spec.gdn, mixer, h[batch.single_tokens], states, spec.rms_eps
            )
            for r, state in zip(singles, states, strict=True):
                batch.gdn_states[r][j] = state
        return out

    def _attend(self, slot: int, row: StepRow, q: np.ndarray) -> np.ndarray:
        """Causal GQA attention of one row's queries [n, H, hd] over its pages -> [n, H * hd]."""
        spec = self.spec
        num_new = q.shape[0]
        num_ctx = row.start_pos + num_new
        page_ids = np.asarray(row.page_table[: -(-num_ctx // self.page_size)], dtype=np.int64)
        keys = self._k[slot, page_ids].reshape(-1, spec.num_kv_heads, spec.head_dim)[:num_ctx]
        values = self._v[slot, page_ids].reshape(-1, spec.num_kv_heads, spec.head_dim)[:num_ctx]
        # [KV, G * n, hd]: query head h = kv * G + g shares KV head kv = h // G.
        q_grouped = q.reshape(num_new, spec.num_kv_heads, spec.group_size, spec.head_dim)
        q_grouped = q_grouped.transpose(1, 2, 0, 3).reshape(spec.num_kv_heads, -1, spec.head_dim)
        scores = q_grouped @ keys.transpose(1, 2, 0)  # [KV, G * n, num_ctx]
        scores *= np.float32(1.0 / np.sqrt(spec.head_dim))
        scores = scores.reshape(spec.num_kv_heads, spec.group_size, num_new, num_ctx)
        # New token i sits at position start_pos + i and sees keys 0 .. start_pos + i.
        future = np.arange(num_ctx)[None, :] > (row.start_pos + np.arange(num_new))[:, None]
        scores[..., future] = -np.inf
        probs = softmax(scores)
        out = probs.reshape(spec.num_kv_heads, -1, num_ctx) @ values.transpose(1, 0, 2)  # [KV, G*n, hd]
        out = out.reshape(spec.num_kv_heads, spec.group_size, num_new, spec.head_dim)
        return out.transpose(2, 0, 1, 3).reshape(num_new, spec.q_dim)

    def _attend_singles(self, slot: int, q: np.ndarray, batch: _Batch) -> np.ndarray:
        """Attention of single-token rows (decode), batched: queries [R, H, hd] -> [R, H * hd].

        Each row's context is gathered from its pages into one [R, S, KV, hd] block padded to
        the longest; positions past a row's length are masked out.
        """
        spec = self.spec
        num_rows = q.shape[0]
        shape = (num_rows, -1, spec.num_kv_heads, spec.head_dim)
        keys = self._k[slot, batch.single_tables].reshape(shape)  # [R, S, KV, hd]
        values = self._v[slot, batch.single_tables].reshape(shape)
        q_grouped = q.reshape(num_rows, spec.num_kv_heads, spec.group_size, spec.head_dim)
        scores = q_grouped @ keys.transpose(0, 2, 3, 1)  # [R, KV, G, S]
        scores *= np.float32(1.0 / np.sqrt(spec.head_dim))
        padding = np.arange(keys.shape[1])[None, :] >= batch.single_lengths[:, None]  # [R, S]
        scores = np.where(padding[:, None, None, :], np.float32(-np.inf), scores)
        out = softmax(scores) @ values.transpose(0, 2, 1, 3)  # [R, KV, G, hd]
        return out.reshape(num_rows, spec.q_dim)

    def _sample(self, x: np.ndarray, rows: Sequence[StepRow], batch: _Batch,
                layer_x: dict[int, np.ndarray]) -> list[SampledToken | None]:  # fmt: skip
        wanted = [r for r, row in enumerate(rows) if row.sample is not None]
        results: list[SampledToken | None] = [None] * len(rows)
        if not wanted:
            return results
        x_last = x[batch.row_starts[1:][wanted] - 1]
        logits = self._head_logits(x_last)
        for r, row_x, row_logits in zip(wanted, x_last, logits, strict=True):
            spec = rows[r].sample
            results[r] = sampling.sample(row_logits, spec, num_ids=self.spec.tokenizer_vocab_size)
            extra = {}
            if spec.want_hidden:
                extra["hidden"] = rms_norm(row_x, self._final_norm, self.spec.rms_eps).astype(np.float32)
            lo, hi = batch.row_starts[r], batch.row_starts[r + 1]
            if spec.want_all_logits:
                extra["all_logits"] = self._head_logits(x[lo:hi])
            if spec.hidden_layers:
                extra["layer_hidden"] = np.stack([
                    layer_x[k][lo:hi] if k >= 0 else rms_norm(x[lo:hi], self._final_norm, self.spec.rms_eps)
                    for k in spec.hidden_layers
                ]).astype(np.float32, copy=False)  # fmt: skip
            if extra:
                results[r] = attrs.evolve(results[r], **extra)
        return results

    def _head_logits(self, x_last: np.ndarray) -> np.ndarray:
        hidden = rms_norm(x_last, self._final_norm, self.spec.rms_eps)
        return (hidden @ self._head.T).astype(np.float32, copy=False)

    def _plan(self, rows: Sequence[StepRow]) -> _Batch:
        """Positions, page slots and RoPE angles of every new token, checked against the pool."""
        positions, pages = [], []
        for row in rows:
            num_ctx = row.start_pos + len(row.token_ids)
            table = np.asarray(row.page_table, dtype=np.int64)
            if len(row.token_ids) < 1:
                raise ValueError(f"row of sequence {row.seq_id} has no tokens")
            if table.shape[0] * self.page_size < num_ctx:
                raise ValueError(f"sequence {row.seq_id}: {table.shape[0]} pages cannot hold {num_ctx} positions")
            if row.sample is not None and row.sample.hidden_layers:
                check_hidden_layers(row.sample.hidden_layers, self.spec.num_layers)
            positions.append(np.arange(row.start_pos, num_ctx, dtype=np.int64))
            pages.append(table[positions[-1] // self.page_size])
        all_positions = np.concatenate(positions)
        if all_positions.max() >= self.spec.max_context:
            raise ValueError(f"position {all_positions.max()} is past the context limit {self.spec.max_context}")
        row_starts = np.concatenate([[0], np.cumsum([len(r.token_ids) for r in rows])]).astype(np.int64)
        cos, sin = rope_angles(self.spec, all_positions, self.dtype)
        singles = [r for r, row in enumerate(rows) if len(row.token_ids) == 1]
        tables, lengths = self._padded_tables([rows[r] for r in singles])
        return _Batch(
            positions=all_positions,
            pages=np.concatenate(pages),
            slots=all_positions % self.page_size,
            row_starts=row_starts,
            cos=cos[:, None],
            sin=sin[:, None],
            multi_rows=tuple(r for r, row in enumerate(rows) if len(row.token_ids) > 1),
            single_rows=tuple(singles),
            single_tokens=row_starts[singles],
            single_tables=tables,
            single_lengths=lengths,
            gdn_states=self._start_states(rows),
        )

    def _start_states(self, rows: Sequence[StepRow]) -> list[list[gdn.GdnState]]:
        """Each row's GDN states to continue from, checked before anything runs (hybrids)."""
        if self._states is None:
            return []
        return [self._states.start(row.seq_id, row.start_pos) for row in rows]

    def _padded_tables(self, rows: Sequence[StepRow]) -> tuple[np.ndarray, np.ndarray]:
        """Page tables of single-token rows as one [R, max pages] array, and context lengths."""
        lengths = np.array([row.start_pos + 1 for row in rows], dtype=np.int64)
        num_pages = -(-lengths // self.page_size)
        tables = np.zeros((len(rows), int(num_pages.max(initial=0))), dtype=np.int64)
        for i, row in enumerate(rows):
            tables[i, : num_pages[i]] = row.page_table[: num_pages[i]]
        return tables, lengths

    # -- KV pages ------------------------------------------------------------------------

    def snapshot_pages(self, page_ids: Sequence[int]) -> PageSnapshot:
        """Copy the pages' KV to host memory."""
        ids = np.asarray(page_ids, dtype=np.int64)
        return PageSnapshot((self._k[:, ids].copy(), self._v[:, ids].copy()))

    def restore_pages(self, page_ids: Sequence[int], snapshot: PageSnapshot) -> None:
        """Write a snapshot back into (possibly different) pages, in the same order."""
        ids = np.asarray(page_ids, dtype=np.int64)
        k, v = snapshot.arrays
        if k.shape[1] != ids.shape[0]:
            raise ValueError(f"snapshot holds {k.shape[1]} pages, restore asked for {ids.shape[0]}")
        self._k[:, ids] = k
        self._v[:, ids] = v

    def copy_pages(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
        """Copy whole pages src[i] -> dst[i] (copy-on-write of a shared tail page)."""
        src, dst = np.asarray(src_ids, dtype=np.int64), np.asarray(dst_ids, dtype=np.int64)
        if src.shape != dst.shape:
            raise ValueError(f"copy_pages got {src.shape[0]} sources and {dst.shape[0]} destinations")
        self._k[:, dst] = self._k[:, src]
        self._v[:, dst] = self._v[:, src]

    # -- recurrent state (hybrid models) -------------------------------------------------

    def release_sequence(self, seq_id: int) -> None:
        """Drop a sequence's recurrent state (it finished, or paused to replay); no-op without."""
        if self._states is not None:
            self._states.release(seq_id)

    @property
    def num_recurrent_states(self) -> int:
        """Sequences whose recurrent state this runner holds (0 for dense models)."""
        return 0 if self._states is None else len(self._states)

    @property
    def state_nbytes(self) -> int:
        """Bytes of one sequence's recurrent state (0 for dense models)."""
        return 0 if self._states is None else self._states.nbytes()

    max_states = None  # states live in host memory, one per sequence: no fixed bound

    def snapshot_state(self, seq_id: int) -> StateSnapshot:
        """A copy of the sequence's recurrent state: (conv windows, delta-rule states), each
        stacked over the GDN layers; ValueError when it holds none."""
        if self._states is None:
            raise ValueError("a dense model keeps no recurrent state")
        num_tokens, arrays = self._states.snapshot(seq_id)
        return StateSnapshot(num_tokens, arrays)

    def restore_state(self, seq_id: int, snapshot: StateSnapshot) -> None:
        """Make a copy of `snapshot` the sequence's state: its next row starts at
        `snapshot.num_tokens` (a resumed pause, or a prefix reused from a checkpoint)."""
        if self._states is None:
            raise ValueError("a dense model keeps no recurrent state")
        arrays = self._checkpoint_arrays[self._checkpoints.check(snapshot)] if snapshot.on_device else snapshot.arrays
        self._states.restore(seq_id, snapshot.num_tokens, *arrays)

    # -- checkpoint slots (RecurrentState's optional device tier) --------------------------------

    @property
    def num_checkpoint_slots(self) -> int:
        return self._checkpoints.count

    @property
    def num_free_checkpoint_slots(self) -> int:
        return self._checkpoints.num_free

    def save_checkpoint(self, seq_id: int) -> StateSnapshot:
        """The sequence's state copied into a free checkpoint slot."""
        if self._states is None:
            raise ValueError("a dense model keeps no recurrent state")
        num_tokens, arrays = self._states.snapshot(seq_id)  # raises first when it holds none
        slot = self._checkpoints.take()
        self._checkpoint_arrays[slot] = arrays
        return self._checkpoints.hold(StateSnapshot(num_tokens, (), slot=slot, slot_nbytes=self.state_nbytes))

    def demote_checkpoint(self, snapshot: StateSnapshot) -> StateSnapshot:
        arrays = self._checkpoint_arrays.pop(self._checkpoints.free(snapshot))
        return StateSnapshot(snapshot.num_tokens, arrays)

    def release_checkpoint(self, snapshot: StateSnapshot) -> None:
        del self._checkpoint_arrays[self._checkpoints.free(snapshot)]

    def recurrent_state(self, seq_id: int) -> gdn.SequenceState | None:
        """A sequence's recurrent state (tests and tools; the arrays are the runner's own)."""
        return None if self._states is None else self._states.get(seq_id)

    def close(self) -> None:
        """Drop the KV pool, the recurrent states and the weights."""
        self._k = self._v = np.zeros((0,), dtype=self.dtype)
        self._layers = []
        if self._states is not None:
            self._states.clear()

    # -- construction --------------------------------------------------------------------

    def _float(self, tensor) -> np.ndarray:
        return tensor.dequantize().astype(self.dtype, copy=False)

    def _transposed(self, *tensors) -> np.ndarray:
        return np.ascontiguousarray(np.concatenate([self._float(t) for t in tensors], axis=0).T)

    def _load_layer(self, weights: ModelWeights, i: int) -> _Layer:
        def get(name: str):
            tensor = weights.layer(i, name)
            if tensor is None:
                raise ValueError(f"{self.spec.arch} weights lack layers.{i}.{name}")
            return tensor

        spec = self.spec
        is_gdn = spec.layer_type(i) == LINEAR_ATTENTION
        return _Layer(
            attn_norm=self._float(get("attn_norm")),
            mixer=self._load_gdn(get) if is_gdn else self._load_attention(get),
            slot=(spec.gdn_layers if is_gdn else spec.attention_layers).index(i),
            ffn_norm=self._float(get("ffn_norm")),
            w_gate_up=self._transposed(get("w_gate"), get("w_up")),
            w_down=self._transposed(get("w_down")),
        )

    def _load_attention(self, get) -> _Attention:
        has_bias, has_norm = self.spec.has_qkv_bias, self.spec.has_qk_norm
        return _Attention(
            w_qkv=self._transposed(get("wq"), get("wk"), get("wv")),
            b_qkv=np.concatenate([self._float(get(b)) for b in ("bq", "bk", "bv")]) if has_bias else None,
            q_norm=self._float(get("q_norm")) if has_norm else None,
            k_norm=self._float(get("k_norm")) if has_norm else None,
            w_o=self._transposed(get("wo")),
        )

    def _load_gdn(self, get) -> gdn.GdnLayer:
        return gdn.GdnLayer(
            w_in=self._transposed(get("gdn_qkv"), get("gdn_z"), get("gdn_beta"), get("gdn_alpha")),
            conv=self._transposed(get("gdn_conv")),
            dt_bias=self._float(get("gdn_dt_bias")),
            a=self._float(get("gdn_a")),
            norm=self._float(get("gdn_norm")),
            w_out=self._transposed(get("gdn_out")),
        )


# -- the math, shared with tests and other backends' oracles ---------------------------------


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis."""
    mean_sq = np.mean(np.square(x), axis=-1, keepdims=True)
    return x * (1.0 / np.sqrt(mean_sq + np.float32(eps))).astype(x.dtype) * weight


def rope_angles(spec: ModelSpec, positions: np.ndarray, dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [len(positions), rotary_dim // 2] of pos * theta^(-2i / rotary_dim)
    (rotary_dim = head_dim unless the model rotates only part of each head).

    Angles are computed in float64 and rounded once, so long positions lose no precision.
    """
    dim = spec.rotary_dim
    inv_freq = spec.rope_theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    angles = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Split-half RoPE over the first 2 * cos.shape[-1] dims (all of them unless partial):
    first half a, second half b -> (a cos - b sin, b cos + a sin); the other dims pass."""
    half = cos.shape[-1]
    a, b = x[..., :half], x[..., half : 2 * half]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin, x[..., 2 * half :]], axis=-1)


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis (rows of all -inf do not occur: a query sees itself)."""
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x)."""
    with np.errstate(over="ignore"):  # exp(-x) overflows to inf for very negative x: silu -> -0
        return x / (1.0 + np.exp(-x))


def spec_and_weights(model) -> tuple[ModelSpec, ModelWeights]:
    """(spec, stored weights) of a loaded model, or of a (spec, weights) pair such as
    random_model's: what both backends' runners take."""
    if isinstance(model, tuple):
        spec, weights = model
        return spec, weights
    return model.spec, model.weights
