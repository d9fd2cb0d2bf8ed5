"""Outputs at every position of the rows that ask (`SampleSpec.want_all_logits`,
`SampleSpec.hidden_layers`): offline scoring and hidden-row export on the CUDA runner.

Nothing here touches a step of rows that do not ask. For a sub-step holding such rows:

* logits: after the step is queued, the final RMSNorm and the LM head run again over those
  rows' tokens (their residual rows in `bufs.x`), `min(max_rows, gemv.MAX_M)` tokens at a
  time into the head's own scratch (`bufs.h` / `bufs.xq8`, `bufs.logits`), each chunk copied
  back before the next; the head's kernels and activations are those the sampled rows' head
  uses (q8 where the model's head is quantized and `activations="q8"`, else float32);
* hidden rows of layers k >= 0: the sub-step runs eagerly (no graph) and the residual rows are
  copied back after layer k's kernels (`Forward.launch(after_layer=...)`);
* the final hidden row (-1): the last layer's residual rows, normalized on the host as for
  `want_hidden` (`staging.final_hidden`).

A row split over several sub-steps (longer than `max_tokens_per_step`) gets each piece's rows
from its own sub-step; `assemble` joins them in order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ninfer.core.runner import SampleSpec
from ninfer.gpu.cuda.kernels import gemv, norm


def wants_positions(spec: SampleSpec | None) -> bool:
    return spec is not None and (spec.want_all_logits or bool(spec.hidden_layers))


def hooked_layers(rows, batch) -> frozenset[int]:
    """Layers (>= 0) whose residual rows some piece of this sub-batch asks for: the sub-step
    then runs eagerly, with a hook after each of them."""
    return frozenset(k for p in batch if (s := _spec(rows, p)) is not None for k in s.hidden_layers if k >= 0)


def _spec(rows, piece) -> SampleSpec | None:
    return rows[piece.row].sample


def any_asks(rows, batch) -> bool:
    """Whether a piece of this sub-batch belongs to a row that asks (else nothing here runs)."""
    return any(wants_positions(_spec(rows, p)) for p in batch)


def piece_starts(batch) -> np.ndarray:
    """Index of each piece's first token in the sub-step's token rows."""
    return np.concatenate([[0], np.cumsum([p.count for p in batch])]).astype(np.int64)


def layer_hook(bufs, rows, batch, layers: frozenset[int], stream, into: dict[int, np.ndarray]):
    """`after_layer` for Forward.launch: copies the sub-step's residual rows after each of
    `layers` into `into[layer]` (host float32 [tokens, d_model])."""
    num_tokens = int(sum(p.count for p in batch))

    def after_layer(i: int) -> None:
        if i in layers:
            into[i] = bufs.x[:num_tokens].copy_to_host(stream=stream)

    return after_layer


def queue_positions(forward, bufs, rows, batch, layer_rows: dict[int, np.ndarray], stream) -> dict[int, dict]:
    """Right behind the step on its stream: per piece (by index in `batch`) of a row that asks,
    {"logits": float32 [count, vocab] or absent, "layers": {k: float32 [count, d_model]},
    "final_x": float32 [count, d_model] (the last layer's residual rows, for -1)}."""
    if not any_asks(rows, batch):
        return {}
    starts = piece_starts(batch)
    out: dict[int, dict] = {}
    for i, piece in enumerate(batch):
        spec = _spec(rows, piece)
        if not wants_positions(spec):
            continue
        lo, hi = int(starts[i]), int(starts[i + 1])
        entry: dict = {"layers": {k: layer_rows[k][lo:hi] for k in spec.hidden_layers if k >= 0}}
        if -1 in spec.hidden_layers:
            entry["final_x"] = bufs.x[lo:hi].copy_to_host(stream=stream)
        if spec.want_all_logits:
            entry["logits"] = head_rows(forward, bufs, lo, hi - lo, stream)
        out[i] = entry
    return out


def head_rows(forward, bufs, lo: int, count: int, stream) -> np.ndarray:
    """float32 [count, vocab]: the final norm and the head over residual rows lo .. lo + count."""
    chunk = min(bufs.limits.max_rows, gemv.MAX_M)
    act = "q8" if forward.head_q8 else "f32"
    dst = bufs.xq8 if act == "q8" else bufs.h
    eps = forward.spec.rms_eps
    parts = []
    for a in range(lo, lo + count, chunk):
        m = min(chunk, lo + count - a)
        x = bufs.x[a : a + m]
        norm.rmsnorm(x, x, forward.model.final_norm, eps, bufs.last_tok, dst, bufs.xs, m, act, False, False, stream)
        forward._linear((forward.model.head,), m, act, bufs.logits, None, stream)
        parts.append(bufs.logits[:m].copy_to_host(stream=stream))
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


def assemble(spec: SampleSpec, entries: Sequence[dict], final_norm: np.ndarray, eps: float) -> dict:
    """`SampledToken` fields (all_logits, layer_hidden) of one row from its pieces' entries, in order."""
    fields = {}
    if spec.want_all_logits:
        fields["all_logits"] = np.concatenate([e["logits"] for e in entries]).astype(np.float32, copy=False)
    if spec.hidden_layers:
        layers = []
        for k in spec.hidden_layers:
            if k >= 0:
                layers.append(np.concatenate([e["layers"][k] for e in entries]))
            else:
                layers.append(final_hidden_rows(np.concatenate([e["final_x"] for e in entries]), final_norm, eps))
        fields["layer_hidden"] = np.stack(layers).astype(np.float32, copy=False)
    return fields


def final_hidden_rows(x: np.ndarray, final_norm: np.ndarray, eps: float) -> np.ndarray:
    """rmsnorm(x) * final_norm of residual rows [n, d], as the reference computes it (float32)."""
    x = np.asarray(x, np.float32)
    scale = (1.0 / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + np.float32(eps))).astype(np.float32)
    return (x * scale * final_norm).astype(np.float32)
