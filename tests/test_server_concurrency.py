"""Many streams at once under a KV pool small enough to force pauses, and clients that hang
up. (A graceful SIGTERM of a real server process: test_server_shutdown.py.)"""

from __future__ import annotations

import threading
import time

import pytest
from server_fixtures import metric_values, running_server, small_settings

MODEL = "SmolLM2-135M-Instruct"
NUM_STREAMS = 6
HANG_UP = {1, 4}  # these clients leave after two chunks
MAX_TOKENS = 60


def messages(i: int) -> list[dict]:
    # A distinct system message first, so no two prompts share KV pages through the prefix cache.
    return [{"role": "system", "content": f"You are assistant number {i}. Be brief."},
            {"role": "user", "content": ["Describe a fruit.", "Count to fifty.", "Tell a story.", "Describe a city.",
                                         "Explain gravity.", "Describe the sea."][i]}]  # fmt: skip


@pytest.fixture(scope="module")
def server(smollm2):
    # 8 pages of 16 tokens; two prompts of ~28 tokens with 60-token answers already need 12.
    settings = small_settings(max_context=128, kv_capacity=128, max_concurrency=NUM_STREAMS)
    with running_server(settings, smollm2) as s:
        yield s


def run_stream(server, i: int, results: dict) -> None:
    client = server.openai()
    parts = []
    with client.chat.completions.create(model=MODEL, messages=messages(i), max_tokens=MAX_TOKENS, temperature=0,
                                        stream=True) as stream:  # fmt: skip
        for chunk in stream:
            for choice in chunk.choices:
                parts.append(choice.delta.content or "")
                if choice.finish_reason:
                    results[i] = ("".join(parts), choice.finish_reason)
            if i in HANG_UP and len(parts) >= 2:
                results[i] = ("left", None)
                return  # leaving the block closes the connection mid-answer


def test_streams_under_kv_pressure_with_hang_ups(server):
    with server.http() as http:
        before = metric_values(http.get("/metrics").text)
        results: dict = {}
        threads = [threading.Thread(target=run_stream, args=(server, i, results)) for i in range(NUM_STREAMS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert sorted(results) == list(range(NUM_STREAMS))
        after = wait_for_idle(http)
    assert after["ninfer_preemptions_total"] > before["ninfer_preemptions_total"], "the pool never ran short"
    assert after["ninfer_requests_total{outcome=cancelled}"] - before["ninfer_requests_total{outcome=cancelled}"] == len(HANG_UP)
    # Each surviving stream says exactly what the same greedy request says alone.
    client = server.openai()
    for i in sorted(set(range(NUM_STREAMS)) - HANG_UP):
        alone = client.chat.completions.create(model=MODEL, messages=messages(i), max_tokens=MAX_TOKENS, temperature=0)
        assert results[i] == (alone.choices[0].message.content, alone.choices[0].finish_reason), i


def wait_for_idle(http, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        values = metric_values(http.get("/metrics").text)
        if values["ninfer_kv_pages_active"] == 0 and values["ninfer_requests_running"] == 0 and values["ninfer_requests_paused"] == 0:
            return values
        time.sleep(0.05)
    raise AssertionError(f"the engine never went idle: {values}")
