"""Request / response helpers shared by the API routes: JSON bodies, failed answers, SSE."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import trio
from quart import Response, g

from ninfer.protocols.errors import ApiError, ErrorKind
from ninfer.protocols.sse import SSE_HEADERS, encode_json
from ninfer.server.calls import CallFinished, CallResult, CallStarted, Idle


async def read_json(request) -> Any:
    """The request body parsed as JSON; a 400 (ApiError) when it is empty or not JSON."""
    data = await request.get_data(as_text=False)
    if not data.strip():
        raise ApiError(ErrorKind.INVALID_REQUEST, "The request body is empty; send a JSON object.")
    try:
        return json.loads(data)
    except (UnicodeDecodeError, ValueError) as e:
        raise ApiError(ErrorKind.INVALID_REQUEST, f"The request body is not valid JSON: {e}.") from None


def json_response(body: Any, status: int = 200) -> Response:
    return Response(encode_json(body), status=status, content_type="application/json")


def request_id_of(request) -> str:
    """The id the server gave this request (the app sets it), else the client's header."""
    return getattr(g, "request_id", None) or request.headers.get("x-request-id", "")


def raise_if_failed(result: CallResult | CallFinished) -> None:
    """Raise the ApiError for an answer the engine failed or a shutdown cancelled."""
    if result.reason == "error":
        raise ApiError(ErrorKind.INTERNAL, f"The model failed while answering: {result.error or 'unknown error'}")
    if result.reason == "cancelled":
        raise ApiError(ErrorKind.UNAVAILABLE, "The server is shutting down; the answer was cancelled.")


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
