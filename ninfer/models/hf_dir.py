"""`load_hf_dir(path)`: a Hugging Face style model directory (config.json + *.safetensors).

Supported: llama, qwen2 and qwen3 dense decoders with plain RoPE, and Qwen3.5 hybrids (qwen3_5,
qwen3_5_text; converted to canonical form by qwen35.py). Hugging Face checkpoints
already use the split-half (`rotate_half`) RoPE layout that canonical weights use, so Q/K rows
are taken as stored (unlike GGUF llama files, nothing is permuted).

safetensors' numpy backend cannot build bfloat16 arrays, so BF16 tensors are memory-mapped
straight from the file (its header is a length-prefixed JSON table of dtype, shape and byte
offsets) and kept as uint16 bits, the `StoredTensor` "BF16" form.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np

from ninfer.models import qwen35
from ninfer.models.errors import ModelLoadError
from ninfer.models.loaded import LoadedModel
from ninfer.models.spec import ModelSpec
from ninfer.models.weights import ModelWeights, StoredTensor

ARCH_BY_CLASS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "embed",
    "model.norm.weight": "final_norm",
    "lm_head.weight": "lm_head",
}
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.q_proj.bias": "bq",
    "self_attn.k_proj.bias": "bk",
    "self_attn.v_proj.bias": "bv",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "self_attn.o_proj.weight": "wo",
    "post_attention_layernorm.weight": "ffn_norm",
    "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16}
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # a buffer older checkpoints saved; recomputed


def load_hf_dir(path: str | Path, *, progress: bool = False) -> LoadedModel:
    """Load a directory with config.json, *.safetensors and tokenizer.json."""
    path = Path(path).expanduser()
    config = read_json(path / "config.json")
    spec = spec_from_config(config, source=path / "config.json")
    weights = read_weights(path, spec, progress=progress)
    tokenizer_config = read_json(path / "tokenizer_config.json", required=False) or {}
    declared_stop_ids = _declared_stop_ids(path, config)
    tokenizer = _load_tokenizer(path, tokenizer_config, declared_stop_ids)
    return LoadedModel(
        name=path.name,
        path=path,
        file_format="hf",
        spec=spec.for_tokenizer(tokenizer.vocab_size),
        weights=weights,
        tokenizer=tokenizer,
        chat_template=_chat_template(path, tokenizer_config),
        stop_token_ids=tokenizer.stop_ids(),  # eos first, then declared and vocabulary ones
    )


def read_json(path: Path, *, required: bool = True) -> dict[str, Any] | None:
    """A JSON object from `path`; a missing required file or bad JSON -> ModelLoadError."""
    if not path.is_file():
        if required:
            raise ModelLoadError(f"{path} is missing, so {path.parent} is not a model directory")
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path} is not readable JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return value


def spec_from_config(config: dict[str, Any], *, source: Path | str = "config.json") -> ModelSpec:
    """The `ModelSpec` a Hugging Face config.json describes, or a ModelLoadError saying why not."""
    if config.get("model_type") in qwen35.MOE_MODEL_TYPES:
        raise ModelLoadError(f"{source}: {config['model_type']} {qwen35.MOE_REFUSAL}")
    if qwen35.is_hf_config(config):
        try:
            return qwen35.spec_from_hf_config(config, source)
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"{source} has a missing or invalid hyper-parameter ({exc})") from None
    arch = _arch(config, source)
    _check_supported(config, arch, source)
    num_heads = int(config["num_attention_heads"])
    d_model = int(config["hidden_size"])
    try:
        return ModelSpec(
            arch=arch,
            num_layers=int(config["num_hidden_layers"]),
            d_model=d_model,
            d_ffn=int(config["intermediate_size"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or d_model // num_heads),
            vocab_size=int(config["vocab_size"]),
            max_context=int(config.get("max_position_embeddings", 2048)),
            rope_theta=float(_rope_theta(config)),
            rms_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            has_qkv_bias=arch == "qwen2",
            has_qk_norm=arch == "qwen3",
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{source} has a missing or invalid hyper-parameter ({exc})") from None


def canonical_name(hf_name: str) -> str | None:
    """The canonical tensor name of a Hugging Face tensor name, or None if it has none."""
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    match = _LAYER_RE.fullmatch(hf_name)
    if match and match.group(2) in LAYER_NAMES:
        return f"layers.{match.group(1)}.{LAYER_NAMES[match.group(2)]}"
    return None


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of every tensor the spec needs."""
    if spec.arch == "qwen35":
        return qwen35.expected_shapes(spec)
    shapes: dict[str, tuple[int, ...]] = {
        "embed": (spec.vocab_size, spec.d_model),
        "final_norm": (spec.d_model,),
    }
    if not spec.tie_embeddings:
        shapes["lm_head"] = (spec.vocab_size, spec.d_model)
    per_layer = {
        "attn_norm": (spec.d_model,),
        "wq": (spec.q_dim, spec.d_model),
        "wk": (spec.kv_dim, spec.d_model),
        "wv": (spec.kv_dim, spec.d_model),
        "wo": (spec.d_model, spec.q_dim),
        "ffn_norm": (spec.d_model,),
        "w_gate": (spec.d_ffn, spec.d_model),
        "w_up": (spec.d_ffn, spec.d_model),
        "w_down": (spec.d_model, spec.d_ffn),
    }
    if spec.has_qkv_bias:
        per_layer |= {"bq": (spec.q_dim,), "bk": (spec.kv_dim,), "bv": (spec.kv_dim,)}
    if spec.has_qk_norm:
        per_layer |= {"q_norm": (spec.head_dim,), "k_norm": (spec.head_dim,)}
    for i in range(spec.num_layers):
        shapes |= {f"layers.{i}.{name}": shape for name, shape in per_layer.items()}
    return shapes


