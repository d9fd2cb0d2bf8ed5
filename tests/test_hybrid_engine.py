"""A Qwen3.5 hybrid through the scheduler and the CLI on the reference backend: pauses replay
(recomputing the recurrent state), the prefix cache stays out, and pages and states are all
given back at idle."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import trio

from ninfer.core.params import SamplingParams
from ninfer.gpu.reference import ReferenceRunner
from ninfer.models.loader import load_model
from ninfer.sched.config import EngineConfig
from ninfer.sched.engine import open_engine
from ninfer.sched.request import FinishReason, GenerationRequest

torch = pytest.importorskip("torch")
from hybrid_models import tiny_hybrid_for  # noqa: E402

PAGE = 4
MAX_CONTEXT = 40


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return tiny_hybrid_for(tmp_path_factory)


@pytest.fixture(scope="module")
def model(hybrid):
    return load_model(hybrid.gguf_path)


def make_requests(model, prompts):
    reqs = []
    for i, text in enumerate(prompts):
        ids = tuple(model.tokenizer.encode(text))
        sampling = SamplingParams(temperature=0.0) if i % 2 == 0 else SamplingParams(temperature=0.8, top_p=0.9)
        reqs.append(GenerationRequest(prompt_ids=ids, max_tokens=MAX_CONTEXT - len(ids) - 4, sampling=sampling,
                                      seed=7 + i, request_id=f"h{i}"))  # fmt: skip
    return reqs


async def collect_all(engine, reqs):
    results = [None] * len(reqs)

    async def one(i, stream):
        async with stream:
            results[i] = await stream.collect()

    async with trio.open_nursery() as nursery:
        for i, req in enumerate(reqs):
            nursery.start_soon(one, i, engine.submit(req))
    return results


@pytest.mark.parametrize("pipelined", [False, True])  # True: decode steps submitted one ahead, fed
async def test_pressure_replays_hybrid_sequences_without_changing_a_token(model, pipelined):
    # the same system prompt everywhere: a dense model would share it through the prefix cache
    prompts = [f"sys: be brief. q{i}" for i in range(4)]
    reqs = make_requests(model, prompts)
    alone = []
    config = EngineConfig(page_size=PAGE, prefill_chunk=8, max_context=MAX_CONTEXT, prefix_cache=False)
    for req in reqs:
        runner = ReferenceRunner(model, num_pages=MAX_CONTEXT // PAGE, page_size=PAGE)
        async with open_engine(config, runner, model.tokenizer, stop_token_ids=()) as engine:
            alone += await collect_all(engine, [req])

    runner = ReferenceRunner(model, num_pages=MAX_CONTEXT // PAGE, page_size=PAGE)  # one full sequence
    runner.pipelined = pipelined
    config = EngineConfig(page_size=PAGE, prefill_chunk=8, max_context=MAX_CONTEXT, max_concurrency=4,
                          host_snapshot_bytes=1 << 30)  # a budget a dense model would snapshot into  # fmt: skip
    async with open_engine(config, runner, model.tokenizer, stop_token_ids=()) as engine:
        together = await collect_all(engine, reqs)
        stats = engine.statistics()
        await trio.sleep(0)

    assert stats.num_replay_restores >= 1 and stats.num_snapshot_restores == 0  # pauses replayed
    assert stats.num_prefix_hits == 0 and stats.num_prefix_cache_pages == 0
    assert stats.num_pages_used == 0 and stats.host_snapshot_bytes == 0
    assert runner.num_recurrent_states == 0
    assert (stats.num_lookahead_steps > 0) == pipelined
    for got, want in zip(together, alone, strict=True):
        assert got.finished.reason is FinishReason.LENGTH
        assert got.token_ids == want.token_ids


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


def test_the_cpu_backend_refuses_hybrids_with_a_clear_error(model):
    from ninfer import runtime
    from ninfer.sched.config import ConfigError

    config = EngineConfig(page_size=PAGE, max_context=32, kv_capacity=64)
    with pytest.raises(ConfigError, match="hybrid"):
        runtime.create_runner(model, runtime.RuntimeOptions(backend="cpu"), config)
    runner, backend, _ = runtime.create_runner(model, runtime.RuntimeOptions(backend="reference"), config)
    assert backend == "reference" and isinstance(runner, ReferenceRunner) and runner.spec.is_hybrid
