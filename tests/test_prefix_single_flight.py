"""Shared prefixes are computed once: single flight, every admission looked up, burst budgets.

The real engine and its real prefix cache over the fake runner, in exact virtual time (trio
MockClock): every step costs 1 s + 1/16 s per token fed, a page copy 1/4 s. Pages hold 4
tokens; the shared prefix is 40 tokens (ten full pages). The fake runner's tokens depend on the
KV read back through each row's page table, so a request that attached the wrong pages, or
pages nobody computed, produces other tokens than alone (or fails the step).
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from ninfer.sched.config import EngineConfig
from ninfer.sched.engine import open_engine
from ninfer.sched.fake import ByteTokenizer, CostModel, FakeRunner, VirtualTimeExecutor
from ninfer.sched.request import EngineUnhealthy, FinishReason, GenerationRequest

PAGE = 4
SHARED = tuple(range(100, 140))  # 40 tokens: ten full pages
COST = CostModel(step_s=1.0, token_s=1 / 16, page_copy_s=1 / 4)


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)


def request(suffix, *, seed=0, max_tokens=4, prefix=SHARED, **kwargs) -> GenerationRequest:
    return GenerationRequest(prompt_ids=prefix + tuple(suffix), max_tokens=max_tokens, seed=seed,
                             ignore_eos=True, **kwargs)  # fmt: skip


def question(i: int) -> tuple[int, ...]:
    return (200 + i, 7, 8)  # a suffix of its own: the first token differs from every other's


def make_runner(**overrides) -> FakeRunner:
    values = dict(num_pages=128, page_size=PAGE, max_context=64, cost=COST)
    values.update(overrides)
    return FakeRunner(**values)


def engine_for(runner, **overrides):
    values = dict(page_size=PAGE, prefill_chunk=64, max_concurrency=8, max_context=64)
    values.update(overrides)
    return open_engine(EngineConfig(**values), runner, ByteTokenizer(), executor=VirtualTimeExecutor(runner))


async def collect_all(engine, requests, results, at=0.0):
    """Submit every request at virtual time `at`, in order, and collect them concurrently."""
    await trio.sleep_until(at)
    streams = [engine.submit(req) for req in requests]

    async def one(i, stream):
        async with stream:
            results[i] = await stream.collect()

    async with trio.open_nursery() as nursery:
        for i, stream in enumerate(streams):
            nursery.start_soon(one, i, stream)


async def alone(req) -> tuple[int, ...]:
    """The tokens a request produces with an engine (and no prefix cache) to itself."""
    runner = make_runner()
    async with engine_for(runner, prefix_cache=False) as engine:
        async with engine.submit(req) as stream:
            return (await stream.collect()).token_ids


def prefix_tokens_computed(runner, seq_ids=None, shared=len(SHARED)) -> int:
    """Positions of the shared prefix fed to the runner, over every row (of `seq_ids`) of every step."""
    rows = [row for log in runner.steps for row in log.rows if seq_ids is None or row[0] in seq_ids]
    return sum(max(0, min(start + n, shared) - start) for _, start, n, _ in rows)


def check_idle(engine) -> None:
    state = engine._state
    state.pool.check_consistent(holders=state.prefix.holders())
    assert state.prefix.claimants() == {}


# -- single flight -------------------------------------------------------------------------


async def test_a_burst_computes_its_shared_prefix_once(autojump_clock):
    requests = [request(question(i), seed=i) for i in range(6)]
    runner = make_runner()
    results = [None] * len(requests)
    async with engine_for(runner, prefill_chunk=16) as engine:
        await collect_all(engine, requests, results)
        stats = engine.statistics()
        check_idle(engine)
    # Step 0: only the first computes; the five others wait for its pages. With five waiters its
    # row may take a chunk for each (16 x 6 >= 43): the whole prompt in one step, 3.6875 s.
    assert runner.steps[0].rows == ((0, 0, 43, True),)
    # Step 1: the waiters attach the ten published pages and prefill only their own 3 tokens.
    assert runner.steps[1].rows == ((0, 43, 1, True), *((i, 40, 3, True) for i in range(1, 6)))
    assert prefix_tokens_computed(runner) == len(SHARED)
    assert [r.started.cached_tokens for r in results] == [0] + [len(SHARED)] * 5
    assert [r.finished.timings.ttft_s for r in results] == [3.6875] + [3.6875 + 2.0] * 5
    assert (stats.num_prefix_lookups, stats.num_prefix_hits, stats.num_prefix_waits) == (6, 5, 5)
    assert stats.num_cached_prompt_tokens == 5 * len(SHARED)
    for req, result in zip(requests, results):
        assert result.finished.reason is FinishReason.LENGTH
        assert result.token_ids == await alone(req)


async def test_waiters_take_over_when_the_owner_is_cancelled(autojump_clock):
    # 4 prefill tokens a step (1.25 s): the owner needs 11 steps for its 43-token prompt.
    owner, first, second = (request(question(i), seed=i) for i in range(3))
    runner = make_runner()
    results = [None, None]
    async with engine_for(runner, prefill_chunk=4, max_prefill_tokens=4) as engine:
        owner_stream = engine.submit(owner)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect_all, engine, [first, second], results, 0.0)
            # Step 3 runs from 3.75 to 5.0 and computes positions 12..15; the owner leaves
            # during it, so its first four pages are published and it is reaped at 5.0.
            await trio.sleep_until(4.0)
            await owner_stream.aclose()
        stats = engine.statistics()
        check_idle(engine)
    assert [log.rows for log in runner.steps[:4]] == [((0, 4 * k, 4, False),) for k in range(4)]
    # The first waiter takes over from the published 16 tokens (and claims the rest); the second
    # now waits for it, and attaches all 40 once it has published them.
    assert [r.started.cached_tokens for r in results] == [16, 40]
    assert prefix_tokens_computed(runner) == len(SHARED)  # nothing computed twice
    assert stats.num_prefix_waits == 2 and stats.requests_by_outcome["cancelled"] == 1
    for req, result in zip((first, second), results):
        assert result.finished.reason is FinishReason.LENGTH
        assert result.token_ids == await alone(req)


async def test_a_failed_runner_ends_the_waiters_too(autojump_clock):
    runner = make_runner(fail_at_step=1)
    async with engine_for(runner, prefill_chunk=4, max_prefill_tokens=4) as engine:
        streams = [engine.submit(request(question(i), seed=i)) for i in range(3)]
        async with streams[0] as owner:
            done = await owner.collect()
        for stream in streams[1:]:
            with pytest.raises(EngineUnhealthy):
                async with stream:
                    await stream.collect()
        stats = engine.statistics()
        check_idle(engine)
    assert done.finished.reason is FinishReason.ERROR
    assert stats.num_prefix_waits == 2 and stats.num_pages_used == stats.num_prefix_cache_pages


async def test_waiters_step_aside_for_younger_unrelated_requests(autojump_clock):
    # prefill_chunk 8: the owner gets 16 tokens a step (one waiter), the unrelated request 8.
    owner, waiter = request(question(0), seed=0), request(question(1), seed=1)
    other = request((), prefix=tuple(range(10, 20)), seed=2)
    runner = make_runner()
    results = [None] * 3
    async with engine_for(runner, prefill_chunk=8) as engine:
        await collect_all(engine, [owner, waiter, other], results)
        stats = engine.statistics()
        check_idle(engine)
    # The younger, unrelated request is admitted at once; the waiter once the owner's ten
    # pages are published (after step 2, which computes positions 32..42).
    assert runner.steps[0].rows == ((0, 0, 16, False), (2, 0, 8, False))
    assert [row[0] for row in runner.steps[3].rows] == [0, 2, 1]
    assert runner.steps[3].rows[2] == (1, 40, 3, True)
    assert [r.started.cached_tokens for r in results] == [0, 40, 0]
    assert stats.num_prefix_waits == 1 and prefix_tokens_computed(runner, {0, 1}) == len(SHARED)


@pytest.mark.parametrize(
    "owner_args, waiter_args, waits",
    [
        ({}, {"cache_read_only": True}, True),  # a read-only request reads what the owner computes
        ({"cache_read_only": True}, {}, False),  # a read-only owner publishes nothing: no one waits
        ({"cache_salt": "a"}, {"cache_salt": "b"}, False),  # another tenant's pages are never shared
    ],
    ids=["read-only-waiter", "read-only-owner", "other-tenant"],
)
async def test_who_waits_for_whom(autojump_clock, owner_args, waiter_args, waits):
    requests = [request(question(0), seed=0, **owner_args), request(question(1), seed=1, **waiter_args)]
    runner = make_runner()
    results = [None, None]
    async with engine_for(runner) as engine:
        await collect_all(engine, requests, results)
        stats = engine.statistics()
        check_idle(engine)
    assert stats.num_prefix_waits == int(waits)
    assert results[1].started.cached_tokens == (len(SHARED) if waits else 0)
    assert prefix_tokens_computed(runner) == len(SHARED) * (1 if waits else 2)
    assert [r.token_ids for r in results] == [await alone(req) for req in requests]


# -- every admitted request is looked up ---------------------------------------------------


async def test_requests_arriving_while_cache_copies_run_are_looked_up_before_admission(autojump_clock):
    # The first request leaves a partial tail page (tokens 1, 2) behind the shared pages, so the
    # next hit copies it on write: 0.25 s of cache IO before that step's plan. A request that
    # arrives during the copy used to be admitted in that plan without a lookup.
    warm = request((1, 2), max_tokens=1)
    copying, arriving = request((1, 2, 50), seed=1), request((1, 2, 60), seed=2)
    runner = make_runner()
    results = [None, None]
    async with engine_for(runner) as engine:
        async with engine.submit(warm) as stream:
            await stream.collect()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect_all, engine, [copying], results, 10.0)
            await trio.sleep_until(10.125)  # during the copy (10.0 .. 10.25)
            arriving_stream = engine.submit(arriving)
            async with arriving_stream:
                arrived = await arriving_stream.collect()
        stats = engine.statistics()
        check_idle(engine)
    assert results[0].started.cached_tokens == 42 and arrived.started.cached_tokens == 42
    assert (stats.num_prefix_lookups, stats.num_prefix_hits) == (3, 2)
    assert stats.num_cached_prompt_tokens == 84
    assert arrived.token_ids == await alone(arriving)


# -- the burst budget ----------------------------------------------------------------------


@pytest.mark.parametrize("max_prefill_tokens, steps_to_admit", [(128, 1), (8, 9)], ids=["adaptive", "fixed"])
async def test_a_burst_of_short_suffixes_over_a_cached_prefix_is_admitted_at_once(
    autojump_clock, max_prefill_tokens, steps_to_admit
):
    # Twelve 6-token suffixes over the cached prefix: 72 prefill tokens, chunks of 8. In a burst
    # the step takes them all (up to max_prefill_tokens); with the budget held at the chunk
    # they trickle in 8 tokens a step.
    burst = [request((200 + i, 1, 2, 3, 4, 5), seed=i) for i in range(12)]
    runner = make_runner(num_pages=256)
    results = [None] * len(burst)
    async with engine_for(runner, prefill_chunk=8, max_concurrency=12, max_prefill_tokens=max_prefill_tokens) as engine:
        async with engine.submit(request((1,), max_tokens=1)) as warm:
            await warm.collect()
        first_step = len(runner.steps)
        await collect_all(engine, burst, results, at=10.0)
        stats = engine.statistics()
        check_idle(engine)
    assert [r.started.cached_tokens for r in results] == [len(SHARED)] * 12
    first_token_steps = [
        next(k for k, log in enumerate(runner.steps[first_step:]) if any(row[0] == seq and row[3] for row in log.rows))
        for seq in range(1, 13)
    ]
    assert max(first_token_steps) + 1 == steps_to_admit
    if steps_to_admit == 1:
        assert runner.steps[first_step].rows == tuple((seq, 40, 6, True) for seq in range(1, 13))
    assert stats.num_prefix_waits == 0
    for req, result in zip(burst[:3], results[:3]):
        assert result.token_ids == await alone(req)
