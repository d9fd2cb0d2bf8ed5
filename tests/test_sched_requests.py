"""Per-request semantics through the real engine: text, stop strings and tokens, grammar,
logprobs, seeds, rejections, runner failure. The fake runner samples among the tokens a
constraint allows, so a one-token-at-a-time "script" constraint makes it emit chosen bytes."""

from __future__ import annotations

import numpy as np
import pytest
import trio
import trio.testing

from ninfer.cache.prefix import PrefixCache
from ninfer.sched.config import EngineConfig
from ninfer.sched.engine import open_engine
from ninfer.sched.fake import ByteTokenizer, FakeRunner, VirtualTimeExecutor
from ninfer.sched.prefix_hook import NoPrefixCache
from ninfer.sched.request import (
    EngineUnhealthy,
    FinishReason,
    GenerationRequest,
    InvalidRequest,
    RequestFailed,
    RequestTooLarge,
    TokenDelta,
)

EOS = ByteTokenizer.eos_id


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)


class Script:
    """A TokenConstraint allowing exactly one scripted token at each step."""

    def __init__(self, token_ids, *, finish_at_end=False, fail_at=None):
        self.token_ids = list(token_ids)
        self.position = 0
        self.finish_at_end = finish_at_end
        self.fail_at = fail_at

    def allowed_mask(self):
        if self.position == self.fail_at:
            raise RuntimeError("grammar exploded")
        mask = np.zeros(ByteTokenizer.vocab_size, dtype=bool)
        mask[self.token_ids[self.position]] = True
        return mask

    def advance(self, token_id):
        assert token_id == self.token_ids[self.position]
        self.position += 1

    def is_finished(self):
        return self.finish_at_end and self.position == len(self.token_ids)


def text_ids(text):
    return list(text.encode())


def make_runner(**overrides):
    args = dict(num_pages=64, page_size=4, max_context=64)
    args.update(overrides)
    return FakeRunner(**args)


def engine_for(runner, *, stop_token_ids=(EOS,), **config):
    values = dict(page_size=4, prefill_chunk=16, max_concurrency=4)
    values.update(config)
    return open_engine(EngineConfig(**values), runner, ByteTokenizer(), stop_token_ids=stop_token_ids,
                       executor=VirtualTimeExecutor(runner))  # fmt: skip


def scripted(text_or_ids, max_tokens=32, **fields):
    ids = text_ids(text_or_ids) if isinstance(text_or_ids, str) else list(text_or_ids)
    constraint = fields.pop("constraint", None) or Script(ids)
    return GenerationRequest(prompt_ids=(1, 2, 3), max_tokens=max_tokens, constraint=constraint, **fields)


async def run(engine, request):
    deltas = []
    async with engine.submit(request) as stream:
        async for event in stream:
            if isinstance(event, TokenDelta):
                deltas.append(event)
            else:
                last = event
    return deltas, last


async def test_stop_string_across_tokens_is_never_emitted(autojump_clock):
    async with engine_for(make_runner()) as engine:
        deltas, finished = await run(engine, scripted("Hello, world STOP and more", stop=("STOP",)))
    assert "".join(d.text for d in deltas) == "Hello, world "
    assert finished.reason is FinishReason.STOP and finished.stop_sequence == "STOP"
    # Every sampled token is reported, up to the one that completed the stop string.
    assert [i for d in deltas for i in d.token_ids] == text_ids("Hello, world STOP")
    # "S", "T", "O" were held back as a possible stop string: their deltas carry no text.
    assert [d.text for d in deltas[-4:]] == ["", "", "", ""]


async def test_a_false_start_of_a_stop_string_is_released(autojump_clock):
    async with engine_for(make_runner()) as engine:
        deltas, finished = await run(engine, scripted("a STOx b", max_tokens=8, stop=("STOP", "xyz")))
    # "STO" is released when "x" arrives, but "x" itself may start "xyz" until " " comes.
    assert [d.text for d in deltas] == ["a", " ", "", "", "", "STO", "x ", "b"]
    assert finished.reason is FinishReason.LENGTH


async def test_held_back_text_is_flushed_when_the_length_ends_it(autojump_clock):
    async with engine_for(make_runner()) as engine:
        deltas, finished = await run(engine, scripted("abST", max_tokens=4, stop=("STOP",)))
    assert finished.reason is FinishReason.LENGTH
    assert "".join(d.text for d in deltas) == "abST"
    assert deltas[-1].token_ids == () and deltas[-1].text == "ST"


