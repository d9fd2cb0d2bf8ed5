"""The prefix cache behind the real server: its flags, its metrics, and exactness under pressure.

The real SmolLM2 model on the numpy reference backend behind a real server on a loopback port,
driven by the official OpenAI SDK and raw HTTP; counters are read back from /metrics.
"""

from __future__ import annotations

import pytest
from server_fixtures import metric_values, running_server, small_settings

from ninfer.cli.main import build_parser
from ninfer.cli.serve import settings_from_args
from ninfer.server.settings import SettingsError

# Distinct ~110-token prompts: each takes 7-8 of the 16-token pages of a 24-page pool.
TOPICS = ["rivers", "mountains", "deserts", "forests", "glaciers"]


def prompt(topic: str) -> str:
    facts = " ".join(f"Fact {i} about {topic}: they matter to fact {i + 1}." for i in range(8))
    return f"{facts} In one word, what are {topic}?"


def ask(client, model_id: str, text: str):
    reply = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": text}],
                                           max_tokens=6, temperature=0)  # fmt: skip
    return reply.choices[0].message.content, reply.usage


def scrape(server) -> dict[str, float]:
    with server.http() as http:
        return metric_values(http.get("/metrics").text)


def test_serve_flags_reach_the_engine_config():
    parser = build_parser()
    on = settings_from_args(parser.parse_args(["serve"]))
    assert on.engine_fields()["prefix_cache"] is True and on.engine_fields()["host_cache_bytes"] == 1024 << 20
    off = settings_from_args(parser.parse_args(["serve", "--no-prefix-reuse", "--host-cache-mib", "0.5"]))
    assert off.engine_fields()["prefix_cache"] is False and off.engine_fields()["host_cache_bytes"] == 1 << 19
    with pytest.raises(SettingsError, match="--host-cache-mib"):
        small_settings(host_cache_mib=-1)


def test_cli_rejects_a_negative_host_cache(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--host-cache-mib", "-3"])
    assert exit_info.value.code == 2
    assert "--host-cache-mib" in capsys.readouterr().err


def test_no_prefix_reuse_serves_every_prompt_cold(smollm2):
    with running_server(small_settings(prefix_reuse=False), smollm2) as server:
        client = server.openai()
        model_id = client.models.list().data[0].id
        first, first_usage = ask(client, model_id, prompt("rivers"))
        second, second_usage = ask(client, model_id, prompt("rivers"))
        metrics = scrape(server)
    assert first == second
    assert first_usage.prompt_tokens_details.cached_tokens == 0 == second_usage.prompt_tokens_details.cached_tokens
    assert metrics["ninfer_cached_prompt_tokens_total"] == 0
    assert metrics["ninfer_prefix_cache_pages"] == 0
    assert metrics["ninfer_prefill_tokens_total"] == first_usage.prompt_tokens + second_usage.prompt_tokens


@pytest.mark.slow
def test_pressure_demotes_restores_and_evicts_with_exact_output(smollm2):
    # 24 device pages; the host tier holds a few pages (a page of SmolLM2 KV is ~0.7 MB in
    # float32), so distinct prompts first demote the oldest cached pages, then evict them.
    settings = small_settings(max_context=256, kv_capacity=384, host_cache_mib=6, max_concurrency=1)
    with running_server(settings, smollm2) as server:
        client = server.openai()
        model_id = client.models.list().data[0].id
        cold, cold_usage = ask(client, model_id, prompt(TOPICS[0]))
        assert cold_usage.prompt_tokens_details.cached_tokens == 0
        ask(client, model_id, prompt(TOPICS[1]))
        ask(client, model_id, prompt(TOPICS[2]))
        pressed = scrape(server)
        assert pressed["ninfer_prefix_demotions_total"] > 0  # the first prompt's pages left the device
        assert pressed["ninfer_prefix_host_pages"] > 0 and pressed["ninfer_prefix_host_bytes"] > 0
        assert pressed["ninfer_kv_pages_active"] == 0

        warm, warm_usage = ask(client, model_id, prompt(TOPICS[0]))
        restored = scrape(server)
        assert warm == cold  # restored KV gives the same greedy answer
        assert warm_usage.prompt_tokens_details.cached_tokens > 0
        assert restored["ninfer_prefix_restores_total"] > pressed["ninfer_prefix_restores_total"]
        assert restored["ninfer_prefix_hits_total"] >= 1

        for topic in TOPICS[3:]:
            ask(client, model_id, prompt(topic))
        final = scrape(server)
    assert final["ninfer_prefix_evictions_total"] > 0  # the bounded host tier dropped its oldest
    assert final["ninfer_prefix_host_bytes"] <= 6 << 20
    assert final["ninfer_prefix_lookups_total"] == len(TOPICS) + 1
    assert final["ninfer_cached_prompt_tokens_total"] >= warm_usage.prompt_tokens_details.cached_tokens


def test_read_only_requests_and_salts_through_every_api(smollm2):
    with running_server(small_settings(), smollm2) as server:
        client = server.openai()
        model_id = client.models.list().data[0].id

        def cached(text: str, **extra) -> int:
            reply = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": text}],
                                                   max_tokens=2, temperature=0, extra_body=extra)  # fmt: skip
            return reply.usage.prompt_tokens_details.cached_tokens

        # A read-only request publishes nothing: the same prompt afterwards finds no cache ...
        assert cached(prompt("rivers"), cache_read_only=True) == 0
        assert cached(prompt("rivers")) == 0
        # ... but it reads what others published.
        assert cached(prompt("rivers"), cache_read_only=True) > 0
        # A salt is a tenant of its own, on every API.
        assert cached(prompt("rivers"), cache_salt="tenant-a") == 0
        anthropic = server.anthropic()
        message = [{"role": "user", "content": prompt("rivers")}]
        first = anthropic.messages.create(model=model_id, messages=message, max_tokens=2,
                                          extra_body={"temperature": 0.0, "cache_salt": "tenant-a"})  # fmt: skip
        assert first.usage.cache_read_input_tokens > 0  # tenant-a's entry from the chat call above
        other = anthropic.messages.create(model=model_id, messages=message, max_tokens=2,
                                          extra_body={"cache_salt": "tenant-b", "cache_read_only": True})  # fmt: skip
        assert (other.usage.cache_read_input_tokens or 0) == 0
        response = client.responses.create(model=model_id, input=prompt("rivers"), max_output_tokens=2,
                                           extra_body={"cache_salt": "tenant-b"})  # fmt: skip
        assert response.usage.input_tokens_details.cached_tokens == 0  # tenant-b's read published nothing
        with server.http() as http:
            bad = http.post("/v1/chat/completions", json={"model": model_id, "messages": message,
                                                          "cache_read_only": "sometimes"})  # fmt: skip
        assert bad.status_code == 400 and "cache_read_only" in bad.json()["error"]["message"]
