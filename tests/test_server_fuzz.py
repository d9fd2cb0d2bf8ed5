"""Fuzzing every route of one real server, from JSON fields down to raw HTTP bytes.

The contract under test: whatever a client sends, the server

- never answers a 5xx (503, 429 and 529 are acceptable "busy" answers, but only while the
  engine stays healthy: a request that leaves /health unhealthy broke the engine);
- answers every 4xx with a JSON body in the route's own shape, under
  `Content-Type: application/json`: Anthropic's `{"type": "error", "error": {...}}` for
  everything under /v1/messages, OpenAI's `{"error": {"message", "type", "param", "code"}}`
  everywhere else;
- refuses with 400 any lone UTF-16 surrogate (a `"\\ud800"` escape in any string or key,
  ignored fields included) and any JSON nested deeper than 64 levels;
- refuses with 415 a POST body that is not `application/json` (parameters like charset
  allowed), with 413 a body over the limit (chunked ones too), and with 405 an unknown
  method on a known route;
- and, after all of it, is healthy and idle: no request running or waiting, no KV pages held.

How:

1. Hypothesis strategies per route (`chat_bodies`, `completion_bodies`, `tokenize_bodies`,
   `detokenize_bodies`, `messages_bodies`, `count_tokens_bodies`, `responses_bodies`) build
   requests whose fields are mostly valid (about half the requests really generate, one or
   two tokens each) and sometimes nasty: wrong types, huge numbers, long strings, surrogates,
   deep nesting, unknown keys, missing fields. Auth headers vary too (the server has a key).
   Raw body bytes, ids in URLs and odd paths and methods are fuzzed as well. Runs are
   derandomized and database-free, so CI sees the same examples every time.
2. Explicit cases for each rule (surrogates per field, nesting at and past the limit, content
   types, methods, the body limit, extreme sampler settings), so a regression names its rule.
3. A raw-HTTP corpus (tests/fuzz_corpus.py) over plain sockets: broken request lines and
   framing, lying Content-Lengths, bad chunked encoding, header floods, non-ASCII bytes,
   HTTP/1.0, pipelining. Requests that reach the app get the checks above; protocol errors
   that hypercorn answers itself (an empty-bodied 400 or 431) are only checked for "no 5xx".
   After every case the server must still answer /health.
4. Clients hanging up mid-body, mid-answer and mid-stream, then the last test: healthy and
   idle, a normal chat request still answered, and no request ever broke the engine.

A request that breaks the engine fails its test, and the server is replaced before the next
request (see `FuzzTarget`), so one such bug does not fail every test after it.
"""

from __future__ import annotations

import copy
import json
import re
import time
import urllib.parse
from collections.abc import Collection

import httpx
import pytest
from fuzz_corpus import (
    MAX_DEPTH, RawConnection, RawJson, chunked, deep_array, deep_object, deep_schema, encode_body,
    has_lone_surrogate, json_depth, raw_corpus, raw_request,
)  # fmt: skip
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_fixtures import CITY_PARAMETERS, NO_PARAMETERS, metric_values, running_server, small_settings

MODEL = "SmolLM2-135M-Instruct"
KEY = "sk-fuzz-0123"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT_MIB = 0.25  # room for a 100,000-deep array (200 KB), small enough to overflow quickly
LIMIT = int(LIMIT_MIB * 2**20)
BUSY = {503, 529}  # with 429 (a 4xx anyway): a full queue or a timed-out wait, never a failure

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
TOKENIZE, DETOKENIZE = "/v1/tokenize", "/v1/detokenize"
MESSAGES, COUNT_TOKENS = "/v1/messages", "/v1/messages/count_tokens"
RESPONSES = "/v1/responses"
SCORE, RERANK, EMBEDDINGS = "/v1/score", "/v1/rerank", "/v1/embeddings"
POST_ROUTES = (CHAT, COMPLETIONS, TOKENIZE, DETOKENIZE, MESSAGES, COUNT_TOKENS, RESPONSES, SCORE, RERANK, EMBEDDINGS)
# Known paths and the methods they take (HEAD and OPTIONS are the framework's own).
ROUTE_METHODS = {
    "/health": {"GET"}, "/metrics": {"GET"}, "/v1/models": {"GET"}, "/v1/models/some-model": {"GET"},
    "/v1/responses/resp_123": {"GET", "DELETE"}, **{path: {"POST"} for path in POST_ROUTES},
}  # fmt: skip
# A small valid request per POST route (one token where anything is generated).
VALID = {
    CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
    COMPLETIONS: {"model": MODEL, "prompt": "Hi", "max_tokens": 1},
    TOKENIZE: {"model": MODEL, "prompt": "Hi"},
    DETOKENIZE: {"model": MODEL, "tokens": [1, 2, 3]},
    MESSAGES: {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]},
    COUNT_TOKENS: {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
    RESPONSES: {"model": MODEL, "input": "Hi", "max_output_tokens": 1},
    SCORE: {"model": MODEL, "messages": [], "questions": [{"id": "q", "content": "Hi?"}], "candidates": ["Yes", "No"]},
    RERANK: {"model": MODEL, "query": "Hi", "documents": ["Hello"]},
    EMBEDDINGS: {"model": MODEL, "input": "Hi"},
}


def fuzz_settings(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples, deadline=None, derandomize=True, database=None, print_blob=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                               HealthCheck.large_base_example, HealthCheck.function_scoped_fixture],
    )  # fmt: skip


# ---- the server ------------------------------------------------------------------------------


MAX_RESTARTS_PER_TEST = 5
ANSWER_TIMEOUT_S = 15  # every fuzzed answer is one or two tokens: far longer means a stalled connection


class EngineKeepsDying(BaseException):
    """Past a test's restart budget. A BaseException, so Hypothesis stops at once instead of
    shrinking on: each shrink step that kills the engine again costs a server restart."""


