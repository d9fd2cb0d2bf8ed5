"""Routes of the OpenAI Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

The streaming and non-streaming answers fold the service's events through one
`ResponseStream`. Finished responses (with `store`, the default) go into a bounded
in-process `ResponsesStore`, which serves `previous_response_id` and GET / DELETE.
Errors use OpenAI's shape; a stream waits for the request's start before answering, so a
refused or timed-out request still gets its own status, and later failures end the stream
with `response.failed`.
"""

from __future__ import annotations

import logging
import re
import time

import trio
from quart import Response, request

from ninfer.protocols import responses as wire
from ninfer.protocols.calls import CallFinished, CallStarted, Idle, TextDelta, ToolCallDelta
from ninfer.protocols.errors import ApiError, ErrorKind
from ninfer.protocols.responses_events import (
    DeletedResponse, ResponseStream, TokenLogprob, TopLogprob, new_id, to_json, usage,
)  # fmt: skip
from ninfer.protocols.responses_events import Response as WireResponse
from ninfer.protocols.sse import sse_comment, sse_event
from ninfer.server.http_io import (
    error_from_exception, json_response, open_sse, raise_if_failed, read_json, request_id_of,
)  # fmt: skip
from ninfer.server.responses_store import ResponsesStore, StoredResponse

log = logging.getLogger(__name__)


def register(app, service, store: ResponsesStore | None = None) -> ResponsesStore:
    """Add the Responses routes to a Quart app serving `service`; returns the store used."""
    store = store if store is not None else ResponsesStore()

    async def create():
        return await _guarded(_create(service, store))

    async def retrieve(response_id: str):
        return await _guarded(_retrieve(store, response_id))

    async def delete(response_id: str):
        return await _guarded(_delete(store, response_id))

    app.add_url_rule("/v1/responses", "responses_create", create, methods=["POST"])
    app.add_url_rule("/v1/responses/<response_id>", "responses_get", retrieve, methods=["GET"])
    app.add_url_rule("/v1/responses/<response_id>", "responses_delete", delete, methods=["DELETE"])
    return store


async def _guarded(handler) -> Response:
    try:
        return await handler
    except trio.Cancelled:
        raise
    except Exception as exc:
        return error_response(exc)


# The service names fields as the chat API does; say them as this API does.
_PARAM_NAMES = [
    (re.compile(r"^max_tokens$"), "max_output_tokens"),
    (re.compile(r"^response_format(\..*)?$"), "text.format"),
    (re.compile(r"^tools\.(\d+)\.function\.?"), r"tools.\1."),
    (re.compile(r"^messages(\..*)?$"), "input"),
]


def error_response(exc: BaseException) -> Response:
    """Any exception as an OpenAI error response (internals are logged, never shown)."""
    error = error_from_exception(exc)
    if error.kind is ErrorKind.INTERNAL:
        log.error("/v1/responses failed", exc_info=exc)
    param = error.param
    for pattern, name in _PARAM_NAMES if param else ():
        param = pattern.sub(name, param).rstrip(".")
    status, body = ApiError(error.kind, error.message, param, error.code).openai()
    return json_response(body, status)


def _not_found(response_id: str, param: str | None = None) -> ApiError:
    kind = ErrorKind.INVALID_REQUEST if param else ErrorKind.NOT_FOUND
    what = "Previous response" if param else "Response"
    return ApiError(kind, f"{what} with id '{response_id}' not found.", param,
                    "previous_response_not_found" if param else "not_found")  # fmt: skip


async def _retrieve(store: ResponsesStore, response_id: str) -> Response:
    entry = store.get(response_id)
    if entry is None:
        raise _not_found(response_id)
    return json_response(to_json(entry.response))


async def _delete(store: ResponsesStore, response_id: str) -> Response:
    if not store.delete(response_id):
        raise _not_found(response_id)
    return json_response(to_json(DeletedResponse(id=response_id)))


