"""Hybrid (qwen35) models on the CUDA runner: GDN weights, the recurrent-state pool, the forward.

A hybrid interleaves Gated DeltaNet layers (linear attention over a per-sequence recurrent
state) with gated full-attention layers (partial RoPE, an output gate). Here:

- `upload_gdn_layer`: a GDN layer's weights on the device (device_model.upload_model calls it
  for linear-attention layers; gated attention layers are plain `DeviceLayer`s whose wq holds
  the gate rows too). The kernels take A_log and exponentiate it; the stored `gdn_a` is
  already -exp(A_log), so A_log = log(-gdn_a) is uploaded.
- `StatePool`: the conv windows [gdn layers, slots, K - 1, conv_dim] and delta-rule states
  [gdn layers, slots, Hv, dk, dv] (float32) and, on the host, which slot each sequence holds
  and how many tokens its state has seen. A row at position 0 takes a slot (its own again on a
  replay), every later row must start where its state ends (the reference StateStore's rule,
  checked before anything is launched), `release` frees the slot for another sequence;
  `snapshot` copies a slot to the host and `restore` writes one back (into any sequence's
  slot: a resumed pause, a prefix-cache checkpoint). One spare slot more takes the writes of
  graph buckets' padding rows.
- `HybridForward`: the launch sequence. GDN layers: RMSNorm, one fused projection
  (qkv | z | beta | alpha), the causal conv, the delta rule (decode kernels when every row is
  one token continuing a state, else the prefill kernels, which take any mix of rows), the
  gated RMSNorm, the output projection. Gated attention layers: the QKV projection,
  gated_qkv_post, the existing attention kernels, the sigmoid gate, the output projection.

The linears take int8 activations where the runner runs q8 (`activations='q8'`, the served
default) and every matrix has an int8 kernel, as the dense forward does: the RMSNorm and
SwiGLU kernels write the int8 blocks themselves, the GDN and attention outputs are quantized
before their output projections (`act_quant.quantize_rows`); else float32. The per-step GDN
inputs (row starts, slots, fresh flags) are a step input like the others
(StepBuffers.gdn_rows), so decode steps whose rows all continue a state are captured and
replayed as CUDA graphs (padding rows use a spare slot); steps with a prefill row, or a row
starting a sequence, run eagerly (their conv grid depends on the longest row).
"""

from __future__ import annotations

import attrs
import numpy as np
from numba import cuda

from ninfer.core.runner import CheckpointSlots, StateSnapshot
from ninfer.gpu import gdn as gdn_ref
from ninfer.gpu.cuda.buckets import bucket, token_bucket, warm_rows, zeros
from ninfer.gpu.cuda.device_weights import DeviceWeight
from ninfer.gpu.cuda.forward import Forward, StepPlan
from ninfer.gpu.cuda.kernels import act_quant, embed, gated_attn, gdn, gemm, gemv, swiglu
from ninfer.gpu.cuda.kernels.intrinsics import SIMULATOR
from ninfer.models.spec import LINEAR_ATTENTION


@attrs.frozen(eq=False)
class GdnDeviceLayer:
    """One Gated DeltaNet decoder block on the device."""

    attn_norm: object  # float32 [d]
    w_in: tuple[DeviceWeight, ...]  # fused [qkv; z; beta; alpha] rows, or the four when their types differ
    conv: object  # float32 [K, conv_dim]
    a_log: object  # float32 [Hv]: log(-gdn_a)
    dt_bias: object  # float32 [Hv]
    norm: object  # float32 [dv]
    w_out: DeviceWeight
    ffn_norm: object
    w_gate_up: tuple[DeviceWeight, ...]
    w_down: DeviceWeight

    @property
    def linears(self) -> tuple[DeviceWeight, ...]:
        return (*self.w_in, self.w_out, *self.w_gate_up, self.w_down)


