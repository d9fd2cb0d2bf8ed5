"""Tiny random models for tests: numpy llama weights, and Hugging Face directories.

`tiny_llama` builds `(spec, weights)` for the reference runner directly; `build_tiny_dir`
saves a seeded `transformers` model (llama / qwen2 / qwen3) with a word-level tokenizer, for
the loader and the transformers oracle (it needs torch and transformers installed);
`write_tiny_gguf` writes a tiny GGUF file from `tiny_gguf_tensors` (byte-level vocabulary).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from tokenizers import pre_tokenizers

from ninfer.models.spec import ModelSpec
from ninfer.models.weights import ModelWeights, StoredTensor

# ---- numpy weights ------------------------------------------------------------------------


def tiny_llama(*, vocab_size: int = 64, max_context: int = 128, seed: int = 0):
    """A random 2-layer llama (d 32, GQA 4/2) with float32 weights."""
    spec = ModelSpec(
        arch="llama", num_layers=2, d_model=32, d_ffn=64, num_heads=4, num_kv_heads=2,
        head_dim=8, vocab_size=vocab_size, max_context=max_context, tie_embeddings=True,
    )  # fmt: skip
    rng = np.random.default_rng(seed)

    def tensor(*shape, scale=0.3):
        return StoredTensor("F32", shape, (rng.standard_normal(shape) * scale).astype(np.float32))

    def ones(n):
        return StoredTensor("F32", (n,), np.ones(n, np.float32))

    tensors = {"embed": tensor(vocab_size, 32, scale=1.0), "final_norm": ones(32)}
    for i in range(spec.num_layers):
        tensors |= {
            f"layers.{i}.attn_norm": ones(32), f"layers.{i}.ffn_norm": ones(32),
            f"layers.{i}.wq": tensor(32, 32), f"layers.{i}.wk": tensor(16, 32),
            f"layers.{i}.wv": tensor(16, 32), f"layers.{i}.wo": tensor(32, 32),
            f"layers.{i}.w_gate": tensor(64, 32), f"layers.{i}.w_up": tensor(64, 32),
            f"layers.{i}.w_down": tensor(32, 64),
        }  # fmt: skip
    return spec, ModelWeights(tensors, spec.num_layers)


# ---- Hugging Face directories -------------------------------------------------------------

TINY = dict(
    vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=5000.0,
)  # fmt: skip
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_end|>"]
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def build_tiny_dir(path: Path, arch: str, *, seed: int = 0, dtype=None, **overrides):
    """Save a seeded random `arch` model plus a word-level tokenizer into `path`.

    Norm weights and biases are perturbed away from their 1 / 0 initial values, so a loader or
    forward that drops them is caught. Returns the float32 torch model (eval mode).
    """
    import torch
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 16}),
    }
    config_cls, model_cls, extra = classes[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**(TINY | extra | overrides))).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.5)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(path)
    write_tokenizer(path, model.config.vocab_size)
    return model.float()


def write_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIALS)} | {f"t{i}": i for i in range(len(SPECIALS), vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(SPECIALS)
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": {"content": "<|im_end|>"}, "chat_template": TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


# ---- GGUF files ---------------------------------------------------------------------------

BYTE_TOKENS = sorted(pre_tokenizers.ByteLevel.alphabet())


def tiny_gguf_tensors(arch, rng, *, d=16, heads=4, kv_heads=2, head_dim=4, ffn=24, layers=2):
    """Canonical tensors of a tiny model, keyed by GGUF name."""
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    out = {"token_embd.weight": f(len(BYTE_TOKENS), d), "output_norm.weight": f(d)}
    for i in range(layers):
        b = f"blk.{i}."
        out |= {b + "attn_norm.weight": f(d), b + "ffn_norm.weight": f(d)}
        out |= {b + "attn_q.weight": f(heads * head_dim, d), b + "attn_k.weight": f(kv_heads * head_dim, d)}
        out |= {b + "attn_v.weight": f(kv_heads * head_dim, d), b + "attn_output.weight": f(d, heads * head_dim)}
        out |= {b + "ffn_gate.weight": f(ffn, d), b + "ffn_up.weight": f(ffn, d), b + "ffn_down.weight": f(d, ffn)}
        if arch == "qwen2":
            out |= {b + "attn_q.bias": f(heads * head_dim), b + "attn_k.bias": f(kv_heads * head_dim)}
            out |= {b + "attn_v.bias": f(kv_heads * head_dim)}
        if arch == "qwen3":
            out |= {b + "attn_q_norm.weight": f(head_dim), b + "attn_k_norm.weight": f(head_dim)}
    return out


def write_tiny_gguf(path, arch="llama", *, tensors=None, metadata=(), tokenizer_model="gpt2", head_dim=4):
    """A complete tiny model file; `tensors` are written as given (GGUF names)."""
    writer = gguf.GGUFWriter(path, arch)
    for key, value in {
        "block_count": 2, "context_length": 64, "embedding_length": 16, "feed_forward_length": 24,
        "attention.head_count": 4, "attention.head_count_kv": 2, "attention.key_length": head_dim,
        "attention.value_length": head_dim, "rope.dimension_count": head_dim,
    }.items():  # fmt: skip
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.rope.freq_base", 1e6)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(BYTE_TOKENS)
    writer.add_token_types([1] * len(BYTE_TOKENS))
    writer.add_eos_token_id(0)
    for key, value in dict(metadata).items():
        writer.add_key_value(f"{arch}.{key}" if not key.startswith("general.") else key, *value)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
