"""Routes of the Anthropic Messages API: POST /v1/messages and /v1/messages/count_tokens.

Both the streaming and the non-streaming answer fold the service's events through one
`MessageStream`, so they cannot disagree. Errors use Anthropic's shape
(`{"type": "error", "error": {"type", "message"}}`; a full queue is 529 overloaded_error).
A stream waits for the request's first event before answering, so a request that times out
in the queue still gets its 503; once the stream is open, later failures arrive as an
`error` event.
"""

from __future__ import annotations

import logging
import secrets

import trio
from quart import Response, request

from ninfer.protocols import anthropic as wire
from ninfer.protocols.anthropic_events import MessageStream, Ping, StreamFrames, to_json
from ninfer.protocols.calls import CallFinished, CallStarted, Idle, TextDelta, ToolCallDelta
from ninfer.protocols.errors import ApiError, ErrorKind
from ninfer.protocols.sse import sse_event
from ninfer.server.http_io import (
    error_from_exception, json_response, open_sse, raise_if_failed, read_json, request_id_of,
)  # fmt: skip

log = logging.getLogger(__name__)


def register(app, service) -> None:
    """Add the Anthropic routes to a Quart app serving `service` (a GenerationService)."""

    async def messages():
        try:
            return await _messages(service)
        except trio.Cancelled:
            raise
        except Exception as exc:
            return error_response(exc)

    async def count_tokens():
        try:
            body = wire.parse_count_tokens_request(await read_json(request))
            service.check_model(body.model)
            num_tokens = await service.count_tokens(wire.to_chat_call(body))
            return json_response({"input_tokens": num_tokens})
        except trio.Cancelled:
            raise
        except Exception as exc:
            return error_response(exc)

    app.add_url_rule("/v1/messages", "anthropic_messages", messages, methods=["POST"])
    app.add_url_rule("/v1/messages/count_tokens", "anthropic_count_tokens", count_tokens, methods=["POST"])


def error_response(exc: BaseException) -> Response:
    """Any exception as an Anthropic error response (internals are logged, never shown)."""
    error = error_from_exception(exc)
    if error.kind is ErrorKind.INTERNAL:
        log.error("/v1/messages failed", exc_info=exc)
    status, body = error.anthropic()
    return json_response(body, status)


async def _messages(service) -> Response:
    body = wire.parse_messages_request(await read_json(request))
    service.check_model(body.model)
    request_id = request_id_of(request)
    call = wire.to_chat_call(body, request_id=request_id)
    assembler = MessageStream(
        message_id=f"msg_{secrets.token_hex(12)}", model=body.model, stop_sequences=tuple(body.stop_sequences)
    )
    stream = await service.start_chat(call)
    if not body.stream:
        async with stream:
            async for event in stream:
                _fold(assembler, event)
        return _final(assembler)
    frames = StreamFrames()
    return await open_sse(stream, lambda event: _chunks(assembler, frames, event), _stream_error)


def _fold(assembler: MessageStream, event) -> list:
    """Feed one service event to the assembler; returns the Anthropic events it makes."""
    if isinstance(event, CallStarted):
        return assembler.start(prompt_tokens=event.prompt_tokens, cached_tokens=event.cached_tokens)
    if isinstance(event, TextDelta):
        return assembler.text(event.text)
    if isinstance(event, ToolCallDelta):
        return assembler.tool_call(index=event.index, call_id=event.id, name=event.name, arguments=event.arguments)
    if isinstance(event, CallFinished):
        raise_if_failed(event)
        return assembler.finish(
            reason=event.reason, completion_tokens=event.usage.completion_tokens, stop_sequence=event.stop_sequence
        )
    return []


def _final(assembler: MessageStream) -> Response:
    return json_response(to_json(assembler.message()))


def _chunks(assembler: MessageStream, frames: StreamFrames, event) -> list[bytes]:
    """Anthropic events as SSE, with pings while nothing else happens."""
    if isinstance(event, Idle):
        return [frames.encode(Ping())]
    return [frames.encode(e) for e in _fold(assembler, event)]


def _stream_error(exc: Exception) -> list[bytes]:
    """A failure after the stream opened, as Anthropic's `error` event."""
    error = error_from_exception(exc)
    if error.kind is ErrorKind.INTERNAL and not isinstance(exc, ApiError):
        log.error("/v1/messages stream failed", exc_info=exc)
    _, body = error.anthropic()
    return [sse_event(body, "error")]
