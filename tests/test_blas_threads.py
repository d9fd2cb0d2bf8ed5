"""The reference backend's BLAS thread cap (ninfer/gpu/blas.py), applied to the real OpenBLAS."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from ninfer.gpu import blas

@pytest.fixture
def clean_env(monkeypatch):
    for name in ("NINFER_BLAS_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_default_leaves_one_core_free(clean_env):
    clean_env.setattr(blas, "available_cores", lambda: 8)
    assert blas.default_num_blas_threads() == 7
    clean_env.setattr(blas, "available_cores", lambda: 1)
    assert blas.default_num_blas_threads() == 1


def test_the_users_choice_wins(clean_env, caplog):
    clean_env.setenv("NINFER_BLAS_THREADS", "3")
    assert blas.default_num_blas_threads() == 3
    clean_env.setenv("NINFER_BLAS_THREADS", "zero")
    with caplog.at_level(logging.WARNING, logger="ninfer.gpu.blas"):
        assert blas.default_num_blas_threads() == max(1, blas.available_cores() - 1)
    assert "NINFER_BLAS_THREADS" in caplog.text
    clean_env.delenv("NINFER_BLAS_THREADS")
    clean_env.setenv("OPENBLAS_NUM_THREADS", "2")
    assert blas.default_num_blas_threads() is None  # the BLAS library's own setting stands


@pytest.mark.parametrize(("text", "cpus"), [("200000 100000", 2), ("150000 100000", 2), ("max 100000", None),
                                            ("garbage", None)])  # fmt: skip
def test_a_container_cpu_quota_caps_the_cores(tmp_path, text, cpus):
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text(text + "\n")
    assert blas.cgroup_cpu_limit(cpu_max) == cpus
    assert blas.cgroup_cpu_limit(tmp_path / "missing") is None


def test_the_reference_runtime_applies_the_limit_to_numpys_blas(smollm2_path):
    # A fresh process: the limit is process-wide and must not leak into this one.
    code = (
        "import json, sys\n"
        "import numpy\n"
        "from ninfer.gpu import blas\n"
        "from ninfer.runtime import RuntimeOptions, create_runner, load\n"
        "from ninfer.sched.config import EngineConfig\n"
        "before = blas.num_blas_threads_in_use()\n"
        "options, config = RuntimeOptions(backend='reference'), EngineConfig(kv_capacity=512, max_context=256)\n"
        "runner, backend, _ = create_runner(load(sys.argv[1], progress=False), options, config)\n"
        "print(json.dumps([backend, before, blas.num_blas_threads_in_use()]))\n"
    )
    threads = 3 if blas.available_cores() < 3 else 2  # never OpenBLAS's own default (one per core)
    env = {"PATH": "", "NINFER_BLAS_THREADS": str(threads), "HOME": str(Path.home())}
    run = subprocess.run([sys.executable, "-c", code, str(smollm2_path)], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    backend, before, after = json.loads(run.stdout.strip().splitlines()[-1])
    assert backend == "reference" and before and before != [threads] * len(before)
    assert after == [threads] * len(before)
