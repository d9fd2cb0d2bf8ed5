"""The prefix cache inside the engine: exactness, pressure, concurrency, reporting.

A tiny random llama on the real numpy `ReferenceRunner` (runner calls in worker threads, as in
production) with byte tokens; the three-turn conversation runs the real SmolLM2 model behind the
real server and the official SDKs.
"""

from __future__ import annotations

import numpy as np
import pytest
import trio

from ninfer.core.params import SamplingParams
from ninfer.gpu.reference import ReferenceRunner
from ninfer.sched.config import EngineConfig
from ninfer.sched.engine import open_engine
from ninfer.sched.fake import ByteTokenizer
from ninfer.sched.request import Finished, FinishReason, GenerationRequest, Started, TokenDelta
from tiny_models import tiny_llama

PAGE = 4
MAX_CONTEXT = 96
SYSTEM = b"You are terse. Notes: alpha beta gamma. "  # 40 tokens: ten full pages
QUESTIONS = [b"Who?", b"Why not?", b"When, then?", b"How many are there?"]
GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=257, max_context=MAX_CONTEXT, seed=11)


def request(prompt: bytes, sampling=GREEDY, *, seed=7, max_tokens=6, **kwargs) -> GenerationRequest:
    return GenerationRequest(prompt_ids=tuple(prompt), max_tokens=max_tokens, sampling=sampling, seed=seed,
                             ignore_eos=True, **kwargs)  # fmt: skip


def config(**overrides) -> EngineConfig:
    values = dict(page_size=PAGE, prefill_chunk=16, max_concurrency=4, max_context=MAX_CONTEXT)
    values.update(overrides)
    return EngineConfig(**values)


async def run_one(engine, req):
    async with engine.submit(req) as stream:
        return await stream.collect()


async def run_sequentially(model, reqs, *, num_pages=64, **overrides):
    """Each request after the previous one finished; returns (completions, statistics)."""
    runner = ReferenceRunner(model, num_pages=num_pages, page_size=PAGE)
    async with open_engine(config(**overrides), runner, ByteTokenizer()) as engine:
        results = [await run_one(engine, req) for req in reqs]
        stats = engine.statistics()
        check_idle_pool(engine)
    return results, stats


def check_idle_pool(engine) -> None:
    """At idle the pool's references are exactly the prefix cache's (none without one)."""
    holders = getattr(engine._state.prefix, "holders", list)
    engine._state.pool.check_consistent(holders=holders())


def tokens(results):
    return [r.token_ids for r in results]


# -- exactness -----------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_output_with_the_cache_equals_output_without_it(model, sampling):
    reqs = [request(SYSTEM + q, sampling, seed=100 + i) for i, q in enumerate(QUESTIONS)]
    reqs.append(request(SYSTEM + QUESTIONS[0], sampling, seed=100))  # the very same request again
    without, stats_off = await run_sequentially(model, reqs, prefix_cache=False)
    cached, stats_on = await run_sequentially(model, reqs)
    assert tokens(cached) == tokens(without)
    assert [r.started.cached_tokens for r in without] == [0] * len(reqs) and stats_off.num_prefix_lookups == 0
    hits = [r.started.cached_tokens for r in cached]
    assert hits[0] == 0 and all(hit >= len(SYSTEM) for hit in hits[1:])
    assert hits[-1] == len(reqs[-1].prompt_ids) - 1  # all but the last prompt token
    assert [r.finished.usage.cached_tokens for r in cached] == hits
    assert stats_on.num_cached_prompt_tokens == sum(hits) and stats_on.num_prefix_hits == len(reqs) - 1


async def test_the_next_turn_reuses_the_previous_answer(model):
    runner = ReferenceRunner(model, num_pages=64, page_size=PAGE)
    async with open_engine(config(), runner, ByteTokenizer()) as engine:
        first = await run_one(engine, request(SYSTEM + b"Q1:", max_tokens=8))
        history = SYSTEM + b"Q1:" + bytes(first.token_ids)
        second = await run_one(engine, request(history + b"Q2:"))
    assert second.started.cached_tokens == len(history) - 1  # the answer's KV too (its last token is new)
    alone, _ = await run_sequentially(model, [request(history + b"Q2:")], prefix_cache=False)
    assert second.token_ids == alone[0].token_ids


