"""Random-weight models of real shapes (numpy only): kernels and benchmarks at scale.

Quant bits are random bytes with finite scales sized so activations stay O(1) through the
layers; norms are near 1. Shapes follow public configs (Qwen3-0.6B, Llama-3-8B, SmolLM2).
"""

from __future__ import annotations

import numpy as np

from ninfer.gpu.cuda.kernels.quant_layout import random_stored
from ninfer.models.spec import FULL_ATTENTION, LINEAR_ATTENTION, GdnSpec, ModelSpec
from ninfer.models.weights import ModelWeights, StoredTensor

SHAPES = {
    "tiny": dict(arch="llama", num_layers=2, d_model=64, d_ffn=128, num_heads=4, num_kv_heads=2, head_dim=32,
                 vocab_size=96, max_context=64),
    "smollm2-135m": dict(arch="llama", num_layers=30, d_model=576, d_ffn=1536, num_heads=9, num_kv_heads=3,
                         head_dim=64, vocab_size=49152, max_context=8192, rope_theta=100000.0, rms_eps=1e-5,
                         tie_embeddings=True),
    "qwen3-0.6b": dict(arch="qwen3", num_layers=28, d_model=1024, d_ffn=3072, num_heads=16, num_kv_heads=8,
                       head_dim=128, vocab_size=151936, max_context=8192, rope_theta=1000000.0, rms_eps=1e-6,
                       tie_embeddings=True, has_qk_norm=True),
    "llama3-8b": dict(arch="llama", num_layers=32, d_model=4096, d_ffn=14336, num_heads=32, num_kv_heads=8,
                      head_dim=128, vocab_size=128256, max_context=8192, rope_theta=500000.0, rms_eps=1e-5),
}  # fmt: skip


# Hybrids (qwen35): three Gated DeltaNet layers to one gated full-attention layer (the tiny
# one: GDN, attention, GDN)
HYBRID_SHAPES = {
    # (the simulator's: every dimension as small as the kernels allow)
    "tiny-hybrid": dict(arch="qwen35", num_layers=3, d_model=32, d_ffn=32, num_heads=1, num_kv_heads=1, head_dim=32,
                        rope_dim=8, vocab_size=64, max_context=64, has_qk_norm=True, has_attn_gate=True,
                        gdn=dict(num_k_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=16, conv_kernel=4)),
    # Qwen3.5's text-model layer shapes (256-dim heads, a quarter rotated; 128 x 128 GDN states),
    # fewer layers: GPU checks at real speed
    "qwen35-like": dict(arch="qwen35", num_layers=8, d_model=1024, d_ffn=3584, num_heads=8, num_kv_heads=2,
                        head_dim=256, rope_dim=64, vocab_size=151936, max_context=4096, rope_theta=10000000.0,
                        has_qk_norm=True, has_attn_gate=True, tie_embeddings=True,
                        gdn=dict(num_k_heads=16, num_v_heads=16, head_k_dim=128, head_v_dim=128, conv_kernel=4)),
    # a Qwen3.5-27B-sized dense hybrid (64 layers, 48 GDN + 16 gated attention; 5120 wide,
    # 17408 FFN, 24 x 256 query heads over 4 KV heads, 48 x 128 x 128 GDN value states, an
    # untied 248,320-row head): the single-GPU benchmark shape
    "qwen35-27b": dict(arch="qwen35", num_layers=64, d_model=5120, d_ffn=17408, num_heads=24, num_kv_heads=4,
                       head_dim=256, rope_dim=64, vocab_size=248320, max_context=8192, rope_theta=10000000.0,
                       rms_eps=1e-6, has_qk_norm=True, has_attn_gate=True, tie_embeddings=False,
                       gdn=dict(num_k_heads=16, num_v_heads=48, head_k_dim=128, head_v_dim=128, conv_kernel=4)),
}  # fmt: skip


def random_spec(shape: str, **overrides) -> ModelSpec:
    if shape in HYBRID_SHAPES:
        fields = {**HYBRID_SHAPES[shape], **overrides}
        n = fields["num_layers"]
        full = (lambda i: i == 1) if shape == "tiny-hybrid" else (lambda i: i % 4 == 3)
        types = [FULL_ATTENTION if full(i) else LINEAR_ATTENTION for i in range(n)]
        return ModelSpec(**{**fields, "gdn": GdnSpec(**fields["gdn"]), "layer_types": types})
    return ModelSpec(**{**SHAPES[shape], **overrides})


