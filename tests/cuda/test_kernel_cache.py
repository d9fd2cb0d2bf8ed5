"""The kernel disk cache's key and store, without a GPU (tests/cuda/test_kernels_gpu.py's
`test_kernel_cache_survives_a_restart` loads real kernels back on one).

A cached kernel must never be used for anything but the exact factory arguments, launch types,
compile options, GPU architecture and code it was compiled from: each of these is checked to
change the key (so a change recompiles), and the same inputs to keep it (so a restart hits).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from ninfer.gpu.cuda.kernels import jit
from ninfer.gpu.cuda.kernels.jit import KernelStore, code_version, entry_key

ARGTYPES = ("array(float32, 1d, C)", "int32")


def test_entry_key_changes_with_every_input_and_only_with_them():
    base = entry_key("m.f", ("Q4_1", 64), (), ARGTYPES, {"launch_bounds": 256})
    assert base == entry_key("m.f", ("Q4_1", 64), (), ARGTYPES, {"launch_bounds": 256})
    others = [
        entry_key("m.g", ("Q4_1", 64), (), ARGTYPES, {"launch_bounds": 256}),  # another factory
        entry_key("m.f", ("Q4_0", 64), (), ARGTYPES, {"launch_bounds": 256}),  # weight type
        entry_key("m.f", ("Q4_1", 128), (), ARGTYPES, {"launch_bounds": 256}),  # a shape argument
        entry_key("m.f", ("Q4_1", 64), (("evict_first", False),), ARGTYPES, {"launch_bounds": 256}),
        entry_key("m.f", ("Q4_1", 64), (), ("array(float16, 1d, C)", "int32"), {"launch_bounds": 256}),
        entry_key("m.f", ("Q4_1", 64), (), ARGTYPES, {"launch_bounds": 128}),  # compile options
    ]
    assert len({base, *others}) == len(others) + 1


def test_code_version_follows_the_sources(tmp_path):
    src = tmp_path / "kernels"
    shutil.copytree(Path(jit.__file__).parent, src, ignore=shutil.ignore_patterns("__pycache__"))
    extra = tmp_path / "plan.py"
    extra.write_text("PDL = True\n")
    first = code_version((src, extra))
    assert first == code_version((src, extra))
    gemv = src / "gemv.py"
    gemv.write_text(gemv.read_text() + "\n# a change\n")
    second = code_version((src, extra))
    extra.write_text("PDL = False\n")
    third = code_version((src, extra))
    (src / "newfamily.py").write_text("X = 1\n")
    fourth = code_version((src, extra))
    assert len({first, second, third, fourth}) == 4


def test_the_store_directory_is_per_architecture_and_code(tmp_path):
    try:
        a = jit.use_disk_cache(tmp_path, compute_capability=(9, 0))
        b = jit.use_disk_cache(tmp_path, compute_capability=(12, 0))
        if jit.SIMULATOR:  # the simulator compiles nothing to keep
            assert a is None and b is None
            return
        assert a.directory.parent == b.directory.parent == tmp_path
        assert a.directory.name == f"sm90-{code_version()}"
        assert b.directory.name == f"sm120-{code_version()}"
        assert jit.current_store() is b
    finally:
        jit.use_disk_cache(None)
    assert jit.current_store() is None


def test_store_round_trip_misses_and_torn_entries(tmp_path):
    store = KernelStore(tmp_path / "sm90-x")
    assert store.load("k1") is None and store.stats["misses"] == 1
    payload = {"name": "_Z3gemv", "cubin_cache": {(9, 0): b"\x7fELF" + bytes(range(256))}}
    store.save("k1", payload)
    assert store.load("k1") == payload and store.stats["hits"] == 1
    assert len(store) == 1 and not list(store.directory.glob(".tmp-*"))  # written whole, renamed in
    store.path("k1").write_bytes(b"\x80\x05torn")  # a crash mid-write on a filesystem without rename
    assert store.load("k1") is None and store.stats["errors"] == 1
    assert not store.path("k1").exists()  # dropped, so the next compile replaces it


def test_store_that_cannot_write_does_not_raise(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    store = KernelStore(blocker / "sub")
    store.save("k", {"x": 1})
    assert store.stats["errors"] == 1
    assert store.load("k") is None and store.stats["misses"] == 1


CHILD = textwrap.dedent(
    """
    import json, sys
    import numba, numpy
    from pathlib import Path
    from numba import cuda
    from ninfer.gpu.cuda.kernels import jit

    @jit.compiled
    def add_kernel(step, *, scale=1):
        def add(x):
            i = cuda.grid(1)
            if i < x.shape[0]:
                x[i] += step * scale
        return cuda.jit(add)

    a, b, c = add_kernel(1), add_kernel(1), add_kernel(2)
    store = jit.use_disk_cache(Path(sys.argv[1]), compute_capability=(9, 0))
    sig = (numba.typeof(numpy.zeros(2, "float32")),)
    out = {
        "memoized": a is b, "distinct": a is not c,
        "slot": type(a._cache).__name__,
        "keys_differ": a._cache._key(sig) != c._cache._key(sig),
        "kw_key_differs": add_kernel(1, scale=2)._cache._key(sig) != a._cache._key(sig),
        "miss": a._cache.load_overload(sig, None) is None,
    }
    store.save(a._cache._key(sig), {"not": "a kernel"})  # a payload from another numba-cuda
    out["stale_is_miss"] = a._cache.load_overload(sig, None) is None
    out["stats"] = dict(store.stats)
    out["path"] = a._cache.cache_path
    print(json.dumps(out))
    """
)


def test_compiled_factories_attach_the_disk_cache(tmp_path):
    """A real numba CUDADispatcher (no GPU needed to create one, nor to look up its cache)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["memoized"] and out["distinct"] and out["slot"] == "_DiskOverloads"
    assert out["keys_differ"] and out["kw_key_differs"]
    assert out["miss"] and out["stale_is_miss"]
    assert out["stats"] == {"misses": 1, "saves": 1, "hits": 1, "errors": 1}
    assert out["path"] == str(tmp_path / f"sm90-{code_version()}")
