"""The prefix-aware routing policy, as plain functions over plain state (no Ray, no IO).

A request's *route key* names the start of its conversation: the system prompt and every
message up to and including the first user message (or a completion's prompt, a Responses
call's instructions and input, a rerank query), as canonical JSON cut at `max_key_chars`,
hashed with the request's `cache_salt` the way the prefix cache salts its page keys
(`ninfer.cache.prefix_index.salt_bytes`), so tenants hash apart. Every follow-up turn of a
conversation repeats that start, so it gets the same key and lands where its KV prefix is
cached. Hashing characters instead of the prefix cache's token pages keeps the ingress free of
tokenizers and templates; the price is that two conversations whose first turns differ only
after `max_key_chars` share a replica (harmless: they share most of their prefix too).

Keys map to replicas by rendezvous (highest-random-weight) hashing: a replica that joins or
leaves moves only the keys it wins or held, and every router process agrees without shared
state. The preferred replica is skipped for the least-loaded one when its load (requests
running and queued there) is at `spill_threshold` or more: routed by *fallback*. Requests with
no key (`GET /v1/models`, say) go to the least-loaded replica: routed by *load*.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ninfer.cache.prefix_index import salt_bytes

DEFAULT_MAX_KEY_CHARS = 4096
_CLUSTER_SALT = b"ninfer-cluster"


class RouteReason(enum.Enum):
    PREFIX = "prefix"  # the replica the key hashes to
    LOAD = "load"  # no key: the least-loaded replica
    FALLBACK = "fallback"  # the key's replica was past the spill threshold: the least-loaded one


@attrs.frozen
class RouteChoice:
    """Where to send a request: replica ids by preference, and why the first one."""

    ranked: tuple[str, ...]
    reason: RouteReason
    preferred: str | None  # the key's replica (None without a key)


def _validate_threshold(_instance, _attribute, value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"spill_threshold must be at least 1 request (or None for never), got {value}")


@attrs.frozen(kw_only=True)
class RoutingPolicy:
    """`spill_threshold`: a preferred replica with this many requests (running + queued) or more
    is passed over for the least-loaded one; None never spills (pure affinity)."""

    spill_threshold: int | None = attrs.field(default=8, validator=_validate_threshold)
    max_key_chars: int = attrs.field(default=DEFAULT_MAX_KEY_CHARS, validator=attrs.validators.ge(1))


# ---- route keys ------------------------------------------------------------------------------


def route_key(body: bytes | str | Mapping[str, Any], *, max_key_chars: int = DEFAULT_MAX_KEY_CHARS) -> bytes | None:
    """The route key of a request body (JSON bytes or a parsed object); None when it names no
    conversation (no body, not JSON, or none of the fields a prefix starts with)."""
    if isinstance(body, (bytes, str)):
        if not body:
            return None
        try:
            body = json.loads(body)
        except ValueError:
            return None
    if not isinstance(body, Mapping):
        return None
    anchor = conversation_anchor(body)
    if anchor is None:
        return None
    text = json.dumps(anchor, ensure_ascii=False, sort_keys=True, separators=(",", ":"))[:max_key_chars]
    salt = body.get("cache_salt")
    salt = salt if isinstance(salt, str) else None
    return key_of(text, salt)


def key_of(text: str, cache_salt: str | None = None) -> bytes:
    """A key from an anchor's text and a tenant's cache_salt (the simulation keys conversations so)."""
    data = salt_bytes(_CLUSTER_SALT, cache_salt) + text.encode()
    return hashlib.blake2b(data, digest_size=16, person=b"ninfer-route").digest()


def conversation_anchor(body: Mapping[str, Any]) -> list | None:
    """The part of a request that every later turn of its conversation repeats."""
    if isinstance(body.get("messages"), list):
        return ["messages", body.get("system"), _through_first_user(body["messages"])]
    if "prompt" in body:
        return ["prompt", body["prompt"]]
    if "input" in body:
        items = body["input"]
        items = _through_first_user(items) if isinstance(items, list) else items
        return ["input", body.get("instructions"), items]
    if "query" in body:
        return ["query", body["query"]]
    return None


def _through_first_user(items: list) -> list:
    for i, item in enumerate(items):
        if isinstance(item, Mapping) and item.get("role") == "user":
            return items[: i + 1]
    return items


# ---- choosing a replica ----------------------------------------------------------------------


def rank_replicas(key: bytes, replica_ids: Sequence[str]) -> list[str]:
    """Replica ids by rendezvous weight for `key`, best first (ties broken by id)."""

    def weight(replica_id: str) -> bytes:
        return hashlib.blake2b(key + replica_id.encode(), digest_size=8).digest()

    return sorted(replica_ids, key=lambda r: (weight(r), r), reverse=True)


def least_loaded(replica_ids: Sequence[str], loads: Mapping[str, int]) -> list[str]:
    """Replica ids by load, least first (ties keep the given order)."""
    return sorted(replica_ids, key=lambda r: loads.get(r, 0))


def choose(key: bytes | None, loads: Mapping[str, int], policy: RoutingPolicy) -> RouteChoice:
    """Where a request with `key` goes, given each replica's load (every replica is a key of `loads`)."""
    replica_ids = list(loads)
    if not replica_ids:
        raise ValueError("no replicas to route to")
    if key is None:
        return RouteChoice(tuple(least_loaded(replica_ids, loads)), RouteReason.LOAD, None)
    ranked = rank_replicas(key, replica_ids)
    preferred = ranked[0]
    threshold = policy.spill_threshold
    if threshold is not None and loads[preferred] >= threshold and len(ranked) > 1:
        others = least_loaded(ranked[1:], loads)
        if loads[others[0]] < loads[preferred]:
            return RouteChoice((*others, preferred), RouteReason.FALLBACK, preferred)
    return RouteChoice(tuple(ranked), RouteReason.PREFIX, preferred)


@attrs.define
class RouterCounters:
    """Requests routed, by reason (what the router's /metrics exposes)."""

    counts: dict[RouteReason, int] = attrs.field(factory=lambda: dict.fromkeys(RouteReason, 0))

    def count(self, reason: RouteReason) -> None:
        self.counts[reason] += 1

    def statistics(self) -> dict[str, int]:
        return {reason.value: n for reason, n in self.counts.items()}