def upload_gdn_layer(weights, i: int, vec, fused, single, stream=0) -> GdnDeviceLayer:
    """Layer i's GDN weights; `vec`, `fused`, `single` are upload_model's helpers."""
    p = f"layers.{i}."

    def host_vec(array):
        return cuda.to_device(np.ascontiguousarray(array, np.float32), stream=stream)

    conv = weights[p + "gdn_conv"].dequantize()  # [conv_dim, K]; the kernels take [K, conv_dim]
    a = np.asarray(weights[p + "gdn_a"].dequantize(), np.float64)  # -exp(A_log)
    return GdnDeviceLayer(
        attn_norm=vec(p + "attn_norm"),
        w_in=fused([p + "gdn_qkv", p + "gdn_z", p + "gdn_beta", p + "gdn_alpha"]),
        conv=host_vec(conv.T),
        a_log=host_vec(np.log(-a)),
        dt_bias=vec(p + "gdn_dt_bias"),
        norm=vec(p + "gdn_norm"),
        w_out=single(p + "gdn_out"),
        ffn_norm=vec(p + "ffn_norm"),
        w_gate_up=fused([p + "w_gate", p + "w_up"]),
        w_down=single(p + "w_down"),
    )


def is_gdn(spec, i: int) -> bool:
    return spec.layer_type(i) == LINEAR_ATTENTION


# -- the recurrent state pool ---------------------------------------------------------------------


@attrs.define
class _Held:
    slot: int
    num_tokens: int  # tokens the state has seen once the queued steps have run


