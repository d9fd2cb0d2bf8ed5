"""Compiled kernels on disk: a restart on the same GPU and code loads them instead of compiling.

Every kernel factory is decorated with `@compiled` (memoized like `functools.cache`). Each
kernel it returns looks its compiled overloads up in the `KernelStore` that `use_disk_cache`
set, if any, before numba compiles them, and saves what it compiled there. An entry's key is
the factory, its arguments, the argument types of the launch and the compile options; the
store's directory is one per compute capability and code version (the sources the kernels are
built from, numba's and numba-cuda's versions, the Python version), so a change of any of these
compiles afresh. numba's own `cache=True` keys on the source file of one function and cannot
see a change in the device functions a kernel calls from other modules; this key does.

The hook is the dispatcher's cache slot: `CUDADispatcher.compile` asks `_cache.load_overload`
before compiling and hands what it compiled (bound, so with its cubin) to `save_overload`;
entries hold `_Kernel._reduce_states()`, which numba-cuda's own disk cache stores too.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import pickle
import sys
import tempfile
from collections import Counter
from pathlib import Path

from ninfer.gpu.cuda.kernels.intrinsics import SIMULATOR

log = logging.getLogger(__name__)

_KERNELS = Path(__file__).resolve().parent
_NINFER = _KERNELS.parents[2]
# what the kernels are built from: their modules, the page kernels, the plan's switches, and the
# engine constant the sampler is sized by
SOURCES = (_KERNELS, _NINFER / "gpu" / "cuda" / "pages.py", _NINFER / "gpu" / "cuda" / "plan.py",
           _NINFER / "core" / "params.py")  # fmt: skip
SUFFIX = ".kernel"


def code_version(sources=SOURCES) -> str:
    """A digest of the kernel sources (every .py under a directory, or the file) and of the
    compiler's versions: it changes when anything a compiled kernel depends on does."""
    import numba

    try:
        from numba_cuda import __version__ as numba_cuda_version
    except ImportError:  # pragma: no cover - numba-cuda is a dependency
        numba_cuda_version = "?"
    digest = hashlib.sha256(f"{numba.__version__}|{numba_cuda_version}|{sys.version_info[:2]}".encode())
    for source in sources:
        source = Path(source)
        files = sorted(source.rglob("*.py")) if source.is_dir() else [source]
        for path in files:
            digest.update(str(path.relative_to(source.parent)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def entry_key(factory: str, args: tuple, kwargs: tuple, argtypes: tuple, options: dict) -> str:
    """The file name stem of one compiled overload: a digest of everything that selects it."""
    text = repr((factory, args, kwargs, tuple(str(t) for t in argtypes), sorted(options.items())))
    return hashlib.sha256(text.encode()).hexdigest()[:40]


class KernelStore:
    """A directory of pickled compiled kernels, one file an overload. Writes are atomic (a
    temporary file renamed into place), so processes may share it; an entry that cannot be
    read is a miss (and is removed), never an error."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.stats: Counter = Counter()  # hits, misses, saves, errors

    def path(self, key: str) -> Path:
        return self.directory / f"{key}{SUFFIX}"

    def load(self, key: str):
        path = self.path(key)
        try:
            data = path.read_bytes()
        except OSError:  # not there (or no cache directory to read): compile
            self.stats["misses"] += 1
            return None
        try:
            payload = pickle.loads(data)
        except Exception as exc:  # a torn or stale entry: compile afresh
            log.warning("kernel cache: dropping unreadable %s (%s)", path.name, exc)
            self.stats["errors"] += 1
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        self.stats["hits"] += 1
        return payload

    def save(self, key: str, payload) -> None:
        try:
            data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=SUFFIX)
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            os.replace(tmp, self.path(key))
        except Exception as exc:  # a full disk or a read-only cache must not fail a launch
            log.warning("kernel cache: could not save %s (%s)", key, exc)
            self.stats["errors"] += 1
            return
        self.stats["saves"] += 1

    def __len__(self) -> int:
        return sum(1 for _ in self.directory.glob(f"*{SUFFIX}")) if self.directory.is_dir() else 0


_store: KernelStore | None = None
_bound = 0  # overloads compiled or loaded in this process (each is a module load at its first launch)


def use_disk_cache(root: Path | None, compute_capability: tuple[int, int] | None = None) -> KernelStore | None:
    """Keep compiled kernels under `root`/sm<cc>-<code version> from now on (None: in memory
    only); the store, whose `stats` count hits and misses. `compute_capability`: the current
    device's unless given."""
    global _store
    if root is None or SIMULATOR:
        _store = None
        return None
    if compute_capability is None:
        from numba import cuda

        compute_capability = cuda.get_current_device().compute_capability
    major, minor = compute_capability
    _store = KernelStore(Path(root) / f"sm{major}{minor}-{code_version()}")
    return _store


def current_store() -> KernelStore | None:
    return _store


def overloads_bound() -> int:
    """How many kernel overloads this process has compiled or loaded so far: a launch sequence
    that moved it loaded a module (the CUDA runner redoes a graph capture that did)."""
    return _bound


class _DiskOverloads:
    """What a dispatcher's `_cache` slot needs (numba's NullCache interface), over the store
    that is current at each compile."""

    def __init__(self, factory: str, args: tuple, kwargs: tuple, options: dict):
        self.factory, self.args, self.kwargs, self.options = factory, args, kwargs, options

    @property
    def cache_path(self) -> str | None:
        return None if _store is None else str(_store.directory)

    def _key(self, sig) -> str:
        return entry_key(self.factory, self.args, self.kwargs, tuple(sig), self.options)

    def load_overload(self, sig, target_context):
        global _bound
        _bound += 1  # numba asks here before each compile of a new overload, store or not
        if _store is None:
            return None
        payload = _store.load(self._key(sig))
        if payload is None:
            return None
        from numba.cuda.dispatcher import _Kernel

        try:
            return _Kernel._rebuild(**payload)
        except Exception as exc:  # numba-cuda changed the payload's shape under the same version
            log.warning("kernel cache: cannot rebuild %s (%s)", self.factory, exc)
            _store.stats["errors"] += 1
            return None

    def save_overload(self, sig, kernel) -> None:
        if _store is not None:
            _store.save(self._key(sig), kernel._reduce_states())

    def flush(self) -> None:
        pass


def compiled(factory):
    """Decorate a kernel factory (a function that returns a numba CUDA kernel): memoized
    per arguments, and every kernel it returns compiles through the disk cache."""
    name = f"{factory.__module__}.{factory.__qualname__}"

    @functools.cache
    @functools.wraps(factory)
    def make(*args, **kwargs):
        kernel = factory(*args, **kwargs)
        if not SIMULATOR:
            kernel._cache = _DiskOverloads(name, args, tuple(sorted(kwargs.items())), dict(kernel.targetoptions))
        return kernel

    return make
