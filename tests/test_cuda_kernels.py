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


# runs in the background while the rest of the suite does (child_jobs.py)
JOB = child_jobs.simulator_job("kernel_checks", [sys.executable, str(CHECKS), "tiny", *CHECK_NAMES], 1800, __name__)


@pytest.fixture(scope="module")
def sim_results() -> dict[str, str]:
    return child_jobs.json_results(JOB)


@pytest.mark.parametrize("name", CHECK_NAMES)
def test_kernel_matches_numpy_reference_under_simulator(sim_results, name):
    assert sim_results.get(name) == "ok", sim_results.get(name, "check did not run")


def test_the_harness_has_checks():
    assert {"attn_decode", "gemv_q8", "runner", "sampler"} <= set(CHECK_NAMES)