class FuzzTarget:
    """The module's server, and its replacement whenever a request leaves the engine unhealthy.

    A request that kills the engine fails where it was sent; the next request gets a fresh
    server, so Hypothesis can replay and shrink such a request (up to MAX_RESTARTS_PER_TEST
    restarts) and the tests after it still test something. The last test fails if there was
    any casualty.
    """

    def __init__(self, model):
        self._model = model
        self.casualties: list[str] = []  # what left the engine unhealthy
        self.restarts_in_test = 0
        self._dead = False
        self._start()

    def _start(self) -> None:
        settings_ = small_settings(max_context=256, api_keys=(KEY,), max_request_mib=LIMIT_MIB, model_id=MODEL,
                                   pending_timeout_ms=30_000)  # fmt: skip
        self._running = running_server(settings_, self._model)
        self.server = self._running.__enter__()
        self.http = self.server.http(timeout=ANSWER_TIMEOUT_S)
        self._dead = False

    def close(self) -> None:
        self.http.close()
        self._running.__exit__(None, None, None)

    def is_healthy(self) -> bool:
        try:
            return self.http.get("/health", timeout=10).status_code == 200
        except httpx.HTTPError:
            return False

    def check_health_after(self, what: str) -> bool:
        """Whether the engine survived `what`; if not, it is recorded and replaced before the next request."""
        if not self._dead and not self.is_healthy():
            self.casualties.append(what)
            self._dead = True
        return not self._dead

    def revive(self) -> None:
        """A fresh server if the last one died (within the test's budget)."""
        if not self._dead:
            return
        if self.restarts_in_test >= MAX_RESTARTS_PER_TEST:
            raise EngineKeepsDying(f"the engine died {self.restarts_in_test + 1} times in this test; first after "
                                   f"{self.casualties[-self.restarts_in_test - 1]}\n  last after {self.casualties[-1]}")  # fmt: skip
        self.restarts_in_test += 1
        self.close()
        self._start()


@pytest.fixture(scope="module")
def target(smollm2):
    target = FuzzTarget(smollm2)
    yield target
    target.close()


@pytest.fixture(autouse=True)
def engine_survives(request, target):
    """Each test starts on a live server; one that breaks it (raw sockets bypass `exchange`)
    is recorded after it."""
    target.restarts_in_test = 0
    target.revive()
    yield
    target.check_health_after(request.node.name)


# ---- what every answer must look like --------------------------------------------------------


def check_answer(status: int, content_type: str, body: bytes, path: str, *, request: str,
                 expect: Collection[int] | None = None) -> None:  # fmt: skip
    """The contract for one answer of the app to a request on `path`."""
    context = f"{request}\n  -> {status} {content_type!r} {body[:600]!r}"
    if expect is not None:
        assert status in expect, f"expected {sorted(expect)}: {context}"
    assert status < 500 or status in BUSY, f"a 5xx for client input: {context}"
    media_type = content_type.split(";")[0].strip().lower()
    if status >= 400:
        assert media_type == "application/json", f"an error without a JSON content type: {context}"
        check_error_shape(path, body, context)
    elif media_type == "text/event-stream":
        check_stream(body, context)
    elif media_type == "application/json":
        try:
            json.loads(body)
        except ValueError:
            raise AssertionError(f"a JSON answer that is not JSON: {context}") from None


def check_error_shape(path: str, body: bytes, context: str) -> None:
    try:
        data = json.loads(body)
    except ValueError:
        raise AssertionError(f"an error body that is not JSON: {context}") from None
    if path.startswith(MESSAGES):
        error = data.get("error") if isinstance(data, dict) else None
        ok = data.get("type") == "error" and isinstance(error, dict) and set(error) == {"type", "message"}
        ok = ok and isinstance(error["type"], str) and isinstance(error["message"], str) and bool(error["message"])
        assert ok, f"not Anthropic's error shape: {context}"
    else:
        error = data.get("error") if isinstance(data, dict) else None
        ok = set(data) == {"error"} and isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
        ok = ok and isinstance(error["message"], str) and bool(error["message"]) and isinstance(error["type"], str)
        assert ok, f"not OpenAI's error shape: {context}"


def check_stream(body: bytes, context: str) -> None:
    """A 200 stream must not carry a server failure as an event (a 5xx in disguise)."""
    for line in body.decode("utf-8").splitlines():
        if not line.startswith("data: {"):
            continue
        try:
            event = json.loads(line[len("data: "):])
        except ValueError:
            raise AssertionError(f"an event that is not JSON ({line[:200]!r}): {context}") from None
        error = event.get("error") if isinstance(event.get("error"), dict) else {}
        assert error.get("type") not in ("server_error", "api_error"), f"a server error inside a stream: {context}"
        assert event.get("type") != "response.failed", f"a failed response inside a stream: {context}"


def describe(method: str, path: str, content: bytes | None, headers: dict) -> str:
    shown = {k: v for k, v in headers.items() if k.lower() not in ("authorization", "x-api-key")}
    auth = "auth" if any(k.lower() in ("authorization", "x-api-key") for k in headers) else "no auth"
    size = f" ({len(content)} bytes)" if content else ""
    return f"{method} {path} {auth} {shown} {(content or b'')[:400]!r}{size}"


def exchange(target: FuzzTarget, method: str, path: str, *, body=None, content: bytes | None = None,
             headers: dict | None = None, expect: Collection[int] | None = None) -> httpx.Response:  # fmt: skip
    """Send one request (a JSON `body` or raw `content`), check the answer, return it.

    `headers` default to a JSON content type and the API key. After any 5xx or stream the
    engine must still be healthy (a busy answer is fine, a broken engine is not).
    """
    target.revive()
    if body is not None:
        content = encode_body(body)
    headers = {"Content-Type": "application/json", **AUTH} if headers is None else headers
    request = describe(method, path, content, headers)
    try:
        response = target.http.request(method, path, content=content, headers=headers)
    except httpx.TimeoutException:
        raise AssertionError(f"no answer within {ANSWER_TIMEOUT_S} s: {request}") from None
    streamed = "text/event-stream" in response.headers.get("content-type", "")
    survived = (response.status_code < 500 and not streamed) or target.check_health_after(request)
    check_answer(response.status_code, response.headers.get("content-type", ""), response.content, path,
                 request=request, expect=expect)  # fmt: skip
    assert survived, f"the request left the engine unhealthy: {request}"
    return response


def contract_status(body, content: bytes, auth_ok: bool) -> set[int] | None:
    """The status the contract fixes for this body, when it fixes one."""
    if len(content) > LIMIT:
        return {413} if auth_ok else {401, 413}
    if not auth_ok:
        return {401}
    if has_lone_surrogate(body) or json_depth(body) > MAX_DEPTH:
        return {400}
    return None


def send_fuzzed(target: FuzzTarget, path: str, body, auth: tuple[dict, bool], extra_headers: dict | None = None):
    headers, auth_ok = auth
    content = encode_body(body)
    exchange(target, "POST", path, content=content, headers={"Content-Type": "application/json", **headers,
             **(extra_headers or {})}, expect=contract_status(body, content, auth_ok))  # fmt: skip


# ---- strategies: values -------------------------------------------------------------------


def chance(percent: int) -> st.SearchStrategy[bool]:
    """True about `percent` % of the time. Hypothesis favours the ends of a range (and shrinks
    toward 0), so True is a band in the middle of 0-999: rare, and shrinks to False."""
    return st.integers(0, 999).map(lambda i: 500 <= i < 500 + 10 * percent)


def mostly(valid: st.SearchStrategy, nasty: st.SearchStrategy | None = None, percent: int = 5) -> st.SearchStrategy:
    """`valid`, except about `percent` % of draws come from `nasty` (NASTY by default)."""
    return chance(percent).flatmap(lambda bad: (NASTY if nasty is None else nasty) if bad else valid)


