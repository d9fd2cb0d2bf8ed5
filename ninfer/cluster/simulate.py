"""Replicas under a multi-tenant, multi-turn chat trace, in virtual time (pure Python, no Ray).

Compares routing policies on the figures that matter for a prefix cache spread over replicas:
prefix hit rate (prompt tokens served from a replica's cache), TTFT p50 / p99 and load
imbalance (the busiest replica's busy time over the mean). The prefix-aware policy is the one
`ninfer cluster` runs (`ninfer.cluster.routing.choose`), on synthetic keys (`routing.key_of`: one
per conversation, salted by tenant) standing in for the page keys of the conversation's first turn,
which the trace has no token ids for.

The model, one discrete-event queue per replica:
- each replica runs `lanes` requests at once; a request waits in its replica's FIFO for a lane;
- a request costs `step_s + uncached_prompt_tokens * prefill_token_s` to its first token, then
  `output_tokens * decode_token_s` to its end (decode speed per stream is taken as fixed);
- each replica's prefix cache is an LRU over `cache_tokens`: a tenant's system prompt and each
  conversation's whole history (prompt + answer) once its turn has finished; a hit is the
  longer of the two that the prompt starts with.

The trace: conversations arrive as a Poisson process; each belongs to one of `num_tenants`
tenants (their system prompts of log-normal length), has `turns` user turns (log-normal user
and answer lengths) separated by exponential think times. Drawn up front from the seed, so
every policy sees the same requests.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict, deque

import attrs
import numpy as np

from ninfer.cluster.routing import RouteReason, RoutingPolicy, choose, key_of

POLICIES = ("prefix", "round-robin", "least-loaded")


@attrs.frozen(kw_only=True)
class ChatTrace:
    """Conversations and their arrival rate scale with the replicas, so every cluster size runs
    at the same utilisation."""

    conversations_per_replica: int = 40
    rate_per_replica: float = 0.5  # new conversations per second per replica
    num_tenants: int = 16
    turns: int = 4
    system_tokens: float = 1500.0  # mean per tenant
    user_tokens: float = 120.0
    output_tokens: float = 150.0
    length_sigma: float = 0.6
    think_s: float = 8.0  # mean pause between an answer and the next turn
    seed: int = 0


@attrs.frozen(kw_only=True)
class ReplicaModel:
    lanes: int = 8
    step_s: float = 0.004
    prefill_token_s: float = 50e-6
    decode_token_s: float = 0.01
    cache_tokens: int = 200_000


@attrs.frozen
class TraceRequest:
    arrival_s: float
    tenant: int
    conversation: int
    turn: int
    system_tokens: int
    history_tokens: int  # earlier turns, prompts and answers, after the system prompt
    user_tokens: int
    output_tokens: int

    @property
    def prompt_tokens(self) -> int:
        return self.system_tokens + self.history_tokens + self.user_tokens


def _lognormal(rng, mean: float, sigma: float, size: int) -> np.ndarray:
    mu = math.log(mean) - sigma**2 / 2  # so the distribution's mean is `mean` (as `ninfer simulate`)
    return np.maximum(1, np.rint(rng.lognormal(mu, sigma, size))).astype(int)


def generate_trace(trace: ChatTrace, num_replicas: int) -> list[TraceRequest]:
    rng = np.random.default_rng(trace.seed)
    n, turns = trace.conversations_per_replica * num_replicas, trace.turns
    systems = _lognormal(rng, trace.system_tokens, trace.length_sigma, trace.num_tenants)
    # Zipf-like tenant popularity: a few big tenants, a long tail.
    weights = 1.0 / np.arange(1, trace.num_tenants + 1)
    tenants = rng.choice(trace.num_tenants, size=n, p=weights / weights.sum())
    starts = np.cumsum(rng.exponential(1.0 / (trace.rate_per_replica * num_replicas), n))
    users = _lognormal(rng, trace.user_tokens, trace.length_sigma, n * turns).reshape(n, turns)
    outputs = _lognormal(rng, trace.output_tokens, trace.length_sigma, n * turns).reshape(n, turns)
    thinks = rng.exponential(trace.think_s, (n, turns))
    requests = []
    for c in range(n):
        at, history = float(starts[c]), 0
        for t in range(turns):
            requests.append(TraceRequest(at, int(tenants[c]), c, t, int(systems[tenants[c]]), history,
                                         int(users[c, t]), int(outputs[c, t])))  # fmt: skip
            history += int(users[c, t] + outputs[c, t])
            # The next turn comes after this answer could have streamed out, plus a pause.
            at += float(outputs[c, t]) * 0.02 + float(thinks[c, t])
    requests.sort(key=lambda r: (r.arrival_s, r.conversation, r.turn))
    return requests


# ---- one replica ------------------------------------------------------------------------------


class _PrefixLRU:
    """Cached prefixes by name ((tenant,) or (tenant, conversation)) with their token counts."""

    def __init__(self, capacity_tokens: int):
        self.capacity = capacity_tokens
        self.entries: OrderedDict[tuple, int] = OrderedDict()
        self.num_tokens = 0

    def hit_tokens(self, request: TraceRequest) -> int:
        hits = [0]
        for name, limit in (((request.tenant,), request.system_tokens),
                            ((request.tenant, request.conversation), request.prompt_tokens - 1)):  # fmt: skip
            if name in self.entries:
                self.entries.move_to_end(name)
                hits.append(min(self.entries[name], limit))
        return max(hits)

    def insert(self, name: tuple, num_tokens: int) -> None:
        self.num_tokens += num_tokens - self.entries.pop(name, 0)
        self.entries[name] = num_tokens
        while self.num_tokens > self.capacity and self.entries:
            _, evicted = self.entries.popitem(last=False)
            self.num_tokens -= evicted


@attrs.define
class _Replica:
    model: ReplicaModel
    cache: _PrefixLRU
    queue: deque = attrs.field(factory=deque)
    running: int = 0
    busy_s: float = 0.0

    @property
    def load(self) -> int:
        return self.running + len(self.queue)


# ---- the replay --------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class PolicyFigures:
    policy: str
    num_replicas: int
    num_requests: int
    hit_rate: float  # cached prompt tokens / prompt tokens
    ttft_p50_s: float
    ttft_p99_s: float
    imbalance: float  # busiest replica's busy time / the mean
    routed: dict[str, int]  # prefix-aware only: requests by RouteReason


def simulate_cluster(requests: list[TraceRequest], num_replicas: int, policy: str, *,
                     model: ReplicaModel = ReplicaModel(),
                     routing: RoutingPolicy = RoutingPolicy()) -> PolicyFigures:  # fmt: skip
    """Replay `requests` over `num_replicas` replicas routed by `policy` (one of POLICIES)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    ids = [f"replica-{i}" for i in range(num_replicas)]
    replicas = {rid: _Replica(model, _PrefixLRU(model.cache_tokens)) for rid in ids}
    routed = dict.fromkeys((r.value for r in RouteReason), 0)
    ttfts, hits, prompts = [], 0, 0
    order = itertools.count()
    events: list = [(r.arrival_s, 1, next(order), "arrive", r, None) for r in requests]
    heapq.heapify(events)
    round_robin = itertools.cycle(ids)

    def start(rid: str, request: TraceRequest, now: float) -> None:
        nonlocal hits, prompts
        replica = replicas[rid]
        replica.running += 1
        cached = replica.cache.hit_tokens(request)
        hits, prompts = hits + cached, prompts + request.prompt_tokens
        to_first = model.step_s + (request.prompt_tokens - cached) * model.prefill_token_s
        ttfts.append(now - request.arrival_s + to_first)
        service = to_first + request.output_tokens * model.decode_token_s
        replica.busy_s += service
        heapq.heappush(events, (now + service, 0, next(order), "finish", request, rid))

    while events:
        now, _, _, kind, request, rid = heapq.heappop(events)
        if kind == "arrive":
            rid = _route(policy, request, replicas, round_robin, routing, routed)
            replica = replicas[rid]
            if replica.running < model.lanes:
                start(rid, request, now)
            else:
                replica.queue.append(request)
            continue
        replica = replicas[rid]
        replica.running -= 1
        replica.cache.insert((request.tenant,), request.system_tokens)
        replica.cache.insert((request.tenant, request.conversation), request.prompt_tokens + request.output_tokens)
        if replica.queue:
            start(rid, replica.queue.popleft(), now)
    busy = [r.busy_s for r in replicas.values()]
    return PolicyFigures(
        policy=policy, num_replicas=num_replicas, num_requests=len(requests),
        hit_rate=hits / prompts if prompts else 0.0,
        ttft_p50_s=float(np.percentile(ttfts, 50)), ttft_p99_s=float(np.percentile(ttfts, 99)),
        imbalance=max(busy) / (sum(busy) / len(busy)) if sum(busy) else 1.0,
        routed=routed if policy == "prefix" else {},
    )  # fmt: skip


