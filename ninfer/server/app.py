"""The Quart-Trio application: cross-cutting HTTP behaviour and the small routes.

Every request gets an `x-request-id` (the client's, when it sent a sane one). Before any
route runs: CORS preflights are answered, bodies over `--max-request-mib` are refused with 413
from their Content-Length (before reading them), and, when API keys are set, every path but
`/health` needs `Authorization: Bearer KEY` or `x-api-key: KEY`; OPTIONS then gets 204 with
the route's methods. Errors that escape a route (401, 404, 405, 408, 413, 415, bad JSON,
engine errors) are rendered in the Anthropic shape under `/v1/messages`, in FastAPI's shape
(`{"detail": ...}`, a missing key 403) under `/v1/systemone` and `/systemone`, and in the
OpenAI shape everywhere else.

Routes here: GET /health, /metrics, /v1/models, /v1/models/{id}. The generation routes are
in `routes_openai`, `routes_anthropic` and `routes_responses`, the prefill-only routes (/v1/score,
/v1/rerank, /v1/embeddings) in `routes_scoring`, /v1/systemone in `routes_systemone`, /props
and /admin/* in `routes_admin`, the web pages (/, /chat, /dashboard; no key needed) in
`routes_webui`.
"""

from __future__ import annotations

import hmac
import logging
import re
import secrets

import trio
from quart import Response, current_app, g, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, MethodNotAllowed

from ninfer.protocols import systemone
from ninfer.protocols.errors import ApiError, ErrorKind
from ninfer.server import (
    routes_admin, routes_anthropic, routes_openai, routes_responses, routes_scoring, routes_systemone, routes_webui,
)  # fmt: skip
from ninfer.server.http_io import error_from_exception, http_api_error, json_response
from ninfer.server.metrics import CONTENT_TYPE, ServerMetrics
from ninfer.server.service import current_route
from ninfer.server.settings import ServerSettings

log = logging.getLogger(__name__)

ANTHROPIC_PREFIXES = ("/v1/messages",)
OPEN_PATHS = ("/health",)  # never need a key
# The routes that run the model: `ninfer_route_requests_total{route}` counts their answered requests.
API_ROUTES = frozenset((
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", routes_scoring.SCORE_ROUTE,
    routes_scoring.RERANK_ROUTE, routes_scoring.EMBEDDINGS_ROUTE, *systemone.ROUTES,
))  # fmt: skip
_CLIENT_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
# Statuses of errors raised before the route read all of the request body.
_UNREAD_BODY_STATUSES = frozenset((401, 404, 405, 408, 413, 415))
# Methods whose routes never read a request body (one sent anyway is read and dropped).
_BODYLESS_METHODS = frozenset(("GET", "HEAD", "OPTIONS", "DELETE"))


def create_app(service, settings: ServerSettings, metrics: ServerMetrics,
               admin: routes_admin.AdminContext | None = None) -> QuartTrio:  # fmt: skip
    """The app serving `service` (a GenerationService) under `settings`; `admin` adds /props
    and the /admin routes."""
    app = QuartTrio("ninfer")
    app.config["MAX_CONTENT_LENGTH"] = settings.max_request_bytes  # also caps chunked bodies
    app.config["RESPONSE_TIMEOUT"] = None  # long answers are never cut off
    app.config["BODY_TIMEOUT"] = settings.body_timeout_s
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = True
    _add_hooks(app, settings, metrics)
    _add_error_handlers(app)
    _add_basic_routes(app, service, metrics)
    for routes in (routes_openai, routes_anthropic, routes_responses):
        routes.register(app, service)
    routes_scoring.register(app, service, settings, metrics)
    routes_systemone.register(app, service, metrics)
    if admin is not None:
        routes_admin.register(app, service, settings, admin)
    if settings.webui:
        routes_webui.register(app)
    app.asgi_app = _shield_last_send(app.asgi_app)
    return app


def _shield_last_send(asgi_app):
    """The last message of each response is sent shielded from cancellation.

    Hypercorn closes a `Connection: close` connection inside that send, and the disconnect it
    reports to the app meanwhile makes quart-trio cancel the request's tasks, the send among
    them: the socket then stayed open (a client sent 408 or 413 mid-body waited forever).
    Only the final message is shielded; a client that reads nothing is bounded by the send
    timeout (TCP_USER_TIMEOUT, `serve`).
    """

    async def app(scope, receive, send):
        async def send_last_shielded(message):
            if message.get("type") == "http.response.body" and not message.get("more_body", False):
                with trio.CancelScope(shield=True):
                    await send(message)
            else:
                await send(message)

        await asgi_app(scope, receive, send_last_shielded)

    return app


def error_response(error: ApiError) -> Response:
    """An ApiError in the shape of the API the current path belongs to."""
    if systemone.is_systemone_path(request.path):
        return routes_systemone.detail_response(error)
    is_anthropic = request.path.startswith(ANTHROPIC_PREFIXES)
    status, body = error.anthropic() if is_anthropic else error.openai()
    response = json_response(body, status)
    if error.kind is ErrorKind.AUTHENTICATION:
        response.headers["WWW-Authenticate"] = "Bearer"
    return response


def _has_body() -> bool:
    return bool(request.content_length) or "chunked" in request.headers.get("transfer-encoding", "").lower()


# ---- hooks -----------------------------------------------------------------------------