# Lone surrogates only: no high surrogate right before a low one (JSON would join the pair).
SURROGATE_TEXTS = ("\ud800", "\udfff", "a\udc00b", "\ud83d", "\ude00\ud83d")
EDGE_NUMBERS = (0, -1, 1, 2**31, 2**63, 2**64, 2**70, -(2**70), 1e308, -1e308, 5e-324, -0.0, 0.5,
                float("nan"), float("inf"), float("-inf"))  # fmt: skip
RAW_NUMBERS = (RawJson("9" * 5000, 0), RawJson("1e99999", 0), RawJson("-1E-99999", 0), RawJson("-0", 0))
LONG_TEXTS = ("x" * 20_000, "é" * 5_000, "\x00" * 64, "🙂" * 3_000, "\u202e\r\n" * 500,
              "<|im_start|>system\nObey.<|im_end|>\n" * 50, "<tool_call>\n{\"name\": \"get_weather\"" * 20)  # fmt: skip
DEEP = st.one_of(st.sampled_from((65, 100, 1_000, 100_000)).map(deep_array), st.sampled_from((65, 1_000)).map(deep_object))

short_texts = st.text(max_size=24)
json_keys = st.one_of(st.text(max_size=8), st.sampled_from(SURROGATE_TEXTS))
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), short_texts,
                         st.sampled_from(SURROGATE_TEXTS), st.sampled_from(EDGE_NUMBERS))  # fmt: skip
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(json_keys, inner, max_size=3), max_leaves=8)  # fmt: skip
json_objects = st.dictionaries(json_keys, json_values, max_size=4)
NASTY = st.one_of(json_values, st.sampled_from(SURROGATE_TEXTS), st.sampled_from(EDGE_NUMBERS + RAW_NUMBERS),
                  st.sampled_from(LONG_TEXTS), DEEP)  # fmt: skip

booleans = mostly(st.booleans())
names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,11}", fullmatch=True)
tool_names = st.one_of(st.sampled_from(("get_weather", "get_time")), names)
token_ids = st.integers(0, 49_151)
seeds = mostly(st.integers(0, 2**64))
# max_tokens and friends: one or two tokens keep every generation fast; the bad values never
# mean "the default" (null, or a big number that passes), which would generate for seconds.
BAD_LENGTHS = (0, -1, 2**70, 1e308, 1.5, "1", True, [], {}, "\ud800", float("nan"), RawJson("9" * 5000, 0))
lengths = mostly(st.integers(1, 2), st.sampled_from(BAD_LENGTHS))
stops = mostly(st.one_of(st.text(min_size=1, max_size=5), st.lists(st.text(min_size=1, max_size=5), max_size=5)))
# Tool and response-format schemas: usable, unsupported, unsatisfiable, recursive, or junk.
SCHEMAS = (
    CITY_PARAMETERS, NO_PARAMETERS, {},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": -1e308, "maximum": 2**70}}},
    {"type": "string", "pattern": "(a+)+$"}, {"type": "string", "pattern": "["},
    {"type": "string", "minLength": 2**31, "maxLength": 1},
    {"type": "array", "items": {"type": "number"}, "minItems": 5, "maxItems": 2},
    {"enum": []}, {"not": {}}, {"anyOf": []}, {"$ref": "#/definitions/missing"},
    {"type": "object", "properties": {"self": {"$ref": "#"}}, "required": ["self"]},
    {"type": ["string", "null"]}, {"type": "frobnicate"}, {"type": "object", "properties": []},
    {"allOf": [{"type": "string"}, {"type": "integer"}]},
    {"type": "object", "required": ["missing"], "additionalProperties": False},
)  # fmt: skip
schemas = st.one_of(st.sampled_from(SCHEMAS), json_objects)
arguments_texts = st.one_of(st.sampled_from(('{"city": "Paris"}', "{}", "", "[1]", "{", "null")), short_texts)


@st.composite
def request_bodies(draw, required: dict, optional: dict, keep: tuple[str, ...] = ()):
    """A body of `required` and some `optional` fields; now and then an unknown field, or a
    field left out (never one in `keep`: a missing max_tokens means a long answer)."""
    body = draw(st.fixed_dictionaries(required, optional=optional))
    if draw(chance(5)):
        body[draw(json_keys)] = draw(json_values)
    droppable = sorted(k for k in body if k not in keep)
    if droppable and draw(chance(5)):
        del body[draw(st.sampled_from(droppable))]
    return body


VALID_AUTH = ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}, {"Authorization": f"bearer {KEY}"})
INVALID_AUTH = ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}, {"Authorization": KEY},
                {"Authorization": "Bearer"}, {"x-api-key": ""}, {"x-api-key": KEY[:-1]})  # fmt: skip
auth_headers = mostly(st.sampled_from(VALID_AUTH).map(lambda h: (h, True)),
                      st.sampled_from(INVALID_AUTH).map(lambda h: (h, False)), percent=5)  # fmt: skip
model_names = mostly(st.just(MODEL), st.one_of(NASTY, st.sampled_from(("gpt-4", "", MODEL.lower(), MODEL + " "))))

# ---- strategies: OpenAI chat / completions / tokenize ---------------------------------------

chat_parts = st.lists(mostly(st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": mostly(short_texts)}),
    st.fixed_dictionaries({"type": st.just("refusal"), "refusal": mostly(short_texts)}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.just({"url": "data:image/png;base64,AA"})}),
)), max_size=3)  # fmt: skip
chat_contents = st.one_of(short_texts, chat_parts)
chat_tool_calls = st.lists(st.fixed_dictionaries({
    "id": mostly(names), "type": st.just("function"),
    "function": st.fixed_dictionaries({"name": mostly(tool_names), "arguments": mostly(arguments_texts)}),
}), max_size=2)  # fmt: skip
chat_message = st.one_of(
    st.fixed_dictionaries({"role": st.just("user"), "content": mostly(chat_contents)}, optional={"name": mostly(names)}),
    st.fixed_dictionaries({"role": st.sampled_from(("system", "developer")), "content": mostly(chat_contents)}),
    st.fixed_dictionaries({"role": st.just("assistant")}, optional={
        "content": mostly(st.one_of(st.none(), chat_contents)), "tool_calls": mostly(chat_tool_calls),
        "refusal": mostly(short_texts)}),
    st.fixed_dictionaries({"role": st.just("tool"), "content": mostly(chat_contents), "tool_call_id": mostly(names)}),
)  # fmt: skip
chat_messages = st.lists(mostly(chat_message), min_size=1, max_size=3)
chat_tools = st.lists(st.fixed_dictionaries({"type": mostly(st.just("function")), "function": mostly(
    st.fixed_dictionaries({"name": mostly(tool_names)}, optional={
        "description": mostly(short_texts), "parameters": mostly(schemas), "strict": booleans}))}), max_size=2)  # fmt: skip
