"""Replay a synthetic workload against the real scheduler in virtual time.

The engine, its planner and its lanes are the production code; only the runner is the fake
one, whose steps cost what `CostModel` says. `trio.testing.MockClock(autojump_threshold=0)`
jumps over every idle interval, so an hour of traffic replays in seconds and always gives the
same numbers for the same seed. Use it to tune `EngineConfig` (lanes, chunk, KV, host budget)
without a GPU.
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
from ninfer.sched.request import GenerationRequest, Overloaded, QueueTimeout
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
