"""Exact virtual-time timelines of the engine over the fake runner (trio MockClock).

Every step costs 1 s + 1/16 s per token fed (binary fractions: sums are exact), so the time
of each token follows from the batching policy alone; the comments derive each expected time.
Pages hold 4 tokens. Tasks woken at the same instant run in any order, so no assertion depends
on it.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from ninfer.sched.config import EngineConfig
from ninfer.sched.engine import open_engine
from ninfer.sched.fake import ByteTokenizer, CostModel, FakeRunner, VirtualTimeExecutor
from ninfer.sched.request import (
    FinishReason,
    GenerationRequest,
    Overloaded,
    QueueTimeout,
    Started,
    TokenDelta,
)

COST = CostModel(step_s=1.0, token_s=1 / 16)


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)


def request(num_prompt, max_tokens, seed):
    return GenerationRequest(
        prompt_ids=tuple(range(10 + seed, 10 + seed + num_prompt)), max_tokens=max_tokens, seed=seed
    )


def engine_for(runner, records=None, **config):
    # The bare scheduler's timelines: no prefix cache (tests/test_prefix_engine.py has its own).
    values = dict(page_size=4, prefill_chunk=64, max_concurrency=4, prefix_cache=False)
    values.update(config)
    observer = records.append if records is not None else None
    return open_engine(EngineConfig(**values), runner, ByteTokenizer(),
                       executor=VirtualTimeExecutor(runner), observer=observer)  # fmt: skip


class Trace:
    """One consumer's view: when each event arrived."""

    def __init__(self):
        self.started_at = None
        self.token_times = []
        self.token_ids = []
        self.finished = None
        self.finished_at = None
        self.error = None

    async def consume(self, engine, req, at=0.0, leave_at=None):
        """Submit at virtual time `at`, read every event, leave early at `leave_at`."""
        await trio.sleep_until(at)
        await self.follow(engine.submit(req), leave_at)

    async def follow(self, stream, leave_at=None):
        with trio.move_on_at(leave_at if leave_at is not None else float("inf")):
            try:
                async with stream:
                    async for event in stream:
                        self._record(event)
            except QueueTimeout as exc:
                self.error, self.finished_at = exc, trio.current_time()

    def _record(self, event):
        now = trio.current_time()
        if isinstance(event, Started):
            self.started_at = now
        elif isinstance(event, TokenDelta):
            if event.token_ids:
                self.token_times.append(now)
                self.token_ids += event.token_ids
        else:
            self.finished, self.finished_at = event, now


async def run_alone(req, **runner_args):
    """The tokens a request produces with the engine to itself."""
    runner = FakeRunner(**runner_args)
    async with engine_for(runner) as engine:
        async with engine.submit(req) as stream:
            return (await stream.collect()).token_ids


async def test_batching_of_arrivals(autojump_clock):
    runner = FakeRunner(num_pages=64, page_size=4, max_context=64, cost=COST)
    a, b, c = Trace(), Trace(), Trace()
    async with engine_for(runner) as engine, trio.open_nursery() as nursery:
        # Submitted in this order before any task runs: A is sequence 0, B sequence 1.
        nursery.start_soon(a.follow, engine.submit(request(4, 3, seed=1)))
        nursery.start_soon(b.follow, engine.submit(request(4, 3, seed=2)))
        nursery.start_soon(c.consume, engine, request(4, 2, seed=3), 2.0)
    # step 0 @0: A and B prefill together (8 tokens): 1.5 s.
    # step 1 @1.5: both decode: 1.125 s. C arrives at 2.0, mid-step.
    # step 2 @2.625: two decodes + C's 4-token prefill: 1.375 s.
    # step 3 @4.0: C decodes alone: 1.0625 s.
    assert a.token_times == b.token_times == [1.5, 2.625, 4.0]
    assert c.started_at == 2.625 and c.token_times == [4.0, 5.0625]
    assert [log.rows for log in runner.steps] == [
        ((0, 0, 4, True), (1, 0, 4, True)),
        ((0, 4, 1, True), (1, 4, 1, True)),
        ((0, 5, 1, True), (1, 5, 1, True), (2, 0, 4, True)),
        ((2, 4, 1, True),),
    ]
    assert c.finished.timings.queue_s == 0.625 and c.finished.timings.ttft_s == 2.0
    assert a.finished.reason is FinishReason.LENGTH and a.finished.usage.completion_tokens == 3


