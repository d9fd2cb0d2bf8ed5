"""The tokenizer rebuilt from GGUF metadata, against transformers' GGUF tokenizer as an oracle."""

from __future__ import annotations

import json
import random
import unicodedata

import gguf
import numpy as np
import pytest
import tokenizers
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers

from ninfer.models.errors import ModelLoadError
from ninfer.models.tokenizer import Tokenizer

CORPUS = [
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }  // C loop',
    "日本語のテキストを分割します。中文文本处理。한국어 문장입니다.",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷 and ❤️‍🔥",
    "   leading spaces and trailing   ",
    "\n\n\n  \t \r\n  x\t\t\ty   \n",
    "Numbers: 12345, 3.14159, 1,000,000, 2024-06-01, 0xFF, 1e-5",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>",
    "Mixed: café naïve Ünïcödé — “quotes” ‘single’ … €100 x²",
    "it's I'm we'll they've he'd don't IT'S WE'LL",
    "a<|endoftext|>b<jupyter_code>c<file_sep>",
    "",
    " ",
    "x" * 64 + "    " + "ab" * 24,
    "Привет, мир! Ελληνικά. العربية. עברית.",
    "<html><body class=\"main\">&nbsp;&lt;tag&gt;</body></html>",
    "SELECT * FROM users WHERE id = 42 AND name LIKE '%bob%';",
]


@pytest.fixture(scope="module")
def tok(smollm2):
    return smollm2.tokenizer


@pytest.mark.parametrize("text", CORPUS)
def test_ids_and_decode_match_transformers(tok, hf_reference, text):
    ids = tok.encode(text)
    assert ids == hf_reference.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text == hf_reference.decode(ids)


def _numeric_chars_on_token_boundaries(tok, text: str, ids: list[int]) -> bool:
    """Whether every \\p{N} character of `text` starts and ends on a token boundary."""
    boundaries, offset = {0}, 0
    for token_id in ids:
        offset += len(tok.token_bytes(token_id))
        boundaries.add(offset)
    offset = 0
    for char in text:
        size = len(char.encode())
        if unicodedata.category(char).startswith("N") and not {offset, offset + size} <= boundaries:
            return False
        offset += size
    return True


def test_non_ascii_digits_are_split_one_per_token(tok, hf_reference):
    """SmolLM2's pre-tokenizer isolates every \\p{N} character (llama.cpp's `smollm` rule).

    transformers has no `smollm` entry and falls back to GPT-2's regex, which keeps " ٣٤٥"
    together and merges the space with the first digit's first byte; there the two differ.
    """
    text = "x ٣٤٥ and ①② then ½ 7 8"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert _numeric_chars_on_token_boundaries(tok, text, ids)
    assert not _numeric_chars_on_token_boundaries(tok, text, hf_reference.encode(text, add_special_tokens=False))


def test_special_tokens_in_text_stay_whole(tok):
    im_start, im_end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == im_start and ids[-1] == im_end
    assert {im_start, im_end} <= tok.special_ids
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_vocabulary_facts(tok):
    assert tok.vocab_size == 49152
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    assert tok.id_to_token(tok.eos_id) == "<|im_end|>"
    assert tok.token_to_id(tok.id_to_token(1234)) == 1234
    assert len(tok.special_ids) == 17  # the file's CONTROL tokens
    assert not tok.add_bos and tok.encode("hi", add_special_tokens=True) == tok.encode("hi")


def test_stop_ids_cover_every_end_token(tok):
    stops = tok.stop_ids()
    assert stops[0] == tok.eos_id
    assert tok.token_to_id("<|endoftext|>") in stops
    assert tok.token_to_id("<|im_start|>") not in stops


def test_json_round_trip_and_llguidance(tok):
    again = tokenizers.Tokenizer.from_str(tok.to_json_str())
    for text in CORPUS:
        assert again.encode(text).ids == tok.encode(text)
    import llguidance

    assert llguidance.LLTokenizer(tok.to_json_str()).vocab_size == tok.vocab_size


# --- streaming detokenization -------------------------------------------------------------


def _stream(detok, ids):
    pieces = [detok.push(i) for i in ids]
    return pieces, detok.flush()


