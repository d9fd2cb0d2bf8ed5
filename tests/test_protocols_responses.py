"""OpenAI Responses wire schemas, conversion to chat messages, and stream events (no server).

Request bodies come from the real `openai` SDK: a transport that records what the SDK sends
(and answers 400) stands in for the network, so the parser sees the SDK's own JSON.
"""

from __future__ import annotations

import json

import httpx2
import openai
import pytest
from openai.types.responses import Response as SdkResponse
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from ninfer.protocols.responses import (
    FunctionCallItem,
    MessageItem,
    input_items,
    parse_responses_request,
    to_chat_messages,
    to_tool_choice,
    to_tools,
)
from ninfer.protocols.responses_events import Response, ResponseStream, to_json, usage
from ninfer.protocols.strict import WireFormatError

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": True,
}


def sent_by_sdk(call) -> dict:
    """The JSON body the real SDK sends for `call(client)`."""
    bodies = []

    def handler(request):
        bodies.append(json.loads(request.content))
        return httpx2.Response(400, json={"error": {"message": "recorded", "type": "invalid_request_error"}})

    transport = httpx2.MockTransport(handler)
    client = openai.OpenAI(
        api_key="k", base_url="http://sdk.test/v1", max_retries=0, http_client=httpx2.Client(transport=transport)
    )
    with pytest.raises(openai.BadRequestError):
        call(client)
    return bodies[0]


def error_of(data: dict) -> WireFormatError:
    with pytest.raises(WireFormatError) as info:
        to_chat_messages(input_items(parse_responses_request(data)))
    return info.value


def test_text_input_is_one_user_message():
    sent = sent_by_sdk(lambda c: c.responses.create(
        model="smol", input="Hi there", instructions="Be brief.", max_output_tokens=16, temperature=0.2,
    ))
    request = parse_responses_request(sent)
    assert request.instructions == "Be brief." and request.max_output_tokens == 16
    assert input_items(request) == [MessageItem(role="user", content="Hi there")]
    assert to_chat_messages(input_items(request)) == [{"role": "user", "content": "Hi there"}]


def test_item_input_with_function_calls_converts_to_chat_messages():
    sent = sent_by_sdk(lambda c: c.responses.create(
        model="smol",
        input=[
            {"role": "developer", "content": "Use tools."},
            {"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Paris?"}]},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
        ],
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        extra_body={"seed": 3},
    ))  # fmt: skip
    request = parse_responses_request(sent)
    assert request.seed == 3 and request.parallel_tool_calls is False
    assert isinstance(request.input[3], FunctionCallItem)
    assert to_chat_messages(input_items(request)) == [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    ]  # fmt: skip
    assert to_tool_choice(request) == {"name": "get_weather"}
    assert to_tools(request.tools) == [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER_TOOL["parameters"],
    }}]  # fmt: skip


def test_function_calls_without_an_assistant_message_get_one():
    request = parse_responses_request({"model": "m", "input": [
        {"role": "user", "content": "go"},
        {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "b", "name": "f", "arguments": '{"x": 1}'},
    ]})  # fmt: skip
    messages = to_chat_messages(input_items(request))
    assert messages[1]["role"] == "assistant" and messages[1]["content"] == ""
    assert [call["id"] for call in messages[1]["tool_calls"]] == ["a", "b"]


@pytest.mark.parametrize(
    ("choice", "tools", "expected"),
    [("auto", [WEATHER_TOOL], "auto"), ("required", [WEATHER_TOOL], "required"),
     ("none", [WEATHER_TOOL], "none"), ("auto", [], "none")],
)  # fmt: skip
def test_tool_choice(choice, tools, expected):
    request = parse_responses_request({"model": "m", "input": "x", "tools": tools, "tool_choice": choice})
    assert to_tool_choice(request) == expected


def test_previous_response_id_alone_is_enough_input():
    request = parse_responses_request({"model": "m", "previous_response_id": "resp_1"})
    assert input_items(request) == []


