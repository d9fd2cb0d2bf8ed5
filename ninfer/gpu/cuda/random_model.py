"""Random-weight models of real shapes (numpy only): kernels and benchmarks at scale.

Quant bits are random bytes with finite scales sized so activations stay O(1) through the
layers; norms are near 1. Shapes follow public configs (Qwen3-0.6B, Llama-3-8B, SmolLM2).
"""

from __future__ import annotations

import numpy as np

from ninfer.gpu.cuda.kernels.quant_layout import random_stored
from ninfer.models.spec import ModelSpec
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


def random_spec(shape: str, **overrides) -> ModelSpec:
    return ModelSpec(**{**SHAPES[shape], **overrides})


def random_model(spec: ModelSpec, qtype: str = "Q4_1", *, embed_qtype: str = "Q8_0", seed: int = 0):
    """(spec, ModelWeights) with every matrix of `qtype` (embedding / head `embed_qtype`)."""
    rng = np.random.default_rng(seed)

    def mat(rows, cols, qt=qtype, gain=1.0):
        return random_stored(qt, rows, cols, rng, scale=gain / np.sqrt(cols))

    def vec(n, mean=1.0, spread=0.1):
        return StoredTensor("F32", (n,), (mean + spread * rng.standard_normal(n)).astype(np.float32))

    t = {"embed": mat(spec.vocab_size, spec.d_model, embed_qtype, gain=np.sqrt(spec.d_model)), "final_norm": vec(spec.d_model)}
    if not spec.tie_embeddings:
        t["lm_head"] = mat(spec.vocab_size, spec.d_model, embed_qtype, gain=4.0)
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        t[p + "attn_norm"] = vec(spec.d_model)
        t[p + "wq"] = mat(spec.q_dim, spec.d_model, gain=2.0)
        t[p + "wk"] = mat(spec.kv_dim, spec.d_model, gain=2.0)
        t[p + "wv"] = mat(spec.kv_dim, spec.d_model)
        if spec.has_qkv_bias:
            for b, n in (("bq", spec.q_dim), ("bk", spec.kv_dim), ("bv", spec.kv_dim)):
                t[p + b] = vec(n, 0.0, 0.05)
        if spec.has_qk_norm:
            t[p + "q_norm"], t[p + "k_norm"] = vec(spec.head_dim), vec(spec.head_dim)
        t[p + "wo"] = mat(spec.d_model, spec.q_dim, gain=0.5)
        t[p + "ffn_norm"] = vec(spec.d_model)
        t[p + "w_gate"] = mat(spec.d_ffn, spec.d_model)
        t[p + "w_up"] = mat(spec.d_ffn, spec.d_model)
        t[p + "w_down"] = mat(spec.d_model, spec.d_ffn, gain=0.5)
    return spec, ModelWeights(t, spec.num_layers)
