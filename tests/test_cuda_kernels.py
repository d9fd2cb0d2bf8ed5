"""Every CUDA kernel against its numpy reference under numba's CUDA simulator (no GPU needed).

The simulator must be switched on before numba is imported, and the PTX tests in this same
pytest run need the real numba-cuda target, so the checks run in one child process with
NUMBA_ENABLE_CUDASIM=1 (`python -m ninfer.gpu.cuda.kernel_checks tiny`) and each check's
outcome is one test here. Shapes are tiny: the simulator runs a Python thread per CUDA thread.
Paths the simulator cannot take (warp shuffles, dp4a, mma.sync, 16-byte loads) run in
test_gpu_runner.py on a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CHECK_NAMES = [
    "attn_decode", "attn_prefill", "dequantize_rows", "embed", "flash_prefill", "gemm", "gemv_epilogue", "gemv_f32", "gemv_fused",
    "gemv_q8", "l2_prefetch", "lookahead", "pages", "qkv_post", "quantize_rows", "rmsnorm", "runner", "sampler", "swiglu",
]  # fmt: skip


@pytest.fixture(scope="module")
def sim_results() -> dict[str, str]:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    proc = subprocess.run(
        [sys.executable, "-m", "ninfer.gpu.cuda.kernel_checks", "tiny", *CHECK_NAMES],
        env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        pytest.fail(f"the simulator child printed no results (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


@pytest.mark.parametrize("name", CHECK_NAMES)
def test_kernel_matches_numpy_reference_under_simulator(sim_results, name):
    assert sim_results.get(name) == "ok", sim_results.get(name, "check did not run")


def test_every_check_is_listed():
    """A new check in kernel_checks.py must be run here too."""
    src = open(os.path.join(os.path.dirname(__file__), "..", "ninfer", "gpu", "cuda", "kernel_checks.py")).read()
    defined = {line.split("(")[0][len("def check_") :] for line in src.splitlines() if line.startswith("def check_")}
    assert defined == set(CHECK_NAMES)
