"""The Ray Serve application: an HTTP ingress in front of N engine replicas.

    client --HTTP--> Serve proxy --> Ingress --handle (PrefixAwareRouter)--> EngineReplica
                                                                              `-- ninfer serve (child process)

`EngineReplica` runs one `ninfer serve` on a loopback port (`engine.EngineProcess`) and relays
requests to it byte for byte: the first item it yields is the status and headers, the rest the
body as it arrives, so SSE streams pass through unchanged. Its `check_health` fails once the
engine process is gone or `/health` is not 200, and Serve replaces the replica. A stream whose
engine dies ends with an error event in its API's shape (OpenAI `data: {"error": ...}`,
Anthropic `event: error`); a request that finds no engine gets a 503 in its shape.

`Ingress` computes each request's route key (`prompt_keys.PromptKeyer`: the prompt rendered
and tokenized as a replica would, hashed into the prefix cache's page key) and calls the replicas'
handle, whose `PrefixAwareRouter` picks the replica. It serves three routes of its own:
`/metrics` (every replica's metrics labelled `replica="..."`, plus the router's counters),
`/cluster/replicas` (id, engine pid and health of each replica) and everything else is relayed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import attrs
from ray import serve

from ninfer.cluster.engine import EngineProcess
from ninfer.cluster.metrics_text import merge_expositions
from ninfer.cluster.prompt_keys import PromptKeyer, serve_page_size
from ninfer.cluster.routing import DEFAULT_ROUTE_PAGES
from ninfer.protocols.errors import ApiError, ErrorKind
from ninfer.protocols.sse import sse_event

log = logging.getLogger(__name__)

# Headers one HTTP hop owns: never relayed.
_HOP_HEADERS = frozenset(("host", "content-length", "connection", "keep-alive", "transfer-encoding", "te",
                          "upgrade", "date", "server"))  # fmt: skip
ANTHROPIC_PREFIXES = ("/v1/messages",)
REPLICA_HEADER = "x-ninfer-replica"


@attrs.frozen(kw_only=True)
class ClusterOptions:
    """What `ninfer cluster` deploys; validated by the CLI."""

    model: str | None = None
    serve_flags: tuple[str, ...] = ()
    backend: str = "reference"
    num_replicas: int = 2
    min_replicas: int | None = None  # both set: autoscale on ongoing requests per replica
    max_replicas: int | None = None
    target_ongoing_requests: float = 8.0
    num_gpus_per_replica: float = 0.0
    num_cpus_per_replica: float = 1.0
    max_ongoing_requests: int = 72  # ninfer serve's lanes (8) + pending queue (64)
    spill_threshold: int | None = 8
    route_pages: int = DEFAULT_ROUTE_PAGES  # a route key reaches this many KV pages at most
    health_check_period_s: float = 2.0
    start_timeout_s: float = 600.0


def api_error_body(path: str, error: ApiError) -> tuple[int, dict[str, Any]]:
    return error.anthropic() if path.startswith(ANTHROPIC_PREFIXES) else error.openai()


def error_frame(path: str, error: ApiError) -> bytes:
    """A mid-stream failure as the API's own SSE error event."""
    _, body = api_error_body(path, error)
    return sse_event(body, "error") if path.startswith(ANTHROPIC_PREFIXES) else sse_event(body)


def _relayed(headers) -> list[tuple[str, str]]:
    return [(k, v) for k, v in headers if k.lower() not in _HOP_HEADERS]


def _engine_gone(what: str) -> ApiError:
    return ApiError(ErrorKind.UNAVAILABLE, f"The replica's engine {what}; retry the request.")


