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

# Distinct prompts of ~142 tokens with the chat template: with 6 answer tokens each request
# takes 9-10 of the 16-token pages, so three of them overflow a 24-page pool.
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
    on = settings_from_args(parser.parse_args(["serve"])).engine
    assert on.prefix_cache is True and on.host_cache_bytes == 1024 << 20
    off = settings_from_args(parser.parse_args(["serve", "--no-prefix-reuse", "--host-cache-mib", "0.5"])).engine
    assert off.prefix_cache is False and off.host_cache_bytes == 1 << 19
    # lookahead: on unless --no-lookahead, and it reaches the engine's config
    assert on.lookahead is True and off.lookahead is True
    no_ahead = settings_from_args(parser.parse_args(["serve", "--no-lookahead"])).engine
    assert no_ahead.lookahead is False


@pytest.mark.parametrize("flags, expected", [([], "q8"), (["--activations", "f32"], "f32")])
def test_serve_activations_flag_reaches_create_runner(monkeypatch, flags, expected):
    import functools

    import trio

    import ninfer.runtime
    from ninfer.runtime import ConfigError
    from ninfer.server.serve import serve

    settings = settings_from_args(build_parser().parse_args(["serve", "--backend", "reference", *flags]))
    assert settings.runtime.activations == expected
    seen = []

    def fake_create_runner(model, options, config):
        seen.append((model, options))
        raise ConfigError("stopped before building a runner")

    monkeypatch.setattr(ninfer.runtime, "create_runner", fake_create_runner)
    model = object()  # never looked at: create_runner is the first thing serve() hands it to
    with pytest.raises(ConfigError, match="stopped before building a runner"):
        trio.run(functools.partial(serve, settings, model=model, handle_signals=False))
    assert [(m, o.backend, o.activations) for m, o in seen] == [(model, "reference", expected)]


def test_settings_reject_unknown_activations():
    with pytest.raises(SettingsError, match="--activations must be one of f32, q8, got 'q4'"):
        small_settings(activations="q4")


@pytest.mark.parametrize("flags", [["--host-cache-mib", "-3"], ["--host-cache-mib", "inf"], ["--max-request-mib", "nan"]])
def test_cli_rejects_negative_or_infinite_sizes(capsys, flags):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", *flags])
    assert exit_info.value.code == 2
    assert flags[0] in capsys.readouterr().err


def test_settings_reject_bad_sizes_where_they_are_declared():
    from ninfer.sched.config import EngineConfig

    with pytest.raises(SettingsError, match="--max-request-mib"):
        small_settings(max_request_mib=float("nan"))
    with pytest.raises(SettingsError, match="host_cache_bytes"):  # EngineConfig declares the host tier
        EngineConfig(host_cache_bytes=-3 << 20)


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


def cached_tokens(server, api: str, text: str, **extra) -> int:
    """Prompt tokens served from the cache for one 2-token request through `api`."""
    client, model_id = server.openai(), "SmolLM2-135M-Instruct"
    if api == "chat":
        reply = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": text}],
                                               max_tokens=2, temperature=0, extra_body=extra)  # fmt: skip
        return reply.usage.prompt_tokens_details.cached_tokens
    if api == "completions":
        reply = client.completions.create(model=model_id, prompt=text, max_tokens=2, temperature=0, extra_body=extra)
        return reply.usage.prompt_tokens_details.cached_tokens
    if api == "messages":
        reply = server.anthropic().messages.create(model=model_id, messages=[{"role": "user", "content": text}],
                                                   max_tokens=2, extra_body={"temperature": 0.0, **extra})  # fmt: skip
        return reply.usage.cache_read_input_tokens or 0
    reply = client.responses.create(model=model_id, input=text, max_output_tokens=2, extra_body=extra)
    return reply.usage.input_tokens_details.cached_tokens


@pytest.fixture(scope="module")
def server(smollm2):
    with running_server(small_settings(), smollm2) as s:
        yield s


@pytest.mark.parametrize("api", ["chat", "completions", "messages", "responses"])
def test_read_only_requests_and_salts_through_every_api(server, api):
    text, salt = prompt("rivers"), f"tenant-{api}"  # a tenant per API: the tests share one server
    # A read-only request publishes nothing: the same prompt afterwards finds nothing ...
    assert cached_tokens(server, api, text, cache_salt=salt, cache_read_only=True) == 0
    assert cached_tokens(server, api, text, cache_salt=salt) == 0
    # ... but it reads what others published.
    assert cached_tokens(server, api, text, cache_salt=salt, cache_read_only=True) > 0
    # Another salt is another tenant; null means "not read-only".
    assert cached_tokens(server, api, text, cache_salt=salt + "-other", cache_read_only=None) == 0
    assert cached_tokens(server, api, text, cache_salt=salt + "-other") > 0


def test_chat_and_messages_share_a_tenants_entries(server):
    # The same conversation renders to the same prompt through both APIs.
    text = prompt("deserts")
    assert cached_tokens(server, "chat", text, cache_salt="shared") == 0
    assert cached_tokens(server, "messages", text, cache_salt="shared") > 0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
def test_a_non_boolean_cache_read_only_is_a_400(server, path):
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 2, "cache_read_only": "sometimes"}
    body |= {"input": "hi"} if path == "/v1/responses" else {"messages": [{"role": "user", "content": "hi"}]}
    with server.http() as http:
        bad = http.post(path, json=body, headers={"anthropic-version": "2023-06-01"})
    assert bad.status_code == 400
    assert "cache_read_only" in bad.text
