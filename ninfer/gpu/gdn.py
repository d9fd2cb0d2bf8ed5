"""Gated DeltaNet (the linear-attention layers of Qwen3.5 hybrids) in numpy: the reference.

One layer, for one sequence's new tokens h [n, d_model] (after the input RMSNorm):

    mixed, z, b, a = h @ gdn_qkv.T, h @ gdn_z.T, h @ gdn_beta.T, h @ gdn_alpha.T
    mixed = silu(causal_conv1d(mixed))        depthwise over time, conv_kernel taps; the last
                                              conv_kernel - 1 inputs carry over (conv state)
    q, k, v = split(mixed)                    q, k: num_k_heads x head_k_dim; v: num_v_heads x head_v_dim
    q, k = l2norm(q) / sqrt(head_k_dim), l2norm(k)
    beta = sigmoid(b);  g = gdn_a * softplus(a + dt_bias)  (g <= 0: gdn_a = -exp(A_log))
    per value head p, reading key head p % num_k_heads, with state S [head_k_dim, head_v_dim]:
        S = exp(g_t) S                        decay
        S = S + k_t (beta_t (v_t - S^T k_t))^T   delta rule: write the part S mispredicts
        o_t = S^T q_t
    o = rmsnorm(o) * gdn_norm * silu(z)       per value head
    out = o @ gdn_out.T

`delta_rule_step` is the recurrence for one token (decode, batched over sequences);
`delta_rule_chunked` computes the same over a whole prompt chunk by chunk (prefill): inside a
chunk the writes form a unit lower-triangular system solved at once, then one matrix product
carries the state across the chunk. Both compute in float32.
"""

from __future__ import annotations

import attrs
import numpy as np

CHUNK_TOKENS = 64  # tokens per chunk of the chunked form
L2_EPS = 1e-6  # l2norm of q and k: x / sqrt(sum(x^2) + eps)


@attrs.frozen(eq=False)
class GdnLayer:
    """One GDN layer's float weights, matrices transposed to [in, out] for `x @ w`."""

    w_in: np.ndarray  # [d_model, conv_dim + value_dim + 2 * num_v_heads]: qkv | z | beta | alpha
    conv: np.ndarray  # [conv_kernel, conv_dim]: tap j multiplies the input conv_kernel - 1 - j steps back
    dt_bias: np.ndarray  # [num_v_heads]
    a: np.ndarray  # [num_v_heads], negative
    norm: np.ndarray  # [head_v_dim]
    w_out: np.ndarray  # [value_dim, d_model]


@attrs.define(eq=False)
class GdnState:
    """One sequence's state in one layer: the conv window and the delta-rule matrices."""

    conv: np.ndarray  # [conv_kernel - 1, conv_dim]: the latest inputs, oldest first
    ssm: np.ndarray  # [num_v_heads, head_k_dim, head_v_dim]

    @classmethod
    def zeros(cls, gdn, dtype=np.float32) -> GdnState:
        return cls(
            np.zeros((gdn.conv_kernel - 1, gdn.conv_dim), dtype),
            np.zeros((gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim), dtype),
        )

    def copy(self) -> GdnState:
        return GdnState(self.conv.copy(), self.ssm.copy())


def layer_forward(gdn, layer: GdnLayer, h: np.ndarray, state: GdnState, rms_eps: float,
                  chunk: int = CHUNK_TOKENS) -> tuple[np.ndarray, GdnState]:  # fmt: skip
    """One sequence's tokens h [n, d_model] -> (output [n, d_model], the state after them)."""
    n = h.shape[0]
    mixed, z, beta, g = _project(gdn, layer, h)
    mixed, conv = causal_conv1d(mixed, state.conv, layer.conv)
    q, k, v = _split_heads(gdn, mixed)
    if n == 1:
        o, ssm = delta_rule_step(q[0], k[0], v[0], g[0], beta[0], state.ssm)
        o = o[None]
    else:
        o, ssm = delta_rule_chunked(q, k, v, g, beta, state.ssm, chunk)
    return _output(gdn, layer, o, z, rms_eps), GdnState(conv, ssm)


def decode_forward(gdn, layer: GdnLayer, h: np.ndarray, states: list[GdnState],
                   rms_eps: float) -> tuple[np.ndarray, list[GdnState]]:  # fmt: skip
    """One token for each of R sequences, h [R, d_model] -> (output [R, d_model], new states)."""
    mixed, z, beta, g = _project(gdn, layer, h)
    conv_in = np.stack([s.conv for s in states])  # [R, K - 1, C]
    window = np.concatenate([conv_in, mixed[:, None]], axis=1)  # [R, K, C]
    mixed = silu(np.einsum("rkc,kc->rc", window, layer.conv))
    q, k, v = _split_heads(gdn, mixed)
    o, ssm = delta_rule_step(q, k, v, g, beta, np.stack([s.ssm for s in states]))
    new = [GdnState(window[r, 1:].copy(), ssm[r]) for r in range(len(states))]
    return _output(gdn, layer, o, z, rms_eps), new


