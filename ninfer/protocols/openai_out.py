"""OpenAI response objects: chat completions, their stream chunks, and text completions.

Each wire object is an attrs class; `to_wire` unstructures it, leaving out fields that hold
their default (optional fields the client did not ask for). Fields without a default are
always written, null included, where OpenAI writes null (`finish_reason`, `logprobs`).
"""

from __future__ import annotations

from typing import Any

import attrs
import cattrs

from ninfer.core.usage import Usage
from ninfer.protocols.calls import CallResult, LogprobEntry, TextDelta, ToolCallDelta
from ninfer.protocols.sse import EventTemplate, sse_event

_OUT = cattrs.Converter(omit_if_default=True)


def to_wire(obj: Any) -> dict[str, Any]:
    return _OUT.unstructure(obj)


@attrs.frozen
class PromptTokensDetails:
    cached_tokens: int


@attrs.frozen
class UsageOut:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def usage_out(usage: Usage) -> UsageOut:
    return UsageOut(
        usage.prompt_tokens, usage.completion_tokens, usage.prompt_tokens + usage.completion_tokens,
        PromptTokensDetails(usage.cached_tokens),
    )  # fmt: skip


# ---- chat ------------------------------------------------------------------------------


@attrs.frozen
class TopLogprobOut:
    token: str
    logprob: float
    bytes: list[int]


@attrs.frozen
class TokenLogprobOut:
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprobOut]


@attrs.frozen
class ChoiceLogprobs:
    content: list[TokenLogprobOut]


def chat_logprobs(entries: tuple[LogprobEntry, ...] | None) -> ChoiceLogprobs | None:
    if entries is None:
        return None
    return ChoiceLogprobs([
        TokenLogprobOut(e.token, e.logprob, list(e.token_bytes),
                        [TopLogprobOut(t.token, t.logprob, list(t.token_bytes)) for t in e.top])
        for e in entries
    ])  # fmt: skip


@attrs.frozen
class FunctionOut:
    name: str | None = None
    arguments: str | None = None


@attrs.frozen
class ToolCallOut:
    id: str
    type: str
    function: FunctionOut


@attrs.frozen
class ChatMessageOut:
    role: str
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


@attrs.frozen
class ChatChoice:
    index: int
    message: ChatMessageOut
    logprobs: ChoiceLogprobs | None
    finish_reason: str


@attrs.frozen
class ChatCompletion:
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageOut


def chat_completion(result: CallResult, *, id: str, created: int, model: str) -> dict[str, Any]:
    """The non-streaming chat response body."""
    calls = [ToolCallOut(c.id, "function", FunctionOut(c.name, c.arguments)) for c in result.tool_calls]
    content = result.text if (result.text or not calls) else None
    message = ChatMessageOut("assistant", content, tool_calls=calls or None)
    choice = ChatChoice(0, message, chat_logprobs(result.logprobs), result.reason)
    body = to_wire(ChatCompletion(id, created, model, [choice], usage_out(result.usage)))
    return {"object": "chat.completion", **body}


@attrs.frozen
class ToolCallDeltaOut:
    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionOut | None = None


@attrs.frozen
class DeltaOut:
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDeltaOut] | None = None


@attrs.frozen
class ChunkChoice:
    index: int
    delta: DeltaOut
    logprobs: ChoiceLogprobs | None
    finish_reason: str | None


@attrs.frozen
class ChatCompletionChunk:
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: UsageOut | None = None


class ChatChunker:
    """Builds the chunks of one streamed chat answer, in order."""

    def __init__(self, *, id: str, created: int, model: str, include_usage: bool):
        self._head = (id, created, model)
        self._include_usage = include_usage
        self._text_frame: EventTemplate | None = None  # a plain text delta's event, made at the first

    def _chunk(self, choices: list[ChunkChoice], usage: UsageOut | None = None) -> dict[str, Any]:
        return {"object": "chat.completion.chunk", **to_wire(ChatCompletionChunk(*self._head, choices, usage))}

    def role(self) -> dict[str, Any]:
        return self._chunk([ChunkChoice(0, DeltaOut(role="assistant", content=""), None, None)])

    def text(self, delta: TextDelta) -> dict[str, Any] | None:
        if not delta.text and not delta.logprobs:
            return None
        return self._chunk([ChunkChoice(0, DeltaOut(content=delta.text), chat_logprobs(delta.logprobs), None)])

    def text_event(self, delta: TextDelta) -> bytes | None:
        """`text`'s chunk as an SSE event. Plain text (no logprobs), once a frame per stream on
        the serving path, fills an `EventTemplate` made once per stream: only the content is
        encoded, and the event is the one `sse_event(self.text(delta))` gives."""
        if delta.logprobs is not None:
            chunk = self.text(delta)
            return None if chunk is None else sse_event(chunk)
        if not delta.text:
            return None
        if self._text_frame is None:
            self._text_frame = EventTemplate(lambda text: sse_event(self.text(TextDelta(text))))
        return self._text_frame.fill(delta.text)

    def tool_call(self, delta: ToolCallDelta) -> list[dict[str, Any]]:
        """Two chunks per call: id + name first, then the arguments (as OpenAI streams them)."""
        head = ToolCallDeltaOut(delta.index, delta.id, "function", FunctionOut(delta.name, ""))
        args = ToolCallDeltaOut(delta.index, function=FunctionOut(arguments=delta.arguments))
        return [self._chunk([ChunkChoice(0, DeltaOut(tool_calls=[d]), None, None)]) for d in (head, args)]

    def finish(self, reason: str, usage: Usage) -> list[dict[str, Any]]:
        chunks = [self._chunk([ChunkChoice(0, DeltaOut(), None, reason)])]
        if self._include_usage:
            chunks.append(self._chunk([], usage_out(usage)))
        return chunks


# ---- text completions --------------------------------------------------------------------


@attrs.frozen
class CompletionLogprobs:
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


def completion_logprobs(entries: tuple[LogprobEntry, ...] | None, start_offset: int) -> CompletionLogprobs | None:
    if entries is None:
        return None
    offsets, offset = [], start_offset
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return CompletionLogprobs(
        [e.token for e in entries], [e.logprob for e in entries],
        [{t.token: t.logprob for t in e.top} for e in entries], offsets,
    )  # fmt: skip


@attrs.frozen
class CompletionChoice:
    text: str
    index: int
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


@attrs.frozen
class Completion:
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageOut | None = None


def completion(id: str, created: int, model: str, choices: list[CompletionChoice], usage: Usage | None) -> dict[str, Any]:
    """A text completion body (or stream chunk: `usage` None, or `choices` empty for usage only)."""
    body = to_wire(Completion(id, created, model, choices, usage_out(usage) if usage else None))
    return {"object": "text_completion", **body}
