"""Replay a synthetic workload against the real scheduler in virtual time.

The engine, its planner and its lanes are the production code; only the runner is the fake
one, whose steps cost what `CostModel` says. `trio.testing.MockClock(autojump_threshold=0)`
jumps over every idle interval, so an hour of traffic replays in seconds and always gives the
same numbers for the same seed. Use it to tune `EngineConfig` (lanes, chunk, KV, host budget)
without a GPU.

Two workloads: `Workload` (Poisson arrivals, `simulate`, `format_report`) and `PrefixBurst`
(N requests at once over one long shared prefix with short suffixes of their own, burst after
burst: `simulate_burst`, `format_burst_report`), which reports per burst the prefix tokens
computed and cached, TTFT p50 / p95 and the steps until every request had its first token:

    print(format_burst_report(simulate_burst(PrefixBurst(num_requests=64))))
"""

from __future__ import annotations

import math

import attrs
import numpy as np
import trio
import trio.testing

from ninfer.sched.config import EngineConfig
from ninfer.sched.engine import open_engine
from ninfer.sched.fake import ByteTokenizer, CostModel, FakeRunner, VirtualTimeExecutor
from ninfer.sched.request import GenerationRequest, Overloaded, QueueTimeout, Started
from ninfer.sched.stats import EngineStatistics, RequestRecord


@attrs.frozen(kw_only=True)
class Workload:
    """Poisson arrivals; log-normal prompt and output lengths; some clients give up."""

    num_requests: int = 200
    arrival_rate_per_s: float = 8.0
    mean_prompt_tokens: float = 256.0
    mean_output_tokens: float = 128.0
    length_sigma: float = 0.6  # spread of the log-normal lengths
    cancel_fraction: float = 0.05  # share of clients that leave early
    mean_cancel_after_s: float = 2.0  # when they leave, exponentially distributed
    seed: int = 0


@attrs.frozen
class SimRequest:
    arrival_s: float
    num_prompt: int
    max_tokens: int
    cancel_after_s: float | None


def generate_requests(workload: Workload, max_context: int) -> list[SimRequest]:
    """Draw the whole trace up front (so it does not depend on the scheduler's behaviour)."""
    rng = np.random.default_rng(workload.seed)
    gaps = rng.exponential(1.0 / workload.arrival_rate_per_s, workload.num_requests)
    arrivals = np.cumsum(gaps)
    prompts = _lognormal(rng, workload.mean_prompt_tokens, workload.length_sigma, workload.num_requests)
    outputs = _lognormal(rng, workload.mean_output_tokens, workload.length_sigma, workload.num_requests)
    cancels = rng.random(workload.num_requests) < workload.cancel_fraction
    cancel_after = rng.exponential(workload.mean_cancel_after_s, workload.num_requests)
    requests = []
    for i in range(workload.num_requests):
        num_prompt = int(min(prompts[i], max_context - 1))
        max_tokens = int(max(1, min(outputs[i], max_context - num_prompt)))
        cancel_s = float(cancel_after[i]) if cancels[i] else None
        requests.append(SimRequest(float(arrivals[i]), num_prompt, max_tokens, cancel_s))
    return requests


def _lognormal(rng, mean: float, sigma: float, size: int) -> np.ndarray:
    mu = math.log(mean) - sigma**2 / 2  # so the distribution's mean is `mean`
    return np.maximum(1, np.rint(rng.lognormal(mu, sigma, size)))


@attrs.frozen(kw_only=True)
class SimulationReport:
    num_requests: int
    duration_s: float  # first arrival to last finish, virtual
    records: tuple[RequestRecord, ...]
    statistics: EngineStatistics

    @property
    def num_generated_tokens(self) -> int:
        return self.statistics.num_generated_tokens

    @property
    def throughput_tokens_per_s(self) -> float:
        return self.num_generated_tokens / self.duration_s if self.duration_s else 0.0

    def percentiles(self, values, points=(50, 90, 99)) -> dict[int, float]:
        values = [v for v in values if v is not None]
        if not values:
            return {p: math.nan for p in points}
        return {p: float(np.percentile(values, p)) for p in points}

    def ttft_s(self) -> dict[int, float]:
        return self.percentiles(r.ttft_s for r in self.records)

    def inter_token_s(self) -> dict[int, float]:
        return self.percentiles(gap for r in self.records for gap in r.inter_token_s)

    def queue_s(self) -> dict[int, float]:
        return self.percentiles(r.queue_s for r in self.records)

    def total_s(self) -> dict[int, float]:
        return self.percentiles(r.total_s for r in self.records)


