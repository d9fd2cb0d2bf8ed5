"""A tiny random Qwen3.5 hybrid (3 Gated DeltaNet layers + 1 gated full-attention layer), saved
as a Hugging Face directory and written as a llama.cpp-style `qwen35` GGUF.

`build_tiny_hybrid(directory)` saves the seeded transformers model (the oracle) and its GGUF
twin; test modules share one copy (`tiny_hybrid_for`) through the fixtures here, imported by
name: `from hybrid_models import hybrid, model` (`hybrid`: the TinyHybrid; `model`: its GGUF
loaded by ninfer). The GGUF is converted here, independently of ninfer's HF
loader, with llama.cpp's conventions: zero-centred norm gains + 1 (not the gated GDN norm),
`ssm_a = -exp(A_log)`, `dt_bias` as `ssm_dt.bias`, conv1d squeezed to [C, K], and value heads
moved from grouped to tiled order in every GDN tensor that has them.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import gguf
import numpy as np
import pytest
from tokenizers import pre_tokenizers

from ninfer.models.tokenizer import Tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENS = sorted(pre_tokenizers.ByteLevel.alphabet()) + SPECIALS  # 256 bytes, then 3 specials
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
CONFIG = dict(
    vocab_size=len(TOKENS), hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4,
    linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
    max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.1, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [1, 1, 0]},
)  # fmt: skip


@attrs.frozen
class TinyHybrid:
    hf_dir: Path
    gguf_path: Path
    model: object  # the float32 transformers Qwen3_5ForCausalLM (eval mode)


def build_tiny_hybrid(directory: Path, *, seed: int = 0) -> TinyHybrid:
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**CONFIG, eos_token_id=TOKENS.index("<|im_end|>"))).eval()
    with torch.no_grad():  # move 1-D parameters (norm gains, A_log, dt_bias) off their initial values
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.5)
    hf_dir = directory / "tiny-qwen35"
    model.save_pretrained(hf_dir)
    _write_hf_tokenizer(hf_dir)
    gguf_path = write_hybrid_gguf(directory / "tiny-qwen35.gguf", model)
    return TinyHybrid(hf_dir, gguf_path, model)


def _tokenizer() -> Tokenizer:
    types = [1] * 256 + [3] * len(SPECIALS)
    eos = TOKENS.index("<|im_end|>")
    return Tokenizer.from_gguf_metadata(TOKENS, types, [], model="gpt2", pre="qwen2", bos_id=None, eos_id=eos)


def _write_hf_tokenizer(path: Path) -> None:
    (path / "tokenizer.json").write_text(_tokenizer().to_json_str())
    config = {"eos_token": "<|im_end|>", "chat_template": TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def write_hybrid_gguf(path: Path, model, *, arch: str = "qwen35", qtype=None) -> Path:
    """The model as a llama.cpp `qwen35` GGUF (float32 tensors unless `qtype` for matrices)."""
    cfg = model.config
    writer = gguf.GGUFWriter(path, arch)
    head_dim = cfg.head_dim
    rotary = int(head_dim * cfg.rope_parameters["partial_rotary_factor"])
    for key, value in {
        "block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads, "attention.head_count_kv": cfg.num_key_value_heads,
        "attention.key_length": head_dim, "attention.value_length": head_dim, "rope.dimension_count": rotary,
        "ssm.conv_kernel": cfg.linear_conv_kernel_dim, "ssm.state_size": cfg.linear_key_head_dim,
        "ssm.group_count": cfg.linear_num_key_heads, "ssm.time_step_rank": cfg.linear_num_value_heads,
        "ssm.inner_size": cfg.linear_num_value_heads * cfg.linear_value_head_dim, "full_attention_interval": 4,
    }.items():  # fmt: skip
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.rope.freq_base", cfg.rope_parameters["rope_theta"])
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(TOKENS)
    writer.add_token_types([1] * 256 + [3] * len(SPECIALS))
    writer.add_eos_token_id(TOKENS.index("<|im_end|>"))
    writer.add_chat_template(TEMPLATE)
    for name, array in gguf_tensors(model).items():
        if qtype is not None and array.ndim == 2 and array.shape[1] % 32 == 0:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_tensors(model) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array, converted from the HF state dict the way llama.cpp does."""
    cfg = model.config
    nk, nv, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    key_dim = nk * cfg.linear_key_head_dim
    # tiled value head t = rep * nk + kh holds HF (grouped) value head kh * (nv // nk) + rep
    grouped = np.arange(nv).reshape(nk, nv // nk)
    head_order = grouped.T.reshape(-1)
    v_rows = (head_order[:, None] * dv + np.arange(dv)).reshape(-1)
    qkv_rows = np.concatenate([np.arange(2 * key_dim), 2 * key_dim + v_rows])
    out = {}
    for name, tensor in model.state_dict().items():
        a = tensor.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = a
        elif name == "model.norm.weight":
            out["output_norm.weight"] = a + 1
        elif name == "lm_head.weight":
            out["output.weight"] = a
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            gguf_name, array = _layer_tensor(rest, a, head_order, v_rows, qkv_rows)
            out[f"blk.{layer}.{gguf_name}"] = np.ascontiguousarray(array, dtype=np.float32)
    return out


def _layer_tensor(rest: str, a: np.ndarray, heads, v_rows, qkv_rows) -> tuple[str, np.ndarray]:
    plain = {
        "input_layernorm.weight": ("attn_norm.weight", a + 1),
        "post_attention_layernorm.weight": ("post_attention_norm.weight", a + 1),
        "self_attn.q_norm.weight": ("attn_q_norm.weight", a + 1),
        "self_attn.k_norm.weight": ("attn_k_norm.weight", a + 1),
        "self_attn.q_proj.weight": ("attn_q.weight", a), "self_attn.k_proj.weight": ("attn_k.weight", a),
        "self_attn.v_proj.weight": ("attn_v.weight", a), "self_attn.o_proj.weight": ("attn_output.weight", a),
        "mlp.gate_proj.weight": ("ffn_gate.weight", a), "mlp.up_proj.weight": ("ffn_up.weight", a),
        "mlp.down_proj.weight": ("ffn_down.weight", a),
        "linear_attn.norm.weight": ("ssm_norm.weight", a),
    }  # fmt: skip
    if rest in plain:
        return plain[rest]
    reordered = {
        "linear_attn.in_proj_qkv.weight": ("attn_qkv.weight", lambda: a[qkv_rows]),
        "linear_attn.in_proj_z.weight": ("attn_gate.weight", lambda: a[v_rows]),
        "linear_attn.in_proj_b.weight": ("ssm_beta.weight", lambda: a[heads]),
        "linear_attn.in_proj_a.weight": ("ssm_alpha.weight", lambda: a[heads]),
        "linear_attn.conv1d.weight": ("ssm_conv1d.weight", lambda: a[:, 0, :][qkv_rows]),
        "linear_attn.dt_bias": ("ssm_dt.bias", lambda: a[heads]),
        "linear_attn.A_log": ("ssm_a", lambda: -np.exp(a[heads])),
        "linear_attn.out_proj.weight": ("ssm_out.weight", lambda: a[:, v_rows]),
    }
    gguf_name, convert = reordered[rest]
    return gguf_name, convert()


_BUILT: dict[Path, TinyHybrid] = {}


def tiny_hybrid_for(tmp_path_factory) -> TinyHybrid:
    """The session's tiny hybrid, built on first use (test modules share one copy)."""
    key = tmp_path_factory.getbasetemp()
    if key not in _BUILT:
        _BUILT[key] = build_tiny_hybrid(tmp_path_factory.mktemp("hybrid"))
    return _BUILT[key]


_LOADED: dict[Path, object] = {}


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory) -> TinyHybrid:
    """The session's tiny hybrid (built once, shared by every module that imports this)."""
    return tiny_hybrid_for(tmp_path_factory)


@pytest.fixture(scope="module")
def model(hybrid):
    """Its GGUF loaded by ninfer (loaded once per session)."""
    from ninfer.models.loader import load_model

    if hybrid.gguf_path not in _LOADED:
        _LOADED[hybrid.gguf_path] = load_model(hybrid.gguf_path)
    return _LOADED[hybrid.gguf_path]
