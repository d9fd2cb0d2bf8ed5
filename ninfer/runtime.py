"""From a model argument to a running engine: resolve, load, size the KV pool, pick a backend.

Shared by `ninfer serve`, `generate`, `chat` and `bench`, so every command treats the model
argument, `--backend` and `--kv-capacity` the same way.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs

from ninfer.gpu.runner import Runner
from ninfer.models.loaded import LoadedModel

BACKENDS = ("auto", "cuda", "reference")
ACTIVATIONS = ("f32", "q8")  # CUDA decode linears: exact float32, or int8 blocks with dp4a
# Host memory the reference backend's KV pool may take when --kv-capacity is auto.
REFERENCE_AUTO_KV_BYTES = 2 << 30


class ConfigError(Exception):
    """A bad combination of runtime options (one readable sentence)."""


def _kv_capacity(instance, attribute, value):
    if value != "auto" and (not isinstance(value, int) or value <= 0):
        raise ValueError(f"kv_capacity must be a positive number of tokens or 'auto', got {value!r}")


@attrs.frozen(kw_only=True)
class RuntimeOptions:
    backend: str = attrs.field(default="auto", validator=attrs.validators.in_(BACKENDS))
    kv_capacity: int | str = attrs.field(default="auto", validator=_kv_capacity)  # tokens
    page_size: int = 16
    max_context: int | None = None  # None: the model's context, capped at 8192
    max_batch_rows: int = 64
    activations: str = attrs.field(default="f32", validator=attrs.validators.in_(ACTIVATIONS))
    max_tokens_per_step: int = 4096  # CUDA: tokens one forward's buffers hold (longer prefills split)


def parse_kv_capacity(text: str) -> int | str:
    """`auto` or a positive token count (argparse type)."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"--kv-capacity must be a token count or 'auto', got {text!r}") from None
    if value <= 0:
        raise ValueError(f"--kv-capacity must be positive, got {value}")
    return value


def resolve_backend(name: str) -> str:
    """'auto' -> 'cuda' when a usable GPU is present, else 'reference'."""
    if name == "reference":
        return name
    from ninfer.gpu.cuda.available import cuda_available

    if name == "cuda":
        if not cuda_available():
            raise ConfigError("--backend cuda was asked for, but no usable CUDA GPU was found")
        return name
    return "cuda" if cuda_available() else "reference"


def effective_max_context(model: LoadedModel, options: RuntimeOptions) -> int:
    limit = model.spec.max_context
    if options.max_context is None:
        return min(limit, 8192)
    if options.max_context > limit:
        raise ConfigError(
            f"--max-context {options.max_context} exceeds the model's context of {limit} tokens"
        )
    return options.max_context


def num_pages_for(model: LoadedModel, options: RuntimeOptions, backend: str, max_context: int) -> int:
    """KV pool size in pages; an explicit capacity must hold at least one full context."""
    page = options.page_size
    if options.kv_capacity == "auto":
        if backend == "cuda":
            from ninfer.gpu.cuda.runner import auto_num_pages

            return auto_num_pages(model.spec, page)
        per_page = model.spec.kv_bytes_per_token(4) * page
        return max(REFERENCE_AUTO_KV_BYTES // per_page, -(-max_context // page))
    pages = -(-options.kv_capacity // page)
    if pages * page < max_context:
        raise ConfigError(
            f"--kv-capacity {options.kv_capacity} is smaller than the context of {max_context} "
            "tokens; raise it or lower --max-context"
        )
    return pages


def create_runner(model: LoadedModel, options: RuntimeOptions) -> tuple[Runner, str, int]:
    """(runner, backend name, max_context) for this model and these options."""
    backend = resolve_backend(options.backend)
    max_context = effective_max_context(model, options)
    num_pages = num_pages_for(model, options, backend, max_context)
    if backend == "cuda":
        from ninfer.gpu.cuda.runner import CudaRunner

        runner = CudaRunner(
            model, num_pages=num_pages, page_size=options.page_size, max_batch_rows=options.max_batch_rows,
            max_tokens_per_step=options.max_tokens_per_step, max_context=max_context,
            activations=options.activations,
        )  # fmt: skip
    else:
        from ninfer.gpu.blas import limit_blas_threads
        from ninfer.gpu.reference import ReferenceRunner

        limit_blas_threads()
        runner = ReferenceRunner(model, num_pages=num_pages, page_size=options.page_size)
    return runner, backend, max_context


def load(model_arg: str | None, *, progress: bool = True) -> LoadedModel:
    """Resolve a model name / path (pulling the default on first use) and load it."""
    from ninfer.models.loader import load_model
    from ninfer.models.registry import ensure_model

    return load_model(ensure_model(model_arg, progress=progress), progress=progress)


@asynccontextmanager
async def open_runtime(
    model: LoadedModel, options: RuntimeOptions, **engine_fields
) -> AsyncIterator[tuple[object, Runner, str]]:
    """Create the runner and open an engine on it: yields (engine, runner, backend)."""
    from ninfer.sched.engine import EngineConfig, open_engine

    runner, backend, max_context = create_runner(model, options)
    try:
        config = EngineConfig(max_context=max_context, page_size=options.page_size, **engine_fields)
        async with open_engine(
            config, runner, model.tokenizer, stop_token_ids=model.stop_token_ids
        ) as engine:
            yield engine, runner, backend
    finally:
        runner.close()

