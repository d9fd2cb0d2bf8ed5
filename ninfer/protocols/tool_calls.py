"""Hermes-style tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in text.

ChatML models (SmolLM2, Qwen2/3) write tool calls as JSON between tags. `ToolCallParser` is
incremental: feed it text as tokens arrive and it returns text pieces (safe to show now) and
complete tool calls, holding back only what might still be the start of a tag. Feeding the
same text in any chunking gives the same pieces in total, so a streamed answer and a
non-streamed one agree. Arguments are re-serialised as compact JSON (`{"city":"Paris"}`), the
form the tool grammar makes the model write and docs/serving.md promises.
"""

from __future__ import annotations

import json

import attrs

START_TAG = "<tool_call>"
END_TAG = "</tool_call>"


@attrs.frozen
class TextPiece:
    text: str


@attrs.frozen
class CallPiece:
    name: str
    arguments: str  # a JSON object, re-serialised compactly (`compact_json`) from what the model wrote


Piece = TextPiece | CallPiece


def parse_call_body(body: str) -> CallPiece | None:
    """The call a tag body describes, or None when it is not a valid Hermes call."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models double-encode the arguments
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return CallPiece(obj["name"], compact_json(arguments))


def compact_json(value) -> str:
    """JSON without insignificant whitespace; non-ASCII text stays as written."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _tag_prefix_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolCallParser:
    """Splits model output into text and tool calls, incrementally.

    Whitespace between and after tool calls is dropped (models put newlines there). A closed
    tag whose body does not parse is returned as text, tags included, so nothing the model
    finished writing is lost. An answer that ends inside a call is cut (typically by
    max_tokens, which its finish reason `length` tells the client), and half a call is neither
    a call nor text to show: an unclosed tag whose body does not parse is dropped, and so is a
    start tag cut short (`<tool_c`) at the very end.
    """

    def __init__(self, start_tag: str = START_TAG, end_tag: str = END_TAG):
        self._start_tag = start_tag
        self._end_tag = end_tag
        self._buffer = ""
        self._in_call = False
        self._held_space = ""  # whitespace after a call, shown only if more text follows
        self._after_call = False  # nothing but whitespace since the last call
        self.num_calls = 0

    def feed(self, text: str) -> list[Piece]:
        """Pieces completed by `text`."""
        self._buffer += text
        pieces: list[Piece] = []
        while self._step(pieces):
            pass
        return pieces

    def finish(self) -> list[Piece]:
        """Everything still held: an unclosed call is parsed as if its end tag had arrived (and
        dropped when it does not parse); a held-back start of a start tag is dropped."""
        pieces: list[Piece] = []
        if self._in_call:
            self._close_call(self._buffer, pieces, closed=False)
        elif self._buffer:
            self._emit_text(self._buffer[: len(self._buffer) - _tag_prefix_len(self._buffer, self._start_tag)], pieces)
        self._buffer = ""
        self._in_call = False
        self._held_space = ""
        self._after_call = False
        return pieces

    def _step(self, pieces: list[Piece]) -> bool:
        """Consume one tag or text run from the buffer; False when waiting for more text."""
        if self._in_call:
            end = self._buffer.find(self._end_tag)
            if end < 0:
                return False
            body, self._buffer = self._buffer[:end], self._buffer[end + len(self._end_tag) :]
            self._in_call = False
            self._close_call(body, pieces, closed=True)
            return True
        start = self._buffer.find(self._start_tag)
        if start >= 0:
            self._emit_text(self._buffer[:start], pieces)
            self._buffer = self._buffer[start + len(self._start_tag) :]
            self._in_call = True
            return True
        keep = _tag_prefix_len(self._buffer, self._start_tag)
        ready, self._buffer = self._buffer[: len(self._buffer) - keep], self._buffer[len(self._buffer) - keep :]
        self._emit_text(ready, pieces)
        return False

    def _close_call(self, body: str, pieces: list[Piece], *, closed: bool) -> None:
        call = parse_call_body(body.strip())
        if call is None:
            if closed:
                self._emit_text(self._start_tag + body + self._end_tag, pieces)
            return
        self._held_space = ""
        self._after_call = True
        self.num_calls += 1
        pieces.append(call)

    def _emit_text(self, text: str, pieces: list[Piece]) -> None:
        if not text:
            return
        if self._after_call and not text.strip():
            self._held_space += text
            return
        text, self._held_space, self._after_call = self._held_space + text, "", False
        if pieces and isinstance(pieces[-1], TextPiece):
            pieces[-1] = TextPiece(pieces[-1].text + text)
        else:
            pieces.append(TextPiece(text))


def split_tool_calls(text: str) -> tuple[str, list[CallPiece]]:
    """Non-incremental helper: (text without the calls, the calls) of a whole answer."""
    parser = ToolCallParser()
    pieces = parser.feed(text) + parser.finish()
    content = "".join(p.text for p in pieces if isinstance(p, TextPiece))
    return content, [p for p in pieces if isinstance(p, CallPiece)]
