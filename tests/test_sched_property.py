"""Property tests over random traces: arrivals, lengths, cancellations, tiny KV pools.

After every run: page accounting is back to zero (or, with the prefix cache on, to exactly
the cache's pages), every request ended exactly once, every token stream is gap- and
duplicate-free, and each request produced exactly the tokens it produces alone without any
cache (a prefix of them when it was cancelled). Before every forward pass and every cache copy
the pool's reference counts equal the holders' page lists (sequences and cache): no count is
negative and no page is both free and referenced. Half the traces run with lookahead (decode
step N + 1 submitted, fed by step N's samples, before step N is collected).

Single flight, checked at the same points: only running or looked-up queued requests claim
pages, a request waiting for another's pages holds none, and no two running requests are both
still to compute the same page of a shared prefix (unless a read-only request, a pause or the
host tier, which hands out pages a hit may fail to restore, is involved). Every admitted request
was looked up exactly once: the lookup counter equals the admissions.
"""

from __future__ import annotations

import collections

import attrs
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ninfer.core.params import SamplingParams
from ninfer.sched.config import EngineConfig
from ninfer.sched.engine import open_engine
from ninfer.sched.fake import ByteTokenizer, CostModel, FakeRunner, VirtualTimeExecutor
from ninfer.sched.output import StopStringMatcher
from ninfer.sched.request import (
    FinishReason,
    GenerationRequest,
    Overloaded,
    QueueTimeout,
    Started,
    TokenDelta,
)
from ninfer.sched.sequence import Phase

PAGE = 4
MAX_CONTEXT = 32
COST = CostModel(step_s=1 / 4, token_s=1 / 64, page_copy_s=1 / 128)


@attrs.frozen
class Arrival:
    at_s: float
    num_prompt: int
    max_tokens: int
    seed: int
    greedy: bool
    cancel_after_s: float | None
    num_shared: int = 0  # leading prompt tokens common to every request (a shared prefix)
    read_only: bool = False  # reads the prefix cache, publishes nothing


@attrs.frozen
class Trace:
    arrivals: tuple[Arrival, ...]
    num_pages: int
    host_pages: int  # host snapshot budget, in pages
    prefill_chunk: int
    max_concurrency: int
    max_pending: int
    pending_timeout_s: float
    prefix_cache: bool = False
    host_cache_pages: int = 0  # the prefix cache's host tier, in pages
    lookahead: bool = False  # the runner is pipelined: decode steps are submitted one ahead


