"""OpenAI routes: /v1/chat/completions, /v1/completions, /v1/tokenize, /v1/detokenize.

Streaming answers are SSE: `data: {chunk}` events, `: keep-alive` comments while the request
waits or prefills, and `data: [DONE]` at the end. A stream waits for the request's first event
before answering, so a request refused or timed out in the queue within the first keep-alive
interval still gets its own status; a failure after that arrives as a `data: {"error": ...}`
event before `[DONE]`. Errors escaping these handlers become the app's OpenAI-shaped errors.
"""

from __future__ import annotations

import logging
import time

from quart import Response, g, request

from ninfer.protocols import openai as wire
from ninfer.protocols import openai_calls as calls
from ninfer.protocols import openai_out as out
from ninfer.protocols.calls import CallFinished, CallStarted, Idle, TextDelta, ToolCallDelta
from ninfer.protocols.errors import ApiError, ErrorKind
from ninfer.protocols.sse import DONE, EventTemplate, sse_comment, sse_event
from ninfer.protocols.strict import structure
from ninfer.server.http_io import error_from_exception, json_response, open_sse, raise_if_failed, read_json

log = logging.getLogger(__name__)


def register(app, service) -> None:
    """Add the OpenAI routes to a Quart app serving `service`."""

    async def chat_completions():
        return await _chat(service)

    async def completions():
        return await _completions(service)

    async def tokenize():
        return await _tokenize(service)

    async def detokenize():
        body = structure(wire.IN_CONVERTER, await read_json(request), wire.DetokenizeRequest)
        service.check_model(body.model)
        return json_response({"prompt": await service.detokenize(body.tokens)})

    app.add_url_rule("/v1/chat/completions", "openai_chat", chat_completions, methods=["POST"])
    app.add_url_rule("/v1/completions", "openai_completions", completions, methods=["POST"])
    app.add_url_rule("/v1/tokenize", "tokenize", tokenize, methods=["POST"])
    app.add_url_rule("/v1/detokenize", "detokenize", detokenize, methods=["POST"])


# ---- chat ------------------------------------------------------------------------------


async def _chat(service) -> Response:
    req = wire.parse_chat_request(await read_json(request))
    service.check_model(req.model)
    call = calls.chat_call(req, g.request_id)
    response_id, created = "chatcmpl-" + g.request_id.removeprefix("req_"), int(time.time())
    if not req.stream:
        result = await service.chat(call)
        raise_if_failed(result)
        return json_response(out.chat_completion(result, id=response_id, created=created, model=req.model))
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    chunker = out.ChatChunker(id=response_id, created=created, model=req.model, include_usage=include_usage)
    return await _open_sse(await service.start_chat(call), lambda event: _chat_chunks(chunker, event))


def _chat_chunks(chunker: out.ChatChunker, event) -> list[bytes]:
    if isinstance(event, Idle):
        return [sse_comment()]
    if isinstance(event, CallStarted):
        return [sse_event(chunker.role())]
    if isinstance(event, TextDelta):
        frame = chunker.text_event(event)
        return [frame] if frame else []
    if isinstance(event, ToolCallDelta):
        return [sse_event(c) for c in chunker.tool_call(event)]
    if isinstance(event, CallFinished):
        raise_if_failed(event)
        return [sse_event(c) for c in chunker.finish(event.reason, event.usage)]
    return []


# ---- SSE plumbing ------------------------------------------------------------------------


async def _open_sse(stream, to_chunks) -> Response:
    """The SSE answer: chunks, an error event on a late failure, and `[DONE]` at the end."""

    def on_error(exc: Exception) -> list[bytes]:
        error = error_from_exception(exc)
        if error.kind is ErrorKind.INTERNAL and not isinstance(exc, ApiError):
            log.error("stream %s failed", stream.request_id, exc_info=exc)
        return [sse_event(error.openai()[1])]

    return await open_sse(stream, to_chunks, on_error, closing=(DONE,))


# ---- completions -------------------------------------------------------------------------


async def _completions(service) -> Response:
    req = wire.parse_completion_request(await read_json(request))
    service.check_model(req.model)
    call = calls.completion_call(req, g.request_id)
    response_id, created = "cmpl-" + g.request_id.removeprefix("req_"), int(time.time())
    echo = ""
    if req.echo:
        echo = call.prompt if isinstance(call.prompt, str) else await service.detokenize(list(call.prompt))
    if not req.stream:
        result = await service.complete(call)
        raise_if_failed(result)
        choice = out.CompletionChoice(echo + result.text, 0, out.completion_logprobs(result.logprobs, len(echo)), result.reason)
        return json_response(out.completion(response_id, created, req.model, [choice], result.usage))
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    state = _CompletionStreamState(response_id, created, req.model, echo, include_usage)
    return await _open_sse(await service.start_completion(call), state.chunks)


class _CompletionStreamState:
    """Chunks of one streamed text completion (the echo goes out with the first one)."""

    def __init__(self, response_id: str, created: int, model: str, echo: str, include_usage: bool):
        self._head = (response_id, created, model)
        self._pending_echo = echo
        self._offset = len(echo)
        self._include_usage = include_usage
        self._text = EventTemplate(lambda text: self._chunk(text, None, None))  # a plain text chunk's event

    def _chunk(self, text: str, logprobs, finish_reason: str | None) -> bytes:
        choice = out.CompletionChoice(text, 0, logprobs, finish_reason)
        return sse_event(out.completion(*self._head, [choice], None))

    def chunks(self, event) -> list[bytes]:
        if isinstance(event, Idle):
            return [sse_comment()]
        if isinstance(event, TextDelta):
            text, self._pending_echo = self._pending_echo + event.text, ""
            logprobs = out.completion_logprobs(event.logprobs, self._offset)
            self._offset += len(event.text)
            if logprobs is None:
                return [self._text.fill(text)] if text else []
            return [self._chunk(text, logprobs, None)]
        if isinstance(event, CallFinished):
            raise_if_failed(event)
            chunks = [self._chunk(self._pending_echo, None, event.reason)]
            if self._include_usage:
                chunks.append(sse_event(out.completion(*self._head, [], event.usage)))
            return chunks
        return []


# ---- tokenize ----------------------------------------------------------------------------


async def _tokenize(service) -> Response:
    body = structure(wire.IN_CONVERTER, await read_json(request), wire.TokenizeRequest)
    service.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(ErrorKind.INVALID_REQUEST, "Send exactly one of prompt or messages.", "prompt")
    if body.prompt is not None:
        add_special = body.add_special_tokens is not False
        ids = await service.tokenize(body.prompt, add_special_tokens=add_special)
    else:
        ids = await service.chat_prompt_ids(calls.tokenize_chat_call(body))
    return json_response({"tokens": ids, "count": len(ids), "max_model_len": service.max_context})