async def test_utf8_split_over_tokens_is_never_broken(autojump_clock):
    async with engine_for(make_runner()) as engine:
        deltas, _ = await run(engine, scripted("é€", max_tokens=5))
    assert [d.text for d in deltas] == ["", "é", "", "", "€"]


async def test_stop_token_ends_with_stop_and_is_not_emitted(autojump_clock):
    async with engine_for(make_runner()) as engine:
        deltas, finished = await run(engine, scripted([*text_ids("hi"), EOS, *text_ids("zz")]))
        ignoring, ignored = await run(engine, scripted([*text_ids("hi"), EOS, *text_ids("zz")],
                                                       max_tokens=5, ignore_eos=True))  # fmt: skip
        own, own_finished = await run(engine, scripted("hiQ", stop_token_ids=(ord("Q"),)))
    assert [i for d in deltas for i in d.token_ids] == text_ids("hi")
    assert finished.reason is FinishReason.STOP and finished.stop_token_id == EOS
    assert finished.stop_sequence is None and finished.usage.completion_tokens == 3
    assert ignored.reason is FinishReason.LENGTH
    assert [i for d in ignoring for i in d.token_ids] == [*text_ids("hi"), EOS, *text_ids("zz")]
    assert "".join(d.text for d in own) == "hi" and own_finished.stop_token_id == ord("Q")


async def test_a_finished_grammar_stops_the_request(autojump_clock):
    async with engine_for(make_runner()) as engine:
        deltas, finished = await run(engine, scripted("{}", constraint=Script(text_ids("{}"), finish_at_end=True)))
    assert finished.reason is FinishReason.STOP and finished.stop_sequence is None
    assert "".join(d.text for d in deltas) == "{}"


async def test_logprobs_come_from_the_runner(autojump_clock):
    runner = make_runner()
    request = GenerationRequest(prompt_ids=(5, 6), max_tokens=3, seed=9, logprobs=True, top_logprobs=2)
    async with engine_for(runner) as engine:
        deltas, _ = await run(engine, request)
    for delta in deltas:
        (logprob,) = delta.logprobs
        assert logprob.token_id == delta.token_ids[0]
        assert [t for t, _ in logprob.top] == [delta.token_ids[0], (delta.token_ids[0] + 1) % 257]
        assert logprob.top[0][1] == logprob.logprob <= 0


async def test_seeds_are_drawn_when_missing_and_decide_the_tokens(autojump_clock):
    async def tokens(engine, seed):
        async with engine.submit(GenerationRequest(prompt_ids=(5, 6), max_tokens=6, seed=seed)) as stream:
            return stream.seed, (await stream.collect()).token_ids

    config = dict(seed=1234)
    async with engine_for(make_runner(), stop_token_ids=(), **config) as engine:
        drawn, first = await tokens(engine, None)
        _, again = await tokens(engine, drawn)
        other_seed, other = await tokens(engine, None)
    async with engine_for(make_runner(), stop_token_ids=(), **config) as engine:
        redrawn, _ = await tokens(engine, None)
    assert isinstance(drawn, int) and drawn == redrawn and other_seed != drawn
    assert first == again and first != other


async def test_rejections_are_precise(autojump_clock):
    async with engine_for(make_runner(), max_context=32) as engine:
        with pytest.raises(RequestTooLarge, match="prompt has 32 tokens but the context holds 32"):
            engine.submit(GenerationRequest(prompt_ids=(1,) * 32, max_tokens=1))
        with pytest.raises(RequestTooLarge, match=r"at most 2 tokens"):
            engine.submit(GenerationRequest(prompt_ids=(1,) * 30, max_tokens=3))
        with pytest.raises(InvalidRequest, match="outside the vocabulary"):
            engine.submit(GenerationRequest(prompt_ids=(1, 900), max_tokens=3))
        # Exactly filling the context is fine: the last sampled token needs no KV slot.
        async with engine.submit(GenerationRequest(prompt_ids=(1,) * 30, max_tokens=2, ignore_eos=True)) as s:
            assert (await s.collect()).finished.usage.completion_tokens == 2
        assert engine.statistics().requests_by_outcome["too_large"] == 2


def test_config_is_validated_with_sentences():
    with pytest.raises(ValueError, match="max_concurrency .* at least 1"):
        EngineConfig(max_concurrency=0)
    with pytest.raises(ValueError, match="pending_timeout_s"):
        EngineConfig(pending_timeout_s=0)


