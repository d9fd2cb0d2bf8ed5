"""Small request / response helpers shared by the Anthropic and Responses routes."""

from __future__ import annotations

import json
from typing import Any

from quart import Response, g

from ninfer.protocols.errors import ApiError, ErrorKind
from ninfer.protocols.sse import encode_json
from ninfer.server.calls import CallFinished, CallStarted, Idle


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
