"""The OpenAI APIs end to end: a real server (SmolLM2 on the reference backend) and the official
`openai` SDK, streaming and not. See tests/server_fixtures.py for how the server runs.

max_tokens stays tiny: every generated token is a CPU forward pass of the real model.
"""

from __future__ import annotations

import json

import openai
import pytest
from server_fixtures import CITY_PARAMETERS, NO_PARAMETERS, running_server, small_settings
from test_grammar import validate

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}
WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": CITY_PARAMETERS},
}
TIME_TOOL = {"type": "function", "function": {"name": "now", "parameters": NO_PARAMETERS}}


@pytest.fixture(scope="module")
def server(smollm2):
    with running_server(small_settings(max_context=512), smollm2) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


def stream_chat(client, **kwargs):
    """(text, tool call dicts by index, finish_reason, usage, logprob tokens) of a streamed answer."""
    text, calls, finish, usage, tokens = [], {}, None, None, []
    with client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs) as stream:
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                text.append(choice.delta.content or "")
                for call in choice.delta.tool_calls or ():
                    entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                    entry["id"] = entry["id"] or call.id
                    entry["name"] += call.function.name or ""
                    entry["arguments"] += call.function.arguments or ""
                if choice.logprobs is not None:
                    tokens += [t.token for t in choice.logprobs.content]
                finish = choice.finish_reason or finish
    return "".join(text), calls, finish, usage, tokens


def test_models_list_and_retrieve(client, model_id, smollm2):
    assert model_id == smollm2.name
    card = client.models.retrieve(model_id)
    assert card.id == model_id and card.owned_by == "ninfer"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_stream_matches_non_stream_for_the_same_seeded_request(client, model_id):
    args = dict(model=model_id, messages=QUESTION, max_tokens=6, temperature=0.8, seed=1234, logprobs=True)
    whole = client.chat.completions.create(**args)
    text, calls, finish, usage, tokens = stream_chat(client, **args)
    choice = whole.choices[0]
    assert text == choice.message.content and text
    assert tokens == [t.token for t in choice.logprobs.content]
    assert "".join(tokens) == text or finish == "stop"  # the stop token adds no text
    assert finish == choice.finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens > 0
    assert 0 <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens  # the prefix cache may serve some
    assert calls == {}


def test_max_tokens_gives_length_and_counts(client, model_id):
    result = client.chat.completions.create(model=model_id, messages=QUESTION, max_completion_tokens=3, **GREEDY)
    assert result.choices[0].finish_reason == "length"
    assert result.usage.completion_tokens == 3
    assert result.usage.total_tokens == result.usage.prompt_tokens + 3
    assert result.id.startswith("chatcmpl-") and result.object == "chat.completion"


def test_stop_string_cuts_the_answer(client, model_id):
    full = client.chat.completions.create(model=model_id, messages=QUESTION, max_tokens=6, **GREEDY)
    text = full.choices[0].message.content
    words = text.split()
    assert len(words) >= 2, text
    stop = " " + words[1]
    cut = client.chat.completions.create(model=model_id, messages=QUESTION, max_tokens=6, stop=[stop], **GREEDY)
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.index(stop)]


def test_greedy_logprobs_pick_the_top_token(client, model_id):
    result = client.chat.completions.create(model=model_id, messages=QUESTION, max_tokens=3, logprobs=True,
                                            top_logprobs=3, **GREEDY)  # fmt: skip
    content = result.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.logprob <= 0
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token or "\ufffd" in entry.token


def test_json_schema_response_parses_and_validates(client, model_id):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
              "capital": {"type": "boolean"}}, "required": ["city", "capital"], "additionalProperties": False}  # fmt: skip
    result = client.chat.completions.create(
        model=model_id, messages=QUESTION, max_tokens=24, seed=7,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    )  # fmt: skip
    assert result.choices[0].finish_reason == "stop"
    validate(json.loads(result.choices[0].message.content), schema)


