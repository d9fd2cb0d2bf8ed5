"""The scheduler's invariants on the real numpy reference runner.

A tiny random llama (2 layers, d 32) with the real SmolLM2 tokenizer's vocabulary, a KV pool of
one max-length sequence, and a host budget that holds one small snapshot: concurrent requests
must pause (both by snapshot and by replay) and still produce exactly the tokens each produces
alone, greedy or seeded.
"""

from __future__ import annotations

import attrs
import pytest
import trio

from ninfer.core.params import SamplingParams
from ninfer.gpu.reference import ReferenceRunner
from ninfer.sched.config import EngineConfig
from ninfer.sched.engine import open_engine
from ninfer.sched.request import FinishReason, GenerationRequest, Started
from tiny_models import tiny_llama

PAGE = 4
MAX_CONTEXT = 48


PROMPTS = [
    "<|im_start|>user\nWhat is a page table?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea,",
    "def fib(n):\n    return",
    "Les pommes de terre sont",
]


def requests(tokenizer):
    made = []
    for index, text in enumerate(PROMPTS):
        prompt = tuple(tokenizer.encode(text))
        greedy = index % 2 == 0
        sampling = SamplingParams(temperature=0.0) if greedy else SamplingParams(temperature=0.9, top_p=0.95)
        made.append(GenerationRequest(prompt_ids=prompt, max_tokens=MAX_CONTEXT - len(prompt) - 8,
                                      sampling=sampling, seed=100 + index, request_id=f"r{index}"))  # fmt: skip
    return made


async def collect_all(engine, reqs):
    results = [None] * len(reqs)

    async def one(index, stream):
        async with stream:
            results[index] = await stream.collect()

    async with trio.open_nursery() as nursery:
        for index, req in enumerate(reqs):
            nursery.start_soon(one, index, engine.submit(req))
    return results


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2.tokenizer


async def test_pressure_on_the_reference_runner_changes_no_token(tokenizer, smollm2):
    model = tiny_llama(vocab_size=tokenizer.vocab_size, max_context=MAX_CONTEXT)
    reqs = requests(tokenizer)
    stop_ids = ()  # random weights: let every request run to its length
    alone_runner = ReferenceRunner(model, num_pages=MAX_CONTEXT // PAGE, page_size=PAGE)
    alone = []
    config = EngineConfig(page_size=PAGE, prefill_chunk=8, prefix_cache=False)
    async with open_engine(config, alone_runner, tokenizer, stop_token_ids=stop_ids) as engine:
        for req in reqs:
            (result,) = await collect_all(engine, [req])
            alone.append(result)

    runner = ReferenceRunner(model, num_pages=MAX_CONTEXT // PAGE, page_size=PAGE)
    config = EngineConfig(page_size=PAGE, prefill_chunk=8, max_concurrency=4,
                          host_snapshot_bytes=4 * runner.page_nbytes)  # fmt: skip
    async with open_engine(config, runner, tokenizer, stop_token_ids=stop_ids) as engine:
        together = await collect_all(engine, reqs)
        stats = engine.statistics()
        await trio.sleep(0)

    assert stats.num_snapshot_restores >= 1 and stats.num_replay_restores >= 1
    assert stats.num_replayed_tokens > 0
    # At idle only the prefix cache (on by default) holds pages.
    assert stats.num_pages_used == stats.num_prefix_cache_pages and stats.host_snapshot_bytes == 0
    assert stats.requests_by_outcome["length"] == len(reqs)
    for req, got, expected in zip(reqs, together, alone):
        assert isinstance(got.started, Started) and got.started.prompt_tokens == len(req.prompt_ids)
        assert got.finished.reason is FinishReason.LENGTH
        assert got.token_ids == expected.token_ids and len(got.token_ids) == req.max_tokens
        assert got.text == expected.text == tokenizer.decode(list(got.token_ids))


async def test_lookahead_on_the_reference_runner_changes_no_token(tokenizer):
    """Decode steps submitted one ahead (fed by the samples of the step before) give each
    request the tokens and log-probabilities it gets without lookahead, alone."""
    model = tiny_llama(vocab_size=tokenizer.vocab_size, max_context=MAX_CONTEXT)
    reqs = [attrs.evolve(req, logprobs=True, top_logprobs=2) if i == 1 else req for i, req in enumerate(requests(tokenizer))]
    pages = 4 * MAX_CONTEXT // PAGE
    alone = []
    config = EngineConfig(page_size=PAGE, prefill_chunk=8, prefix_cache=False, lookahead=False)
    async with open_engine(config, ReferenceRunner(model, num_pages=pages, page_size=PAGE), tokenizer) as engine:
        for req in reqs:
            alone += await collect_all(engine, [req])

    runner = ReferenceRunner(model, num_pages=pages, page_size=PAGE)
    runner.pipelined = True  # the CUDA runner's path: submit ahead with feed, collect behind
    config = EngineConfig(page_size=PAGE, prefill_chunk=8, max_concurrency=4)
    async with open_engine(config, runner, tokenizer, stop_token_ids=()) as engine:
        together = await collect_all(engine, reqs)
        stats = engine.statistics()

    assert stats.num_lookahead_steps > stats.num_steps // 2
    for got, expected in zip(together, alone):
        assert got.token_ids == expected.token_ids and got.text == expected.text
        assert got.finished.reason is expected.finished.reason
        # batched with others vs alone: the same tokens, log-probabilities to float32 rounding
        got_lp, want_lp = got.logprobs or (), expected.logprobs or ()
        assert len(got_lp) == len(want_lp) == (len(got.token_ids) if got_lp else 0)
        for g, w in zip(got_lp, want_lp):
            assert g.logprob == pytest.approx(w.logprob, rel=1e-4, abs=1e-5)
            assert [i for i, _ in g.top] == [i for i, _ in w.top] and len(g.top) == 2


def test_bench_decode_with_lookahead_gives_the_host_fed_tokens(tokenizer):
    """`ninfer bench`'s decode loop submits each step fed by the one before; its streams end on
    the tokens the host-fed loop gives (greedy, three streams, same prompts)."""
    import numpy as np

    from ninfer.cli.bench import bench_decode

    model = tiny_llama(vocab_size=tokenizer.vocab_size, max_context=MAX_CONTEXT)
    runner = ReferenceRunner(model, num_pages=64, page_size=PAGE)
    ahead = bench_decode(runner, 3, 8, 20, 1, np.random.default_rng(5), lookahead=True)
    fed = bench_decode(runner, 3, 8, 20, 1, np.random.default_rng(5), lookahead=False)
    assert ahead["last_tokens"] == fed["last_tokens"] and len(set(fed["last_tokens"])) > 1
