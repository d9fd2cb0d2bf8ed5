"""Qwen3.5 hybrid models (`qwen35`): hyper-parameters and tensors, for both file formats.

Canonical weights follow llama.cpp's GGUF layout (weights.py lists them), so GGUF tensors load
as stored and Hugging Face checkpoints are converted here, the way llama.cpp's converter does:

- RMSNorm gains are zero-centred in HF (`x * (1 + w)`): the loader adds the one, except to
  the gated norm of the linear-attention output (`linear_attn.norm`, a plain gain).
- `A_log` becomes `gdn_a = -exp(A_log)`; `conv1d.weight` [C, 1, K] becomes [C, K].
- Value heads move from HF's grouped order (value head j reads key head j // r, r = nv / nk)
  to the tiled order (value head p reads key head p % nk): the V rows of `in_proj_qkv` and the
  conv taps, `in_proj_z`, `in_proj_a`, `in_proj_b`, `A_log`, `dt_bias`, and the columns of
  `out_proj`. Tiled is what GGUF files hold; a GGUF's quantized `ssm_out` could not have its
  columns reordered, an HF float one can.

Multimodal checkpoints (`Qwen3_5ForConditionalGeneration`) load their text model; the vision
tower's tensors are skipped with a warning (ninfer takes text only). Multi-token-prediction
heads (`mtp.*`) are skipped too.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import numpy as np

from ninfer.models.errors import ModelLoadError
from ninfer.models.spec import FULL_ATTENTION, LINEAR_ATTENTION, GdnSpec, ModelSpec
from ninfer.models.weights import StoredTensor

log = logging.getLogger(__name__)

HF_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
HF_CLASSES = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
# MoE relatives: refused until the MoE issue lands.
MOE_MODEL_TYPES = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")
MOE_GGUF_ARCHS = ("qwen3next", "qwen35moe")
MOE_REFUSAL = "is a mixture-of-experts hybrid, which ninfer does not run yet (MoE support is a separate issue)"

_HF_LAYER = re.compile(r"model\.(?:language_model\.)?layers\.(\d+)\.(.+)")
_HF_GLOBAL = {
    "model.embed_tokens.weight": "embed", "model.language_model.embed_tokens.weight": "embed",
    "model.norm.weight": "final_norm", "model.language_model.norm.weight": "final_norm",
    "lm_head.weight": "lm_head",
}  # fmt: skip
_HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
    "self_attn.q_proj.weight": "wq", "self_attn.k_proj.weight": "wk", "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo", "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
    "mlp.gate_proj.weight": "w_gate", "mlp.up_proj.weight": "w_up", "mlp.down_proj.weight": "w_down",
    "linear_attn.in_proj_qkv.weight": "gdn_qkv", "linear_attn.in_proj_z.weight": "gdn_z",
    "linear_attn.in_proj_b.weight": "gdn_beta", "linear_attn.in_proj_a.weight": "gdn_alpha",
    "linear_attn.conv1d.weight": "gdn_conv", "linear_attn.dt_bias": "gdn_dt_bias",
    "linear_attn.A_log": "gdn_a", "linear_attn.norm.weight": "gdn_norm", "linear_attn.out_proj.weight": "gdn_out",
}  # fmt: skip
_ZERO_CENTRED = ("attn_norm", "ffn_norm", "final_norm", "q_norm", "k_norm")
_SKIPPED_PREFIXES = ("model.visual.", "visual.", "mtp.")

# GGUF (llama.cpp `qwen35`) tensor names; canonical weights are stored as GGUF holds them.
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm", "post_attention_norm.weight": "ffn_norm",
    "attn_q.weight": "wq", "attn_k.weight": "wk", "attn_v.weight": "wv", "attn_output.weight": "wo",
    "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm",
    "ffn_gate.weight": "w_gate", "ffn_up.weight": "w_up", "ffn_down.weight": "w_down",
    "attn_qkv.weight": "gdn_qkv", "attn_gate.weight": "gdn_z", "ssm_beta.weight": "gdn_beta",
    "ssm_alpha.weight": "gdn_alpha", "ssm_conv1d.weight": "gdn_conv", "ssm_dt.bias": "gdn_dt_bias",
    "ssm_dt": "gdn_dt_bias", "ssm_a": "gdn_a", "ssm_norm.weight": "gdn_norm", "ssm_out.weight": "gdn_out",
}  # fmt: skip

ATTENTION_ROLES = ("attn_norm", "wq", "wk", "wv", "wo", "q_norm", "k_norm", "ffn_norm", "w_gate", "w_up", "w_down")
GDN_ROLES = (
    "attn_norm", "gdn_qkv", "gdn_z", "gdn_beta", "gdn_alpha", "gdn_conv", "gdn_dt_bias", "gdn_a",
    "gdn_norm", "gdn_out", "ffn_norm", "w_gate", "w_up", "w_down",
)  # fmt: skip


def layer_types_every(num_layers: int, interval: int) -> tuple[str, ...]:
    """Every `interval`-th layer is full attention, the rest linear (Qwen3.5's pattern)."""
    return tuple(LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(num_layers))


def layer_shapes(spec: ModelSpec, i: int) -> dict[str, tuple[int, ...]]:
    """Role -> shape of every tensor layer i of a qwen35 model needs."""
    d, f = spec.d_model, spec.d_ffn
    shapes = {"attn_norm": (d,), "ffn_norm": (d,), "w_gate": (f, d), "w_up": (f, d), "w_down": (d, f)}
    if spec.layer_type(i) == FULL_ATTENTION:
        q_rows = 2 * spec.q_dim if spec.has_attn_gate else spec.q_dim
        return shapes | {
            "wq": (q_rows, d), "wk": (spec.kv_dim, d), "wv": (spec.kv_dim, d), "wo": (d, spec.q_dim),
            "q_norm": (spec.head_dim,), "k_norm": (spec.head_dim,),
        }  # fmt: skip
    g = spec.gdn
    nv, c = g.num_v_heads, g.conv_dim
    return shapes | {
        "gdn_qkv": (c, d), "gdn_z": (g.value_dim, d), "gdn_beta": (nv, d), "gdn_alpha": (nv, d),
        "gdn_conv": (c, g.conv_kernel), "gdn_dt_bias": (nv,), "gdn_a": (nv,),
        "gdn_norm": (g.head_v_dim,), "gdn_out": (d, g.value_dim),
    }  # fmt: skip


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of every tensor a qwen35 spec needs."""
    shapes: dict[str, tuple[int, ...]] = {"embed": (spec.vocab_size, spec.d_model), "final_norm": (spec.d_model,)}
    if not spec.tie_embeddings:
        shapes["lm_head"] = (spec.vocab_size, spec.d_model)
    for i in range(spec.num_layers):
        shapes |= {f"layers.{i}.{role}": shape for role, shape in layer_shapes(spec, i).items()}
    return shapes


# -- Hugging Face ---------------------------------------------------------------------------


def is_hf_config(config: dict[str, Any]) -> bool:
    return config.get("model_type") in HF_MODEL_TYPES or any(c in HF_CLASSES for c in config.get("architectures") or ())


def spec_from_hf_config(config: dict[str, Any], source: Path | str) -> ModelSpec:
    """The spec of a qwen3_5 (multimodal: its text_config) or qwen3_5_text config.json."""
    text = config.get("text_config") or config
    rope = text.get("rope_parameters") or {}
    kind = rope.get("rope_type", "default")
    if kind != "default":
        raise ModelLoadError(f"{source} asks for rope scaling {kind!r}; ninfer supports only plain RoPE")
    if text.get("hidden_act", "silu") != "silu" or text.get("attention_bias"):
        raise ModelLoadError(f"{source}: only silu activations without attention biases are supported")
    num_layers = int(text["num_hidden_layers"])
    layer_types = text.get("layer_types") or layer_types_every(num_layers, int(text.get("full_attention_interval", 4)))
    head_dim = int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])
    partial = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0)))
    tie = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return ModelSpec(
        arch="qwen35",
        num_layers=num_layers,
        d_model=int(text["hidden_size"]),
        d_ffn=int(text["intermediate_size"]),
        num_heads=int(text["num_attention_heads"]),
        num_kv_heads=int(text.get("num_key_value_heads") or text["num_attention_heads"]),
        head_dim=head_dim,
        vocab_size=int(text["vocab_size"]),
        max_context=int(text.get("max_position_embeddings", 2048)),
        rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
        rms_eps=float(text.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(tie),
        has_qk_norm=True,
        has_attn_gate=True,
        rope_dim=int(head_dim * partial),
        layer_types=tuple(layer_types),
        gdn=GdnSpec(
            num_k_heads=int(text["linear_num_key_heads"]),
            num_v_heads=int(text["linear_num_value_heads"]),
            head_k_dim=int(text["linear_key_head_dim"]),
            head_v_dim=int(text["linear_value_head_dim"]),
            conv_kernel=int(text["linear_conv_kernel_dim"]),
        ),
    )


def convert_hf_tensor(
    hf_name: str, tensor: StoredTensor, spec: ModelSpec, source: Path
) -> tuple[str, StoredTensor] | None:
    """(canonical name, tensor in canonical form) of one HF tensor; None for a skipped one."""
    if hf_name.startswith(_SKIPPED_PREFIXES):
        if not hf_name.startswith("mtp."):
            _warn_vision_once(source)
        return None
    if hf_name in _HF_GLOBAL:
        name = _HF_GLOBAL[hf_name]
        return name, _plus_one(tensor) if name == "final_norm" else tensor
    match = _HF_LAYER.fullmatch(hf_name)
    if not match or match.group(2) not in _HF_LAYER_NAMES:
        raise ModelLoadError(f"{source} holds tensor {hf_name}, which ninfer's qwen35 forward does not use")
    role = _HF_LAYER_NAMES[match.group(2)]
    return f"layers.{match.group(1)}.{role}", _hf_to_canonical(role, tensor, spec)


_warned_vision: set[Path] = set()


def _warn_vision_once(source: Path) -> None:
    if source not in _warned_vision:
        _warned_vision.add(source)
        log.warning("%s: skipping the vision tower; ninfer runs the text model only", source)


def _hf_to_canonical(role: str, tensor: StoredTensor, spec: ModelSpec) -> StoredTensor:
    if role in _ZERO_CENTRED:
        return _plus_one(tensor)
    if not role.startswith("gdn_") or role == "gdn_norm":
        return tensor
    g = spec.gdn
    heads = tiled_head_order(g.num_k_heads, g.num_v_heads)
    v_rows = (heads[:, None] * g.head_v_dim + np.arange(g.head_v_dim)).reshape(-1)
    qkv_rows = np.concatenate([np.arange(2 * g.key_dim), 2 * g.key_dim + v_rows])
    if role == "gdn_conv":
        taps = tensor.data.reshape(g.conv_dim, g.conv_kernel)
        return StoredTensor(tensor.qtype, (g.conv_dim, g.conv_kernel), taps).take_rows(qkv_rows)
    if role == "gdn_a":
        a_log = tensor.dequantize()[heads]
        return StoredTensor("F32", tensor.shape, -np.exp(a_log.astype(np.float32)))
    order = {"gdn_qkv": qkv_rows, "gdn_z": v_rows, "gdn_beta": heads, "gdn_alpha": heads, "gdn_dt_bias": heads}
    if role == "gdn_out":
        return tensor.take_columns(v_rows)
    return tensor.take_rows(order[role])


def tiled_head_order(num_k_heads: int, num_v_heads: int) -> np.ndarray:
    """HF (grouped) value-head index of each tiled value head p: key head p % nk, repeat p // nk."""
    p = np.arange(num_v_heads)
    return (p % num_k_heads) * (num_v_heads // num_k_heads) + p // num_k_heads


def _plus_one(tensor: StoredTensor) -> StoredTensor:
    return StoredTensor("F32", tensor.shape, tensor.dequantize() + np.float32(1.0))


# -- GGUF -----------------------------------------------------------------------------------


def spec_from_gguf(meta, common: dict[str, Any]) -> ModelSpec:
    """The spec of a llama.cpp `qwen35` file; `common` holds the fields every arch reads.

    block_count may include multi-token-prediction blocks after the decoder
    (`nextn_predict_layers`, as llama.cpp writes them for other MTP models): they are not layers.
    """
    common = common | {"num_layers": common["num_layers"] - int(meta.arch_key("nextn_predict_layers", 0))}
    num_v_heads = int(meta.arch_key("ssm.time_step_rank", required=True))
    interval = int(meta.arch_key("full_attention_interval", 4))
    return ModelSpec(
        **common,
        has_qk_norm=True,
        has_attn_gate=True,
        rope_dim=int(meta.arch_key("rope.dimension_count", common["head_dim"])),
        layer_types=layer_types_every(common["num_layers"], interval),
        gdn=GdnSpec(
            num_k_heads=int(meta.arch_key("ssm.group_count", required=True)),
            num_v_heads=num_v_heads,
            head_k_dim=int(meta.arch_key("ssm.state_size", required=True)),
            head_v_dim=int(meta.arch_key("ssm.inner_size", required=True)) // num_v_heads,
            conv_kernel=int(meta.arch_key("ssm.conv_kernel", required=True)),
        ),
    )
