"""Request bodies: strict UTF-8, JSON, bounded nesting, no lone surrogates.

Python's `json` accepts what a wire API must refuse: `"\\ud800"` escapes become lone
surrogates (which fail later, far from the request, when anything encodes them), and a body
nested 100,000 levels deep overflows the parser's recursion. `parse_json_body` refuses both
with a `WireFormatError` naming the field, so every route answers them with a 400 in its own
shape before any of the request reaches the engine.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ninfer.protocols.strict import WireFormatError

MAX_JSON_DEPTH = 64  # arrays and objects inside each other, the body itself counting as 1
_SURROGATE = re.compile("[\ud800-\udfff]")


def parse_json_body(data: bytes) -> Any:
    """The body as JSON; a `WireFormatError` for anything a wire API must not accept."""
    if not data.strip():
        raise WireFormatError("The request body is empty; send a JSON object.")
    try:
        text = data.decode("utf-8")  # strict: json.loads(bytes) would let surrogates through
    except UnicodeDecodeError as e:
        raise WireFormatError(f"The request body is not valid UTF-8 (byte {e.start}).") from None
    try:
        value = json.loads(text)
    except RecursionError:
        raise _too_deep(None) from None
    except ValueError as e:
        raise WireFormatError(f"The request body is not valid JSON: {e}.") from None
    check_json_value(value)
    return value


def check_json_value(value: Any) -> None:
    """Raise `WireFormatError` for nesting past MAX_JSON_DEPTH or a lone surrogate anywhere."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            _check_text(item, path, "string")
        elif isinstance(item, (dict, list)):
            if len(path) >= MAX_JSON_DEPTH:
                raise _too_deep(path)
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            for key, child in pairs:
                if isinstance(key, str):
                    _check_text(key, path, "key")
                stack.append((child, (*path, str(key))))


def _check_text(text: str, path: tuple[str, ...], what: str) -> None:
    found = _SURROGATE.search(text)
    if found is None:
        return
    param = ".".join(path) or None
    code = f"\\u{ord(found.group()):04x}"
    where = f"{param}: a {what}" if param else f"A {what}"
    if what == "key":
        where = f"A key in {param}" if param else "A key"
    raise WireFormatError(f"{where} holds a lone UTF-16 surrogate ({code}), which is not valid Unicode.", param)


def _too_deep(path: tuple[str, ...] | None) -> WireFormatError:
    param = path[0] if path else None  # the top-level field it is in
    return WireFormatError(f"The request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep.", param)
