"""Anthropic Messages wire schemas, conversion to chat messages, and stream events (no server).

Request bodies come from the real `anthropic` SDK: a transport that records what the SDK
sends (and answers 400) stands in for the network, so the parser sees the SDK's own JSON.
"""

from __future__ import annotations

import json

import anthropic
import httpx2
import pytest
from anthropic.types import Message as SdkMessage
from anthropic.types import RawMessageStreamEvent
from pydantic import TypeAdapter

from ninfer.protocols.anthropic import (
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
    parse_count_tokens_request,
    parse_messages_request,
    to_chat_messages,
    to_tool_choice,
    to_tools,
)
from ninfer.protocols.anthropic_events import MessageStream, StreamFrames, error_body, stop_reason, to_json
from ninfer.protocols.strict import WireFormatError

WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def sent_by_sdk(call) -> dict:
    """The JSON body the real SDK sends for `call(client)`."""
    bodies = []

    def handler(request):
        bodies.append(json.loads(request.content))
        return httpx2.Response(400, json=error_body("invalid_request_error", "recorded"))

    transport = httpx2.MockTransport(handler)
    client = anthropic.Anthropic(
        api_key="k", base_url="http://sdk.test", max_retries=0, http_client=httpx2.Client(transport=transport)
    )
    with pytest.raises(anthropic.BadRequestError):
        call(client)
    return bodies[0]


def body(**overrides) -> dict:
    base = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    return {**base, **overrides}


def error_of(data: dict) -> WireFormatError:
    with pytest.raises(WireFormatError) as info:
        to_chat_messages(parse_messages_request(data))
    return info.value


def test_sdk_request_with_system_tools_and_history_converts_to_chat_messages():
    sent = sent_by_sdk(lambda c: c.messages.create(
        model="smol",
        max_tokens=16,
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools.", "cache_control": {"type": "ephemeral"}}],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18C"}]},
                {"type": "text", "text": "And tomorrow?"},
            ]},
        ],
        tools=[WEATHER_TOOL],
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        stop_sequences=["###"],
        output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}},
        extra_body={"temperature": 0.5, "top_k": 40, "seed": 7},
    ))
    request = parse_messages_request(sent)
    assert request.stop_sequences == ["###"] and request.top_k == 40 and request.temperature == 0.5
    assert request.seed == 7 and request.output_config.format.schema == {"type": "object"}
    assert request.tool_choice.disable_parallel_tool_use
    assert to_chat_messages(request) == [
        {"role": "system", "content": "Be brief.\n\nUse tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        ]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18C"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert to_tools(request.tools) == [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER_TOOL["input_schema"],
    }}]


def test_content_blocks_structure_by_type():
    request = parse_messages_request(body(messages=[
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "no", "is_error": True}]},
    ]))
    assert request.messages[0].content == [ToolUseBlock(id="t", name="f", input={})]
    assert request.messages[1].content == [ToolResultBlock(tool_use_id="t", content="no", is_error=True)]
    assert to_chat_messages(request)[1] == {"role": "tool", "tool_call_id": "t", "content": "Error: no"}


def test_blocks_as_the_sdk_dumps_them_are_accepted_and_unknown_keys_still_rejected():
    # anthropic 2.16's ToolUseBlock.model_dump() adds caller and toolset_name (None for a client tool).
    from anthropic.types import TextBlock as SdkTextBlock
    from anthropic.types import ToolUseBlock as SdkToolUseBlock

    used = SdkToolUseBlock(id="toolu_1", name="get_weather", input={"city": "Paris"}, type="tool_use")
    direct = SdkToolUseBlock.model_validate({**used.model_dump(), "id": "toolu_2", "caller": {"type": "direct"}})
    said = SdkTextBlock(text="Checking.", type="text")
    assert {"caller", "toolset_name"} <= used.model_dump().keys()
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [said.model_dump(), used.model_dump(), direct.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C", "toolset_name": None}]},
    ]  # fmt: skip
    messages = to_chat_messages(parse_messages_request(body(messages=history)))
    assert messages[1] == {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "toolu_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
    ]}  # fmt: skip
    bogus = [history[0], {"role": "assistant", "content": [{**used.model_dump(), "bogus": 1}]}, history[2]]
    error = error_of(body(messages=bogus))
    assert error.param == "messages.1.content.0" and "bogus" in error.message


def test_a_final_assistant_turn_is_rejected_rather_than_answered_wrongly():
    error = error_of(body(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The"}]))
    assert error.param == "messages.1" and "prefill" in error.message


def test_system_string_and_count_tokens_request():
    sent = sent_by_sdk(lambda c: c.messages.count_tokens(
        model="smol", system="You are terse.", messages=[{"role": "user", "content": "hello"}]
    ))
    request = parse_count_tokens_request(sent)
    assert to_chat_messages(request) == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "hello"},
    ]
    assert parse_messages_request(body(system=[{"type": "text", "text": "x"}])).system == [TextBlock(text="x")]


