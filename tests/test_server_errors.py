"""Every error status and shape, over raw HTTP (and the SDKs where they map statuses).

Two real servers: one with an API key, a 10 KiB body limit, CORS, one lane and a one-slot
queue (for 401 / 413 / 429 / 503), and one whose runner fails on demand (500, then 503 and an
unhealthy /health).
"""

from __future__ import annotations

import json
import threading

import openai
import pytest
from server_fixtures import metric_values, running_server, small_settings

KEY = "sk-test-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def server(smollm2):
    settings = small_settings(
        max_context=512, api_keys=(KEY,), max_request_mib=10 / 1024, cors_origins=(ORIGIN,), max_concurrency=1,
        max_pending_requests=1, pending_timeout_ms=3000, keepalive_s=1.0, model_id="SmolLM2-135M-Instruct",
    )  # fmt: skip
    with running_server(settings, smollm2) as s:
        yield s


@pytest.fixture
def http(server):
    with server.http(headers=AUTH) as client:
        yield client


def openai_error(response, status: int, *, param=..., code=...) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if param is not ...:
        assert body["error"]["param"] == param, body
    if code is not ...:
        assert body["error"]["code"] == code, body
    return body["error"]


def anthropic_error(response, status: int, type_: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == type_ and body["error"]["message"]
    return body["error"]


def detail_error(response, status: int) -> str:
    """System One's errors: FastAPI's `{"detail": "..."}`."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"detail"} and isinstance(body["detail"], str) and body["detail"], body
    return body["detail"]


SYSTEMONE = {"model": "any", "state": "The door is open.", "questions": {"q": {"type": "noul", "question": "Is it open?"}}}
SCORE = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Pick one."}],
         "questions": [{"id": "a", "content": "Yes or no?", "candidates": ["Yes", "No"]}]}  # fmt: skip


# ---- 400 -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, param",
    [
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 5}, "temperature"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
        ({"n": 2}, "n"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": 7}, "stop"),
        ({"messages": "hello"}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages.0.content.0"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}},
         "tool_choice"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
         "response_format.json_schema.schema"),
        ({"max_tokens": 100000}, "messages"),
    ],
)  # fmt: skip
def test_field_errors_name_the_field(http, change, param):
    openai_error(http.post("/v1/chat/completions", json={**CHAT, **change}), 400, param=param)


def test_specific_codes(http):
    too_long = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 100000})
    assert openai_error(too_long, 400)["code"] == "context_length_exceeded"
    bad_schema = {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}}
    assert "not" in openai_error(http.post("/v1/chat/completions", json=bad_schema), 400, code="unsupported_schema")["message"]


def test_unknown_field_is_named(http):
    error = openai_error(http.post("/v1/chat/completions", json={**CHAT, "frobnicate": 1}), 400)
    assert "frobnicate" in error["message"]


def test_missing_field(http):
    error = openai_error(http.post("/v1/chat/completions", json={"model": "m"}), 400, param="messages")
    assert "missing" in error["message"]


@pytest.mark.parametrize("body", [b"{not json", b"", b"[1, 2]", b'"text"', b"\xff\xfe"])
def test_bodies_that_are_not_a_json_object(http, body):
    response = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    openai_error(response, 400)


def test_completions_errors(http):
    base = {"model": "SmolLM2-135M-Instruct", "prompt": "Hi", "max_tokens": 1}
    openai_error(http.post("/v1/completions", json={**base, "echo": True, "logprobs": 1}), 400, param="echo")
    openai_error(http.post("/v1/completions", json={**base, "prompt": [1, 10**9]}), 400, param="prompt.1")
    openai_error(http.post("/v1/completions", json={**base, "prompt": ["a", "b"]}), 400, param="prompt")
    openai_error(http.post("/v1/completions", json={**base, "suffix": "x"}), 400, param="suffix")


def test_tokenize_errors(http):
    openai_error(http.post("/v1/tokenize", json={}), 400, param="prompt")
    openai_error(http.post("/v1/detokenize", json={"tokens": [-1]}), 400, param="tokens.0")
    openai_error(http.post("/v1/detokenize", json={"tokens": "abc"}), 400, param="tokens")


# ---- 401 / 404 / 405 / 413 ---------------------------------------------------------------


def test_api_key_is_required_except_for_health(server):
    with server.http() as http:
        assert http.get("/health").status_code == 200
        openai_error(http.get("/v1/models"), 401, code="invalid_api_key")
        openai_error(http.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        openai_error(http.get("/metrics"), 401)
        anthropic_error(http.post("/v1/messages", json={}), 401, "authentication_error")
        assert http.get("/v1/models", headers=AUTH).status_code == 200
        assert http.get("/v1/models", headers={"x-api-key": KEY}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        server.openai(api_key="wrong").models.list()
    assert server.openai(api_key=KEY).models.list().data[0].id == "SmolLM2-135M-Instruct"


def test_not_found_routes_and_models(http):
    openai_error(http.get("/v1/nope"), 404, code="unknown_url")
    anthropic_error(http.post("/v1/messages/nope", json={}), 404, "not_found_error")
    openai_error(http.get("/v1/models/other-model"), 404, code="model_not_found")
    openai_error(http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4"}), 404, param="model")
    openai_error(http.get("/v1/chat/completions"), 405)


JSON_TYPE = {"content-type": "application/json"}


def test_body_over_the_limit_is_refused_before_parsing(http):
    junk = b"{" + b"x" * 20_000  # not JSON: a 400 would mean it was parsed
    openai_error(http.post("/v1/chat/completions", content=junk, headers=JSON_TYPE), 413)
    anthropic_error(http.post("/v1/messages", content=junk, headers=JSON_TYPE), 413, "request_too_large")

    def chunks():  # no Content-Length: the limit applies while reading
        for _ in range(20):
            yield b"x" * 1000

    # Every route that reads a body, in its own shape (the framework's error was a 500 on some).
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/tokenize", "/v1/detokenize", "/v1/responses"):
        openai_error(http.post(path, content=chunks(), headers=JSON_TYPE), 413, code="request_too_large")
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        anthropic_error(http.post(path, content=chunks(), headers=JSON_TYPE), 413, "request_too_large")
    assert http.get("/health").json() == {"status": "ok"}


def test_cors(server):
    with server.http() as http:
        preflight = http.options("/v1/chat/completions", headers={
            "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})  # fmt: skip
        assert preflight.status_code == 204
        assert preflight.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in preflight.headers["access-control-allow-methods"]
        assert "authorization" in preflight.headers["access-control-allow-headers"]
        allowed = http.get("/v1/models", headers={**AUTH, "Origin": ORIGIN})
        assert allowed.headers["access-control-allow-origin"] == ORIGIN
        other = http.get("/v1/models", headers={**AUTH, "Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers


# ---- 429 / 529 / 503 ------------------------------------------------------------------------

# A grammar that cannot end before 400 characters: the lane stays busy until we hang up.
LONG = {**CHAT, "max_tokens": 400, "stream": True, "response_format": {"type": "json_schema", "json_schema": {
    "name": "long", "schema": {"type": "object", "properties": {"s": {"type": "string", "minLength": 400}}, "required": ["s"]}}}}  # fmt: skip


def wait_for_metric(http, name: str, value: float, timeout_s: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if metric_values(http.get("/metrics").text).get(name) == value:
            return
        time.sleep(0.05)
    raise AssertionError(f"{name} never reached {value}")


def test_full_queue_is_429_and_529_and_a_timed_out_wait_is_503(server, http):
    with http.stream("POST", "/v1/chat/completions", json=LONG) as busy:
        assert busy.status_code == 200
        lines = busy.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # the only lane is running
        waiting: dict = {}
        thread = threading.Thread(target=lambda: waiting.update(r=server.http(headers=AUTH).post("/v1/chat/completions", json=CHAT)))
        thread.start()
        wait_for_metric(http, "ninfer_requests_waiting", 1.0)
        overloaded = openai_error(http.post("/v1/chat/completions", json=CHAT), 429)
        assert ".." not in overloaded["message"] and overloaded["message"].endswith("Retry later.")
        anthropic_body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
        anthropic_error(http.post("/v1/messages", json=anthropic_body), 529, "overloaded_error")
        with pytest.raises(openai.RateLimitError):
            server.openai(api_key=KEY).chat.completions.create(**CHAT)
        detail_error(http.post("/v1/systemone", json=SYSTEMONE), 429)  # System One's FastAPI shape
        scored = http.post("/v1/score", json=SCORE)  # a question's failure stays in its own slot
        assert scored.status_code == 200 and scored.json()["results"][0]["error"]["code"] == "overloaded"
        thread.join(timeout=30)
        openai_error(waiting["r"], 503, code="queue_timeout")
    wait_for_metric(http, "ninfer_kv_pages_active", 0.0)
    outcomes = metric_values(http.get("/metrics").text)
    assert outcomes['ninfer_requests_total{outcome=overloaded}'] >= 3
    assert outcomes['ninfer_requests_total{outcome=queue_timeout}'] >= 1


def test_a_waiting_stream_gets_keepalives_then_the_timeout_as_an_event(http):
    with http.stream("POST", "/v1/chat/completions", json=LONG) as busy:
        busy_lines = busy.iter_lines()  # keep a reference: a collected iterator closes the response
        next(line for line in busy_lines if line.startswith("data:"))
        with http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as waiting:
            # Past the first keep-alive interval the stream is open, so the timeout comes as an event.
            assert waiting.status_code == 200
            lines = [line for line in waiting.iter_lines() if line]
    assert lines.count(": keep-alive") >= 2
    error = json.loads(next(line for line in lines if line.startswith("data: {"))[len("data: "):])["error"]
    assert error["code"] == "queue_timeout" and error["type"] == "service_unavailable_error"
    assert lines[-1] == "data: [DONE]"


# ---- 500 / 503 when the runner fails -----------------------------------------------------


class FailingRunner:
    """The real reference runner, until `fail` is set; then every step raises."""

    def __init__(self, inner):
        self._inner = inner
        self.fail = threading.Event()

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def step(self, rows):
        if self.fail.is_set():
            raise RuntimeError("simulated device failure")
        self.num_steps += 1
        if self.num_steps == self.fail_at_step:
            self.fail.set()
        return self._inner.step(rows)

    num_steps = 0
    fail_at_step = 0  # set: the steps after this one fail (0: never on its own)


@pytest.fixture(scope="module")
def failing(smollm2):
    from ninfer.gpu.reference import ReferenceRunner

    runner = FailingRunner(ReferenceRunner(smollm2, num_pages=64, page_size=16))
    try:
        with running_server(small_settings(), smollm2, runner=runner) as s:
            yield s, runner
    finally:
        runner.close()


def test_runner_failure_is_500_then_503_and_unhealthy(failing):
    server, runner = failing
    with server.http() as http:
        assert http.get("/health").json() == {"status": "ok"}
        assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
        runner.fail.set()
        detail_error(http.post("/v1/systemone", json=SYSTEMONE), 500)  # the failing step is System One's
        openai_error(http.post("/v1/chat/completions", json=CHAT), 503, code="engine_unhealthy")
        health = http.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        openai_error(http.post("/v1/chat/completions", json=CHAT), 503, code="engine_unhealthy")
        detail_error(http.post("/v1/systemone", json=SYSTEMONE), 503)
        values = metric_values(http.get("/metrics").text)
        assert values["ninfer_engine_healthy"] == 0.0
        assert values["ninfer_requests_total{outcome=error}"] >= 1



# ---- a failure in the middle of a stream, on every streaming API ------------------------------

MODEL = "SmolLM2-135M-Instruct"
MESSAGES = [{"role": "user", "content": "Count from one to twenty in words."}]
STREAMS = {
    "/v1/chat/completions": {"model": MODEL, "messages": MESSAGES, "max_tokens": 40, "stream": True, "temperature": 0},
    "/v1/completions": {"model": MODEL, "prompt": "One, two, three,", "max_tokens": 40, "stream": True, "temperature": 0},
    "/v1/messages": {"model": MODEL, "messages": MESSAGES, "max_tokens": 40, "stream": True, "temperature": 0},
    "/v1/responses": {"model": MODEL, "input": "Count from one to twenty in words.", "max_output_tokens": 40,
                      "stream": True, "temperature": 0},
}  # fmt: skip


def sse_events(lines: list[str]) -> list[tuple[str | None, str]]:
    """(event name, data) of each SSE event in the lines of a stream."""
    events, name = [], None
    for line in lines:
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            events.append((name, line[len("data: "):]))
            name = None
    return events


@pytest.mark.parametrize("path", list(STREAMS))
def test_a_runner_failure_mid_stream_ends_the_stream_with_the_apis_error(smollm2, path):
    from ninfer.gpu.reference import ReferenceRunner

    runner = FailingRunner(ReferenceRunner(smollm2, num_pages=64, page_size=16))
    runner.fail_at_step = 4  # the prefill and three decode steps succeed, then the device "fails"
    try:
        with running_server(small_settings(), smollm2, runner=runner) as server, server.http() as http:
            with http.stream("POST", path, json=STREAMS[path], headers={"anthropic-version": "2023-06-01"}) as reply:
                assert reply.status_code == 200
                events = sse_events(list(reply.iter_lines()))
            assert http.get("/health").status_code == 503
    finally:
        runner.close()
    payloads = [(name, data) for name, data in events if data != "[DONE]"]
    assert len(payloads) >= 3  # some of the answer arrived before the failure
    last_name, last_data = payloads[-1]
    last = json.loads(last_data)
    if path == "/v1/messages":
        assert last_name == "error" and last["type"] == "error" and last["error"]["type"] == "api_error"
    elif path == "/v1/responses":
        assert last["type"] == "response.failed" and last["response"]["status"] == "failed"
        message = last["response"]["error"]["message"]
        # the exception's own text stays in the log: it could hold another request's data
        assert "the runner failed" in message and "simulated device failure" not in message
    else:
        assert last["error"]["type"] == "server_error" and events[-1][1] == "[DONE]"
