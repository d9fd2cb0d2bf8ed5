"""Forced tool calls on all three APIs (Chat Completions, Anthropic Messages, Responses): a real
server (SmolLM2, reference backend) driven by the official `openai` and `anthropic` SDKs.

An answer cut by max_tokens inside a tool call must never show the half-written
`<tool_call>` block as text, and a forced call against an open parameters schema must write
only the declared keys. Seeds are fixed: the server's sampler gives the same answer for the same
seed and parameters, so each request below takes the same path on every run. See
tests/server_fixtures.py for how the server runs.
"""

from __future__ import annotations

import json

import pytest
from server_fixtures import CITY_PARAMETERS, running_server, small_settings

TWO_CITIES = "What is the weather in Paris and in Rome?"
DESCRIPTION = "Current weather in a city"
# Seed 2 answers TWO_CITIES with two calls of ~30 tokens each: Paris, then Rome. 45 tokens cut
# the answer inside the second call (after a first call the grammar allows only another call
# or the end, so `length` after one whole call means the second was being written).
CUT_SEED, CUT_AT = 2, 45
OPEN_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}}  # no additionalProperties


@pytest.fixture(scope="module")
def server(smollm2):
    with running_server(small_settings(max_context=512), smollm2) as s:
        yield s


@pytest.fixture(scope="module")
def model_id(server):
    return server.openai().models.list().data[0].id


def compact(arguments: str) -> str:
    return json.dumps(json.loads(arguments), separators=(",", ":"), ensure_ascii=False)


def chat_tool(parameters):
    return {"type": "function", "function": {"name": "get_weather", "description": DESCRIPTION, "parameters": parameters}}


def cut_chat(server, model_id, stream: bool, max_tokens: int = CUT_AT):
    """(text, [(call id, name, arguments)], finish reason) of the cut chat answer."""
    args = dict(model=model_id, messages=[{"role": "user", "content": TWO_CITIES}], tools=[chat_tool(CITY_PARAMETERS)],
                tool_choice="required", max_tokens=max_tokens, seed=CUT_SEED)  # fmt: skip
    client = server.openai()
    if not stream:
        choice = client.chat.completions.create(**args).choices[0]
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
        return choice.message.content or "", calls, choice.finish_reason
    text, calls, finish = [], {}, None
    with client.chat.completions.create(stream=True, **args) as chunks:
        for chunk in chunks:
            for choice in chunk.choices:
                text.append(choice.delta.content or "")
                for call in choice.delta.tool_calls or ():
                    entry = calls.setdefault(call.index, ["", "", ""])
                    entry[0] += call.id or ""
                    entry[1] += call.function.name or ""
                    entry[2] += call.function.arguments or ""
                finish = choice.finish_reason or finish
    return "".join(text), [tuple(calls[i]) for i in sorted(calls)], finish


def cut_anthropic(server, model_id, stream: bool, max_tokens: int = CUT_AT):
    args = dict(model=model_id, max_tokens=max_tokens, messages=[{"role": "user", "content": TWO_CITIES}],
                tools=[{"name": "get_weather", "description": DESCRIPTION, "input_schema": CITY_PARAMETERS}],
                tool_choice={"type": "any"}, extra_body={"seed": CUT_SEED})  # fmt: skip
    client = server.anthropic()
    if stream:
        deltas = []
        with client.messages.stream(**args) as events:
            for event in events:
                if event.type == "content_block_delta" and event.delta.type == "text_delta":
                    deltas.append(event.delta.text)
            message = events.get_final_message()
        assert "".join(deltas) == "".join(b.text for b in message.content if b.type == "text")
    else:
        message = client.messages.create(**args)
    text = "".join(b.text for b in message.content if b.type == "text")
    calls = [(b.id, b.name, json.dumps(b.input)) for b in message.content if b.type == "tool_use"]
    return text, calls, message.stop_reason


def cut_responses(server, model_id, stream: bool, max_tokens: int = CUT_AT):
    args = dict(model=model_id, input=TWO_CITIES, tool_choice="required", max_output_tokens=max_tokens,
                tools=[{"type": "function", "name": "get_weather", "description": DESCRIPTION, "parameters": CITY_PARAMETERS}],
                extra_body={"seed": CUT_SEED})  # fmt: skip
    client = server.openai()
    if stream:
        deltas, response = [], None
        with client.responses.stream(**args) as events:
            for event in events:
                if event.type == "response.output_text.delta":
                    deltas.append(event.delta)
                elif event.type in ("response.completed", "response.incomplete"):
                    response = event.response
        assert "".join(deltas) == response.output_text
    else:
        response = client.responses.create(**args)
    calls = [(o.call_id, o.name, o.arguments) for o in response.output if o.type == "function_call"]
    return response.output_text, calls, response.status


CUT = {"chat": (cut_chat, "length", "call_"), "anthropic": (cut_anthropic, "max_tokens", "toolu_"),
       "responses": (cut_responses, "incomplete", "call_")}  # fmt: skip


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("api", sorted(CUT))
def test_a_second_call_cut_by_max_tokens_never_reaches_the_client_as_text(server, model_id, api, stream):
    run, cut_reason, id_prefix = CUT[api]
    text, calls, finish = run(server, model_id, stream)
    assert finish == cut_reason
    assert text == "", f"the unfinished call leaked as text: {text!r}"
    ((call_id, name, arguments),) = calls  # the first call, whole; the cut second one dropped
    assert call_id.startswith(id_prefix) and name == "get_weather"
    assert json.loads(arguments) == {"city": "Paris"}
    if api != "anthropic":  # Anthropic's input is an object, not text
        assert arguments == compact(arguments) == '{"city":"Paris"}'


@pytest.mark.parametrize("api", sorted(CUT))
def test_a_start_tag_cut_by_max_tokens_never_reaches_the_client_as_text(server, model_id, api):
    # Two tokens of a forced call are "<tool": the start of a call, not text.
    run, cut_reason, _ = CUT[api]
    assert run(server, model_id, True, max_tokens=2) == ("", [], cut_reason)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_forced_call_against_an_open_schema_writes_only_declared_keys(server, model_id, seed):
    # Open, seed 0 wrote {"city": "Paris", "": [...]} and seed 1 {"location": "Paris"}.
    tool = chat_tool(OPEN_PARAMETERS)
    sent = json.dumps(tool)
    result = server.openai().chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=[tool],
        tool_choice="required", parallel_tool_calls=False, max_tokens=120, seed=seed,
    )  # fmt: skip
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls" and result.usage.completion_tokens < 120
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments).keys() <= {"city"}
    assert json.dumps(tool) == sent


def test_a_named_anthropic_tool_with_an_open_schema_writes_only_declared_keys(server, model_id):
    tool = {"name": "get_weather", "description": DESCRIPTION, "input_schema": OPEN_PARAMETERS}
    message = server.anthropic().messages.create(
        model=model_id, max_tokens=120, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[tool], tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"seed": 0},
    )  # fmt: skip
    assert message.stop_reason == "tool_use" and message.usage.output_tokens < 120
    (block,) = message.content
    assert block.type == "tool_use" and block.id.startswith("toolu_") and block.input.keys() <= {"city"}
