"""`ServerSettings`: every `ninfer serve` option, frozen and validated at start-up.

The settings compose the objects that own the options, each declared and validated once, on
its owner: `RuntimeOptions` (backend, activations), `EngineConfig` (lanes, queue, context, KV
pages and capacity, prefix cache, lookahead) and `SamplingParams` (the sampling defaults of
requests that omit a field). `ServerSettings` itself declares only the HTTP server's options
and checks the one rule that spans objects (--default-max-tokens below --max-context). The
CLI builds all of them from its flags (`ninfer.cli.serve.settings_from_args`).

A bad value or combination raises `SettingsError` (the runtime's `ConfigError`) with one
sentence naming the flag, so the server never starts half-configured.
"""

from __future__ import annotations

import math
import re

import attrs

from ninfer.core.params import SamplingParams
from ninfer.protocols.scoring import DEFAULT_RERANK_MAX_DOCUMENTS, DEFAULT_RERANK_WEIGHTS
from ninfer.runtime import ConfigError, RuntimeOptions
from ninfer.sched.config import EngineConfig

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
DEFAULT_FRAME_GAP_US = 250.0  # see ninfer.server.service.GenerationService._frame_gap
MIB = 1 << 20
_ORIGIN = re.compile(r"^(\*|https?://[^/\s]+)$")

# An invalid server option (printed as one line by the CLI): the same error whichever of the
# composed objects declares the option.
SettingsError = ConfigError


def _require(ok, message: str):
    """An attrs validator: `ok(value)`, else SettingsError(message.format(value=value))."""

    def check(instance, attribute, value):
        if not ok(value):
            raise SettingsError(message.format(value=value))

    return check


def _finite_positive(value) -> bool:
    return math.isfinite(value) and value > 0


def _origins_valid(instance, attribute, origins) -> None:
    for origin in origins:
        if not _ORIGIN.match(origin):
            raise SettingsError(f"--cors takes '*' or an origin like https://example.com, got {origin!r}")


RERANK_OPTIONS = ("exact", "substitute", "complement", "irrelevant")  # the order of rerank_weights


def _rerank_weights_valid(instance, attribute, weights) -> None:
    if len(weights) != len(RERANK_OPTIONS):
        raise SettingsError(f"rerank weights take {len(RERANK_OPTIONS)} numbers ({', '.join(RERANK_OPTIONS)}), got {len(weights)}")
    for name, w in zip(RERANK_OPTIONS, weights):
        if isinstance(w, bool) or not isinstance(w, int | float) or not 0 <= w <= 1:
            raise SettingsError(f"--rerank-weight-{name} must be a number between 0 and 1, got {w!r}")


def _names_valid(instance, attribute, names) -> None:
    for name in names:
        if not isinstance(name, str) or not name.strip() or any(c.isspace() or not c.isprintable() for c in name):
            raise SettingsError(f"--served-model-name takes non-empty names without spaces, got {name!r}")


def _keys_valid(instance, attribute, keys) -> None:
    for key in keys:
        if not key or any(c.isspace() for c in key):
            raise SettingsError("API keys must be non-empty and contain no whitespace")