def test_json_object_response_is_an_object(client, model_id):
    result = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Reply with an empty JSON object."}],
        max_tokens=16, response_format={"type": "json_object"}, **GREEDY,
    )  # fmt: skip
    if result.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(result.choices[0].message.content), dict)
    else:  # a length cut leaves a JSON prefix: still an object being written
        assert result.choices[0].message.content.startswith("{")


def test_required_tool_call_is_a_declared_tool_with_valid_arguments(client, model_id):
    result = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "What is the weather in Rome?"}],
        tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required", parallel_tool_calls=False, max_tokens=40, seed=3,
    )  # fmt: skip
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER_TOOL, TIME_TOOL)}
    validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_named_tool_choice_streams_the_call_as_deltas(client, model_id):
    args = dict(model=model_id, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER_TOOL, TIME_TOOL],
                tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=40, **GREEDY)  # fmt: skip
    text, calls, finish, usage, _ = stream_chat(client, **args)
    assert finish == "tool_calls" and text == ""
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    validate(json.loads(calls[0]["arguments"]), WEATHER_TOOL["function"]["parameters"])
    whole = client.chat.completions.create(**args).choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in whole] == [(calls[0]["name"], calls[0]["arguments"])]


def test_tool_results_in_the_history_are_accepted(client, model_id):
    messages = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "developer", "content": [{"type": "text", "text": "Use tools when useful."}]},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    ]  # fmt: skip
    result = client.chat.completions.create(model=model_id, messages=messages, tools=[WEATHER_TOOL], max_tokens=2, **GREEDY)
    assert result.usage.completion_tokens >= 1
    assert result.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_seeded_sampling_is_reproducible(client, model_id):
    args = dict(model=model_id, messages=QUESTION, max_tokens=4, temperature=1.0, top_p=0.9, seed=99)
    first = client.chat.completions.create(**args).choices[0].message.content
    assert client.chat.completions.create(**args).choices[0].message.content == first


def test_completions_text_and_token_prompts_agree(server, client, model_id):
    prompt = "The capital of France is"
    with server.http() as http:
        ids = http.post("/v1/tokenize", json={"prompt": prompt, "add_special_tokens": False}).json()["tokens"]
    by_text = client.completions.create(model=model_id, prompt=prompt, max_tokens=3, **GREEDY)
    by_ids = client.completions.create(model=model_id, prompt=ids, max_tokens=3, **GREEDY)
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert by_text.usage.prompt_tokens == by_ids.usage.prompt_tokens
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model_id, prompt=prompt, max_tokens=3, stream=True, **GREEDY) if c.choices)  # fmt: skip
    assert streamed == by_text.choices[0].text


def test_completions_echo_and_logprobs(client, model_id):
    prompt = "One, two, three,"
    echoed = client.completions.create(model=model_id, prompt=prompt, max_tokens=2, echo=True, **GREEDY)
    plain = client.completions.create(model=model_id, prompt=prompt, max_tokens=2, logprobs=2, **GREEDY)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    logprobs = plain.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 2
    assert "".join(logprobs.tokens) == plain.choices[0].text
    assert logprobs.text_offset == [0, len(logprobs.tokens[0])]
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(lp)
               for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs))  # fmt: skip


def test_tokenize_detokenize_and_chat_prompt_count(server, client, model_id):
    with server.http() as http:
        tokens = http.post("/v1/tokenize", json={"model": model_id, "prompt": "héllo wörld 123"}).json()
        assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 512
        back = http.post("/v1/detokenize", json={"model": model_id, "tokens": tokens["tokens"]}).json()
        assert back["prompt"] == "héllo wörld 123"
        chat = http.post("/v1/tokenize", json={"messages": QUESTION}).json()
    usage = client.chat.completions.create(model=model_id, messages=QUESTION, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens


def test_request_ids(server):
    with server.http() as http:
        generated = http.get("/v1/models").headers["x-request-id"]
        assert generated.startswith("req_")
        assert http.get("/v1/models", headers={"x-request-id": "my-trace-42"}).headers["x-request-id"] == "my-trace-42"
        assert http.get("/nope").headers["x-request-id"]