@pytest.mark.parametrize(
    ("overrides", "param", "words"),
    [
        ({"input": 5}, "input", "string or an array"),
        ({"input": ""}, "input", "give some input"),
        ({"input": []}, "input", "at least one"),
        ({"max_output_tokens": 0}, "max_output_tokens", "at least 1"),
        ({"temperature": 2.5}, "temperature", "between 0.0 and 2.0"),
        ({"top_p": "1"}, "top_p", "number"),
        ({"top_logprobs": 21}, "top_logprobs", "between 0 and 20"),
        ({"stream": 1}, "stream", "boolean"),
        ({"tool_choice": "sometimes"}, "tool_choice", "'auto', 'none', 'required'"),
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER_TOOL]}, "tool_choice.name", "not one of"),
        ({"tool_choice": "required"}, "tool_choice", "at least one tool"),
        ({"tools": [{"type": "web_search"}]}, "tools.0", "unknown tool type 'web_search'"),
        ({"tools": [{"type": "function"}]}, "tools.0.name", "missing"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input.0", "unknown input item type 'reasoning'"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role", "'user', 'assistant'"),
        ({"input": [{"type": "function_call", "call_id": "a", "name": "f", "arguments": "{"}]}, "input.0.arguments", "JSON"),
        ({"input": [{"type": "function_call", "call_id": "a", "name": "f", "arguments": "[1]"}]}, "input.0.arguments", "object"),
        ({"metadata": ["x"]}, "metadata", "object"),
        ({"reasoning": {"effort": "high"}}, "reasoning", "not a reasoning model"),
        ({"background": True}, "background", "not supported"),
        ({"conversation": "conv_1"}, None, "conversation"),
    ],
)  # fmt: skip
def test_invalid_requests_name_the_field(overrides, param, words):
    error = error_of({"model": "m", "input": "hi", **overrides})
    assert error.param == param
    assert words in error.message


def test_images_and_files_are_rejected_where_they_appear():
    parts = [{"type": "input_text", "text": "look"}, {"type": "input_image", "image_url": "https://x/y.png"}]
    error = error_of({"model": "m", "input": [{"role": "user", "content": parts}]})
    assert error.param == "input.0.content.1.type" and "input_image parts are not supported" in error.message
    output = [{"type": "input_file", "file_id": "f"}]
    error = error_of({"model": "m", "input": [{"type": "function_call_output", "call_id": "c", "output": output}]})
    assert error.param == "input.0.output.0.type"


# --- stream events ---------------------------------------------------------------------------

event_adapter = TypeAdapter(ResponseStreamEvent)


def template(**fields) -> Response:
    return Response(id="resp_1", created_at=1700000000, model="smol", status="in_progress", output=[], **fields)


def test_text_then_function_call_events_are_numbered_and_match_the_response():
    stream = ResponseStream(template=template(tools=[WEATHER_TOOL]))
    events = stream.start() + stream.text("Let me ") + stream.text("check.")
    events += stream.function_call(call_id="call_a", name="get_weather", arguments='{"city":"Paris"}')
    events += stream.finish(reason="tool_calls", usage=usage(30, 9, 12))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        event_adapter.validate_python(event)
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []

    final = SdkResponse.model_validate(to_json(stream.response()))
    assert final.status == "completed"
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert final.output_text == deltas == "Let me check."
    call = final.output[1]
    assert (call.type, call.call_id, call.name, json.loads(call.arguments)) == (
        "function_call", "call_a", "get_weather", {"city": "Paris"},
    )  # fmt: skip
    assert events[-1]["response"] == to_json(stream.response())
    assert final.usage.input_tokens == 30 and final.usage.input_tokens_details.cached_tokens == 12
    assert final.usage.total_tokens == 39
    message_id = events[2]["item"]["id"]
    assert {e["item_id"] for e in events[3:8]} == {message_id} and message_id.startswith("msg_")


def test_length_cut_ends_incomplete():
    stream = ResponseStream(template=template(max_output_tokens=2))
    events = stream.start() + stream.text("ab") + stream.finish(reason="length", usage=usage(3, 2, 0))
    for event in events:
        event_adapter.validate_python(event)
    assert events[-1]["type"] == "response.incomplete"
    final = SdkResponse.model_validate(to_json(stream.response()))
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.output[0].status == "incomplete"


def test_engine_failure_sends_response_failed():
    stream = ResponseStream(template=template())
    events = stream.start() + stream.text("a") + stream.fail("the runner failed")
    event_adapter.validate_python(events[-1])
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"] == {"code": "server_error", "message": "the runner failed"}


def test_an_answer_with_only_a_function_call_has_no_message_item():
    stream = ResponseStream(template=template())
    stream.start()
    stream.function_call(call_id="c", name="f", arguments="{}")
    stream.finish(reason="tool_calls", usage=usage(1, 1, 0))
    assert [item.type for item in stream.response().output] == ["function_call"]