async def _create(service, store: ResponsesStore) -> Response:
    body = wire.parse_responses_request(await read_json(request))
    service.check_model(body.model)
    history: tuple = ()
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise _not_found(body.previous_response_id, "previous_response_id")
        history = previous.conversation
    call = wire.to_chat_call(body, history, request_id=request_id_of(request))
    turn = _Turn(body, history, store, ResponseStream(template=_template(body)))
    stream = await service.start_chat(call)
    if not body.stream:
        async with stream:
            async for event in stream:
                turn.fold(event, is_streaming=False)
        return json_response(to_json(turn.assembler.response()))
    return await open_sse(stream, lambda event: _chunks(turn, event), lambda exc: _stream_error(turn, exc))


def _template(body: wire.ResponsesRequest) -> WireResponse:
    """The Response with the request's settings echoed, before any output."""
    choice = body.tool_choice
    return WireResponse(
        id=new_id("resp"), created_at=int(time.time()), model=body.model, status="in_progress", output=[],
        instructions=body.instructions, max_output_tokens=body.max_output_tokens,
        previous_response_id=body.previous_response_id,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        temperature=body.temperature, top_p=body.top_p, top_logprobs=body.top_logprobs,
        tool_choice=choice if isinstance(choice, str) else wire.converter.unstructure(choice),
        tools=[wire.converter.unstructure(tool) for tool in body.tools],
        text=wire.converter.unstructure(body.text or wire.TextConfig()),
        truncation=body.truncation or "disabled", store=body.store, metadata=body.metadata or {},
        user=body.user,
    )  # fmt: skip


class _Turn:
    """One request's state: folds events into the assembler and stores the result."""

    def __init__(self, body: wire.ResponsesRequest, history: tuple, store: ResponsesStore,
                 assembler: ResponseStream):  # fmt: skip
        self.body, self.history, self.store, self.assembler = body, history, store, assembler

    def fold(self, event, *, is_streaming: bool) -> list[dict]:
        """Feed one service event; returns the Responses events it makes."""
        if isinstance(event, CallStarted):
            return self.assembler.start()
        if isinstance(event, TextDelta):
            return self.assembler.text(event.text, _logprobs(event) if wire.wants_logprobs(self.body) else None)
        if isinstance(event, ToolCallDelta):
            return self.assembler.function_call(call_id=event.id, name=event.name, arguments=event.arguments)
        if isinstance(event, CallFinished):
            return self._finish(event, is_streaming)
        return []

    def fail(self, message: str) -> list[dict]:
        return self.assembler.fail(message)

    def _finish(self, event: CallFinished, is_streaming: bool) -> list[dict]:
        totals = usage(event.usage.prompt_tokens, event.usage.completion_tokens, event.usage.cached_tokens)
        if event.reason in ("error", "cancelled"):
            if not is_streaming:
                raise_if_failed(event)
            message = event.error or "the answer was cancelled: the server is shutting down"
            return self.assembler.fail(message, usage=totals)
        events = self.assembler.finish(reason=event.reason, usage=totals)
        self._store()
        return events

    def _store(self) -> None:
        if not self.body.store:
            return
        response = self.assembler.response()
        turn = wire.to_chat_messages(wire.input_items(self.body)) + wire.output_messages(response.output)
        self.store.put(StoredResponse(response, (*self.history, *turn)))


def _logprobs(event: TextDelta) -> list[TokenLogprob]:
    return [
        TokenLogprob(token=e.token, logprob=e.logprob, bytes=list(e.token_bytes),
                     top_logprobs=[TopLogprob(token=t.token, logprob=t.logprob, bytes=list(t.token_bytes))
                                   for t in e.top])
        for e in event.logprobs or ()
    ]  # fmt: skip


def _chunks(turn: _Turn, event) -> list[bytes]:
    """Typed events (numbered by the assembler) as SSE, comments while nothing happens."""
    if isinstance(event, Idle):
        return [sse_comment()]
    return [sse_event(e, e["type"]) for e in turn.fold(event, is_streaming=True)]


def _stream_error(turn: _Turn, exc: Exception) -> list[bytes]:
    """A failure after the stream opened ends it with `response.failed`."""
    error = error_from_exception(exc)
    if error.kind is ErrorKind.INTERNAL:
        log.error("/v1/responses stream failed", exc_info=exc)
    return [sse_event(event, event["type"]) for event in turn.fail(error.message)]
