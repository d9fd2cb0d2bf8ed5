"""The cluster's pure parts, no Ray needed: route keys, the routing policy, the metrics merge,
the virtual-time simulation of many replicas, and `ninfer cluster` without Ray installed."""

from __future__ import annotations

import subprocess
import sys

import pytest
from server_fixtures import metric_values

from ninfer.cluster.metrics_text import merge_expositions
from ninfer.cluster.routing import RouteReason, RoutingPolicy, choose, rank_replicas, route_key
from ninfer.cluster.simulate import ChatTrace, ReplicaModel, generate_trace, simulate_cluster

SYSTEM = {"role": "system", "content": "You are terse."}
FIRST = {"role": "user", "content": "Name a river."}


def chat(*messages, **extra) -> dict:
    return {"model": "m", "messages": list(messages), **extra}


# ---- route keys --------------------------------------------------------------------------


def test_every_turn_of_a_conversation_has_the_same_key():
    turn1 = chat(SYSTEM, FIRST)
    turn2 = chat(SYSTEM, FIRST, {"role": "assistant", "content": "Nile."}, {"role": "user", "content": "Another."},
                 max_tokens=5, stream=True)  # fmt: skip
    assert route_key(turn1) == route_key(turn2) is not None
    assert route_key(turn1) == route_key(__import__("json").dumps(turn1).encode())


def test_keys_differ_by_conversation_and_by_tenant():
    base = route_key(chat(SYSTEM, FIRST))
    assert route_key(chat(SYSTEM, {"role": "user", "content": "Name a lake."})) != base
    assert route_key(chat(SYSTEM, FIRST, cache_salt="tenant-a")) != base
    assert route_key(chat(SYSTEM, FIRST, cache_salt="tenant-a")) != route_key(chat(SYSTEM, FIRST, cache_salt="tenant-b"))
    # Anthropic's system field is part of the conversation's start
    assert route_key({"system": "A", "messages": [FIRST]}) != route_key({"system": "B", "messages": [FIRST]})


def test_requests_that_name_no_conversation_have_no_key():
    assert route_key(b"") is None and route_key(b"not json") is None and route_key({"model": "m"}) is None
    assert route_key({"prompt": "Once upon a time"}) is not None and route_key({"query": "q", "documents": []})


def test_the_key_reads_at_most_max_key_chars():
    long = "x" * 100
    a = route_key(chat({"role": "user", "content": long + "a"}), max_key_chars=50)
    b = route_key(chat({"role": "user", "content": long + "b"}), max_key_chars=50)
    assert a == b and a != route_key(chat({"role": "user", "content": long + "a"}))


# ---- the policy ----------------------------------------------------------------------------


def test_a_key_goes_to_its_rendezvous_replica_until_it_is_past_the_threshold():
    key = route_key(chat(SYSTEM, FIRST))
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
    key = route_key(chat(SYSTEM, FIRST))
    choice = choose(key, {"a": 5, "b": 5}, RoutingPolicy(spill_threshold=2))
    assert choice.reason is RouteReason.PREFIX and choice.ranked[0] == rank_replicas(key, ["a", "b"])[0]


def test_no_key_goes_to_the_least_loaded_replica():
    choice = choose(None, {"a": 4, "b": 1, "c": 2}, RoutingPolicy())
    assert choice.reason is RouteReason.LOAD and choice.ranked == ("b", "c", "a")


def test_adding_a_replica_moves_only_the_keys_it_wins():
    keys = [route_key(chat({"role": "user", "content": f"question {i}"})) for i in range(400)]
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
