"""OpenAI Responses API output: the Response object, its output items, and typed stream events.

`ResponseStream` is sans-IO: the route feeds it the generation service's neutral events and
sends the events it returns (each numbered by `sequence_number`); the non-streaming route
feeds the same events and returns `stream.response()`, so both paths build one object.
"""

from __future__ import annotations

import secrets
from typing import Any, Literal

import attrs

from ninfer.protocols.strict import make_converter

ItemStatus = Literal["in_progress", "completed", "incomplete"]
ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed"]


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


@attrs.frozen(kw_only=True)
class TopLogprob:
    token: str
    logprob: float
    bytes: list[int]


@attrs.frozen(kw_only=True)
class TokenLogprob:
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob] = attrs.Factory(list)


@attrs.frozen(kw_only=True)
class OutputTextPart:
    text: str
    type: Literal["output_text"] = "output_text"
    annotations: list[Any] = attrs.Factory(list)
    logprobs: list[TokenLogprob] = attrs.Factory(list)


@attrs.frozen(kw_only=True)
class MessageOutput:
    id: str
    status: ItemStatus
    content: list[OutputTextPart]
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"


@attrs.frozen(kw_only=True)
class FunctionCallOutput:
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus
    type: Literal["function_call"] = "function_call"


OutputItem = MessageOutput | FunctionCallOutput


@attrs.frozen(kw_only=True)
class InputTokensDetails:
    cached_tokens: int = 0
    cache_write_tokens: int = 0  # the prefix cache fills as a side effect; nothing is billed


@attrs.frozen(kw_only=True)
class OutputTokensDetails:
    reasoning_tokens: int = 0


@attrs.frozen(kw_only=True)
class ResponseUsage:
    """input_tokens includes cached ones (OpenAI's convention); the details say how many."""

    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()


@attrs.frozen(kw_only=True)
class ResponseError:
    code: str
    message: str


@attrs.frozen(kw_only=True)
class IncompleteDetails:
    reason: Literal["max_output_tokens", "content_filter"]


@attrs.frozen(kw_only=True)
class Response:
    """The Response object; request echo fields (`tools`, `tool_choice`...) are wire dicts."""

    id: str
    created_at: int
    model: str
    status: ResponseStatus
    output: list[OutputItem]
    object: Literal["response"] = "response"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    tool_choice: Any = "auto"
    tools: list[Any] = attrs.Factory(list)
    text: Any = attrs.Factory(lambda: {"format": {"type": "text"}})
    truncation: str = "disabled"
    store: bool = True
    background: bool = False
    metadata: dict[str, str] = attrs.Factory(dict)
    user: str | None = None
    usage: ResponseUsage | None = None


@attrs.frozen(kw_only=True)
class DeletedResponse:
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


converter = make_converter()


def to_json(obj: Any) -> dict[str, Any]:
    """An output object as a JSON-ready dict (field names as on the wire)."""
    return converter.unstructure(obj)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=prompt_tokens,
        output_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens),
    )


@attrs.define
class _OpenItem:
    """The output item being streamed: a message (text pieces) or a function call."""

    item_id: str
    output_index: int
    parts: list[str] = attrs.Factory(list)
    logprobs: list[TokenLogprob] = attrs.Factory(list)


