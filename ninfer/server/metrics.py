"""Prometheus metrics of one server, in its own `CollectorRegistry` (never the global one).

Gauges and counters are read from `engine.statistics()` at scrape time, so they can never
drift from the engine's own accounting; latency histograms are filled per finished request
from the engine's observer hook (`observe_record`) or, failing that, from the service's
per-stream observer (`call_finished`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ninfer.sched.request import Finished
from ninfer.server import heap
from ninfer.sched.stats import EngineStatistics, RequestRecord

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)

# (metric name, EngineStatistics field, help)
_GAUGES = (
    ("ninfer_requests_running", "num_running", "Requests holding a lane with resident KV pages."),
    ("ninfer_requests_waiting", "num_waiting", "Requests waiting in the admission queue."),
    ("ninfer_requests_paused", "num_paused", "Requests paused under KV pressure."),
    ("ninfer_kv_pages_used", "num_pages_used", "KV pages in use (requests and prefix cache)."),
    ("ninfer_kv_pages_active", "num_pages_active", "KV pages held by running or paused requests."),
    ("ninfer_kv_pages_free", "num_pages_free", "KV pages free."),
    ("ninfer_kv_pages_capacity", "num_pages_capacity", "KV pages in the pool."),
    ("ninfer_host_snapshot_bytes", "host_snapshot_bytes", "Host memory held by paused requests' KV."),
    ("ninfer_lanes", "num_lanes", "Execution lanes (max concurrency)."),
    ("ninfer_prefix_cache_pages", "num_prefix_cache_pages", "Device KV pages the prefix cache holds."),
    ("ninfer_prefix_host_pages", "num_prefix_host_pages", "Prefix-cache pages on the host tier."),
    ("ninfer_prefix_host_bytes", "prefix_host_bytes", "Host memory of the prefix cache's host tier."),
    # hybrid models (zero for the others)
    ("ninfer_recurrent_states", "num_recurrent_states", "Recurrent states the runner holds (hybrid models)."),
    ("ninfer_recurrent_state_bytes", "recurrent_state_bytes", "Memory of the recurrent states the runner holds."),
    ("ninfer_prefix_checkpoints", "num_prefix_checkpoints", "Recurrent-state checkpoints the prefix cache keeps."),
    ("ninfer_prefix_device_checkpoints", "num_prefix_device_checkpoints",
     "Prefix checkpoints kept in the runner's checkpoint slots (device memory)."),
    ("ninfer_prefix_checkpoint_bytes", "prefix_checkpoint_bytes", "Host memory of the prefix cache's checkpoints."),
)
_COUNTERS = (
    ("ninfer_prompt_tokens", "num_prompt_tokens", "Prompt tokens of admitted requests."),
    ("ninfer_prefill_tokens", "num_prefill_tokens", "Prompt tokens computed (not from cache)."),
    ("ninfer_generation_tokens", "num_generated_tokens", "Tokens generated."),
    ("ninfer_cached_prompt_tokens", "num_cached_prompt_tokens", "Prompt tokens served from the prefix cache."),
    ("ninfer_replayed_tokens", "num_replayed_tokens", "Tokens recomputed after a pause dropped KV."),
    ("ninfer_preemptions", "num_preemptions", "Pauses under KV pressure."),
    ("ninfer_snapshot_restores", "num_snapshot_restores", "Resumes from a host snapshot."),
    ("ninfer_replay_restores", "num_replay_restores", "Resumes by replaying tokens."),
    ("ninfer_engine_steps", "num_steps", "Engine steps (batched forward passes)."),
    ("ninfer_lookahead_steps", "num_lookahead_steps", "Decode steps queued before the step before them was read."),
    ("ninfer_prefix_lookups", "num_prefix_lookups", "Prompts looked up in the prefix cache."),
    ("ninfer_prefix_hits", "num_prefix_hits", "Lookups that reused at least one token."),
    ("ninfer_prefix_waits", "num_prefix_waits", "Times a request waited for a shared prefix another was computing."),
    ("ninfer_prefix_demotions", "num_prefix_demotions", "Cached pages moved to the host tier."),
    ("ninfer_prefix_restores", "num_prefix_restores", "Host-tier pages copied back on a hit."),
    ("ninfer_prefix_evictions", "num_prefix_evictions", "Cached pages dropped."),
)


class _EngineCollector:
    def __init__(self, statistics: Callable[[], EngineStatistics]):
        self._statistics = statistics

    def collect(self):
        stats = self._statistics()
        for name, field, doc in _GAUGES:
            yield GaugeMetricFamily(name, doc, value=float(getattr(stats, field)))
        yield GaugeMetricFamily("ninfer_engine_healthy", "1 while the engine accepts work.",
                                value=1.0 if stats.is_healthy else 0.0)  # fmt: skip
        for name, field, doc in _COUNTERS:
            yield CounterMetricFamily(name, doc, value=float(getattr(stats, field)))
        outcomes = CounterMetricFamily("ninfer_requests", "Requests by how they ended.", labels=["outcome"])
        for outcome, count in sorted(stats.requests_by_outcome.items()):
            outcomes.add_metric([outcome], float(count))
        yield outcomes


class _GcCollector:
    """Python's garbage collections while a server runs (ninfer.server.heap): each holds the
    event loop, and with it the step task that feeds the GPU."""

    def collect(self):
        pauses = heap.PAUSES
        seconds = CounterMetricFamily("ninfer_gc_pause_seconds", "Time garbage collections held the process.",
                                      labels=["generation"])  # fmt: skip
        count = CounterMetricFamily("ninfer_gc_collections", "Garbage collections.", labels=["generation"])
        for generation in range(3):
            seconds.add_metric([str(generation)], pauses.seconds[generation])
            count.add_metric([str(generation)], float(pauses.collections[generation]))
        yield seconds
        yield count


class ServerMetrics:
    """The registry `/metrics` renders, and the hooks that fill its histograms."""

    def __init__(self, statistics: Callable[[], EngineStatistics]):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(statistics))
        self.registry.register(_GcCollector())
        self.ttft = Histogram("ninfer_time_to_first_token_seconds", "Submission to first token.",
                              buckets=_LATENCY_BUCKETS_S, registry=self.registry)  # fmt: skip
        self.itl = Histogram("ninfer_inter_token_latency_seconds", "Gap between consecutive tokens.",
                             buckets=_TOKEN_BUCKETS_S, registry=self.registry)  # fmt: skip
        self.e2e = Histogram("ninfer_e2e_request_latency_seconds", "Submission to finish.",
                             buckets=_LATENCY_BUCKETS_S, registry=self.registry)  # fmt: skip
        self.queue = Histogram("ninfer_queue_time_seconds", "Submission to first scheduled step.",
                               buckets=_LATENCY_BUCKETS_S, registry=self.registry)  # fmt: skip
        self.http = Counter("ninfer_http_requests", "HTTP responses by route and status.",
                            ["method", "route", "status"], registry=self.registry)  # fmt: skip
        self.route_requests = Counter("ninfer_route_requests", "API requests answered with a success status, by route.",
                                      ["route"], registry=self.registry)  # fmt: skip
        self.scored_tokens = Counter("ninfer_scored_tokens", "Tokens scoring calls were billed (usage.total_tokens).",
                                     ["route"], registry=self.registry)  # fmt: skip

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observe_record(self, record: RequestRecord) -> None:
        """The engine's per-request observer."""
        self._observe(record.queue_s, record.ttft_s, record.total_s, record.inter_token_s)

    def call_finished(self, outcome: str, finished: Finished | None, inter_token_s: Sequence[float]) -> None:
        """The service's per-stream observer, used when the engine takes no observer."""
        if finished is not None:
            timings = finished.timings
            self._observe(timings.queue_s, timings.ttft_s, timings.total_s, inter_token_s)

    def _observe(self, queue_s, ttft_s, total_s, inter_token_s) -> None:
        if queue_s is not None:
            self.queue.observe(queue_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        for gap in inter_token_s:
            self.itl.observe(gap)
        self.e2e.observe(total_s)

    def count_http(self, method: str, route: str, status: int) -> None:
        self.http.labels(method, route, str(status)).inc()

    def count_request(self, route: str) -> None:
        """An API request (generation or scoring) answered with a success status."""
        self.route_requests.labels(route).inc()

    def count_scored_tokens(self, route: str, num_tokens: int) -> None:
        self.scored_tokens.labels(route).inc(num_tokens)
