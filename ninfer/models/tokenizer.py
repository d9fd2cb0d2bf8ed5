"""The model's tokenizer: a `tokenizers.Tokenizer` rebuilt from GGUF metadata or read from disk.

GGUF files carry no tokenizer.json, only the vocabulary, merges, token types and a
`tokenizer.ggml.pre` label naming the pre-tokenizer llama.cpp re-implements for that vocabulary.
`Tokenizer.from_gguf_metadata` turns those back into the byte-level BPE the model was trained
with; `Tokenizer.from_file` wraps a Hugging Face tokenizer.json.

Streaming text out of generated ids goes through `IncrementalDetokenizer`, which emits only
completed UTF-8 text and costs O(1) per token.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from ninfer.models.errors import ModelLoadError

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
# Texts longer than this are encoded through encode_batch, which releases the GIL.
_LONG_TEXT_CHARS = 1 << 14

# The split patterns of the tokenizer.json files llama.cpp's labels stand for. llama.cpp runs a
# hand-expanded copy (its regex engine lacks `(?i:...)`); the `tokenizers` regex engine runs the
# originals directly.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> (pre-tokenizer kind, split regex, ignore_merges).
# "digits": every digit alone, then GPT-2's byte-level regex (StarCoder / SmolLM vocabularies).
# "gpt2": GPT-2's byte-level regex only. "split": the regex, then byte-level without its regex.
# llama.cpp sets ignore_merges for the llama3 family: a word that is itself a token is taken whole.
_PRE_TOKENIZERS = {
    "smollm": ("digits", None, False),
    "starcoder": ("digits", None, False),
    "refact": ("digits", None, False),
    "gpt2": ("gpt2", None, False),
    "gpt-2": ("gpt2", None, False),
    "qwen2": ("split", _QWEN2_SPLIT, False),
    "deepseek-r1-qwen": ("split", _QWEN2_SPLIT, False),
    "llama-bpe": ("split", _LLAMA3_SPLIT, True),
    "llama3": ("split", _LLAMA3_SPLIT, True),
    "llama-v3": ("split", _LLAMA3_SPLIT, True),
}
SUPPORTED_GGUF_PRE = tuple(_PRE_TOKENIZERS)

# End-of-turn / end-of-text tokens used across model families; each counts as a stop id when the
# vocabulary declares it as a special token: stop on all of them, not only eos (chat models end a
# turn with an end-of-turn token that is often not the declared eos, and would run on past it).
_STOP_TOKEN_TEXTS = (
    "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<|end_of_text|>",
    "<end_of_turn>", "<|return|>", "<|end▁of▁sentence|>", "</s>", "<EOT>",
)  # fmt: skip


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable spelling of each byte, inverted (character -> byte)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_DECODER = _byte_decoder()
_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _byte_level_pre_tokenizer(kind: str, split: str | None) -> pre_tokenizers.PreTokenizer:
    if kind == "digits":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if kind == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _special_template(hf: tokenizers.Tokenizer, bos: int | None, eos: int | None) -> None:
    """Make `add_special_tokens=True` prepend bos and/or append eos."""
    specials, single = [], "$A"
    if bos is not None:
        specials.append((hf.id_to_token(bos), bos))
        single = f"{hf.id_to_token(bos)} {single}"
    if eos is not None:
        specials.append((hf.id_to_token(eos), eos))
        single = f"{single} {hf.id_to_token(eos)}"
    hf.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)


def _token_text(value) -> str | None:
    """tokenizer_config.json writes a token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """Text <-> token ids for one model, plus the ids that end generation."""

    def __init__(
        self,
        hf: tokenizers.Tokenizer,
        *,
        bos_id: int | None,
        eos_id: int | None,
        extra_stop_ids: Iterable[int] = (),
    ):
        self.hf = hf
        self.bos_id = bos_id
        self.eos_id = eos_id
        self._extra_stop_ids = tuple(extra_stop_ids)
        added = hf.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, tok in added.items() if tok.special)
        self.add_bos = bos_id is not None and hf.encode("", add_special_tokens=True).ids[:1] == [bos_id]
        self._token_bytes: list[bytes | None] | None = None
        self._byte_level: bool | None = None

    @classmethod
    def from_gguf_metadata(
        cls,
        tokens: Sequence[str],
        token_types: Sequence[int],
        merges: Sequence[str],
        *,
        model: str,
        pre: str | None,
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool = False,
        add_eos: bool = False,
        extra_stop_ids: Iterable[int] = (),
    ) -> Tokenizer:
        """Rebuild the tokenizer a GGUF file describes (`tokenizer.ggml.*` metadata)."""
        if model != "gpt2":
            hint = " (SentencePiece vocabularies are not supported yet)" if model == "llama" else ""
            raise ModelLoadError(
                f"tokenizer model {model!r} is not supported{hint}; "
                "ninfer reads byte-level BPE ('gpt2') vocabularies."
            )
        if pre not in _PRE_TOKENIZERS:
            raise ModelLoadError(
                f"pre-tokenizer {pre!r} is not supported (supported: {', '.join(SUPPORTED_GGUF_PRE)})."
            )
        kind, split, ignore_merges = _PRE_TOKENIZERS[pre]
        vocab: dict[str, int] = {}
        for i, tok in enumerate(tokens):
            vocab.setdefault(tok, i)
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        hf = tokenizers.Tokenizer(models.BPE(vocab, pairs, ignore_merges=ignore_merges))
        hf.pre_tokenizer = _byte_level_pre_tokenizer(kind, split)
        hf.decoder = decoders.ByteLevel()
        types = list(token_types)
        hf.add_special_tokens([
            AddedToken(tokens[i], special=True, normalized=False)
            for i, t in enumerate(types) if t == TOKEN_TYPE_CONTROL
        ])  # fmt: skip
        hf.add_tokens([
            AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(types) if t == TOKEN_TYPE_USER_DEFINED
        ])  # fmt: skip
        if add_bos or add_eos:
            _special_template(hf, bos_id if add_bos else None, eos_id if add_eos else None)
        return cls(hf, bos_id=bos_id, eos_id=eos_id, extra_stop_ids=extra_stop_ids)

    @classmethod
    def from_file(
        cls,
        tokenizer_json_path: str | Path,
        tokenizer_config: dict | None = None,
        *,
        extra_stop_ids: Iterable[int] = (),
    ) -> Tokenizer:
        """Wrap a Hugging Face tokenizer.json; tokenizer_config.json names bos / eos.

        `add_bos_token` / `add_eos_token`, when the config states them, decide what
        `add_special_tokens=True` adds (as transformers does); otherwise the file's post-processor
        stands.
        """
        hf = tokenizers.Tokenizer.from_file(str(tokenizer_json_path))
        config = tokenizer_config or {}
        bos_id = _id_of(hf, _token_text(config.get("bos_token")))
        eos_id = _id_of(hf, _token_text(config.get("eos_token")))
        if "add_bos_token" in config or "add_eos_token" in config:
            add_bos = bool(config.get("add_bos_token")) and bos_id is not None
            add_eos = bool(config.get("add_eos_token")) and eos_id is not None
            if add_bos or add_eos:
                _special_template(hf, bos_id if add_bos else None, eos_id if add_eos else None)
            else:
                hf.post_processor = None
        return cls(hf, bos_id=bos_id, eos_id=eos_id, extra_stop_ids=extra_stop_ids)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (added tokens included)."""
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in it (e.g. `<|im_start|>`) stay whole.

        `add_special_tokens=True` adds what the model asks for around a sequence (e.g. bos).
        """
        if len(text) > _LONG_TEXT_CHARS:
            # `encode` holds the GIL throughout (seconds for megabytes, stalling every other
            # thread, the server's event loop included); `encode_batch` lets it go.
            return self.hf.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def to_json_str(self) -> str:
        """The tokenizer as tokenizer.json text (what llguidance's `LLTokenizer` takes)."""
        return self.hf.to_str()

    def stop_ids(self) -> tuple[int, ...]:
        """Every end-of-generation id the vocabulary declares: eos first, then the rest ascending."""
        found = set(self._extra_stop_ids)
        for text in _STOP_TOKEN_TEXTS:
            token_id = self.hf.token_to_id(text)
            if token_id is not None and token_id in self.special_ids:
                found.add(token_id)
        found.discard(self.eos_id)
        head = () if self.eos_id is None else (self.eos_id,)
        return head + tuple(sorted(found))

    def detokenizer(self, *, skip_special_tokens: bool = False) -> IncrementalDetokenizer:
        """A fresh streaming decoder for one generated sequence."""
        if self._is_byte_level():
            return _ByteLevelDetokenizer(self, skip_special_tokens)
        return _WindowDetokenizer(self, skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (exact for byte-level and byte-fallback vocabularies);
        none for an id past the tokenizer (a padded head's row: samplers mask those, this keeps
        a backend that does not from failing the request)."""
        if not 0 <= token_id < self.vocab_size:
            return b""
        if self._token_bytes is None:
            self._token_bytes = [None] * self.vocab_size
        cached = self._token_bytes[token_id]
        if cached is None:
            cached = self._token_bytes[token_id] = self._spell_bytes(self.hf.id_to_token(token_id) or "")
        return cached

    def _spell_bytes(self, text: str) -> bytes:
        if self._is_byte_level():
            # As the ByteLevel decoder does: a token spelled outside the byte alphabet (an added
            # token written in plain text) stands for its own UTF-8 bytes.
            if all(c in _BYTE_DECODER for c in text):
                return bytes(_BYTE_DECODER[c] for c in text)
            return text.encode()
        if _BYTE_FALLBACK.fullmatch(text):  # SentencePiece byte-fallback token, e.g. <0xE4>
            return bytes([int(text[3:5], 16)])
        return text.replace("\u2581", " ").encode()  # Metaspace spells spaces as U+2581

    def _is_byte_level(self) -> bool:
        if self._byte_level is None:
            self._byte_level = isinstance(self.hf.decoder, decoders.ByteLevel)
        return self._byte_level


def _id_of(hf: tokenizers.Tokenizer, text: str | None) -> int | None:
    return None if text is None else hf.token_to_id(text)


class IncrementalDetokenizer:
    """Turns generated ids into text as they arrive, never splitting a UTF-8 character.

    `push(id)` returns only text completed by that token; `flush()` returns what is left (an
    unfinished character comes out as U+FFFD there). Concatenating every push and the flush
    gives `Tokenizer.decode` of all the ids.
    """

    def push(self, token_id: int) -> str:
        raise NotImplementedError

    def flush(self) -> str:
        raise NotImplementedError


class _ByteLevelDetokenizer(IncrementalDetokenizer):
    """Byte-level vocabularies: each token is a fixed byte string, fed to a UTF-8 decoder."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool):
        self._tokenizer = tokenizer
        self._skip = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if token_id in self._skip:
            return ""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class _WindowDetokenizer(IncrementalDetokenizer):
    """Other decoders (e.g. SentencePiece's): re-decode a short trailing window of ids.

    The window keeps the ids of the last emitted piece as context, so a decoder that treats the
    first token of a sequence specially (dropping its leading space) does so only on context. It
    grows only while a character is incomplete, so the cost per token stays bounded.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []  # context ids, then ids not yet emitted
        self._num_context = 0

    def _pending_text(self) -> str:
        context = self._tokenizer.decode(self._ids[: self._num_context], skip_special_tokens=self._skip)
        text = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip)
        return text[len(context) :] if len(text) > len(context) else ""

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        piece = self._pending_text()
        if not piece or piece.endswith("\ufffd"):
            return ""  # an incomplete character: wait for the bytes that finish it
        self._ids = self._ids[self._num_context :]
        self._num_context = len(self._ids)
        return piece

    def flush(self) -> str:
        piece = self._pending_text()
        self._ids, self._num_context = [], 0
        return piece
