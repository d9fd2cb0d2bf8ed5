"""Anthropic Messages API output: the Message object, stream events, and error bodies.

`MessageStream` is sans-IO: the route feeds it the generation service's neutral events
(started, text, tool-call fragment, finished) and sends the Anthropic events it returns; the
non-streaming route feeds the same events and returns `stream.message()`. One code path for
both is what keeps streamed deltas equal to the non-streamed text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

import attrs

from ninfer.protocols.sse import EventTemplate, sse_event
from ninfer.protocols.strict import make_converter


@attrs.frozen(kw_only=True)
class TextContent:
    text: str
    type: Literal["text"] = "text"


@attrs.frozen(kw_only=True)
class ToolUseContent:
    id: str
    name: str
    input: dict[str, Any]
    type: Literal["tool_use"] = "tool_use"


@attrs.frozen(kw_only=True)
class Usage:
    """input_tokens excludes cache reads, as in Anthropic's API: prompt = input + cache_read."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


@attrs.frozen(kw_only=True)
class Message:
    id: str
    model: str
    content: list[TextContent | ToolUseContent]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: Usage
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"


@attrs.frozen(kw_only=True)
class TextDelta:
    text: str
    type: Literal["text_delta"] = "text_delta"


@attrs.frozen(kw_only=True)
class InputJsonDelta:
    partial_json: str
    type: Literal["input_json_delta"] = "input_json_delta"


@attrs.frozen(kw_only=True)
class MessageStart:
    message: Message
    type: Literal["message_start"] = "message_start"


@attrs.frozen(kw_only=True)
class ContentBlockStart:
    index: int
    content_block: TextContent | ToolUseContent
    type: Literal["content_block_start"] = "content_block_start"


@attrs.frozen(kw_only=True)
class ContentBlockDelta:
    index: int
    delta: TextDelta | InputJsonDelta
    type: Literal["content_block_delta"] = "content_block_delta"


@attrs.frozen(kw_only=True)
class ContentBlockStop:
    index: int
    type: Literal["content_block_stop"] = "content_block_stop"


@attrs.frozen(kw_only=True)
class StopInfo:
    stop_reason: StopReason
    stop_sequence: str | None = None


@attrs.frozen(kw_only=True)
class DeltaUsage:
    """Cumulative counts at the end of the message."""

    output_tokens: int
    input_tokens: int | None = None
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = None


@attrs.frozen(kw_only=True)
class MessageDelta:
    delta: StopInfo
    usage: DeltaUsage
    type: Literal["message_delta"] = "message_delta"


@attrs.frozen(kw_only=True)
class MessageStop:
    type: Literal["message_stop"] = "message_stop"


@attrs.frozen(kw_only=True)
class Ping:
    type: Literal["ping"] = "ping"


@attrs.frozen(kw_only=True)
class ErrorDetail:
    type: str  # invalid_request_error, authentication_error, not_found_error, overloaded_error...
    message: str


@attrs.frozen(kw_only=True)
class ErrorBody:
    """`{"type": "error", "error": {"type", "message"}}`: a response body and a stream event."""

    error: ErrorDetail
    type: Literal["error"] = "error"


@attrs.frozen(kw_only=True)
class TokenCount:
    input_tokens: int


StreamEvent = (
    MessageStart | ContentBlockStart | ContentBlockDelta | ContentBlockStop | MessageDelta
    | MessageStop | Ping | ErrorBody
)

converter = make_converter()


def to_json(obj: Any) -> dict[str, Any]:
    """An output object as a JSON-ready dict (field names as on the wire)."""
    return converter.unstructure(obj)


class StreamFrames:
    """A message stream's events as SSE bytes. A text delta, once a frame per stream on the
    serving path, fills an `EventTemplate` of its block (made when the block's first delta
    comes) instead of encoding the whole event: the same bytes, the text alone encoded."""

    def __init__(self):
        self._block, self._text = -1, None

    def encode(self, event: StreamEvent) -> bytes:
        if isinstance(event, ContentBlockDelta) and isinstance(event.delta, TextDelta):
            if event.index != self._block or self._text is None:
                self._block = index = event.index
                self._text = EventTemplate(
                    lambda text: sse_event(to_json(ContentBlockDelta(index=index, delta=TextDelta(text=text))),
                                           "content_block_delta")  # fmt: skip
                )
            return self._text.fill(event.delta.text)
        return sse_event(to_json(event), event.type)


def error_body(error_type: str, message: str) -> dict[str, Any]:
    return to_json(ErrorBody(error=ErrorDetail(type=error_type, message=message)))


def stop_reason(reason: str, stop_sequence: str | None, stop_sequences: Sequence[str]) -> StopReason:
    """The neutral finish reason (stop / length / tool_calls) as Anthropic's stop_reason."""
    if reason == "tool_calls":
        return "tool_use"
    if reason == "length":
        return "max_tokens"
    return "stop_sequence" if stop_sequence in stop_sequences else "end_turn"


