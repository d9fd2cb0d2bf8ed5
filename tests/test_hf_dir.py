"""Loading Hugging Face directories saved by `transformers` itself (tiny random models)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from ninfer.models.errors import ModelLoadError
from ninfer.models.hf_dir import load_hf_dir, read_json, spec_from_config
from ninfer.models.loader import load_model
from tiny_models import build_tiny_dir, write_tokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


@pytest.fixture
def llama_dir(tmp_path):
    build_tiny_dir(tmp_path, "llama")
    return tmp_path


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_loads_spec_and_every_weight_as_transformers_holds_it(tmp_path, arch):
    model = build_tiny_dir(tmp_path, arch)
    loaded = load_model(tmp_path)
    spec = loaded.spec
    assert (loaded.file_format, loaded.name, spec.arch) == ("hf", tmp_path.name, arch)
    assert (spec.num_layers, spec.d_model, spec.d_ffn, spec.num_heads, spec.num_kv_heads) == (2, 64, 128, 4, 2)
    assert (spec.vocab_size, spec.max_context, spec.rope_theta) == (300, 256, 5000.0)
    assert spec.head_dim == 16 and spec.has_qkv_bias == (arch == "qwen2") and spec.has_qk_norm == (arch == "qwen3")
    state = model.state_dict()
    layer = model.model.layers[1]
    pairs = {
        "embed": model.model.embed_tokens.weight, "lm_head": model.lm_head.weight,
        "final_norm": model.model.norm.weight, "layers.1.wq": layer.self_attn.q_proj.weight,
        "layers.1.wo": layer.self_attn.o_proj.weight, "layers.1.w_down": layer.mlp.down_proj.weight,
        "layers.1.ffn_norm": layer.post_attention_layernorm.weight,
    }  # fmt: skip
    if arch == "qwen2":
        pairs["layers.1.bk"] = layer.self_attn.k_proj.bias
    if arch == "qwen3":
        pairs["layers.1.q_norm"] = layer.self_attn.q_norm.weight
    for name, tensor in pairs.items():
        np.testing.assert_array_equal(loaded.weights[name].dequantize(), tensor.detach().numpy(), err_msg=name)
    assert len(loaded.weights) == len([k for k in state if "rotary" not in k])


def test_bf16_weights_stay_bf16_bits_and_dequantize_exactly(tmp_path):
    model = build_tiny_dir(tmp_path, "qwen3", dtype=torch.bfloat16)
    loaded = load_hf_dir(tmp_path)
    wq = loaded.weights["layers.0.wq"]
    assert wq.qtype == "BF16" and wq.data.dtype == np.uint16
    assert wq.nbytes == wq.shape[0] * wq.shape[1] * 2
    # model.float() after the bf16 cast holds exactly the bf16 values, widened.
    expected = model.model.layers[0].self_attn.q_proj.weight.detach().numpy()
    np.testing.assert_array_equal(wq.dequantize(), expected)


def test_sharded_checkpoint_loads_every_shard(tmp_path):
    model = build_tiny_dir(tmp_path / "one", "llama")
    model.save_pretrained(tmp_path / "many", max_shard_size="40KB")
    write_tokenizer(tmp_path / "many", 300)
    assert (tmp_path / "many" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "many").glob("*.safetensors"))) > 2
    one, many = load_hf_dir(tmp_path / "one"), load_hf_dir(tmp_path / "many")
    assert set(one.weights) == set(many.weights)
    for name in one.weights:
        np.testing.assert_array_equal(one.weights[name].dequantize(), many.weights[name].dequantize())


def test_tied_embeddings_have_no_separate_head(tmp_path):
    build_tiny_dir(tmp_path, "qwen2", tie_word_embeddings=True)
    loaded = load_hf_dir(tmp_path)
    assert loaded.spec.tie_embeddings and "lm_head" not in loaded.weights
    assert loaded.weights.head() is loaded.weights["embed"]


def test_tokenizer_chat_template_and_stop_ids(llama_dir):
    (llama_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    loaded = load_hf_dir(llama_dir)
    assert loaded.tokenizer.encode("t7 t42 <|im_end|>") == [7, 42, 3]
    assert {2, 3} <= set(loaded.stop_token_ids)
    assert loaded.chat_template.render([{"role": "user", "content": "hi"}]).startswith("user: hi")


def test_rope_theta_read_from_legacy_top_level_key(llama_dir):
    edit_config(llama_dir, rope_parameters=None, rope_theta=12345.0)
    assert load_hf_dir(llama_dir).spec.rope_theta == 12345.0


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope scaling 'linear'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope scaling 'yarn'"),
        ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, "ninfer runs llama, qwen2 and qwen3"),
        ({"hidden_act": "gelu"}, "activation 'gelu'"),
        ({"mlp_bias": True}, "biases"),
        ({"use_sliding_window": True}, "sliding-window"),
        ({"num_hidden_layers": 3}, "lacks the weights of layers.2"),
        ({"intermediate_size": 96}, "has shape"),
    ],
)
def test_unsupported_or_inconsistent_configs_are_clear_errors(llama_dir, changes, message):
    edit_config(llama_dir, **changes)
    with pytest.raises(ModelLoadError, match=message):
        load_hf_dir(llama_dir)


@pytest.mark.parametrize("missing", ["config.json", "tokenizer.json", "model.safetensors"])
def test_missing_files_are_one_sentence_errors(llama_dir, missing):
    (llama_dir / missing).unlink()
    with pytest.raises(ModelLoadError) as info:
        load_hf_dir(llama_dir)
    message = str(info.value)
    assert str(llama_dir) in message and "\n" not in message


def test_missing_shard_and_corrupt_files_are_errors(tmp_path):
    build_tiny_dir(tmp_path, "llama")
    shutil.copy(tmp_path / "model.safetensors", tmp_path / "broken.safetensors")
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ModelLoadError, match="not a readable safetensors file"):
        load_hf_dir(tmp_path)
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="missing shard model-00001-of-00002"):
        load_hf_dir(tmp_path)


def test_spec_from_config_defaults_head_dim_and_kv_heads():
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 96, "num_attention_heads": 6,
              "num_hidden_layers": 1, "intermediate_size": 128, "vocab_size": 10}  # fmt: skip
    spec = spec_from_config(config)
    assert (spec.head_dim, spec.num_kv_heads, spec.rope_theta, spec.max_context) == (16, 6, 10000.0, 2048)
    assert read_json(Path("/nonexistent/config.json"), required=False) is None


# --- padded vocabularies --------------------------------------------------------------------

NUM_TOKENS = 280  # the tokenizer's ids; the model's head has 300 rows


@pytest.fixture
def padded_dir(tmp_path):
    """A qwen3 whose head has 20 rows past its tokenizer, rigged so one of them wins the argmax."""
    from safetensors.numpy import load_file, save_file

    build_tiny_dir(tmp_path, "qwen3", vocab_size=300, tie_word_embeddings=False)
    write_tokenizer(tmp_path, NUM_TOKENS)
    tensors = load_file(tmp_path / "model.safetensors")
    head = tensors["lm_head.weight"]
    head[NUM_TOKENS:] = head[:20] * 40  # forty times the largest of 20 logits beats every real one
    save_file(tensors, tmp_path / "model.safetensors")
    return tmp_path


def test_padding_ids_are_never_sampled_nor_in_logprobs(padded_dir):
    from ninfer.core.params import SamplingParams
    from ninfer.core.runner import SampleSpec, StepRow
    from ninfer.gpu.reference import ReferenceRunner
    from ninfer.gpu.sampling import log_softmax

    loaded = load_hf_dir(padded_dir)
    assert (loaded.spec.vocab_size, loaded.spec.tokenizer_vocab_size, loaded.spec.num_sampled_ids) == (300, 280, 280)
    runner = ReferenceRunner(loaded, num_pages=4, page_size=16)
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, top_k=0)):
        spec = SampleSpec(params=params, seed=3, token_index=0, want_logits=True, num_top_logprobs=20,
                          score_ids=np.array([5, 290], np.int32))  # fmt: skip
        row = StepRow(seq_id=0, token_ids=np.array([4, 9, 11], np.int32), start_pos=0,
                      page_table=np.arange(4, dtype=np.int32), sample=spec)  # fmt: skip
        out = runner.step([row])[0]
        assert out.logits.shape == (300,) and int(np.argmax(out.logits)) >= NUM_TOKENS  # the rig works
        assert out.token_id < NUM_TOKENS and np.all(out.top_ids < NUM_TOKENS)
        real = log_softmax(out.logits[:NUM_TOKENS])
        assert out.logprob == pytest.approx(float(real[out.token_id]), abs=1e-6)
        assert out.score_logprobs[0] == pytest.approx(float(real[5]), abs=1e-6) and out.score_logprobs[1] == -np.inf
    # a backend that does not mask them yet (CUDA) gets no text for a padding id, not a failure
    assert loaded.tokenizer.token_bytes(290) == b"" and loaded.tokenizer.detokenizer().push(290) == ""


async def test_padded_vocabulary_generates_through_the_engine(padded_dir):
    import trio

    from ninfer.core.params import SamplingParams
    from ninfer.gpu.reference import ReferenceRunner
    from ninfer.sched.config import EngineConfig
    from ninfer.sched.engine import open_engine
    from ninfer.sched.request import FinishReason, GenerationRequest

    loaded = load_hf_dir(padded_dir)
    runner = ReferenceRunner(loaded, num_pages=16, page_size=16)
    config = EngineConfig(page_size=16, max_context=64)
    prompt = tuple(loaded.tokenizer.encode("t7 t42 t100"))
    results = []
    async with open_engine(config, runner, loaded.tokenizer, stop_token_ids=()) as engine:
        for sampling in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)):
            request = GenerationRequest(prompt_ids=prompt, max_tokens=12, sampling=sampling, seed=1,
                                        logprobs=True, top_logprobs=3)  # fmt: skip
            async with engine.submit(request) as stream:
                results.append(await stream.collect())
        await trio.sleep(0)
    for result in results:
        assert result.finished.reason is FinishReason.LENGTH, result.finished
        assert len(result.token_ids) == 12 and max(result.token_ids) < NUM_TOKENS
        assert result.text == loaded.tokenizer.decode(list(result.token_ids))
