"""`ninfer simulate --workload burst`: the shared-prefix burst through the real command line."""

from __future__ import annotations

import re

import pytest

from ninfer.cli.main import main

# Small enough to replay in well under a second per run: a 400-token prefix (25 pages), short
# suffixes, a 64-token chunk (so the suffixes of a burst add up to several chunks).
SMALL = ["--workload", "burst", "--shared-prefix-tokens", "400", "--suffix-tokens", "40", "--suffix-spread", "8",
         "--output-tokens", "4", "--prefill-chunk", "64"]  # fmt: skip

HEADER = re.compile(r"^(\d+) arrivals a burst, a (\d+)-token shared prefix", re.M)
BURST = re.compile(
    r"burst (\d+): prefix computed (\d+) tokens, cached (\d+) of (\d+) \([\d.]+ %\), "
    r"TTFT p50 ([\d.]+) ms p95 ([\d.]+) ms, (\d+) steps to admit, (\d+)/(\d+) first tokens"
)
TOTALS = re.compile(r"lookups (\d+), hits (\d+), steps (\d+), preemptions (\d+)")


def simulate(capsys, *flags: str) -> list[dict]:
    """Run `ninfer simulate ...`; one dict per arrival count, with its bursts' figures."""
    assert main(["simulate", *flags]) == 0
    out = capsys.readouterr().out
    runs = []
    for block in out.strip().split("\n\n"):
        (arrivals, prefix), = HEADER.findall(block)  # fmt: skip
        bursts = [
            dict(computed=int(m[1]), cached=int(m[2]), shared=int(m[3]), p50=float(m[4]), p95=float(m[5]),
                 steps=int(m[6]), first=int(m[7]), requests=int(m[8]))  # fmt: skip
            for m in (match.groups() for match in BURST.finditer(block))
        ]
        lookups, hits, steps, preemptions = map(int, TOTALS.search(block).groups())
        runs.append(dict(arrivals=int(arrivals), prefix=int(prefix), bursts=bursts, lookups=lookups, hits=hits,
                         preemptions=preemptions))  # fmt: skip
    return runs


def test_the_shared_prefix_is_computed_once_per_arrival_count(capsys):
    runs = simulate(capsys, *SMALL, "--arrivals", "4,12", "--bursts", "2")
    assert [run["arrivals"] for run in runs] == [4, 12]
    for run in runs:
        n, prefix = run["arrivals"], run["prefix"]
        assert prefix == 400
        first, later = run["bursts"]
        # The first burst finds nothing cached, yet computes the prefix once, for everyone.
        assert first["computed"] == prefix
        assert first["cached"] == (n - 1) * prefix and first["shared"] == n * prefix
        # The next burst finds all of it cached.
        assert later["computed"] == 0 and later["cached"] == later["shared"] == n * prefix
        for burst in (first, later):
            assert burst["first"] == burst["requests"] == n
            assert 0 < burst["p50"] <= burst["p95"]
        assert run["lookups"] == 2 * n and run["hits"] == 2 * n - 1  # every admitted request looked up
        assert run["preemptions"] == 0


def test_without_prefix_reuse_every_request_computes_the_prefix(capsys):
    (reuse,) = simulate(capsys, *SMALL, "--arrivals", "12", "--bursts", "1")
    (no_reuse,) = simulate(capsys, *SMALL, "--arrivals", "12", "--bursts", "1", "--no-prefix-reuse")
    (burst,) = no_reuse["bursts"]
    assert burst["computed"] == burst["shared"] == 12 * no_reuse["prefix"] and burst["cached"] == 0
    assert no_reuse["lookups"] == 0
    assert reuse["bursts"][0]["p95"] < burst["p95"]


def test_the_burst_budget_admits_a_burst_in_fewer_steps(capsys):
    (adaptive,) = simulate(capsys, *SMALL, "--arrivals", "12", "--bursts", "2")
    (fixed,) = simulate(capsys, *SMALL, "--arrivals", "12", "--bursts", "2", "--max-prefill-tokens", "64")
    for a, f in zip(adaptive["bursts"], fixed["bursts"]):
        assert a["computed"] == f["computed"]  # single flight either way
        assert a["steps"] < f["steps"]
    assert adaptive["bursts"][1]["p95"] < fixed["bursts"][1]["p95"]


def test_the_same_seed_gives_the_same_figures(capsys):
    assert simulate(capsys, *SMALL, "--arrivals", "6", "--seed", "3") == simulate(
        capsys, *SMALL, "--arrivals", "6", "--seed", "3"
    )


def test_help_explains_the_burst_workload(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for needle in ("--workload {poisson,burst}", "--arrivals", "--shared-prefix-tokens", "--suffix-tokens",
                   "--bursts", "--max-prefill-tokens", "--no-prefix-reuse", "TTFT p50 / p95", "steps until"):  # fmt: skip
        assert needle in text


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--workload", "burst", "--rate", "3"], "--rate applies to --workload poisson only"),
        (["--arrivals", "4"], "--arrivals applies to --workload burst only"),
        (["--workload", "burst", "--arrivals", "8", "--max-concurrency", "2", "--max-pending", "2"], "--max-pending"),
        (["--workload", "burst", "--arrivals", "2", "--max-context", "100"], "--max-context (100)"),
    ],
)
def test_flags_the_workload_cannot_use_are_one_line_errors(capsys, flags, needle):
    assert main(["simulate", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("ninfer simulate: error: ") and needle in err


def test_a_bad_arrivals_list_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--workload", "burst", "--arrivals", "4,x"])
    assert exc.value.code == 2
    assert "--arrivals" in capsys.readouterr().err