def simulate(
    config: EngineConfig,
    workload: Workload,
    *,
    cost: CostModel = CostModel(),
    num_pages: int,
    page_nbytes: int | None = None,
    max_context: int = 4096,
) -> SimulationReport:
    """Run the whole workload in virtual time and report latencies and counters."""
    requests = generate_requests(workload, config.max_context or max_context)
    clock = trio.testing.MockClock(autojump_threshold=0)
    runner = FakeRunner(num_pages=num_pages, page_size=config.page_size, max_context=max_context,
                        cost=cost, page_nbytes=page_nbytes)  # fmt: skip
    return trio.run(_replay, config, runner, requests, clock=clock)


async def _replay(config, runner, requests) -> SimulationReport:
    records: list[RequestRecord] = []
    executor = VirtualTimeExecutor(runner)
    engine_cm = open_engine(config, runner, ByteTokenizer(), executor=executor, observer=records.append)
    async with engine_cm as engine:
        async with trio.open_nursery() as nursery:
            for index, request in enumerate(requests):
                nursery.start_soon(_client, engine, index, request)
        end_s = trio.current_time()
        await trio.sleep(1.0)  # let the last cancellations be reaped
        stats = engine.statistics()
    # Lanes finishing in the same step report in any order (trio shuffles them): sort.
    records.sort(key=lambda record: int(record.request_id.removeprefix("sim-")))
    start_s = requests[0].arrival_s if requests else 0.0
    return SimulationReport(num_requests=len(requests), duration_s=end_s - start_s,
                            records=tuple(records), statistics=stats)  # fmt: skip


async def _client(engine, index: int, request: SimRequest) -> None:
    await trio.sleep_until(request.arrival_s)
    prompt = tuple((index * 31 + i) % 256 for i in range(request.num_prompt))
    generation = GenerationRequest(prompt_ids=prompt, max_tokens=request.max_tokens, seed=index,
                                   request_id=f"sim-{index}")  # fmt: skip
    try:
        stream = engine.submit(generation)
    except Overloaded:
        return
    leave_s = math.inf if request.cancel_after_s is None else request.cancel_after_s
    with trio.move_on_after(leave_s):
        try:
            async with stream:
                async for _ in stream:
                    pass
        except QueueTimeout:
            pass


def format_report(report: SimulationReport) -> str:
    """A plain-text summary: latency percentiles, throughput, preemption counters."""
    stats = report.statistics

    def row(name, values, scale=1000.0, unit="ms"):
        cells = "  ".join(f"p{p}={v * scale:9.2f}" for p, v in values.items())
        return f"  {name:<18}{cells} {unit}"

    outcomes = ", ".join(f"{k}={v}" for k, v in stats.requests_by_outcome.items() if v)
    return "\n".join([
        f"requests: {report.num_requests} over {report.duration_s:.2f} s of virtual time ({outcomes})",
        "latency:",
        row("time to 1st token", report.ttft_s()),
        row("inter-token", report.inter_token_s()),
        row("queue", report.queue_s()),
        row("end to end", report.total_s(), scale=1.0, unit="s"),
        f"throughput: {report.throughput_tokens_per_s:.1f} generated tok/s "
        f"({stats.num_generated_tokens} tokens, {stats.num_prefill_tokens} prefill tokens, "
        f"{stats.num_steps} steps)",
        f"pressure: {stats.num_preemptions} preemptions, {stats.num_snapshot_restores} snapshot "
        f"restores, {stats.num_replay_restores} replay restores, {stats.num_replayed_tokens} "
        "replayed tokens",
    ])  # fmt: skip


