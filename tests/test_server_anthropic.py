"""The Anthropic Messages API end to end: a real server (SmolLM2, reference backend) driven by
the official `anthropic` SDK, streaming and not, and by raw HTTP for malformed input.

The server runs with one lane, one queue slot and a short queue timeout, so the queue-full
(529) and queue-timeout (503) paths can be reached on purpose; tests that hold the lane wait
for the server to be idle again before they end. max_tokens stays tiny: every token is a CPU
forward pass of the real model. See tests/server_fixtures.py for how the server runs.
"""

from __future__ import annotations

import json
import threading
import time

import anthropic
import pytest
from server_fixtures import CITY_PARAMETERS, NO_PARAMETERS, metric_values, running_server, small_settings
from test_grammar import validate

API_KEY = "sk-ant-test"
HI = [{"role": "user", "content": "Say hi to me."}]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0.0}
WEATHER_TOOL = {"name": "get_weather", "description": "Current weather in a city", "input_schema": CITY_PARAMETERS}
TIME_TOOL = {"name": "now", "input_schema": NO_PARAMETERS}


@pytest.fixture(scope="module")
def server(smollm2):
    settings = small_settings(
        max_context=512, api_keys=(API_KEY,), max_concurrency=1, max_pending_requests=1, pending_timeout_ms=1500,
        max_request_mib=0.05,
    )  # fmt: skip
    with running_server(settings, smollm2) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.anthropic(api_key=API_KEY)


@pytest.fixture(scope="module")
def model_id(server):
    with server.http() as http:
        return http.get("/v1/models", headers={"x-api-key": API_KEY}).json()["data"][0]["id"]


def post(server, body, *, key=API_KEY, path="/v1/messages", **kwargs):
    headers = {"x-api-key": key} if key else {}
    with server.http() as http:
        return http.post(path, headers=headers, **({"json": body} if body is not None else {}), **kwargs)