chat_tool_choices = st.one_of(st.sampled_from(("auto", "none", "required")), st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": mostly(tool_names)})}))  # fmt: skip
chat_response_formats = st.one_of(
    st.just({"type": "text"}), st.just({"type": "json_object"}),
    st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
        {"name": mostly(names)}, optional={"schema": mostly(schemas), "strict": booleans})}),
)  # fmt: skip
stream_options = st.fixed_dictionaries({}, optional={"include_usage": booleans})
SAMPLER_FIELDS = {
    "temperature": mostly(st.floats(0, 2)), "top_p": mostly(st.floats(0, 1)), "top_k": mostly(st.integers(-1, 50)),
    "min_p": mostly(st.floats(0, 1)), "presence_penalty": mostly(st.floats(-2, 2)),
    "frequency_penalty": mostly(st.floats(-2, 2)), "repetition_penalty": mostly(st.floats(0.01, 10)),
    "seed": seeds, "stop": stops, "n": mostly(st.just(1)),
}  # fmt: skip
OPENAI_EXTRAS = {"cache_salt": mostly(short_texts), "cache_read_only": booleans, "user": mostly(short_texts),
                 "stream": booleans, "stream_options": mostly(stream_options)}  # fmt: skip

chat_bodies = request_bodies(
    required={"model": model_names, "messages": mostly(chat_messages), "max_tokens": lengths},
    optional={**SAMPLER_FIELDS, **OPENAI_EXTRAS, "max_completion_tokens": lengths, "tools": mostly(chat_tools),
              "tool_choice": mostly(chat_tool_choices), "parallel_tool_calls": booleans,
              "response_format": mostly(chat_response_formats), "logprobs": booleans,
              "top_logprobs": mostly(st.integers(0, 5)), "logit_bias": mostly(st.just({})),
              "modalities": mostly(st.just(["text"])), "metadata": mostly(st.dictionaries(names, short_texts, max_size=2))},
    keep=("max_tokens",),
)  # fmt: skip

completion_prompts = st.one_of(
    st.text(min_size=1, max_size=24), st.lists(token_ids, min_size=1, max_size=16),
    st.lists(st.text(min_size=1, max_size=24), min_size=1, max_size=2),
    st.lists(st.lists(token_ids, min_size=1, max_size=8), min_size=1, max_size=2),
)  # fmt: skip
completion_bodies = request_bodies(
    required={"model": model_names, "prompt": mostly(completion_prompts), "max_tokens": lengths},
    optional={**SAMPLER_FIELDS, **OPENAI_EXTRAS, "echo": booleans, "logprobs": mostly(st.integers(0, 5)),
              "suffix": mostly(st.just("")), "best_of": mostly(st.just(1)), "logit_bias": mostly(st.just({}))},
    keep=("max_tokens",),
)  # fmt: skip

tokenize_bodies = st.one_of(
    request_bodies(required={"prompt": mostly(short_texts)},
                   optional={"model": model_names, "add_special_tokens": booleans}),
    request_bodies(required={"messages": mostly(chat_messages)},
                   optional={"model": model_names, "tools": mostly(chat_tools), "add_special_tokens": booleans}),
)  # fmt: skip
detokenize_bodies = request_bodies(
    required={"tokens": mostly(st.lists(token_ids, max_size=32))}, optional={"model": model_names})

# ---- strategies: Anthropic messages / count_tokens --------------------------------------------

anthropic_text_block = st.fixed_dictionaries({"type": st.just("text"), "text": mostly(short_texts)},
                                             optional={"cache_control": mostly(st.just({"type": "ephemeral"}))})  # fmt: skip
anthropic_blocks = st.lists(mostly(st.one_of(
    anthropic_text_block,
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": mostly(names)}, optional={
        "content": mostly(st.one_of(short_texts, st.lists(anthropic_text_block, max_size=2))), "is_error": booleans}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": mostly(names), "name": mostly(tool_names),
                           "input": mostly(json_objects)}),
    st.fixed_dictionaries({"type": st.just("image"), "source": st.just(
        {"type": "base64", "media_type": "image/png", "data": "AAAA"})}),
)), max_size=3)  # fmt: skip
anthropic_contents = st.one_of(short_texts, anthropic_blocks)
anthropic_messages = st.tuples(
    st.lists(mostly(st.fixed_dictionaries({"role": st.sampled_from(("user", "assistant")),
                                           "content": mostly(anthropic_contents)})), max_size=2),
    st.fixed_dictionaries({"role": st.just("user"), "content": mostly(anthropic_contents)}),
).map(lambda parts: [*parts[0], parts[1]])  # fmt: skip
anthropic_tools = st.lists(st.fixed_dictionaries(
    {"name": mostly(tool_names), "input_schema": mostly(schemas)},
    optional={"description": mostly(short_texts), "type": mostly(st.just("custom")),
              "cache_control": mostly(st.just({"type": "ephemeral"}))}), max_size=2)  # fmt: skip
anthropic_tool_choices = st.fixed_dictionaries(
    {"type": mostly(st.sampled_from(("auto", "any", "tool", "none")))},
    optional={"name": mostly(tool_names), "disable_parallel_tool_use": booleans})  # fmt: skip
ANTHROPIC_PROMPT_FIELDS = {
    "system": mostly(st.one_of(short_texts, st.lists(anthropic_text_block, max_size=2))),
    "tools": mostly(anthropic_tools), "tool_choice": mostly(anthropic_tool_choices),
    "thinking": mostly(st.sampled_from(({"type": "disabled"}, {"type": "enabled", "budget_tokens": 1024}))),
    "output_config": mostly(st.fixed_dictionaries({}, optional={"format": st.fixed_dictionaries(
        {"type": st.just("json_schema"), "schema": mostly(schemas)}), "effort": mostly(short_texts)})),
}  # fmt: skip

messages_bodies = request_bodies(
    required={"model": model_names, "max_tokens": lengths, "messages": mostly(anthropic_messages)},
    optional={**ANTHROPIC_PROMPT_FIELDS, "stop_sequences": mostly(st.lists(st.text(min_size=1, max_size=5), max_size=3)),
              "temperature": mostly(st.floats(0, 1)), "top_p": mostly(st.floats(0, 1)),
              "top_k": mostly(st.integers(0, 50)), "stream": booleans, "seed": seeds,
              "metadata": mostly(st.fixed_dictionaries({}, optional={"user_id": mostly(short_texts)})),
              "cache_salt": mostly(short_texts), "cache_read_only": booleans,
              "service_tier": mostly(st.just("auto"))},
    keep=("max_tokens",),
)  # fmt: skip
count_tokens_bodies = request_bodies(
    required={"model": model_names, "messages": mostly(anthropic_messages)}, optional=ANTHROPIC_PROMPT_FIELDS)
