"""The cluster's pure parts, no Ray needed: route keys (rendered with the real SmolLM2 tokenizer
and template, checked against the prefix cache's own keys), the routing policy, the metrics merge,
the virtual-time simulation of many replicas, and `ninfer cluster` without Ray installed."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from hybrid_models import hybrid  # noqa: F401 (fixture)
from server_fixtures import metric_values

from ninfer.cache.pages import PagePool
from ninfer.cluster.launch import auto_backend
from ninfer.cache.prefix_index import PrefixIndex, salt_bytes
from ninfer.cluster.metrics_text import merge_expositions
from ninfer.cluster.prompt_keys import PromptKeyer, PromptModel, engine_model_salt, load_prompt_model, serve_page_size
from ninfer.cluster.routing import (
    DEFAULT_PAGE_SIZE, PageKeying, RouteReason, RoutingPolicy, choose, key_of, page_route_key, rank_replicas,
)  # fmt: skip
from ninfer.cluster.simulate import ChatTrace, ReplicaModel, generate_trace, simulate_cluster

CHAT = "/v1/chat/completions"
# A system prompt of more than 5 pages (80 tokens) of SmolLM2's tokenizer.
SYSTEM = {"role": "system", "content": "You are a careful assistant for a shipping company. Answer questions about "
          "parcels, delivery times, customs forms and returns. Be brief, be polite, never invent tracking "
          "numbers, and ask for the order number when you need it. Parcels to islands take two extra days; "
          "refunds go back to the card that paid, within five working days of the return's arrival."}  # fmt: skip
FIRST = {"role": "user", "content": "Where is my parcel?"}


def chat(*messages, **extra) -> dict:
    return {"model": "m", "messages": list(messages), **extra}


@pytest.fixture(scope="module")
def keyer(smollm2) -> PromptKeyer:
    model = PromptModel(smollm2.spec, smollm2.tokenizer, smollm2.chat_template)
    return PromptKeyer(model, engine_model_salt(smollm2.spec, "reference"), PageKeying(route_pages=4))


def rendered_ids(smollm2, messages) -> list[int]:
    """The prompt's token ids as the server's chat path makes them, computed here directly."""
    text = smollm2.chat_template.render(messages, tools=None, add_generation_prompt=True)
    return list(smollm2.tokenizer.encode(text, add_special_tokens=False))


def engine_prefix_cache(spec):
    """The prefix cache an engine builds for `spec` on the reference backend (its real salt).
    The runner is left unbuilt: the cache reads only its spec, page geometry and class name."""
    from ninfer.gpu.reference import ReferenceRunner
    from ninfer.sched.config import EngineConfig
    from ninfer.sched.engine import default_prefix_cache

    runner = ReferenceRunner.__new__(ReferenceRunner)
    runner.spec, runner.page_size, runner.num_pages, runner.dtype = spec, DEFAULT_PAGE_SIZE, 64, np.dtype(np.float32)
    return default_prefix_cache(EngineConfig(), runner)


# ---- route keys --------------------------------------------------------------------------


def test_the_route_key_is_the_prefix_caches_key_of_the_nth_page(smollm2, keyer):
    ids = rendered_ids(smollm2, [SYSTEM, FIRST])
    assert len(ids) > 5 * 16
    for salt in (None, "tenant-a"):
        key = keyer.route_key(CHAT, json.dumps(chat(SYSTEM, FIRST, cache_salt=salt)).encode())
        # The engine's own prefix cache, given the prompt's pages: its entry for page 4.
        cache, pool = engine_prefix_cache(smollm2.spec), PagePool(64)
        chain = cache.insert(ids, pool.allocate(len(ids) // 16 + 1), salt, pool)
        assert key == chain[3].key
        # And through PrefixIndex by hand, with the salt spelled out as the engine spells it.
        model_salt = f"{smollm2.spec!r}|ReferenceRunner|".encode()
        index = PrefixIndex(16)
        keys = list(index.keys_after(index.root_key(salt_bytes(model_salt, salt)), np.asarray(ids), 0))
        assert key == keys[3]


def test_conversations_that_share_a_system_prompt_share_a_key(keyer):
    other = {"role": "user", "content": "How do I return a broken kettle?"}
    assert keyer.route_key(CHAT, chat(SYSTEM, FIRST)) == keyer.route_key(CHAT, chat(SYSTEM, other)) is not None
    # With keys deep enough to reach the user turn, they part.
    deep = PromptKeyer(keyer.model, keyer.model_salt, PageKeying(route_pages=64))
    assert deep.route_key(CHAT, chat(SYSTEM, FIRST)) != deep.route_key(CHAT, chat(SYSTEM, other))


def test_a_cache_salt_hashes_apart(keyer):
    base = keyer.route_key(CHAT, chat(SYSTEM, FIRST))
    a = keyer.route_key(CHAT, chat(SYSTEM, FIRST, cache_salt="tenant-a"))
    b = keyer.route_key(CHAT, chat(SYSTEM, FIRST, cache_salt="tenant-b"))
    assert len({base, a, b}) == 3


def test_every_turn_of_a_conversation_has_the_same_key(keyer):
    for system in (SYSTEM, {"role": "system", "content": "Be terse."}):  # a first turn of 4 pages, and of fewer
        turn1 = chat(system, FIRST)
        turn2 = chat(system, FIRST, {"role": "assistant", "content": "It left the depot this morning."},
                     {"role": "user", "content": "When will it arrive? " * 20}, max_tokens=5, stream=True)  # fmt: skip
        turn3 = chat(*turn2["messages"], {"role": "assistant", "content": "Tomorrow."},
                     {"role": "user", "content": "Ok."})  # fmt: skip
        keys = [keyer.route_key(CHAT, json.dumps(t).encode()) for t in (turn1, turn2, turn3)]
        assert keys[0] is not None and keys.count(keys[0]) == 3
    # A short first turn is keyed on its own full pages, so its conversations spread out.
    short = {"role": "system", "content": "Be terse."}
    hi = {"role": "user", "content": "Hi"}
    assert keyer.route_key(CHAT, chat(short, FIRST)) != keyer.route_key(CHAT, chat(short, hi))


def test_the_apis_render_one_conversation_to_one_key(keyer):
    openai_key = keyer.route_key(CHAT, chat(SYSTEM, FIRST, cache_salt="t"))
    anthropic = {"model": "m", "max_tokens": 8, "system": SYSTEM["content"], "messages": [FIRST], "cache_salt": "t"}
    responses = {"model": "m", "instructions": SYSTEM["content"], "input": FIRST["content"], "cache_salt": "t"}
    assert keyer.route_key("/v1/messages", anthropic) == openai_key
    assert keyer.route_key("/v1/responses", responses) == openai_key
    # A stored conversation lives on one replica: no key, routed by load.
    assert keyer.route_key("/v1/responses", {**responses, "previous_response_id": "resp_1"}) is None


def test_other_routes_key_their_prompts(smollm2, keyer):
    text = "Once upon a time, in a land far away, there lived a lighthouse keeper. " * 6
    ids = list(smollm2.tokenizer.encode(text, add_special_tokens=True))
    assert len(ids) > 64
    completion = keyer.route_key("/v1/completions", {"model": "m", "prompt": text, "cache_salt": "t"})
    assert completion == page_route_key(ids, keyer.model_salt, "t", depth=4)
    as_ids = keyer.route_key("/v1/completions", {"model": "m", "prompt": ids})
    assert as_ids == page_route_key(ids, keyer.model_salt, None, depth=4)
    # A rerank is keyed on the prefix its documents share (the query's), whatever the documents.
    query = "which parcel carrier delivers on sundays in the north of the country?"
    a = keyer.route_key("/v1/rerank", {"model": "m", "query": query, "documents": ["Post A delivers daily.", "B"]})
    b = keyer.route_key("/v1/rerank", {"model": "m", "query": query, "documents": ["Carrier C, weekdays only."]})
    c = keyer.route_key("/v1/rerank", {"model": "m", "query": "something else, about cats", "documents": ["x"]})
    assert a == b is not None and c != a
    # A score call is keyed on its messages, whatever its questions: as a chat with that system prompt.
    score = {"model": "m", "messages": [SYSTEM], "candidates": ["yes", "no"],
             "questions": [{"id": "q", "content": "Is it late?"}]}  # fmt: skip
    other = {**score, "questions": [{"id": "1", "content": "Lost?"}, {"id": "2", "content": "Lost too?"}]}
    assert keyer.route_key("/v1/score", score) == keyer.route_key("/v1/score", other) == keyer.route_key(
        CHAT, chat(SYSTEM, FIRST)) is not None  # fmt: skip


def test_requests_without_a_prompt_of_a_page_have_no_key(keyer):
    assert keyer.route_key("/v1/completions", {"model": "m", "prompt": "Hi"}) is None  # shorter than a page
    assert keyer.route_key(CHAT, b"") is None and keyer.route_key(CHAT, b"not json") is None
    assert keyer.route_key(CHAT, {"model": "m", "messages": []}) is None  # the replica refuses it
    assert keyer.route_key("/v1/embeddings", {"model": "m", "input": "x" * 500}) is None
    assert keyer.route_key("/v1/models", b"") is None


def test_the_ingress_reads_the_models_metadata_as_the_replicas_load_it(smollm2, smollm2_path):
    model = load_prompt_model(smollm2_path)  # GGUF metadata only
    assert repr(model.spec) == repr(smollm2.spec)  # so the salt is the engine's
    messages = [SYSTEM, FIRST]
    assert model.chat_template.render(messages, add_generation_prompt=True) == smollm2.chat_template.render(
        messages, add_generation_prompt=True)  # fmt: skip
    assert serve_page_size(()) == DEFAULT_PAGE_SIZE == engine_page_size()
    assert serve_page_size(("--max-concurrency", "4", "--page-size", "32")) == 32
    assert serve_page_size(("--page-size=8",)) == 8


def engine_page_size() -> int:
    from ninfer.sched.config import EngineConfig

    return EngineConfig().page_size


# ---- the policy ----------------------------------------------------------------------------


def test_a_key_goes_to_its_rendezvous_replica_until_it_is_past_the_threshold():
    key = key_of("a conversation")
    ids = ["r0", "r1", "r2", "r3"]
    preferred = rank_replicas(key, ids)[0]
    loads = dict.fromkeys(ids, 0)
    policy = RoutingPolicy(spill_threshold=3)
    assert choose(key, loads, policy).ranked[0] == preferred
    assert choose(key, loads, policy).reason is RouteReason.PREFIX
    loads[preferred] = 3
    loads[ids[ids.index(preferred) - 1]] = 1
    spilled = choose(key, loads, policy)
    assert spilled.reason is RouteReason.FALLBACK and spilled.ranked[0] != preferred
    assert loads[spilled.ranked[0]] == 0 and spilled.ranked[-1] == preferred
    assert choose(key, loads, RoutingPolicy(spill_threshold=None)).ranked[0] == preferred


def test_no_spill_when_every_replica_is_as_busy():
    key = key_of("a conversation")
    choice = choose(key, {"a": 5, "b": 5}, RoutingPolicy(spill_threshold=2))
    assert choice.reason is RouteReason.PREFIX and choice.ranked[0] == rank_replicas(key, ["a", "b"])[0]


def test_no_key_goes_to_the_least_loaded_replica():
    choice = choose(None, {"a": 4, "b": 1, "c": 2}, RoutingPolicy())
    assert choice.reason is RouteReason.LOAD and choice.ranked == ("b", "c", "a")


def test_adding_a_replica_moves_only_the_keys_it_wins():
    keys = [key_of(f"question {i}") for i in range(400)]
    before = {k: rank_replicas(k, ["a", "b", "c"])[0] for k in keys}
    after = {k: rank_replicas(k, ["a", "b", "c", "d"])[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == "d" for k in moved) and 50 < len(moved) < 150  # about a quarter


def test_a_bad_threshold_is_refused_in_a_sentence():
    with pytest.raises(ValueError, match="spill_threshold must be at least 1"):
        RoutingPolicy(spill_threshold=0)


# ---- metrics ------------------------------------------------------------------------------


def test_replica_metrics_merge_into_one_valid_exposition():
    text = ("# HELP ninfer_x_total X.\n# TYPE ninfer_x_total counter\nninfer_x_total{route=\"/a\"} 1.0\n"
            "# HELP ninfer_y Y.\n# TYPE ninfer_y gauge\nninfer_y 2.0\n")  # fmt: skip
    merged = merge_expositions({"r1": text, "r2": text.replace("1.0", "3.0")})
    values = metric_values(merged)  # the official parser: one family each, all samples labelled
    assert values == {"ninfer_x_total{replica=r1,route=/a}": 1.0, "ninfer_x_total{replica=r2,route=/a}": 3.0,
                      "ninfer_y{replica=r1}": 2.0, "ninfer_y{replica=r2}": 2.0}  # fmt: skip
    assert merged.count("# TYPE ninfer_x_total") == 1


# ---- the simulation ----------------------------------------------------------------------

TRACE = ChatTrace(conversations_per_replica=15, rate_per_replica=1.0, num_tenants=6, turns=4, seed=3)


@pytest.fixture(scope="module")
def requests():
    return generate_trace(TRACE, 8)


def test_prefix_routing_beats_round_robin_and_least_loaded_on_hit_rate(requests):
    prefix = simulate_cluster(requests, 8, "prefix")
    for other in ("round-robin", "least-loaded"):
        figures = simulate_cluster(requests, 8, other)
        assert prefix.hit_rate > figures.hit_rate + 0.1, (prefix, figures)
        assert prefix.ttft_p50_s < figures.ttft_p50_s
    assert prefix.routed["prefix"] > 0.9 * len(requests)


def test_the_spill_threshold_bounds_imbalance_and_tail_latency():
    # Few tenants, heavy load: pure affinity piles conversations onto unlucky replicas.
    trace = ChatTrace(conversations_per_replica=30, rate_per_replica=1.5, seed=0)
    requests = generate_trace(trace, 8)
    sticky = simulate_cluster(requests, 8, "prefix", routing=RoutingPolicy(spill_threshold=None))
    spilling = simulate_cluster(requests, 8, "prefix", routing=RoutingPolicy(spill_threshold=4))
    assert sticky.routed["fallback"] == 0 and spilling.routed["fallback"] > 0
    assert spilling.imbalance < sticky.imbalance
    assert spilling.ttft_p99_s < sticky.ttft_p99_s / 2


def test_the_simulation_is_deterministic(requests):
    assert simulate_cluster(requests, 8, "prefix") == simulate_cluster(requests, 8, "prefix")
    assert generate_trace(TRACE, 8) == requests


def test_every_turn_follows_the_one_before(requests):
    by_conversation = {}
    for r in requests:
        by_conversation.setdefault(r.conversation, []).append(r)
    for turns in by_conversation.values():
        assert [t.turn for t in turns] == list(range(TRACE.turns))
        for a, b in zip(turns, turns[1:]):
            assert b.arrival_s > a.arrival_s and b.history_tokens == a.history_tokens + a.user_tokens + a.output_tokens


def test_a_replica_caches_what_it_served():
    # One replica, one conversation: every later turn hits its whole history.
    requests = generate_trace(ChatTrace(conversations_per_replica=1, turns=3, seed=1), 1)
    figures = simulate_cluster(requests, 1, "prefix", model=ReplicaModel(cache_tokens=10**6))
    prompt = sum(r.prompt_tokens for r in requests)
    expected = sum(min(r.system_tokens + r.history_tokens, r.prompt_tokens - 1) for r in requests[1:])
    assert figures.hit_rate == pytest.approx(expected / prompt)


def test_cluster_sim_prints_a_table():
    from ninfer.cli.main import main

    out = subprocess.run([sys.executable, "-m", "ninfer.cli.main", "cluster-sim", "--replicas", "4",
                          "--conversations-per-replica", "5"], capture_output=True, text=True, check=True)  # fmt: skip
    lines = out.stdout.splitlines()
    assert "hit rate" in lines[0] and len(lines) == 4
    assert [line.split()[1] for line in lines[1:]] == ["prefix", "round-robin", "least-loaded"]
    assert main is not None


# ---- without Ray ----------------------------------------------------------------------------

_NO_RAY = "import sys; sys.modules['ray'] = None  # any `import ray` now fails\n"


def test_ninfer_imports_and_runs_without_ray():
    code = _NO_RAY + (
        "from ninfer.cli.main import build_parser\n"
        "build_parser().parse_args(['serve'])\n"
        "import ninfer.cluster.routing, ninfer.cluster.simulate\n"
        "print(sorted(m for m in sys.modules if m.startswith('ray')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['ray']"  # only the blocker itself


def test_ninfer_cluster_without_ray_says_how_to_install_it():
    code = _NO_RAY + "from ninfer.cli.main import main\nsys.exit(main(['cluster', '--replicas', '2']))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 2
    assert "pip install 'ninfer[cluster]'" in out.stderr and "Traceback" not in out.stderr


def test_auto_picks_what_serve_picks_without_a_gpu(smollm2_path, hybrid):
    """`ninfer cluster --backend auto`: CUDA on a cluster with GPUs, else the cpu backend for a
    llama-family GGUF and the reference backend for a hybrid (as `ninfer serve` decides)."""
    assert auto_backend(True, str(smollm2_path)) == "cuda"
    assert auto_backend(False, str(smollm2_path)) == "cpu"
    assert auto_backend(False, str(hybrid.gguf_path)) == "reference"