async def test_exact_after_demotion_to_host_and_restore(model):
    # A pool of one context: the long unrelated request needs every page the cache holds.
    unrelated = request(bytes(range(100, 160)), max_tokens=10)
    reqs = [request(SYSTEM + QUESTIONS[0]), unrelated, request(SYSTEM + QUESTIONS[1])]
    without, _ = await run_sequentially(model, reqs, num_pages=24, prefix_cache=False)
    cached, stats = await run_sequentially(model, reqs, num_pages=24, max_concurrency=1)
    assert tokens(cached) == tokens(without)
    assert stats.num_prefix_demotions > 0 and stats.num_prefix_restores > 0
    assert cached[2].started.cached_tokens >= len(SYSTEM)
    assert stats.num_preemptions == 0  # inactive cache gave way; nobody active was paused


async def test_pressure_evicts_least_recently_used_and_never_starves_the_active(model):
    prompts = [bytes([65 + i]) * 24 for i in range(3)]  # three distinct 6-page prompts
    touch_first = request(prompts[0] + b"?", max_tokens=2)  # makes prompt 0 more recent than 1 and 2
    big = request(bytes(range(150, 186)), max_tokens=4)  # 40 positions: 10 of the 24 pages
    after = [request(p + b"!", max_tokens=2) for p in prompts]
    reqs = [*(request(p, max_tokens=2) for p in prompts), touch_first, big, *after]
    cached, stats = await run_sequentially(model, reqs, num_pages=24, host_cache_bytes=0, max_concurrency=1)
    without, _ = await run_sequentially(model, reqs, num_pages=24, prefix_cache=False)
    assert tokens(cached) == tokens(without)
    assert all(r.finished.reason is FinishReason.LENGTH for r in cached)
    assert stats.num_preemptions == 0 and stats.num_prefix_evictions > 0 and stats.num_prefix_demotions == 0
    # The most recently used prompt kept its pages; the least recently used lost theirs.
    hits = [r.started.cached_tokens for r in cached[-3:]]
    assert hits[0] == 24 and hits[1] == 0


# -- concurrency ---------------------------------------------------------------------------


async def test_concurrent_requests_with_a_cached_prefix_share_its_pages(model):
    runner = ReferenceRunner(model, num_pages=64, page_size=PAGE)
    async with open_engine(config(), runner, ByteTokenizer()) as engine:
        warm = await run_one(engine, request(SYSTEM + b"warm"))
        pool = engine._state.pool
        streams = [engine.submit(request(SYSTEM + q, max_tokens=12)) for q in QUESTIONS]
        started, shared_pages = [], 0

        async def follow(stream):
            nonlocal shared_pages
            async with stream:
                async for event in stream:
                    if isinstance(event, Started):
                        started.append(event.cached_tokens)
                    elif isinstance(event, TokenDelta) and event.token_ids:
                        shared_pages = max(shared_pages, pool.statistics().num_shared)

        async with trio.open_nursery() as nursery:
            for stream in streams:
                nursery.start_soon(follow, stream)
        holders = [seq.pages for seq in engine._state.running]
        pool.check_consistent(holders=holders + engine._state.prefix.holders())
    assert warm.started.cached_tokens == 0
    assert started == [len(SYSTEM)] * len(QUESTIONS)
    # Every one of SYSTEM's ten pages was held by the cache and the running requests at once.
    assert shared_pages >= len(SYSTEM) // PAGE


async def test_a_request_arriving_mid_generation_reuses_pages_still_in_use(model):
    runner = ReferenceRunner(model, num_pages=64, page_size=PAGE)
    async with open_engine(config(), runner, ByteTokenizer()) as engine:
        async with engine.submit(request(SYSTEM + b"first", max_tokens=20)) as first:
            async for event in first:
                if getattr(event, "token_ids", ()):
                    break  # the first is decoding, nowhere near finished
            second = await run_one(engine, request(SYSTEM + b"first", max_tokens=3))
            finished = [event async for event in first if isinstance(event, Finished)]
    # Its full pages were shared as soon as they were computed: all but the last page's 2 tokens.
    assert second.started.cached_tokens == len(SYSTEM + b"first") // PAGE * PAGE
    assert finished[0].reason is FinishReason.LENGTH


# -- controls ------------------------------------------------------------------------------