STREAM_TEXTS = ["a😀b 👨‍👩‍👧 fin", "日本語のテキスト、中文。", "mixed é ½ ❤️‍🔥 x"]


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_detokenizer_never_emits_broken_characters(tok, text):
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # multi-byte characters really span several tokens
    pieces, rest = _stream(tok.detokenizer(), ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + rest == tok.decode(ids) == text
    assert rest == ""


def test_detokenizer_emits_a_character_when_its_last_byte_arrives(tok):
    ids = tok.encode("😀")
    assert len(ids) > 1
    pieces, _ = _stream(tok.detokenizer(), ids)
    assert pieces == [""] * (len(ids) - 1) + ["😀"]


def test_detokenizer_equals_decode_on_random_ids(tok):
    rng = random.Random(1234)
    special = sorted(tok.special_ids)
    for _ in range(40):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        ids += rng.sample(special, 2)
        rng.shuffle(ids)
        for skip in (False, True):
            pieces, rest = _stream(tok.detokenizer(skip_special_tokens=skip), ids)
            assert "".join(pieces) + rest == tok.decode(ids, skip_special_tokens=skip)


def test_unfinished_character_comes_out_at_flush(tok):
    ids = tok.encode("ok😀")[:-1]  # drop the emoji's last byte
    pieces, rest = _stream(tok.detokenizer(), ids)
    assert "".join(pieces) == "ok" and rest.startswith("\ufffd")
    assert "".join(pieces) + rest == tok.decode(ids)


def test_window_detokenizer_for_sentencepiece_style_decoders():
    """A byte-fallback vocabulary (no ByteLevel decoder) streams through the window path."""
    emoji = "😀".encode()
    vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2, **{f"<0x{b:02X}>": 3 + i for i, b in enumerate(emoji)}}
    hf = tokenizers.Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    hf.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok = Tokenizer(hf, bos_id=None, eos_id=None)
    ids = [1, 3, 4, 5, 6, 2]
    pieces, rest = _stream(tok.detokenizer(), ids)
    assert pieces == ["hello", "", "", "", "😀", " world"] and rest == ""
    assert "".join(pieces) == tok.decode(ids) == "hello😀 world"
    assert b"".join(tok.token_bytes(i) for i in ids) == " hello😀 world".encode()


# --- building from other sources, and errors ----------------------------------------------


def test_from_file_with_tokenizer_config(tok, tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(tok.to_json_str())
    config = {"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}, "add_bos_token": True}
    again = Tokenizer.from_file(path, config)
    assert (again.bos_id, again.eos_id) == (1, 2) and again.add_bos
    assert again.encode("hi", add_special_tokens=True) == [1, *tok.encode("hi")]
    assert again.stop_ids() == tok.stop_ids()


def test_unknown_pre_tokenizer_and_sentencepiece_are_refused():
    with pytest.raises(ModelLoadError, match="'mystery'"):
        Tokenizer.from_gguf_metadata(["a"], [1], [], model="gpt2", pre="mystery", bos_id=None, eos_id=None)
    with pytest.raises(ModelLoadError, match="not supported yet"):
        Tokenizer.from_gguf_metadata(["a"], [1], [], model="llama", pre=None, bos_id=None, eos_id=None)


SPLIT_CORPUS = [
    "Hello WORLD, it's I'M we'LL they'Ve 1234567 and 3.14159!",
    "  spaces\n\n  \n\ttab\r\n\r\nend  ",
    "日本語 😀 ok; x'd 's",
    "<|im_start|>user\nhey<|im_end|>",
    "def f(x):\n    return x**2  # 100%\n",
]


def _train_byte_level(split: str) -> tuple[list[str], list[str]]:
    """A small BPE vocabulary learned with `split` as its pre-tokenizer."""
    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        show_progress=False,
    )
    hf.train_from_iterator(SPLIT_CORPUS * 30, trainer)
    model = json.loads(hf.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    return tokens, [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe"])
def test_split_pre_tokenizers_match_transformers(tmp_path, pre):
    """qwen2 / llama-bpe vocabularies (synthetic, written to a GGUF) tokenize as transformers does."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    split = PRETOKENIZE_REGEX if pre == "qwen2" else PRETOKENIZE_REGEX.replace(r"\p{N}|", r"\p{N}{1,3}|")
    tokens, merges = _train_byte_level(split)
    types = [3 if t.startswith("<|") else 1 for t in tokens]
    writer = gguf.GGUFWriter(tmp_path / "tok.gguf", "qwen2")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tok.gguf")

    ours = Tokenizer.from_gguf_metadata(tokens, types, merges, model="gpt2", pre=pre, bos_id=None, eos_id=2)
    plain = Tokenizer.from_gguf_metadata(tokens, types, merges, model="gpt2", pre="gpt2", bos_id=None, eos_id=2)
    for text in SPLIT_CORPUS:
        assert ours.encode(text) == reference.encode(text, add_special_tokens=False), text
        assert ours.decode(ours.encode(text)) == text
    # The split really matters here, so a wrong pattern could not pass.
    assert any(ours.encode(t) != plain.encode(t) for t in SPLIT_CORPUS)


def test_gguf_add_bos_and_declared_stop_ids():
    tokens, merges = _train_byte_level(r" ?\p{L}+|\p{N}|\s+|[^\s\p{L}\p{N}]+")
    types = [3 if t.startswith("<|") else 1 for t in tokens]
    build = lambda **kw: Tokenizer.from_gguf_metadata(  # noqa: E731
        tokens, types, merges, model="gpt2", pre="llama-bpe", bos_id=1, eos_id=2, **kw
    )
    plain, with_bos = build(), build(add_bos=True, extra_stop_ids=[7])  # e.g. tokenizer.ggml.eot_token_id
    assert with_bos.add_bos and not plain.add_bos
    assert with_bos.encode("hi there", add_special_tokens=True) == [1, *plain.encode("hi there")]
    assert with_bos.encode("hi there") == plain.encode("hi there")
    assert plain.stop_ids() == (2, 0)  # <|endoftext|> is declared special, so it stops too
    assert with_bos.stop_ids() == (2, 0, 7)
