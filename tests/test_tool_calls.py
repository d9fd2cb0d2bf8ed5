"""The Hermes `<tool_call>` parser: whole texts, every chunking, malformed and unclosed calls."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer.protocols.tool_calls import (
    START_TAG, CallPiece, TextPiece, ToolCallParser, parse_call_body, split_tool_calls,
)  # fmt: skip

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


def feed_in_chunks(text: str, cuts: list[int]) -> list:
    parser = ToolCallParser()
    pieces, start = [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        pieces += parser.feed(text[start:cut])
        start = cut
    return pieces + parser.finish()


def merged(pieces: list) -> list:
    """Adjacent text pieces joined: the chunking may split text, never calls."""
    out = []
    for p in pieces:
        if out and isinstance(p, TextPiece) and isinstance(out[-1], TextPiece):
            out[-1] = TextPiece(out[-1].text + p.text)
        else:
            out.append(p)
    return out


def test_plain_text_passes_through():
    assert split_tool_calls("Hello <b>world</b> a < b") == ("Hello <b>world</b> a < b", [])


def test_one_call_with_text_before():
    content, calls = split_tool_calls("Let me check.\n" + WEATHER)
    assert content == "Let me check.\n"
    assert calls == [CallPiece("get_weather", '{"city":"Paris","days":3}')]


def test_parallel_calls_drop_the_whitespace_between_them():
    content, calls = split_tool_calls(WEATHER + "\n\n" + TIME + "\n")
    assert content == ""
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[1].arguments) == {}


def test_text_after_a_call_is_kept():
    content, calls = split_tool_calls(TIME + "\nDone.")
    assert content == "\nDone."
    assert len(calls) == 1


def test_unclosed_call_at_the_end_is_still_a_call():
    content, calls = split_tool_calls('<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}')
    assert content == ""
    assert calls == [CallPiece("get_time", '{"tz":"UTC"}')]


def test_malformed_call_comes_back_as_text():
    text = "<tool_call>\n{not json}\n</tool_call> then text"
    assert split_tool_calls(text) == (text, [])


@pytest.mark.parametrize("cut", ["<", "<tool_c", "<tool_call>", '<tool_call>\n{"name": "f", "argu', '<tool_call>\n{"name": "f", "arguments": {"x": 1}'])
def test_a_call_cut_before_its_end_is_dropped_not_shown_as_text(cut):
    # An answer cut by max_tokens inside a call: half a call is neither a call nor text.
    assert split_tool_calls("Checking.\n" + cut) == ("Checking.\n", [])
    assert split_tool_calls(WEATHER + "\n" + cut) == ("", [CallPiece("get_weather", '{"city":"Paris","days":3}')])
    for at in range(len(cut) + 1):  # streamed: no piece of it shows while it arrives either
        pieces = feed_in_chunks(TIME + "\n" + cut, [len(TIME) + 1 + at])
        assert pieces == [CallPiece("get_time", "{}")], at


def test_arguments_are_compact_json_whatever_the_model_wrote():
    body = '{"name": "f", "arguments": {"city" : "Zürich",  "days": [1, 2], "opts": {"a": null}}}'
    (call,) = split_tool_calls(f"<tool_call>\n{body}\n</tool_call>")[1]
    assert call.arguments == '{"city":"Zürich","days":[1,2],"opts":{"a":null}}'
    assert json.loads(call.arguments) == json.loads(body)["arguments"]


def test_call_body_variants():
    assert parse_call_body('{"name": "f", "parameters": {"x": 1}}') == CallPiece("f", '{"x":1}')
    assert parse_call_body('{"name": "f", "arguments": "{\\"x\\": 1}"}') == CallPiece("f", '{"x":1}')
    assert parse_call_body('{"name": "f"}') == CallPiece("f", "{}")
    assert parse_call_body('{"name": "", "arguments": {}}') is None
    assert parse_call_body('{"name": "f", "arguments": [1]}') is None
    assert parse_call_body('["f"]') is None


def test_partial_tag_is_held_back_until_it_resolves():
    parser = ToolCallParser()
    assert parser.feed("Hi <tool") == [TextPiece("Hi ")]
    assert parser.feed("box>") == [TextPiece("<toolbox>")]
    assert parser.feed("<tool_c") == []
    assert parser.feed('all>{"name": "f", "arguments": {}}</tool_call>') == [CallPiece("f", "{}")]
    assert parser.num_calls == 1


@pytest.mark.parametrize("call", [WEATHER, TIME])
def test_a_space_after_text_that_follows_a_call_survives_any_cut(call):
    # Found by the property below: "Sure." and " " fed apart lost the space.
    text = call + "Sure. "
    for cut in range(len(text) + 1):
        pieces = merged(feed_in_chunks(text, [cut]))
        assert [p.text for p in pieces if isinstance(p, TextPiece)] == ["Sure. "], cut


@settings(max_examples=200, deadline=None)
@given(
    parts=st.lists(st.sampled_from(["Sure. ", WEATHER, TIME, "\n", "a <tool", "x</tool_call>", "<", "ok"]), max_size=6),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12),
)
def test_any_chunking_gives_the_same_pieces(parts, cuts):
    text = "".join(parts)
    whole = ToolCallParser()
    expected = merged(whole.feed(text) + whole.finish())
    assert merged(feed_in_chunks(text, [c for c in cuts if c <= len(text)])) == expected
    # Nothing the model wrote is lost but the calls' markup, whitespace next to calls, and a
    # start tag cut short at the very end (an unfinished call).
    shown = "".join(p.text for p in expected if isinstance(p, TextPiece))
    cut_tag = next((n for n in range(len(START_TAG) - 1, 0, -1) if text.endswith(START_TAG[:n])), 0)
    rest = text[: len(text) - cut_tag].replace(WEATHER, "").replace(TIME, "")
    assert "".join(shown.split()) == "".join(rest.split())
    assert [p.name for p in expected if isinstance(p, CallPiece)] == [
        "get_weather" if part == WEATHER else "get_time" for part in parts if part in (WEATHER, TIME)
    ]
