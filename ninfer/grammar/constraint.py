"""llguidance matchers behind the engine's `TokenConstraint` protocol."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ninfer.grammar.tool_grammar import ToolSpec, tool_call_lark

# Compact JSON: with flexible whitespace a small model can pad forever and never close.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class GrammarError(ValueError):
    """A schema or grammar llguidance cannot enforce; the message says what and where."""


class GrammarConstraint:
    """One request's grammar state: a mask before each token, advanced by each emitted token.

    A token the grammar rejects (it cannot happen while the engine applies the mask) ends the
    answer instead of raising, so one bad request never disturbs the engine's step.
    """

    def __init__(self, matcher: Any, vocab_size: int):
        self._matcher = matcher
        self._vocab_size = vocab_size
        self.error: str | None = None

    def allowed_mask(self) -> np.ndarray | None:
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little", count=self._vocab_size).astype(bool)
        return mask

    def advance(self, token_id: int) -> None:
        if self.error is None and not self._matcher.consume_token(int(token_id)):
            self.error = self._matcher.get_error() or f"token {token_id} does not fit the grammar"

    def is_finished(self) -> bool:
        return self.error is not None or self._matcher.is_stopped()

    def is_accepting(self) -> bool:
        """True when the text so far is a complete sentence of the grammar."""
        return self._matcher.is_accepting()


class GrammarCompiler:
    """Builds constraints for one tokenizer; cheap to call per request after construction."""

    def __init__(self, tokenizer_json: str, *, vocab_size: int, stop_token_ids: Iterable[int]):
        import llguidance

        self._llg = llguidance
        self._vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=sorted(set(stop_token_ids))
        )

    def json_schema(self, schema: Any) -> GrammarConstraint:
        """A constraint producing JSON that validates against `schema` (compact separators)."""
        if not isinstance(schema, dict):
            raise GrammarError("the JSON schema must be an object")
        try:
            grammar = self._llg.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
        except ValueError as e:
            raise GrammarError(f"invalid JSON schema: {e}") from None
        return self.constraint(grammar)

    def json_object(self) -> GrammarConstraint:
        """Any JSON object."""
        return self.json_schema({"type": "object"})

    def tool_calls(self, tools: Sequence[ToolSpec], *, parallel: bool) -> GrammarConstraint:
        """One (or, when `parallel`, several) Hermes tool calls, each to one of `tools` with
        arguments that match that tool's parameter schema."""
        return self.lark(tool_call_lark(tools, parallel=parallel))

    def lark(self, source: str) -> GrammarConstraint:
        return self.constraint(self._llg.LLMatcher.grammar_from_lark(source))

    def constraint(self, grammar: str) -> GrammarConstraint:
        matcher = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(_clean_error(matcher.get_error()))
        return GrammarConstraint(matcher, self._vocab_size)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes of one token (a piece of a UTF-8 character stays a piece)."""
        return self.tokenizer.decode_bytes([int(token_id)])


def _clean_error(message: str) -> str:
    # llguidance prefixes some messages with its internal grammar index; keep the sentence.
    return message.strip().splitlines()[0] if message.strip() else "the grammar is invalid"

