"""Request bodies at the edge: strict UTF-8, bounded nesting, no lone surrogates."""

from __future__ import annotations

import json

import pytest

from ninfer.protocols.json_body import MAX_JSON_DEPTH, parse_json_body
from ninfer.protocols.strict import WireFormatError


def nested(depth: int) -> bytes:
    """`depth` arrays inside each other (the outermost counts as 1)."""
    return b"[" * depth + b"]" * depth


def test_ordinary_bodies_parse():
    body = {"model": "m", "messages": [{"role": "user", "content": "caf\u00e9 \U0001f600 \\ud800"}]}
    assert parse_json_body(json.dumps(body).encode()) == body
    assert parse_json_body(json.dumps(body, ensure_ascii=False).encode()) == body
    # a surrogate pair written as two escapes is one character, not a lone surrogate
    assert parse_json_body(b'{"a": "\\ud83d\\ude00"}') == {"a": "\U0001f600"}


@pytest.mark.parametrize("body, param", [
    ({"model": "\ud800"}, "model"),
    ({"messages": [{"role": "user", "content": "ok \udfff"}]}, "messages.0.content"),
    ({"tools": [{"name": "x", "input_schema": {"properties": {"\ud800": {}}}}]}, "tools.0.input_schema.properties"),
    ({"\udc00": 1}, None),
])  # fmt: skip
def test_lone_surrogates_are_refused_with_their_field(body, param):
    with pytest.raises(WireFormatError, match="lone UTF-16 surrogate") as caught:
        parse_json_body(json.dumps(body).encode())  # json.dumps writes them as \\u escapes
    assert caught.value.param == param


def test_nesting_is_bounded():
    assert parse_json_body(nested(MAX_JSON_DEPTH)) == json.loads(nested(MAX_JSON_DEPTH))
    with pytest.raises(WireFormatError, match="levels deep"):
        parse_json_body(nested(MAX_JSON_DEPTH + 1))
    for depth in (900, 100_000):  # past the parser's own recursion limit too
        with pytest.raises(WireFormatError, match="levels deep"):
            parse_json_body(nested(depth))
    deep_schema = {"a": 1}
    for _ in range(300):
        deep_schema = {"properties": {"x": deep_schema}}
    with pytest.raises(WireFormatError, match="levels deep") as caught:
        parse_json_body(json.dumps({"tools": [deep_schema]}).encode())
    assert caught.value.param == "tools"


@pytest.mark.parametrize("data, words", [
    (b"", "empty"),
    (b"  \n", "empty"),
    (b'{"a": "\xff"}', "not valid UTF-8"),
    (b'{"a": "\xed\xa0\x80"}', "not valid UTF-8"),  # a surrogate spelled in bytes (CESU-8)
    (b'{"a": ', "not valid JSON"),
    (b"NaN-ish", "not valid JSON"),
])  # fmt: skip
def test_bodies_that_are_not_json_are_refused(data, words):
    with pytest.raises(WireFormatError, match=words):
        parse_json_body(data)