def assert_anthropic_error(response, status: int, error_type: str, *words: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == error_type
    for word in words:
        assert word in body["error"]["message"]
    assert response.headers["x-request-id"]
    return body["error"]["message"]


def stream_message(client, **kwargs):
    """(streamed text, tool inputs by block index, the SDK's final message, event types)."""
    text, inputs, kinds = [], {}, []
    with client.messages.stream(**kwargs) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                text.append(event.delta.text)
            elif event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                inputs[event.index] = inputs.get(event.index, "") + event.delta.partial_json
        final = stream.get_final_message()
    return "".join(text), inputs, final, kinds


def wait_until_idle(server, timeout_s: float = 60.0) -> dict[str, float]:
    """Poll /metrics until no request runs or waits and no KV page is held by one."""
    deadline = time.monotonic() + timeout_s
    with server.http() as http:
        while True:
            values = metric_values(http.get("/metrics", headers={"x-api-key": API_KEY}).text)
            busy = values["ninfer_requests_running"] + values["ninfer_requests_waiting"] + values["ninfer_kv_pages_active"]
            if busy == 0:
                return values
            assert time.monotonic() < deadline, f"server still busy: {values}"
            time.sleep(0.05)


# --- generation ------------------------------------------------------------------------------


def test_stream_matches_non_stream_for_the_same_seeded_request(client, model_id):
    args = dict(model=model_id, max_tokens=6, messages=HI, extra_body={"temperature": 1.0, "top_k": 40, "seed": 1234})
    whole = client.messages.create(**args)
    text, _, final, kinds = stream_message(client, **args)
    assert [block.type for block in whole.content] == ["text"]
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.output_tokens == whole.usage.output_tokens == 6
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == (
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    )  # fmt: skip
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert whole.id.startswith("msg_") and whole.role == "assistant" and whole.model == model_id


def test_count_tokens_matches_the_prompt_of_a_message(client, model_id):
    system = "You are terse."
    whole = client.messages.create(model=model_id, max_tokens=1, system=system, messages=HI, extra_body=GREEDY)
    counted = client.messages.count_tokens(model=model_id, system=system, messages=HI)
    assert counted.input_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    blocks = [{"type": "text", "text": system}, {"type": "text", "text": "Answer in one word."}]
    longer = client.messages.count_tokens(model=model_id, system=blocks, messages=HI)
    assert longer.input_tokens > counted.input_tokens


def test_stop_sequence_cuts_the_answer_and_is_reported(client, model_id):
    args = dict(model=model_id, max_tokens=8, messages=QUESTION, extra_body=GREEDY)
    text = client.messages.create(**args).content[0].text
    words = text.split()
    assert len(words) >= 3, text
    stop = " " + words[2]
    cut = client.messages.create(**args, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]


def test_raw_stream_frames_every_event_with_its_name(server, model_id):
    body = {"model": model_id, "max_tokens": 2, "stream": True, "messages": HI, "temperature": 0}
    with server.http() as http:
        with http.stream("POST", "/v1/messages", json=body, headers={"x-api-key": API_KEY}) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            raw = response.read().decode()
    frames = [frame for frame in raw.split("\n\n") if frame.strip()]
    names = []
    for frame in frames:
        lines = dict(line.split(": ", 1) for line in frame.split("\n") if not line.startswith(":"))
        assert json.loads(lines["data"])["type"] == lines["event"]
        names.append(lines["event"])
    assert names[0] == "message_start" and names[1] == "ping" and names[-1] == "message_stop"
    content = [n for n in names if n.startswith("content_block")]
    assert content[0] == "content_block_start" and content[-1] == "content_block_stop"
    assert names.count("content_block_delta") >= 1 and names.count("message_delta") == 1


def test_forced_tool_use_streams_valid_input_for_a_declared_tool(client, model_id):
    # tool_choice "any" becomes a grammar: the answer must be one call of a declared tool
    # whose input matches that tool's schema. (Each forced call costs ~30 CPU forward passes,
    # so the named-tool mapping is left to the protocol tests.)
    text, inputs, final, kinds = stream_message(
        client, model=model_id, max_tokens=40, messages=[{"role": "user", "content": "What is the weather in Rome?"}],
        tools=[WEATHER_TOOL, TIME_TOOL], tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body={"seed": 5},
    )  # fmt: skip
    assert final.stop_reason == "tool_use" and text == ""
    (block,) = final.content
    schemas = {tool["name"]: tool["input_schema"] for tool in (WEATHER_TOOL, TIME_TOOL)}
    assert block.type == "tool_use" and block.name in schemas and block.id
    validate(block.input, schemas[block.name])
    assert json.loads(inputs[0]) == block.input
    assert kinds.count("content_block_start") == 1


def test_tool_results_in_the_history_reach_the_prompt(client, model_id):
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
    ]  # fmt: skip
    result = [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Sunny and 21 C"}]}]
    base = client.messages.count_tokens(model=model_id, messages=[*history, {"role": "user", "content": "Thanks"}], tools=[WEATHER_TOOL])
    longer = client.messages.count_tokens(model=model_id, messages=[*history, {"role": "user", "content": result}], tools=[WEATHER_TOOL])
    assert longer.input_tokens > base.input_tokens
    answer = client.messages.create(
        model=model_id, max_tokens=2, messages=[*history, {"role": "user", "content": result}], tools=[WEATHER_TOOL],
        extra_body=GREEDY,
    )  # fmt: skip
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == longer.input_tokens


def test_a_tool_use_block_as_the_sdk_dumps_it_goes_back_in_the_next_turn(client, model_id):
    # anthropic 2.16's ToolUseBlock.model_dump() carries caller and toolset_name (None here).
    question = [{"role": "user", "content": "What is the weather in Rome?"}]
    first = client.messages.create(
        model=model_id, max_tokens=40, messages=question, tools=[WEATHER_TOOL],
        tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"seed": 5},
    )  # fmt: skip
    (block,) = first.content
    assert block.type == "tool_use" and block.id.startswith("toolu_")
    dumped = block.model_dump()
    assert {"caller", "toolset_name"} <= dumped.keys()
    history = [*question, {"role": "assistant", "content": [dumped]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "Sunny, 21 C"}]}]  # fmt: skip
    answer = client.messages.create(model=model_id, max_tokens=2, messages=history, tools=[WEATHER_TOOL], extra_body=GREEDY)
    assert answer.usage.output_tokens >= 1 and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    counted = client.messages.count_tokens(model=model_id, messages=history, tools=[WEATHER_TOOL])
    assert counted.input_tokens == answer.usage.input_tokens + answer.usage.cache_read_input_tokens


# --- errors ----------------------------------------------------------------------------------