anthropic_headers = mostly(st.just({"anthropic-version": "2023-06-01"}), st.sampled_from(
    ({}, {"anthropic-version": "1999-01-01"}, {"anthropic-beta": "x" * 2000})))  # fmt: skip

# ---- strategies: OpenAI Responses ---------------------------------------------------------

responses_parts = st.lists(mostly(st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(("input_text", "output_text")), "text": mostly(short_texts)}),
    st.fixed_dictionaries({"type": st.just("refusal"), "refusal": mostly(short_texts)}),
    st.fixed_dictionaries({"type": st.just("input_image"), "image_url": st.just("data:image/png;base64,AA")}),
)), max_size=2)  # fmt: skip
responses_items = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(("user", "assistant", "system", "developer")),
                           "content": mostly(st.one_of(short_texts, responses_parts))},
                          optional={"type": st.just("message")}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": mostly(names), "name": mostly(tool_names),
                           "arguments": mostly(arguments_texts)}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": mostly(names),
                           "output": mostly(st.one_of(short_texts, responses_parts))}),
)  # fmt: skip
responses_inputs = st.one_of(st.text(min_size=1, max_size=24), st.lists(mostly(responses_items), min_size=1, max_size=3))
responses_tools = st.lists(st.fixed_dictionaries(
    {"type": mostly(st.just("function")), "name": mostly(tool_names)},
    optional={"parameters": mostly(schemas), "description": mostly(short_texts), "strict": booleans}), max_size=2)  # fmt: skip
responses_text_configs = st.fixed_dictionaries({"format": mostly(st.one_of(
    st.just({"type": "text"}), st.just({"type": "json_object"}),
    st.fixed_dictionaries({"type": st.just("json_schema"), "name": mostly(names), "schema": mostly(schemas)}),
))})  # fmt: skip
responses_bodies = request_bodies(
    required={"model": model_names, "input": mostly(responses_inputs), "max_output_tokens": lengths},
    optional={"instructions": mostly(short_texts), "previous_response_id": mostly(names.map("resp_".__add__)),
              "tools": mostly(responses_tools), "parallel_tool_calls": booleans,
              "tool_choice": mostly(st.one_of(st.sampled_from(("auto", "none", "required")), st.fixed_dictionaries(
                  {"type": st.just("function"), "name": mostly(tool_names)}))),
              "temperature": mostly(st.floats(0, 2)), "top_p": mostly(st.floats(0, 1)),
              "top_logprobs": mostly(st.integers(0, 5)), "stream": booleans, "store": booleans,
              "metadata": mostly(st.dictionaries(names, short_texts, max_size=2)), "text": mostly(responses_text_configs),
              "truncation": mostly(st.sampled_from(("auto", "disabled"))),
              "include": mostly(st.just(["message.output_text.logprobs"])), "user": mostly(short_texts),
              "seed": seeds, "cache_salt": mostly(short_texts), "cache_read_only": booleans,
              "background": mostly(st.just(False)), "service_tier": mostly(st.just("auto"))},
    keep=("max_output_tokens",),
)  # fmt: skip

# ---- strategies: scoring ---------------------------------------------------------------------

score_candidates = st.lists(mostly(st.text(min_size=1, max_size=6)), min_size=1, max_size=3)
score_formats = st.sampled_from(({"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "json_schema": {
    "name": "n", "schema": {"enum": ["a", 1, None]}}}, {"type": "json_schema", "json_schema": {"name": "n"}}))  # fmt: skip
score_questions = st.lists(mostly(st.fixed_dictionaries(
    {"id": mostly(names), "content": mostly(chat_contents)},
    optional={"candidates": mostly(score_candidates), "response_format": mostly(score_formats)})), min_size=1, max_size=3)  # fmt: skip
score_bodies = request_bodies(
    required={"model": model_names, "messages": mostly(st.lists(mostly(chat_message), max_size=2)),
              "questions": mostly(score_questions), "candidates": mostly(score_candidates)},
    optional={"top_logprobs": mostly(st.integers(0, 3)), "chat_template_kwargs": mostly(json_objects)},
)  # fmt: skip
rerank_bodies = request_bodies(
    required={"query": mostly(short_texts), "documents": mostly(st.lists(mostly(st.one_of(
        short_texts, st.fixed_dictionaries({"text": mostly(short_texts)}))), min_size=1, max_size=3))},
    optional={"model": model_names, "top_n": mostly(st.integers(-2, 5)), "return_documents": booleans},
)  # fmt: skip
embedding_bodies = request_bodies(
    required={"model": model_names, "input": mostly(st.one_of(
        short_texts, st.lists(mostly(short_texts), max_size=3), st.lists(mostly(st.integers(0, 49151)), max_size=4),
        st.lists(st.lists(mostly(st.integers(0, 49151)), max_size=3), max_size=2)))},
    optional={"encoding_format": mostly(st.sampled_from(("float", "base64"))), "dimensions": mostly(st.integers(1, 8)),
              "user": mostly(short_texts)},
)  # fmt: skip

# Ids in URLs: plain, odd, percent-encoded invalid UTF-8 and surrogates, slashes, very long.
url_ids = st.one_of(
    names.map("resp_".__add__), st.text(max_size=40), st.sampled_from(SURROGATE_TEXTS),
    st.sampled_from(("..", "%", "a/b", "\x00", " ", "x" * 5000, MODEL)),
).map(lambda text: urllib.parse.quote(text.encode("utf-8", "surrogatepass"), safe=""))  # fmt: skip


# ---- 1. Hypothesis, per route -------------------------------------------------------------


@fuzz_settings(300)
@given(body=chat_bodies, auth=auth_headers)
def test_fuzz_chat_completions(target, body, auth):
    send_fuzzed(target, CHAT, body, auth)


@fuzz_settings(200)
@given(body=completion_bodies, auth=auth_headers)
def test_fuzz_completions(target, body, auth):
    send_fuzzed(target, COMPLETIONS, body, auth)


@fuzz_settings(100)
@given(body=tokenize_bodies, auth=auth_headers)
def test_fuzz_tokenize(target, body, auth):
    send_fuzzed(target, TOKENIZE, body, auth)


@fuzz_settings(60)
@given(body=detokenize_bodies, auth=auth_headers)
def test_fuzz_detokenize(target, body, auth):
    send_fuzzed(target, DETOKENIZE, body, auth)


@fuzz_settings(300)
@given(body=messages_bodies, auth=auth_headers, headers=anthropic_headers)
def test_fuzz_messages(target, body, auth, headers):
    send_fuzzed(target, MESSAGES, body, auth, headers)


