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


RESTART = """
import json, sys
import numpy as np
from ninfer.core.params import SamplingParams
from ninfer.core.runner import SampleSpec, StepRow
from ninfer.gpu.cuda.random_model import random_model, random_spec
from ninfer.gpu.cuda.runner import CudaRunner
from ninfer.runtime import use_kernel_cache

store = use_kernel_cache(True)
model = random_model(random_spec("smollm2-135m", num_layers=2, max_context=256), "Q4_1", seed=11)
runner = CudaRunner(model, num_pages=16, page_size=16, max_batch_rows=2, activations=sys.argv[1])
table = np.arange(16, dtype=np.int32)
prompt = np.random.default_rng(3).integers(0, 49152, 20).astype(np.int32)
tokens, pos = [], 0
for step in range(4):
    ids = prompt if step == 0 else np.asarray([tokens[-1]], np.int32)
    row = StepRow(seq_id=0, token_ids=ids, start_pos=pos, page_table=table,
                  sample=SampleSpec(params=SamplingParams(temperature=0.0), seed=0, token_index=step, want_logits=True))
    out = runner.step([row])[0]
    pos += len(ids)
    tokens.append(out.token_id)
logits = out.logits.tolist()
runner.close()
print(json.dumps({"stats": dict(store.stats), "dir": str(store.directory), "tokens": tokens, "logits": logits}))
"""


@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_kernel_cache_survives_a_restart(tmp_path):
    """A second process on the same cache compiles nothing: every kernel the first one compiled
    (prefill and decode) loads from disk and computes the same tokens and logits; another
    activation scheme (other kernels) compiles only what it does not share."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "NINFER_CACHE_DIR": str(tmp_path)}

    def run(acts):
        proc = subprocess.run([sys.executable, "-c", RESTART, acts], env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    cold, warm = run("q8"), run("q8")
    assert cold["stats"].get("saves", 0) > 5 and not cold["stats"].get("hits")
    assert warm["stats"].get("hits") == cold["stats"]["saves"] and not warm["stats"].get("saves")
    assert not warm["stats"].get("errors") and warm["dir"] == cold["dir"]
    assert warm["tokens"] == cold["tokens"] and warm["logits"] == cold["logits"]
    other = run("f32")
    assert other["stats"].get("saves", 0) > 0 and other["stats"].get("hits", 0) > 0
