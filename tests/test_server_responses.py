"""The OpenAI Responses API end to end: a real server (SmolLM2, reference backend) driven by
the official `openai` SDK (`client.responses`), streaming and not, and by raw HTTP for
malformed input; plus the bounded response store on its own.

The server runs with one lane and one queue slot so the queue-full (429) path can be reached
on purpose. max_tokens stays tiny: every token is a CPU forward pass of the real model.
"""

from __future__ import annotations

import json
import time

import openai
import pytest
from server_fixtures import CITY_PARAMETERS, metric_values, running_server, small_settings
from test_grammar import validate

from ninfer.protocols.responses_events import Response as WireResponse
from ninfer.server.responses_store import ResponsesStore, StoredResponse, StoreStatistics

API_KEY = "sk-test"
GREEDY = {"temperature": 0.0}
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": CITY_PARAMETERS,
    "strict": True,
}


@pytest.fixture(scope="module")
def server(smollm2):
    settings = small_settings(max_context=512, api_keys=(API_KEY,), max_concurrency=1, max_pending_requests=1)
    with running_server(settings, smollm2) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.openai(api_key=API_KEY)


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


def raw(server, method: str, path: str, body=None, *, key=API_KEY, **kwargs):
    headers = {"authorization": f"Bearer {key}"} if key else {}
    with server.http() as http:
        return http.request(method, path, headers=headers, **({"json": body} if body is not None else {}), **kwargs)