async def test_chunked_prefill_keeps_decode_running_and_late_arrivals_share_the_chunk(autojump_clock):
    runner = FakeRunner(num_pages=64, page_size=4, max_context=64, cost=COST)
    a, b, c = Trace(), Trace(), Trace()
    async with engine_for(runner, prefill_chunk=8) as engine, trio.open_nursery() as nursery:
        nursery.start_soon(a.follow, engine.submit(request(4, 6, seed=1)))
        nursery.start_soon(b.follow, engine.submit(request(20, 2, seed=2)))
        nursery.start_soon(c.consume, engine, request(6, 1, seed=3), 2.0)
    # step 0 @0: A's whole prompt (4) + B's first 4 of 20, the 8-token chunk: 1.5 s.
    # step 1 @1.5: A decodes, B prefills 8: 1.5625 s. C arrives at 2.0, during B's prefill.
    # step 2 @3.0625: A decodes, B's last 8 (samples); C is admitted but the chunk is spent.
    # step 3 @4.625: A, B decode; C's 6-token prompt fits the chunk: 1.5 s.
    # steps 4, 5: A alone, 1.0625 s each.
    assert a.token_times == [1.5, 3.0625, 4.625, 6.125, 7.1875, 8.25]
    assert b.token_times == [4.625, 6.125]
    assert c.started_at == 3.0625 and c.token_times == [6.125]
    assert [log.rows for log in runner.steps[:4]] == [
        ((0, 0, 4, True), (1, 0, 4, False)),
        ((0, 4, 1, True), (1, 4, 8, False)),
        ((0, 5, 1, True), (1, 12, 8, True)),
        ((0, 6, 1, True), (1, 20, 1, True), (2, 0, 6, True)),
    ]


async def test_overload_is_rejected_at_once(autojump_clock):
    runner = FakeRunner(num_pages=64, page_size=4, max_context=64, cost=COST)
    async with engine_for(runner, max_concurrency=1, max_pending=1) as engine:
        first = engine.submit(request(4, 4, seed=1))  # takes the free lane
        second = engine.submit(request(4, 4, seed=2))  # waits in the FIFO
        with pytest.raises(Overloaded, match="1 requests are already waiting"):
            engine.submit(request(4, 4, seed=3))
        await trio.sleep(0.5)  # the first is running now; the FIFO still holds the second
        with pytest.raises(Overloaded):
            engine.submit(request(4, 4, seed=4))
        async with first, second:
            assert (await first.collect()).finished.reason is FinishReason.LENGTH
            assert (await second.collect()).finished.reason is FinishReason.LENGTH
        assert engine.statistics().requests_by_outcome["overloaded"] == 2


async def test_queue_timeout_covers_the_whole_wait(autojump_clock):
    # 16 pages of 4 tokens; A's 60-token prompt takes 15 of them, so B (one free lane left)
    # cannot get its first page plus a spare one for A and waits for KV, not for a lane.
    runner = FakeRunner(num_pages=16, page_size=4, max_context=64, cost=COST)
    a, b, c = Trace(), Trace(), Trace()
    records = []
    async with engine_for(runner, records, max_concurrency=2, pending_timeout_s=3.0) as engine:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.follow, engine.submit(request(60, 4, seed=1)))
            nursery.start_soon(b.follow, engine.submit(request(4, 1, seed=2)))
            nursery.start_soon(c.consume, engine, request(4, 1, seed=3), 1.0)
        stats = engine.statistics()
    assert isinstance(b.error, QueueTimeout) and b.finished_at == 3.0 and b.started_at is None
    assert isinstance(c.error, QueueTimeout) and c.finished_at == 4.0
    assert a.finished.reason is FinishReason.LENGTH
    assert all(row[0] == 0 for log in runner.steps for row in log.rows)
    assert stats.requests_by_outcome["queue_timeout"] == 2
    assert sorted(r.outcome.value for r in records) == ["length", "queue_timeout", "queue_timeout"]