def _project(gdn, layer: GdnLayer, h: np.ndarray):
    """(conv input [n, C], z [n, V], beta [n, nv], g [n, nv]) of tokens h [n, d]."""
    c, v, nv = gdn.conv_dim, gdn.value_dim, gdn.num_v_heads
    proj = h @ layer.w_in
    mixed, z = proj[:, :c], proj[:, c : c + v]
    beta = sigmoid(proj[:, c + v : c + v + nv])
    g = layer.a * softplus(proj[:, c + v + nv :] + layer.dt_bias)
    return mixed, z, beta, g.astype(h.dtype, copy=False)


def _split_heads(gdn, mixed: np.ndarray):
    """q, k [..., nv, dk] (l2-normed, q scaled, key heads tiled over value heads), v [..., nv, dv]."""
    lead = mixed.shape[:-1]
    kd, r = gdn.key_dim, gdn.num_v_heads // gdn.num_k_heads
    q = l2norm(mixed[..., :kd].reshape(*lead, gdn.num_k_heads, gdn.head_k_dim))
    k = l2norm(mixed[..., kd : 2 * kd].reshape(*lead, gdn.num_k_heads, gdn.head_k_dim))
    v = mixed[..., 2 * kd :].reshape(*lead, gdn.num_v_heads, gdn.head_v_dim)
    q = q * np.float32(gdn.head_k_dim**-0.5)
    reps = (1,) * len(lead) + (r, 1)  # value head p reads key head p % num_k_heads
    return np.tile(q, reps), np.tile(k, reps), v


def _output(gdn, layer: GdnLayer, o: np.ndarray, z: np.ndarray, rms_eps: float) -> np.ndarray:
    """Gated RMSNorm per value head, then the output projection: o [n, nv, dv] -> [n, d]."""
    n = o.shape[0]
    z = z.reshape(n, gdn.num_v_heads, gdn.head_v_dim)
    mean_sq = np.mean(np.square(o), axis=-1, keepdims=True)
    normed = o / np.sqrt(mean_sq + np.float32(rms_eps)) * layer.norm * silu(z)
    return normed.reshape(n, gdn.value_dim).astype(o.dtype, copy=False) @ layer.w_out


def causal_conv1d(x: np.ndarray, state: np.ndarray, taps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """silu of the depthwise causal conv of x [n, C] after the window `state` [K - 1, C];
    returns (out [n, C], the new window: the last K - 1 inputs)."""
    n, kernel = x.shape[0], taps.shape[0]
    full = np.concatenate([state, x], axis=0)  # [K - 1 + n, C]
    out = np.zeros_like(x)
    for j in range(kernel):  # tap j sees the input K - 1 - j steps before each output
        out += taps[j] * full[j : j + n]
    return silu(out), full[full.shape[0] - (kernel - 1) :].copy()


def delta_rule_step(q, k, v, g, beta, state):
    """One token of the gated delta rule, batched over any leading dims.

    q, k [..., H, dk]; v [..., H, dv]; g, beta [..., H]; state [..., H, dk, dv].
    Returns (o [..., H, dv], new state).
    """
    s = state * np.exp(g)[..., None, None]
    predicted = np.einsum("...hk,...hkv->...hv", k, s)
    delta = (v - predicted) * beta[..., None]
    s = s + k[..., :, None] * delta[..., None, :]
    return np.einsum("...hk,...hkv->...hv", q, s), s


def delta_rule_chunked(q, k, v, g, beta, state, chunk: int = CHUNK_TOKENS):
    """The gated delta rule over n tokens, chunk by chunk (same result as n `delta_rule_step`s).

    q, k [n, H, dk]; v [n, H, dv]; g, beta [n, H]; state [H, dk, dv] -> (o [n, H, dv], state).

    Within a chunk of L tokens, with c_t the cumulative log-decay and D[t, s] = exp(c_t - c_s)
    (s <= t), the state after token t is exp(c_t) S0 + sum_{s<=t} D[t, s] k_s u_s^T, where the
    written values u solve (I + A) u = beta (v - exp(c) k S0), A[t, s] = beta_t D[t, s] k_t.k_s
    for s < t. Outputs: o = exp(c) q S0 + (D * q k^T) u; the next state is
    exp(c_L) S0 + sum_s D[L, s] k_s u_s^T.
    """
    n = q.shape[0]
    # heads first: [H, n, ...]
    q, k, v = (x.transpose(1, 0, 2) for x in (q, k, v))
    g, beta = g.T, beta.T
    out = np.empty_like(v)
    s0 = state
    for lo in range(0, n, chunk):
        hi = min(lo + chunk, n)
        out[:, lo:hi], s0 = _chunk(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi], s0)
    return out.transpose(1, 0, 2), s0