class EngineReplica:
    """One ninfer engine behind a Serve replica."""

    def __init__(self, options: ClusterOptions):
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.engine = EngineProcess(options.model, options.serve_flags, backend=options.backend)
        self.engine.wait_ready(options.start_timeout_s)
        self._session = None

    def _http(self):
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=None),
                                                  auto_decompress=False)  # fmt: skip
        return self._session

    async def check_health(self) -> None:
        if not self.engine.is_alive():
            raise RuntimeError(f"replica {self.replica_id}: the engine process exited")
        status = await asyncio.to_thread(self.engine.health_status)
        if status != 200:
            raise RuntimeError(f"replica {self.replica_id}: the engine's /health answered {status}")

    def info(self, target_replica: str | None = None) -> dict[str, Any]:
        return {"replica": self.replica_id, "engine_pid": self.engine.pid, "engine_alive": self.engine.is_alive()}

    async def metrics(self, headers: list[tuple[str, str]], target_replica: str | None = None) -> tuple[int, str]:
        import aiohttp

        try:
            async with self._http().get(self.engine.url + "/metrics", headers=_relayed(headers)) as response:
                return response.status, await response.text()
        except aiohttp.ClientError:
            return 503, ""

    async def forward(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes,
                      route_key: bytes | None = None):  # fmt: skip
        """Yields {"status", "headers", "replica"} first, then the body's bytes as they come."""
        import aiohttp

        route = path.split("?", 1)[0]
        try:
            response = await self._http().request(method, self.engine.url + path, headers=_relayed(headers),
                                                  data=body or None, allow_redirects=False)  # fmt: skip
        except aiohttp.ClientError:
            status, payload = api_error_body(route, _engine_gone("is not running"))
            yield {"status": status, "headers": [("content-type", "application/json")], "replica": self.replica_id}
            yield json.dumps(payload).encode()
            return
        try:
            yield {"status": response.status, "headers": _relayed(response.headers.items()), "replica": self.replica_id}
            is_sse = response.headers.get("content-type", "").startswith("text/event-stream")
            try:
                async for chunk in response.content.iter_any():
                    yield chunk
            except (aiohttp.ClientError, asyncio.TimeoutError):
                log.warning("replica %s: the engine failed mid-response on %s", self.replica_id, route)
                if is_sse:
                    yield error_frame(route, _engine_gone("failed while streaming"))
        finally:
            response.release()

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop()


