"""A Lark grammar (llguidance dialect) for "the answer is a tool call".

The text it allows is exactly what the Hermes template renders and `ToolCallParser` reads:

    <tool_call>
    {"name": "get_weather", "arguments": {"city":"Paris"}}
    </tool_call>

one block per call, blocks separated by a newline. The name is one of the declared tools and
the arguments are compact JSON matching that tool's `parameters` schema (`%json`).
"""

from __future__ import annotations

import json
import re
from typing import Any

import attrs

from ninfer.protocols.tool_calls import END_TAG, START_TAG

MAX_PARALLEL_CALLS = 8
TOOL_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


@attrs.frozen
class ToolSpec:
    name: str
    parameters: dict[str, Any] = attrs.field(factory=lambda: {"type": "object"})

    def __attrs_post_init__(self):
        if not TOOL_NAME_PATTERN.match(self.name):
            raise ValueError(
                f"tool name {self.name!r} must be 1 to 64 letters, digits, '_', '.' or '-'"
            )


def _literal(text: str) -> str:
    # JSON string escapes are valid in llguidance's Lark string literals.
    return json.dumps(text, ensure_ascii=False)


def _arguments_schema(parameters: dict[str, Any]) -> str:
    schema = dict(parameters) if parameters else {"type": "object"}
    schema.setdefault("type", "object")
    schema["x-guidance"] = {**_JSON_OPTIONS, **schema.get("x-guidance", {})}
    return json.dumps(schema, ensure_ascii=False)


def tool_call_lark(tools: list[ToolSpec] | tuple[ToolSpec, ...], *, parallel: bool) -> str:
    """The grammar text; `parallel` allows up to MAX_PARALLEL_CALLS calls in a row."""
    if not tools:
        raise ValueError("a tool-call grammar needs at least one tool")
    lines = []
    if parallel:
        lines.append(f'start: call ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}')
    else:
        lines.append("start: call")
    bodies = " | ".join(f"body_{i}" for i in range(len(tools)))
    lines.append(f"call: {_literal(START_TAG + chr(10))} ({bodies}) {_literal(chr(10) + END_TAG)}")
    for i, tool in enumerate(tools):
        head = '{"name": ' + json.dumps(tool.name) + ', "arguments": '
        lines.append(f'body_{i}: {_literal(head)} args_{i} "}}"')
        lines.append(f"args_{i}: %json {_arguments_schema(tool.parameters)}")
    return "\n".join(lines) + "\n"
