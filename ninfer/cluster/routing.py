"""The prefix-aware routing policy, as plain functions over plain state (no Ray, no IO).

A request's *route key* is one of the prefix cache's own page keys
(`ninfer.cache.prefix_index`): the chained hash of the request's prompt token ids, page by page,
from the root key of its salt (`salt_bytes(model salt, cache_salt)`, so tenants hash apart), taken
at page `depth`, where `depth` is the number of full pages of the conversation's first turn,
capped at `route_pages` (`page_route_key`). Every later turn of a conversation repeats that first
turn, so it has the same key, and it is the key under which the replica that served the earlier
turns caches that prefix. Rendering a request to its token ids (chat template, tokenizer) is
`ninfer.cluster.prompt_keys`; this module only hashes them.

Keys map to replicas by rendezvous (highest-random-weight) hashing: a replica that joins or
leaves moves only the keys it wins or held, and every router process agrees without shared
state. The preferred replica is skipped for the least-loaded one when its load (requests
running and queued there) is at `spill_threshold` or more: routed by *fallback*. Requests with
no key (`GET /v1/models`, a prompt shorter than one page) go to the least-loaded replica: routed
by *load*.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping, Sequence

import attrs
import numpy as np

from ninfer.cache.prefix_index import PrefixIndex, salt_bytes

DEFAULT_PAGE_SIZE = 16  # `ninfer serve --page-size`'s default
DEFAULT_ROUTE_PAGES = 4  # 64 tokens at the default page size: a typical system prompt's start
_SIM_SALT = b"ninfer-cluster"  # as before keys were page keys: the simulation's tables stand


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


# ---- route keys ------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class PageKeying:
    """How route keys cut prompts: the replicas' KV page size and the pages a key reaches."""

    page_size: int = attrs.field(default=DEFAULT_PAGE_SIZE, validator=attrs.validators.ge(1))
    route_pages: int = attrs.field(default=DEFAULT_ROUTE_PAGES, validator=attrs.validators.ge(1))


def route_depth(num_anchor_tokens: int, num_prompt_tokens: int, keying: PageKeying) -> int:
    """The page a key is taken at: the full pages of the conversation's first turn (its anchor),
    at most `route_pages`, and never past the prompt's own full pages (0: no key)."""
    size = keying.page_size
    return min(keying.route_pages, num_anchor_tokens // size, num_prompt_tokens // size)


def page_route_key(token_ids: Sequence[int] | np.ndarray, model_salt: bytes, cache_salt: str | None, *,
                   depth: int, page_size: int = DEFAULT_PAGE_SIZE) -> bytes | None:  # fmt: skip
    """The prefix cache's key of page `depth` (1-based) of `token_ids` under the salt
    (`model_salt`, `cache_salt`), exactly as `PrefixCache` keys that page; None for depth 0 or a
    prompt with fewer full pages."""
    if depth < 1 or len(token_ids) < depth * page_size:
        return None
    index = PrefixIndex(page_size)
    root = index.root_key(salt_bytes(model_salt, cache_salt))
    ids = np.asarray(token_ids[: depth * page_size], dtype=np.int64)
    key = root
    for key in index.keys_after(root, ids, 0):
        pass
    return key


def key_of(text: str, cache_salt: str | None = None) -> bytes:
    """A synthetic key from a name and a tenant's cache_salt: the simulation keys its
    conversations so (it has no token ids); the policy treats it as any other key."""
    data = salt_bytes(_SIM_SALT, cache_salt) + text.encode()
    return hashlib.blake2b(data, digest_size=16, person=b"ninfer-route").digest()


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
