"""`load_gguf(path)`: a llama.cpp GGUF file as a `LoadedModel`.

The file is memory-mapped by `gguf.GGUFReader`; tensors stay in their stored (often quantized)
form and are never dequantized here. Only llama-arch Q/K matrices are copied, to undo the row
permutation llama.cpp's converter applies for its interleaved RoPE (left in place, the split-half
rotation would pair the wrong dimensions): canonical weights use the split-half rotation.

`qwen35` (Qwen3.5 hybrids) files load with llama.cpp's tensor names and conventions, which are
the canonical ones (qwen35.py); `qwen3next` / `qwen35moe` (MoE hybrids) are refused.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from ninfer.models import qwen35
from ninfer.models.chat_template import ChatTemplate, ChatTemplateError
from ninfer.models.errors import ModelLoadError
from ninfer.models.loaded import LoadedModel
from ninfer.models.spec import SUPPORTED_ARCHS, ModelSpec
from ninfer.models.tokenizer import Tokenizer
from ninfer.models.weights import STORED_TYPES, ModelWeights, StoredTensor

_GLOBAL_TENSORS = {
    "token_embd.weight": "embed", "output_norm.weight": "final_norm", "output.weight": "lm_head",
}  # fmt: skip
_LAYER_TENSORS = {
    "attn_norm.weight": "attn_norm",
    "attn_q.weight": "wq", "attn_k.weight": "wk", "attn_v.weight": "wv",
    "attn_q.bias": "bq", "attn_k.bias": "bk", "attn_v.bias": "bv",
    "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm",
    "attn_output.weight": "wo",
    "ffn_norm.weight": "ffn_norm",
    "ffn_gate.weight": "w_gate", "ffn_up.weight": "w_up", "ffn_down.weight": "w_down",
}  # fmt: skip
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")
_REQUIRED_LAYER = ("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down")


def load_gguf(path: str | Path, *, progress: bool = False) -> LoadedModel:
    """Load a GGUF model file (llama, qwen2 or qwen3 architecture).

    Every problem (missing or truncated file, unsupported architecture, tensor type, RoPE
    scaling or tokenizer) raises `ModelLoadError` with a one-sentence message.
    """
    path = Path(path).expanduser()
    reader = _open(path)
    meta = _Metadata(reader, path)
    spec = _read_spec(meta, reader)
    tokenizer = _read_tokenizer(meta)
    # qwen35 files may append multi-token-prediction blocks (counted in block_count): skipped
    num_mtp_blocks = int(meta.arch_key("nextn_predict_layers", 0)) if meta.arch == "qwen35" else 0
    weights = _read_weights(reader, spec, path, progress=progress, num_skipped_blocks=num_mtp_blocks)
    return LoadedModel(
        name=_model_name(meta, path),
        path=path,
        file_format="gguf",
        spec=spec.for_tokenizer(tokenizer.vocab_size),
        weights=weights,
        tokenizer=tokenizer,
        chat_template=_read_chat_template(meta, tokenizer),
        stop_token_ids=tokenizer.stop_ids(),
    )


def read_gguf_header(path: str | Path) -> tuple[ModelSpec, Tokenizer, ChatTemplate | None]:
    """A GGUF file's spec, tokenizer and chat template from its metadata alone (no tensor data
    is read): what a router needs to render prompts as the engine will."""
    path = Path(path).expanduser()
    reader = _open(path)
    meta = _Metadata(reader, path)
    tokenizer = _read_tokenizer(meta)
    spec = _read_spec(meta, reader).for_tokenizer(tokenizer.vocab_size)
    return spec, tokenizer, _read_chat_template(meta, tokenizer)


def _open(path: Path):
    from gguf import GGUFReader

    if not path.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    try:
        reader = GGUFReader(path)
    except Exception as exc:  # the reader signals bad files with assorted ValueError / IndexError
        reason = "it does not start with the GGUF magic" if "magic" in str(exc) else f"{exc}"
        raise ModelLoadError(f"{path} is not a readable GGUF file ({reason}).") from None
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > path.stat().st_size:
        raise ModelLoadError(f"{path} is truncated: its tensors need {end} bytes, the file has fewer.")
    return reader


class _Metadata:
    """Typed access to the GGUF key-value section, with one-sentence errors for missing keys."""

    def __init__(self, reader, path: Path):
        self._fields = reader.fields
        self.path = path
        self.arch = self.get("general.architecture")
        if self.arch is None:
            raise ModelLoadError(f"{path} has no general.architecture metadata.")

    def get(self, key: str, default=None):
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"{self.path} is missing the metadata key {key}.")
        return value

    def arch_key(self, suffix: str, default=None, *, required: bool = False):
        key = f"{self.arch}.{suffix}"
        return self.require(key) if required else self.get(key, default)


def _as_float32_decimal(value: float) -> float:
    """The shortest decimal that round-trips the stored float32 (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _read_spec(meta: _Metadata, reader) -> ModelSpec:
    if meta.arch in qwen35.MOE_GGUF_ARCHS:
        raise ModelLoadError(f"{meta.path.name}: architecture {meta.arch!r} {qwen35.MOE_REFUSAL}.")
    if meta.arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(
            f"{meta.path.name}: architecture {meta.arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHS)})."
        )
    scaling = meta.arch_key("rope.scaling.type")
    if scaling not in (None, "none"):
        raise ModelLoadError(f"{meta.path.name}: RoPE scaling {scaling!r} is not supported yet.")
    num_heads = int(meta.arch_key("attention.head_count", required=True))
    num_kv_heads = meta.arch_key("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list) and meta.arch == "qwen35":
        # hybrid files may list 0 KV heads for the linear-attention layers
        num_kv_heads = max(num_kv_heads) if len(set(num_kv_heads) - {0}) == 1 else num_kv_heads
    if isinstance(num_kv_heads, list):
        raise ModelLoadError(f"{meta.path.name}: a per-layer KV head count is not supported.")
    d_model = int(meta.arch_key("embedding_length", required=True))
    head_dim = int(meta.arch_key("attention.key_length", d_model // num_heads))
    if int(meta.arch_key("attention.value_length", head_dim)) != head_dim:
        raise ModelLoadError(f"{meta.path.name}: key and value head sizes differ, which is not supported.")
    if int(meta.arch_key("rope.dimension_count", head_dim)) != head_dim and meta.arch != "qwen35":
        raise ModelLoadError(f"{meta.path.name}: partial rotary embeddings are not supported.")
    names = {t.name for t in reader.tensors}
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    # the embedding's rows: a vocabulary padded past the tokenizer's (its ids are never sampled)
    vocab = int(embed.shape[-1]) if embed is not None and len(embed.shape) == 2 else None
    vocab = vocab or meta.arch_key("vocab_size") or len(meta.require("tokenizer.ggml.tokens"))
    common = dict(
        arch=meta.arch,
        num_layers=int(meta.arch_key("block_count", required=True)),
        d_model=d_model,
        d_ffn=int(meta.arch_key("feed_forward_length", required=True)),
        num_heads=num_heads,
        num_kv_heads=int(num_kv_heads),
        head_dim=head_dim,
        vocab_size=int(vocab),
        max_context=int(meta.arch_key("context_length", required=True)),
        rope_theta=_as_float32_decimal(meta.arch_key("rope.freq_base", 10000.0)),
        rms_eps=_as_float32_decimal(meta.arch_key("attention.layer_norm_rms_epsilon", required=True)),
        tie_embeddings="output.weight" not in names,
    )
    try:
        if meta.arch == "qwen35":
            return qwen35.spec_from_gguf(meta, common)
        return ModelSpec(
            **common,
            has_qkv_bias="blk.0.attn_q.bias" in names,
            has_qk_norm="blk.0.attn_q_norm.weight" in names,
        )
    except ValueError as exc:
        raise ModelLoadError(f"{meta.path.name}: inconsistent hyper-parameters ({exc}).") from None


def _read_tokenizer(meta: _Metadata) -> Tokenizer:
    tokens = meta.require("tokenizer.ggml.tokens")
    extra = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
    return Tokenizer.from_gguf_metadata(
        tokens,
        meta.get("tokenizer.ggml.token_type") or [1] * len(tokens),
        meta.get("tokenizer.ggml.merges") or [],
        model=meta.require("tokenizer.ggml.model"),
        pre=meta.get("tokenizer.ggml.pre"),
        bos_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_id=meta.get("tokenizer.ggml.eos_token_id"),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        extra_stop_ids=[i for i in extra if i is not None],
    )


def _read_chat_template(meta: _Metadata, tokenizer: Tokenizer) -> ChatTemplate | None:
    source = meta.get("tokenizer.chat_template")
    if source is None:
        return None
    token = lambda i: None if i is None else tokenizer.id_to_token(i)  # noqa: E731
    try:
        return ChatTemplate(source, bos_token=token(tokenizer.bos_id), eos_token=token(tokenizer.eos_id))
    except ChatTemplateError as exc:
        raise ModelLoadError(f"{meta.path.name}: {exc}") from None


def _model_name(meta: _Metadata, path: Path) -> str:
    """The registry's public id for a known file, else general.name, else the file stem."""
    from ninfer.models.registry import public_id_for_file

    return public_id_for_file(path) or meta.get("general.name") or path.stem


def _canonical_name(gguf_name: str, arch: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    layer_names = qwen35.GGUF_LAYER_NAMES if arch == "qwen35" else _LAYER_TENSORS
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match and match.group(2) in layer_names:
        return f"layers.{match.group(1)}.{layer_names[match.group(2)]}"
    return None


def _stored_tensor(t, path: Path) -> StoredTensor:
    qtype = t.tensor_type.name
    if qtype not in STORED_TYPES:
        raise ModelLoadError(
            f"{path.name}: tensor {t.name} is stored as {qtype}, which ninfer does not support."
        )
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
    data = t.data
    if qtype == "BF16":  # the reader exposes bf16 as raw bytes
        data = data.view(np.uint16).reshape(shape)
    return StoredTensor(qtype, shape, data)


def _rope_unpermute_order(num_rows: int, num_heads: int) -> np.ndarray:
    """Row order turning llama.cpp's interleaved Q/K layout back into split-half.

    The converter maps canonical row (h, j, i) -- head h, half j, pair index i -- to stored row
    (h, i, j); reading the stored rows in (h, j, i) order restores the canonical matrix.
    """
    head_dim = num_rows // num_heads
    stored = np.arange(num_rows).reshape(num_heads, head_dim // 2, 2)
    return stored.swapaxes(1, 2).reshape(-1)


def _expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    d, q, kv, f = spec.d_model, spec.q_dim, spec.kv_dim, spec.d_ffn
    return {
        "embed": (spec.vocab_size, d), "lm_head": (spec.vocab_size, d), "final_norm": (d,),
        "attn_norm": (d,), "ffn_norm": (d,), "wq": (q, d), "wk": (kv, d), "wv": (kv, d),
        "bq": (q,), "bk": (kv,), "bv": (kv,), "q_norm": (spec.head_dim,), "k_norm": (spec.head_dim,),
        "wo": (d, q), "w_gate": (f, d), "w_up": (f, d), "w_down": (d, f),
    }  # fmt: skip


def _read_weights(reader, spec: ModelSpec, path: Path, *, progress: bool, num_skipped_blocks: int = 0) -> ModelWeights:
    from tqdm import tqdm

    if "rope_freqs.weight" in {t.name for t in reader.tensors}:
        raise ModelLoadError(f"{path.name}: per-frequency RoPE scaling (rope_freqs) is not supported yet.")
    hybrid_shapes = qwen35.expected_shapes(spec) if spec.arch == "qwen35" else None
    expected = _expected_shapes(spec)
    tensors: dict[str, StoredTensor] = {}
    for t in tqdm(reader.tensors, desc=f"loading {path.name}", unit="tensor", disable=not progress):
        match = _LAYER_NAME.fullmatch(t.name)
        if match and spec.num_layers <= int(match.group(1)) < spec.num_layers + num_skipped_blocks:
            continue
        name = _canonical_name(t.name, spec.arch)
        if name is None:
            raise ModelLoadError(
                f"{path.name}: tensor {t.name} is not part of a supported {spec.arch} model."
            )
        stored = _stored_tensor(t, path)
        role = name.rsplit(".", 1)[-1]
        want = expected[role] if hybrid_shapes is None else hybrid_shapes.get(name)
        if want is None and _layer_of(name) >= spec.num_layers:
            raise ModelLoadError(f"{path.name}: tensor {t.name} lies beyond the {spec.num_layers} layers declared.")
        if want is None:
            kind = spec.layer_type(_layer_of(name)).replace("_", "-")
            raise ModelLoadError(f"{path.name}: tensor {t.name} does not belong in a {kind} layer.")
        if stored.shape != want:
            raise ModelLoadError(f"{path.name}: tensor {t.name} has shape {stored.shape}, expected {want}.")
        if spec.arch == "llama" and role in ("wq", "bq", "wk", "bk"):
            heads = spec.num_heads if role in ("wq", "bq") else spec.num_kv_heads
            stored = stored.take_rows(_rope_unpermute_order(stored.shape[0], heads))
        tensors[name] = stored
    _check_complete(tensors, spec, path)
    return ModelWeights(tensors, spec.num_layers)


def _layer_of(name: str) -> int:
    return int(name.split(".")[1]) if name.startswith("layers.") else 0


def _check_complete(tensors: dict[str, StoredTensor], spec: ModelSpec, path: Path) -> None:
    extra = [n for n in tensors if n.startswith("layers.") and _layer_of(n) >= spec.num_layers]
    if extra:
        raise ModelLoadError(
            f"{path.name}: tensor {extra[0]} lies beyond the {spec.num_layers} layers declared."
        )
    if spec.arch == "qwen35":
        missing = [n for n in qwen35.expected_shapes(spec) if n not in tensors]
        if missing:
            raise ModelLoadError(f"{path.name}: {len(missing)} tensors are missing, starting with {missing[0]}.")
        return
    needed = ["embed", "final_norm"] + ([] if spec.tie_embeddings else ["lm_head"])
    per_layer = list(_REQUIRED_LAYER)
    per_layer += ["bq", "bk", "bv"] if spec.has_qkv_bias else []
    per_layer += ["q_norm", "k_norm"] if spec.has_qk_norm else []
    needed += [f"layers.{i}.{n}" for i in range(spec.num_layers) for n in per_layer]
    missing = [n for n in needed if n not in tensors]
    if missing:
        raise ModelLoadError(f"{path.name}: {len(missing)} tensors are missing, starting with {missing[0]}.")
