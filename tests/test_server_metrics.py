"""/metrics on a real server: names and types, counters that move with real requests, and a
client that hangs up mid-stream getting its request cancelled and its KV pages freed."""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_fixtures import metric_values, running_server, small_settings

MODEL = "SmolLM2-135M-Instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Name a color."}], "temperature": 0}
# A grammar that cannot end before 400 characters: the request runs until the client leaves.
ENDLESS = {**CHAT, "max_tokens": 400, "stream": True, "response_format": {"type": "json_schema", "json_schema": {
    "name": "long", "schema": {"type": "object", "properties": {"s": {"type": "string", "minLength": 400}}, "required": ["s"]}}}}  # fmt: skip

REQUIRED = {
    "gauge": ["ninfer_requests_running", "ninfer_requests_waiting", "ninfer_requests_paused", "ninfer_kv_pages_used",
              "ninfer_kv_pages_active", "ninfer_kv_pages_capacity"],
    "counter": ["ninfer_prompt_tokens", "ninfer_generation_tokens", "ninfer_cached_prompt_tokens", "ninfer_replayed_tokens",
                "ninfer_preemptions", "ninfer_requests", "ninfer_gc_pause_seconds", "ninfer_gc_collections"],
    "histogram": ["ninfer_time_to_first_token_seconds", "ninfer_inter_token_latency_seconds",
                  "ninfer_e2e_request_latency_seconds", "ninfer_queue_time_seconds"],
}  # fmt: skip


@pytest.fixture(scope="module")
def server(smollm2):
    with running_server(small_settings(max_context=512), smollm2) as s:
        yield s


def scrape(http) -> dict[str, float]:
    response = http.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return metric_values(response.text)


def wait_until(http, predicate, timeout_s: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        values = scrape(http)
        if predicate(values):
            return values
        time.sleep(0.05)
    raise AssertionError(f"metrics never satisfied the condition: {values}")


def test_every_required_metric_has_its_type(server):
    with server.http() as http:
        families = {f.name: f.type for f in text_string_to_metric_families(http.get("/metrics").text)}
    for kind, names in REQUIRED.items():
        for name in names:
            assert families.get(name) == kind, (name, families.get(name))
    values = scrape(server.http())
    assert values["ninfer_kv_pages_capacity"] == 2048 / 16


def test_a_running_server_freezes_the_heap_and_reports_each_collection(server):
    import gc

    from ninfer.server import heap

    assert gc.get_freeze_count() > 0 and gc.get_threshold()[0] == heap.YOUNG_THRESHOLD  # --gc-freeze, the default
    with server.http() as http:
        before = scrape(http)
        gc.collect()  # in this process, the server's
        after = scrape(http)
    full = 'ninfer_gc_collections_total{generation=2}'
    assert after[full] >= before[full] + 1
    assert after['ninfer_gc_pause_seconds_total{generation=2}'] > before['ninfer_gc_pause_seconds_total{generation=2}']


def test_counters_and_histograms_follow_a_request(server):
    with server.http() as http:
        before = scrape(http)
        body = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3}).json()
        usage = body["usage"]
        after = wait_until(http, lambda v: v["ninfer_e2e_request_latency_seconds_count"] > before["ninfer_e2e_request_latency_seconds_count"])

    def delta(name):
        return after[name] - before.get(name, 0.0)

    assert delta("ninfer_prompt_tokens_total") == usage["prompt_tokens"]
    assert delta("ninfer_generation_tokens_total") == usage["completion_tokens"]
    outcome = "length" if body["choices"][0]["finish_reason"] == "length" else "stop"
    assert delta(f"ninfer_requests_total{{outcome={outcome}}}") == 1
    for name in ("ninfer_time_to_first_token_seconds", "ninfer_queue_time_seconds", "ninfer_e2e_request_latency_seconds"):
        assert delta(name + "_count") == 1
        assert after[name + "_sum"] > before.get(name + "_sum", 0.0)
    assert delta("ninfer_inter_token_latency_seconds_count") == usage["completion_tokens"] - 1
    assert after["ninfer_kv_pages_active"] == 0 and after["ninfer_requests_running"] == 0
    assert delta("ninfer_http_requests_total{method=POST,route=/v1/chat/completions,status=200}") == 1


def test_hanging_up_mid_stream_cancels_and_frees_the_pages(server):
    with server.http() as http:
        before = scrape(http)
        with http.stream("POST", "/v1/chat/completions", json=ENDLESS) as stream:
            assert stream.status_code == 200
            data = (line for line in stream.iter_lines() if line.startswith("data:"))
            for _ in range(4):
                next(data)
            busy = scrape(http)
            assert busy["ninfer_requests_running"] == 1 and busy["ninfer_kv_pages_active"] >= 1
        # Leaving the block closed the connection mid-answer.
        cancelled = "ninfer_requests_total{outcome=cancelled}"
        after = wait_until(http, lambda v: v[cancelled] == before[cancelled] + 1)
        assert after["ninfer_kv_pages_active"] == 0 and after["ninfer_requests_running"] == 0
        assert http.get("/health").status_code == 200


def test_a_repeated_prompt_reports_cached_tokens(server):
    body = {**CHAT, "messages": [{"role": "user", "content": "Repeat after me: the quick brown fox jumps."}], "max_tokens": 1}
    with server.http() as http:
        http.post("/v1/chat/completions", json=body).raise_for_status()
        before = scrape(http)
        usage = http.post("/v1/chat/completions", json=body).json()["usage"]
        after = scrape(http)
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < usage["prompt_tokens"]
    assert after["ninfer_cached_prompt_tokens_total"] - before["ninfer_cached_prompt_tokens_total"] == cached
