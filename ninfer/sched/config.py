"""Engine configuration: frozen, validated, every limit named with its unit.

`EngineConfig` is the one declaration of the engine's limits: `ninfer serve`, `generate` and
`chat` build it straight from their flags (`ninfer.cli.common.engine_config`), the runtime
fills in the context limit it resolved for the model, and the engine takes it as is.
"""

from __future__ import annotations

import attrs

GIB = 1 << 30
MIN_CONTEXT = 2  # a sequence needs a prompt token and room for one generated token


class ConfigError(ValueError):
    """A bad option or combination of options (one readable sentence; the CLI prints it as
    one line)."""


def _at_least(minimum: int | float, what: str):
    def check(instance, attribute, value):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"{attribute.name} ({what}) must be a number, got {value!r}.")
        if value < minimum:
            raise ConfigError(f"{attribute.name} ({what}) must be at least {minimum}, got {value}.")

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
            raise ConfigError(f"{attribute.name} ({what}) must be a positive number, got {value!r}.")

    return check


@attrs.frozen(kw_only=True)
class EngineConfig:
    """Limits of one engine.

    KV capacity is whatever the runner was built with (`runner.num_pages`); `kv_capacity` is
    the tokens the user asked for (`--kv-capacity`; None = auto, fit free memory): the runtime
    sizes the runner from it and, when set, the engine checks that the runner holds at least
    that many. `max_context` None means the model's own context length (the runtime caps it
    at 8192; see `resolve_max_context`).
    """

    max_concurrency: int = attrs.field(default=8, validator=_at_least(1, "execution lanes"))
    max_pending: int = attrs.field(default=64, validator=_at_least(1, "queued requests"))
    pending_timeout_s: float = attrs.field(
        default=60.0, validator=_positive_float("seconds a request may wait for a lane")
    )
    max_context: int | None = attrs.field(
        default=None, validator=_optional_at_least(MIN_CONTEXT, "tokens per sequence")
    )
    page_size: int = attrs.field(default=16, validator=_at_least(1, "tokens per KV page"))
    prefill_chunk: int = attrs.field(
        default=512, validator=_at_least(1, "prefill tokens per step")
    )
    max_prefill_tokens: int | None = attrs.field(
        default=None, validator=_optional_at_least(1, "prefill tokens per step in a burst")
    )
    # ^ a burst of short prefills (short prompts, short suffixes over a cached prefix, each at
    #   most prefill_chunk) may take up to this many tokens a step, to be admitted within a few
    #   steps (sched/planner.py); None = 8 x prefill_chunk.
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

    def __attrs_post_init__(self):
        kv, context = self.kv_capacity, self.max_context
        if kv is not None and context is not None and kv < context:
            raise ConfigError(f"--kv-capacity ({kv} tokens) must hold at least one full --max-context ({context} tokens)")
        burst = self.max_prefill_tokens
        if burst is not None and burst < self.prefill_chunk:
            raise ConfigError(f"max_prefill_tokens ({burst}) must be at least prefill_chunk ({self.prefill_chunk})")

    def resolve_max_context(self, model_context: int, *, cap: int | None = None) -> int:
        """The context limit in effect for a model of `model_context` tokens: `max_context`,
        else the model's (at most `cap`). The one check of `max_context` against the model."""
        if self.max_context is None:
            return model_context if cap is None else min(model_context, cap)
        if self.max_context > model_context:
            raise ConfigError(
                f"--max-context {self.max_context} exceeds the model's context of {model_context} tokens"
            )
        return self.max_context

    def for_model(self, model_context: int, *, cap: int | None = None) -> EngineConfig:
        """This config with `max_context` resolved for the model (see `resolve_max_context`)."""
        return attrs.evolve(self, max_context=self.resolve_max_context(model_context, cap=cap))
