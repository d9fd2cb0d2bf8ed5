"""Loading GGUF files: the real SmolLM2 file, synthetic tiny files, and broken files."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from ninfer.models.errors import ModelLoadError
from ninfer.models.gguf_file import load_gguf
from tiny_models import BYTE_TOKENS, tiny_gguf_tensors, write_tiny_gguf

# --- the real file --------------------------------------------------------------------------


def test_real_file_spec(smollm2):
    spec = smollm2.spec
    assert (spec.arch, spec.num_layers, spec.d_model, spec.d_ffn) == ("llama", 30, 576, 1536)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (9, 3, 64)
    assert (spec.rope_theta, spec.rms_eps, spec.vocab_size, spec.max_context) == (100000.0, 1e-5, 49152, 8192)
    assert spec.tie_embeddings and not spec.has_qkv_bias and not spec.has_qk_norm


def test_real_file_weights_stay_stored_and_mapped(smollm2):
    weights = smollm2.weights
    assert len(weights) == 2 + 30 * 9 and "lm_head" not in weights
    embed = weights["embed"]
    assert (embed.qtype, embed.shape) == ("Q8_0", (49152, 576))
    assert (embed.data.shape, embed.data.dtype) == ((49152, 612), np.uint8)  # 18 blocks of 34 bytes a row
    assert weights.head() is embed
    # Memory-mapped, not read into memory or dequantized (only Q/K rows are reordered copies).
    assert isinstance(embed.data.base, np.memmap) or isinstance(embed.data, np.memmap)
    assert not weights["layers.0.w_down"].data.flags.owndata
    assert weights["layers.0.wq"].qtype == "Q4_1" and weights["layers.0.wq"].shape == (576, 576)
    assert weights["layers.0.wk"].shape == (192, 576) and weights["layers.0.w_down"].shape == (576, 1536)
    assert weights.layer(0, "bq") is None and weights["final_norm"].qtype == "F32"


def test_real_file_tokenizer_template_and_stops(smollm2):
    assert (smollm2.name, smollm2.file_format) == ("SmolLM2-135M-Instruct", "gguf")
    assert smollm2.stop_token_ids == (2, 0)  # <|im_end|> (eos), <|endoftext|>
    assert smollm2.tokenizer.vocab_size == smollm2.spec.vocab_size
    assert smollm2.chat_template.render([{"role": "user", "content": "hi"}]).endswith("<|im_start|>assistant\n")


def test_rope_unpermutation_matches_transformers(smollm2, smollm2_path):
    """Canonical wq / wk equal transformers' un-permuted q_proj / k_proj (one layer, to stay cheap).

    transformers loads llama GGUF files through `LlamaTensorProcessor`; it is applied here to the
    same layer's stored tensors, read with transformers' own GGUF reader.
    """
    from transformers.integrations.gguf.reader import GgufHeader, load_gguf_state_dict, read_gguf_metadata
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    layer = 7
    meta, _ = read_gguf_metadata(str(smollm2_path))
    heads = {"num_attention_heads": meta["llama.attention.head_count"]}
    processor = LlamaTensorProcessor(config=heads | {"num_key_value_heads": meta["llama.attention.head_count_kv"]})
    lazy = load_gguf_state_dict(GgufHeader.from_file(str(smollm2_path)))
    for gguf_role, role in (("attn_q", "wq"), ("attn_k", "wk")):
        name = f"blk.{layer}.{gguf_role}.weight"
        raw = lazy[name]
        stored = gguf.dequantize(np.asarray(raw.data).reshape(raw.shape), gguf.GGMLQuantizationType(raw.ggml_type))
        theirs = processor.process(stored, name).weights
        ours = smollm2.weights[f"layers.{layer}.{role}"].dequantize()
        np.testing.assert_array_equal(ours, theirs)
        assert not np.array_equal(ours, stored)  # the file's row order really differs


# --- synthetic tiny files -------------------------------------------------------------------

def _interleave_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to llama Q/K: pair each row of a head's first half with its second."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_synthetic_llama_qk_rows_are_restored(tmp_path):
    canonical = tiny_gguf_tensors("llama", np.random.default_rng(0))
    stored = dict(canonical)
    for i in range(2):
        stored[f"blk.{i}.attn_q.weight"] = _interleave_rows(canonical[f"blk.{i}.attn_q.weight"], 4)
        stored[f"blk.{i}.attn_k.weight"] = _interleave_rows(canonical[f"blk.{i}.attn_k.weight"], 2)
    model = load_gguf(write_tiny_gguf(tmp_path / "tiny.gguf", tensors=stored))
    assert model.spec.tie_embeddings and model.spec.rope_theta == 1e6 and model.spec.rms_eps == 1e-6
    for i in range(2):
        for ours, theirs in (("wq", "attn_q"), ("wk", "attn_k"), ("wv", "attn_v")):
            loaded = model.weights[f"layers.{i}.{ours}"].dequantize()
            np.testing.assert_array_equal(loaded, canonical[f"blk.{i}.{theirs}.weight"])


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_synthetic_qwen_files_load_unpermuted_with_their_extras(tmp_path, arch):
    head_dim = 8 if arch == "qwen3" else 4  # qwen3 heads need not be d_model / num_heads wide
    rng = np.random.default_rng(1)
    tensors = tiny_gguf_tensors(arch, rng, head_dim=head_dim)
    tensors["output.weight"] = rng.standard_normal((len(BYTE_TOKENS), 16)).astype(np.float32)
    model = load_gguf(write_tiny_gguf(tmp_path / "tiny.gguf", arch, tensors=tensors, head_dim=head_dim))
    spec = model.spec
    assert (spec.arch, spec.head_dim, spec.tie_embeddings) == (arch, head_dim, False)
    assert (spec.has_qkv_bias, spec.has_qk_norm) == (arch == "qwen2", arch == "qwen3")
    np.testing.assert_array_equal(model.weights["layers.1.wq"].dequantize(), tensors["blk.1.attn_q.weight"])
    np.testing.assert_array_equal(model.weights["lm_head"].dequantize(), tensors["output.weight"])
    extra = "bq" if arch == "qwen2" else "q_norm"
    assert model.weights.layer(0, extra) is not None


def _message(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text and "Traceback" not in text
    return text


@pytest.mark.parametrize(
    ("arch", "change", "expected"),
    [
        ("gemma", {}, "architecture 'gemma' is not supported"),
        ("llama", {"metadata": {"rope.scaling.type": ("yarn", gguf.GGUFValueType.STRING)}}, "RoPE scaling 'yarn'"),
        ("llama", {"tensor": ("blk.0.ffn_up.weight", np.zeros((24, 16), np.float64))}, "ffn_up.weight is stored as F64"),
        ("llama", {"tensor": ("blk.0.mystery.weight", np.zeros(16, np.float32))}, "mystery.weight is not part"),
        ("llama", {"drop": "blk.1.ffn_down.weight"}, "missing, starting with layers.1.w_down"),
        ("llama", {"tensor": ("blk.0.ffn_up.weight", np.zeros((20, 16), np.float32))}, "has shape (20, 16)"),
        ("llama", {"tokenizer_model": "llama"}, "not supported yet"),
    ],
)
def test_unsupported_files_are_refused_in_one_sentence(tmp_path, arch, change, expected):
    tensors = tiny_gguf_tensors(arch, np.random.default_rng(2))
    if "tensor" in change:
        name, array = change["tensor"]
        tensors[name] = array
    tensors.pop(change.get("drop", ""), None)
    path = write_tiny_gguf(
        tmp_path / "bad.gguf", arch, tensors=tensors, metadata=change.get("metadata", {}),
        tokenizer_model=change.get("tokenizer_model", "gpt2"),
    )  # fmt: skip
    with pytest.raises(ModelLoadError) as excinfo:
        load_gguf(path)
    assert expected in _message(excinfo)


# --- broken files ---------------------------------------------------------------------------


@pytest.mark.parametrize("keep_bytes", [6, 1000, -100])  # header, metadata, tensor data
def test_truncated_copies_of_the_real_file_are_refused(smollm2_path, tmp_path, keep_bytes):
    size = smollm2_path.stat().st_size
    keep = keep_bytes if keep_bytes > 0 else size + keep_bytes
    path = tmp_path / "cut.gguf"
    with smollm2_path.open("rb") as src:
        path.write_bytes(src.read(keep))
    with pytest.raises(ModelLoadError) as excinfo:
        load_gguf(path)
    assert str(path) in _message(excinfo)


def test_garbage_empty_and_missing_files_are_refused(tmp_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(np.random.default_rng(3).bytes(4096))
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelLoadError) as excinfo:
        load_gguf(garbage)
    assert "GGUF magic" in _message(excinfo)
    with pytest.raises(ModelLoadError) as excinfo:
        load_gguf(empty)
    _message(excinfo)
    with pytest.raises(ModelLoadError) as excinfo:
        load_gguf(tmp_path / "absent.gguf")
    assert "not found" in _message(excinfo)


def test_embedding_rows_past_the_token_list_are_padding(tmp_path):
    """The vocabulary is the embedding's rows; ids past the token list are padding (never sampled)."""
    rng = np.random.default_rng(4)
    tensors = tiny_gguf_tensors("qwen2", rng)
    tensors["token_embd.weight"] = rng.standard_normal((len(BYTE_TOKENS) + 8, 16)).astype(np.float32)
    model = load_gguf(write_tiny_gguf(tmp_path / "padded.gguf", "qwen2", tensors=tensors))
    assert model.spec.vocab_size == len(BYTE_TOKENS) + 8
    assert model.spec.tokenizer_vocab_size == model.tokenizer.vocab_size == len(BYTE_TOKENS)
