"""SIGTERM to a real `ninfer serve` process with streams running and requests queued.

Each running stream ends with its API's terminal event (a short one finishes normally, an
endless one gets the "shutting down" error event at the end of the grace period), queued
requests get 503 at once, and the process exits within the grace period plus a second.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
from server_fixtures import metric_values

MODEL = "SmolLM2-135M-Instruct"
GRACE_S = 3.0
SERVER_SCRIPT = f"""
import logging, sys, trio
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from ninfer.server.serve import serve
from ninfer.runtime import RuntimeOptions
from ninfer.sched.config import EngineConfig
from ninfer.server.settings import ServerSettings
trio.run(serve, ServerSettings(model=sys.argv[1], port=0, runtime=RuntimeOptions(backend="reference"),
                               engine=EngineConfig(max_context=512, kv_capacity=2048, max_concurrency=3),
                               shutdown_grace_s={GRACE_S}, log_level="info"))
"""
HI = [{"role": "user", "content": "Hi"}]
# A JSON string of at least 400 characters: far more than the grace period lets it generate.
LONG_SCHEMA = {"type": "object", "properties": {"s": {"type": "string", "minLength": 400}}, "required": ["s"]}
SHORT_CHAT = {"model": MODEL, "messages": HI, "max_tokens": 8, "temperature": 0, "stream": True}
ENDLESS_CHAT = {"model": MODEL, "messages": HI, "max_tokens": 400, "stream": True,
                "response_format": {"type": "json_schema", "json_schema": {"name": "long", "schema": LONG_SCHEMA}}}  # fmt: skip
ENDLESS_MESSAGES = {"model": MODEL, "messages": HI, "max_tokens": 400, "stream": True, "temperature": 0,
                    "system": "Write a very long story."}  # fmt: skip
ANTHROPIC = {"anthropic-version": "2023-06-01"}


def start_process(model_path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", SERVER_SCRIPT, str(model_path)], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    for line in proc.stderr:
        found = re.search(r"serving on (http://\S+)", line)
        if found:
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
            return proc, found.group(1)
    raise AssertionError(f"the server exited early with {proc.wait()}")


class Client(threading.Thread):
    """One request in a thread: the status, and the SSE lines (or the JSON body) it got."""

    def __init__(self, base_url: str, path: str, body: dict, headers: dict | None = None):
        super().__init__(daemon=True)
        self.base_url, self.path, self.body, self.headers = base_url, path, body, headers or {}
        self.status: int | None = None
        self.lines: list[str] = []
        self.data_seen = threading.Event()
        self.answered_s: float | None = None

    def run(self) -> None:
        try:
            with httpx.Client(base_url=self.base_url, timeout=60) as http:
                with http.stream("POST", self.path, json=self.body, headers=self.headers) as reply:
                    self.status = reply.status_code
                    self.answered_s = time.monotonic()
                    for line in reply.iter_lines():
                        self.lines.append(line)
                        if line.startswith("data:"):
                            self.data_seen.set()
        except httpx.HTTPError as e:
            self.lines.append(f"cut: {type(e).__name__}")
        self.data_seen.set()

    def data(self) -> list[dict | str]:
        return [line[len("data: "):] if line == "data: [DONE]" else json.loads(line[len("data: "):])
                for line in self.lines if line.startswith("data: ")]  # fmt: skip


def wait_until_queued(base_url: str, num_waiting: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        values = metric_values(httpx.get(base_url + "/metrics", timeout=10).text)
        if values["ninfer_requests_waiting"] >= num_waiting:
            return
        time.sleep(0.05)
    raise AssertionError("the requests never queued")


def test_sigterm_ends_every_stream_with_its_terminal_event_and_refuses_the_queue(smollm2_path):
    proc, base_url = start_process(smollm2_path)
    try:
        short = Client(base_url, "/v1/chat/completions", SHORT_CHAT)
        endless = Client(base_url, "/v1/chat/completions", ENDLESS_CHAT)
        endless_messages = Client(base_url, "/v1/messages", ENDLESS_MESSAGES, ANTHROPIC)
        running = [short, endless, endless_messages]
        for client in running:
            client.start()
        assert all(client.data_seen.wait(60) for client in running)
        # Every lane is taken: these two wait in the queue.
        queued = [Client(base_url, "/v1/chat/completions", SHORT_CHAT),
                  Client(base_url, "/v1/messages", {**ENDLESS_MESSAGES, "stream": False}, ANTHROPIC)]  # fmt: skip
        for client in queued:
            client.start()
        wait_until_queued(base_url, len(queued))
        sent_s = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for client in [*running, *queued]:
            client.join(timeout=60)
        exit_code = proc.wait(timeout=60)
        exited_s = time.monotonic()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert exit_code == 0
    assert exited_s - sent_s <= GRACE_S + 1.0 + 0.5  # the half second: the interpreter's own exit

    # The queue is refused at once, in each API's shape, with no 200 first.
    for client in queued:
        assert client.status == 503 and client.answered_s - sent_s < GRACE_S / 2, (client.status, client.lines)
    assert json.loads("".join(queued[0].lines))["error"]["code"] == "shutting_down"
    assert json.loads("".join(queued[1].lines))["error"]["type"] == "overloaded_error"

    # A stream that finishes within the grace period ends as usual.
    *chunks, done = short.data()
    assert done == "[DONE]" and chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")

    # The endless ones end with their API's error event, not a silent cut.
    *chunks, error, done = endless.data()
    assert done == "[DONE]" and error["error"]["code"] == "shutting_down", endless.lines[-4:]
    assert "shutting down" in error["error"]["message"]
    last_event = [line for line in endless_messages.lines if line.startswith("event: ")][-1]
    *_, error = endless_messages.data()
    assert last_event == "event: error" and error["type"] == "error"
    assert "shutting down" in error["error"]["message"]