# -- the shared-prefix burst -------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class PrefixBurst:
    """Bursts of requests arriving together, all sharing one long prefix (a system prompt), each
    with a short suffix of its own (a question) and a fixed number of output tokens.

    The first burst finds nothing cached; later ones (`num_bursts` > 1, each after the one before
    has finished) find the prefix cached. Suffix lengths are uniform in
    `suffix_tokens +- suffix_spread`; every suffix starts with a token no other request of the
    replay starts its suffix with (up to 256 requests), so exactly `prefix_tokens` are shared.
    """

    num_requests: int = 64
    prefix_tokens: int = 2000
    suffix_tokens: int = 150
    suffix_spread: int = 30
    output_tokens: int = 64
    num_bursts: int = 2
    seed: int = 0

    def prompts(self) -> list[list[tuple[int, ...]]]:
        """The prompts of each burst (drawn up front: they do not depend on the scheduler)."""
        rng = np.random.default_rng(self.seed)
        prefix = tuple(int(t) for t in rng.integers(0, 256, self.prefix_tokens))
        bursts = []
        for burst in range(self.num_bursts):
            prompts = []
            for i in range(self.num_requests):
                index = burst * self.num_requests + i
                low, high = self.suffix_tokens - self.suffix_spread, self.suffix_tokens + self.suffix_spread
                num_suffix = int(rng.integers(max(1, low), max(1, high) + 1))
                first = (index * 149 + 7) % 256  # 149 is odd: distinct for 256 requests in a row
                suffix = (first, *(int(t) for t in rng.integers(0, 256, num_suffix - 1)))
                prompts.append(prefix + suffix)
            bursts.append(prompts)
        return bursts


@attrs.frozen(kw_only=True)
class BurstFigures:
    """What one burst cost: prefix tokens computed and cached, TTFT, steps until all started."""

    num_requests: int
    prefix_tokens: int  # the shared part of one prompt
    prefix_tokens_computed: int  # positions < prefix_tokens fed to the runner, summed over rows
    prefix_tokens_cached: int  # the shared part served by the prefix cache, summed over requests
    num_first_tokens: int  # requests that got a first token
    ttft_p50_s: float  # virtual seconds from the burst's arrival
    ttft_p95_s: float
    steps_to_admit: int  # steps from the arrival until the last request had its first token

    @property
    def shared_tokens(self) -> int:
        """The shared part summed over the burst's requests."""
        return self.num_requests * self.prefix_tokens

    @property
    def cached_fraction(self) -> float:
        """Cached share of the shared part (at most (N - 1) / N when the burst found nothing)."""
        return self.prefix_tokens_cached / self.shared_tokens if self.shared_tokens else 0.0


@attrs.frozen(kw_only=True)
class BurstReport:
    workload: PrefixBurst
    bursts: tuple[BurstFigures, ...]
    statistics: EngineStatistics


def burst_config(workload: PrefixBurst, **overrides) -> EngineConfig:
    """The engine a served burst runs on: a lane per request (`ninfer serve --max-concurrency N`),
    the default page size and prefill chunk."""
    values = dict(max_concurrency=workload.num_requests, max_pending=workload.num_requests,
                  max_context=_burst_context(workload), page_size=16)  # fmt: skip
    values.update(overrides)
    return EngineConfig(**values)


def _burst_context(workload: PrefixBurst) -> int:
    return workload.prefix_tokens + workload.suffix_tokens + workload.suffix_spread + workload.output_tokens + 1


# The `ninfer simulate` defaults: 4 ms a step, 20 us a token, 10 us a row, 5 us a page copied.
BURST_COST = CostModel(step_s=4e-3, token_s=20e-6, row_s=10e-6, page_copy_s=5e-6)


