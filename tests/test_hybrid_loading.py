"""Loading Qwen3.5 hybrids: HF text and multimodal checkpoints, GGUF `qwen35` files, and the
MoE relatives that are refused."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest

from ninfer.models.errors import ModelLoadError
from ninfer.models.loader import load_model

torch = pytest.importorskip("torch")
from hybrid_models import gguf_tensors, hybrid, write_hybrid_gguf  # noqa: E402, F401 (hybrid: a fixture)


def test_multimodal_checkpoint_loads_its_text_model_and_skips_the_vision_tower(hybrid, tmp_path, caplog):
    from safetensors.numpy import load_file, save_file

    path = tmp_path / "qwen35-vl"
    shutil.copytree(hybrid.hf_dir, path)
    text = json.loads((path / "config.json").read_text())
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "text_config": text | {"model_type": "qwen3_5_text"}, "vision_config": {"depth": 1}}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    tensors = load_file(path / "model.safetensors")
    renamed = {name.replace("model.", "model.language_model.", 1): t for name, t in tensors.items()}
    renamed["model.visual.blocks.0.attn.qkv.weight"] = np.zeros((6, 2), np.float32)
    save_file(renamed, path / "model.safetensors")
    with caplog.at_level(logging.WARNING):
        loaded = load_model(path)
    assert "vision tower" in caplog.text
    text_only = load_model(hybrid.hf_dir)
    assert loaded.spec == text_only.spec
    for name in text_only.weights:
        np.testing.assert_array_equal(loaded.weights[name].dequantize(), text_only.weights[name].dequantize())


def test_hf_norms_gain_one_and_value_heads_move_to_tiled_order(hybrid):
    loaded = load_model(hybrid.hf_dir)
    state = {k: v.detach().numpy() for k, v in hybrid.model.state_dict().items()}
    np.testing.assert_allclose(loaded.weights["final_norm"].dequantize(), state["model.norm.weight"] + 1)
    a_log = state["model.layers.0.linear_attn.A_log"]  # 4 value heads over 2 key heads: grouped (0 1)(2 3)
    np.testing.assert_allclose(loaded.weights["layers.0.gdn_a"].dequantize(), -np.exp(a_log[[0, 2, 1, 3]]), rtol=1e-6)
    np.testing.assert_array_equal(loaded.weights["layers.0.gdn_norm"].dequantize(),
                                  state["model.layers.0.linear_attn.norm.weight"])  # fmt: skip


def test_moe_hybrids_are_refused_naming_the_moe_issue(hybrid, tmp_path):
    path = tmp_path / "next"
    shutil.copytree(hybrid.hf_dir, path)
    config = json.loads((path / "config.json").read_text()) | {"model_type": "qwen3_next"}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="mixture-of-experts.*MoE"):
        load_model(path)
    gguf_path = write_hybrid_gguf(tmp_path / "next.gguf", hybrid.model, arch="qwen3next")
    with pytest.raises(ModelLoadError, match="qwen3next.*mixture-of-experts"):
        load_model(gguf_path)


def test_quantized_hybrid_gguf_loads_in_stored_form(hybrid, tmp_path):
    import gguf

    path = write_hybrid_gguf(tmp_path / "q8.gguf", hybrid.model, qtype=gguf.GGMLQuantizationType.Q8_0)
    model = load_model(path)
    assert model.weights["layers.0.gdn_qkv"].qtype == "Q8_0"
    want = gguf_tensors(hybrid.model)["blk.0.attn_qkv.weight"]
    np.testing.assert_allclose(model.weights["layers.0.gdn_qkv"].dequantize(), want, atol=np.abs(want).max() / 100)


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda t: t.pop("blk.1.ssm_a"), "missing, starting with layers.1.gdn_a"),
        (lambda t: t.update({"blk.3.ssm_a": t["blk.0.ssm_a"]}), "ssm_a does not belong in a full-attention layer"),
        (lambda t: t.update({"blk.0.ssm_conv1d.weight": np.zeros((64, 3), np.float32)}), "has shape (64, 3)"),
    ],
)
def test_broken_hybrid_gguf_files_are_refused_in_one_sentence(hybrid, tmp_path, monkeypatch, edit, expected):
    import hybrid_models

    tensors = gguf_tensors(hybrid.model)
    edit(tensors)
    monkeypatch.setattr(hybrid_models, "gguf_tensors", lambda model: tensors)
    path = write_hybrid_gguf(tmp_path / "bad.gguf", hybrid.model)
    with pytest.raises(ModelLoadError) as excinfo:
        load_model(path)
    assert expected in str(excinfo.value) and "\n" not in str(excinfo.value)


def test_multi_token_prediction_blocks_after_the_decoder_are_skipped(hybrid, tmp_path, monkeypatch):
    import gguf

    import hybrid_models

    tensors = gguf_tensors(hybrid.model)
    tensors |= {name.replace("blk.3.", "blk.4."): a for name, a in tensors.items() if name.startswith("blk.3.")}
    tensors["blk.4.nextn.eh_proj.weight"] = np.zeros((64, 128), np.float32)
    monkeypatch.setattr(hybrid_models, "gguf_tensors", lambda model: tensors)
    real_writer = gguf.GGUFWriter

    class WithMtp(real_writer):  # one more block, declared as a prediction block
        def add_uint32(self, key, value):
            super().add_uint32(key, value + 1 if key.endswith(".block_count") else value)
            if key.endswith(".block_count"):
                super().add_uint32(key.replace("block_count", "nextn_predict_layers"), 1)

    monkeypatch.setattr(gguf, "GGUFWriter", WithMtp)
    model = load_model(write_hybrid_gguf(tmp_path / "mtp.gguf", hybrid.model))
    plain = load_model(hybrid.gguf_path)
    assert model.spec == plain.spec and set(model.weights) == set(plain.weights)