async def test_engine_refuses_a_too_small_pool():
    with pytest.raises(ValueError, match="fewer than max_context"):
        async with open_engine(EngineConfig(page_size=4), make_runner(num_pages=15), ByteTokenizer()):
            pass
    with pytest.raises(ValueError, match="page size"):
        async with open_engine(EngineConfig(page_size=16), make_runner(), ByteTokenizer()):
            pass


async def test_a_bad_grammar_fails_only_its_own_request(autojump_clock):
    async with engine_for(make_runner(), stop_token_ids=()) as engine:
        good = engine.submit(GenerationRequest(prompt_ids=(1, 2), max_tokens=6, seed=1))
        bad = engine.submit(scripted("abcdef", constraint=Script(text_ids("abcdef"), fail_at=2)))
        async with good, bad:
            bad_result = await bad.collect()
            good_result = await good.collect()
        assert engine.is_healthy
    assert bad_result.finished.reason is FinishReason.ERROR and "grammar exploded" in bad_result.finished.error
    assert bad_result.text == "ab"
    assert good_result.finished.reason is FinishReason.LENGTH and len(good_result.token_ids) == 6


async def test_runner_failure_fails_in_flight_requests_and_marks_the_engine_unhealthy(autojump_clock):
    runner = make_runner(fail_at_step=2)
    async with engine_for(runner, stop_token_ids=(), max_concurrency=2) as engine:
        streams = [engine.submit(GenerationRequest(prompt_ids=(1, 2), max_tokens=8, seed=i)) for i in range(3)]
        results = []
        for stream in streams[:2]:
            async with stream:
                results.append(await stream.collect())
        with pytest.raises(EngineUnhealthy, match="the runner failed"):
            async with streams[2]:
                await streams[2].collect()
        assert not engine.is_healthy
        with pytest.raises(EngineUnhealthy):
            engine.submit(GenerationRequest(prompt_ids=(1,), max_tokens=1))
        stats = engine.statistics()
    for result in results:
        assert result.finished.reason is FinishReason.ERROR
        # every client sees the same message: the exception's text (maybe another request's
        # data) stays in the log
        assert "the runner failed (RuntimeError" in result.finished.error
        assert "injected runner failure" not in result.finished.error
        assert len(result.token_ids) == 2  # two steps ran before the failure
    assert not stats.is_healthy and stats.num_pages_used == 0
    assert stats.requests_by_outcome["error"] == 2 and stats.requests_by_outcome["unhealthy"] == 2


async def test_leaving_the_engine_ends_every_stream(autojump_clock):
    async with engine_for(make_runner(), stop_token_ids=(), max_concurrency=1) as engine:
        running = engine.submit(GenerationRequest(prompt_ids=(1, 2), max_tokens=50))
        queued = engine.submit(GenerationRequest(prompt_ids=(1, 2), max_tokens=50))
        await trio.sleep(0.1)
    assert (await running.collect()).finished.reason is FinishReason.CANCELLED
    with pytest.raises(EngineUnhealthy, match="shut down"):
        await queued.collect()


class HoardingCache(NoPrefixCache):
    """A stand-in prefix cache that holds inactive pages and gives them back on demand."""

    def __init__(self, num_pages):
        self.num_pages = num_pages
        self.held = None
        self.reclaimed = 0
        self.published = []

    def attach(self, seq, pool):
        if self.held is None:
            self.held = pool.allocate(self.num_pages)

    def publish(self, seq, pool):
        self.published.append((seq.seq_id, len(seq.pages)))

    def num_reclaimable_pages(self, at_most=None):
        return min(len(self.held or ()), at_most if at_most is not None else len(self.held or ()))

    def reclaim(self, num_pages, pool):
        pool.release(self.held[:num_pages])
        self.held = self.held[num_pages:]
        self.reclaimed += num_pages


async def test_inactive_cache_pages_are_reclaimed_before_pausing_anyone(autojump_clock):
    runner = make_runner(num_pages=8, max_context=32)
    cache = HoardingCache(num_pages=5)
    config = EngineConfig(page_size=4, max_concurrency=2, host_snapshot_bytes=1 << 20)
    requests = [GenerationRequest(prompt_ids=(1, 2, 3, 4), max_tokens=12, seed=i) for i in range(2)]
    async with open_engine(config, runner, ByteTokenizer(), executor=VirtualTimeExecutor(runner),
                           prefix_cache=cache) as engine:  # fmt: skip
        streams = [engine.submit(r) for r in requests]
        results = []
        for stream in streams:
            async with stream:
                results.append(await stream.collect())
        stats = engine.statistics()
    # Two requests of 4 pages each need all 8: the cache's 5 inactive pages go back first.
    assert cache.reclaimed == 5 and stats.num_preemptions == 0
    assert sorted(cache.published) == [(0, 4), (1, 4)]  # offered the pages before release
    assert all(r.finished.reason is FinishReason.LENGTH for r in results)