class Ingress:
    """The cluster's HTTP front: routes of its own, everything else relayed to a replica."""

    def __init__(self, replicas, options: ClusterOptions):
        self.replicas = replicas
        self.options = options
        # The replicas' tokenizer and chat template (GGUF: metadata only), read once.
        self.keyer = PromptKeyer.load(options.model, options.backend, page_size=serve_page_size(options.serve_flags),
                                      route_pages=options.route_pages)  # fmt: skip

    async def __call__(self, request):
        from starlette.responses import JSONResponse, PlainTextResponse

        path = request.url.path
        if path == "/metrics" and request.method == "GET":
            status, text = await self._metrics(request)
            return PlainTextResponse(text, status_code=status, media_type="text/plain; version=0.0.4")
        if path == "/cluster/replicas" and request.method == "GET":
            return JSONResponse({"replicas": await self._replica_infos()})
        return await self._relay(request)

    async def _relay(self, request):
        from starlette.responses import JSONResponse, StreamingResponse

        path = request.url.path
        target = path + (f"?{request.url.query}" if request.url.query else "")
        body = await request.body()
        key = None
        if request.method == "POST" and body:  # templating and tokenizing: off the event loop
            key = await asyncio.to_thread(self.keyer.route_key, path, body)
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw]
        stream = self.replicas.options(stream=True).forward.remote(request.method, target, headers, body,
                                                                   route_key=key)  # fmt: skip
        try:
            head = await stream.__anext__()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # no replica could take it, or it died before answering
            log.warning("no replica answered %s %s: %r", request.method, path, exc)
            status, payload = api_error_body(path, _engine_gone("did not answer"))
            return JSONResponse(payload, status_code=status)
        response_headers = dict(head["headers"])
        response_headers[REPLICA_HEADER] = head["replica"]
        is_sse = response_headers.get("content-type", response_headers.get("Content-Type", "")).startswith(
            "text/event-stream")  # fmt: skip
        return StreamingResponse(self._rest(stream, path, is_sse), status_code=head["status"],
                                 headers=response_headers)  # fmt: skip

    async def _rest(self, stream, path: str, is_sse: bool):
        try:
            async for chunk in stream:
                yield chunk
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the replica itself died mid-stream
            log.warning("a replica failed mid-response on %s: %r", path, exc)
            if is_sse:
                yield error_frame(path, _engine_gone("failed while streaming"))

    async def _router(self):
        from ninfer.cluster.router import live_routers

        for _ in range(100):
            routers = [r for r in live_routers() if r.replica_ids()]
            if routers:
                return routers[0]
            await self.replicas.info.remote()  # the first call creates the handle's router
            await asyncio.sleep(0.05)
        raise RuntimeError("the replicas' router never saw a replica")

    async def _replica_infos(self) -> list[dict[str, Any]]:
        router = await self._router()
        infos = []
        for rid in router.replica_ids():  # one at a time: see _pinned
            try:
                infos.append(await self._pinned(self.replicas.info, rid))
            except Exception as exc:  # a replica being replaced
                infos.append({"replica": rid, "error": repr(exc)})
        return infos

    async def _pinned(self, method, rid: str, *args):
        # Calls made while serving one HTTP request share its internal request id, and Serve
        # fulfils a routed call by that id: concurrent pinned calls would take each other's
        # replicas (and one would never be routed). So they go one at a time, with a deadline.
        return await asyncio.wait_for(method.remote(*args, target_replica=rid), 10.0)

    async def _metrics(self, request) -> tuple[int, str]:
        router = await self._router()
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw]
        ids = router.replica_ids()
        texts, statuses = {}, []
        for rid in ids:
            try:
                answer = await self._pinned(self.replicas.metrics, rid, headers)
            except Exception:  # a replica being replaced: its metrics are left out
                continue
            if isinstance(answer, tuple):
                statuses.append(answer[0])
                if answer[0] == 200:
                    texts[rid] = answer[1]
        if statuses and all(s in (401, 403) for s in statuses):
            return statuses[0], ""
        routed = router.counters.statistics()
        lines = ["# HELP ninfer_cluster_routed_total Requests the router sent to a replica, by reason.",
                 "# TYPE ninfer_cluster_routed_total counter"]  # fmt: skip
        lines += [f'ninfer_cluster_routed_total{{reason="{reason}"}} {n}' for reason, n in routed.items()]
        lines += ["# HELP ninfer_cluster_replicas Replicas the router can send to.",
                  "# TYPE ninfer_cluster_replicas gauge", f"ninfer_cluster_replicas {len(ids)}"]  # fmt: skip
        return 200, merge_expositions(texts) + "\n".join(lines) + "\n"


def build_app(options: ClusterOptions):
    """The bound application `serve.run` deploys."""
    from ray.serve.config import RequestRouterConfig

    scaling: dict[str, Any] = {"num_replicas": options.num_replicas}
    if options.min_replicas is not None and options.max_replicas is not None:
        scaling = {"autoscaling_config": {"min_replicas": options.min_replicas, "max_replicas": options.max_replicas,
                                          "target_ongoing_requests": options.target_ongoing_requests}}  # fmt: skip
    replica = serve.deployment(EngineReplica, name="ninfer-engine").options(
        **scaling,
        max_ongoing_requests=options.max_ongoing_requests,
        health_check_period_s=options.health_check_period_s,
        health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=5.0,
        ray_actor_options={"num_cpus": options.num_cpus_per_replica, "num_gpus": options.num_gpus_per_replica},
        request_router_config=RequestRouterConfig(
            request_router_class="ninfer.cluster.router.PrefixAwareRouter",
            request_router_kwargs={"spill_threshold": options.spill_threshold},
        ),
    )  # fmt: skip
    ingress = serve.deployment(Ingress, name="ninfer-ingress").options(
        num_replicas=1, max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0},
    )  # fmt: skip
    return ingress.bind(replica.bind(options), options)