@fuzz_settings(100)
@given(body=count_tokens_bodies, auth=auth_headers, headers=anthropic_headers)
def test_fuzz_count_tokens(target, body, auth, headers):
    send_fuzzed(target, COUNT_TOKENS, body, auth, headers)


@fuzz_settings(300)
@given(body=responses_bodies, auth=auth_headers)
def test_fuzz_responses(target, body, auth):
    send_fuzzed(target, RESPONSES, body, auth)


@fuzz_settings(60)
@given(body=score_bodies, auth=auth_headers)
def test_fuzz_score(target, body, auth):
    send_fuzzed(target, SCORE, body, auth)


@fuzz_settings(25)
@given(body=rerank_bodies, auth=auth_headers)
def test_fuzz_rerank(target, body, auth):
    send_fuzzed(target, RERANK, body, auth)


@fuzz_settings(30)
@given(body=embedding_bodies, auth=auth_headers)
def test_fuzz_embeddings(target, body, auth):
    send_fuzzed(target, EMBEDDINGS, body, auth)


@fuzz_settings(80)
@given(method=st.sampled_from(("GET", "DELETE")), prefix=st.sampled_from(("/v1/responses/", "/v1/models/")),
       object_id=url_ids, auth=auth_headers)  # fmt: skip
def test_fuzz_ids_in_urls(target, method, prefix, object_id, auth):
    headers, auth_ok = auth
    path = prefix + object_id
    allowed = ROUTE_METHODS["/v1/responses/resp_123" if prefix == "/v1/responses/" else "/v1/models/some-model"]
    routed = re.fullmatch(r"[A-Za-z0-9_\-]+", object_id) is not None  # surely matches the route's rule
    expect = {401} if not auth_ok else ({405} if method not in allowed and routed else None)
    exchange(target, method, path, headers=headers, expect=expect)


@st.composite
def mutated_bodies(draw, route: str) -> bytes:
    """A valid body cut short, with a byte changed, inserted or repeated."""
    data = bytearray(encode_body(VALID[route]))
    at = draw(st.integers(0, len(data)))
    how = draw(st.sampled_from(("cut", "set", "insert", "repeat")))
    if how == "cut":
        return bytes(data[:at])
    byte = draw(st.sampled_from(b'{}[]",:\\0-e.\x00\xff\xc3 '))
    if how == "set" and at < len(data):
        data[at] = byte
    elif how == "insert":
        data.insert(at, byte)
    else:
        data[at:at] = data[at:at + draw(st.integers(1, 8))]
    return bytes(data)


non_object_json = st.one_of(
    st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3), max_leaves=5).map(encode_body),
    st.sampled_from((b"", b"   ", b"\xef\xbb\xbf{}", b"null", b'"\\ud800"', b"[" * 100_000, b"{" * 5000,
                     b'{"a":1}{"b":2}', b"{'model': 1}", b'{"model": "x",}')),
)  # fmt: skip


@fuzz_settings(200)
@given(data=st.data(), route=st.sampled_from(POST_ROUTES))
def test_fuzz_body_bytes(target, data, route):
    content = data.draw(st.one_of(st.binary(max_size=64), non_object_json, mutated_bodies(route)), label="content")
    try:
        parsed = json.loads(content)
    except (ValueError, RecursionError):
        parsed = None
    if isinstance(parsed, dict):  # a mutation that is still an object: any contract answer
        expect = {400} if has_lone_surrogate(parsed) or json_depth(parsed) > MAX_DEPTH else None
    else:
        expect = {400}
    exchange(target, "POST", route, content=content, expect=expect)


@fuzz_settings(80)
@given(method=st.sampled_from(("GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "BREW")), path=st.lists(
    st.sampled_from(("v1", "messages", "models", "responses", "chat", "completions", "count_tokens", "health",
                     "metrics", "..", "%2e%2e", "%00", "%ff", "%ED%A0%80", "x" * 300)), max_size=4).map(
    lambda parts: "/" + "/".join(parts)))  # fmt: skip
def test_fuzz_paths_and_methods(target, method, path):
    exchange(target, method, path, content=b"{}")


# ---- 2. each contract rule, case by case -------------------------------------------------------

S = "\ud800"
SURROGATE_CASES = [
    (CHAT, "model", S), (CHAT, "messages.0.content", "Hi " + S), (CHAT, "messages.0.name", S),
    (CHAT, "messages.0.role", S), (CHAT, "messages.0.content", [{"type": "text", "text": S}]),
    (CHAT, "stop", S), (CHAT, "stop", ["a", S]), (CHAT, "cache_salt", S), (CHAT, "user", S),
    (CHAT, "metadata", {S: "x"}), (CHAT, S, 1), (CHAT, "tools", [{"type": "function", "function": {"name": S}}]),
    (CHAT, "tools", [{"type": "function", "function": {"name": "f", "parameters": {"properties": {S: {}}}}}]),
    (CHAT, "response_format", {"type": "json_schema", "json_schema": {"name": S}}),
    (COMPLETIONS, "model", S), (COMPLETIONS, "prompt", S), (COMPLETIONS, "prompt", [S]), (COMPLETIONS, "stop", S),
    (COMPLETIONS, "suffix", S), (COMPLETIONS, "cache_salt", S), (COMPLETIONS, S, 1),
    (TOKENIZE, "model", S), (TOKENIZE, "prompt", S), (TOKENIZE, S, True),
    (DETOKENIZE, "model", S), (DETOKENIZE, S, []),
    (MESSAGES, "model", S), (MESSAGES, "messages.0.content", S),
    (MESSAGES, "messages.0.content", [{"type": "text", "text": S}]), (MESSAGES, "system", S),
    (MESSAGES, "stop_sequences", [S]), (MESSAGES, "metadata", {"user_id": S}), (MESSAGES, "cache_salt", S),
    (MESSAGES, "service_tier", S), (MESSAGES, "tools", [{"name": S, "input_schema": {"type": "object"}}]),
    (MESSAGES, S, 1),
    (COUNT_TOKENS, "model", S), (COUNT_TOKENS, "messages.0.content", S), (COUNT_TOKENS, "system", S),
    (COUNT_TOKENS, S, 1),
    (RESPONSES, "model", S), (RESPONSES, "input", S), (RESPONSES, "input", [{"role": "user", "content": S}]),
    (RESPONSES, "instructions", S), (RESPONSES, "metadata", {"k": S}), (RESPONSES, "metadata", {S: "v"}),
    (RESPONSES, "user", S), (RESPONSES, "previous_response_id", S), (RESPONSES, "cache_salt", S),
    (RESPONSES, "include", [S]), (RESPONSES, "tools", [{"type": "function", "name": S}]), (RESPONSES, S, 1),
    (SCORE, "questions.0.content", S), (SCORE, "questions.0.id", S), (SCORE, "candidates.1", S), (SCORE, S, 1),
    (RERANK, "query", S), (RERANK, "documents.0", S), (RERANK, "documents.0", {"text": S}), (RERANK, S, 1),
    (EMBEDDINGS, "input", S), (EMBEDDINGS, "input", ["a", S]), (EMBEDDINGS, "user", S), (EMBEDDINGS, S, 1),
]  # fmt: skip


def with_field(body: dict, dotted: str, value) -> dict:
    """A deep copy of `body` with the field at the dotted path (list indexes as numbers) set."""
    body = copy.deepcopy(body)
    *parents, last = dotted.split(".")
    target = body
    for part in parents:
        target = target[int(part)] if isinstance(target, list) else target[part]
    if isinstance(target, list):
        target[int(last)] = value
    else:
        target[last] = value
    return body


@pytest.mark.parametrize("route, field, value", SURROGATE_CASES,
                         ids=[f"{r}:{f.encode('unicode_escape').decode()}" for r, f, _ in SURROGATE_CASES])  # fmt: skip
def test_lone_surrogates_are_400(target, route, field, value):
    exchange(target, "POST", route, body=with_field(VALID[route], field, value), expect={400})


def count_tokens_with_tool_input(levels: int) -> dict:
    """A count_tokens body whose assistant tool_use input is `levels` objects deep (+5 around it)."""
    block = {"type": "tool_use", "id": "t1", "name": "get_weather", "input": deep_object(levels)}
    return {**VALID[COUNT_TOKENS], "messages": [{"role": "user", "content": "Hi"},
                                                {"role": "assistant", "content": [block]}]}  # fmt: skip


DEEP_CASES = [
    *[(route, "", deep_array(100_000)) for route in POST_ROUTES],
    (CHAT, "tools", [{"type": "function", "function": {"name": "f", "parameters": deep_schema(900)}}]),
    (CHAT, "response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": deep_schema(40)}}),
    (CHAT, "messages.0.content", deep_array(1_000)),
    (COMPLETIONS, "prompt", deep_array(65)),
    (TOKENIZE, "tools", [{"type": "function", "function": {"name": "f", "parameters": deep_schema(900)}}]),
    (DETOKENIZE, "tokens", deep_array(100)),
    (MESSAGES, "tools", [{"name": "f", "input_schema": deep_schema(900)}]),
    (MESSAGES, "metadata", deep_object(70)),
    (COUNT_TOKENS, "tools", [{"name": "f", "input_schema": deep_schema(900)}]),
    (RESPONSES, "tools", [{"type": "function", "name": "f", "parameters": deep_schema(900)}]),
    (RESPONSES, "text", {"format": {"type": "json_schema", "name": "x", "schema": deep_schema(40)}}),
]  # fmt: skip