async def test_cancel_before_the_first_token_frees_pages_after_the_step_in_flight(autojump_clock):
    runner = FakeRunner(num_pages=64, page_size=4, max_context=64, cost=COST)
    records, a = [], Trace()
    async with engine_for(runner, records, prefill_chunk=8) as engine, trio.open_nursery() as nursery:
        # 40 prompt tokens in chunks of 8, 1.5 s per step; the consumer leaves at 2.0,
        # during step 1 (1.5 .. 3.0), which still writes the pages for positions 8..15.
        nursery.start_soon(a.consume, engine, request(40, 4, seed=1), 0.0, 2.0)
        await trio.sleep_until(2.0 + 1 / 64)
        assert engine.statistics().num_pages_used == 4
        await trio.sleep_until(3.0 + 1 / 64)
        stats = engine.statistics()
        assert stats.num_pages_used == 0 and stats.num_running == 0
    assert a.token_ids == [] and len(runner.steps) == 2
    (record,) = records
    assert record.outcome.value == "cancelled" and record.ttft_s is None and record.total_s == 3.0


async def test_cancel_mid_stream_by_leaving_the_stream(autojump_clock):
    runner = FakeRunner(num_pages=64, page_size=4, max_context=64, cost=COST)
    got = []
    async with engine_for(runner) as engine:
        async with engine.submit(request(4, 10, seed=1)) as stream:
            async for event in stream:
                if isinstance(event, TokenDelta):
                    got += event.token_ids
                    if len(got) == 2:
                        break
        left_at = trio.current_time()  # 2.3125: the second token
        await trio.sleep(1.0625 + 1 / 64)  # at most one more step may still hold the pages
        stats = engine.statistics()
    assert left_at == 2.3125
    assert stats.num_pages_used == 0 and stats.requests_by_outcome["cancelled"] == 1
    assert len(runner.steps) <= 3
    assert got == list((await run_alone(request(4, 10, seed=1), num_pages=64, page_size=4, max_context=64))[:2])


async def _pause_scenario(host_snapshot_bytes, cancel_b_at=None):
    """A (4 + 12 tokens) and B (4 + 8) on a 4-page pool: A's fifth page pauses B.

    steps 0..4 @0, 1.5, 2.625, 3.75, 4.875: both run (prefill 1.5 s, then 1.125 s per pair)
    and fill the pool (A and B hold 2 pages each after writing positions 0..7).
    step 5 @6.0: A needs a page for position 8: B, the youngest, is paused.
    A then decodes alone, 1.0625 s per step, until its 12th token at 13.4375; then B resumes.
    """
    runner = FakeRunner(num_pages=4, page_size=4, max_context=16, cost=COST)
    a, b, records = Trace(), Trace(), []
    async with engine_for(runner, records, host_snapshot_bytes=host_snapshot_bytes) as engine:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.follow, engine.submit(request(4, 12, seed=1)))
            nursery.start_soon(b.follow, engine.submit(request(4, 8, seed=2)), cancel_b_at)
            await trio.sleep_until(6.5)
            paused = engine.statistics()
        stats = engine.statistics()
    return runner, a, b, paused, stats, records


A_TIMES = [1.5, 2.625, 3.75, 4.875, 6.0, 7.0625, 8.125, 9.1875, 10.25, 11.3125, 12.375, 13.4375]