def read_weights(path: Path, spec: ModelSpec, *, progress: bool = False) -> ModelWeights:
    """Every tensor of the checkpoint under canonical names, checked against the spec."""
    tensors: dict[str, StoredTensor] = {}
    shards = shard_files(path)
    if progress:
        from tqdm import tqdm

        shards = tqdm(shards, desc="loading safetensors", unit="shard")
    for shard in shards:
        for hf_name, tensor in read_safetensors(shard).items():
            if spec.arch == "qwen35":
                converted = qwen35.convert_hf_tensor(hf_name, tensor, spec, shard)
                if converted is not None:
                    tensors[converted[0]] = converted[1]
                continue
            name = canonical_name(hf_name)
            if name is None:
                if hf_name.endswith(_IGNORED_SUFFIXES):
                    continue
                raise ModelLoadError(
                    f"{shard} holds tensor {hf_name}, which ninfer's {spec.arch} forward does not use"
                )
            tensors[name] = tensor
    if spec.tie_embeddings:
        tensors.pop("lm_head", None)  # some tied checkpoints store the head copy anyway
    _check_shapes(path, tensors, expected_shapes(spec))
    return ModelWeights(tensors, spec.num_layers)


def shard_files(path: Path) -> list[Path]:
    """The safetensors files of a directory: the index's shards, else every *.safetensors."""
    index = read_json(path / "model.safetensors.index.json", required=False)
    if index is not None:
        names = sorted(set(index.get("weight_map", {}).values()))
        missing = [name for name in names if not (path / name).is_file()]
        if missing:
            raise ModelLoadError(
                f"{path} is missing shard {missing[0]} listed in model.safetensors.index.json"
            )
        files = [path / name for name in names]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weight files")
    return files


def read_safetensors(path: Path) -> dict[str, StoredTensor]:
    """HF name -> StoredTensor for one safetensors file (BF16 memory-mapped as uint16 bits)."""
    from safetensors import SafetensorError, safe_open

    header, data_start = _read_header(path)
    try:
        with safe_open(path, framework="np") as handle:
            return {name: _stored(handle, path, name, header[name], data_start) for name in handle.keys()}
    except (SafetensorError, OSError, KeyError, ValueError) as exc:
        raise ModelLoadError(f"{path} is not a readable safetensors file ({exc})") from None


def _stored(handle, path: Path, name: str, info: dict[str, Any], data_start: int) -> StoredTensor:
    shape = tuple(int(n) for n in info["shape"])
    dtype = info["dtype"]
    if dtype == "BF16":
        begin, end = info["data_offsets"]
        count = (end - begin) // 2
        bits = np.memmap(path, dtype=np.uint16, mode="r", offset=data_start + begin, shape=count)
        return StoredTensor("BF16", shape, bits.reshape(shape))
    if dtype in _FLOAT_DTYPES:
        return StoredTensor(dtype, shape, handle.get_tensor(name).astype(_FLOAT_DTYPES[dtype], copy=False))
    raise ModelLoadError(f"{path} stores tensor {name} as {dtype}, which ninfer does not support")


