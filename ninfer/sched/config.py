"""Engine configuration: frozen, validated, every limit named with its unit."""

from __future__ import annotations

import attrs

GIB = 1 << 30


def _at_least(minimum: int | float, what: str):
    def check(instance, attribute, value):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"{attribute.name} ({what}) must be a number, got {value!r}.")
        if value < minimum:
            raise ValueError(f"{attribute.name} ({what}) must be at least {minimum}, got {value}.")

    return check


def _optional_at_least(minimum: int, what: str):
    inner = _at_least(minimum, what)

    def check(instance, attribute, value):
        if value is not None:
            inner(instance, attribute, value)

    return check


def _positive_float(what: str):
    def check(instance, attribute, value):
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ValueError(f"{attribute.name} ({what}) must be a positive number, got {value!r}.")

    return check


@attrs.frozen(kw_only=True)
class EngineConfig:
    """Limits of one engine.

    KV capacity is whatever the runner was built with (`runner.num_pages`); `kv_capacity` only
    records the tokens the CLI asked for (None = auto, fit free memory) and, when set, the
    engine checks that the runner holds at least that many. `max_context` None means the
    model's own context length.
    """

    max_concurrency: int = attrs.field(default=8, validator=_at_least(1, "execution lanes"))
    max_pending: int = attrs.field(default=64, validator=_at_least(1, "queued requests"))
    pending_timeout_s: float = attrs.field(
        default=60.0, validator=_positive_float("seconds a request may wait for a lane")
    )
    max_context: int | None = attrs.field(
        default=None, validator=_optional_at_least(2, "tokens per sequence")
    )
    page_size: int = attrs.field(default=16, validator=_at_least(1, "tokens per KV page"))
    prefill_chunk: int = attrs.field(
        default=512, validator=_at_least(1, "prefill tokens per step")
    )
    host_snapshot_bytes: int = attrs.field(
        default=GIB, validator=_at_least(0, "bytes of host memory for paused KV")
    )
    kv_capacity: int | None = attrs.field(
        default=None, validator=_optional_at_least(1, "KV tokens")
    )
    seed: int | None = None  # draws the seeds of unseeded requests; None = OS entropy
    prefix_cache: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    # ^ reuse computed KV across requests (ninfer/cache/prefix.py)
    host_cache_bytes: int = attrs.field(
        default=GIB, validator=_at_least(0, "bytes of host memory for demoted prefix-cache pages")
    )
    prefix_salt: str = ""  # mixed into every prefix-cache key (e.g. a model revision)
    lookahead: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    # ^ on a pipelined runner (CUDA), queue decode step N + 1 before reading step N's tokens
    #   (sched/stepper.py): the GPU does not wait for the host between steps
