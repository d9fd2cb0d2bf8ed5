"""A real ninfer server on a loopback port, for tests that drive it with SDKs and raw HTTP.

The server runs `serve(settings, task_status=...)` inside its own `trio.run` on a background
thread: the official `openai` / `anthropic` SDKs (httpx underneath) are synchronous or asyncio
clients, and pytest-trio fixtures are per test, so a thread lets one server (model loaded
once, runner built once) serve a whole test module while the tests stay plain functions
calling the SDKs' synchronous clients. `stop()` cancels the server's nursery from the test
thread through the trio token; `shutdown()` asks for a graceful shutdown instead.

Usage in a test module:

    @pytest.fixture(scope="module")
    def server(smollm2):
        with running_server(small_settings(max_context=256, kv_capacity=1024), smollm2) as s:
            yield s
"""

from __future__ import annotations

import contextlib
import functools
import queue
import threading

import httpx
import trio

from ninfer.server.serve import serve
from ninfer.server.settings import ServerSettings

START_TIMEOUT_S = 180.0
# The parameters of the weather and clock tools every API's tests declare (in its own shape).
CITY_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


class ServerThread:
    """One server in a background thread; `base_url` once `start()` returned."""

    def __init__(self, settings: ServerSettings, model, *, runner=None):
        self.settings = settings
        self._model = model
        self._runner = runner
        self._ready: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._token = None
        self._scope: trio.CancelScope | None = None
        self._shutdown: trio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="ninfer-test-server", daemon=True)
        self.host = ""
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    def start(self) -> ServerThread:
        self._thread.start()
        item = self._ready.get(timeout=START_TIMEOUT_S)
        if isinstance(item, BaseException):
            raise item
        self.host, self.port = item
        return self

    def stop(self) -> None:
        """Cancel the server at once and wait for its thread."""
        if self._token is not None and self._thread.is_alive():
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._scope.cancel, trio_token=self._token)
        self._thread.join(timeout=60)
        if self._error is not None:
            raise self._error

    def shutdown(self) -> None:
        """Ask for a graceful shutdown (as SIGTERM does); returns at once."""
        trio.from_thread.run_sync(self._shutdown.set, trio_token=self._token)

    def join(self, timeout_s: float) -> bool:
        """Wait for the server to exit on its own; True when it did."""
        self._thread.join(timeout=timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as e:  # reported to the test thread
            self._error = e
            self._ready.put(e)

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._shutdown = trio.Event()
        async with trio.open_nursery() as nursery:
            self._scope = nursery.cancel_scope
            start = functools.partial(serve, self.settings, model=self._model, runner=self._runner,
                                      shutdown_trigger=self._shutdown.wait, handle_signals=False)  # fmt: skip
            address = await nursery.start(start)
            self._ready.put(address)

    # ---- clients -------------------------------------------------------------------------

    def openai(self, api_key: str = "none", **kwargs):
        import openai

        return openai.OpenAI(base_url=self.url("/v1"), api_key=api_key, max_retries=0, timeout=120, **kwargs)

    def anthropic(self, api_key: str = "none", **kwargs):
        import anthropic

        return anthropic.Anthropic(base_url=self.base_url, api_key=api_key, max_retries=0, timeout=120, **kwargs)

    def http(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, **{"timeout": 120, **kwargs})


@contextlib.contextmanager
def running_server(settings: ServerSettings, model, *, runner=None):
    """A started ServerThread, stopped when the block ends."""
    server = ServerThread(settings, model, runner=runner).start()
    try:
        yield server
    finally:
        server.stop()


def metric_values(text: str) -> dict[str, float]:
    """Prometheus text -> {"name{label=value,...}": value} (labels sorted), via the official parser."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


# Flags in the CLI's units, as the field of the object that declares them takes them.
_CLI_UNITS = {
    "max_pending_requests": lambda v: ("max_pending", v),
    "pending_timeout_ms": lambda v: ("pending_timeout_s", v / 1000.0),
    "host_cache_mib": lambda v: ("host_cache_bytes", int(v * (1 << 20))),
    "prefix_reuse": lambda v: ("prefix_cache", v),
}


def small_settings(**overrides) -> ServerSettings:
    """Settings for tests: any free port, the reference backend, a short context.

    `overrides` are flat, by option (`max_context=512`, `activations="q8"`, `api_keys=(...)`,
    `host_cache_mib=6`): each goes to the object that declares it (RuntimeOptions,
    EngineConfig, SamplingParams or ServerSettings itself), as `ninfer serve`'s flags do.
    """
    import attrs

    from ninfer.core.params import SamplingParams
    from ninfer.runtime import RuntimeOptions
    from ninfer.sched.config import EngineConfig

    fields = {"port": 0, "backend": "reference", "max_context": 256, "kv_capacity": 2048, "keepalive_s": 1.0,
              "shutdown_grace_s": 2.0, "log_level": "warning"}  # fmt: skip
    fields.update(overrides)
    parts: dict[type, dict] = {RuntimeOptions: {}, EngineConfig: {}, SamplingParams: {}, ServerSettings: {}}
    for name, value in fields.items():
        name, value = _CLI_UNITS[name](value) if name in _CLI_UNITS else (name, value)
        owner = next(cls for cls in parts if name in attrs.fields_dict(cls))
        parts[owner][name] = value
    return ServerSettings(
        runtime=RuntimeOptions(**parts[RuntimeOptions]), engine=EngineConfig(**parts[EngineConfig]),
        sampling=SamplingParams(**parts[SamplingParams]), **parts[ServerSettings],
    )  # fmt: skip
