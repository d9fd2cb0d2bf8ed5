"""Every CUDA kernel against its numpy reference at real shapes on a GPU (skipped where there
is none): the paths the simulator cannot take (warp shuffles, dp4a, mma.sync, 16-byte loads).
The same checks (kernel_checks.py beside this file) run at tiny shapes under the simulator in
tests/test_cuda_kernels.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ninfer.gpu.cuda.available import cuda_available

CHECKS = Path(__file__).resolve().parent / "kernel_checks.py"
CHECK_NAMES = sorted(re.findall(r"^def check_(\w+)\(", CHECKS.read_text(), re.M))


@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("name", CHECK_NAMES)
def test_kernel_matches_numpy_reference_on_gpu(name):
    import kernel_checks  # beside this file (pytest puts this directory on sys.path)

    assert kernel_checks.run([name], "real")[name] == "ok"