def assert_openai_error(response, status: int, *words: str, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"]
    if param is not None:
        assert error["param"] == param
    assert response.headers["x-request-id"]
    return error


def stream_response(client, **kwargs):
    """(every event as a dict, the final Response) of a streamed request."""
    events = []
    with client.responses.stream(**kwargs) as stream:
        for event in stream:
            events.append(event.model_dump())
        final = stream.get_final_response() if events[-1]["type"] == "response.completed" else None
    return events, final


# --- generation ------------------------------------------------------------------------------


def test_stream_matches_non_stream_and_the_stored_response(client, model_id):
    args = dict(model=model_id, input="Say hi to me.", instructions="Be cheerful.", max_output_tokens=6,
                temperature=1.0, top_p=0.9, extra_body={"seed": 77})  # fmt: skip
    whole = client.responses.create(**args)
    events = []
    with client.responses.create(**args, stream=True) as stream:
        events = [event.model_dump() for event in stream]
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"  # cut by max_output_tokens
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == whole.output_text and whole.output_text
    (done,) = [e for e in events if e["type"] == "response.output_text.done"]
    assert done["text"] == deltas
    final = events[-1]["response"]
    assert final["status"] == whole.status == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["usage"]["output_tokens"] == whole.usage.output_tokens == 6
    assert final["usage"]["input_tokens"] == whole.usage.input_tokens
    assert whole.instructions == "Be cheerful." and whole.max_output_tokens == 6 and whole.model == model_id

    stored = client.responses.retrieve(whole.id)
    assert stored.model_dump() == whole.model_dump()
    assert client.responses.retrieve(final["id"]).output_text == deltas


def test_previous_response_id_continues_the_conversation_without_old_instructions(client, model_id):
    first = client.responses.create(model=model_id, input="Name a color.", instructions="Answer in one word.",
                                    max_output_tokens=3, **GREEDY)  # fmt: skip
    follow_up = client.responses.create(model=model_id, previous_response_id=first.id, input="Another one?",
                                        max_output_tokens=1, **GREEDY)  # fmt: skip
    assert follow_up.previous_response_id == first.id
    explicit = client.responses.create(
        model=model_id, max_output_tokens=1, **GREEDY,
        input=[
            {"role": "user", "content": "Name a color."},
            {"role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
            {"role": "user", "content": "Another one?"},
        ],
    )  # fmt: skip
    # The same prompt token for token: the history is the first turn's input and output, and
    # the first turn's instructions are not carried over (OpenAI's rule).
    assert follow_up.usage.input_tokens == explicit.usage.input_tokens
    assert follow_up.output_text == explicit.output_text


def test_logprobs_are_included_on_request(client, model_id):
    result = client.responses.create(model=model_id, input="What is the capital of France?", max_output_tokens=3,
                                     include=["message.output_text.logprobs"], top_logprobs=2, **GREEDY)  # fmt: skip
    part = result.output[0].content[0]
    assert len(part.logprobs) == result.usage.output_tokens == 3
    assert "".join(lp.token for lp in part.logprobs) == part.text
    for entry in part.logprobs:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy takes the top token


def test_required_function_call_streams_and_its_output_round_trips(client, model_id):
    args = dict(model=model_id, input="What is the weather in Paris?", tools=[WEATHER_TOOL], tool_choice="required",
                parallel_tool_calls=False, max_output_tokens=40, **GREEDY)  # fmt: skip
    events, final = stream_response(client, **args)
    kinds = [e["type"] for e in events]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    (call,) = [item for item in final.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    validate(json.loads(call.arguments), WEATHER_TOOL["parameters"])
    (arguments_done,) = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert arguments_done["arguments"] == call.arguments and arguments_done["item_id"] == call.id

    answer = client.responses.create(
        model=model_id, previous_response_id=final.id, tools=[WEATHER_TOOL], max_output_tokens=1, **GREEDY,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}],
    )  # fmt: skip
    assert answer.status in ("completed", "incomplete")
    assert answer.usage.input_tokens > final.usage.input_tokens + final.usage.output_tokens


# --- the store over HTTP ---------------------------------------------------------------------


def test_get_and_delete_and_store_false(server, client, model_id):
    kept = client.responses.create(model=model_id, input="Hi", max_output_tokens=1, **GREEDY)
    assert client.responses.retrieve(kept.id).id == kept.id
    deleted = raw(server, "DELETE", f"/v1/responses/{kept.id}")
    assert deleted.status_code == 200 and deleted.json() == {"id": kept.id, "object": "response", "deleted": True}
    assert_openai_error(raw(server, "GET", f"/v1/responses/{kept.id}"), 404, kept.id)
    assert_openai_error(raw(server, "DELETE", f"/v1/responses/{kept.id}"), 404, kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)

    unstored = client.responses.create(model=model_id, input="Hi", max_output_tokens=1, store=False, **GREEDY)
    assert unstored.store is False
    assert_openai_error(raw(server, "GET", f"/v1/responses/{unstored.id}"), 404)
    gone = {"model": model_id, "input": "Hi", "previous_response_id": unstored.id}
    assert_openai_error(raw(server, "POST", "/v1/responses", gone), 400, unstored.id, param="previous_response_id")


# --- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": 3}, "input", ["string or an array"]),
        ({"max_output_tokens": "5"}, "max_output_tokens", ["integer"]),
        ({"temperature": 9}, "temperature", ["between"]),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
         "input.0.content.0.type", ["input_image"]),
        ({"tools": [{"type": "web_search"}]}, "tools.0", ["web_search"]),
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER_TOOL]}, "tool_choice.name", ["nope"]),
        ({"bogus": 1}, None, ["bogus"]),
    ],
)  # fmt: skip
def test_malformed_requests_are_400_with_the_field(server, model_id, body, param, words):
    error = assert_openai_error(raw(server, "POST", "/v1/responses", {"model": model_id, "input": "Hi", **body}), 400, *words)
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_invalid_json_unknown_model_and_missing_key(server, client, model_id):
    with server.http() as http:
        bad = http.post("/v1/responses", content=b"{nope", headers={"authorization": f"Bearer {API_KEY}", "content-type": "application/json"})
    assert_openai_error(bad, 400, "not valid JSON")
    error = assert_openai_error(raw(server, "POST", "/v1/responses", {"model": "gpt-nope", "input": "Hi"}), 404, "gpt-nope")
    assert error["code"] == "model_not_found"
    error = assert_openai_error(raw(server, "POST", "/v1/responses", {"model": model_id, "input": "Hi"}, key=None), 401)
    assert error["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        server.openai(api_key="wrong").responses.create(model=model_id, input="Hi", max_output_tokens=1)


def test_full_queue_is_429_and_a_disconnect_mid_stream_frees_the_pages(server, client, model_id):
    with server.http() as http:
        metrics = lambda: metric_values(http.get("/metrics", headers={"authorization": f"Bearer {API_KEY}"}).text)  # noqa: E731
        with client.responses.create(model=model_id, input="Write a long story about a dragon.", stream=True,
                                     max_output_tokens=200, **GREEDY) as holder:  # fmt: skip
            for event in holder:  # the lane is busy once text flows
                if event.type == "response.output_text.delta":
                    break
            with http.stream("POST", "/v1/responses", json={"model": model_id, "input": "Hi", "stream": True},
                             headers={"authorization": f"Bearer {API_KEY}"}) as queued:  # fmt: skip
                assert queued.status_code == 200  # answered after the first keep-alive: it waits
                assert metrics()["ninfer_requests_waiting"] == 1
                refused = raw(server, "POST", "/v1/responses", {"model": model_id, "input": "Hi"})
                error = assert_openai_error(refused, 429)
                assert error["type"] == "rate_limit_error"
        deadline = time.monotonic() + 60
        while (values := metrics())["ninfer_requests_running"] + values["ninfer_kv_pages_active"] > 0:
            assert time.monotonic() < deadline, values
            time.sleep(0.05)


# --- the store (no server) -------------------------------------------------------------------


def stored(response_id: str) -> StoredResponse:
    response = WireResponse(id=response_id, created_at=0, model="m", status="completed", output=[])
    return StoredResponse(response, ({"role": "user", "content": response_id},))


def test_store_evicts_the_least_recently_used():
    store = ResponsesStore(max_responses=2)
    store.put(stored("a"))
    store.put(stored("b"))
    assert store.get("a").conversation == ({"role": "user", "content": "a"},)  # a is now the newest
    store.put(stored("c"))
    assert "b" not in store and "a" in store and "c" in store
    assert store.statistics() == StoreStatistics(num_responses=2, max_responses=2, num_evicted=1)


def test_store_delete_and_bounds():
    store = ResponsesStore(max_responses=1)
    store.put(stored("a"))
    assert store.delete("a") and not store.delete("a") and store.get("a") is None
    with pytest.raises(ValueError, match="at least 1"):
        ResponsesStore(max_responses=0)
