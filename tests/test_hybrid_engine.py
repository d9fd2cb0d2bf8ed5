"""A Qwen3.5 hybrid through the scheduler and the CLI on the reference backend.

Pauses snapshot the recurrent state beside the KV pages (or drop and replay, recomputing it),
the prefix cache reuses a prefix only where it holds a checkpoint of the state (the prompt
boundary of an earlier request), and every page, state and snapshot is given back at idle.
Seeded sampling everywhere (not only greedy): the tokens of a request must not depend on
whether it ran alone, batched, paused either way or over a cached prefix.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import trio

from ninfer.core.params import SamplingParams
from ninfer.gpu.reference import ReferenceRunner
from ninfer.sched.config import EngineConfig
from ninfer.sched.engine import open_engine
from ninfer.sched.request import FinishReason, GenerationRequest

torch = pytest.importorskip("torch")
from hybrid_models import hybrid, model  # noqa: E402, F401 (fixtures)

PAGE = 4
MAX_CONTEXT = 64
NUM_PAGES_ONE_SEQUENCE = MAX_CONTEXT // PAGE
PROMPTS = [f"sys: answer briefly. q{i}: {'why ' * (i + 1)}" for i in range(4)]


def sampling(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.0) if i % 3 == 0 else SamplingParams(temperature=0.9, top_p=0.95)


def make_requests(model, prompts, *, max_tokens=16, tag="h"):
    reqs = []
    for i, text in enumerate(prompts):
        ids = tuple(model.tokenizer.encode(text)) if isinstance(text, str) else tuple(int(t) for t in text)
        reqs.append(GenerationRequest(prompt_ids=ids, max_tokens=max_tokens, sampling=sampling(i), seed=7 + i,
                                      request_id=f"{tag}{i}"))  # fmt: skip
    return reqs


def engine_config(**overrides) -> EngineConfig:
    return EngineConfig(**{"page_size": PAGE, "prefill_chunk": 8, "max_context": MAX_CONTEXT, "max_concurrency": 4,
                           **overrides})  # fmt: skip


async def collect_all(engine, reqs):
    results = [None] * len(reqs)

    async def one(i, stream):
        async with stream:
            results[i] = await stream.collect()

    async with trio.open_nursery() as nursery:
        for i, req in enumerate(reqs):
            nursery.start_soon(one, i, engine.submit(req))
    return results


async def run_engine(model, rounds, *, num_pages, pipelined=False, **config):
    """Each round's requests submitted together, rounds one after another, on one engine;
    (results of every round, statistics at idle, runner)."""
    runner = ReferenceRunner(model, num_pages=num_pages, page_size=PAGE)
    runner.pipelined = pipelined
    results = []
    async with open_engine(engine_config(**config), runner, model.tokenizer, stop_token_ids=()) as engine:
        for reqs in rounds:
            results.append(await collect_all(engine, reqs))
        stats = engine.statistics()
    return results, stats, runner


def assert_idle(stats, runner):
    """Nothing held but the prefix cache's pages and checkpoints."""
    assert stats.num_running == stats.num_paused == stats.num_waiting == 0
    assert stats.num_pages_active == 0
    assert stats.num_pages_used == stats.num_prefix_cache_pages  # no sequence holds a page
    assert stats.host_snapshot_bytes == 0  # no page or state snapshot is left
    assert stats.num_recurrent_states == 0 and stats.recurrent_state_bytes == 0
    assert runner.num_recurrent_states == 0


async def cold(model, reqs, num_pages=4 * NUM_PAGES_ONE_SEQUENCE):
    """Each request alone on a fresh engine without a prefix cache."""
    out = []
    for req in reqs:
        results, _, _ = await run_engine(model, [[req]], num_pages=num_pages, prefix_cache=False,
                                         max_context=MAX_CONTEXT * 2)  # fmt: skip
        out.append(results[0][0])
    return out