def _read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The safetensors header (8-byte little-endian length, then JSON) and where data starts."""
    try:
        with open(path, "rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(length))
    except (OSError, struct.error, ValueError) as exc:
        raise ModelLoadError(f"{path} is not a readable safetensors file ({exc})") from None
    header.pop("__metadata__", None)
    return header, 8 + length


def _check_shapes(path: Path, tensors: dict[str, StoredTensor], expected: dict[str, tuple[int, ...]]) -> None:
    for name, shape in expected.items():
        if name not in tensors:
            raise ModelLoadError(f"{path} lacks the weights of {name}")
        if tensors[name].shape != shape:
            raise ModelLoadError(
                f"{path}: tensor {name} has shape {tensors[name].shape}, config.json implies {shape}"
            )
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise ModelLoadError(f"{path} holds tensor {extra[0]}, which config.json does not account for")


def _arch(config: dict[str, Any], source: Path | str) -> str:
    for class_name in config.get("architectures") or ():
        if class_name in ARCH_BY_CLASS:
            return ARCH_BY_CLASS[class_name]
    model_type = config.get("model_type")
    if model_type in ARCH_BY_CLASS.values():
        return model_type
    kinds = config.get("architectures") or model_type
    raise ModelLoadError(f"{source} describes a {kinds} model; ninfer runs llama, qwen2 and qwen3")


def _check_supported(config: dict[str, Any], arch: str, source: Path | str) -> None:
    """Reject the variations of these architectures that ninfer's forward does not compute."""
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else rope
    if kind not in (None, "default", "none"):
        raise ModelLoadError(f"{source} asks for rope scaling {kind!r}; ninfer supports only plain RoPE")
    if config.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{source} uses activation {config['hidden_act']!r}; ninfer supports only silu")
    if config.get("mlp_bias") or (arch != "qwen2" and config.get("attention_bias")):
        raise ModelLoadError(f"{source} has MLP or output-projection biases, which ninfer does not support")
    layer_types = set(config.get("layer_types") or ("full_attention",))
    if config.get("use_sliding_window") or layer_types != {"full_attention"}:
        raise ModelLoadError(f"{source} uses sliding-window attention, which ninfer does not support")


def _rope_theta(config: dict[str, Any]) -> float:
    # transformers 5 moved rope_theta into rope_parameters; older configs keep it at top level.
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        return params["rope_theta"]
    return config.get("rope_theta", 10000.0)


def _load_tokenizer(path: Path, tokenizer_config: dict[str, Any], stop_ids: tuple[int, ...]):
    tokenizer_json = path / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise ModelLoadError(f"{tokenizer_json} is missing; ninfer needs a fast-tokenizer tokenizer.json")
    from ninfer.models.tokenizer import Tokenizer

    try:
        return Tokenizer.from_file(tokenizer_json, tokenizer_config, extra_stop_ids=stop_ids)
    except ModelLoadError:
        raise
    except Exception as exc:  # the tokenizers library raises bare Exceptions on bad files
        raise ModelLoadError(f"{tokenizer_json} could not be loaded ({exc})") from None


def _chat_template(path: Path, tokenizer_config: dict[str, Any]):
    from ninfer.models.chat_template import ChatTemplate

    source = tokenizer_config.get("chat_template")
    if isinstance(source, list):  # named templates: [{"name": "default", "template": "..."}]
        named = {item.get("name"): item.get("template") for item in source if isinstance(item, dict)}
        source = named.get("default") or next(iter(named.values()), None)
    jinja_file = path / "chat_template.jinja"  # where transformers 5 saves it
    if not source and jinja_file.is_file():
        source = jinja_file.read_text(encoding="utf-8")
    if not source:
        return None
    return ChatTemplate(
        source,
        bos_token=_token_text(tokenizer_config.get("bos_token")),
        eos_token=_token_text(tokenizer_config.get("eos_token")),
    )


def _declared_stop_ids(path: Path, config: dict[str, Any]) -> tuple[int, ...]:
    """End-of-generation ids of generation_config.json and config.json (int or list each)."""
    generation = read_json(path / "generation_config.json", required=False) or {}
    ids: list[int] = []
    text = config.get("text_config") or {}  # multimodal configs keep the text model's ids there
    for value in (generation.get("eos_token_id"), config.get("eos_token_id"), text.get("eos_token_id")):
        ids.extend([value] if isinstance(value, int) else value or [])
    return tuple(dict.fromkeys(int(i) for i in ids))


def _token_text(value: Any) -> str | None:
    # tokenizer_config stores special tokens as a string or as a serialized AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value