def simulate_burst(
    workload: PrefixBurst,
    config: EngineConfig | None = None,
    *,
    cost: CostModel = BURST_COST,
    num_pages: int | None = None,
) -> BurstReport:
    """Replay the bursts one after the other in virtual time; figures per burst.

    `num_pages` defaults to enough for every request of a burst to hold its whole prompt and
    output unshared, so the figures show the scheduler, not memory pressure.
    """
    config = config or burst_config(workload)
    max_context = config.max_context or _burst_context(workload)
    if num_pages is None:
        num_pages = workload.num_requests * -(-max_context // config.page_size) + 16
    clock = trio.testing.MockClock(autojump_threshold=0)
    runner = FakeRunner(num_pages=num_pages, page_size=config.page_size, max_context=max_context, cost=cost)
    return trio.run(_replay_bursts, config, runner, workload, clock=clock)


async def _replay_bursts(config, runner: FakeRunner, workload: PrefixBurst) -> BurstReport:
    records: list[RequestRecord] = []
    figures = []
    async with open_engine(config, runner, ByteTokenizer(), executor=VirtualTimeExecutor(runner),
                           observer=records.append) as engine:  # fmt: skip
        for burst, prompts in enumerate(workload.prompts()):
            first_step = len(runner.steps)
            cached: list[int] = []
            async with trio.open_nursery() as nursery:
                # One task submits the whole burst, in order, at one instant.
                for i, prompt in enumerate(prompts):
                    request = GenerationRequest(prompt_ids=prompt, max_tokens=workload.output_tokens, seed=i,
                                                ignore_eos=True, request_id=f"burst{burst}-{i}")  # fmt: skip
                    nursery.start_soon(_follow_burst, engine.submit(request), cached)
            burst_records = [r for r in records if r.request_id.startswith(f"burst{burst}-")]
            figures.append(_burst_figures(workload, runner.steps[first_step:], burst_records, cached))
            await trio.sleep(1.0)  # idle between bursts
        stats = engine.statistics()
    return BurstReport(workload=workload, bursts=tuple(figures), statistics=stats)


async def _follow_burst(stream, cached: list[int]) -> None:
    async with stream:
        async for event in stream:
            if isinstance(event, Started):
                cached.append(event.cached_tokens)


def _burst_figures(workload: PrefixBurst, steps, records: list[RequestRecord], cached: list[int]) -> BurstFigures:
    shared = workload.prefix_tokens
    computed = 0
    first_sample: dict[int, int] = {}
    for index, log in enumerate(steps):
        for seq_id, start, num_tokens, sampled in log.rows:
            computed += max(0, min(start + num_tokens, shared) - start)
            if sampled:
                first_sample.setdefault(seq_id, index)
    ttfts = [r.ttft_s for r in records if r.ttft_s is not None]
    p50, p95 = (float(np.percentile(ttfts, p)) for p in (50, 95)) if ttfts else (math.nan, math.nan)
    return BurstFigures(
        num_requests=workload.num_requests, prefix_tokens=shared, prefix_tokens_computed=computed,
        prefix_tokens_cached=sum(min(c, shared) for c in cached), num_first_tokens=len(ttfts),
        ttft_p50_s=p50, ttft_p95_s=p95,
        steps_to_admit=max(first_sample.values()) + 1 if first_sample else 0,
    )  # fmt: skip


def format_burst_report(report: BurstReport) -> str:
    """One line per burst: prefix tokens computed / cached, TTFT p50 / p95, steps to admit."""
    w = report.workload
    lines = [f"{w.num_requests} arrivals a burst, a {w.prefix_tokens}-token shared prefix, "
             f"~{w.suffix_tokens}-token suffixes, {w.output_tokens} tokens out"]  # fmt: skip
    for burst, f in enumerate(report.bursts):
        lines.append(
            f"  burst {burst}: prefix computed {f.prefix_tokens_computed} tokens, cached "
            f"{f.prefix_tokens_cached} of {f.shared_tokens} ({100 * f.cached_fraction:.1f} %), "
            f"TTFT p50 {1e3 * f.ttft_p50_s:.1f} ms p95 {1e3 * f.ttft_p95_s:.1f} ms, "
            f"{f.steps_to_admit} steps to admit, {f.num_first_tokens}/{f.num_requests} first tokens"
        )
    stats = report.statistics
    lines.append(f"  lookups {stats.num_prefix_lookups}, hits {stats.num_prefix_hits}, "
                 f"steps {stats.num_steps}, preemptions {stats.num_preemptions}")  # fmt: skip
    return "\n".join(lines)
