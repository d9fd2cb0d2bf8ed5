"""`ninfer simulate`: the workload generator, virtual-time replay and its report."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer.cli.simulate import main
from ninfer.sched.config import EngineConfig
from ninfer.sched.fake import CostModel
from ninfer.sched.simulate import Workload, format_report, generate_requests, simulate

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
