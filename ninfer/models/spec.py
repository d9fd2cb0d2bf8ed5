"""Architecture hyper-parameters of a decoder-only transformer.

One frozen record describes llama, qwen2, qwen3 and the qwen35 hybrid alike; the differences
are flags and optional fields (`has_qkv_bias`, `has_qk_norm`, `has_attn_gate`, `rope_dim`,
`layer_types` + `gdn`) rather than subclasses, so every backend runs one forward.

Hybrid models (qwen35, Qwen3.5's text model) interleave two kinds of token mixer: most layers
are Gated DeltaNet linear attention (`LINEAR_ATTENTION`: a per-sequence recurrent state and a
short causal conv1d, shapes in `GdnSpec`), the others full attention (`FULL_ATTENTION`) over the
paged KV cache. Only the full-attention layers hold KV pages.
"""

from __future__ import annotations

import attrs

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "qwen35")
FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"  # Gated DeltaNet
LAYER_TYPES = (FULL_ATTENTION, LINEAR_ATTENTION)


def _positive(instance, attribute, value):
    if value <= 0:
        raise ValueError(f"model spec field {attribute.name} must be positive, got {value}")


@attrs.frozen(kw_only=True)
class GdnSpec:
    """Shapes of a Gated DeltaNet layer.

    Value head p reads key / query head p % num_k_heads (the tiled order llama.cpp stores;
    Hugging Face groups them, p // (num_v_heads // num_k_heads), and its loader reorders).
    """

    num_k_heads: int = attrs.field(validator=_positive)  # query / key heads
    num_v_heads: int = attrs.field(validator=_positive)  # value heads (= recurrent state heads)
    head_k_dim: int = attrs.field(validator=_positive)
    head_v_dim: int = attrs.field(validator=_positive)
    conv_kernel: int = attrs.field(validator=_positive)  # taps of the causal depthwise conv1d

    def __attrs_post_init__(self):
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"GDN num_v_heads ({self.num_v_heads}) must be a multiple of num_k_heads ({self.num_k_heads})"
            )

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv1d: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    def state_nbytes(self, dtype_bytes: int) -> int:
        """Bytes of one layer's recurrent state: the conv window and the delta-rule matrix."""
        conv = (self.conv_kernel - 1) * self.conv_dim
        return (conv + self.num_v_heads * self.head_k_dim * self.head_v_dim) * dtype_bytes


def _tuple_of_str(value) -> tuple[str, ...]:
    return tuple(str(v) for v in value)


@attrs.frozen(kw_only=True)
class ModelSpec:
    """Shapes and constants of one model; weights follow the canonical names in weights.py.

    RoPE convention: canonical weights always use the split-half rotation (Hugging Face
    `rotate_half`). Loaders undo the GGUF llama Q/K row permutation, so backends never see it.
    With `rope_dim` set (partial rotary) only the first `rope_dim` dims of each head rotate.

    Norm weights are multiplicative gains (`rmsnorm(x) * w`): loaders of zero-centred
    checkpoints (Qwen3.5's `1 + w`) add the one at load.
    """

    arch: str = attrs.field(validator=attrs.validators.in_(SUPPORTED_ARCHS))
    num_layers: int = attrs.field(validator=_positive)
    d_model: int = attrs.field(validator=_positive)
    d_ffn: int = attrs.field(validator=_positive)
    num_heads: int = attrs.field(validator=_positive)
    num_kv_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    vocab_size: int = attrs.field(validator=_positive)  # rows of the embedding and the head
    max_context: int = attrs.field(validator=_positive)
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    tie_embeddings: bool = False
    has_qkv_bias: bool = False
    has_qk_norm: bool = False
    # Attention output gate (qwen35): wq yields, per head, head_dim query rows then head_dim
    # gate rows; the attention output is multiplied by sigmoid(gate) before wo.
    has_attn_gate: bool = False
    rope_dim: int | None = None  # rotated dims per head (partial rotary); None = head_dim
    layer_types: tuple[str, ...] = attrs.field(default=(), converter=_tuple_of_str)  # () = all full attention
    gdn: GdnSpec | None = None  # shapes of the linear-attention layers, when there are any
    # Ids the tokenizer knows (when fewer than vocab_size): the head's other rows are padding,
    # never sampled and left out of log-probabilities. None = every row is a token.
    tokenizer_vocab_size: int | None = None

    def __attrs_post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(
                f"the rotated dims must be even and at most head_dim ({self.head_dim}), got {self.rotary_dim}"
            )
        self._check_layer_types()
        if self.tokenizer_vocab_size is not None and not 0 < self.tokenizer_vocab_size <= self.vocab_size:
            raise ValueError(
                f"tokenizer_vocab_size must be in 1 .. vocab_size ({self.vocab_size}), got {self.tokenizer_vocab_size}"
            )

    def _check_layer_types(self) -> None:
        if not self.layer_types:
            if self.gdn is not None:
                raise ValueError("a GDN spec needs layer_types naming the linear-attention layers")
            return
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types names {len(self.layer_types)} layers, the model has {self.num_layers}")
        unknown = set(self.layer_types) - set(LAYER_TYPES)
        if unknown:
            raise ValueError(f"unknown layer types {sorted(unknown)} (known: {', '.join(LAYER_TYPES)})")
        if LINEAR_ATTENTION in self.layer_types and self.gdn is None:
            raise ValueError("linear-attention layers need the GDN shapes (gdn)")
        if FULL_ATTENTION not in self.layer_types:
            raise ValueError("a hybrid model needs at least one full-attention layer")

    def for_tokenizer(self, num_token_ids: int) -> ModelSpec:
        """This spec with the ids past a smaller tokenizer's marked as padding (see tokenizer_vocab_size)."""
        if num_token_ids >= self.vocab_size:
            return self
        return attrs.evolve(self, tokenizer_vocab_size=num_token_ids)

    @property
    def rotary_dim(self) -> int:
        return self.head_dim if self.rope_dim is None else self.rope_dim

    @property
    def is_hybrid(self) -> bool:
        """Some layers are linear attention: sequences carry recurrent state besides KV pages."""
        return LINEAR_ATTENTION in self.layer_types

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else FULL_ATTENTION

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Indices of the full-attention layers (the ones with KV pages)."""
        return tuple(i for i in range(self.num_layers) if self.layer_type(i) == FULL_ATTENTION)

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        """Indices of the linear-attention (Gated DeltaNet) layers."""
        return tuple(i for i in range(self.num_layers) if self.layer_type(i) == LINEAR_ATTENTION)

    @property
    def num_sampled_ids(self) -> int:
        """Ids that may be sampled: the tokenizer's, or the whole head."""
        return self.tokenizer_vocab_size or self.vocab_size

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
        """Bytes of K and V for one token over all full-attention layers."""
        return 2 * len(self.attention_layers) * self.kv_dim * dtype_bytes

    def recurrent_state_nbytes(self, dtype_bytes: int) -> int:
        """Bytes of one sequence's recurrent state over all linear-attention layers (0 if none)."""
        return 0 if self.gdn is None else len(self.gdn_layers) * self.gdn.state_nbytes(dtype_bytes)
