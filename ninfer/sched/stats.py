"""What the engine counts: a frozen snapshot for metrics and a per-request record for histograms."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Mapping

import attrs


class Outcome(enum.Enum):
    """How a submitted request ended (the label of `requests_by_outcome`)."""

    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"
    QUEUE_TIMEOUT = "queue_timeout"
    OVERLOADED = "overloaded"  # rejected by submit: the FIFO was full
    TOO_LARGE = "too_large"  # rejected by submit: it can never fit the context
    UNHEALTHY = "unhealthy"  # rejected or dropped from the FIFO after a runner failure


@attrs.frozen(kw_only=True)
class EngineStatistics:
    """A snapshot of the engine's gauges and counters (counters only ever grow)."""

    is_healthy: bool
    num_lanes: int  # max_concurrency
    num_waiting: int  # in the FIFO
    num_running: int  # holding a lane with resident KV
    num_paused: int  # holding a lane, KV snapshotted to host or dropped
    num_pages_capacity: int
    num_pages_used: int  # capacity - free (running sequences + prefix cache)
    num_pages_free: int
    num_pages_active: int  # pages held by running sequences
    host_snapshot_bytes: int  # host memory now held by snapshots of paused sequences (KV + recurrent state)
    num_steps: int
    num_preemptions: int  # pauses, by snapshot or by drop
    num_snapshot_restores: int
    num_replay_restores: int
    num_replayed_tokens: int  # tokens recomputed after a drop (not counted as prefill)
    num_prompt_tokens: int  # prompt tokens of admitted requests (cached ones included)
    num_prefill_tokens: int  # prompt tokens actually computed (first time, not replay)
    num_cached_prompt_tokens: int  # prompt tokens served from the prefix cache
    num_generated_tokens: int  # sampled tokens, stop tokens included
    requests_by_outcome: Mapping[str, int]  # Outcome.value -> count
    # The prefix cache (all zero without one); counters except the last three gauges.
    num_prefix_lookups: int = 0  # admitted requests whose prompt was looked up (every one, with a cache)
    num_prefix_hits: int = 0  # of those, how many reused at least one token
    num_prefix_demotions: int = 0  # inactive pages moved to the host tier under pressure
    num_prefix_restores: int = 0  # host-tier pages copied back by a hit
    num_prefix_evictions: int = 0  # cached pages dropped (either tier)
    num_prefix_cache_pages: int = 0  # gauge: device pages the cache holds (active or not)
    num_prefix_host_pages: int = 0  # gauge: pages on the host tier
    prefix_host_bytes: int = 0  # gauge: host memory those pages take
    num_lookahead_steps: int = 0  # decode steps queued before the step before them was read
    num_prefix_waits: int = 0  # requests that waited for prefix pages another request was computing
    # Hybrid models: gauges of the recurrent state the runner holds (one per running sequence
    # that has started; paused ones hold theirs in host_snapshot_bytes or none), and of the
    # prefix cache's state checkpoints (host memory, within their own budget).
    num_recurrent_states: int = 0
    recurrent_state_bytes: int = 0
    num_prefix_checkpoints: int = 0
    num_prefix_device_checkpoints: int = 0  # of those, in the runner's checkpoint slots (device memory)
    prefix_checkpoint_bytes: int = 0
    # STEP_PHASES -> host seconds, cumulative: wall-clock measurements, left out of equality
    # (two replays of one workload in virtual time have equal statistics, not equal timings)
    step_phase_s: Mapping[str, float] = attrs.field(factory=dict, eq=False)


# The step task's phases, timed on the host with perf_counter (PhaseClock): "schedule" (reap
# cancellations, expire the queue, prefix lookups, plan), "cache_io" (prefix-cache copies),
# "pause_resume" (KV snapshots and restores), "forward" (waiting on the runner's step, in its
# thread), "commit" (accepting the sampled tokens). Awaited phases include the time other tasks
# held the event loop meanwhile.
STEP_PHASES = ("schedule", "cache_io", "pause_resume", "forward", "commit")


class PhaseClock:
    """Cumulative host seconds per step phase: `start()` a step, `lap(phase)` after each part."""

    def __init__(self):
        self.seconds = dict.fromkeys(STEP_PHASES, 0.0)
        self._mark = time.perf_counter()

    def start(self) -> None:
        self._mark = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] += now - self._mark
        self._mark = now


class Counters:
    """The mutable tallies behind `EngineStatistics`."""

    def __init__(self):
        self.phases = PhaseClock()
        self.num_steps = 0
        self.num_lookahead_steps = 0
        self.num_preemptions = 0
        self.num_snapshot_restores = 0
        self.num_replay_restores = 0
        self.num_replayed_tokens = 0
        self.num_prompt_tokens = 0
        self.num_prefill_tokens = 0
        self.num_cached_prompt_tokens = 0
        self.num_generated_tokens = 0
        self.outcomes = {outcome.value: 0 for outcome in Outcome}

    def count_outcome(self, outcome: Outcome) -> None:
        self.outcomes[outcome.value] += 1


@attrs.frozen(kw_only=True)
class RequestRecord:
    """Timings of one finished request, handed to the engine's observer.

    Times are seconds from submission. `ttft_s` is None when no token was generated;
    `inter_token_s` holds the gaps between consecutive tokens.
    """

    request_id: str
    outcome: Outcome
    num_prompt_tokens: int
    num_cached_tokens: int
    num_generated_tokens: int
    num_pauses: int
    queue_s: float | None  # until the first scheduled step (None: never scheduled)
    ttft_s: float | None
    inter_token_s: tuple[float, ...]
    total_s: float


RequestObserver = Callable[[RequestRecord], None]
