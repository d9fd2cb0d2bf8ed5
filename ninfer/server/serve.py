"""`serve(settings, task_status=...)`: load the model, run the engine, serve HTTP until told to stop.

    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(serve, ServerSettings(port=0))

reports the bound address once the server is ready. The socket listens from the start: while
the model loads and the runner compiles its kernels and captures every batch shape (CUDA),
`/health` answers 503 `{"status": "loading", "stage": ...}` and every other route 503 in its
API's own error shape, so the first real request never waits for a compilation. Shutdown: SIGINT / SIGTERM (when running in
the main thread) or `shutdown_trigger` returning. Hypercorn then stops accepting connections;
queued requests are answered 503 at once; running requests and streams get
`settings.shutdown_grace_s`, after which the engine cancels them, so each stream still ends
with its API's error event (the server is shutting down) before it closes. Hypercorn cancels
whatever is left a second later; the service, engine and runner close after it. A second
signal cancels at once.

A client that takes no data for `settings.send_timeout_s` is dropped by the kernel
(TCP_USER_TIMEOUT on the listening socket, which accepted sockets inherit): its connection
closes, its request is cancelled and its buffers are freed.
"""

from __future__ import annotations

import functools
import logging
import signal
import socket
import threading
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

import attrs
import trio

from ninfer.server import heap
from ninfer.server.settings import MIB, ServerSettings

log = logging.getLogger(__name__)

_FINAL_EVENTS_S = 1.0


async def serve(
    settings: ServerSettings, *, model=None, runner=None,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    handle_signals: bool | None = None,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:  # fmt: skip
    """Serve until shutdown.

    The socket listens first; while the model loads and the runner warms up, `/health` is 503
    `{"status": "loading"}` and every other route 503 in its API's shape (readiness.py).
    `task_status` reports the address once the server is ready.
    `model` (a LoadedModel) skips loading `settings.model`; `runner` (a Runner for that model,
    which the caller then owns and closes) skips creating one from the settings.
    `handle_signals` None means: only when running in the main thread (where trio can).
    """
    from ninfer.server.readiness import ReadinessSwitch

    if handle_signals is None:
        handle_signals = threading.current_thread() is threading.main_thread()
    switch = ReadinessSwitch()
    shutdown = trio.Event()
    try:
        await _serve(settings, model, runner, switch, shutdown, shutdown_trigger, handle_signals, task_status)
    except BaseExceptionGroup as group:  # a failure to start (a bad model, say) is raised as itself
        leaves = _leaves(group)
        if len(leaves) == 1:
            raise leaves[0] from None
        raise


async def _serve(settings, model, runner, switch, shutdown, shutdown_trigger, handle_signals, task_status) -> None:
    import hypercorn.trio

    async with trio.open_nursery() as nursery:
        if handle_signals:
            nursery.start_soon(_watch_signals, shutdown, nursery.cancel_scope)
        if shutdown_trigger is not None:
            nursery.start_soon(_set_after, shutdown_trigger, shutdown)

        async def run_hypercorn(*, task_status):
            await hypercorn.trio.serve(switch, _hypercorn_config(settings), shutdown_trigger=shutdown.wait,
                                       task_status=task_status)  # fmt: skip
            nursery.cancel_scope.cancel()  # stop the engine too once the server has drained

        binds = await nursery.start(run_hypercorn)
        address = _address_of(binds[0])
        log.info("listening on http://%s:%d (answering 503 'loading' until the model is ready)", *address)
        await nursery.start(_run_engine, settings, model, runner, switch, shutdown)
        log.info("serving on http://%s:%d", *address)
        task_status.started(address)


async def _run_engine(settings: ServerSettings, model, runner, switch, shutdown: trio.Event, *, task_status) -> None:
    """Load, create and warm the runner, open the engine and the app, then serve until cancelled."""
    from ninfer.runtime import config_for_model, create_runner, kernel_cache_summary, load, warm_up

    owns_runner = runner is None
    if model is None:
        switch.stage = "loading the model"
        model = await trio.to_thread.run_sync(functools.partial(load, settings.model, progress=True),
                                              abandon_on_cancel=True)  # fmt: skip
    if owns_runner:
        switch.stage = "creating the runner"
        runner, backend, config = await trio.to_thread.run_sync(create_runner, model, settings.runtime, settings.engine,
                                                                abandon_on_cancel=True)  # fmt: skip
    else:  # its pages are the KV capacity: settings.engine.kv_capacity sizes runners built here
        backend, config = None, config_for_model(model, attrs.evolve(settings.engine, kv_capacity=None))
    try:
        if owns_runner:
            cache = f"prefix cache on, host tier {config.host_cache_bytes / MIB:g} MiB" if config.prefix_cache else "prefix cache off"
            log.info("model %s on the %s backend, %d KV pages of %d tokens, %s", model.name, backend, runner.num_pages,
                     config.page_size, cache)  # fmt: skip
            switch.stage = "compiling kernels and capturing graphs"
            seconds = await trio.to_thread.run_sync(functools.partial(warm_up, runner, backend, config, progress=True),
                                                    abandon_on_cancel=True)  # fmt: skip
            if seconds is not None and backend == "cuda":
                log.info("warmed up every batch shape in %.1f s (%s)", seconds, kernel_cache_summary())
        switch.stage = "starting the engine"
        backend = backend or {"CudaRunner": "cuda", "CpuRunner": "cpu"}.get(type(runner).__name__, "reference")
        with heap.quiet(freeze=settings.gc_freeze, collect=owns_runner):  # the load's garbage is not frozen
            await _open_app(settings, model, runner, config, backend, switch, shutdown, task_status)
    finally:
        if owns_runner:
            runner.close()


async def _open_app(settings, model, runner, config, backend: str, switch, shutdown: trio.Event, task_status) -> None:
    from ninfer.sched.engine import open_engine
    from ninfer.server.app import create_app
    from ninfer.server.live import LiveHistory
    from ninfer.server.memory import MemoryMonitor
    from ninfer.server.metrics import ServerMetrics
    from ninfer.server.quiesce import Quiescer
    from ninfer.server.routes_admin import AdminContext
    from ninfer.server.service import ServiceDefaults, open_service

    engines = []
    metrics = ServerMetrics(lambda: engines[0].statistics())
    async with open_engine(config, runner, model.tokenizer, stop_token_ids=model.stop_token_ids,
                           observer=metrics.observe_record) as engine:  # fmt: skip
        engines.append(engine)
        defaults = ServiceDefaults(max_tokens=settings.default_max_tokens, sampling=settings.sampling)
        async with open_service(engine, model, max_context=engine.max_context, model_id=settings.model_id,
                                defaults=defaults, keepalive_s=settings.keepalive_s,
                                frame_gap_s=settings.frame_gap_us * 1e-6,
                                aliases=settings.served_model_names) as service:  # fmt: skip
            memory = MemoryMonitor(runner, backend, reserve_bytes=settings.runtime.reserve_bytes,
                                   host_cache_bytes=config.host_cache_bytes if config.prefix_cache else 0)  # fmt: skip
            history = LiveHistory(engine.statistics, service.live,
                                  lambda: {"held": service.gate.num_held, "memory_used": memory.used_bytes})  # fmt: skip
            async with trio.open_nursery() as nursery:
                admin = AdminContext(backend=backend, memory=memory, history=history,
                                     quiescer=Quiescer(service.gate, nursery))  # fmt: skip
                app = create_app(service, settings, metrics, admin)
                await nursery.start(memory.run)
                nursery.start_soon(history.run)
                await nursery.start(switch.run_app, app)
                nursery.start_soon(_end_requests_on_shutdown, shutdown, service, settings.shutdown_grace_s)
                task_status.started()


async def _end_requests_on_shutdown(shutdown: trio.Event, service, grace_s: float) -> None:
    await shutdown.wait()
    service.drain()
    await trio.sleep(grace_s)
    log.warning("shutdown grace period over: cancelling the requests still running")
    service.cancel_all()


def _hypercorn_config(settings: ServerSettings):
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"fd://{_listening_socket(settings).detach()}"]
    # The engine ends what still runs at the grace period's end; its streams get this margin
    # to send their final error events before hypercorn cancels them.
    config.graceful_timeout = settings.shutdown_grace_s + _FINAL_EVENTS_S
    config.accesslog = logging.getLogger("ninfer.access") if settings.log_level == "debug" else None
    config.errorlog = _hypercorn_error_log()
    config.include_server_header = False
    return config


