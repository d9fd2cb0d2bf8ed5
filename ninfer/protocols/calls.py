"""Protocol-neutral calls into the generation service, and the events that come back.

Every HTTP API (OpenAI chat / completions, Anthropic Messages, OpenAI Responses) converts its
wire request into one of these calls and converts the events back to its own wire format, so
templating, tool-call parsing, grammar constraints and sampler defaults live in one place.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from ninfer.core.usage import Timings, Usage

ToolChoice = str | dict[str, Any]  # "auto" | "none" | "required" | {"name": "<tool name>"}
ReasonName = Literal["stop", "length", "tool_calls", "cancelled", "error"]


class InvalidRequest(Exception):
    """A request the service cannot run; each API maps it to its own 400 shape.

    `param` is the wire field at fault when one is (e.g. "response_format.json_schema"),
    `code` a short machine-readable tag (e.g. "unsupported_schema") or None.
    """

    def __init__(self, message: str, param: str | None = None, *, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class ModelNotFound(InvalidRequest):
    """The request names a model this server does not serve (HTTP 404)."""

    def __init__(self, model: str, served: str):
        super().__init__(
            f"The model '{model}' does not exist; this server serves '{served}'.",
            "model",
            code="model_not_found",
        )


@attrs.frozen(kw_only=True)
class SamplingOptions:
    """Sampler knobs a request may set; None means "use the server's default"."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None


@attrs.frozen(kw_only=True)
class ResponseFormat:
    """Structured output: "text" (no constraint), "json_object" or "json_schema"."""

    kind: Literal["text", "json_object", "json_schema"] = "text"
    schema: dict[str, Any] | None = None  # only for json_schema
    name: str | None = None


@attrs.frozen(kw_only=True)
class GenerationOptions:
    """What every call sets besides its prompt: length, sampling, stops, logprobs, prefix-cache
    participation (`cache_salt`, `cache_read_only`) and the id that names it in logs."""

    max_tokens: int | None = None  # None: the server default, else up to the context limit
    sampling: SamplingOptions = SamplingOptions()
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    cache_salt: str | None = None
    cache_read_only: bool = False  # read the prefix cache, publish nothing
    request_id: str = ""
    ignore_eos: bool = False  # generate up to max_tokens, past end-of-sequence tokens


@attrs.frozen(kw_only=True)
class ChatCall(GenerationOptions):
    """One chat generation.

    `messages` are Hugging Face chat-template dicts: {"role", "content"} with role system /
    user / assistant / tool, content a string (text parts already joined), assistant
    "tool_calls" as [{"id", "type": "function", "function": {"name", "arguments": dict}}],
    tool messages with "tool_call_id". `tools` are OpenAI function tools:
    {"type": "function", "function": {"name", "description", "parameters"}}.
    """

    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None


def chat_tool(name: str, description: str | None, parameters: dict[str, Any]) -> dict[str, Any]:
    """A tool as `ChatCall.tools` holds it (an OpenAI function tool)."""
    return {"type": "function", "function": {"name": name, "description": description or "", "parameters": parameters}}


def chat_tool_call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """An assistant tool call as `ChatCall.messages` holds it (arguments a dict, for templates)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


@attrs.frozen(kw_only=True)
class CompletionCall(GenerationOptions):
    """One raw-text completion: the prompt is fed as is (no chat template)."""

    prompt: str | tuple[int, ...]


@attrs.frozen
class LogprobEntry:
    """One generated token's log-probability, with its text and exact bytes."""

    token_id: int
    token: str
    token_bytes: bytes
    logprob: float
    top: tuple[LogprobEntry, ...] = ()  # best first; their own `top` is empty


@attrs.frozen
class CallStarted:
    request_id: str
    prompt_tokens: int
    cached_tokens: int


@attrs.frozen
class TextDelta:
    """New answer text. `token_ids` / `logprobs` cover the tokens that arrived with it; text
    held back by the tool-call parser comes out in a later delta, so the two need not align."""

    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[LogprobEntry, ...] | None = None


@attrs.frozen
class ToolCallDelta:
    """One complete tool call (the parser emits it once its closing tag or the end arrives).

    `index` counts tool calls of this answer from 0; `arguments` is a JSON object text.
    """

    index: int
    id: str
    name: str
    arguments: str


@attrs.frozen
class Idle:
    """Nothing happened for `keepalive_s`: send an SSE comment or ping to keep the stream up."""


@attrs.frozen
class CallFinished:
    reason: ReasonName
    usage: Usage
    timings: Timings | None = None
    stop_sequence: str | None = None
    error: str | None = None


CallEvent = CallStarted | TextDelta | ToolCallDelta | Idle | CallFinished


@attrs.frozen
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON object text


@attrs.frozen(kw_only=True)
class CallResult:
    """A whole answer, as `collect` gathers it from the events (non-streaming responses)."""

    request_id: str
    text: str
    tool_calls: tuple[ToolCall, ...]
    reason: ReasonName
    usage: Usage
    token_ids: tuple[int, ...]
    logprobs: tuple[LogprobEntry, ...] | None
    stop_sequence: str | None = None
    error: str | None = None
    timings: Timings | None = None
