"""`ServerSettings`: every `ninfer serve` option, frozen and validated at start-up.

A bad value or combination raises `SettingsError` with one sentence naming the flag, so the
server never starts half-configured.
"""

from __future__ import annotations

import math
import re

import attrs

from ninfer.gpu.runner import SamplingParams
from ninfer.runtime import ACTIVATIONS, BACKENDS, ConfigError, RuntimeOptions

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
MIB = 1 << 20
_ORIGIN = re.compile(r"^(\*|https?://[^/\s]+)$")


class SettingsError(ConfigError):
    """An invalid server option (printed as one line by the CLI)."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise SettingsError(message)


@attrs.frozen(kw_only=True)
class ServerSettings:
    model: str | None = None  # path or known name; None = the default model
    host: str = "127.0.0.1"
    port: int = 8080  # 0 = any free port (tests)
    model_id: str | None = None  # public name; None = the model's own name
    backend: str = "auto"
    max_context: int | None = None
    kv_capacity: int | str = "auto"  # tokens or "auto"
    page_size: int = 16
    activations: str = "f32"  # CUDA decode activations (RuntimeOptions.activations); reference ignores it
    max_concurrency: int = 8
    max_pending_requests: int = 64
    pending_timeout_ms: int = 60_000
    prefill_chunk: int = 512
    prefix_reuse: bool = True  # reuse computed KV of shared prompt prefixes (docs/scheduling.md)
    lookahead: bool = True  # submit decode steps one ahead on a pipelined (CUDA) runner (docs/scheduling.md)
    host_cache_mib: float = 1024.0  # host memory for prefix-cache pages demoted off the device
    api_keys: tuple[str, ...] = attrs.field(default=(), repr=False)  # empty: no authentication
    default_max_tokens: int | None = None  # None: up to the context limit
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_request_mib: float = 8.0
    log_level: str = "info"
    cors_origins: tuple[str, ...] = ()  # allowed browser origins; "*" = any
    keepalive_s: float = 10.0  # SSE comment interval on an idle stream
    shutdown_grace_s: float = 10.0  # in-flight streams get this long after SIGINT / SIGTERM
    send_timeout_s: float = 30.0  # a client that takes no data for this long is dropped
    body_timeout_s: float = 60.0  # a request body must arrive within this long

    def __attrs_post_init__(self):
        _check(bool(self.host), "--host must not be empty")
        _check(0 <= self.port <= 65535, f"--port must be between 0 and 65535, got {self.port}")
        _check(self.backend in BACKENDS, f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        _check(self.activations in ACTIVATIONS,
               f"--activations must be one of {', '.join(ACTIVATIONS)}, got {self.activations!r}")  # fmt: skip
        _check(self.model_id is None or bool(self.model_id.strip()), "--model-id must not be empty")
        for flag, value in (("--max-concurrency", self.max_concurrency), ("--max-pending-requests", self.max_pending_requests),
                            ("--pending-timeout-ms", self.pending_timeout_ms), ("--prefill-chunk", self.prefill_chunk),
                            ("--page-size", self.page_size)):  # fmt: skip
            _check(value >= 1, f"{flag} must be at least 1, got {value}")
        _check(self.max_context is None or self.max_context >= 2, f"--max-context must be at least 2, got {self.max_context}")
        self._check_limits()
        self._check_keys()
        _check(isinstance(self.prefix_reuse, bool), f"prefix_reuse must be true or false, got {self.prefix_reuse!r}")
        _check(isinstance(self.lookahead, bool), f"lookahead must be true or false, got {self.lookahead!r}")
        _check(math.isfinite(self.host_cache_mib) and self.host_cache_mib >= 0,
               f"--host-cache-mib must be a finite number >= 0, got {self.host_cache_mib}")  # fmt: skip
        _check(math.isfinite(self.max_request_mib) and self.max_request_mib > 0,
               f"--max-request-mib must be a finite positive number, got {self.max_request_mib}")  # fmt: skip
        _check(self.log_level in LOG_LEVELS, f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        for origin in self.cors_origins:
            _check(bool(_ORIGIN.match(origin)), f"--cors takes '*' or an origin like https://example.com, got {origin!r}")
        _check(self.keepalive_s > 0, f"--sse-keepalive-s must be positive, got {self.keepalive_s}")
        _check(self.shutdown_grace_s >= 0, f"--shutdown-grace-s must be at least 0, got {self.shutdown_grace_s}")
        for flag, value in (("--send-timeout-s", self.send_timeout_s), ("--body-timeout-s", self.body_timeout_s)):
            _check(math.isfinite(value) and value > 0, f"{flag} must be a finite positive number, got {value}")
        try:
            self.sampling_defaults()
        except ValueError as e:
            raise SettingsError(f"invalid sampler default: {e}") from None

    def _check_limits(self) -> None:
        kv = self.kv_capacity
        _check(kv == "auto" or (isinstance(kv, int) and kv > 0), f"--kv-capacity must be a positive token count or 'auto', got {kv!r}")
        if self.default_max_tokens is not None:
            _check(self.default_max_tokens >= 1, f"--default-max-tokens must be at least 1, got {self.default_max_tokens}")
            if self.max_context is not None:
                _check(self.default_max_tokens < self.max_context,
                       f"--default-max-tokens ({self.default_max_tokens}) must be below --max-context ({self.max_context})")  # fmt: skip
        if isinstance(kv, int) and self.max_context is not None:
            _check(kv >= self.max_context,
                   f"--kv-capacity ({kv} tokens) must hold at least one full --max-context ({self.max_context} tokens)")  # fmt: skip

    def _check_keys(self) -> None:
        for key in self.api_keys:
            _check(bool(key) and not any(c.isspace() for c in key), "API keys must be non-empty and contain no whitespace")

    @property
    def max_request_bytes(self) -> int:
        return int(self.max_request_mib * MIB)

    def sampling_defaults(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
        )  # fmt: skip

    def runtime_options(self) -> RuntimeOptions:
        return RuntimeOptions(
            backend=self.backend, kv_capacity=self.kv_capacity, page_size=self.page_size,
            max_context=self.max_context, activations=self.activations,
        )  # fmt: skip

    def engine_fields(self) -> dict:
        """EngineConfig fields these settings choose (open_runtime adds max_context, page_size)."""
        return {
            "max_concurrency": self.max_concurrency, "max_pending": self.max_pending_requests,
            "pending_timeout_s": self.pending_timeout_ms / 1000.0, "prefill_chunk": self.prefill_chunk,
            "prefix_cache": self.prefix_reuse, "host_cache_bytes": int(self.host_cache_mib * MIB),
            "lookahead": self.lookahead,
        }  # fmt: skip


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
