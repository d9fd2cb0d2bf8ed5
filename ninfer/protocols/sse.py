"""Server-sent events framing (https://html.spec.whatwg.org/multipage/server-sent-events.html).

An event is `event: NAME` (optional) and `data: ...` lines ended by a blank line; a line that
starts with `:` is a comment, which clients ignore and proxies see as traffic (keep-alive).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # ask nginx-style proxies not to buffer the stream
}

DONE = b"data: [DONE]\n\n"  # OpenAI's end-of-stream marker


def encode_json(data: Any) -> str:
    """Compact JSON, UTF-8 kept as is."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def sse_event(data: Any, event: str | None = None) -> bytes:
    """One event; `data` is JSON-encoded unless it already is a string."""
    text = data if isinstance(data, str) else encode_json(data)
    lines = [f"event: {event}"] if event else []
    lines.extend(f"data: {line}" for line in text.split("\n"))
    return ("\n".join(lines) + "\n\n").encode("utf-8")


def sse_comment(text: str = "keep-alive") -> bytes:
    """A comment line: keeps idle connections (and proxies) from timing out."""
    return "".join(f": {line}\n" for line in text.split("\n")).encode("utf-8") + b"\n"


_MARK = "ninfer-fill-5f0c"  # stands for the varying string while an `EventTemplate` is made


class EventTemplate:
    """The SSE events of one shape whose only varying part is one JSON string (a streamed
    text delta): `make(text)` builds an event the general way; `fill(text)` gives the same
    bytes by encoding the string alone into the event `make` built once around a marker.
    (Compact JSON never holds a raw newline, so the event's one `data:` line stays one line.)
    A shape whose other fields happen to hold the marker keeps the general way."""

    def __init__(self, make: Callable[[str], bytes]):
        self._make = make
        parts = make(_MARK).split(encode_json(_MARK).encode())
        self._parts = (parts[0], parts[1]) if len(parts) == 2 else None

    def fill(self, text: str) -> bytes:
        if self._parts is None:
            return self._make(text)
        before, after = self._parts
        return before + encode_json(text).encode() + after
