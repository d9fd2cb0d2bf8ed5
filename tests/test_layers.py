"""The layers point one way (README, "Layout"), and the layers above the backends never load numba.

Every import counts, at any depth: lazy imports inside functions and `TYPE_CHECKING` blocks
included, since each is a dependency all the same.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "ninfer"
GPU_ONLY = ("numba", "cuda", "llvmlite", "ninfer.gpu.cuda")

# Each part of ninfer (a subpackage, or a top-level module) and the parts it may import, bottom
# layer first. A part may import only parts listed before it, so the graph has no cycle.
LAYERS: dict[str, frozenset[str]] = {
    "ninfer": frozenset(),  # ninfer/__init__.py: the version
    "models": frozenset(),  # model files, specs, tokenizer, chat templates
    "core": frozenset({"models"}),  # engine types and the Runner protocol (models for ModelSpec)
    "cache": frozenset({"core"}),
    "sched": frozenset({"core", "cache", "models"}),
    "gpu": frozenset({"core", "models"}),
    "cpu": frozenset({"core", "models", "gpu"}),  # numba kernels under the reference runner's forward
    "protocols": frozenset({"core"}),
    "grammar": frozenset({"core", "protocols"}),
    "runtime": frozenset({"core", "models", "sched", "gpu", "cpu"}),  # picks a backend, opens an engine
    "server": frozenset({"core", "models", "sched", "protocols", "grammar", "runtime"}),
    # replicas on Ray Serve, each a `ninfer serve` process; the ingress renders prompts with the
    # server's own code (models: tokenizer / template, server: render_chat) to key them as the cache
    # does, and resolves `auto` as serve does (runtime.host_backend)
    "cluster": frozenset({"cache", "protocols", "models", "server", "runtime"}),
}
LAYERS["cli"] = frozenset(LAYERS)  # the commands: anything below


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (lazy imports inside functions included).

    `from a.b import c` counts as `a.b`, and also as `a.b.c` (c may be a submodule); relative
    imports are resolved against the file's package.
    """
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names if alias.name != "*")
    return names


def ninfer_files(package: str | None = None) -> list[Path]:
    if package is None:
        return sorted(ROOT.rglob("*.py"))
    if (ROOT / f"{package}.py").exists():
        return [ROOT / f"{package}.py"]
    if package == "ninfer":
        return [ROOT / "__init__.py"]
    return sorted((ROOT / package).rglob("*.py"))


def part_of(module: str) -> str | None:
    """The layer a ninfer module belongs to (None for modules outside ninfer)."""
    parts = module.split(".")
    if parts[0] != "ninfer":
        return None
    return parts[1] if len(parts) > 1 else "ninfer"


def is_gpu_only(name: str) -> bool:
    return any(name == g or name.startswith(g + ".") for g in GPU_ONLY)


def test_every_part_of_ninfer_has_a_layer():
    parts = {part_of(module_name(path)) for path in ninfer_files()}
    assert parts == set(LAYERS), f"add these to LAYERS (and to README's Layout): {sorted(parts - set(LAYERS))}"


def test_layers_only_point_down():
    order = list(LAYERS)
    upward = {(part, dep) for i, part in enumerate(order) for dep in LAYERS[part] if dep not in order[:i]}
    assert not upward, f"a layer may only depend on layers listed before it: {sorted(upward)}"


@pytest.mark.parametrize("part", list(LAYERS))
def test_each_part_imports_only_the_layers_below_it(part):
    known = {module_name(path) for path in ninfer_files()}
    offenders = sorted(
        f"{path.relative_to(ROOT.parent)}: {name}"
        for path in ninfer_files(part)
        for name in imported_modules(path)
        if (dep := part_of(name)) not in (None, part) and dep not in LAYERS[part]
        # `from ninfer.x import y` also adds `ninfer.x.y`: judge that one only if it is a module
        and (name in known or name.rpartition(".")[0] not in known)
    )
    assert not offenders, f"{part} may import only {sorted(LAYERS[part])}; it imports: {offenders}"


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(path): path for path in ninfer_files()}
    return {m: {n for n in imported_modules(path) if n in modules and n != m} for m, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> Iterator[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    yield sorted(component)


def test_no_module_import_cycles():
    found = list(cycles(import_graph()))
    assert not found, f"modules that import each other (directly or around a loop): {found}"


def test_the_cycle_check_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert list(cycles(graph)) == [["a", "b", "c"]]


@pytest.mark.parametrize("package", ["core", "sched", "protocols", "cache", "models", "server", "grammar"])
def test_upper_layers_never_import_gpu_code(package):
    offenders = {
        f"{path.relative_to(ROOT.parent)}: {name}"
        for path in ninfer_files(package)
        for name in imported_modules(path)
        if is_gpu_only(name) or name.startswith("ninfer.gpu")
    }
    assert not offenders, f"{package} imports GPU code: {sorted(offenders)}"


def test_importing_the_engine_and_server_does_not_load_numba():
    code = (
        "import sys, ninfer.sched.request, ninfer.core.runner, ninfer.runtime\n"
        "import importlib.util as u\n"
        "for m in ('ninfer.sched.engine', 'ninfer.server.app', 'ninfer.cli.main'):\n"
        "    if u.find_spec(m): __import__(m)\n"
        "bad = sorted(m for m in sys.modules if m == 'numba' or m.startswith('numba.'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"numba was imported eagerly: {out.stdout.strip()}"
