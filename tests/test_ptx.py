"""Every CUDA kernel compiles to PTX for sm_90 (H100 / H200) and sm_120a (RTX 50xx / PRO 6000),
and that PTX assembles to machine code (nvJitLink), without a GPU.

Compilation runs in child processes (`python tests/cuda/ptx.py CC`), so this works in the
same pytest run as the simulator tests, which need numba in simulator mode.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import pytest

import child_jobs

pytestmark = pytest.mark.ptx

HERE = Path(__file__).resolve().parent
CUDA_PKG = HERE.parent / "ninfer" / "gpu" / "cuda"
TARGETS = {"9.0": ".target sm_90", "12.0a": ".target sm_120a"}
QTYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q6_K")
FLOAT = ("F32", "F16", "BF16")


# one child per target, in the background while the rest of the suite runs (child_jobs.py)
JOBS = {
    cc: child_jobs.register(f"ptx_{cc}", [sys.executable, str(HERE / "cuda" / "ptx.py"), cc],
                            {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}, timeout_s=2400,
                            module=__name__, fixture="reports",
                            cost_s=300)  # fmt: skip
    for cc in TARGETS
}


@pytest.fixture(scope="module")
def reports() -> dict[str, dict]:
    out = {}
    for cc, job in JOBS.items():
        job.wait()
        start = job.stdout.find("{")
        if start < 0:
            pytest.fail(f"PTX child for {cc} printed no report (exit {job.returncode}):\n{job.stderr[-4000:]}")
        out[cc] = json.loads(job.stdout[start:])
    return out


def expected_kernels() -> set[str]:
    names = {"sample_rows", "quantize_rows", "rmsnorm_f32", "rmsnorm_q8", "swiglu_f32", "swiglu_q8"}
    for q in QTYPES:
        names |= {f"gemm_{q}", f"embed_{q}", f"dequantize_rows_{q}", f"gemv_f32_{q}_l32_m1"}
        if q not in FLOAT:
            names.add(f"gemv_q8_{q}_l32_m1")
    return names


@pytest.mark.parametrize("cc", list(TARGETS))
def test_every_kernel_compiles_and_assembles(reports, cc):
    report = reports[cc]
    errors = {k: v["error"][:500] for k, v in report.items() if "error" in v}
    assert not errors, errors
    assert {v["target"] for v in report.values()} == {TARGETS[cc]}
    assert all(v["sass_bytes"] > 0 for v in report.values())
    missing = expected_kernels() - set(report)
    assert not missing, f"kernels missing from the PTX report: {sorted(missing)}"
    families = {"attn_decode", "attn_decode_lp", "attn_decode_one", "attn_prefill", "attn_combine", "flash_prefill",
                "qkv_post", "page_copy", "page_gather", "page_scatter", "gemv_fused", "gemv_rope", "gemv_swiglu"}
    assert all(any(k.startswith(f) for k in report) for f in families)


PDL_AWARE = {"rmsnorm", "gemv_split", "gemv_rope", "gemv_swiglu", "gemv_fused", "attn_decode_lp", "attn_decode_one",
             "attn_combine", "sample_rows"}  # the one-row decode step's kernels at least


@pytest.mark.parametrize("cc", list(TARGETS))
def test_pdl_aware_kernels_hold_both_grid_dependency_instructions(reports, cc):
    """The graph surgery (graphs.programmatic_edges) finds a kernel's Python name in its entry
    symbol and makes the edges into aware kernels programmatic: each must then really wait
    (griddepcontrol.wait) and let the next grid start (launch_dependents); the others none."""
    ok = {k: v for k, v in reports[cc].items() if "error" not in v}
    names = {v["python_name"] for v in ok.values()}
    assert PDL_AWARE <= names, sorted(PDL_AWARE - names)
    aware = {v["python_name"] for v in ok.values() if v["pdl_aware"]}
    assert PDL_AWARE <= aware, sorted(PDL_AWARE - aware)
    wrong = sorted(k for k, v in ok.items() if v["pdl_aware"] != v["grid_dep"])
    assert not wrong, f"aware without the instructions, or the instructions without aware: {wrong}"


def test_register_arrays_stay_in_registers(reports):
    """No kernel spills to local memory on sm_90: the unrolled accumulators stay in registers."""
    spills = {k: v["spill_bytes"] for k, v in reports["9.0"].items() if v.get("spill_bytes")}
    assert not spills, spills


def test_sampler_fits_its_block(reports):
    """512 threads x registers must fit the 64k-register file, or the launch fails."""
    import re

    src = (CUDA_PKG / "kernels" / "sampler.py").read_text()
    threads = int(re.search(r"^THREADS = (\d+)", src, re.M).group(1))  # read, not imported: no numba here
    assert reports["9.0"]["sample_rows"]["registers"] * threads <= 65536


def test_every_kernel_module_is_compiled():
    """Every module of ninfer/gpu/cuda that builds kernels (cuda.jit) has ptx_cases() and is in
    tests/cuda/ptx.py's list (intrinsics.py builds device functions only)."""
    spec = importlib.util.spec_from_file_location("ptx_tool", HERE / "cuda" / "ptx.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)  # no numba at import
    found = set()
    for path in CUDA_PKG.rglob("*.py"):
        src = path.read_text()
        if path.name != "intrinsics.py" and re.search(r"cuda\.jit\(", src):
            assert "def ptx_cases" in src, f"{path} builds kernels but has no ptx_cases()"
            found.add(".".join(path.relative_to(CUDA_PKG).with_suffix("").parts))
    assert found == set(tool.KERNEL_MODULES)
