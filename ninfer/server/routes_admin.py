"""The operator's routes: llama.cpp's `GET /props`, and the admin endpoints (behind the API key
when one is set, as every route but /health and the web pages).

- `GET /admin/stats`: the engine's cumulative counters and gauges, requests by outcome, and
  the host seconds the step task spent per phase (`ninfer.sched.stats.STEP_PHASES`).
- `GET /admin/vram`: the memory plan against the device's real figures (`memory.py`),
  measured in the background: never waits for the device or the step task; says its age.
- `GET /admin/live`: the dashboard's figures (`live.py`): gauges, rates, latencies, requests in
  flight (never their text), a few minutes of history.
- `POST /admin/quiesce {"hold_ms", "timeout_ms"}`: drain the engine (new requests wait, running
  ones finish) and hold it idle for `hold_ms`; answers once drained, with the drain time. 409
  while already quiesced, or when the drain takes longer than `timeout_ms` (default 30 s).
- `POST /admin/resume`: end a hold early.
"""

from __future__ import annotations

import importlib.metadata
import time

import attrs
from quart import request

from ninfer.protocols.errors import ApiError, ErrorKind
from ninfer.server.http_io import json_response, read_json
from ninfer.server.live import LiveHistory
from ninfer.server.memory import MemoryMonitor
from ninfer.server.quiesce import QuiesceConflict, Quiescer
from ninfer.server.settings import ServerSettings

MAX_HOLD_MS = 3_600_000
MAX_DRAIN_MS = 600_000
DEFAULT_DRAIN_MS = 30_000


@attrs.frozen(kw_only=True)
class AdminContext:
    """What the admin routes read besides the service: built by `serve` with the engine."""

    backend: str  # "cuda" or "reference"
    memory: MemoryMonitor
    history: LiveHistory
    quiescer: Quiescer
    started_unix_s: float = attrs.field(factory=time.time)


def register(app, service, settings: ServerSettings, admin: AdminContext) -> None:
    async def props():
        return json_response(_props(service, settings, admin))

    async def stats():
        return json_response(_stats(service, admin))

    async def vram():
        return json_response(admin.memory.snapshot())

    async def live():
        return json_response(_live(service, admin))

    async def quiesce():
        hold_ms, timeout_ms = _quiesce_body(await read_json(request))
        try:
            done = await admin.quiescer.quiesce(hold_ms / 1000.0, timeout_ms / 1000.0)
        except QuiesceConflict as e:
            return _conflict(str(e))
        return json_response({"quiesced": True, "drain_ms": round(done.drain_s * 1000.0, 3), "hold_ms": hold_ms,
                              "held_until_unix_s": round(done.held_until_unix_s, 3)})  # fmt: skip

    async def resume():
        return json_response({"resumed": admin.quiescer.resume()})

    app.add_url_rule("/props", "props", props, methods=["GET"])
    app.add_url_rule("/admin/stats", "admin_stats", stats, methods=["GET"])
    app.add_url_rule("/admin/vram", "admin_vram", vram, methods=["GET"])
    app.add_url_rule("/admin/live", "admin_live", live, methods=["GET"])
    app.add_url_rule("/admin/quiesce", "admin_quiesce", quiesce, methods=["POST"])
    app.add_url_rule("/admin/resume", "admin_resume", resume, methods=["POST"])


# ---- /props ------------------------------------------------------------------------------


def _props(service, settings: ServerSettings, admin: AdminContext) -> dict:
    """llama-server's /props, with the fields that mean something here (docs/serving.md)."""
    model, sampling = service.model, service.defaults.sampling
    template = model.chat_template
    stats = service.statistics()
    params = {
        "n_predict": service.defaults.max_tokens or -1, "temperature": sampling.temperature,
        "top_k": sampling.top_k, "top_p": sampling.top_p, "min_p": sampling.min_p,
        "repeat_penalty": sampling.repetition_penalty, "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty, "seed": -1, "stop": [],
    }  # fmt: skip
    return {
        "default_generation_settings": {
            "id": 0, "id_task": -1, "n_ctx": service.max_context, "speculative": False,
            "is_processing": bool(stats.num_running or stats.num_waiting or stats.num_paused), "params": params,
        },
        "total_slots": stats.num_lanes, "n_ctx": service.max_context,
        "model_alias": service.model_id, "model_aliases": list(service.served_names), "model_path": str(model.path),
        "modalities": {"vision": False, "audio": False},
        "chat_template": template.source if template is not None else "",
        "bos_token": (template.bos_token if template is not None else None) or "",
        "eos_token": (template.eos_token if template is not None else None) or "",
        "build_info": f"ninfer {_version()}", "backend": admin.backend, "webui": settings.webui,
    }  # fmt: skip


