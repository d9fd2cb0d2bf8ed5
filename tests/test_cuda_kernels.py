"""Every CUDA kernel against its numpy reference under numba's CUDA simulator (no GPU needed).

The simulator must be switched on before numba is imported, and the PTX tests in this same
pytest run need the real numba-cuda target, so the checks (tests/cuda/kernel_checks.py) run
in one child process with NUMBA_ENABLE_CUDASIM=1 and each check's outcome is one test here.
Shapes are tiny: the simulator runs a Python thread per CUDA thread. Paths the simulator
cannot take (warp shuffles, dp4a, mma.sync, 16-byte loads) run at real shapes on a GPU in
tests/cuda/test_kernels_gpu.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

CHECKS = Path(__file__).resolve().parent / "cuda" / "kernel_checks.py"
# every check_* of the harness (read, not imported: numba must not load here in simulator mode)
CHECK_NAMES = sorted(re.findall(r"^def check_(\w+)\(", CHECKS.read_text(), re.M))


@pytest.fixture(scope="module")
def sim_results() -> dict[str, str]:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    proc = subprocess.run(
        [sys.executable, str(CHECKS), "tiny", *CHECK_NAMES], env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        pytest.fail(f"the simulator child printed no results (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


@pytest.mark.parametrize("name", CHECK_NAMES)
def test_kernel_matches_numpy_reference_under_simulator(sim_results, name):
    assert sim_results.get(name) == "ok", sim_results.get(name, "check did not run")


def test_the_harness_has_checks():
    assert {"attn_decode", "gemv_q8", "runner", "sampler"} <= set(CHECK_NAMES)