@st.composite
def arrivals(draw):
    num_prompt = draw(st.integers(1, 20))
    return Arrival(
        at_s=draw(st.integers(0, 16)) / 8,
        num_prompt=num_prompt,
        max_tokens=draw(st.integers(1, MAX_CONTEXT - num_prompt)),
        seed=draw(st.integers(0, 2**32)),
        greedy=draw(st.booleans()),
        cancel_after_s=draw(st.none() | st.none() | st.integers(0, 40).map(lambda n: n / 8)),
        num_shared=draw(st.sampled_from([0, num_prompt, num_prompt, num_prompt // 2])),
        read_only=draw(st.booleans()),
    )


traces = st.builds(
    Trace,
    arrivals=st.lists(arrivals(), min_size=1, max_size=10).map(tuple),
    num_pages=st.integers(MAX_CONTEXT // PAGE, MAX_CONTEXT // PAGE + 4),
    host_pages=st.sampled_from([0, 2, 5, 1000]),
    prefill_chunk=st.sampled_from([3, 8, 64]),
    max_concurrency=st.integers(1, 5),
    max_pending=st.integers(1, 8),
    pending_timeout_s=st.sampled_from([4.0, 1000.0, 1000.0]),
    prefix_cache=st.sampled_from([True, True, False]),
    host_cache_pages=st.sampled_from([0, 1, 3, 1000]),
    lookahead=st.booleans(),
)


def to_request(arrival: Arrival) -> GenerationRequest:
    shared = tuple((3 * i + 1) % 256 for i in range(arrival.num_shared))
    prompt = shared + tuple((arrival.seed + 7 * i) % 256 for i in range(arrival.num_shared, arrival.num_prompt))
    sampling = SamplingParams(temperature=0.0) if arrival.greedy else SamplingParams()
    return GenerationRequest(prompt_ids=prompt, max_tokens=arrival.max_tokens, seed=arrival.seed,
                             sampling=sampling, cache_read_only=arrival.read_only)  # fmt: skip


def make_runner(num_pages):
    return FakeRunner(num_pages=num_pages, page_size=PAGE, max_context=MAX_CONTEXT, cost=COST)


@attrs.define
class Outcome:
    events: list = attrs.field(factory=list)
    error: Exception | None = None


async def follow(engine, arrival: Arrival, outcome: Outcome):
    await trio.sleep_until(arrival.at_s)
    try:
        stream = engine.submit(to_request(arrival))
    except Overloaded as exc:
        outcome.error = exc
        return
    leave_at = float("inf") if arrival.cancel_after_s is None else arrival.at_s + arrival.cancel_after_s
    with trio.move_on_at(leave_at):
        try:
            async with stream:
                async for event in stream:
                    outcome.events.append(event)
        except QueueTimeout as exc:
            outcome.error = exc


def cache_holders(state) -> list[list[int]]:
    holders = getattr(state.prefix, "holders", None)
    return holders() if holders is not None else []


def check_pool(state) -> None:
    """The pool's refcounts are exactly the sequences' and the cache's references."""
    sequences = [seq.pages for seq in (*state.running, *state.paused, *state.waiting)]
    state.pool.check_consistent(holders=sequences + cache_holders(state))


def check_single_flight(state, *, exact: bool) -> None:
    """Claims belong to requests that compute; waiters hold nothing; with `exact`, no page of a
    shared prefix is being computed by two running requests at once."""
    claimants = getattr(state.prefix, "claimants", dict)()
    computing = {seq.seq_id for seq in state.running} | {s.seq_id for s in state.waiting if s.is_prefix_looked_up}
    assert set(claimants) <= computing
    for seq in state.waiting:
        if seq.prefix_wait is not None:
            assert not seq.is_prefix_looked_up and not seq.pages and seq.num_cached == 0
            assert seq.prefix_wait.owner_id != seq.seq_id
    assert all(seq.prefix_wait is None for seq in (*state.running, *state.paused))
    if not exact:
        return
    pending = collections.Counter()
    for seq in state.running:
        if seq.request.cache_read_only or seq.num_pauses:
            continue
        prompt = tuple(seq.token_ids[: seq.num_prompt])
        for page in range(seq.num_cached // PAGE, (seq.num_prompt - 1) // PAGE):
            pending[prompt[: (page + 1) * PAGE]] += 1
    assert all(count == 1 for count in pending.values()), "two running requests compute the same prefix page"


class CheckingExecutor(VirtualTimeExecutor):
    """Checks the page accounting before every forward pass and every prefix-cache copy."""

    state = None
    exact_single_flight = False

    async def __call__(self, fn, *args):
        if self.state is not None and getattr(fn, "__name__", "") in ("step", "run", "submit", "_submit_then_collect"):
            check_pool(self.state)
            check_single_flight(self.state, exact=self.exact_single_flight)
        return await super().__call__(fn, *args)


def count_admissions(state) -> set[int]:
    """Spy on the state's moves: the ids of the requests that went from the queue to a lane."""
    admitted, move = set(), state.move

    def spy(seq, phase):
        if seq.phase is Phase.WAITING and phase is Phase.RUNNING:
            admitted.add(seq.seq_id)
        move(seq, phase)

    state.move = spy
    return admitted


async def run_trace(trace: Trace):
    runner = make_runner(trace.num_pages)
    runner.pipelined = trace.lookahead
    config = EngineConfig(
        page_size=PAGE, prefill_chunk=trace.prefill_chunk, max_concurrency=trace.max_concurrency,
        max_pending=trace.max_pending, pending_timeout_s=trace.pending_timeout_s,
        host_snapshot_bytes=trace.host_pages * runner.page_nbytes, prefix_cache=trace.prefix_cache,
        host_cache_bytes=trace.host_cache_pages * runner.page_nbytes,
    )  # fmt: skip
    outcomes = [Outcome() for _ in trace.arrivals]
    executor = CheckingExecutor(runner)
    executor.exact_single_flight = trace.prefix_cache and trace.host_cache_pages == 0
    async with open_engine(config, runner, ByteTokenizer(), executor=executor) as engine:
        executor.state = engine._state
        admitted = count_admissions(engine._state)
        async with trio.open_nursery() as nursery:
            for arrival, outcome in zip(trace.arrivals, outcomes):
                nursery.start_soon(follow, engine, arrival, outcome)
        await trio.sleep(10)  # cancellations take effect within one step
        stats = engine.statistics()
        engine._state.pool.check_consistent(holders=cache_holders(engine._state))
        assert getattr(engine._state.prefix, "claimants", dict)() == {}  # at idle nobody computes
        assert stats.num_prefix_lookups == (len(admitted) if trace.prefix_cache else 0)
    return outcomes, stats


async def run_alone(trace: Trace):
    """Each request with the whole engine to itself, one after the other."""
    runner = make_runner(MAX_CONTEXT // PAGE)
    config = EngineConfig(page_size=PAGE, prefill_chunk=trace.prefill_chunk, prefix_cache=False)
    results = []
    async with open_engine(config, runner, ByteTokenizer(), executor=VirtualTimeExecutor(runner)) as engine:
        for arrival in trace.arrivals:
            async with engine.submit(to_request(arrival)) as stream:
                results.append((await stream.collect()).token_ids)
    return results


def check_one(arrival: Arrival, outcome: Outcome, alone: tuple[int, ...]):
    if outcome.error is not None:
        assert isinstance(outcome.error, Overloaded | QueueTimeout)
        assert not outcome.events  # it never started
        return
    events = outcome.events
    finished = [e for e in events if not isinstance(e, Started | TokenDelta)]
    if not events:
        assert arrival.cancel_after_s is not None  # left before it started
        return
    assert isinstance(events[0], Started) and sum(isinstance(e, Started) for e in events) == 1
    tokens = [i for e in events if isinstance(e, TokenDelta) for i in e.token_ids]
    if finished:
        assert len(finished) == 1 and events[-1] is finished[0]
        (done,) = finished
        assert done.usage.completion_tokens == len(tokens)
        if done.reason is FinishReason.LENGTH:
            assert tuple(tokens) == alone
            text = "".join(e.text for e in events if isinstance(e, TokenDelta))
            assert text == ByteTokenizer().decode(tokens)
            return
        assert done.reason is FinishReason.CANCELLED
    assert arrival.cancel_after_s is not None
    assert tuple(tokens) == alone[: len(tokens)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces)
def test_random_traces_keep_every_invariant(trace):
    clock = trio.testing.MockClock(autojump_threshold=0)
    outcomes, stats = trio.run(run_trace, trace, clock=clock)
    alone = trio.run(run_alone, trace, clock=trio.testing.MockClock(autojump_threshold=0))
    for arrival, outcome, expected in zip(trace.arrivals, outcomes, alone):
        check_one(arrival, outcome, expected)
    # At idle every used page is the prefix cache's (none without one).
    assert stats.num_pages_used == stats.num_prefix_cache_pages
    assert stats.num_pages_free == trace.num_pages - stats.num_prefix_cache_pages
    assert stats.host_snapshot_bytes == 0
    assert stats.prefix_host_bytes <= trace.host_cache_pages * make_runner(1).page_nbytes
    if not trace.prefix_cache:
        assert stats.num_pages_used == 0 and stats.num_prefix_lookups == 0
    assert (stats.num_waiting, stats.num_running, stats.num_paused) == (0, 0, 0)
    assert sum(stats.requests_by_outcome.values()) == len(trace.arrivals)
    assert stats.num_snapshot_restores + stats.num_replay_restores <= stats.num_preemptions


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abST", max_size=30),
    cuts=st.lists(st.integers(0, 30), max_size=10),
    stops=st.lists(st.text(alphabet="abST", min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_stop_strings_match_across_any_split(text, cuts, stops):
    pieces, last = [], 0
    for cut in sorted(set(c for c in cuts if c <= len(text))):
        pieces.append(text[last:cut])
        last = cut
    pieces.append(text[last:])
    matcher = StopStringMatcher(stops)
    emitted, hit = "", None
    for piece in pieces:
        chunk = matcher.feed(piece)
        emitted += chunk.text
        if chunk.stop_sequence is not None:
            hit = chunk.stop_sequence
            break
    else:
        emitted += matcher.flush()
    # The spec: generation stops after the first piece that makes the text contain a stop
    # string, and the text is cut where the earliest occurrence starts.
    seen = ""
    for piece in pieces:
        seen += piece
        starts = [(seen.find(s), s) for s in stops if s in seen]
        if starts:
            start = min(index for index, _ in starts)
            assert hit is not None and seen[start:].startswith(hit)
            assert emitted == seen[:start]
            return
    assert hit is None and emitted == text


@st.composite
def bursts(draw):
    """Requests arriving together at a few instants over one shared prefix, in a roomy pool:
    many are admitted at once, so single flight (and its takeovers) is exercised."""
    num_shared = draw(st.integers(PAGE + 1, 16))
    arrivals_ = []
    for _ in range(draw(st.integers(2, 8))):
        num_prompt = draw(st.integers(num_shared, 20))
        arrivals_.append(Arrival(
            at_s=draw(st.sampled_from([0.0, 0.0, 0.5, 1.5])), num_prompt=num_prompt,
            max_tokens=draw(st.integers(1, MAX_CONTEXT - num_prompt)), seed=draw(st.integers(0, 2**32)),
            greedy=draw(st.booleans()), cancel_after_s=draw(st.none() | st.integers(0, 12).map(lambda n: n / 8)),
            num_shared=num_shared, read_only=draw(st.integers(0, 5)) == 0,
        ))  # fmt: skip
    return Trace(
        arrivals=tuple(arrivals_), num_pages=draw(st.integers(MAX_CONTEXT // PAGE, 3 * MAX_CONTEXT // PAGE)),
        host_pages=draw(st.sampled_from([0, 1000])), prefill_chunk=draw(st.sampled_from([3, 8, 64])),
        max_concurrency=draw(st.integers(2, 8)), max_pending=8, pending_timeout_s=1000.0, prefix_cache=True,
        host_cache_pages=draw(st.sampled_from([0, 0, 3])), lookahead=draw(st.booleans()),
    )  # fmt: skip


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=bursts())
def test_bursts_over_a_shared_prefix_keep_every_invariant(trace):
    outcomes, stats = trio.run(run_trace, trace, clock=trio.testing.MockClock(autojump_threshold=0))
    alone = trio.run(run_alone, trace, clock=trio.testing.MockClock(autojump_threshold=0))
    for arrival, outcome, expected in zip(trace.arrivals, outcomes, alone):
        check_one(arrival, outcome, expected)
        # Nobody waits forever for pages an owner that left was computing: no queue timeouts.
        assert not isinstance(outcome.error, QueueTimeout)
    assert stats.num_pages_used == stats.num_prefix_cache_pages
    assert sum(stats.requests_by_outcome.values()) == len(trace.arrivals)
