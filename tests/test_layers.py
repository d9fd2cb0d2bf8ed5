"""The layers point one way: only ninfer/gpu/cuda/ may import numba or the CUDA driver."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "ninfer"
GPU_ONLY = ("numba", "cuda", "llvmlite", "ninfer.gpu.cuda")


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (lazy imports inside functions included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def is_gpu_only(name: str) -> bool:
    return any(name == g or name.startswith(g + ".") for g in GPU_ONLY)


@pytest.mark.parametrize("package", ["sched", "protocols", "cache", "models", "server", "grammar"])
def test_upper_layers_never_import_gpu_code(package):
    files = sorted((ROOT / package).rglob("*.py"))
    offenders = {
        f"{path.relative_to(ROOT.parent)}: {name}"
        for path in files
        for name in imported_modules(path)
        if is_gpu_only(name) or name.startswith("ninfer.gpu.reference")
    }
    assert not offenders, f"upper layers import GPU code: {sorted(offenders)}"


def test_runner_protocol_module_is_numba_free():
    names = imported_modules(ROOT / "gpu" / "runner.py")
    assert not any(is_gpu_only(n) for n in names)


def test_importing_the_engine_and_server_does_not_load_numba():
    code = (
        "import sys, ninfer.sched.request, ninfer.gpu.runner, ninfer.runtime\n"
        "import importlib.util as u\n"
        "for m in ('ninfer.sched.engine', 'ninfer.server.app', 'ninfer.cli.main'):\n"
        "    if u.find_spec(m): __import__(m)\n"
        "bad = sorted(m for m in sys.modules if m == 'numba' or m.startswith('numba.'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"numba was imported eagerly: {out.stdout.strip()}"