class StatePool:
    """Per-sequence GDN state in `num_slots` device slots; host bookkeeping of who holds which."""

    def __init__(self, spec, num_slots: int, stream, checkpoint_slots: int = 0):
        g, n = spec.gdn, len(spec.gdn_layers)
        self.spec = spec
        self.num_slots = num_slots
        self.spare = num_slots  # an extra slot: the padding rows of graph buckets write there
        # then `checkpoint_slots` more: the prefix cache's newest state checkpoints (save_checkpoint)
        self.checkpoints = CheckpointSlots(checkpoint_slots)
        total = num_slots + 1 + checkpoint_slots
        self.conv = _zeros((n, total, g.conv_kernel - 1, g.conv_dim), stream)
        self.ssm = _zeros((n, total, g.num_v_heads, g.head_k_dim, g.head_v_dim), stream)
        self.conv_layers = [self.conv[j] for j in range(n)]
        self.ssm_layers = [self.ssm[j] for j in range(n)]
        self._held: dict[int, _Held] = {}
        self._free = list(range(num_slots - 1, -1, -1))  # pop() takes slot 0 first

    def __len__(self) -> int:
        return len(self._held)

    @property
    def nbytes(self) -> int:
        return int(self.conv.nbytes + self.ssm.nbytes)

    def begin(self, rows) -> dict[int, int]:
        """The slot of each row's sequence for a step over `rows` (taking free slots for rows at
        position 0); ValueError, with nothing changed, where a row does not continue its state."""
        slots: dict[int, int] = {}
        free = list(self._free)
        for row in rows:
            if row.seq_id in slots:
                raise ValueError(f"sequence {row.seq_id} has two rows in one step")
            held = self._held.get(row.seq_id)
            if row.start_pos == 0:
                if held is None and not free:
                    raise ValueError(
                        f"no free recurrent-state slot for sequence {row.seq_id}: all {self.num_slots} are held"
                        " (release finished sequences, or size the runner for more)"
                    )
                slots[row.seq_id] = held.slot if held is not None else free.pop()
            elif held is None or held.num_tokens != row.start_pos:
                where = "none" if held is None else f"one after {held.num_tokens} tokens"
                raise ValueError(
                    f"sequence {row.seq_id} continues at position {row.start_pos}, but its recurrent state is"
                    f" {where} (a hybrid sequence continues only from its own state, or one restored into it)"
                )
            else:
                slots[row.seq_id] = held.slot
        return slots

    def commit(self, rows, slots: dict[int, int]) -> None:
        """The step over `rows` is queued: each sequence's state will have seen its row."""
        for row in rows:
            slot = slots[row.seq_id]
            if row.seq_id not in self._held:
                self._free.remove(slot)
            self._held[row.seq_id] = _Held(slot, row.start_pos + len(row.token_ids))

    def abort(self, rows) -> None:
        """A step failed part-way: its rows' states are unknown, so they are dropped (a
        sequence then starts over from position 0)."""
        for row in rows:
            self.release(row.seq_id)

    def release(self, seq_id: int) -> None:
        held = self._held.pop(seq_id, None)
        if held is not None:
            self._free.append(held.slot)

    def clear(self) -> None:
        self._held.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))

    @property
    def state_nbytes(self) -> int:
        """Bytes of one sequence's state (one slot over every GDN layer)."""
        return self.nbytes // (self.num_slots + 1 + self.checkpoints.count)

    def _copy_slot(self, src: int, dst: int, stream) -> None:
        for c, s in zip(self.conv_layers, self.ssm_layers, strict=True):
            c[dst].copy_to_device(c[src], stream=stream)
            s[dst].copy_to_device(s[src], stream=stream)

    def _checkpoint_index(self, slot: int) -> int:
        return self.num_slots + 1 + slot

    def save_checkpoint(self, seq_id: int, stream) -> StateSnapshot:
        """The sequence's state (after the queued steps) copied into a free checkpoint slot,
        device to device; ValueError when it holds none or every checkpoint slot is taken."""
        held = self._held.get(seq_id)
        if held is None:
            raise ValueError(f"sequence {seq_id} holds no recurrent state to checkpoint")
        slot = self.checkpoints.take()
        self._copy_slot(held.slot, self._checkpoint_index(slot), stream)
        return self.checkpoints.hold(StateSnapshot(held.num_tokens, (), slot=slot, slot_nbytes=self.state_nbytes))

    def demote_checkpoint(self, snapshot: StateSnapshot, stream) -> StateSnapshot:
        """A checkpoint slot's state copied to the host (waits for the stream); the slot is free."""
        host = self._to_host(self._checkpoint_index(self.checkpoints.check(snapshot)), stream)
        self.checkpoints.free(snapshot)
        return StateSnapshot(snapshot.num_tokens, host)

    def release_checkpoint(self, snapshot: StateSnapshot) -> None:
        """Free a checkpoint slot (a later save's copy is queued after anything that reads it)."""
        self.checkpoints.free(snapshot)

    def _to_host(self, index: int, stream) -> tuple[np.ndarray, np.ndarray]:
        conv = np.empty((len(self.conv_layers), *self.conv.shape[2:]), np.float32)
        ssm = np.empty((len(self.ssm_layers), *self.ssm.shape[2:]), np.float32)
        for j, (c, s) in enumerate(zip(self.conv_layers, self.ssm_layers, strict=True)):
            c[index].copy_to_host(ary=conv[j], stream=stream)
            s[index].copy_to_host(ary=ssm[j], stream=stream)
        stream.synchronize()
        return conv, ssm

    def snapshot(self, seq_id: int, stream) -> StateSnapshot:
        """A sequence's state copied to the host after the queued steps (waits for the stream):
        (conv [layers, K - 1, C], ssm [layers, Hv, dk, dv]) float32; ValueError when it holds none."""
        held = self._held.get(seq_id)
        if held is None:
            raise ValueError(f"sequence {seq_id} holds no recurrent state to snapshot")
        return StateSnapshot(held.num_tokens, self._to_host(held.slot, stream))

    def restore(self, seq_id: int, snapshot: StateSnapshot, stream) -> None:
        """Write a snapshot into the sequence's slot (taking a free one where it holds none),
        queued after the steps before it; its next row starts at `snapshot.num_tokens`. A
        checkpoint slot's snapshot is copied device to device (and stays in its slot)."""
        source = self._checkpoint_index(self.checkpoints.check(snapshot)) if snapshot.on_device else None
        if source is None:
            conv, ssm = (np.ascontiguousarray(a, np.float32) for a in snapshot.arrays)
            if conv.shape != (len(self.conv_layers), *self.conv.shape[2:]) or ssm.shape != (
                len(self.ssm_layers), *self.ssm.shape[2:]
            ):
                raise ValueError(f"a state snapshot of shapes {conv.shape}, {ssm.shape} does not fit this model")
        held = self._held.get(seq_id)
        if held is None:
            if not self._free:
                raise ValueError(
                    f"no free recurrent-state slot for sequence {seq_id}: all {self.num_slots} are held"
                    " (release finished sequences, or size the runner for more)"
                )
            held = _Held(self._free.pop(), 0)
        if source is not None:
            self._copy_slot(source, held.slot, stream)
        else:
            for j, (c, s) in enumerate(zip(self.conv_layers, self.ssm_layers, strict=True)):
                c[held.slot].copy_to_device(conv[j], stream=stream)
                s[held.slot].copy_to_device(ssm[j], stream=stream)
            stream.synchronize()  # the host arrays may be reused (or freed) once this returns
        held.num_tokens = snapshot.num_tokens
        self._held[seq_id] = held

    def read(self, seq_id: int, stream) -> gdn_ref.SequenceState | None:
        """A sequence's state copied to the host (waits for the stream)."""
        held = self._held.get(seq_id)
        if held is None:
            return None
        stream.synchronize()
        layers = tuple(
            gdn_ref.GdnState(c[held.slot].copy_to_host(), s[held.slot].copy_to_host())
            for c, s in zip(self.conv_layers, self.ssm_layers, strict=True)
        )
        return gdn_ref.SequenceState(held.num_tokens, layers)


