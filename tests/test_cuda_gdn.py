"""Gated DeltaNet kernels (ninfer/gpu/cuda/kernels/gdn.py): the numpy references against
transformers' Qwen3.5 torch code (an independent oracle: the whole layer's forward, and the
conv / delta-rule functions from a carried state), the references' own chunking invariants,
and the kernels against the references under numba's CUDA simulator (the `check_gdn_*` of
tests/cuda/kernel_checks.py, in a child process, as tests/test_cuda_kernels.py runs them; the
same checks run at a Qwen3.5 shape, timed, on a GPU in tests/cuda/test_kernels_gpu.py).
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

import numpy as np
import pytest

import child_jobs

torch = pytest.importorskip("torch")
qwen = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

from ninfer.gpu.cuda.kernels import gdn  # noqa: E402

CHECKS = Path(__file__).resolve().parent / "cuda" / "kernel_checks.py"
GDN_CHECKS = sorted(re.findall(r"^def check_(gdn\w*)\(", CHECKS.read_text(), re.M))
NUM_K, NUM_V, DK, DV, KS = 2, 4, 16, 8, 4  # k-heads shared by 2 v-heads each; dk != dv
CONV_DIM = 2 * NUM_K * DK + NUM_V * DV

# the torch-only paths (the hub decorators would pick a fused kernel package where installed)
conv_update = inspect.unwrap(qwen.causal_conv1d_update)
chunk_rule = inspect.unwrap(qwen.torch_chunk_gated_delta_rule)
recurrent_rule = inspect.unwrap(qwen.torch_recurrent_gated_delta_rule)


def close(got, want, rtol=2e-5):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    err = np.abs(got - want).max()
    assert err <= rtol * np.abs(want).max(), f"max error {err:.3g} vs max |ref| {np.abs(want).max():.3g}"


def t(a):
    return torch.from_numpy(np.ascontiguousarray(a))


def layer_by_references(layer, x):
    """One sequence through the GDN layer, built from the kernels' numpy references."""
    p = {k: v.detach().numpy() for k, v in layer.state_dict().items()}
    n = x.shape[0]
    one, fresh = np.array([0, n]), np.array([1])
    conv_w = p["conv1d.weight"][:, 0, :].T  # [K, conv_dim]
    qkv, _ = gdn.conv_ref(x @ p["in_proj_qkv.weight"].T, conv_w, one, [0], fresh, np.zeros((1, KS - 1, CONV_DIM)))
    a, b = x @ p["in_proj_a.weight"].T, x @ p["in_proj_b.weight"].T
    state = np.zeros((1, NUM_V, DK, DV), np.float32)
    o, _ = gdn.gdn_ref(qkv, a, b, p["A_log"], p["dt_bias"], one, [0], fresh, state, tiled=False)
    y = gdn.gated_rmsnorm_ref(o, x @ p["in_proj_z.weight"].T, p["norm.weight"], layer.layer_norm_epsilon)
    return y @ p["out_proj.weight"].T