@attrs.frozen(kw_only=True)
class ServerSettings:
    model: str | None = None  # path or known name; None = the default model
    runtime: RuntimeOptions = attrs.field(factory=RuntimeOptions, validator=attrs.validators.instance_of(RuntimeOptions))
    engine: EngineConfig = attrs.field(factory=EngineConfig, validator=attrs.validators.instance_of(EngineConfig))
    # ^ max_context None: the model's, at most 8192 (resolved when the model is loaded)
    sampling: SamplingParams = attrs.field(factory=SamplingParams, validator=attrs.validators.instance_of(SamplingParams))
    # ^ defaults for requests that omit a sampling field
    default_max_tokens: int | None = attrs.field(
        default=None, validator=_require(lambda v: v is None or v >= 1, "--default-max-tokens must be at least 1, got {value}")
    )  # None: up to the context limit
    host: str = attrs.field(default="127.0.0.1", validator=_require(bool, "--host must not be empty"))
    port: int = attrs.field(default=8080, validator=_require(lambda v: 0 <= v <= 65535, "--port must be between 0 and 65535, got {value}"))
    # ^ 0 = any free port (tests)
    model_id: str | None = attrs.field(
        default=None, validator=_require(lambda v: v is None or bool(v.strip()), "--model-id must not be empty")
    )  # public name; None = the model's own name
    served_model_names: tuple[str, ...] = attrs.field(default=(), converter=tuple, validator=_names_valid)
    # ^ --served-model-name: more names requests may send; /v1/models lists them after the id
    webui: bool = True  # the dashboard (/dashboard) and the chat page (/chat, /); --no-webui turns them off
    api_keys: tuple[str, ...] = attrs.field(default=(), repr=False, validator=_keys_valid)  # empty: no authentication
    max_request_mib: float = attrs.field(
        default=8.0, validator=_require(_finite_positive, "--max-request-mib must be a finite positive number, got {value}")
    )
    log_level: str = attrs.field(
        default="info", validator=_require(LOG_LEVELS.__contains__, f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {{value!r}}")
    )
    cors_origins: tuple[str, ...] = attrs.field(default=(), validator=_origins_valid)  # allowed browser origins; "*" = any
    frame_gap_us: float = attrs.field(
        default=DEFAULT_FRAME_GAP_US, validator=_require(lambda v: 0 <= v <= 100_000, "--frame-gap-us must be between 0 and 100000, got {value}")
    )  # with many streams, each stream's text frames are this far apart per stream running
    gc_freeze: bool = True  # once warm, freeze the heap out of the collector (ninfer.server.heap); --no-gc-freeze
    keepalive_s: float = attrs.field(default=10.0, validator=_require(lambda v: v > 0, "--sse-keepalive-s must be positive, got {value}"))
    # ^ SSE comment interval on an idle stream
    shutdown_grace_s: float = attrs.field(
        default=10.0, validator=_require(lambda v: v >= 0, "--shutdown-grace-s must be at least 0, got {value}")
    )  # in-flight streams get this long after SIGINT / SIGTERM
    send_timeout_s: float = attrs.field(
        default=30.0, validator=_require(_finite_positive, "--send-timeout-s must be a finite positive number, got {value}")
    )  # a client that takes no data for this long is dropped
    body_timeout_s: float = attrs.field(
        default=60.0, validator=_require(_finite_positive, "--body-timeout-s must be a finite positive number, got {value}")
    )  # a request body must arrive within this long
    rerank_max_documents: int = attrs.field(
        default=DEFAULT_RERANK_MAX_DOCUMENTS,
        validator=_require(lambda v: v >= 1, "--rerank-max-documents must be at least 1, got {value}"),
    )  # documents one /v1/rerank call may send
    rerank_weights: tuple[float, ...] = attrs.field(default=DEFAULT_RERANK_WEIGHTS, converter=tuple,
                                                    validator=_rerank_weights_valid)  # fmt: skip
    # ^ relevance of each rerank option, in RERANK_OPTIONS order

    def __attrs_post_init__(self):
        limit, context = self.default_max_tokens, self.engine.max_context
        if limit is not None and context is not None and limit >= context:
            raise SettingsError(f"--default-max-tokens ({limit}) must be below --max-context ({context})")

    @property
    def max_request_bytes(self) -> int:
        return int(self.max_request_mib * MIB)


def read_api_key_file(path: str) -> tuple[str, ...]:
    """Keys from a file, one per line (blank lines and `#` comments skipped)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.strip() for line in f]
    except OSError as e:
        raise SettingsError(f"cannot read --api-key-file {path}: {e.strerror}") from None
    keys = tuple(line for line in lines if line and not line.startswith("#"))
    _check(bool(keys), f"--api-key-file {path} holds no key")
    return keys