def _zeros(shape, stream):
    return zeros(shape, np.float32, stream)


# -- the forward ------------------------------------------------------------------------------------


class HybridBuffers:
    """The activations only hybrid layers need, and the step's GDN inputs."""

    def __init__(self, spec, limits, bufs):
        t, g = max(limits.alloc_tokens, limits.max_tokens), spec.gdn
        in_dim = g.conv_dim + g.value_dim + 2 * g.num_v_heads
        self.qkv = _dev((t, 2 * spec.q_dim + 2 * spec.kv_dim))  # q with its gate rows, k, v
        self.gate = _dev((t, spec.q_dim))
        self.gdn_in = _dev((t, in_dim))
        self.conv_out = _dev((t, g.conv_dim))
        self.o = _dev((t, g.value_dim))
        self.normed = _dev((t, g.value_dim))
        c, v, nv = g.conv_dim, g.value_dim, g.num_v_heads
        self.mixed, self.z = self.gdn_in[:, :c], self.gdn_in[:, c : c + v]
        self.beta, self.alpha = self.gdn_in[:, c + v : c + v + nv], self.gdn_in[:, c + v + nv :]
        # the step's GDN rows (a step input: StepBuffers.gdn_rows, copied up with the others)
        self.starts, self.slots, self.fresh = bufs.gdn_rows[0], bufs.gdn_rows[1], bufs.gdn_rows[2]


def _dev(shape):
    return cuda.to_device(np.zeros(shape, np.float32)) if SIMULATOR else cuda.device_array(shape, np.float32)


@attrs.frozen
class GdnStep:
    """The GDN side of one sub-step (host values; the arrays are copied up before it runs)."""

    rows: np.ndarray  # int32 [3, pieces + 1]: token starts, slots, fresh flags
    num_seqs: int
    max_tokens: int
    decode: bool  # one token a row, each continuing a state: the decode kernels


def gdn_step(rows, batch, slots: dict[int, int]) -> GdnStep:
    """Each piece's slot, whether it starts its sequence, and its tokens' offsets."""
    n = len(batch)
    table = np.zeros((3, n + 1), np.int32)
    counts = np.array([p.count for p in batch], np.int64)
    table[0, 1:] = np.cumsum(counts)
    for i, p in enumerate(batch):
        row = rows[p.row]
        table[1, i] = slots[row.seq_id]
        table[2, i] = int(row.start_pos + p.offset == 0)
    decode = bool((counts == 1).all() and not table[2, :n].any())
    return GdnStep(table, n, int(counts.max()), decode)


