"""Request / response helpers shared by the API routes: JSON bodies, failed answers, SSE."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import trio
from quart import Response, current_app, g, request
from werkzeug.exceptions import HTTPException

from ninfer.protocols.calls import CallFinished, CallResult, CallStarted, Idle, InvalidRequest, ModelNotFound
from ninfer.protocols.errors import ApiError, ErrorKind, kind_of_status
from ninfer.protocols.json_body import parse_json_body
from ninfer.protocols.sse import SSE_HEADERS, encode_json
from ninfer.protocols.strict import WireFormatError
from ninfer.sched import request as engine


JSON_MEDIA_TYPE = "application/json"
# Bodies larger than this are parsed off the event loop, so one big body never stalls the others.
_PARSE_IN_THREAD_BYTES = 256 * 1024


async def read_json(request) -> Any:
    """The request body parsed as JSON (parse_json_body's rules).

    A 415 unless the body is sent as application/json (a form or text/plain body is what a
    cross-site page can send without asking); the framework's 413 / 408 while reading, as the
    route's own ApiError.
    """
    if request.mimetype != JSON_MEDIA_TYPE:
        got = f"'{request.mimetype}'" if request.mimetype else "no Content-Type"
        raise ApiError(ErrorKind.UNSUPPORTED_MEDIA_TYPE,
                       f"Send the request body as JSON with 'Content-Type: {JSON_MEDIA_TYPE}'; got {got}.")  # fmt: skip
    try:
        data = await request.get_data(as_text=False)
    except HTTPException as e:
        raise http_api_error(e) from None
    if len(data) > _PARSE_IN_THREAD_BYTES:
        return await trio.to_thread.run_sync(parse_json_body, data)
    return parse_json_body(data)


def error_from_exception(exc: BaseException) -> ApiError:
    """The ApiError for any exception a request handler lets escape.

    Known client and engine errors get their own kind; anything else is INTERNAL with a
    generic message (the handler logs the traceback; the client never sees internals).
    """
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ModelNotFound):
        return ApiError(ErrorKind.NOT_FOUND, exc.message, exc.param, exc.code)
    if isinstance(exc, InvalidRequest):
        return ApiError(ErrorKind.INVALID_REQUEST, exc.message, exc.param, exc.code)
    if isinstance(exc, WireFormatError):
        return ApiError(ErrorKind.INVALID_REQUEST, exc.message, exc.param, "invalid_value")
    if isinstance(exc, engine.Overloaded):
        reason = str(exc).rstrip(". ") or "the request queue is full"
        return ApiError(ErrorKind.OVERLOADED, f"The server is busy: {reason}. Retry later.")
    if isinstance(exc, engine.QueueTimeout):
        return ApiError(ErrorKind.UNAVAILABLE, f"The request waited too long for a free slot: {exc}", code="queue_timeout")
    if isinstance(exc, engine.ShuttingDown):
        return ApiError(ErrorKind.UNAVAILABLE, "The server is shutting down; retry on another server or later.",
                        code="shutting_down")  # fmt: skip
    if isinstance(exc, engine.EngineUnhealthy):
        return ApiError(ErrorKind.UNAVAILABLE, f"The inference engine is unavailable: {exc}", code="engine_unhealthy")
    if isinstance(exc, engine.InvalidRequest):
        return ApiError(ErrorKind.INVALID_REQUEST, str(exc), "prompt")
    if isinstance(exc, engine.RequestTooLarge):
        return ApiError(ErrorKind.INVALID_REQUEST, str(exc), "messages", "context_length_exceeded")
    return ApiError(ErrorKind.INTERNAL, "The server had an internal error while processing the request.")


def http_api_error(error: HTTPException) -> ApiError:
    """A framework HTTP error (routing, body limits and timeouts) as an ApiError of its kind."""
    status = error.code or 500
    messages = {
        404: f"No route for {request.method} {request.path}.",
        405: f"{request.method} is not allowed on {request.path}.",
        408: f"The request body did not arrive within {current_app.config['BODY_TIMEOUT']} s.",
        413: f"The request body exceeds the limit of {current_app.config['MAX_CONTENT_LENGTH']} bytes.",
    }
    message = messages.get(status) or error.description or str(error)
    return ApiError(kind_of_status(status), message, code="unknown_url" if status == 404 else None)


def json_response(body: Any, status: int = 200) -> Response:
    # "replace": a lone surrogate (say, from a request's URL) must never fail the error page itself
    data = encode_json(body).encode("utf-8", "replace")
    return Response(data, status=status, content_type=JSON_MEDIA_TYPE)


def request_id_of(request) -> str:
    """The id the server gave this request (the app sets it), else the client's header."""
    return getattr(g, "request_id", None) or request.headers.get("x-request-id", "")


def raise_if_failed(result: CallResult | CallFinished) -> None:
    """Raise the ApiError for an answer the engine failed or a shutdown cancelled."""
    if result.reason == "error":
        raise ApiError(ErrorKind.INTERNAL, f"The model failed while answering: {result.error or 'unknown error'}")
    if result.reason == "cancelled":
        raise ApiError(ErrorKind.UNAVAILABLE, "The server is shutting down; the answer was cancelled.",
                       code="shutting_down")  # fmt: skip


async def first_events(stream) -> list:
    """The stream's events up to the request's start (or the first keep-alive).

    Waiting for them before answering lets a request that is refused or times out in the
    queue still get its own status code, instead of a 200 stream that only carries an error.
    """
    head = []
    async for event in stream:
        head.append(event)
        if isinstance(event, (CallStarted, Idle, CallFinished)):
            break
    return head


async def open_sse(
    stream,
    to_chunks: Callable[[Any], list[bytes]],
    on_error: Callable[[Exception], list[bytes]],
    *,
    closing: Sequence[bytes] = (),
) -> Response:
    """A 200 SSE response of `to_chunks(event)` for each event, once the request started.

    Errors before the start propagate, so the route answers them with their own status; a
    later one ends the stream with `on_error(exc)`. `closing` goes out last either way.
    """
    try:
        head = await first_events(stream)
    except BaseException:
        await stream.aclose()
        raise
    response = Response(_sse_body(stream, head, to_chunks, on_error, closing), status=200, headers=SSE_HEADERS)
    response.timeout = None  # a long answer must never be cut by the response timeout
    return response


async def _sse_body(stream, head: list, to_chunks, on_error, closing: Sequence[bytes]):
    async with stream:
        try:
            for event in head:
                for chunk in to_chunks(event):
                    yield chunk
            async for event in stream:
                for chunk in to_chunks(event):
                    yield chunk
        except trio.Cancelled:
            raise
        except Exception as exc:
            for chunk in on_error(exc):
                yield chunk
        for chunk in closing:
            yield chunk