async def test_pause_by_snapshot_restores_and_resumes_with_identical_tokens(autojump_clock):
    runner, a, b, paused, stats, _ = await _pause_scenario(host_snapshot_bytes=1 << 20)
    assert paused.num_paused == 1 and paused.host_snapshot_bytes == 2 * runner.page_nbytes
    assert a.token_times == A_TIMES
    # B resumes at 13.4375 from its 2 restored pages and decodes position 8 onwards.
    assert b.token_times == [1.5, 2.625, 3.75, 4.875, 6.0, 14.5, 15.5625, 16.625]
    assert runner.steps[12].rows == ((1, 8, 1, True),)
    assert stats.num_preemptions == 1 and stats.num_snapshot_restores == 1
    assert stats.num_replay_restores == 0 and stats.num_replayed_tokens == 0
    assert stats.host_snapshot_bytes == 0 and stats.num_pages_used == 0
    assert b.token_ids == list(await run_alone(request(4, 8, seed=2), num_pages=4, page_size=4, max_context=16))
    assert a.token_ids == list(await run_alone(request(4, 12, seed=1), num_pages=4, page_size=4, max_context=16))


async def test_pause_by_replay_recomputes_prompt_and_emitted_tokens(autojump_clock):
    runner, a, b, paused, stats, _ = await _pause_scenario(host_snapshot_bytes=0)
    assert paused.num_paused == 1 and paused.host_snapshot_bytes == 0
    assert a.token_times == A_TIMES
    # B's KV was dropped: at 13.4375 it replays its 9 known tokens in one row (1.5625 s),
    # which samples its sixth token; nothing it already emitted is sent again.
    assert runner.steps[12].rows == ((1, 0, 9, True),)
    assert b.token_times == [1.5, 2.625, 3.75, 4.875, 6.0, 15.0, 16.0625, 17.125]
    assert stats.num_replay_restores == 1 and stats.num_replayed_tokens == 8
    assert stats.num_snapshot_restores == 0 and stats.num_prefill_tokens == 8
    assert b.token_ids == list(await run_alone(request(4, 8, seed=2), num_pages=4, page_size=4, max_context=16))


async def test_cancel_while_paused_drops_the_snapshot(autojump_clock):
    runner, a, b, paused, stats, records = await _pause_scenario(1 << 20, cancel_b_at=8.0)
    assert paused.num_paused == 1
    # Cancelled at 8.0 during A's step 7.0625 .. 8.125; B never runs again.
    assert all(row[0] == 0 for log in runner.steps[5:] for row in log.rows)
    assert a.token_times == A_TIMES and len(b.token_ids) == 5
    assert stats.host_snapshot_bytes == 0 and stats.num_paused == 0
    assert stats.num_snapshot_restores == 0
    assert {r.outcome.value for r in records} == {"length", "cancelled"}


async def test_resume_in_arrival_order(autojump_clock):
    # A (4 + 16) outlives B and C (4 + 6 each) on a 5-page pool. C never gets its second
    # page and is paused when A needs one at 6.25; B is paused at A's next page boundary.
    runner = FakeRunner(num_pages=5, page_size=4, max_context=20, cost=COST)
    traces = [Trace(), Trace(), Trace()]
    async with engine_for(runner, host_snapshot_bytes=1 << 20) as engine:
        async with trio.open_nursery() as nursery:
            for trace, (max_tokens, seed) in zip(traces, [(16, 1), (6, 2), (6, 3)]):
                nursery.start_soon(trace.follow, engine.submit(request(4, max_tokens, seed)))
        stats = engine.statistics()
    a, b, c = traces
    assert stats.num_preemptions == 2 and stats.num_snapshot_restores == 2
    # Steps 5..15: A alone (B stalls on a page, then is paused at position 12 of A).
    assert all(log.rows == ((0, 8 + i, 1, True),) for i, log in enumerate(runner.steps[5:16]))
    # A is done: B (older) resumes first; C's restore plus a spare page only fit once B is done.
    assert runner.steps[16].rows == ((1, 8, 1, True),)
    assert [log.rows for log in runner.steps[17:]] == [((2, 4 + i, 1, True),) for i in range(5)]
    assert b.token_times[-1] < c.token_times[1]
    for trace, (max_tokens, seed) in zip(traces, [(16, 1), (6, 2), (6, 3)]):
        alone = await run_alone(request(4, max_tokens, seed), num_pages=5, page_size=4, max_context=20)
        assert trace.token_ids == list(alone)
