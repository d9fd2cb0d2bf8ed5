"""Every CUDA kernel against its numpy reference under numba's CUDA simulator (no GPU needed).

The simulator must be switched on before numba is imported, and the PTX tests in this same
pytest run need the real numba-cuda target, so the checks (tests/cuda/kernel_checks.py) run
in one child process with NUMBA_ENABLE_CUDASIM=1 and each check's outcome is one test here.
Shapes are tiny: the simulator runs a Python thread per CUDA thread. Paths the simulator
cannot take (warp shuffles, dp4a, mma.sync, 16-byte loads) run at real shapes on a GPU in
tests/cuda/test_kernels_gpu.py.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import child_jobs

CHECKS = Path(__file__).resolve().parent / "cuda" / "kernel_checks.py"
# every check_* of the harness (read, not imported: numba must not load here in simulator mode)
CHECK_NAMES = sorted(re.findall(r"^def check_(\w+)\(", CHECKS.read_text(), re.M))


# The harness runs in three children, in the background while the rest of the suite runs
# (child_jobs.py): the two whole-runner checks apart, the kernels together (seconds on a busy
# 2-core machine, measured 2026-12-06: runner 638, lookahead 470, positions 140, the rest ~400;
# after the runner's one-row plans shared a runner and positions took 4-token sub-steps, one
# child at a time beside another engineer's benchmarks: runner 545, positions 83; lookahead ~500, unchanged).
GROUPS = {"runner": ["runner"], "steps": ["lookahead", "positions"]}
GROUPS["kernels"] = [name for name in CHECK_NAMES if name not in {n for g in GROUPS.values() for n in g}]
COSTS = {"runner": 550, "steps": 600, "kernels": 400}
JOBS = [
    child_jobs.simulator_job(f"kernel_checks_{group}", [sys.executable, str(CHECKS), "tiny", *names], 2400, __name__,
                             cost_s=COSTS[group])  # fmt: skip
    for group, names in GROUPS.items()
]


@pytest.fixture(scope="module")
def sim_results() -> dict[str, str]:
    return child_jobs.json_results(*JOBS)


@pytest.mark.parametrize("name", CHECK_NAMES)
def test_kernel_matches_numpy_reference_under_simulator(sim_results, name):
    assert sim_results.get(name) == "ok", sim_results.get(name, "check did not run")


def test_the_harness_has_checks():
    assert {"attn_decode", "gemv_q8", "runner", "sampler"} <= set(CHECK_NAMES)