@attrs.define
class ResponseStream:
    """Folds neutral generation events into Responses stream events and the final Response.

    `template` is the Response with the request's echo fields set and `output` empty.
    """

    template: Response
    _output: list[OutputItem] = attrs.Factory(list)
    _message: _OpenItem | None = None
    _status: ResponseStatus = "in_progress"
    _usage: ResponseUsage | None = None
    _incomplete: IncompleteDetails | None = None
    _error: ResponseError | None = None
    _sequence_number: int = 0

    def start(self) -> list[dict[str, Any]]:
        """response.created and response.in_progress."""
        return [self._event("response.created", response=self._snapshot()),
                self._event("response.in_progress", response=self._snapshot())]

    def text(self, text: str, logprobs: list[TokenLogprob] | None = None) -> list[dict[str, Any]]:
        """One output_text delta, opening the message item (and its part) if needed."""
        if not text and not logprobs:
            return []
        events = self._open_message() if self._message is None else []
        item = self._message
        item.parts.append(text)
        item.logprobs.extend(logprobs or ())
        events.append(self._event(
            "response.output_text.delta", item_id=item.item_id, output_index=item.output_index,
            content_index=0, delta=text, logprobs=[to_json(lp) for lp in logprobs or ()],
        ))
        return events

    def function_call(self, *, call_id: str, name: str, arguments: str) -> list[dict[str, Any]]:
        """A whole function call: added, one arguments delta, arguments done, item done."""
        events = self._close_message("completed")
        item_id, output_index = new_id("fc"), len(self._output)
        pending = FunctionCallOutput(id=item_id, call_id=call_id, name=name, arguments="", status="in_progress")
        done = attrs.evolve(pending, arguments=arguments, status="completed")
        self._output.append(done)
        where = {"item_id": item_id, "output_index": output_index}
        return events + [
            self._event("response.output_item.added", output_index=output_index, item=to_json(pending)),
            self._event("response.function_call_arguments.delta", **where, delta=arguments),
            self._event("response.function_call_arguments.done", **where, arguments=arguments),
            self._event("response.output_item.done", output_index=output_index, item=to_json(done)),
        ]

    def finish(self, *, reason: str, usage: ResponseUsage) -> list[dict[str, Any]]:
        """Close the open item, then response.completed (or .incomplete when cut by length)."""
        is_cut = reason == "length"
        events = self._close_message("incomplete" if is_cut else "completed")
        self._usage = usage
        if is_cut:
            self._status, self._incomplete = "incomplete", IncompleteDetails(reason="max_output_tokens")
            return events + [self._event("response.incomplete", response=self._snapshot())]
        self._status = "completed"
        return events + [self._event("response.completed", response=self._snapshot())]

    def fail(self, message: str, *, usage: ResponseUsage | None = None) -> list[dict[str, Any]]:
        """The engine failed mid-answer: close what is open and send response.failed."""
        events = self.start() if self._sequence_number == 0 else []
        events += self._close_message("incomplete")
        self._status, self._usage = "failed", usage
        self._error = ResponseError(code="server_error", message=message)
        return events + [self._event("response.failed", response=self._snapshot())]

    def response(self) -> Response:
        return self._snapshot()

    def _open_message(self) -> list[dict[str, Any]]:
        self._message = _OpenItem(item_id=new_id("msg"), output_index=len(self._output))
        item = MessageOutput(id=self._message.item_id, status="in_progress", content=[])
        where = {"item_id": item.id, "output_index": self._message.output_index}
        return [
            self._event("response.output_item.added", output_index=where["output_index"], item=to_json(item)),
            self._event("response.content_part.added", **where, content_index=0,
                        part=to_json(OutputTextPart(text=""))),
        ]

    def _close_message(self, status: ItemStatus) -> list[dict[str, Any]]:
        item, self._message = self._message, None
        if item is None:
            return []
        text = "".join(item.parts)
        part = OutputTextPart(text=text, logprobs=item.logprobs)
        done = MessageOutput(id=item.item_id, status=status, content=[part])
        self._output.append(done)
        where = {"item_id": item.item_id, "output_index": item.output_index}
        return [
            self._event("response.output_text.done", **where, content_index=0, text=text,
                        logprobs=[to_json(lp) for lp in item.logprobs]),
            self._event("response.content_part.done", **where, content_index=0, part=to_json(part)),
            self._event("response.output_item.done", output_index=item.output_index, item=to_json(done)),
        ]

    def _snapshot(self) -> Response:
        return attrs.evolve(
            self.template, status=self._status, output=list(self._output), usage=self._usage,
            incomplete_details=self._incomplete, error=self._error,
        )

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        if isinstance(fields.get("response"), Response):
            fields["response"] = to_json(fields["response"])
        event = {"type": kind, "sequence_number": self._sequence_number, **fields}
        self._sequence_number += 1
        return event
