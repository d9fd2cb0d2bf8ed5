"""Live figures for the dashboard (`GET /admin/live`): requests in flight, recent latencies and
a few minutes of once-a-second history.

`LiveTracker` follows every generation request the service submits, from its events (never
its text), and each row of a scoring call while it runs: route, age, tokens in and out, phase, and the time to its first token and between
its tokens as the server saw them. `LiveHistory` samples the engine's statistics once a second
into a ring, turning counters into rates (tokens per second generated and prefilled).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import time
from collections.abc import Callable, Iterator

import attrs
import trio

from ninfer.sched.request import Finished, Started, TokenDelta
from ninfer.sched.stats import EngineStatistics

LATENCY_WINDOW_S = 10.0  # TTFT and inter-token latency: the mean over this many seconds
HISTORY_INTERVAL_S = 1.0
HISTORY_SAMPLES = 300  # five minutes
_MAX_LATENCY_SAMPLES = 4096


@attrs.define
class InFlight:
    """One request the dashboard's table shows (no prompt or output text)."""

    request_id: str
    route: str
    submitted_s: float  # trio clock
    num_prompt_tokens: int
    num_output_tokens: int = 0
    phase: str = "queued"  # queued, prefill, decode
    last_token_s: float | None = None


class LiveTracker:
    def __init__(self) -> None:
        self._ids = itertools.count()
        self._requests: dict[int, InFlight] = {}
        self._ttft = collections.deque(maxlen=_MAX_LATENCY_SAMPLES)  # (time, seconds)
        self._itl = collections.deque(maxlen=_MAX_LATENCY_SAMPLES)

    def begin(self, request_id: str, route: str, num_prompt_tokens: int) -> Callable[[object], None]:
        """Start following a request; returns the callback its events go through."""
        key = next(self._ids)
        row = InFlight(request_id, route, trio.current_time(), num_prompt_tokens)
        self._requests[key] = row

        def on_event(event) -> None:
            if isinstance(event, Started):
                row.phase = "prefill"
            elif isinstance(event, TokenDelta) and event.token_ids:
                self._on_tokens(row, len(event.token_ids))
            elif isinstance(event, Finished) or event is None:
                self._requests.pop(key, None)

        return on_event

    @contextlib.contextmanager
    def prefill_only(self, request_id: str, route: str, num_prompt_tokens: int) -> Iterator[None]:
        """Show a scoring row (prefill only, no tokens streamed) while the block runs."""
        key = next(self._ids)
        self._requests[key] = InFlight(request_id, route, trio.current_time(), num_prompt_tokens, phase="prefill")
        try:
            yield
        finally:
            self._requests.pop(key, None)

    def _on_tokens(self, row: InFlight, num_tokens: int) -> None:
        now = trio.current_time()
        if row.last_token_s is None:
            self._ttft.append((now, now - row.submitted_s))
        else:
            self._itl.append((now, (now - row.last_token_s) / num_tokens))
        row.phase, row.last_token_s = "decode", now
        row.num_output_tokens += num_tokens

    def rows(self) -> list[dict]:
        now = trio.current_time()
        return [{"id": r.request_id, "route": r.route, "age_s": round(now - r.submitted_s, 3),
                 "tokens_in": r.num_prompt_tokens, "tokens_out": r.num_output_tokens, "phase": r.phase}
                for r in self._requests.values()]  # fmt: skip

    def latencies_ms(self) -> tuple[float | None, float | None]:
        """(mean TTFT, mean inter-token latency) over the last LATENCY_WINDOW_S, in ms."""
        since = trio.current_time() - LATENCY_WINDOW_S
        return _mean_ms(self._ttft, since), _mean_ms(self._itl, since)


def _mean_ms(samples: collections.deque, since_s: float) -> float | None:
    while samples and samples[0][0] < since_s:
        samples.popleft()
    if not samples:
        return None
    return round(1000.0 * sum(v for _, v in samples) / len(samples), 3)


class LiveHistory:
    """Once a second: the engine's gauges, token rates and latencies, in a ring."""

    def __init__(self, statistics: Callable[[], EngineStatistics], tracker: LiveTracker,
                 extra: Callable[[], dict] = dict):  # fmt: skip
        self._statistics = statistics
        self._tracker = tracker
        self._extra = extra  # more figures for each sample (held requests, device memory)
        self.samples: collections.deque[dict] = collections.deque(maxlen=HISTORY_SAMPLES)
        self._last: tuple[float, EngineStatistics] | None = None

    @property
    def latest(self) -> dict:
        return self.samples[-1] if self.samples else {}

    async def run(self) -> None:
        while True:
            self.sample()
            await trio.sleep(HISTORY_INTERVAL_S)

    def sample(self) -> None:
        now, stats = trio.current_time(), self._statistics()
        gen_tps = prefill_tps = 0.0
        if self._last is not None:
            then, before = self._last
            elapsed = max(now - then, 1e-9)
            gen_tps = (stats.num_generated_tokens - before.num_generated_tokens) / elapsed
            prefill_tps = (stats.num_prefill_tokens - before.num_prefill_tokens) / elapsed
        self._last = (now, stats)
        ttft_ms, itl_ms = self._tracker.latencies_ms()
        self.samples.append({
            "t": round(time.time(), 3), "running": stats.num_running, "waiting": stats.num_waiting,
            "paused": stats.num_paused, "gen_tps": round(gen_tps, 2), "prefill_tps": round(prefill_tps, 2),
            "ttft_ms": ttft_ms, "itl_ms": itl_ms, "kv_used": stats.num_pages_used,
            "kv_active": stats.num_pages_active, "kv_cached": stats.num_prefix_cache_pages, **self._extra(),
        })  # fmt: skip