async def test_salts_read_only_and_disabled_cache(model):
    prompt = SYSTEM + b"same"
    reqs = [
        request(prompt, cache_salt="tenant-a"),
        request(prompt, cache_salt="tenant-b"),  # another tenant: nothing shared
        request(prompt, cache_salt="tenant-a"),  # the same tenant: a hit
        request(SYSTEM + b"other", cache_read_only=True),  # no salt: finds nothing, publishes nothing
        request(SYSTEM + b"other"),  # so this one finds nothing either
    ]
    cached, stats = await run_sequentially(model, reqs)
    hits = [r.started.cached_tokens for r in cached]
    assert hits[:3] == [0, 0, len(prompt) - 1]
    assert hits[3:] == [0, 0]
    disabled, stats_off = await run_sequentially(model, reqs, prefix_cache=False)
    assert [r.started.cached_tokens for r in disabled] == [0] * len(reqs)
    assert tokens(disabled) == tokens(cached)
    assert stats_off.num_pages_used == 0 and stats.num_pages_used == stats.num_prefix_cache_pages


def test_engine_config_validates_the_cache_fields():
    with pytest.raises(TypeError):
        EngineConfig(prefix_cache="yes")
    with pytest.raises(ValueError, match="host_cache_bytes"):
        EngineConfig(host_cache_bytes=-1)
    assert np.isfinite(EngineConfig().host_cache_bytes)


async def test_concurrent_requests_take_pages_from_inactive_cache_not_from_each_other(model):
    runner = ReferenceRunner(model, num_pages=24, page_size=PAGE)
    fill = [request(bytes([70 + i]) * 30, max_tokens=2) for i in range(4)]  # 4 x 8 pages > the pool
    together = [request(bytes([90 + i]) * 36, max_tokens=8) for i in range(2)]  # 2 x 11 pages
    async with open_engine(config(host_cache_bytes=4 * runner.page_nbytes), runner, ByteTokenizer()) as engine:
        for req in fill:
            await run_one(engine, req)
        assert engine.statistics().num_pages_free <= 8  # the pool is mostly inactive cache
        results = [None, None]
        async with trio.open_nursery() as nursery:
            for i, req in enumerate(together):
                async def one(i=i, req=req):
                    results[i] = await run_one(engine, req)

                nursery.start_soon(one)
        stats = engine.statistics()
    alone, _ = await run_sequentially(model, together, prefix_cache=False)
    assert tokens(results) == tokens(alone)
    assert stats.num_preemptions == 0
    # The host tier holds its 4 most recent demoted pages; older ones were evicted for them.
    assert stats.num_prefix_host_pages == 4 and stats.prefix_host_bytes == 4 * runner.page_nbytes
    assert stats.num_prefix_demotions > 4 and stats.num_prefix_evictions > 0


# -- through the server --------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(smollm2):
    from server_fixtures import running_server, small_settings

    with running_server(small_settings(max_context=512, kv_capacity=4096), smollm2) as s:
        yield s


@pytest.mark.slow
def test_a_three_turn_conversation_reports_the_previous_turns_as_cached(server):
    client = server.openai()
    model_id = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Name a colour."}]
    usages = []
    for follow_up in ("And another one?", "Which of the two is darker?", None):
        reply = client.chat.completions.create(model=model_id, messages=messages, max_tokens=6, temperature=0)
        usages.append(reply.usage)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content}]
        if follow_up is not None:
            messages += [{"role": "user", "content": follow_up}]
    cached = [u.prompt_tokens_details.cached_tokens for u in usages]
    prompts = [u.prompt_tokens for u in usages]
    assert cached[0] < prompts[0]
    # Turns two and three reuse every token of the previous turn's prompt (and its answer).
    assert cached[1] >= prompts[0] and cached[2] >= prompts[1]

    anthropic = server.anthropic()
    history = [{"role": "user", "content": "Name a fruit."}]
    first = anthropic.messages.create(model=model_id, messages=history, max_tokens=6, extra_body={"temperature": 0.0})
    history += [{"role": "assistant", "content": first.content[0].text}, {"role": "user", "content": "Why?"}]
    second = anthropic.messages.create(model=model_id, messages=history, max_tokens=6, extra_body={"temperature": 0.0})
    first_prompt = first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    assert second.usage.cache_read_input_tokens >= first_prompt
