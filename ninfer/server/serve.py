"""`serve(settings, task_status=...)`: load the model, run the engine, serve HTTP until told to stop.

    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(serve, ServerSettings(port=0))

reports the bound address once the socket listens. Shutdown: SIGINT / SIGTERM (when running in
the main thread) or `shutdown_trigger` returning. Hypercorn then stops accepting connections,
lets in-flight requests and streams run for `settings.shutdown_grace_s`, and cancels what is
left; the service, engine and runner close after it. A second signal cancels at once.
"""

from __future__ import annotations

import functools
import logging
import signal
import threading
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

import trio

from ninfer.server.settings import ServerSettings

log = logging.getLogger(__name__)


async def serve(
    settings: ServerSettings, *, model=None, runner=None,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    handle_signals: bool | None = None,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:  # fmt: skip
    """Serve until shutdown.

    `model` (a LoadedModel) skips loading `settings.model`; `runner` (a Runner for that model,
    which the caller then owns and closes) skips creating one from the settings.
    `handle_signals` None means: only when running in the main thread (where trio can).
    """
    from ninfer.runtime import create_runner, effective_max_context, load

    if model is None:
        model = await trio.to_thread.run_sync(functools.partial(load, settings.model, progress=True))
    options = settings.runtime_options()
    if runner is not None:
        max_context = effective_max_context(model, options)
        await _serve_with_runner(settings, model, runner, max_context, shutdown_trigger, handle_signals, task_status)
        return
    runner, backend, max_context = await trio.to_thread.run_sync(create_runner, model, options)
    cache = f"prefix cache on, host tier {settings.host_cache_mib:g} MiB" if settings.prefix_reuse else "prefix cache off"
    log.info("model %s on the %s backend, %d KV pages of %d tokens, %s", model.name, backend, runner.num_pages,
             settings.page_size, cache)  # fmt: skip
    try:
        await _serve_with_runner(settings, model, runner, max_context, shutdown_trigger, handle_signals, task_status)
    finally:
        runner.close()


async def _serve_with_runner(settings, model, runner, max_context, shutdown_trigger, handle_signals, task_status):
    from ninfer.sched.engine import EngineConfig, open_engine
    from ninfer.server.app import create_app
    from ninfer.server.metrics import ServerMetrics
    from ninfer.server.service import ServiceDefaults, open_service

    engines = []
    metrics = ServerMetrics(lambda: engines[0].statistics())
    config = EngineConfig(max_context=max_context, page_size=settings.page_size, **settings.engine_fields())
    async with open_engine(config, runner, model.tokenizer, stop_token_ids=model.stop_token_ids,
                           observer=metrics.observe_record) as engine:  # fmt: skip
        engines.append(engine)
        defaults = ServiceDefaults(max_tokens=settings.default_max_tokens, sampling=settings.sampling_defaults())
        async with open_service(engine, model, max_context=engine.max_context, model_id=settings.model_id,
                                defaults=defaults, keepalive_s=settings.keepalive_s) as service:  # fmt: skip
            app = create_app(service, settings, metrics)
            await _run_http(app, settings, shutdown_trigger, handle_signals, task_status)


async def _run_http(app, settings: ServerSettings, shutdown_trigger, handle_signals, task_status) -> None:
    import hypercorn.trio

    if handle_signals is None:
        handle_signals = threading.current_thread() is threading.main_thread()
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        if handle_signals:
            nursery.start_soon(_watch_signals, shutdown, nursery.cancel_scope)
        if shutdown_trigger is not None:
            nursery.start_soon(_set_after, shutdown_trigger, shutdown)

        async def run_hypercorn(*, task_status):
            await hypercorn.trio.serve(app, _hypercorn_config(settings), shutdown_trigger=shutdown.wait,
                                       task_status=task_status)  # fmt: skip
            nursery.cancel_scope.cancel()  # stop the signal watcher once the server has drained

        binds = await nursery.start(run_hypercorn)
        address = _address_of(binds[0])
        log.info("serving on http://%s:%d", *address)
        task_status.started(address)


def _hypercorn_config(settings: ServerSettings):
    from hypercorn.config import Config

    config = Config()
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    config.bind = [f"{host}:{settings.port}"]
    config.graceful_timeout = settings.shutdown_grace_s
    config.accesslog = logging.getLogger("ninfer.access") if settings.log_level == "debug" else None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.include_server_header = False
    return config


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
