"""Architecture hyper-parameters of a dense decoder-only transformer.

One frozen record describes llama, qwen2 and qwen3 alike; the differences are flags
(`has_qkv_bias`, `has_qk_norm`) rather than subclasses, so every backend runs one forward.
"""

from __future__ import annotations

import attrs

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")


def _positive(instance, attribute, value):
    if value <= 0:
        raise ValueError(f"model spec field {attribute.name} must be positive, got {value}")


@attrs.frozen(kw_only=True)
class ModelSpec:
    """Shapes and constants of one model; weights follow the canonical names in weights.py.

    RoPE convention: canonical weights always use the split-half rotation (Hugging Face
    `rotate_half`). Loaders undo the GGUF llama Q/K row permutation, so backends never see it.
    """

    arch: str = attrs.field(validator=attrs.validators.in_(SUPPORTED_ARCHS))
    num_layers: int = attrs.field(validator=_positive)
    d_model: int = attrs.field(validator=_positive)
    d_ffn: int = attrs.field(validator=_positive)
    num_heads: int = attrs.field(validator=_positive)
    num_kv_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    vocab_size: int = attrs.field(validator=_positive)
    max_context: int = attrs.field(validator=_positive)
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    tie_embeddings: bool = False
    has_qkv_bias: bool = False
    has_qk_norm: bool = False

    def __attrs_post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def group_size(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V for one token over all layers."""
        return 2 * self.num_layers * self.kv_dim * dtype_bytes
