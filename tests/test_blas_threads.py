"""The reference backend's BLAS thread cap (ninfer/gpu/blas.py), applied to the real OpenBLAS."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from ninfer.gpu import blas


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("NINFER_BLAS_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_default_leaves_one_core_free(clean_env):
    clean_env.setattr(blas, "available_cores", lambda: 8)
    assert blas.default_blas_threads() == 7
    clean_env.setattr(blas, "available_cores", lambda: 1)
    assert blas.default_blas_threads() == 1


def test_the_users_choice_wins(clean_env, caplog):
    clean_env.setenv("NINFER_BLAS_THREADS", "3")
    assert blas.default_blas_threads() == 3
    clean_env.setenv("NINFER_BLAS_THREADS", "zero")
    with caplog.at_level(logging.WARNING, logger="ninfer.gpu.blas"):
        assert blas.default_blas_threads() == max(1, blas.available_cores() - 1)
    assert "NINFER_BLAS_THREADS" in caplog.text
    clean_env.delenv("NINFER_BLAS_THREADS")
    clean_env.setenv("OPENBLAS_NUM_THREADS", "2")
    assert blas.default_blas_threads() is None  # the BLAS library's own setting stands


def test_a_reference_runner_applies_the_limit_to_numpys_blas():
    # A fresh process: the limit is process-wide and must not leak into this one.
    code = (
        "import numpy as np\n"
        "from ninfer.gpu import blas\n"
        "from ninfer.gpu.reference import ReferenceRunner\n"
        "from tiny_models import tiny_llama\n"
        "before = blas.blas_threads_in_use()\n"
        "runner = ReferenceRunner(tiny_llama(vocab_size=32, max_context=16, seed=0), num_pages=4, page_size=4)\n"
        "print(runner.blas_threads, before, blas.blas_threads_in_use())\n"
    )
    threads = 3 if blas.available_cores() < 3 else 2  # never OpenBLAS's own default (one per core)
    env = {"PATH": "", "NINFER_BLAS_THREADS": str(threads), "PYTHONPATH": "tests"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    applied, before, after = run.stdout.split(" ", 2)
    assert int(applied) == threads and before != f"[{threads}]"
    assert after.strip() == f"[{threads}]"