@pytest.fixture(scope="module")
def alone(model):
    return trio.run(cold, model, make_requests(model, PROMPTS))


# -- one workload, every way of serving it ----------------------------------------------------


@pytest.mark.parametrize("pipelined", [False, True])  # True: decode steps submitted one ahead, fed
@pytest.mark.parametrize("mode", ["batched", "snapshot", "replay", "cached"])
async def test_seeded_tokens_are_the_same_alone_batched_paused_and_cached(model, alone, mode, pipelined):
    reqs = make_requests(model, PROMPTS)
    rounds, num_pages, config = [reqs], 4 * NUM_PAGES_ONE_SEQUENCE, {}
    if mode == "snapshot":  # one full sequence of pages for four: pauses, with room to snapshot
        num_pages, config = NUM_PAGES_ONE_SEQUENCE, {"host_snapshot_bytes": 1 << 30}
    elif mode == "replay":  # ... and no host budget: every pause drops and replays
        num_pages, config = NUM_PAGES_ONE_SEQUENCE, {"host_snapshot_bytes": 0}
    elif mode == "cached":  # the same requests again: their prompts come from the prefix cache
        rounds = [reqs, make_requests(model, PROMPTS, tag="again")]
    results, stats, runner = await run_engine(model, rounds, num_pages=num_pages, pipelined=pipelined, **config)

    for got in results:
        for result, want in zip(got, alone, strict=True):
            assert result.finished.reason is FinishReason.LENGTH
            assert result.token_ids == want.token_ids
    if mode == "snapshot":
        assert stats.num_snapshot_restores >= 1
    if mode == "replay":
        assert stats.num_replay_restores >= 1 and stats.num_snapshot_restores == 0
    if mode == "cached":
        for result, req in zip(results[1], rounds[1], strict=True):  # each prompt's boundary
            assert result.finished.usage.cached_tokens == (len(req.prompt_ids) - 1) // PAGE * PAGE > 0
        assert stats.num_prefix_hits == len(PROMPTS)
    assert stats.num_prefix_checkpoints >= 1  # the cache is on in every mode
    assert (stats.num_lookahead_steps > 0) == pipelined
    assert_idle(stats, runner)


# -- the prefix cache: checkpoints of the recurrent state --------------------------------------