@pytest.mark.parametrize(
    ("choice", "expected"),
    [(None, "auto"), ({"type": "auto"}, "auto"), ({"type": "any"}, "required"),
     ({"type": "tool", "name": "get_weather"}, {"name": "get_weather"}), ({"type": "none"}, "none")],
)  # fmt: skip
def test_tool_choice_maps_to_neutral_choice(choice, expected):
    request = parse_messages_request(body(tools=[WEATHER_TOOL], tool_choice=choice))
    assert to_tool_choice(request.tool_choice, request.tools) == expected


def test_no_tools_means_no_tool_choice():
    assert to_tool_choice(parse_messages_request(body()).tool_choice, []) == "none"


@pytest.mark.parametrize(
    ("overrides", "param", "words"),
    [
        ({"max_tokens": 0}, "max_tokens", "at least 1"),
        ({"max_tokens": "8"}, "max_tokens", "integer"),
        ({"temperature": 1.5}, "temperature", "between 0.0 and 1.0"),
        ({"top_p": -0.1}, "top_p", "between"),
        ({"stream": "yes"}, "stream", "boolean"),
        ({"system": 3}, "system", "string or an array"),
        ({"stop_sequences": "###"}, "stop_sequences", "array"),
        ({"stop_sequences": ["#"] * 17}, "stop_sequences", "at most 16 stop sequences"),
        ({"stop_sequences": ["#"] * 600_000}, "stop_sequences", "at most 16 stop sequences"),
        ({"stop_sequences": ["###", ""]}, "stop_sequences.1", "must not be empty"),
        ({"messages": []}, "messages", "at least one"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role", "'user', 'assistant'"),
        ({"messages": [{"role": "user"}]}, "messages.0.content", "missing"),
        ({"unknown_field": 1}, None, "unknown_field"),
        ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER_TOOL]}, "tool_choice.name", "not one of"),
        ({"tool_choice": {"type": "any"}}, "tool_choice", "at least one tool"),
        ({"tools": [{"name": "f"}]}, "tools.0.input_schema", "missing"),
        ({"tools": [{"name": "f", "input_schema": []}]}, "tools.0.input_schema", "object"),
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking.type", "not supported"),
    ],
)  # fmt: skip
def test_invalid_requests_name_the_field(overrides, param, words):
    error = error_of(body(**overrides))
    assert error.param == param
    assert words in error.message


def test_image_blocks_are_rejected_where_they_appear():
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    error = error_of(body(messages=[{"role": "user", "content": [{"type": "text", "text": "look"}, image]}]))
    assert error.param == "messages.0.content.1.type"
    assert "image blocks are not supported" in error.message
    nested = {"type": "tool_result", "tool_use_id": "t", "content": [image]}
    error = error_of(body(messages=[{"role": "user", "content": [nested]}]))
    assert error.param == "messages.0.content.0.content.0.type"


