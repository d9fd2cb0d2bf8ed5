"""From a model argument to a running engine: resolve, load, size the KV pool, pick a backend.

Shared by `ninfer serve`, `generate`, `chat` and `bench`, so every command treats the model
argument, `--backend` and `--kv-capacity` the same way.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs

from ninfer.core.runner import Runner
from ninfer.models.loaded import LoadedModel
from ninfer.sched.config import ConfigError, EngineConfig

BACKENDS = ("auto", "cuda", "reference", "cpu")  # cpu: numba kernels over the stored weights
# CUDA decode linears: int8 activation blocks with dp4a (llama.cpp's scheme, the default: the
# fast path, checked against f32 by tests/test_gpu_quality.py), or float32 activations (logits
# within ~1e-3 of the CPU reference).
ACTIVATIONS = ("f32", "q8")
DEFAULT_CONTEXT_CAP = 8192  # --max-context unset: the model's context, at most this
# Host memory the reference backend's KV pool may take when --kv-capacity is auto.
REFERENCE_AUTO_KV_BYTES = 2 << 30
GIB = 1 << 30


def _non_negative(flag: str):
    def check(instance, attribute, value):
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < float("inf"):
            raise ConfigError(f"{flag} must be a finite number of at least 0, got {value!r}")

    return check


def _one_of(flag: str, choices: tuple[str, ...]):
    def check(instance, attribute, value):
        if value not in choices:
            raise ConfigError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")

    return check


@attrs.frozen(kw_only=True)
class RuntimeOptions:
    """How to build the runner: the backend and its kernels' choices.

    The runner's geometry (page size, context, KV capacity) is the engine's: `EngineConfig`
    declares it once, and `create_runner` takes both.
    """

    backend: str = attrs.field(default="auto", validator=_one_of("--backend", BACKENDS))
    activations: str = attrs.field(default="q8", validator=_one_of("--activations", ACTIVATIONS))
    max_batch_rows: int = 64
    max_tokens_per_step: int = 4096  # CUDA: tokens one forward's buffers hold (longer prefills split)
    kernel_cache: bool = True  # CUDA: keep compiled kernels on disk (models.registry.kernel_cache_dir)
    reserve_gib: float = attrs.field(default=0.0, validator=_non_negative("--reserve-gib"))
    # ^ device memory (host memory on the reference backend) `--kv-capacity auto` leaves free

    @property
    def reserve_bytes(self) -> int:
        return int(self.reserve_gib * GIB)


def parse_kv_capacity(text: str) -> int | None:
    """`auto` (None: fit free memory) or a positive token count (argparse type)."""
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"--kv-capacity must be a token count or 'auto', got {text!r}") from None
    if value <= 0:
        raise ValueError(f"--kv-capacity must be positive, got {value}")
    return value


def resolve_backend(name: str, spec=None) -> str:
    """'auto' -> 'cuda' when a usable GPU is present, else 'cpu' for a model it runs (`spec`:
    dense llama / qwen2 / qwen3), else 'reference'."""
    if name in ("reference", "cpu"):
        return name
    from ninfer.gpu.cuda.available import cuda_available

    if name == "cuda":
        if not cuda_available():
            raise ConfigError("--backend cuda was asked for, but no usable CUDA GPU was found")
        return name
    if cuda_available():
        return "cuda"
    return host_backend(spec)


def host_backend(spec=None) -> str:
    """The backend `auto` picks without a GPU: 'cpu' for a model it runs (`spec`: dense llama /
    qwen2 / qwen3), else 'reference'."""
    from ninfer.cpu.runner import runs_on_cpu

    return "cpu" if spec is not None and runs_on_cpu(spec) else "reference"


def config_for_model(model: LoadedModel, config: EngineConfig) -> EngineConfig:
    """`config` with its context limit resolved for `model` (unset: the model's, capped at
    DEFAULT_CONTEXT_CAP; above the model's: ConfigError)."""
    return config.for_model(model.spec.max_context, cap=DEFAULT_CONTEXT_CAP)


# CUDA, hybrid models: device slots for the prefix cache's newest state checkpoints (a hit on
# one restores it device to device; older ones are demoted to host copies): one per lane, at most
# this many (about 157 MB each at Qwen3.5-27B sizes)
MAX_CHECKPOINT_SLOTS = 8


def checkpoint_slots_for(spec, config: EngineConfig, backend: str) -> int:
    """The runner's checkpoint slots (`MAX_CHECKPOINT_SLOTS`): CUDA hybrids with the prefix
    cache on; elsewhere the host copies are all there is."""
    if backend != "cuda" or not spec.is_hybrid or not config.prefix_cache:
        return 0
    return min(config.max_concurrency, MAX_CHECKPOINT_SLOTS)


def state_nbytes_for(model: LoadedModel, config: EngineConfig, backend: str) -> int:
    """Device memory of the recurrent states a runner for `config` holds (hybrid models; 0
    otherwise): one float32 state per lane (the engine checks the runner holds that many), and
    on CUDA one spare slot (graph padding rows write there) and the checkpoint slots."""
    lanes = config.max_concurrency + (1 if backend == "cuda" else 0)
    lanes += checkpoint_slots_for(model.spec, config, backend)
    return lanes * model.spec.recurrent_state_nbytes(4)


def num_pages_for(model: LoadedModel, config: EngineConfig, backend: str, *, reserve_bytes: int = 0) -> int:
    """KV pool size in pages for a resolved `config` (its kv_capacity, else auto); auto leaves
    `reserve_bytes` of the device's memory free (ConfigError, with the numbers, when one full
    context cannot fit then). Auto sizing takes every lane's recurrent state (hybrid models,
    `state_nbytes_for`) out of the same memory as the pages."""
    page = config.page_size
    if config.kv_capacity is not None:
        return -(-config.kv_capacity // page)
    min_pages = -(-config.max_context // page)
    state_bytes = state_nbytes_for(model, config, backend)
    if backend == "cuda":
        from ninfer.gpu.cuda.runner import auto_num_pages

        num_pages, page_bytes = auto_num_pages(model.spec, page), model.spec.kv_bytes_per_token(2) * page
        num_pages = max(num_pages - -(-state_bytes // page_bytes), min_pages)
    else:
        page_bytes = model.spec.kv_bytes_per_token(4) * page
        num_pages = max((REFERENCE_AUTO_KV_BYTES - state_bytes) // page_bytes, min_pages)
    if reserve_bytes:
        num_pages = min(num_pages, _pages_within_reserve(model, config, backend, page_bytes, reserve_bytes))
    return num_pages


def _pages_within_reserve(model: LoadedModel, config: EngineConfig, backend: str, page_bytes: int,
                          reserve_bytes: int) -> int:  # fmt: skip
    """Pages that fit the memory free now less the reserve (and, on CUDA, the weights still to
    be copied there; the reference backend's weights are already in host memory)."""
    free, total = device_memory(backend)
    weights = model.weights.nbytes if backend == "cuda" else 0
    states = state_nbytes_for(model, config, backend)
    room = free - reserve_bytes - weights - states
    needed = -(-config.max_context // config.page_size)
    if room < needed * page_bytes:
        where = "the GPU" if backend == "cuda" else "host memory (the reference backend's device)"
        weights_text = f" and {weights / GIB:.2f} GiB of weights" if weights else ""
        weights_text += f" and {states / GIB:.3f} GiB of recurrent states" if states else ""
        raise ConfigError(
            f"--reserve-gib {reserve_bytes / GIB:g} does not fit: {where} has {free / GIB:.2f} GiB free of"
            f" {total / GIB:.2f} GiB; less the reserve{weights_text} that leaves {max(room, 0) / GIB:.2f} GiB for"
            f" the KV pool, but one --max-context of {config.max_context} tokens needs"
            f" {needed * page_bytes / GIB:.3f} GiB; lower --reserve-gib or --max-context"
        )
    return room // page_bytes


def device_memory(backend: str) -> tuple[int, int]:
    """(free, total) bytes of the backend's device: the GPU's, or host memory (available, total)."""
    if backend == "cuda":
        # Only gpu/cuda/ imports numba: use its handle (the one auto_num_pages asks).
        from ninfer.gpu.cuda.runner import cuda

        free, total = cuda.current_context().get_memory_info()
        return int(free), int(total)
    return host_memory()


def host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory (/proc/meminfo; elsewhere sysconf's free pages)."""
    import os

    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.count(" kB")}
        return fields["MemAvailable"], fields["MemTotal"]
    except (OSError, KeyError, ValueError):
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def create_runner(model: LoadedModel, options: RuntimeOptions, config: EngineConfig) -> tuple[Runner, str, EngineConfig]:
    """(runner, backend name, `config` resolved for the model) for these options and limits."""
    backend = resolve_backend(options.backend, model.spec)
    config = config_for_model(model, config)
    num_pages = num_pages_for(model, config, backend, reserve_bytes=options.reserve_bytes)
    runner = build_runner(
        model, backend, num_pages=num_pages, page_size=config.page_size, max_batch_rows=options.max_batch_rows,
        max_tokens_per_step=options.max_tokens_per_step, max_context=config.max_context,
        activations=options.activations, max_sequences=config.max_concurrency,  # hybrids' state slots
        checkpoint_slots=checkpoint_slots_for(model.spec, config, backend), kernel_cache=options.kernel_cache,
    )  # fmt: skip
    return runner, backend, config


def build_runner(model, backend: str, *, num_pages: int, page_size: int, max_batch_rows: int,
                 max_tokens_per_step: int, max_context: int | None, activations: str,
                 max_sequences: int | None = None, checkpoint_slots: int = 0, kernel_cache: bool = True,
                 use_graphs: bool = True, progress: bool = False) -> Runner:  # fmt: skip
    """The runner of a resolved backend ('cuda', 'cpu' or 'reference') over `model` (a
    LoadedModel, or (spec, weights) as `random_model` gives): `create_runner` and `ninfer
    bench` build theirs here. The CUDA-only arguments are ignored elsewhere."""
    from ninfer.gpu.blas import limit_blas_threads
    from ninfer.gpu.reference import spec_and_weights

    spec, _ = spec_and_weights(model)
    if backend == "cuda":
        from ninfer.gpu.cuda.runner import CudaRunner

        use_kernel_cache(kernel_cache)
        return CudaRunner(
            model, num_pages=num_pages, page_size=page_size, max_batch_rows=max_batch_rows,
            max_tokens_per_step=max_tokens_per_step, max_context=max_context, activations=activations,
            max_sequences=max_sequences, checkpoint_slots=checkpoint_slots, use_graphs=use_graphs, progress=progress,
        )  # fmt: skip
    limit_blas_threads()  # the reference's (and the cpu prefill products') BLAS keeps one thread
    if backend == "cpu":
        from ninfer.cpu.runner import SUPPORTED_ARCHS, CpuRunner, runs_on_cpu

        if not runs_on_cpu(spec):
            raise ConfigError(f"--backend cpu runs {', '.join(SUPPORTED_ARCHS)} models, not {spec.arch} "
                              "(hybrid qwen35 models: use --backend reference)")  # fmt: skip
        return CpuRunner(model, num_pages=num_pages, page_size=page_size)
    from ninfer.gpu.reference import ReferenceRunner

    return ReferenceRunner(model, num_pages=num_pages, page_size=page_size)


def use_kernel_cache(enabled: bool = True):
    """CUDA: compiled kernels go to (and come from) the on-disk cache from now on, or stay in
    memory only; the store (its `stats` count hits and misses), or None."""
    from ninfer.gpu.cuda.kernels.jit import use_disk_cache
    from ninfer.models.registry import kernel_cache_dir

    return use_disk_cache(kernel_cache_dir() if enabled else None)


def kernel_cache_summary() -> str:
    """One line on the kernel disk cache's use so far in this process."""
    from ninfer.gpu.cuda.kernels.jit import current_store

    store = current_store()
    if store is None:
        return "kernel cache off"
    stats = store.stats
    return f"{stats['hits']} kernels loaded from {store.directory}, {stats['saves']} compiled and saved"


def warm_up(runner: Runner, backend: str, config: EngineConfig, *, progress: bool = False) -> float | None:
    """Compile every kernel and capture every batch shape `config` can produce (CUDA), so no
    request waits for it (cpu: numba's kernels, compiled on the first start and loaded from its
    disk cache afterwards); seconds taken, or None where the backend has nothing to warm."""
    if backend not in ("cuda", "cpu"):
        return None
    import time

    started = time.perf_counter()
    if backend == "cpu":
        runner.warm_up(progress=progress)
        return time.perf_counter() - started
    # hybrids: rows cannot start mid-sequence (recurrent state), so their warm-up runs real sequences
    warm = runner.warm_up_hybrid if runner.spec.is_hybrid else runner.warm_up
    warm(max_rows=config.max_concurrency, max_context=config.max_context, progress=progress)
    return time.perf_counter() - started


def load(model_arg: str | None, *, progress: bool = True) -> LoadedModel:
    """Resolve a model name / path (pulling the default on first use) and load it."""
    from ninfer.models.loader import load_model
    from ninfer.models.registry import ensure_model

    return load_model(ensure_model(model_arg, progress=progress), progress=progress)


@asynccontextmanager
async def open_runtime(
    model: LoadedModel, options: RuntimeOptions, config: EngineConfig
) -> AsyncIterator[tuple[object, Runner, str]]:
    """Create the runner and open an engine on it: yields (engine, runner, backend). The cpu
    backend's kernels are loaded first (`warm_up_announced`)."""
    from ninfer.sched.engine import open_engine

    runner, backend, config = create_runner(model, options, config)
    try:
        if backend == "cpu":
            await warm_up_announced(runner)
        async with open_engine(
            config, runner, model.tokenizer, stop_token_ids=model.stop_token_ids
        ) as engine:
            yield engine, runner, backend
    finally:
        runner.close()



COMPILE_NOTICE = ("cpu backend: compiling its kernels (the first run takes a few minutes; later runs load "
                  "them from the disk cache)")


async def warm_up_announced(runner, *, notice_after_s: float = 2.0) -> None:
    """`runner.warm_up()` off the event loop (`ninfer generate` / `chat` on the cpu backend).
    numba compiles the kernels on a first run, for minutes on a small machine; when the warm-up
    is still running after `notice_after_s`, stderr says so, and how long it took once done.
    A warm disk cache loads them in about a second, silently."""
    import sys
    import time

    import trio

    started = time.perf_counter()
    announced = False

    async def notice() -> None:
        nonlocal announced
        await trio.sleep(notice_after_s)
        print(COMPILE_NOTICE, file=sys.stderr, flush=True)
        announced = True

    async with trio.open_nursery() as nursery:
        nursery.start_soon(notice)
        await trio.to_thread.run_sync(runner.warm_up, abandon_on_cancel=True)  # Ctrl-C need not wait
        nursery.cancel_scope.cancel()
    if announced:
        print(f"cpu backend: kernels ready in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