def _add_hooks(app: QuartTrio, settings: ServerSettings, metrics: ServerMetrics) -> None:
    keys = tuple(k.encode() for k in settings.api_keys)
    limit = settings.max_request_bytes

    @app.before_request
    async def prepare():
        g.request_id = "req_" + secrets.token_hex(12)
        current_route.set(request.path)
        sent = request.headers.get("x-request-id", "")
        g.client_request_id = sent if _CLIENT_REQUEST_ID.match(sent) else None
        is_options = request.method == "OPTIONS" and request.url_rule is not None
        if is_options and settings.cors_origins:
            return _options_response()  # a CORS preflight: browsers send it without credentials
        length = request.content_length
        if length is not None and length > limit:
            raise ApiError(ErrorKind.REQUEST_TOO_LARGE,
                           f"The request body is {length} bytes; the limit is {limit} bytes.")  # fmt: skip
        is_open = request.path in OPEN_PATHS or (settings.webui and routes_webui.is_open_path(request.path))
        if keys and not is_open and not _has_valid_key(keys):
            if systemone.is_systemone_path(request.path) and not _sent_key():
                raise ApiError(ErrorKind.AUTHENTICATION, "Not authenticated: send the API key as "
                               "'Authorization: Bearer KEY' or 'x-api-key: KEY'.", code=systemone.MISSING_KEY_CODE)  # fmt: skip
            raise ApiError(ErrorKind.AUTHENTICATION, "Missing or invalid API key: send it as "
                           "'Authorization: Bearer KEY' or 'x-api-key: KEY'.")  # fmt: skip
        if request.method in _BODYLESS_METHODS and _has_body():
            # No route reads it: read it now. Hypercorn drops a keep-alive connection whose request
            # body is still arriving when the response ends (the next request then finds it gone).
            await request.get_data()
        if is_options:
            return _options_response()
        return None

    @app.after_request
    async def finish(response: Response) -> Response:
        response.headers["x-request-id"] = getattr(g, "client_request_id", None) or g.get("request_id", "")
        if settings.cors_origins:
            _add_cors_headers(response, settings.cors_origins)
        if response.status_code in _UNREAD_BODY_STATUSES and _has_body():
            # The body was not read (or not all of it); closing is the only way to stay in sync
            # with the client (hypercorn would wait on the unread bytes and stall the next request).
            response.headers["Connection"] = "close"
        rule = _rule_label()
        metrics.count_http(request.method, rule, response.status_code)
        if request.method == "POST" and rule in API_ROUTES and response.status_code < 400:
            metrics.count_request(rule)
        return response


def _options_response() -> Response:
    """204 with the route's methods (Quart's automatic answer is an empty 200 text/html page)."""
    response = Response(b"", status=204)
    response.headers["Allow"] = ", ".join(sorted(request.url_rule.methods or ()))
    del response.headers["Content-Type"]
    return response


def _rule_label() -> str:
    """The route a request went to, for metrics; for a 405, the route it asked the wrong method of."""
    if request.url_rule is not None:
        return request.url_rule.rule
    failure = request.routing_exception
    if isinstance(failure, MethodNotAllowed) and failure.valid_methods:
        try:
            adapter = current_app.url_map.bind(request.host)
            rule, _ = adapter.match(request.path, method=failure.valid_methods[0], return_rule=True)
            return rule.rule
        except HTTPException:
            pass
    return "unmatched"


def _has_valid_key(keys: tuple[bytes, ...]) -> bool:
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    candidates = [token.strip()] if scheme.lower() == "bearer" else []
    candidates.append(request.headers.get("x-api-key", ""))
    # compare_digest on every key: timing does not reveal which key (or prefix) matched.
    return any(hmac.compare_digest(c.encode(), k) for c in candidates if c for k in keys)


def _sent_key() -> bool:
    """Whether the request carries any key (a bearer token or x-api-key), right or wrong."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return bool((scheme.lower() == "bearer" and token.strip()) or request.headers.get("x-api-key"))


def _add_cors_headers(response: Response, origins: tuple[str, ...]) -> None:
    origin = request.headers.get("origin")
    if origin is None:
        return
    if "*" in origins:
        response.headers["Access-Control-Allow-Origin"] = "*"
    elif origin in origins:
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Vary"] = "Origin"
    else:
        return
    response.headers["Access-Control-Expose-Headers"] = "x-request-id"
    if request.method == "OPTIONS":
        wanted = request.headers.get("access-control-request-headers")
        response.headers["Access-Control-Allow-Methods"] = "GET, POST, DELETE, OPTIONS"
        response.headers["Access-Control-Allow-Headers"] = wanted or "authorization, content-type, x-api-key"
        response.headers["Access-Control-Max-Age"] = "600"


def _add_error_handlers(app: QuartTrio) -> None:
    @app.errorhandler(ApiError)
    async def api_error(error: ApiError):
        return error_response(error)

    @app.errorhandler(HTTPException)
    async def http_error(error: HTTPException):
        return error_response(http_api_error(error))

    @app.errorhandler(Exception)
    async def other_error(error: Exception):
        api = error_from_exception(error)
        if api.kind is ErrorKind.INTERNAL:
            log.error("%s %s failed", request.method, request.path, exc_info=error)
        return error_response(api)


# ---- small routes ------------------------------------------------------------------------


def _add_basic_routes(app: QuartTrio, service, metrics: ServerMetrics) -> None:
    @app.get("/health")
    async def health():
        if service.is_healthy:
            return json_response({"status": "ok"})
        return json_response({"status": "unhealthy", "error": "the inference engine failed"}, 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), status=200, content_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models():
        return json_response({"object": "list", "data": [_model_card(service, name) for name in service.served_names]})

    @app.get("/v1/models/<path:model_id>")
    async def get_model(model_id: str):
        service.check_model(model_id)
        return json_response(_model_card(service, model_id))


def _model_card(service, name: str) -> dict:
    return {"id": name, "object": "model", "created": service.created_s, "owned_by": "ninfer",
            "max_model_len": service.max_context}  # fmt: skip