class HybridForward(Forward):
    """`Forward` over a hybrid's mixed layers (int8 or float32 activations, as `Forward`)."""

    def __init__(self, spec, model, bufs, k_pool, v_pool, cos, sin, *, pool: StatePool, hbufs: HybridBuffers,
                 q8: bool, split_len: int, sampler_threads: int, plan):  # fmt: skip
        self.spec, self.model, self.bufs = spec, model, bufs
        self.k_pool, self.v_pool, self.cos, self.sin = k_pool, v_pool, cos, sin
        self.plan, self.split_len, self.sampler_threads = plan, split_len, sampler_threads
        self.q8 = q8 and model.linears_quantized
        self.head_q8 = q8 and model.head.qtype not in gemv.FLOAT_QTYPES
        self.folds = self.can_epilogue = self.epilogues = frozenset()
        self.num_ids = spec.num_sampled_ids
        self.pool, self.hb = pool, hbufs
        self._make_views(k_pool, v_pool)
        self._kv_index = {layer: a for a, layer in enumerate(spec.attention_layers)}
        self._gdn_index = {layer: j for j, layer in enumerate(spec.gdn_layers)}
        self._gdn_step: GdnStep | None = None

    def stage(self, step: GdnStep, pad_rows: int | None = None) -> None:
        """Fill the selected host mirror's GDN rows for the next sub-step (`upload` copies them
        up); a graph bucket's padding rows (one token each) write to the spare slot."""
        h, n = self.bufs.h_gdn_rows, step.num_seqs
        total = pad_rows or n
        h[:, : n + 1] = step.rows
        h[0, n + 1 : total + 1] = step.rows[0, n] + np.arange(1, total - n + 1)
        h[1, n:total], h[2, n:total] = self.pool.spare, 0
        self._gdn_step = step

    def launch(self, step: StepPlan, stream, after_layer=None) -> None:
        b, t = self.bufs, step.num_tokens
        act = "q8" if (self.q8 and step.act == "q8") else "f32"
        embed.embed(self.model.embed, b.tokens, b.out, b.x, t, stream)
        for i, layer in enumerate(self.model.layers):
            self._norm(layer.attn_norm, t, act, stream)  # -> b.h, or its int8 blocks
            if i in self._gdn_index:  # token mixer: Gated DeltaNet over the recurrent state ...
                self._gdn(self._gdn_index[i], layer, t, act, stream)
            else:  # ... or gated attention over the KV pages
                self._gated_attention(self._kv_index[i], layer, step, act, stream)
            # feed-forward block: SwiGLU
            self._norm(layer.ffn_norm, t, act, stream)
            self._linear(layer.w_gate_up, t, act, b.gate_up, None, stream)
            swiglu.swiglu(b.gate_up, b.xq8 if act == "q8" else b.h, b.xs, t, act, stream)
            self._linear((layer.w_down,), t, act, b.x, b.x, stream)
            if after_layer is not None:
                after_layer(i)
        self._head(step, stream)

    def _gdn(self, j, layer: GdnDeviceLayer, t, act, stream):
        hb, g, s = self.hb, self._gdn_step, self.spec
        self._linear(layer.w_in, t, act, hb.gdn_in, None, stream)
        conv, ssm = self.pool.conv_layers[j], self.pool.ssm_layers[j]
        if g.decode:  # one token a row: row i is token i
            gdn.conv_decode(hb.mixed, layer.conv, hb.slots, conv, hb.conv_out, t, stream)
            gdn.gdn_decode(hb.conv_out, hb.alpha, hb.beta, layer.a_log, layer.dt_bias, hb.slots, ssm, hb.o, t,
                           stream=stream)  # fmt: skip
        else:
            gdn.conv_prefill(hb.mixed, layer.conv, hb.starts, hb.slots, hb.fresh, conv, hb.conv_out, g.num_seqs,
                             g.max_tokens, stream)  # fmt: skip
            gdn.gdn_prefill(hb.conv_out, hb.alpha, hb.beta, layer.a_log, layer.dt_bias, hb.starts, hb.slots, hb.fresh,
                            ssm, hb.o, g.num_seqs, stream=stream)  # fmt: skip
        gdn.gated_rmsnorm(hb.o, hb.z, layer.norm, s.rms_eps, hb.normed, t, stream)
        self._linear_from(hb.normed, (layer.w_out,), t, act, self.bufs.x, self.bufs.x, stream)

    def _gated_attention(self, a, layer, step: StepPlan, act, stream):
        b, hb, s = self.bufs, self.hb, self.spec
        t = step.num_tokens
        self._linear(layer.wqkv, t, act, hb.qkv, None, stream)
        has_norm = layer.q_norm is not None
        q_norm = layer.q_norm if has_norm else b.dummy_f1
        k_norm = layer.k_norm if has_norm else b.dummy_f1
        gated_attn.gated_qkv_post(s, hb.qkv, q_norm, k_norm, self.cos, self.sin, b.tok_pos, b.tok_page, b.tok_slot, b.q,
                                  hb.gate, *self._pools[a], t, has_norm, stream)  # fmt: skip
        self._attention(a, step, "f32", stream)  # -> b.h
        gated_attn.sigmoid_gate(b.h, hb.gate, s.q_dim, t, stream)
        self._linear_from(b.h, (layer.wo,), t, act, b.x, b.x, stream)

    def _linear_from(self, x, parts, num_m, act, out, res, stream):
        """out[:num_m] = x[:num_m] @ w.T (+ res) over float32 x: quantized to int8 blocks first
        in q8 (`_linear` then reads them), else read as it is (column blocks per part)."""
        if act == "q8":
            act_quant.quantize_rows(x, self.bufs.xq8, self.bufs.xs, num_m, x.shape[1], stream)
            self._linear(parts, num_m, act, out, res, stream)
            return
        col = 0
        for w in parts:
            dst = out if len(parts) == 1 else out[:, col : col + w.rows]
            col += w.rows
            if num_m <= gemv.MAX_M:
                gemv.gemv(w, x, self.bufs.dummy_f32, dst, res, num_m, "f32", stream, plan=self.plan)
            else:
                gemm.gemm(w, x, dst, res, num_m, stream)