async def test_lookahead_runs_while_the_queue_waits_for_a_lane(autojump_clock):
    """With every lane busy a queued request cannot change the next plan, so decode steps keep
    being submitted one ahead; each request still gets the tokens it gets alone, and a stop
    token ends its request with the token in flight dropped."""
    requests = [GenerationRequest(prompt_ids=(5, 6, i), max_tokens=12, seed=i) for i in range(3)]

    async def outputs(pipelined):
        runner = make_runner()
        runner.pipelined = pipelined
        async with engine_for(runner, stop_token_ids=(), max_concurrency=1) as engine:
            async with trio.open_nursery() as nursery:
                results = {}

                async def one(i):
                    async with engine.submit(requests[i]) as stream:
                        results[i] = (await stream.collect()).token_ids

                for i in range(3):
                    nursery.start_soon(one, i)
            stats = engine.statistics()
        return [results[i] for i in range(3)], stats

    alone, plain = await outputs(False)
    ahead, stats = await outputs(True)
    assert ahead == alone and all(len(t) == 12 for t in ahead)
    assert plain.num_lookahead_steps == 0
    # per request: its prompt step, then 11 decode steps, each submitted fed by the one before
    assert stats.num_lookahead_steps == 3 * 11 and stats.num_steps == plain.num_steps
    stop = alone[0][4]  # the fifth token of request 0 as a stop token: it ends after 4 deltas
    runner = make_runner()
    runner.pipelined = True
    async with engine_for(runner, stop_token_ids=(stop,), max_concurrency=1) as engine:
        async with engine.submit(requests[0]) as stream:
            done = await stream.collect()
    assert done.token_ids == alone[0][:4] and done.finished.reason is FinishReason.STOP


# ---- one request's failure stays its own --------------------------------------------------


class ExplodingPrefixCache(PrefixCache):
    """The real prefix cache, failing for the requests of two tenants: a stand-in for any bug
    in work the step task does for one request (the bad cache_salt of a review was one)."""

    def attach(self, seq, pool):
        if seq.request.cache_salt == "explode-on-lookup":
            raise RuntimeError("lookup exploded")
        super().attach(seq, pool)

    def publish(self, seq, pool):
        if seq.request.cache_salt == "explode-on-publish":
            raise RuntimeError("publish exploded")
        super().publish(seq, pool)


def exploding_engine(runner):
    cache = ExplodingPrefixCache(page_size=4, page_nbytes=runner.page_nbytes, host_budget_bytes=0)
    return open_engine(EngineConfig(page_size=4, prefill_chunk=16, max_concurrency=4), runner, ByteTokenizer(),
                       stop_token_ids=(), executor=VirtualTimeExecutor(runner), prefix_cache=cache)  # fmt: skip


async def test_a_request_whose_own_work_fails_fails_alone(autojump_clock):
    async with exploding_engine(make_runner()) as engine:
        innocent = engine.submit(GenerationRequest(prompt_ids=(1, 2, 3, 4, 5), max_tokens=6))
        bad = engine.submit(GenerationRequest(prompt_ids=(1, 2, 3), max_tokens=6, cache_salt="explode-on-lookup"))
        unpublished = engine.submit(GenerationRequest(prompt_ids=(7, 8, 9), max_tokens=6, cache_salt="explode-on-publish"))
        with pytest.raises(RequestFailed) as failure:
            async with bad:
                await bad.collect()
        assert "exploded" not in str(failure.value)  # the details stay in the log
        for stream in (innocent, unpublished):
            async with stream:
                result = await stream.collect()
            assert result.finished.reason is FinishReason.LENGTH and result.finished.error is None
            assert len(result.token_ids) == 6
        assert engine.is_healthy
        async with engine.submit(GenerationRequest(prompt_ids=(1, 2), max_tokens=2)) as later:
            assert (await later.collect()).finished.reason is FinishReason.LENGTH
        stats = engine.statistics()
    assert stats.is_healthy and stats.requests_by_outcome["error"] == 1


def test_a_cache_salt_that_is_not_unicode_is_refused_when_the_request_is_made():
    with pytest.raises(ValueError, match="cache_salt"):
        GenerationRequest(prompt_ids=(1,), max_tokens=1, cache_salt="\ud800")