def random_model(spec: ModelSpec, qtype: str = "Q4_1", *, embed_qtype: str = "Q8_0", seed: int = 0,
                 reuse_matrices: bool = False):
    """(spec, ModelWeights) with every matrix of `qtype` (embedding / head `embed_qtype`).
    `reuse_matrices`: layers share the host copy of each matrix shape (drawn once), for speed
    benchmarks of large shapes (a 27B model's draw takes minutes); each is still uploaded apart."""
    rng = np.random.default_rng(seed)
    drawn: dict = {}

    def mat(rows, cols, qt=qtype, gain=1.0):
        if not reuse_matrices:
            return random_stored(qt, rows, cols, rng, scale=gain / np.sqrt(cols))
        key = (rows, cols, qt, gain)
        if key not in drawn:
            drawn[key] = random_stored(qt, rows, cols, rng, scale=gain / np.sqrt(cols))
        return drawn[key]

    def vec(n, mean=1.0, spread=0.1):
        return StoredTensor("F32", (n,), (mean + spread * rng.standard_normal(n)).astype(np.float32))

    t = {"embed": mat(spec.vocab_size, spec.d_model, embed_qtype, gain=np.sqrt(spec.d_model)), "final_norm": vec(spec.d_model)}
    if not spec.tie_embeddings:
        t["lm_head"] = mat(spec.vocab_size, spec.d_model, embed_qtype, gain=4.0)
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        t[p + "attn_norm"] = vec(spec.d_model)
        if spec.layer_type(i) == LINEAR_ATTENTION:
            t.update(_random_gdn(spec, p, mat, vec, rng))
        else:
            t.update(_random_attention(spec, p, mat, vec))
        t[p + "ffn_norm"] = vec(spec.d_model)
        t[p + "w_gate"] = mat(spec.d_ffn, spec.d_model)
        t[p + "w_up"] = mat(spec.d_ffn, spec.d_model)
        t[p + "w_down"] = mat(spec.d_model, spec.d_ffn, gain=0.5)
    return spec, ModelWeights(t, spec.num_layers)


def _random_attention(spec, p, mat, vec) -> dict:
    """An attention layer's tensors (drawn in this order: the dense models' weights stay as they were)."""
    t = {p + "wq": mat(spec.q_dim * (2 if spec.has_attn_gate else 1), spec.d_model, gain=2.0)}
    t[p + "wk"] = mat(spec.kv_dim, spec.d_model, gain=2.0)
    t[p + "wv"] = mat(spec.kv_dim, spec.d_model)
    if spec.has_qkv_bias:
        for name, n in (("bq", spec.q_dim), ("bk", spec.kv_dim), ("bv", spec.kv_dim)):
            t[p + name] = vec(n, 0.0, 0.05)
    if spec.has_qk_norm:
        t[p + "q_norm"], t[p + "k_norm"] = vec(spec.head_dim), vec(spec.head_dim)
    t[p + "wo"] = mat(spec.d_model, spec.q_dim, gain=0.5)
    return t


def _random_gdn(spec, p, mat, vec, rng) -> dict:
    """A Gated DeltaNet layer's tensors: decays exp(g) spread over (0, 1), float32 conv taps."""
    g, d = spec.gdn, spec.d_model
    nv = g.num_v_heads
    taps = (rng.standard_normal((g.conv_dim, g.conv_kernel)) * 0.5).astype(np.float32)
    return {
        p + "gdn_qkv": mat(g.conv_dim, d, gain=2.0), p + "gdn_z": mat(g.value_dim, d),
        p + "gdn_beta": mat(nv, d), p + "gdn_alpha": mat(nv, d),
        p + "gdn_conv": StoredTensor("F32", taps.shape, taps),
        p + "gdn_dt_bias": vec(nv, 0.0, 0.5),
        p + "gdn_a": StoredTensor("F32", (nv,), -np.exp(rng.standard_normal(nv) * 0.5).astype(np.float32)),
        p + "gdn_norm": vec(g.head_v_dim), p + "gdn_out": mat(d, g.value_dim, gain=0.5),
    }  # fmt: skip