def _chunk(q, k, v, g, beta, s0):
    """One chunk, heads first: q, k [H, L, dk], v [H, L, dv], g, beta [H, L], s0 [H, dk, dv]."""
    length = q.shape[1]
    c = np.cumsum(g, axis=-1)  # [H, L] cumulative log-decay
    causal = np.tril(np.ones((length, length), dtype=bool))
    exponent = np.where(causal, c[:, :, None] - c[:, None, :], -np.inf)  # masked before exp
    decay = np.exp(exponent)  # [H, L, L]: D[t, s], 0 above the diagonal
    kk = k @ k.transpose(0, 2, 1)
    a = np.tril(beta[:, :, None] * decay * kk, k=-1)
    rhs = beta[:, :, None] * (v - np.exp(c)[:, :, None] * (k @ s0))
    u = np.linalg.solve(np.eye(length, dtype=q.dtype) + a, rhs).astype(q.dtype, copy=False)
    o = np.exp(c)[:, :, None] * (q @ s0) + (decay * (q @ k.transpose(0, 2, 1))) @ u
    to_end = np.exp(c[:, -1:] - c)  # [H, L]: D[L, s]
    s_next = np.exp(c[:, -1])[:, None, None] * s0 + (k * to_end[:, :, None]).transpose(0, 2, 1) @ u
    return o, s_next.astype(q.dtype, copy=False)


def l2norm(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.sum(np.square(x), axis=-1, keepdims=True) + np.float32(L2_EPS))


def sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + exp(x)), overflow-free: max(x, 0) + log1p(exp(-|x|))."""
    return np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))


def silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return x / (1.0 + np.exp(-x))


@attrs.frozen(eq=False)
class SequenceState:
    """A sequence's GDN state in every linear-attention layer, after its first `num_tokens` tokens."""

    num_tokens: int
    layers: tuple[GdnState, ...]


class StateStore:
    """Recurrent state of the sequences a runner is computing, keyed by sequence id.

    A sequence's state is created by its row at position 0 (a first prefill chunk, or a replay
    that starts over), advanced by every later row, which must start where the state ends, and
    dropped by `release` (the sequence finished, or was paused and will replay).
    """

    def __init__(self, gdn, num_layers: int, dtype=np.float32):
        self._gdn, self._num_layers, self._dtype = gdn, num_layers, dtype
        self._states: dict[int, SequenceState] = {}

    def __len__(self) -> int:
        return len(self._states)

    def start(self, seq_id: int, start_pos: int) -> list[GdnState]:
        """Per-layer states a row of `seq_id` at `start_pos` continues from (fresh at 0);
        ValueError when the runner holds none that ends there."""
        if start_pos == 0:
            return [GdnState.zeros(self._gdn, self._dtype) for _ in range(self._num_layers)]
        held = self._states.get(seq_id)
        if held is None or held.num_tokens != start_pos:
            where = "none" if held is None else f"one after {held.num_tokens} tokens"
            raise ValueError(
                f"sequence {seq_id} continues at position {start_pos}, but its recurrent state is {where}"
                " (a hybrid sequence continues only from its own state, or one restored with restore_state)"
            )
        return list(held.layers)

    def commit(self, seq_id: int, num_tokens: int, layers: list[GdnState]) -> None:
        self._states[seq_id] = SequenceState(num_tokens, tuple(layers))

    def get(self, seq_id: int) -> SequenceState | None:
        return self._states.get(seq_id)

    def release(self, seq_id: int) -> None:
        self._states.pop(seq_id, None)

    def snapshot(self, seq_id: int) -> tuple[int, tuple[np.ndarray, np.ndarray]]:
        """(tokens seen, (conv [layers, K - 1, C], ssm [layers, Hv, dk, dv])): a copy of the
        sequence's state; ValueError when it holds none."""
        held = self._states.get(seq_id)
        if held is None:
            raise ValueError(f"sequence {seq_id} holds no recurrent state to snapshot")
        conv = np.stack([layer.conv for layer in held.layers])
        ssm = np.stack([layer.ssm for layer in held.layers])
        return held.num_tokens, (conv, ssm)

    def restore(self, seq_id: int, num_tokens: int, conv: np.ndarray, ssm: np.ndarray) -> None:
        """Make a snapshot (copied) the sequence's state, after `num_tokens` tokens."""
        want = GdnState.zeros(self._gdn, self._dtype)
        if conv.shape != (self._num_layers, *want.conv.shape) or ssm.shape != (self._num_layers, *want.ssm.shape):
            raise ValueError(f"a state snapshot of shapes {conv.shape}, {ssm.shape} does not fit this model")
        layers = [GdnState(conv[j].astype(self._dtype), ssm[j].astype(self._dtype)) for j in range(self._num_layers)]
        self.commit(seq_id, num_tokens, layers)

    def nbytes(self) -> int:
        """Bytes of one sequence's state."""
        state = GdnState.zeros(self._gdn, self._dtype)
        return self._num_layers * int(state.conv.nbytes + state.ssm.nbytes)

    def clear(self) -> None:
        self._states.clear()
