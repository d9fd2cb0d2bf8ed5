"""Many streams at once under a KV pool small enough to force pauses, clients that hang up,
and a graceful SIGTERM of a real server process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
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


# ---- SIGTERM ---------------------------------------------------------------------------

SERVER_SCRIPT = """
import logging, sys, trio
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from ninfer.server.serve import serve
from ninfer.server.settings import ServerSettings
trio.run(serve, ServerSettings(model=sys.argv[1], port=0, backend="reference", max_context=512, kv_capacity=2048,
                               shutdown_grace_s=3.0, log_level="info"))
"""
ENDLESS = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 400, "stream": True,
           "response_format": {"type": "json_schema", "json_schema": {"name": "long", "schema": {
               "type": "object", "properties": {"s": {"type": "string", "minLength": 400}}, "required": ["s"]}}}}  # fmt: skip


def start_process(model_path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", SERVER_SCRIPT, str(model_path)], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    for line in proc.stderr:
        found = re.search(r"serving on (http://\S+)", line)
        if found:
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
            return proc, found.group(1)
    raise AssertionError(f"the server exited early with {proc.wait()}")


def read_stream(base_url: str, body: dict, lines: list, started: threading.Event) -> None:
    try:
        with httpx.Client(base_url=base_url, timeout=60) as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                lines.append(line)
                if line.startswith("data:"):
                    started.set()
    except httpx.HTTPError as e:
        lines.append(f"cut: {type(e).__name__}")
    started.set()


def test_sigterm_drains_short_streams_and_cuts_endless_ones(smollm2_path):
    proc, base_url = start_process(smollm2_path)
    try:
        short, endless = [], []
        short_started, endless_started = threading.Event(), threading.Event()
        short_body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0, "stream": True}
        threads = [threading.Thread(target=read_stream, args=(base_url, short_body, short, short_started)),
                   threading.Thread(target=read_stream, args=(base_url, ENDLESS, endless, endless_started))]  # fmt: skip
        for t in threads:
            t.start()
        assert short_started.wait(60) and endless_started.wait(60)
        sent_s = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):  # no longer accepting
            httpx.get(base_url + "/health", timeout=5)
        for t in threads:
            t.join(timeout=60)
        assert proc.wait(timeout=60) == 0
        elapsed_s = time.monotonic() - sent_s
    finally:
        if proc.poll() is None:
            proc.kill()
    assert short[-1] == "data: [DONE]" or short[-2:] == ["data: [DONE]", ""], short[-3:]
    assert "data: [DONE]" not in endless  # cut at the end of the grace period
    assert 2.5 <= elapsed_s < 30
