"""`ninfer serve` listens before it is ready: 503 "loading" (in each API's error shape) while the
model loads and the runner warms up, then 200. Real model file, real server on a loopback port."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import trio
from server_fixtures import small_settings

from ninfer.server.serve import serve


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_loading_then_ready(smollm2_path):
    port = _free_port()
    settings = small_settings(port=port, model=str(smollm2_path))
    stop = threading.Event()

    def run_server():
        async def main():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve, settings)
                await trio.to_thread.run_sync(stop.wait)
                nursery.cancel_scope.cancel()

        trio.run(main)

    thread = threading.Thread(target=run_server, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    seen, chat, messages = [], None, None
    try:
        deadline = time.monotonic() + 180
        with httpx.Client(timeout=30) as client:
            while time.monotonic() < deadline:
                try:
                    r = client.get(base + "/health")
                except httpx.TransportError:
                    time.sleep(0.01)  # not listening yet
                    continue
                seen.append((r.status_code, r.json()))
                if r.status_code == 200:
                    break
                if chat is None:
                    chat = client.post(base + "/v1/chat/completions", json={"model": "m", "messages": []})
                    messages = client.post(base + "/v1/messages", json={"model": "m", "max_tokens": 1, "messages": []})
                time.sleep(0.01)
            ready = client.get(base + "/v1/models")
    finally:
        stop.set()
        thread.join(timeout=60)

    statuses = [status for status, _ in seen]
    assert statuses[-1] == 200 and seen[-1][1]["status"] == "ok"
    assert 503 in statuses and statuses.index(200) > statuses.index(503)  # loading comes first, never after
    loading = [body for status, body in seen if status == 503]
    assert all(body["status"] == "loading" and body["stage"] for body in loading)
    assert chat.status_code == 503 and chat.headers["retry-after"]
    assert chat.json()["error"]["code"] == "model_loading" and "loading" in chat.json()["error"]["message"]
    assert messages.status_code == 503 and messages.json()["type"] == "error"
    assert messages.json()["error"]["type"] == "overloaded_error"
    assert ready.status_code == 200 and ready.json()["data"]
