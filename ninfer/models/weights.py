"""Weights in their stored form, under canonical names every backend reads.

A `StoredTensor` keeps the bytes as the file holds them (F32, F16, BF16 or a GGML block
quantization); `dequantize()` gives float32 for backends that compute in float. Matrices are
(rows = output features, cols = input features), the layout of both GGUF and PyTorch linears,
so a quantized row is a run of whole blocks along the input dimension.

Canonical names (i is the layer index):

    embed                         [vocab, d_model]
    final_norm                    [d_model]
    lm_head                       [vocab, d_model]   absent when spec.tie_embeddings
    layers.{i}.attn_norm          [d_model]
    layers.{i}.wq / wk / wv       [q_dim | kv_dim, d_model]
                                  wq is [2 * q_dim, d_model] with spec.has_attn_gate: per head,
                                  head_dim query rows then head_dim output-gate rows
    layers.{i}.bq / bk / bv       [q_dim | kv_dim]   qwen2 only (spec.has_qkv_bias)
    layers.{i}.q_norm / k_norm    [head_dim]         qwen3 only (spec.has_qk_norm)
    layers.{i}.wo                 [d_model, q_dim]
    layers.{i}.ffn_norm           [d_model]
    layers.{i}.w_gate / w_up      [d_ffn, d_model]
    layers.{i}.w_down             [d_model, d_ffn]

Linear-attention (Gated DeltaNet) layers of a hybrid model (spec.gdn; K = key_dim, V =
value_dim, nv = num_v_heads) have no wq .. wo; their token mixer is, in llama.cpp's layout
(value heads in tiled order: value head p reads key head p % num_k_heads):

    layers.{i}.gdn_qkv            [2K + V, d_model]   q, k, v rows (the conv1d's channels)
    layers.{i}.gdn_z              [V, d_model]        gate of the output norm
    layers.{i}.gdn_beta           [nv, d_model]       write strength, sigmoid(h @ gdn_beta.T)
    layers.{i}.gdn_alpha          [nv, d_model]       decay input
    layers.{i}.gdn_conv           [2K + V, conv_kernel]  depthwise taps, oldest first
    layers.{i}.gdn_dt_bias        [nv]
    layers.{i}.gdn_a              [nv]                -exp(A_log): decay g = a * softplus(alpha + dt_bias)
    layers.{i}.gdn_norm           [head_v_dim]        gated RMSNorm gain
    layers.{i}.gdn_out            [d_model, V]
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import attrs
import numpy as np

FLOAT_TYPES = ("F32", "F16", "BF16")
# GGML block quantizations the engine accepts; every backend must handle each of them.
QUANT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
STORED_TYPES = FLOAT_TYPES + QUANT_TYPES

LAYER_NAMES = (
    "attn_norm", "wq", "wk", "wv", "bq", "bk", "bv", "q_norm", "k_norm",
    "wo", "ffn_norm", "w_gate", "w_up", "w_down",
)  # fmt: skip
GDN_LAYER_NAMES = (
    "gdn_qkv", "gdn_z", "gdn_beta", "gdn_alpha", "gdn_conv", "gdn_dt_bias", "gdn_a", "gdn_norm", "gdn_out",
)  # fmt: skip


class UnsupportedTensorType(ValueError):
    """A tensor is stored in a type no backend implements."""


@attrs.frozen(eq=False)
class StoredTensor:
    """One tensor in its stored form.

    `data` is float32 / float16 / uint16 (bf16 bits) of `shape` for float types, and uint8 of
    shape (rows, bytes_per_row) for block quantizations (rows = shape[0]).
    """

    qtype: str
    shape: tuple[int, ...]
    data: np.ndarray

    def __attrs_post_init__(self):
        if self.qtype not in STORED_TYPES:
            raise UnsupportedTensorType(
                f"tensor type {self.qtype} is not supported (supported: {', '.join(STORED_TYPES)})"
            )

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def is_quantized(self) -> bool:
        return self.qtype in QUANT_TYPES

    def dequantize(self) -> np.ndarray:
        """The tensor as float32 of `shape`."""
        if self.qtype == "F32":
            return np.asarray(self.data, dtype=np.float32).reshape(self.shape)
        if self.qtype == "F16":
            return np.asarray(self.data, dtype=np.float16).astype(np.float32).reshape(self.shape)
        if self.qtype == "BF16":
            bits = np.asarray(self.data, dtype=np.uint16).astype(np.uint32) << 16
            return bits.view(np.float32).reshape(self.shape)
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        out = dequantize(np.asarray(self.data), GGMLQuantizationType[self.qtype])
        return np.ascontiguousarray(out, dtype=np.float32).reshape(self.shape)

    def take_rows(self, order: np.ndarray) -> StoredTensor:
        """The same tensor with its rows reordered (used to undo GGUF's RoPE permutation)."""
        return StoredTensor(self.qtype, self.shape, np.ascontiguousarray(self.data[order]))

    def take_columns(self, order: np.ndarray) -> StoredTensor:
        """A float matrix with its columns reordered (quantized rows cannot be split)."""
        if self.is_quantized:
            raise ValueError(f"cannot reorder the columns of a {self.qtype} tensor")
        return StoredTensor(self.qtype, self.shape, np.ascontiguousarray(self.data[:, order]))


@attrs.frozen(eq=False)
class ModelWeights(Mapping[str, StoredTensor]):
    """Canonical name -> StoredTensor, with the layer count for convenient iteration."""

    tensors: dict[str, StoredTensor]
    num_layers: int

    def __getitem__(self, name: str) -> StoredTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"model has no tensor {name!r}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def layer(self, i: int, name: str) -> StoredTensor | None:
        """Tensor `name` of layer i, or None when this architecture has none (e.g. biases)."""
        return self.tensors.get(f"layers.{i}.{name}")

    def head(self) -> StoredTensor:
        """The output projection: lm_head, or the embedding when tied."""
        return self.tensors.get("lm_head") or self.tensors["embed"]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())