def test_authentication_is_required(server, model_id):
    body = {"model": model_id, "max_tokens": 1, "messages": HI}
    assert_anthropic_error(post(server, body, key=None), 401, "authentication_error", "API key")
    assert_anthropic_error(post(server, body, key="wrong"), 401, "authentication_error")
    with pytest.raises(anthropic.AuthenticationError):
        server.anthropic(api_key="wrong").messages.count_tokens(model=model_id, messages=HI)


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"max_tokens": "8"}, ["max_tokens", "integer"]),
        ({"max_tokens": 0}, ["max_tokens", "at least 1"]),
        ({"temperature": 3}, ["temperature", "between"]),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}]}]},
         ["messages.0.content.0", "image"]),
        ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, ["unknown content block type 'video'"]),
        ({"tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "tool", "name": "g"}},
         ["tool_choice.name"]),
        ({"extra": True}, ["unknown field", "extra"]),
        ({"stop_sequences": ["#"] * 17}, ["stop_sequences", "at most 16"]),
        ({"stop_sequences": ["###", ""]}, ["stop_sequences.1", "must not be empty"]),
        ({"messages": [*HI, {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f",
                                                               "input": {}, "bogus": None}]}, *HI]},
         ["messages.1.content.0", "unknown field", "bogus"]),
    ],
)  # fmt: skip
def test_malformed_requests_are_400_with_the_field(server, model_id, body, words):
    full = {"model": model_id, "max_tokens": 4, "messages": HI, **body}
    assert_anthropic_error(post(server, full), 400, "invalid_request_error", *words)


def test_invalid_json_and_a_missing_field_are_400(server, model_id):
    with server.http() as http:
        bad = http.post("/v1/messages", content=b'{"model": ', headers={"x-api-key": API_KEY, "content-type": "application/json"})
    assert_anthropic_error(bad, 400, "invalid_request_error", "not valid JSON")
    assert_anthropic_error(post(server, {"model": model_id, "messages": HI}), 400, "invalid_request_error", "max_tokens")
    assert_anthropic_error(post(server, [1, 2]), 400, "invalid_request_error", "JSON object")


def test_unknown_model_and_route_are_404(server, client):
    assert_anthropic_error(post(server, {"model": "claude-nope", "max_tokens": 1, "messages": HI}), 404, "not_found_error", "claude-nope")
    assert_anthropic_error(post(server, {}, path="/v1/messages/nope"), 404, "not_found_error")
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nope", max_tokens=1, messages=HI)


def test_body_over_the_limit_is_413(server, model_id):
    huge = {"model": model_id, "max_tokens": 1, "messages": [{"role": "user", "content": "x" * 100_000}]}
    assert_anthropic_error(post(server, huge), 413, "request_too_large")


def test_full_queue_is_529_queue_timeout_is_503_and_a_disconnect_frees_the_lane(server, client, model_id):
    story = [{"role": "user", "content": "Write a long story about a dragon."}]
    long_answer = dict(model=model_id, max_tokens=200, messages=story, extra_body=GREEDY)
    short_body = {"model": model_id, "max_tokens": 1, "messages": story}
    before = wait_until_idle(server)
    waiting_result = {}
    with client.messages.stream(**long_answer) as holder:
        for event in holder:  # the one lane is busy once the first token arrives
            if event.type == "content_block_delta":
                break

        def wait_in_queue():
            waiting_result["response"] = post(server, short_body)

        waiter = threading.Thread(target=wait_in_queue)
        waiter.start()
        with server.http() as http:
            deadline = time.monotonic() + 30
            while metric_values(http.get("/metrics", headers={"x-api-key": API_KEY}).text)["ninfer_requests_waiting"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.02)
        overloaded = post(server, short_body)
        assert_anthropic_error(overloaded, 529, "overloaded_error")
        with pytest.raises(anthropic.APIStatusError) as info:
            client.messages.create(**short_body)
        assert info.value.status_code == 529
        waiter.join(timeout=60)
        assert_anthropic_error(waiting_result["response"], 503, "overloaded_error")
    # Leaving the stream closed the connection mid-answer: the request is cancelled.
    after = wait_until_idle(server)
    cancelled = 'ninfer_requests_total{outcome=cancelled}'
    assert after[cancelled] == before.get(cancelled, 0) + 1