def test_unknown_block_types_and_misplaced_blocks_are_rejected():
    error = error_of(body(messages=[{"role": "user", "content": [{"type": "thinking", "thinking": "hm"}]}]))
    assert error.param == "messages.0.content.0" and "unknown content block type 'thinking'" in error.message
    misplaced = [
        {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
        {"role": "user", "content": "ok"},
    ]
    error = error_of(body(messages=misplaced))
    assert error.param == "messages.0.content.0.type" and "not allowed in assistant" in error.message


def test_a_string_where_a_block_is_expected_is_not_split_into_characters():
    error = error_of(body(messages=[{"role": "user", "content": [{"type": "text", "text": ["a"]}]}]))
    assert error.param == "messages.0.content.0.text"


# --- stream events ---------------------------------------------------------------------------

event_adapter = TypeAdapter(RawMessageStreamEvent)


def run_stream(stream: MessageStream, script) -> list[dict]:
    events = []
    for kind, fields in script:
        events += getattr(stream, kind)(**fields)
    return [to_json(e) for e in events]


TEXT_AND_TOOL = [
    ("start", {"prompt_tokens": 30, "cached_tokens": 12}),
    ("text", {"text": "Let me "}),
    ("text", {"text": "check."}),
    ("tool_call", {"index": 0, "call_id": "call_a", "name": "get_weather", "arguments": '{"city": "Paris"}'}),
    ("tool_call", {"index": 1, "call_id": "call_b", "name": "get_weather", "arguments": '{"city": "Rome"}'}),
    ("finish", {"reason": "tool_calls", "completion_tokens": 21}),
]


def test_stream_event_sequence_is_well_formed_and_matches_the_message():
    stream = MessageStream(message_id="msg_1", model="smol")
    events = run_stream(stream, TEXT_AND_TOOL)
    kinds = [e["type"] for e in events]
    assert kinds == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]  # fmt: skip
    for event in events:
        if event["type"] != "ping":
            event_adapter.validate_python(event)
    start = events[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == 18 and start["usage"]["cache_read_input_tokens"] == 12
    delta = events[-2]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 21

    message = SdkMessage.model_validate(to_json(stream.message()))
    streamed_text = "".join(e["delta"]["text"] for e in events if e.get("delta", {}).get("type") == "text_delta")
    assert message.content[0].text == streamed_text == "Let me check."
    tool_inputs = [
        json.loads(e["delta"]["partial_json"]) for e in events if e.get("delta", {}).get("type") == "input_json_delta"
    ]
    assert [b.input for b in message.content[1:]] == tool_inputs == [{"city": "Paris"}, {"city": "Rome"}]
    assert [b.id for b in message.content[1:]] == ["toolu_a", "toolu_b"]
    assert [e["index"] for e in events if e["type"] == "content_block_start"] == [0, 1, 2]
    assert message.usage.output_tokens == 21 and message.stop_reason == "tool_use"


def test_tool_use_ids_have_anthropics_prefix():
    stream = MessageStream(message_id="msg_3", model="smol")
    run_stream(stream, [
        ("start", {"prompt_tokens": 3, "cached_tokens": 0}),
        ("tool_call", {"index": 0, "call_id": "call_0a1b", "name": "f", "arguments": "{}"}),
        ("tool_call", {"index": 1, "call_id": "toolu_kept", "name": "f", "arguments": "{}"}),
        ("tool_call", {"index": 2, "call_id": None, "name": "f", "arguments": "{}"}),
        ("finish", {"reason": "tool_calls", "completion_tokens": 4}),
    ])  # fmt: skip
    assert [block.id for block in stream.message().content] == ["toolu_0a1b", "toolu_kept", "toolu_msg_3_2"]


def test_text_after_a_tool_call_opens_a_new_block():
    stream = MessageStream(message_id="msg_2", model="smol")
    run_stream(stream, [
        ("start", {"prompt_tokens": 3, "cached_tokens": 0}),
        ("tool_call", {"index": 0, "call_id": "c", "name": "f", "arguments": "{}"}),
        ("text", {"text": "done"}),
        ("finish", {"reason": "stop", "completion_tokens": 4}),
    ])  # fmt: skip
    assert [block.type for block in stream.message().content] == ["tool_use", "text"]


@pytest.mark.parametrize(
    ("reason", "stop_sequence", "expected"),
    [("stop", None, "end_turn"), ("stop", "<|im_end|>", "end_turn"), ("stop", "###", "stop_sequence"),
     ("length", None, "max_tokens"), ("tool_calls", None, "tool_use")],
)  # fmt: skip
def test_stop_reasons(reason, stop_sequence, expected):
    assert stop_reason(reason, stop_sequence, ["###"]) == expected
    stream = MessageStream(message_id="m", model="smol", stop_sequences=("###",))
    stream.start(prompt_tokens=1, cached_tokens=0)
    stream.finish(reason=reason, completion_tokens=1, stop_sequence=stop_sequence)
    message = stream.message()
    assert message.stop_reason == expected
    assert message.stop_sequence == ("###" if expected == "stop_sequence" else None)


def test_an_empty_answer_has_no_content_blocks():
    stream = MessageStream(message_id="m", model="smol")
    events = run_stream(stream, [("start", {"prompt_tokens": 1, "cached_tokens": 0}),
                                 ("text", {"text": ""}),
                                 ("finish", {"reason": "stop", "completion_tokens": 1})])  # fmt: skip
    assert [e["type"] for e in events] == ["message_start", "ping", "message_delta", "message_stop"]
    assert stream.message().content == []


def test_error_body_shape():
    assert error_body("overloaded_error", "busy") == {
        "type": "error", "error": {"type": "overloaded_error", "message": "busy"},
    }  # fmt: skip


def test_stream_frames_are_the_general_events_byte_for_byte():
    """`StreamFrames` fills a text delta's template instead of encoding the whole event: for
    texts that JSON must escape, across two text blocks with a tool call between, every frame
    equals `sse_event(to_json(event), event.type)` and the SDK's event type reads it."""
    from ninfer.protocols.sse import _MARK, sse_event

    texts = ["Hello", 'a "quoted" \\ back\\slash', "line\nbreak\ttab\r", "Ünïcödé – ✓ 🦙", "\x00\x1f", _MARK,
             f"x{_MARK}y"]  # fmt: skip
    stream, frames = MessageStream(message_id="msg_1", model=_MARK, stop_sequences=()), StreamFrames()
    events = stream.start(prompt_tokens=5, cached_tokens=0)
    events += [e for text in texts for e in stream.text(text)]
    events += stream.tool_call(index=0, call_id="toolu_1", name="f", arguments='{"a": 1}')
    events += [e for text in texts for e in stream.text(text)]
    events += stream.finish(reason="stop", completion_tokens=9)
    adapter, got_texts = TypeAdapter(RawMessageStreamEvent), []
    for event in events:
        frame = frames.encode(event)
        assert frame == sse_event(to_json(event), event.type), event
        name, data = frame.decode().removesuffix("\n\n").split("\n")
        if name == "event: ping":  # not one of the SDK's message events
            continue
        parsed = adapter.validate_python(json.loads(data.removeprefix("data: ")))
        assert name == f"event: {parsed.type}"
        if parsed.type == "content_block_delta" and parsed.delta.type == "text_delta":
            got_texts.append((parsed.index, parsed.delta.text))
    assert got_texts == [(0, t) for t in texts] + [(2, t) for t in texts]