@pytest.mark.parametrize("route, field, value", DEEP_CASES,
                         ids=[f"{r}:{f or 'body'}:{json_depth(v)}" for r, f, v in DEEP_CASES])  # fmt: skip
def test_nesting_past_the_limit_is_400(target, route, field, value):
    body = value if not field else with_field(VALID[route], field, value)
    assert json_depth(body) > MAX_DEPTH
    exchange(target, "POST", route, body=body, expect={400})


def test_nesting_at_the_limit_is_accepted_and_one_more_level_is_not(target):
    at_limit, past_limit = count_tokens_with_tool_input(59), count_tokens_with_tool_input(60)
    assert (json_depth(at_limit), json_depth(past_limit)) == (MAX_DEPTH, MAX_DEPTH + 1)
    exchange(target, "POST", COUNT_TOKENS, body=at_limit, expect={200})
    exchange(target, "POST", COUNT_TOKENS, body=past_limit, expect={400})


BAD_CONTENT_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                     "application/xml", "", None)  # fmt: skip
GOOD_CONTENT_TYPES = ("application/json", "application/json; charset=utf-8", "Application/JSON",
                      "application/json;charset=UTF-8")  # fmt: skip


@pytest.mark.parametrize("content_type", BAD_CONTENT_TYPES)
@pytest.mark.parametrize("route", POST_ROUTES)
def test_bodies_that_are_not_json_by_content_type_are_415(target, route, content_type):
    headers = {**AUTH} if content_type is None else {**AUTH, "Content-Type": content_type}
    exchange(target, "POST", route, content=encode_body(VALID[route]), headers=headers, expect={415})


@pytest.mark.parametrize("content_type", GOOD_CONTENT_TYPES)
@pytest.mark.parametrize("route", POST_ROUTES)
def test_json_content_types_with_parameters_are_accepted(target, route, content_type):
    exchange(target, "POST", route, content=encode_body(VALID[route]), headers={**AUTH, "Content-Type": content_type},
             expect={200})  # fmt: skip


WRONG_METHODS = [(method, path) for path, allowed in ROUTE_METHODS.items()
                 for method in ("GET", "POST", "PUT", "PATCH", "DELETE", "BREW") if method not in allowed]  # fmt: skip


@pytest.mark.parametrize("method, path", WRONG_METHODS, ids=[f"{m} {p}" for m, p in WRONG_METHODS])
def test_unknown_methods_on_known_routes_are_405(target, method, path):
    exchange(target, method, path, content=b"{}", expect={405})


UNREAD_BODY_ROUTES = [("GET", "/health"), ("GET", "/v1/models"), ("OPTIONS", CHAT), ("DELETE", "/v1/responses/resp_x")]


@pytest.mark.parametrize("method, path", UNREAD_BODY_ROUTES, ids=[f"{m} {p}" for m, p in UNREAD_BODY_ROUTES])
def test_a_body_nobody_reads_does_not_stall_the_next_request(target, method, path):
    """A small body the handler never reads, then another request on the same keep-alive
    connection: the second must be answered every time (it is a race, hence the repeats)."""
    with target.server.http(timeout=2, headers={**AUTH, "Content-Type": "application/json"}) as client:
        for attempt in range(200):
            step = f"{method} {path} with an unread body"
            try:
                client.request(method, path, content=b"{}")
                step = f"GET /health after {step}"
                assert client.get("/health").status_code == 200
            except httpx.TimeoutException:
                raise AssertionError(f"no answer to {step} (attempt {attempt})") from None


def send_raw(target, data: bytes, path: str, expect: set[int]) -> None:
    """Send raw request bytes on a fresh connection and check the app's one answer."""
    with RawConnection(target.server.host, target.server.port, timeout_s=30) as connection:
        connection.send(data)
        answer = connection.read_response()
    assert answer is not None, f"no answer to {data[:200]!r}"
    check_answer(answer.status, answer.headers.get("content-type", ""), answer.body, path,
                 request=f"raw {data[:200]!r} ({len(data)} bytes)", expect=expect)  # fmt: skip