def warm_up_hybrid(runner, *, max_rows: int, max_context: int | None = None, progress: bool = False) -> int:
    """Compile the kernels a hybrid's steps take and capture decode graphs: one prefill per
    token bucket (one row from position 0), then for each row bucket (as many rows as there
    are state slots at most) a one-token first step and a decode step (its graph at the
    shortest context bucket; longer ones are captured on first use). Runs real sequences, as
    the recurrent state requires, with ids from -1 down, and releases them; writes K/V into
    the first pages (call before any request). Returns the steps run."""
    top_rows = bucket(min(max_rows, runner.limits.max_rows), runner.limits.max_rows)
    room = min(runner.num_pages * runner.page_size, max_context or runner.max_context, runner.max_context)
    top_tokens = min(runner.limits.max_tokens, room)
    token_buckets = sorted({min(token_bucket(n), top_tokens) for n in range(2, top_tokens + 1)})
    top_rows = min(top_rows, runner._states.num_slots)  # every row of a step holds a slot
    row_buckets = [1 << i for i in range(top_rows.bit_length())]
    steps = 0
    for n in token_buckets:
        _warm_step(runner, warm_rows(1, [n], 0, runner.page_size))
        steps += 1
    for r in row_buckets:
        _warm_step(runner, warm_rows(r, [1] * r, 0, runner.page_size), keep=True)
        _warm_step(runner, warm_rows(r, [1] * r, 1, runner.page_size))
        steps += 2
    runner._last = None
    runner.stream.synchronize()
    return steps


def _warm_step(runner, rows, keep: bool = False) -> None:
    rows = [attrs.evolve(row, seq_id=-1 - row.seq_id) for row in rows]  # ids no request takes
    runner.collect(runner.submit(rows))
    if not keep:
        for row in rows:
            runner.release_sequence(row.seq_id)