def tool_use_id(call_id: str) -> str:
    """The service's call id (`call_…`, OpenAI's shape) as Anthropic's `toolu_…`, the prefix
    Anthropic's API gives tool-use ids and clients may rely on."""
    if call_id.startswith("toolu_"):
        return call_id
    return "toolu_" + call_id.removeprefix("call_")


@attrs.define
class _Block:
    kind: Literal["text", "tool_use"]
    parts: list[str]  # text pieces, or argument JSON fragments
    call_id: str = ""
    name: str = ""
    tool_index: int = -1


@attrs.define
class MessageStream:
    """Folds neutral generation events into Anthropic stream events and the final Message."""

    message_id: str
    model: str
    stop_sequences: tuple[str, ...] = ()
    _blocks: list[_Block] = attrs.Factory(list)
    _is_open: bool = False
    _usage: Usage = Usage(input_tokens=0, output_tokens=0)
    _stop: StopInfo | None = None

    def start(self, *, prompt_tokens: int, cached_tokens: int) -> list[StreamEvent]:
        """message_start (empty content, prompt usage) and one ping, as Anthropic sends."""
        self._usage = Usage(
            input_tokens=prompt_tokens - cached_tokens,
            output_tokens=0,
            cache_read_input_tokens=cached_tokens,
        )
        return [MessageStart(message=self.message()), Ping()]

    def text(self, text: str) -> list[StreamEvent]:
        if not text:
            return []
        events = self._open_text() if not self._current_is("text") else []
        self._blocks[-1].parts.append(text)
        return events + [ContentBlockDelta(index=len(self._blocks) - 1, delta=TextDelta(text=text))]

    def tool_call(self, *, index: int, call_id: str | None, name: str | None, arguments: str) -> list[StreamEvent]:
        """One tool-call fragment; a new `index` opens a new tool_use block."""
        events: list[StreamEvent] = []
        if not (self._current_is("tool_use") and self._blocks[-1].tool_index == index):
            events += self._close()
            block = _Block("tool_use", [], tool_use_id(call_id or f"{self.message_id}_{index}"), name or "", index)
            self._blocks.append(block)
            self._is_open = True
            content = ToolUseContent(id=block.call_id, name=block.name, input={})
            events.append(ContentBlockStart(index=len(self._blocks) - 1, content_block=content))
        if arguments:
            self._blocks[-1].parts.append(arguments)
            delta = InputJsonDelta(partial_json=arguments)
            events.append(ContentBlockDelta(index=len(self._blocks) - 1, delta=delta))
        return events

    def finish(self, *, reason: str, completion_tokens: int, stop_sequence: str | None = None) -> list[StreamEvent]:
        """Closes the open block, then message_delta (stop reason, usage) and message_stop."""
        events = self._close()
        kind = stop_reason(reason, stop_sequence, self.stop_sequences)
        self._stop = StopInfo(stop_reason=kind, stop_sequence=stop_sequence if kind == "stop_sequence" else None)
        self._usage = attrs.evolve(self._usage, output_tokens=completion_tokens)
        usage = DeltaUsage(
            output_tokens=completion_tokens,
            input_tokens=self._usage.input_tokens,
            cache_creation_input_tokens=0,
            cache_read_input_tokens=self._usage.cache_read_input_tokens,
        )
        return events + [MessageDelta(delta=self._stop, usage=usage), MessageStop()]

    def message(self) -> Message:
        """The Message so far (complete after `finish`)."""
        return Message(
            id=self.message_id,
            model=self.model,
            content=[_content(block) for block in self._blocks],
            stop_reason=self._stop.stop_reason if self._stop else None,
            stop_sequence=self._stop.stop_sequence if self._stop else None,
            usage=self._usage,
        )

    def _current_is(self, kind: str) -> bool:
        return self._is_open and self._blocks[-1].kind == kind

    def _open_text(self) -> list[StreamEvent]:
        events = self._close()
        self._blocks.append(_Block("text", []))
        self._is_open = True
        start = ContentBlockStart(index=len(self._blocks) - 1, content_block=TextContent(text=""))
        return events + [start]

    def _close(self) -> list[StreamEvent]:
        if not self._is_open:
            return []
        self._is_open = False
        return [ContentBlockStop(index=len(self._blocks) - 1)]


def _content(block: _Block) -> TextContent | ToolUseContent:
    if block.kind == "text":
        return TextContent(text="".join(block.parts))
    return ToolUseContent(id=block.call_id, name=block.name, input=_tool_input("".join(block.parts)))


def _tool_input(arguments: str) -> dict[str, Any]:
    """Parsed tool arguments; the parser only emits JSON objects, but never fail a response."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