def _version() -> str:
    try:
        return importlib.metadata.version("ninfer")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# ---- /admin/stats and /admin/live --------------------------------------------------------


def _stats(service, admin: AdminContext) -> dict:
    stats = attrs.asdict(service.statistics())
    phases = stats.pop("step_phase_s")
    outcomes = stats.pop("requests_by_outcome")
    return {
        "uptime_s": round(time.time() - admin.started_unix_s, 3), "model": service.model_id,
        "backend": admin.backend, "engine": stats, "requests_by_outcome": outcomes,
        "step_phase_s": {name: round(seconds, 6) for name, seconds in phases.items()},
        "quiesced": admin.quiescer.is_quiesced, "requests_held": service.gate.num_held,
    }  # fmt: skip


def _live(service, admin: AdminContext) -> dict:
    s = service.statistics()
    latest = admin.history.latest
    ttft_ms, itl_ms = service.live.latencies_ms()
    memory = admin.memory.snapshot()
    return {
        "time_unix_s": round(time.time(), 3), "model": service.model_id, "backend": admin.backend,
        "healthy": s.is_healthy, "quiesced": admin.quiescer.is_quiesced,
        "held_until_unix_s": admin.quiescer.held_until_unix_s,
        "requests": {"running": s.num_running, "waiting": s.num_waiting, "paused": s.num_paused,
                     "held": service.gate.num_held},
        "lanes": s.num_lanes,
        "tokens_per_s": {"generated": latest.get("gen_tps", 0.0), "prefilled": latest.get("prefill_tps", 0.0)},
        "latency_ms": {"ttft": ttft_ms, "inter_token": itl_ms},
        "kv_pages": {"capacity": s.num_pages_capacity, "used": s.num_pages_used, "active": s.num_pages_active,
                     "cached": s.num_prefix_cache_pages, "free": s.num_pages_free},
        "host_tier": {"prefix_pages": s.num_prefix_host_pages, "prefix_bytes": s.prefix_host_bytes,
                      "snapshot_bytes": s.host_snapshot_bytes},
        "totals": {"generated_tokens": s.num_generated_tokens, "prefill_tokens": s.num_prefill_tokens,
                   "steps": s.num_steps, "preemptions": s.num_preemptions,
                   "snapshot_restores": s.num_snapshot_restores, "replay_restores": s.num_replay_restores},
        "memory": {"device": memory.get("device"), "used_bytes": memory.get("used_bytes"),
                   "total_bytes": memory.get("total_bytes"), "age_s": memory.get("age_s")},
        "in_flight": service.live.rows(),
        "history": list(admin.history.samples),
    }  # fmt: skip


# ---- /admin/quiesce ----------------------------------------------------------------------


def _quiesce_body(body) -> tuple[float, float]:
    if not isinstance(body, dict):
        raise ApiError(ErrorKind.INVALID_REQUEST, "The body must be a JSON object such as {\"hold_ms\": 1000}.")
    unknown = sorted(set(body) - {"hold_ms", "timeout_ms"})
    if unknown:
        raise ApiError(ErrorKind.INVALID_REQUEST, f"Unknown field '{unknown[0]}'.", unknown[0], "invalid_value")
    hold_ms = _number(body, "hold_ms", 0, 0, MAX_HOLD_MS)
    timeout_ms = _number(body, "timeout_ms", DEFAULT_DRAIN_MS, 1, MAX_DRAIN_MS)
    return hold_ms, timeout_ms


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ApiError(ErrorKind.INVALID_REQUEST, f"{name} must be a number from {low:g} to {high:g}, got {value!r}.",
                       name, "invalid_value")  # fmt: skip
    return value


def _conflict(message: str):
    return json_response({"error": {"message": message, "type": "conflict_error", "param": None,
                                    "code": "quiesce_conflict"}}, 409)  # fmt: skip