async def test_a_conversation_reuses_each_previous_prompt_through_its_checkpoint(model):
    encode = model.tokenizer.encode
    prompt = list(encode("sys: you are a tiny hybrid. user: hello there, model!"))
    turns, cached = [], []
    runner = ReferenceRunner(model, num_pages=64, page_size=PAGE)
    config = engine_config(max_context=MAX_CONTEXT * 2)
    async with open_engine(config, runner, model.tokenizer, stop_token_ids=()) as engine:
        for i, follow_up in enumerate([" user: and again?", " user: bye"] + [None]):
            req = make_requests(model, [prompt], max_tokens=8, tag=f"turn{i}")[0]
            req = GenerationRequest(prompt_ids=req.prompt_ids, max_tokens=8, seed=11 + i, request_id=req.request_id,
                                    sampling=SamplingParams(temperature=0.8))  # fmt: skip
            (result,) = await collect_all(engine, [req])
            turns.append((req, result))
            cached.append(result.finished.usage.cached_tokens)
            if follow_up is not None:  # the next turn: this prompt, the reply, a new message
                prompt = prompt + list(result.token_ids) + list(encode(follow_up))
        stats = engine.statistics()
    # each turn reuses the previous turn's prompt up to its last page boundary, no further
    want = [0] + [(len(req.prompt_ids) - 1) // PAGE * PAGE for req, _ in turns[:-1]]
    assert cached == want and all(n > 0 for n in cached[1:])
    assert stats.num_prefix_checkpoints == 3 and stats.prefix_checkpoint_bytes == 3 * runner.state_nbytes
    assert_idle(stats, runner)
    # the same tokens as cold runs of each turn (seeded sampling)
    colds = await cold(model, [req for req, _ in turns], num_pages=64)
    for (req, result), want_result in zip(turns, colds, strict=True):
        assert result.token_ids == want_result.token_ids


async def test_a_lookup_falls_back_to_the_longest_boundary_with_a_checkpoint(model):
    a = list(np.random.default_rng(3).integers(0, 256, 30))
    other = list(np.random.default_rng(4).integers(0, 256, 20))
    prompts = {
        "e": a[:13],  # checkpoints position 12
        "a": a,  # walks 7 pages: reuses 12 (e's checkpoint), checkpoints 28
        "d": a[:22] + other[:8],  # walks 5 pages, no checkpoint at 20: falls back to 12
        "c": a + other[:6],  # walks past 28: reuses a's checkpoint there
        "b": other,  # shares nothing
    }
    want_cached = {"e": 0, "a": 12, "d": 12, "c": 28, "b": 0}
    reqs = [make_requests(model, [p], max_tokens=6, tag=name)[0] for name, p in prompts.items()]
    results, stats, runner = await run_engine(model, [[r] for r in reqs], num_pages=64)
    got = {req.request_id[0]: r[0].finished.usage.cached_tokens for req, r in zip(reqs, results, strict=True)}
    assert got == want_cached
    assert stats.num_prefix_checkpoints == 5  # e, a, d, c, b each at its own prompt boundary
    for r, want in zip(results, await cold(model, reqs, num_pages=64), strict=True):
        assert r[0].token_ids == want.token_ids
    assert_idle(stats, runner)


class CountingRunner(ReferenceRunner):
    """The reference runner, counting where each restored state came from."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.restored = {"device": 0, "host": 0}

    def restore_state(self, seq_id, snapshot):
        self.restored["device" if snapshot.on_device else "host"] += 1
        super().restore_state(seq_id, snapshot)


async def test_device_checkpoints_demote_to_host_copies_and_both_restore_exactly(model):
    """A runner with one checkpoint slot: each new checkpoint takes the slot and the one there
    is demoted to a host copy. The lookups of the fallback scenario then restore from the slot
    (a: e's) and from demoted copies (d: e's, c: a's), with the cold runs' tokens."""
    a = list(np.random.default_rng(3).integers(0, 256, 30))
    other = list(np.random.default_rng(4).integers(0, 256, 20))
    prompts = {"e": a[:13], "a": a, "d": a[:22] + other[:8], "c": a + other[:6], "b": other}
    reqs = [make_requests(model, [p], max_tokens=6, tag=name)[0] for name, p in prompts.items()]
    runner = CountingRunner(model, num_pages=64, page_size=PAGE, checkpoint_slots=1)
    results = []
    async with open_engine(engine_config(), runner, model.tokenizer, stop_token_ids=()) as engine:
        for req in reqs:
            results.append((await collect_all(engine, [req]))[0])
        stats = engine.statistics()
        cache = engine._state.prefix
        got = {req.request_id[0]: r.finished.usage.cached_tokens for req, r in zip(reqs, results, strict=True)}
        assert got == {"e": 0, "a": 12, "d": 12, "c": 28, "b": 0}
        assert runner.restored == {"device": 1, "host": 2}
        assert stats.num_prefix_checkpoints == 5 and stats.num_prefix_device_checkpoints == 1
        assert stats.prefix_checkpoint_bytes == 4 * runner.state_nbytes  # the demoted four
        assert runner.num_free_checkpoint_slots == 0
        assert cache._tiers.release_checkpoint == runner.release_checkpoint  # dropped ones free their slot
        assert_idle(stats, runner)
    for r, want in zip(results, await cold(model, reqs, num_pages=64), strict=True):
        assert r.token_ids == want.token_ids


async def test_evicting_an_entry_releases_its_checkpoint_slot(model):
    from ninfer.cache.prefix import PrefixCache, model_salt

    runner = ReferenceRunner(model, num_pages=64, page_size=PAGE, checkpoint_slots=2)
    cache = PrefixCache(page_size=PAGE, page_nbytes=runner.page_nbytes, salt=model_salt(runner.spec, "t"),
                        checkpoint_budget_bytes=4 * runner.state_nbytes)  # no host tier: a reclaim evicts
    cache.set_checkpoint_release(runner.release_checkpoint)
    async with open_engine(engine_config(), runner, model.tokenizer, prefix_cache=cache) as engine:
        for req in make_requests(model, PROMPTS[:3], max_tokens=4):
            await collect_all(engine, [req])
        stats = engine.statistics()
        assert (stats.num_prefix_checkpoints, stats.num_prefix_device_checkpoints) == (3, 2)
        assert runner.num_free_checkpoint_slots == 0
        cache.reclaim(cache.num_reclaimable_pages(), engine._state.pool)
    after = cache.statistics()
    assert after.num_checkpoints == after.num_device_checkpoints == after.checkpoint_bytes == 0
    assert runner.num_free_checkpoint_slots == 2


async def test_checkpoints_stay_within_their_budget(model):
    from ninfer.cache.prefix import PrefixCache, model_salt

    runner = ReferenceRunner(model, num_pages=64, page_size=PAGE)
    cache = PrefixCache(page_size=PAGE, page_nbytes=runner.page_nbytes, salt=model_salt(runner.spec, "t"),
                        checkpoint_budget_bytes=2 * runner.state_nbytes)  # fmt: skip
    reqs = make_requests(model, PROMPTS, max_tokens=4)
    async with open_engine(engine_config(), runner, model.tokenizer, prefix_cache=cache) as engine:
        for req in reqs:
            await collect_all(engine, [req])
        stats = engine.statistics()
        # the two most recent prompts keep theirs; the oldest lost them (and with them any reuse)
        again = await collect_all(engine, make_requests(model, [PROMPTS[0], PROMPTS[3]], max_tokens=4, tag="x"))
        pool = engine._state.pool
    assert stats.num_prefix_checkpoints == 2 and stats.prefix_checkpoint_bytes == 2 * runner.state_nbytes
    assert again[0].finished.usage.cached_tokens == 0
    assert again[1].finished.usage.cached_tokens > 0
    cache.reclaim(cache.num_reclaimable_pages(), pool)  # evicting (no host tier) takes the checkpoints along
    after = cache.statistics()
    assert after.num_device_pages == after.num_checkpoints == after.checkpoint_bytes == 0 and pool.num_used == 0


# -- the state's bytes in the accounting ------------------------------------------------------


async def test_a_snapshot_pause_counts_the_state_bytes_against_the_host_budget(model):
    state_nbytes = ReferenceRunner(model, num_pages=1, page_size=PAGE).state_nbytes
    reqs = make_requests(model, PROMPTS)
    # a budget for several pages but one byte short of a state: no pause can snapshot
    results, stats, runner = await run_engine(model, [reqs], num_pages=NUM_PAGES_ONE_SEQUENCE,
                                              host_snapshot_bytes=state_nbytes - 1)  # fmt: skip
    assert state_nbytes - 1 > 4 * runner.page_nbytes  # (pages alone would fit)
    assert stats.num_preemptions >= 1 and stats.num_snapshot_restores == 0
    assert_idle(stats, runner)


def test_the_runner_must_hold_a_state_for_every_lane(model):
    runner = ReferenceRunner(model, num_pages=NUM_PAGES_ONE_SEQUENCE, page_size=PAGE)
    runner.max_states = 2  # as a CUDA runner built with max_sequences=2

    async def main():
        async with open_engine(engine_config(max_concurrency=4), runner, model.tokenizer):
            pass

    with pytest.raises(ValueError, match="recurrent state for 2 sequences"):
        trio.run(main)


def test_auto_kv_sizing_takes_every_lanes_state_out_of_the_budget(model):
    from ninfer import runtime

    config = engine_config(max_concurrency=8)
    state = ReferenceRunner(model, num_pages=1, page_size=PAGE).state_nbytes
    assert runtime.state_nbytes_for(model, config, "reference") == 8 * state
    # and the graphs' spare slot and the prefix cache's 8 checkpoint slots (none without the cache)
    assert runtime.state_nbytes_for(model, config, "cuda") == 17 * state
    assert runtime.state_nbytes_for(model, engine_config(max_concurrency=8, prefix_cache=False), "cuda") == 9 * state
    assert runtime.checkpoint_slots_for(model.spec, engine_config(max_concurrency=2), "cuda") == 2
    page_bytes = model.spec.kv_bytes_per_token(4) * PAGE
    want = (runtime.REFERENCE_AUTO_KV_BYTES - 8 * state) // page_bytes
    assert runtime.num_pages_for(model, config, "reference") == want


# -- offline scoring --------------------------------------------------------------------------


def test_offline_scoring_releases_each_windows_state(model):
    from ninfer.cli import offline
    from ninfer.core.runner import SampleSpec

    runner = ReferenceRunner(model, num_pages=32, page_size=PAGE)
    docs = [np.random.default_rng(i).integers(0, 256, n).astype(np.int32) for i, n in enumerate((20, 9, 30))]

    def jobs_of(docs):
        return [offline.Job(i, offline.Window(i, 0, len(d), 0), d, 0, len(d)) for i, d in enumerate(docs)]

    jobs = jobs_of(docs)
    spec = SampleSpec(params=SamplingParams(temperature=0.0), seed=0, token_index=0, want_all_logits=True)
    logits = {}
    offline.drive(runner, jobs, lambda job, n: spec, lambda job, pos, n, r: logits.setdefault(job.seq_id, []).append(r),
                  chunk=8, batch_tokens=16, max_rows=2)  # fmt: skip
    assert sorted(logits) == [0, 1, 2]
    assert runner.num_recurrent_states == 0  # every window's state went with its pages
    assert all(sum(r.all_logits.shape[0] for r in logits[i]) == len(d) for i, d in enumerate(docs))


# -- the CLI ----------------------------------------------------------------------------------


def test_cli_generate_runs_the_hybrid_gguf_greedily_as_transformers(hybrid, model):
    text = "hello hybrid"
    result = subprocess.run(
        [sys.executable, "-m", "ninfer.cli.main", "generate", str(hybrid.gguf_path), "--backend", "reference",
         "--raw", "-p", text, "--temperature", "0", "--max-tokens", "12", "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    ids = model.tokenizer.encode(text)
    with torch.no_grad():
        generated = hybrid.model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                          eos_token_id=None, pad_token_id=0)  # fmt: skip
    want = generated[0, len(ids) :].tolist()
    stop = model.stop_token_ids
    cut = next((i + 1 for i, t in enumerate(want) if t in stop), len(want))  # the CLI stops at a stop id
    assert out["token_ids"] == want[:cut]
    assert np.all(np.asarray(out["token_ids"]) < model.tokenizer.vocab_size)


def test_the_cpu_backend_refuses_hybrids_and_auto_picks_reference_for_them(model, monkeypatch):
    import ninfer.gpu.cuda.available as available
    from ninfer import runtime
    from ninfer.sched.config import ConfigError

    config = EngineConfig(page_size=PAGE, max_context=32, kv_capacity=64)
    with pytest.raises(ConfigError, match="hybrid"):
        runtime.create_runner(model, runtime.RuntimeOptions(backend="cpu"), config)
    monkeypatch.setattr(available, "cuda_available", lambda: False)
    runner, backend, _ = runtime.create_runner(model, runtime.RuntimeOptions(), config)
    assert backend == "reference" and isinstance(runner, ReferenceRunner) and runner.spec.is_hybrid