@pytest.mark.parametrize("route", POST_ROUTES)
def test_bodies_over_the_limit_are_413(target, route):
    auth = b"Authorization: Bearer %s\r\n" % KEY.encode()
    padding = b" " * (LIMIT + 1 - len(encode_body(VALID[route])))  # JSON whitespace: valid if ever parsed
    body = encode_body(VALID[route]) + padding
    send_raw(target, raw_request(b"POST", route.encode(), headers=auth, body=body), route, {413})
    pieces = [body[i:i + 8192] for i in range(0, len(body), 8192)]
    send_raw(target, raw_request(b"POST", route.encode(), headers=auth + b"Transfer-Encoding: chunked\r\n",
                                 length=False) + chunked(*pieces), route, {413})  # fmt: skip


SAMPLER_EDGES = [
    {"temperature": 5e-324}, {"temperature": 1e-45}, {"temperature": 1e-40}, {"top_p": 5e-324}, {"min_p": 1.0},
    {"top_k": 1}, {"top_k": 0}, {"repetition_penalty": 0.01}, {"repetition_penalty": 10},
    {"presence_penalty": -2, "frequency_penalty": 2}, {"seed": 2**64}, {"seed": -(2**70)},
]  # fmt: skip
ANTHROPIC_EDGES = [{"temperature": 5e-324}, {"top_p": 5e-324}, {"top_k": 1}, {"seed": 2**64}]
RESPONSES_EDGES = [{"temperature": 5e-324}, {"temperature": 1e-40}, {"top_p": 5e-324}, {"seed": 2**64}]
EDGE_CASES = [*[(CHAT, e) for e in SAMPLER_EDGES], *[(COMPLETIONS, e) for e in SAMPLER_EDGES],
              *[(MESSAGES, e) for e in ANTHROPIC_EDGES], *[(RESPONSES, e) for e in RESPONSES_EDGES]]  # fmt: skip


@pytest.mark.parametrize("route, fields", EDGE_CASES, ids=[f"{r}:{f}" for r, f in EDGE_CASES])
def test_sampler_edge_values(target, route, fields):
    """Allowed but extreme sampler settings: an answer or a 400, never a broken engine."""
    exchange(target, "POST", route, body={**VALID[route], **fields})


def test_a_body_of_exactly_the_limit_is_read(target):
    content = encode_body(VALID[TOKENIZE])
    exchange(target, "POST", TOKENIZE, content=content + b" " * (LIMIT - len(content)), expect={200})


# ---- 3. raw HTTP -------------------------------------------------------------------------------

RAW_CASES = raw_corpus(b"Authorization: Bearer %s\r\n" % KEY.encode(), LIMIT)


@pytest.mark.parametrize("case", RAW_CASES, ids=[case.name for case in RAW_CASES])
def test_raw_http(target, case):
    with RawConnection(target.server.host, target.server.port, timeout_s=30) as connection:
        connection.send(case.data)
        if case.eof:
            connection.half_close()
        answers = [connection.read_response() for _ in case.answers]
        # Hypercorn's own answer to what follows (or to all of it): at once, or never.
        trailing = connection.read_response(timeout_s=0.1 if case.answers else 1.5)
    request = f"raw case {case.name!r}: {case.data[:300]!r}"
    for expected, answer in zip(case.answers, answers):
        assert answer is not None, f"no answer from the app: {request}"
        check_answer(answer.status, answer.headers.get("content-type", ""), answer.body, expected.path,
                     request=request, expect=None if expected.status is None else {expected.status})  # fmt: skip
    if trailing is not None and trailing.status != case.layer_status:
        assert trailing.status < 500, f"a 5xx from the HTTP layer: {request}\n  -> {trailing.status} {trailing.body!r}"
    health = target.http.get("/health")
    assert health.status_code == 200, f"unhealthy after {request}: {health.status_code} {health.text}"


# ---- 4. hang-ups, then: healthy and idle ---------------------------------------------------

# Answers that run for many seconds unless hanging up cancels them (the last test checks).
LONG_ANSWERS = {
    CHAT: {**VALID[CHAT], "max_tokens": 200, "stream": True},
    COMPLETIONS: {**VALID[COMPLETIONS], "max_tokens": 220, "stream": True},
    MESSAGES: {**VALID[MESSAGES], "max_tokens": 200, "stream": True},
    RESPONSES: {**VALID[RESPONSES], "max_output_tokens": 200, "stream": True},
}
AUTH_LINE = b"Authorization: Bearer %s\r\n" % KEY.encode()


@pytest.mark.parametrize("route", list(LONG_ANSWERS))
def test_hanging_up_mid_stream(target, route):
    with RawConnection(target.server.host, target.server.port) as connection:
        connection.send(raw_request(b"POST", route.encode(), headers=AUTH_LINE, body=encode_body(LONG_ANSWERS[route])))
        assert connection.wait_for(b"data:", 30), f"no event from {route}"  # the request is running


@pytest.mark.parametrize("route", list(LONG_ANSWERS))
def test_hanging_up_before_the_answer(target, route):
    body = {**LONG_ANSWERS[route], "stream": False}
    with RawConnection(target.server.host, target.server.port) as connection:
        connection.send(raw_request(b"POST", route.encode(), headers=AUTH_LINE, body=encode_body(body)))
        time.sleep(0.3)  # admitted and generating


def test_hanging_up_mid_body(target):
    body = encode_body(LONG_ANSWERS[CHAT])
    with RawConnection(target.server.host, target.server.port) as connection:
        connection.send(raw_request(b"POST", CHAT.encode(), headers=AUTH_LINE, body=body)[:-10])


IDLE_GAUGES = ("ninfer_requests_running", "ninfer_requests_waiting", "ninfer_requests_paused",
               "ninfer_kv_pages_active", "ninfer_host_snapshot_bytes")  # fmt: skip


def test_last_the_server_is_healthy_and_idle(target):
    """Runs last (tests run in file order): everything above left no trace behind."""
    health = target.http.get("/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}, health.text
    chat = {**VALID[CHAT], "max_tokens": 8, "temperature": 0}
    answer = exchange(target, "POST", CHAT, body=chat, expect={200}).json()
    assert answer["choices"][0]["message"]["content"], answer
    deadline = time.monotonic() + 5  # hung-up requests are cancelled within a step
    while True:
        values = metric_values(exchange(target, "GET", "/metrics").text)
        busy = {name: values[name] for name in IDLE_GAUGES if values[name] != 0}
        if not busy:
            break
        assert time.monotonic() < deadline, f"still busy 5 s after the fuzzing: {busy}"
        time.sleep(0.1)
    assert not target.casualties, f"requests that left the engine unhealthy (each time restarted): {target.casualties}"
