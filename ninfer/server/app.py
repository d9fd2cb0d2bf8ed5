"""The Quart-Trio application: cross-cutting HTTP behaviour and the small routes.

Every request gets an `x-request-id` (the client's, when it sent a sane one). Before any
route runs: CORS preflights are answered, bodies over `--max-request-mib` are refused with 413
from their Content-Length (before reading them), and, when API keys are set, every path but
`/health` needs `Authorization: Bearer KEY` or `x-api-key: KEY`. Errors that escape a route
(404, 405, 413, 401, bad JSON, engine errors) are rendered in the Anthropic shape under
`/v1/messages` and in the OpenAI shape everywhere else.

Routes here: GET /health, /metrics, /v1/models, /v1/models/{id}. The OpenAI generation
routes are in `routes_openai`; Anthropic and Responses register themselves from their own
modules when present.
"""

from __future__ import annotations

import hmac
import importlib
import logging
import re
import secrets

from quart import Response, g, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from ninfer.protocols.errors import ApiError, ErrorKind, error_from_exception
from ninfer.server.http_io import json_response
from ninfer.server.metrics import CONTENT_TYPE, ServerMetrics
from ninfer.server.settings import ServerSettings

log = logging.getLogger(__name__)

ANTHROPIC_PREFIXES = ("/v1/messages",)
OPEN_PATHS = ("/health",)  # never need a key
_CLIENT_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_HTTP_KINDS = {401: ErrorKind.AUTHENTICATION, 404: ErrorKind.NOT_FOUND, 405: ErrorKind.METHOD_NOT_ALLOWED,
               413: ErrorKind.REQUEST_TOO_LARGE}  # fmt: skip
# Errors raised before the route reads the request body.
_UNREAD_BODY_KINDS = (ErrorKind.AUTHENTICATION, ErrorKind.NOT_FOUND, ErrorKind.METHOD_NOT_ALLOWED,
                      ErrorKind.REQUEST_TOO_LARGE)  # fmt: skip
# Route modules that add routes with `register(app, service)`, imported when present.
EXTRA_ROUTE_MODULES = ("ninfer.server.routes_anthropic", "ninfer.server.routes_responses")


def create_app(service, settings: ServerSettings, metrics: ServerMetrics) -> QuartTrio:
    """The app serving `service` (a GenerationService) under `settings`."""
    app = QuartTrio("ninfer")
    app.config["MAX_CONTENT_LENGTH"] = settings.max_request_bytes  # also caps chunked bodies
    app.config["RESPONSE_TIMEOUT"] = None  # long answers are never cut off
    app.config["BODY_TIMEOUT"] = 60
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = True
    _add_hooks(app, settings, metrics)
    _add_error_handlers(app)
    _add_basic_routes(app, service, metrics)
    from ninfer.server import routes_openai

    routes_openai.register(app, service)
    for name in EXTRA_ROUTE_MODULES:
        _register_optional(app, service, name)
    return app


def _register_optional(app, service, module_name: str) -> None:
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        log.warning("routes of %s unavailable: %s", module_name, e)
        return
    module.register(app, service)


def error_response(error: ApiError) -> Response:
    """An ApiError in the shape of the API the current path belongs to."""
    is_anthropic = request.path.startswith(ANTHROPIC_PREFIXES)
    status, body = error.anthropic() if is_anthropic else error.openai()
    response = json_response(body, status)
    if error.kind is ErrorKind.AUTHENTICATION:
        response.headers["WWW-Authenticate"] = "Bearer"
    if error.kind in _UNREAD_BODY_KINDS and _has_body():
        # The body was never read; closing is the only way to stay in sync with the client
        # (hypercorn would otherwise wait on the unread bytes and stall the next request).
        response.headers["Connection"] = "close"
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
        sent = request.headers.get("x-request-id", "")
        g.client_request_id = sent if _CLIENT_REQUEST_ID.match(sent) else None
        if request.method == "OPTIONS" and settings.cors_origins:
            return Response("", status=204)
        length = request.content_length
        if length is not None and length > limit:
            raise ApiError(ErrorKind.REQUEST_TOO_LARGE,
                           f"The request body is {length} bytes; the limit is {limit} bytes.")  # fmt: skip
        if keys and request.path not in OPEN_PATHS and not _has_valid_key(keys):
            raise ApiError(ErrorKind.AUTHENTICATION, "Missing or invalid API key: send it as "
                           "'Authorization: Bearer KEY' or 'x-api-key: KEY'.")  # fmt: skip
        return None

    @app.after_request
    async def finish(response: Response) -> Response:
        response.headers["x-request-id"] = getattr(g, "client_request_id", None) or g.get("request_id", "")
        if settings.cors_origins:
            _add_cors_headers(response, settings.cors_origins)
        rule = request.url_rule.rule if request.url_rule is not None else "unmatched"
        metrics.count_http(request.method, rule, response.status_code)
        return response


def _has_valid_key(keys: tuple[bytes, ...]) -> bool:
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    candidates = [token.strip()] if scheme.lower() == "bearer" else []
    candidates.append(request.headers.get("x-api-key", ""))
    # compare_digest on every key: timing does not reveal which key (or prefix) matched.
    return any(hmac.compare_digest(c.encode(), k) for c in candidates if c for k in keys)


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
        kind = _HTTP_KINDS.get(error.code or 500, ErrorKind.INVALID_REQUEST if (error.code or 500) < 500 else ErrorKind.INTERNAL)
        message = {404: f"No route for {request.method} {request.path}.",
                   405: f"{request.method} is not allowed on {request.path}."}.get(error.code, error.description or str(error))  # fmt: skip
        if error.code == 413:
            message = f"The request body exceeds the limit of {app.config['MAX_CONTENT_LENGTH']} bytes."
        return error_response(ApiError(kind, message, code="unknown_url" if error.code == 404 else None))

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
        return json_response({"object": "list", "data": [_model_card(service)]})

    @app.get("/v1/models/<path:model_id>")
    async def get_model(model_id: str):
        service.check_model(model_id)
        return json_response(_model_card(service))


def _model_card(service) -> dict:
    return {"id": service.model_id, "object": "model", "created": service.created_s, "owned_by": "ninfer",
            "max_model_len": service.max_context}  # fmt: skip
