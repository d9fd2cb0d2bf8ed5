"""`PrefixAwareRouter`: the routing policy (`ninfer.cluster.routing`) as a Ray Serve request router.

Ray Serve (2.60, `ray.serve.request_router`, alpha API) asks a deployment handle's router for
ranked candidate replicas (`choose_replicas`) and then sends the request to the least-loaded
replica of the first rank that accepts it (below `max_ongoing_requests`). This router ranks the
replica the route key hashes to first, unless its load is past the spill threshold; the load is
Serve's own count of requests running on each replica (its queue-length cache, probed when
stale), which for a streaming call lasts until the stream ends. The router lives in the process
that holds the handle (the ingress); `live_routers()` lets that process read its counters and
replica ids.

The handle's caller passes the route key as the `route_key` keyword argument (None for a
request that names no conversation); `target_replica` pins a call to one replica (the ingress
asks each replica for its /metrics that way).
"""

from __future__ import annotations

import weakref
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from ninfer.cluster.routing import RouteReason, RouterCounters, RoutingPolicy, choose

_ROUTERS: weakref.WeakSet = weakref.WeakSet()
_MAX_REASONS = 100_000


def live_routers() -> list[PrefixAwareRouter]:
    """The routers of this process (one per handle to the replicas' deployment)."""
    return list(_ROUTERS)


def _register(router: PrefixAwareRouter) -> None:
    # Serve ships the router class pickled by value (RequestRouterConfig), so this copy's
    # globals are not the module's: register in the imported module, where the ingress looks.
    import ninfer.cluster.router as module

    module._ROUTERS.add(router)


class PrefixAwareRouter(RequestRouter):
    def initialize_state(self, spill_threshold: int | None = 8, **_: Any) -> None:
        self.policy = RoutingPolicy(spill_threshold=spill_threshold)
        self.counters = RouterCounters()
        self._reasons: dict[str, tuple[RouteReason, str | None]] = {}  # by internal request id
        _register(self)

    def replica_ids(self) -> list[str]:
        return sorted(r.replica_id.unique_id for r in self._replicas_list)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:  # fmt: skip
        if not candidate_replicas:
            return []
        if pending_request is None:
            return [candidate_replicas]
        pending_request.routing_context.should_backoff = True  # back off between rounds, never spin
        kwargs = pending_request.kwargs or {}
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        target = kwargs.get("target_replica")
        if target is not None:
            return [[by_id[target]]] if target in by_id else []
        if "route_key" not in kwargs:  # the ingress's own calls (info, metrics): not counted
            return [candidate_replicas]
        choice = choose(kwargs.get("route_key"), await self._loads(candidate_replicas), self.policy)
        if len(self._reasons) > _MAX_REASONS:  # requests cancelled before they were routed
            self._reasons.clear()
        self._reasons[pending_request.metadata.internal_request_id] = (choice.reason, choice.preferred)
        # One rank per replica: Serve tries them in this order, so a full preferred replica
        # (at max_ongoing_requests) still yields to the next one.
        return [[by_id[rid]] for rid in choice.ranked]

    async def _loads(self, replicas: list[RunningReplica]) -> dict[str, int]:
        cache = self._replica_queue_len_cache
        stale = [r for r in replicas if cache.get(r.replica_id) is None]
        if stale:
            await self._probe_queue_lens(stale, 0)
        return {r.replica_id.unique_id: cache.get(r.replica_id) or 0 for r in replicas}

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        reason, preferred = self._reasons.pop(pending_request.metadata.internal_request_id, (None, None))
        if reason is None:  # a pinned call
            return
        if reason is RouteReason.PREFIX and replica_id.unique_id != preferred:
            reason = RouteReason.FALLBACK  # the preferred replica was full and refused it
        self.counters.count(reason)
