"""`ninfer simulate`: the workload generator, virtual-time replay and its report."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer.cli.simulate import main
from ninfer.sched.config import EngineConfig
from ninfer.sched.fake import CostModel
from ninfer.sched.simulate import (
    PrefixBurst,
    Workload,
    burst_config,
    format_burst_report,
    format_report,
    generate_requests,
    simulate,
    simulate_burst,
)

COST = CostModel(step_s=1 / 256, token_s=1 / 65536, row_s=0.0)


def test_workload_is_poisson_with_the_asked_means():
    workload = Workload(num_requests=4000, arrival_rate_per_s=10.0, mean_prompt_tokens=100,
                        mean_output_tokens=50, cancel_fraction=0.25, seed=3)  # fmt: skip
    requests = generate_requests(workload, max_context=100_000)
    arrivals = np.array([r.arrival_s for r in requests])
    assert np.all(np.diff(arrivals) > 0)
    assert np.mean(np.diff(arrivals)) == pytest.approx(0.1, rel=0.05)
    assert np.mean([r.num_prompt for r in requests]) == pytest.approx(100, rel=0.05)
    assert np.mean([r.max_tokens for r in requests]) == pytest.approx(50, rel=0.05)
    assert np.mean([r.cancel_after_s is not None for r in requests]) == pytest.approx(0.25, abs=0.03)
    assert generate_requests(workload, 100_000) == requests  # the seed fixes the trace
    short = generate_requests(workload, max_context=64)
    assert all(r.num_prompt + r.max_tokens <= 64 for r in short)


def test_a_lone_request_costs_exactly_the_model():
    workload = Workload(num_requests=1, mean_prompt_tokens=40, mean_output_tokens=8, cancel_fraction=0.0)
    (request,) = generate_requests(workload, max_context=256)
    config = EngineConfig(page_size=16, max_context=256)
    report = simulate(config, workload, cost=COST, num_pages=64, max_context=256)
    (record,) = report.records
    assert record.ttft_s == 1 / 256 + request.num_prompt / 65536
    assert record.inter_token_s == (1 / 256 + 1 / 65536,) * (request.max_tokens - 1)
    assert record.queue_s == 0.0


def test_replay_is_deterministic_and_accounts_for_every_request():
    workload = Workload(num_requests=40, arrival_rate_per_s=50.0, mean_prompt_tokens=48,
                        mean_output_tokens=32, cancel_fraction=0.2, mean_cancel_after_s=0.2)  # fmt: skip
    config = EngineConfig(page_size=8, max_context=256, max_concurrency=6, prefill_chunk=64,
                          host_snapshot_bytes=8 * 8 * 100)  # fmt: skip
    first = simulate(config, workload, cost=COST, num_pages=40, page_nbytes=8 * 100, max_context=256)
    again = simulate(config, workload, cost=COST, num_pages=40, page_nbytes=8 * 100, max_context=256)
    assert first.records == again.records and first.statistics == again.statistics
    stats = first.statistics
    assert sum(stats.requests_by_outcome.values()) == workload.num_requests
    assert stats.requests_by_outcome["cancelled"] > 0
    assert stats.num_preemptions > 0 and stats.num_snapshot_restores > 0 and stats.num_replay_restores > 0
    assert stats.num_pages_used == stats.num_prefix_cache_pages  # at idle only the cache holds pages
    text = format_report(first)
    assert "time to 1st token" in text and "inter-token" in text and "preemptions" in text


def test_cli_prints_the_report(capsys):
    argv = ["--requests", "12", "--rate", "20", "--prompt-tokens", "32", "--output-tokens", "16",
            "--kv-capacity", "1024", "--max-context", "512"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("requests: 12 over ")
    assert "throughput:" in out and "p99=" in out
    with pytest.raises(SystemExit) as exc:
        main(["--rate", "-1"])
    assert exc.value.code == 2
    assert main(["--kv-capacity", "64", "--max-context", "512", "--requests", "1"]) == 2
    assert "--kv-capacity (64 tokens) must hold at least one full --max-context (512 tokens)" in capsys.readouterr().err


# -- the shared-prefix burst ---------------------------------------------------------------


@pytest.fixture(scope="module")
def burst64():
    # 64 concurrent arrivals over a 2,000-token system prompt, ~150-token questions; short
    # answers keep the replay quick (the prefill is what is measured).
    workload = PrefixBurst(num_requests=64, output_tokens=4, num_bursts=2)
    return simulate_burst(workload)


def test_a_shared_prefix_is_computed_once_even_in_the_first_burst(burst64):
    first, later = burst64.bursts
    shared = burst64.workload.prefix_tokens
    assert first.prefix_tokens_computed == shared  # once, by one request, for all 64
    assert first.prefix_tokens_cached == 63 * shared  # everyone else attached it
    assert first.prefix_tokens_cached >= 0.95 * first.shared_tokens
    assert later.prefix_tokens_computed == 0 and later.prefix_tokens_cached == later.shared_tokens
    for burst in (first, later):
        assert burst.num_first_tokens == 64
        assert burst.steps_to_admit <= 4  # the prefix (one step), then short suffixes in bursts
        assert 0 < burst.ttft_p50_s <= burst.ttft_p95_s
    stats = burst64.statistics
    assert stats.num_prefix_lookups == 128 and stats.num_prefix_hits == 127  # every admission looked up
    assert stats.num_prefix_waits == 63 and stats.num_preemptions == 0
    assert stats.requests_by_outcome["length"] == 128
    assert "steps to admit" in format_burst_report(burst64)


def test_the_burst_budget_admits_the_suffixes_in_fewer_steps():
    workload = PrefixBurst(num_requests=16, prefix_tokens=400, suffix_tokens=40, suffix_spread=8,
                           output_tokens=2, num_bursts=2)  # fmt: skip
    adaptive = simulate_burst(workload, burst_config(workload, prefill_chunk=64))
    fixed = simulate_burst(workload, burst_config(workload, prefill_chunk=64, max_prefill_tokens=64))
    assert adaptive == simulate_burst(workload, burst_config(workload, prefill_chunk=64))  # deterministic
    for a, f in zip(adaptive.bursts, fixed.bursts):
        assert a.prefix_tokens_computed == f.prefix_tokens_computed  # single flight either way
        assert a.num_first_tokens == f.num_first_tokens == 16
    # The warm burst's 16 suffixes (~640 tokens, over two chunks) take 2 steps (512 tokens,
    # then the rest) instead of one step per chunk.
    num_suffix_tokens = sum(len(prompt) - 400 for prompt in workload.prompts()[1])
    assert num_suffix_tokens > 512
    assert adaptive.bursts[1].steps_to_admit == 2
    assert fixed.bursts[1].steps_to_admit == -(-num_suffix_tokens // 64)
    assert adaptive.bursts[1].ttft_p95_s < fixed.bursts[1].ttft_p95_s