def _route(policy, request, replicas, round_robin, routing, routed) -> str:
    if policy == "round-robin":
        return next(round_robin)
    loads = {rid: r.load for rid, r in replicas.items()}
    if policy == "least-loaded":
        return min(loads, key=loads.get)
    key = key_of(f"conversation {request.conversation}", cache_salt=f"tenant {request.tenant}")
    choice = choose(key, loads, routing)
    routed[choice.reason.value] += 1
    return choice.ranked[0]


def compare(trace: ChatTrace, replica_counts=(8, 32, 128), policies=POLICIES, *, model: ReplicaModel = ReplicaModel(),
            routing: RoutingPolicy = RoutingPolicy()) -> list[PolicyFigures]:  # fmt: skip
    """Every policy at every cluster size, each size on its own trace (same seed)."""
    figures = []
    for n in replica_counts:
        requests = generate_trace(trace, n)
        figures.extend(simulate_cluster(requests, n, p, model=model, routing=routing) for p in policies)
    return figures


def format_table(figures: list[PolicyFigures]) -> str:
    lines = [f"{'replicas':>8}  {'policy':<13}{'requests':>9}  {'hit rate':>8}  {'TTFT p50':>9}  "
             f"{'TTFT p99':>9}  {'imbalance':>9}  routed (prefix/fallback)"]  # fmt: skip
    for f in figures:
        routed = f"{f.routed['prefix']}/{f.routed['fallback']}" if f.routed else "-"
        ttft = f"{f.ttft_p50_s * 1e3:>7.0f}ms  {f.ttft_p99_s * 1e3:>7.0f}ms"
        lines.append(f"{f.num_replicas:>8}  {f.policy:<13}{f.num_requests:>9}  {f.hit_rate:>7.1%}  {ttft}  "
                     f"{f.imbalance:>9.2f}  {routed}")  # fmt: skip
    return "\n".join(lines)
