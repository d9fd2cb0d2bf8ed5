"""`ninfer bench serve` against a real server on a loopback port, and the `ignore_eos` it relies on."""

from __future__ import annotations

import json

import httpx
import pytest
from server_fixtures import running_server, small_settings

from ninfer.cli import bench_serve


@pytest.fixture(scope="module")
def server(smollm2):
    with running_server(small_settings(max_concurrency=4), smollm2) as s:
        yield s


def _bench(server, tmp_path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "bench.json"
    rc = bench_serve.main(["--url", server.base_url, "--json", str(out), *extra])
    return rc, json.loads(out.read_text())


def test_bench_serve_reports_each_level_and_pass(server, tmp_path):
    rc, report = _bench(server, tmp_path, "--concurrency", "1,3", "--num-requests", "3", "--passes", "2",
                        "--prompt-tokens", "24", "--output-tokens", "5")  # fmt: skip
    assert rc == 0
    rows = report["results"]
    assert [(r["concurrency"], r["pass"]) for r in rows] == [(1, "first"), (1, "steady"), (3, "first"), (3, "steady")]
    for row in rows:
        s = row["summary"]
        assert s["requests"] == 3 and s["errors"] == 0
        assert s["output_tokens"] == 3 * 5  # ignore_eos: every request runs to max_tokens
        assert s["ttft_ms"]["p50"] > 0 and s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"]
        assert s["itl_ms"]["p50"] is not None and s["tok_s"] > 0
        assert 20 <= s["prompt_tokens_mean"] <= 80  # ~24 words plus the chat template


def test_bench_serve_shared_prefix_is_cached(server, tmp_path):
    rc, report = _bench(server, tmp_path, "--concurrency", "1", "--num-requests", "3", "--passes", "1",
                        "--shared-prefix-tokens", "96", "--prompt-tokens", "16", "--output-tokens", "2")  # fmt: skip
    assert rc == 0
    summary = report["results"][0]["summary"]
    # one after another: the second and third requests find the ~96-token system prompt cached
    assert summary["cached_tokens_mean"] >= (2 / 3) * 80


def test_bench_serve_counts_errors_and_fails(server, tmp_path):
    rc, report = _bench(server, tmp_path, "--model", "no-such-model", "--concurrency", "2", "--num-requests", "2",
                        "--passes", "1", "--output-tokens", "2")  # fmt: skip
    assert rc == 1
    summary = report["results"][0]["summary"]
    assert summary["errors"] == 2 and summary["output_tokens"] == 0
    assert any("HTTP 404" in e for e in summary["first_errors"])


def test_bench_serve_unreachable_url_is_a_clear_error(capsys):
    rc = bench_serve.main(["--url", "http://127.0.0.1:9", "--passes", "1"])
    assert rc == 1
    assert "cannot reach http://127.0.0.1:9" in capsys.readouterr().err


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_ignore_eos_runs_to_max_tokens(server, route):
    model = httpx.get(server.url("/v1/models")).json()["data"][0]["id"]
    body = {"model": model, "max_tokens": 40, "temperature": 0}
    if route == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "Reply with the single word yes."}]
    else:
        body["prompt"] = "The capital of France is Paris.<|im_end|>"
    plain = httpx.post(server.url(route), json=body, timeout=120).json()
    assert plain["choices"][0]["finish_reason"] == "stop"
    assert plain["usage"]["completion_tokens"] < 40
    forced = httpx.post(server.url(route), json={**body, "ignore_eos": True}, timeout=120).json()
    assert forced["choices"][0]["finish_reason"] == "length"
    assert forced["usage"]["completion_tokens"] == 40