def _hypercorn_error_log() -> logging.Logger:
    errorlog = logging.getLogger("hypercorn.error")
    if not any(isinstance(f, _OneLineDisconnects) for f in errorlog.filters):
        errorlog.addFilter(_OneLineDisconnects())
    return errorlog


class _OneLineDisconnects(logging.Filter):
    """A client that hangs up while its answer is written (after a body timeout, say) makes
    hypercorn log a 35-line traceback of trio's stream errors; one line says the same."""

    _GONE = (trio.BusyResourceError, trio.BrokenResourceError, trio.ClosedResourceError)

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is None or not _only(error, self._GONE):
            return True
        record.msg, record.args = "a client hung up while its answer was being sent (%s)", (type(_leaf(error)).__name__,)
        record.exc_info, record.exc_text = None, None
        record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def _only(error: BaseException, kinds: tuple[type[BaseException], ...]) -> bool:
    if isinstance(error, BaseExceptionGroup):
        return all(_only(e, kinds) for e in error.exceptions)
    return isinstance(error, kinds)


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for e in error.exceptions for leaf in _leaves(e)]
    return [error]


def _leaf(error: BaseException) -> BaseException:
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


def _listening_socket(settings: ServerSettings) -> socket.socket:
    """The bound (not yet listening) socket hypercorn serves, with the send timeout set."""
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if hasattr(socket, "TCP_USER_TIMEOUT"):  # Linux; elsewhere slow readers are not dropped
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(settings.send_timeout_s * 1000))
        sock.bind((settings.host, settings.port))
    except BaseException:
        sock.close()
        raise
    return sock


def _address_of(bind: str) -> tuple[str, int]:
    parts = urlsplit(bind)
    return parts.hostname or "", parts.port or 0


async def _set_after(trigger: Callable[[], Awaitable[None]], event: trio.Event) -> None:
    await trigger()
    event.set()


async def _watch_signals(shutdown: trio.Event, scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            if shutdown.is_set():
                log.warning("second %s: cancelling now", signal.Signals(signum).name)
                scope.cancel()
                return
            log.warning("%s: shutting down (in-flight requests get a grace period)", signal.Signals(signum).name)
            shutdown.set()
