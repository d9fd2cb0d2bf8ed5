"""`ninfer cluster` end to end: a local Ray instance, two CPU replicas of the real SmolLM2 model
on the reference backend, driven by the official OpenAI and Anthropic SDKs through the cluster's
one HTTP address. One cluster for the module (Ray's start-up is the slow part); the test that
kills an engine runs last."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

pytest.importorskip("ray", reason="Ray Serve is the optional `cluster` extra: pip install -e '.[cluster]'")
pytest.importorskip("ray.serve", reason="Ray Serve is the optional `cluster` extra: pip install -e '.[cluster]'")

import httpx  # noqa: E402
import openai  # noqa: E402
from server_fixtures import metric_values  # noqa: E402

from ninfer.cluster.prompt_keys import PromptKeyer  # noqa: E402
from ninfer.cluster.routing import rank_replicas  # noqa: E402

LANES = 2  # each engine's --max-concurrency, and the spill threshold


@pytest.fixture(scope="module")
def cluster(smollm2_path):
    from ninfer.cluster import launch
    from ninfer.cluster.deployments import ClusterOptions
    from ninfer.cluster.engine import free_loopback_port

    flags = ("--max-context", "512", "--kv-capacity", "4096", "--max-concurrency", str(LANES),
             "--log-level", "warning", "--no-webui", "--host-cache-mib", "0")  # fmt: skip
    options = ClusterOptions(model=str(smollm2_path), serve_flags=flags, backend="reference", num_replicas=2,
                             num_cpus_per_replica=1, spill_threshold=LANES, health_check_period_s=1.0)  # fmt: skip
    ray_options = launch.RayOptions(num_cpus=4, object_store_mib=80, port=free_loopback_port())
    _, url = launch.start(options, ray_options)
    try:
        yield url
    finally:
        launch.stop()


@pytest.fixture
def client(cluster):
    return openai.OpenAI(base_url=cluster + "/v1", api_key="none", max_retries=0, timeout=120)


def replicas(url: str) -> list[dict]:
    return httpx.get(url + "/cluster/replicas", timeout=30).json()["replicas"]


def ask(client, messages, **kwargs):
    raw = client.chat.completions.with_raw_response.create(model="default", messages=messages, temperature=0,
                                                           **{"max_tokens": 8, **kwargs})  # fmt: skip
    return raw.headers["x-ninfer-replica"], raw.parse()


def test_the_sdks_get_answers_through_the_cluster(cluster, client):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    _, reply = ask(client, question)
    assert "Paris" in reply.choices[0].message.content
    chunks = list(client.chat.completions.create(model="default", messages=question, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))  # fmt: skip
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == reply.choices[0].message.content  # greedy: the same answer, token by token
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    import anthropic

    claude = anthropic.Anthropic(base_url=cluster, api_key="none", max_retries=0, timeout=120)
    with claude.messages.stream(model="default", max_tokens=8, messages=question) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text and final.stop_reason in ("end_turn", "max_tokens")


def test_a_conversation_stays_on_one_replica_and_its_cache_grows(client):
    messages = [{"role": "system", "content": "You answer in one short sentence. " * 4},
                {"role": "user", "content": "Tell me about the Moon."}]  # fmt: skip
    seen, cached = set(), []
    for follow_up in ("And the Sun?", "And Mars?"):
        replica, reply = ask(client, messages)
        seen.add(replica)
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": follow_up}]  # fmt: skip
    replica, reply = ask(client, messages)
    seen.add(replica)
    cached.append(reply.usage.prompt_tokens_details.cached_tokens)
    assert len(seen) == 1, seen
    assert cached[1] > 0 and cached[2] > cached[1], cached  # as on a single server
    # Another tenant's identical conversation shares no cache entry, wherever it lands.
    _, salted = ask(client, messages[:2], extra_body={"cache_salt": "another-tenant"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


def test_metrics_are_labelled_by_replica_and_count_routes(cluster):
    values = metric_values(httpx.get(cluster + "/metrics", timeout=30).text)
    ids = {r["replica"] for r in replicas(cluster)}
    labelled = {k.split("replica=")[1].split(",")[0].rstrip("}") for k in values if "replica=" in k}
    assert labelled == ids
    assert values["ninfer_cluster_routed_total{reason=prefix}"] >= 4
    assert values["ninfer_cluster_replicas"] == 2


def test_overload_on_one_replica_spills_to_the_other(cluster, client):
    before = metric_values(httpx.get(cluster + "/metrics", timeout=30).text)
    messages = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
    landed: list[str] = []

    def stream_one():
        raw = client.chat.completions.with_raw_response.create(
            model="default", messages=messages, max_tokens=48, temperature=0, stream=True,
            extra_body={"ignore_eos": True})  # fmt: skip
        landed.append(raw.headers["x-ninfer-replica"])
        for _ in raw.parse():
            pass

    threads = [threading.Thread(target=stream_one) for _ in range(2 * LANES)]
    for thread in threads:
        thread.start()
        time.sleep(0.3)  # in order: the first LANES fill the conversation's replica
    for thread in threads:
        thread.join(120)
    assert len(landed) == 2 * LANES and len(set(landed)) == 2, landed
    after = metric_values(httpx.get(cluster + "/metrics", timeout=30).text)
    key = "ninfer_cluster_routed_total{reason=fallback}"
    assert after[key] > before[key]


def test_killing_an_engine_fails_its_stream_alone_and_the_replica_comes_back(cluster, client, smollm2_path):
    ids = sorted(r["replica"] for r in replicas(cluster))
    pids = {r["replica"]: r["engine_pid"] for r in replicas(cluster)}
    # Two conversations the router sends to different replicas (the keys and ranking it computes).
    keyer = PromptKeyer.load(str(smollm2_path), "reference")
    conversations = [[{"role": "user", "content": f"Describe city number {i} in detail."}] for i in range(40)]
    owner = {}
    for messages in conversations:
        key = keyer.route_key("/v1/chat/completions", {"model": "default", "messages": messages})
        owner.setdefault(rank_replicas(key, ids)[0], messages)
    victim_messages, survivor_messages = owner[ids[0]], owner[ids[1]]

    def open_stream(messages):
        raw = client.chat.completions.with_raw_response.create(
            model="default", messages=messages, max_tokens=120, temperature=0, stream=True,
            extra_body={"ignore_eos": True})  # fmt: skip
        return raw.headers["x-ninfer-replica"], iter(raw.parse())

    victim_replica, victim = open_stream(victim_messages)
    survivor_replica, survivor = open_stream(survivor_messages)
    assert (victim_replica, survivor_replica) == (ids[0], ids[1])
    next(victim), next(survivor)  # both streams are running
    os.kill(pids[victim_replica], signal.SIGKILL)
    with pytest.raises(openai.APIError, match="engine"):
        for _ in victim:
            pass
    finishes = [c.choices[0].finish_reason for c in survivor if c.choices]
    assert finishes[-1] == "length"  # the other replica's stream never noticed
    # Serve's health check replaces the replica: a new engine, and requests work again.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        now = replicas(cluster)
        alive = [r for r in now if r.get("engine_alive")]
        if len(alive) == 2 and pids[victim_replica] not in {r["engine_pid"] for r in alive}:
            break
        time.sleep(1)
    else:
        pytest.fail(f"the replica did not come back: {now}")
    _, reply = ask(client, victim_messages)
    assert reply.choices[0].finish_reason in ("stop", "length")