def test_references_compose_to_the_transformers_layer():
    """conv + SiLU, the split into q / k / v, the k-head grouping, l2norm, the gating, the
    delta rule and the gated RMSNorm: the references chained give the module's prefill output
    (its chunked rule over 70 tokens: two chunks of 64, the second padded)."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(hidden_size=32, linear_num_key_heads=NUM_K, linear_num_value_heads=NUM_V,
                               linear_key_head_dim=DK, linear_value_head_dim=DV, linear_conv_kernel_dim=KS,
                               num_hidden_layers=1, layer_types=["linear_attention"])  # fmt: skip
    torch.manual_seed(0)
    layer = qwen.Qwen3_5GatedDeltaNet(config, 0).eval()
    with torch.no_grad():  # every per-head parameter different, the norm weight not all ones
        layer.dt_bias.normal_()
        layer.A_log.uniform_(-1.0, 1.5)
        layer.norm.weight.normal_(1.0, 0.2)
        x = torch.randn(1, 70, 32)
        want = layer(x)[0].numpy()
    close(layer_by_references(layer, x[0].numpy()), want, 1e-4)


@pytest.mark.parametrize("n", [1, 2, 5])
def test_conv_reference_matches_causal_conv1d_update(n):
    """From a carried window (slot 1 of a pool; a fresh row in slot 0 starts from zeros)."""
    rng = np.random.default_rng(n)
    w = rng.standard_normal((KS, CONV_DIM)).astype(np.float32)
    pool = rng.standard_normal((2, KS - 1, CONV_DIM)).astype(np.float32)
    x = rng.standard_normal((2 * n, CONV_DIM)).astype(np.float32)
    out, new = gdn.conv_ref(x, w, np.array([0, n, 2 * n]), [1, 0], np.array([0, 1]), pool)
    for s, (slot, start) in enumerate(((1, pool[1]), (0, np.zeros_like(pool[0])))):
        window = t(start.T.copy())[None]  # HF: [batch, channels, K - 1]
        y = conv_update(t(x[s * n : (s + 1) * n].T.copy())[None], window, t(w.T.copy()), None, "silu")
        close(out[s * n : (s + 1) * n], y[0].T.numpy())
        close(new[slot], window[0].T.numpy(), 0.0)


def _rule_inputs(rng, n):
    qkv = rng.standard_normal((n, CONV_DIM)).astype(np.float32)
    a, b = rng.standard_normal((2, n, NUM_V)).astype(np.float32)
    a_log = np.log(rng.uniform(0.2, 4.0, NUM_V)).astype(np.float32)
    dt_bias = rng.standard_normal(NUM_V).astype(np.float32)
    state = (0.3 * rng.standard_normal((1, NUM_V, DK, DV))).astype(np.float32)
    return qkv, a, b, a_log, dt_bias, state


def _torch_rule(rule, qkv, a, b, a_log, dt_bias, state, **kw):
    """transformers' path from the conv output: split, gating, repeat_interleave, the rule."""
    x = t(qkv)[None]
    q, k, v = torch.split(x, [NUM_K * DK, NUM_K * DK, NUM_V * DV], dim=-1)
    q, k = (u.reshape(1, -1, NUM_K, DK).repeat_interleave(NUM_V // NUM_K, dim=2) for u in (q, k))
    v = v.reshape(1, -1, NUM_V, DV)
    g = -t(a_log).exp() * torch.nn.functional.softplus(t(a)[None] + t(dt_bias))
    out, final = rule(q, k, v, g=g, beta=t(b)[None].sigmoid(), initial_state=t(state), output_final_state=True,
                      use_qk_l2norm_in_kernel=True, **kw)  # fmt: skip
    return out[0].reshape(-1, NUM_V * DV).numpy(), final.numpy()


@pytest.mark.parametrize("rule", ["recurrent", "chunk"])
def test_delta_rule_reference_matches_transformers_from_a_state(rule):
    """Outputs and the final state, continuing from a carried state (chunk: 4-token chunks
    over 11 tokens, so the inter-chunk state passing is exercised)."""
    rng = np.random.default_rng(7)
    qkv, a, b, a_log, dt_bias, state = _rule_inputs(rng, 11)
    kw = {"chunk_size": 4} if rule == "chunk" else {}
    want, want_state = _torch_rule(chunk_rule if rule == "chunk" else recurrent_rule, qkv, a, b, a_log, dt_bias,
                                   state, **kw)  # fmt: skip
    pool = np.concatenate([np.full_like(state, np.nan), state])  # slot 1; slot 0 must stay as it was
    got, got_pool = gdn.gdn_ref(qkv, a, b, a_log, dt_bias, np.array([0, 11]), [1], [0], pool, tiled=False)
    close(got, want, 1e-4)
    close(got_pool[1], want_state[0], 1e-4)
    assert np.isnan(got_pool[0]).all()


def test_tiled_heads_are_grouped_heads_reordered():
    """The engine's value-head order (head p reads k-head p % Hk, GdnSpec) is HF's grouped order
    (p // (Hv / Hk)) with the value heads permuted, as the loader does to HF weights."""
    rng = np.random.default_rng(5)
    qkv, a, b, a_log, dt_bias, state = _rule_inputs(rng, 3)
    r = NUM_V // NUM_K
    perm = np.array([(p % NUM_K) * r + p // NUM_K for p in range(NUM_V)])  # tiled head p = grouped head perm[p]
    kd = 2 * NUM_K * DK
    v = qkv[:, kd:].reshape(3, NUM_V, DV)[:, perm].reshape(3, -1)
    tiled, tiled_pool = gdn.gdn_ref(np.concatenate([qkv[:, :kd], v], 1), a[:, perm], b[:, perm], a_log[perm],
                                    dt_bias[perm], np.array([0, 3]), [0], [0], state[:, perm])  # fmt: skip
    grouped, grouped_pool = gdn.gdn_ref(qkv, a, b, a_log, dt_bias, np.array([0, 3]), [0], [0], state, tiled=False)
    close(tiled, grouped.reshape(3, NUM_V, DV)[:, perm].reshape(3, -1), 1e-6)
    close(tiled_pool, grouped_pool[:, perm], 1e-6)


def test_fresh_sequence_ignores_the_slot_contents():
    rng = np.random.default_rng(3)
    qkv, a, b, a_log, dt_bias, state = _rule_inputs(rng, 4)
    fresh_out, fresh_pool = gdn.gdn_ref(qkv, a, b, a_log, dt_bias, np.array([0, 4]), [0], [1], state)
    zero_out, zero_pool = gdn.gdn_ref(qkv, a, b, a_log, dt_bias, np.array([0, 4]), [0], [0], np.zeros_like(state))
    close(fresh_out, zero_out, 0.0)
    close(fresh_pool, zero_pool, 0.0)


def test_reference_chunks_equal_token_by_token():
    """Prefill in two chunks (ragged cut), then against one token a step: the same outputs and
    the same conv and delta states."""
    rng = np.random.default_rng(11)
    n, cut = 9, 4
    qkv, a, b, a_log, dt_bias, state = _rule_inputs(rng, n)
    w = rng.standard_normal((KS, CONV_DIM)).astype(np.float32)
    conv0 = rng.standard_normal((1, KS - 1, CONV_DIM)).astype(np.float32)
    chunked_state, chunked_conv, outs = state, conv0, []
    for lo, hi in ((0, cut), (cut, n)):
        span = np.array([0, hi - lo])
        y, chunked_conv = gdn.conv_ref(qkv[lo:hi], w, span, [0], [0], chunked_conv)
        o, chunked_state = gdn.gdn_ref(y, a[lo:hi], b[lo:hi], a_log, dt_bias, span, [0], [0], chunked_state)
        outs.append(o)
    stepped_state, stepped_conv = state, conv0
    for i in range(n):
        y, stepped_conv = gdn.conv_ref(qkv[i : i + 1], w, np.array([0, 1]), [0], [0], stepped_conv)
        o, stepped_state = gdn.gdn_ref(y, a[i : i + 1], b[i : i + 1], a_log, dt_bias, np.array([0, 1]), [0], [0],
                                       stepped_state)  # fmt: skip
        close(o, np.concatenate(outs)[i : i + 1], 1e-5)
    close(chunked_state, stepped_state, 1e-5)
    close(chunked_conv, stepped_conv, 0.0)


JOB = child_jobs.simulator_job("gdn_checks", [sys.executable, str(CHECKS), "tiny", *GDN_CHECKS], 1200, __name__,
                               cost_s=20)


@pytest.fixture(scope="module")
def sim_results() -> dict[str, str]:
    return child_jobs.json_results(JOB)


def test_every_gdn_kernel_has_a_simulator_check():
    assert set(GDN_CHECKS) == {"gdn_conv", "gdn_decode", "gdn_prefill", "gdn_gated_rmsnorm"}


@pytest.mark.parametrize("name", GDN_CHECKS)
def test_kernel_matches_reference_under_simulator(sim_results, name):
    assert sim_results.get(name) == "ok", sim_results.get(name, "check did not run")
