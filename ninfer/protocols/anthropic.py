"""Anthropic Messages API: wire schemas for POST /v1/messages and /v1/messages/count_tokens.

Requests structure into frozen attrs classes through one strict converter (unknown keys,
wrong types and out-of-range values are precise 400s); content blocks are a tagged union on
"type". `to_chat_messages` / `to_tools` / `to_tool_choice` turn a request into the neutral
chat form the generation service takes (Hugging Face template messages, OpenAI-style function
tools). Responses and stream events live in `anthropic_events.py`.

Only client tools are supported; images, documents and extended thinking are rejected with a
400 naming the block, since the served models read text only.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from ninfer.protocols.calls import ChatCall, ResponseFormat, SamplingOptions, chat_tool, chat_tool_call
from ninfer.protocols.strict import (
    JsonObject,
    WireFormatError,
    at_least,
    between,
    make_converter,
    named_tool_choice,
    register_tagged_union,
    stop_sequences,
)
from ninfer.protocols.strict import structure as _structure

MAX_STOP_SEQUENCES = 16  # per request, as documented in docs/serving.md

# --- request schemas -------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class TextBlock:
    text: str
    type: Literal["text"] = "text"
    cache_control: JsonObject | None = None  # accepted; prefix caching is automatic here
    citations: list[JsonObject] | None = None


@attrs.frozen(kw_only=True)
class ImageBlock:
    """Parsed so the error can name the block; never converted."""

    source: JsonObject
    type: Literal["image"] = "image"
    cache_control: JsonObject | None = None


@attrs.frozen(kw_only=True)
class DocumentBlock:
    """Parsed so the error can name the block; never converted."""

    source: JsonObject
    type: Literal["document"] = "document"
    title: str | None = None
    context: str | None = None
    citations: JsonObject | None = None
    cache_control: JsonObject | None = None


@attrs.frozen(kw_only=True)
class ToolUseBlock:
    """`caller` and `toolset_name` are in what the SDK's `ToolUseBlock.model_dump()` sends back
    (None for a client tool); accepted and ignored."""

    id: str
    name: str
    input: JsonObject
    type: Literal["tool_use"] = "tool_use"
    cache_control: JsonObject | None = None
    caller: JsonObject | None = None
    toolset_name: str | None = None


@attrs.frozen(kw_only=True)
class ToolResultBlock:
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock] = ""
    is_error: bool = False
    type: Literal["tool_result"] = "tool_result"
    cache_control: JsonObject | None = None
    toolset_name: str | None = None  # accepted and ignored, as on ToolUseBlock


ContentBlock = TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock


@attrs.frozen(kw_only=True)
class MessageParam:
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


@attrs.frozen(kw_only=True)
class Tool:
    name: str = attrs.field()
    input_schema: JsonObject
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: JsonObject | None = None

    @name.validator
    def _check_name(self, attribute, value):
        if not value:
            raise WireFormatError("must not be empty", path=("name",))


@attrs.frozen(kw_only=True)
class ToolChoice:
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # required when type is "tool"
    disable_parallel_tool_use: bool = False


@attrs.frozen(kw_only=True)
class Metadata:
    user_id: str | None = None


@attrs.frozen(kw_only=True)
class ThinkingConfig:
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: str | None = None


@attrs.frozen(kw_only=True)
class JsonOutputFormat:
    schema: JsonObject
    type: Literal["json_schema"] = "json_schema"


@attrs.frozen(kw_only=True)
class OutputConfig:
    """Structured output (`format`) is enforced by constrained decoding; `effort` is a hint
    for reasoning models and is ignored."""

    format: JsonOutputFormat | None = None
    effort: str | None = None


@attrs.frozen(kw_only=True)
class CountTokensRequest:
    """POST /v1/messages/count_tokens."""

    model: str
    messages: list[MessageParam]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] = attrs.Factory(list)
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    cache_control: JsonObject | None = None


@attrs.frozen(kw_only=True)
class MessagesRequest:
    """POST /v1/messages.

    `temperature`, `top_p` and `top_k` are Anthropic's sampler fields (newer SDKs send them
    through `extra_body`); `seed` is an ninfer extension, also sent through `extra_body`.
    """

    model: str
    max_tokens: int = attrs.field(validator=at_least(1))
    messages: list[MessageParam]
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] = attrs.field(factory=list, validator=stop_sequences(MAX_STOP_SEQUENCES))
    temperature: float | None = attrs.field(default=None, validator=between(0.0, 1.0))
    top_p: float | None = attrs.field(default=None, validator=between(0.0, 1.0))
    top_k: int | None = attrs.field(default=None, validator=at_least(0))
    stream: bool = False
    tools: list[Tool] = attrs.Factory(list)
    tool_choice: ToolChoice | None = None
    metadata: Metadata | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    cache_control: JsonObject | None = None
    seed: int | None = None
    # ninfer extensions: prefix-cache tenant isolation and read-only participation
    cache_salt: str | None = None
    cache_read_only: bool | None = None
    # Accepted and ignored: one tier, one place, one speed here.
    service_tier: str | None = None
    inference_geo: str | None = None
    speed: str | None = None
    diagnostics: JsonObject | None = None


converter = make_converter()
register_tagged_union(converter, ContentBlock, "content block")
register_tagged_union(converter, TextBlock | ImageBlock, "tool result content block")


def parse_messages_request(body: Any) -> MessagesRequest:
    """Structure and check a /v1/messages body; raises `WireFormatError` (a 400)."""
    request = _structure(converter, body, MessagesRequest)
    _check_common(request)
    if request.messages[-1].role == "assistant":
        # Continuing a partial assistant turn needs the template to leave that turn open,
        # which the service cannot do yet; rendering it closed would answer a different prompt.
        where = f"messages.{len(request.messages) - 1}"
        raise WireFormatError(f"{where}: prefilling the assistant turn is not supported", where)
    return request


def parse_count_tokens_request(body: Any) -> CountTokensRequest:
    request = _structure(converter, body, CountTokensRequest)
    _check_common(request)
    return request


def _check_common(request: MessagesRequest | CountTokensRequest) -> None:
    if not request.messages:
        raise WireFormatError("messages: at least one message is required", "messages")
    if request.thinking is not None and request.thinking.type != "disabled":
        raise WireFormatError(
            "thinking: extended thinking is not supported by this server", "thinking.type"
        )
    to_tool_choice(request.tool_choice, request.tools)  # validates the named tool


# --- conversion to the neutral chat form -----------------------------------------------------


def to_chat_call(request: MessagesRequest | CountTokensRequest, *, request_id: str = "") -> ChatCall:
    """The protocol-neutral call the generation service runs (or counts) for this request."""
    fields: dict[str, Any] = {}
    if isinstance(request, MessagesRequest):
        sampling = SamplingOptions(temperature=request.temperature, top_p=request.top_p, top_k=request.top_k)
        fields = {"max_tokens": request.max_tokens, "sampling": sampling, "seed": request.seed,
                  "stop": tuple(request.stop_sequences), "cache_salt": request.cache_salt,
                  "cache_read_only": bool(request.cache_read_only)}  # fmt: skip
    return ChatCall(
        messages=tuple(to_chat_messages(request)),
        tools=tuple(to_tools(request.tools)),
        tool_choice=to_tool_choice(request.tool_choice, request.tools),
        parallel_tool_calls=parallel_tool_calls(request.tool_choice),
        response_format=to_response_format(request.output_config),
        request_id=request_id,
        **fields,
    )


def to_response_format(config: OutputConfig | None) -> ResponseFormat | None:
    if config is None or config.format is None:
        return None
    return ResponseFormat(kind="json_schema", schema=config.format.schema)



def system_text(system: str | list[TextBlock] | None) -> str | None:
    """The system prompt as one string (text blocks joined by blank lines)."""
    if system is None or isinstance(system, str):
        return system or None
    return "\n\n".join(block.text for block in system) or None


def to_chat_messages(request: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    """Messages as chat-template dicts: system, user, assistant (+ tool_calls), tool."""
    out: list[dict[str, Any]] = []
    system = system_text(request.system)
    if system is not None:
        out.append({"role": "system", "content": system})
    for index, message in enumerate(request.messages):
        blocks = _blocks(message.content)
        path = f"messages.{index}.content"
        if message.role == "user":
            out.extend(_user_messages(blocks, path))
        else:
            out.append(_assistant_message(blocks, path))
    return out


def _blocks(content: str | list[ContentBlock]) -> list[ContentBlock]:
    return [TextBlock(text=content)] if isinstance(content, str) else list(content)


def _user_messages(blocks: list[ContentBlock], path: str) -> list[dict[str, Any]]:
    """Tool results become `tool` messages; the rest of the text one user message after them."""
    tool_messages, texts = [], []
    for number, block in enumerate(blocks):
        where = f"{path}.{number}"
        if isinstance(block, ToolResultBlock):
            tool_messages.append(_tool_message(block, where))
        elif isinstance(block, TextBlock):
            texts.append(block.text)
        else:
            raise _unsupported_block(block, where, "user")
    if texts or not tool_messages:
        tool_messages.append({"role": "user", "content": "\n\n".join(texts)})
    return tool_messages


def _tool_message(block: ToolResultBlock, where: str) -> dict[str, Any]:
    if isinstance(block.content, str):
        text = block.content
    else:
        for number, part in enumerate(block.content):
            if not isinstance(part, TextBlock):
                raise _unsupported_block(part, f"{where}.content.{number}", "tool_result")
        text = "\n\n".join(part.text for part in block.content)
    if block.is_error:
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": text}


def _assistant_message(blocks: list[ContentBlock], path: str) -> dict[str, Any]:
    texts, calls = [], []
    for number, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            calls.append(chat_tool_call(block.id, block.name, block.input))
        else:
            raise _unsupported_block(block, f"{path}.{number}", "assistant")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _unsupported_block(block: ContentBlock, where: str, role: str) -> WireFormatError:
    if isinstance(block, (ImageBlock, DocumentBlock)):
        reason = f"{block.type} blocks are not supported: this model reads text only"
    else:
        reason = f"{block.type} blocks are not allowed in {role} content"
    return WireFormatError(f"{where}: {reason}", f"{where}.type")


def to_tools(tools: list[Tool]) -> list[dict[str, Any]]:
    """Anthropic tools as OpenAI-style function tools."""
    return [chat_tool(tool.name, tool.description, tool.input_schema) for tool in tools]


def to_tool_choice(choice: ToolChoice | None, tools: list[Tool]) -> str | dict[str, str]:
    """auto / any / tool / none -> "auto" / "required" / {"name": ...} / "none"."""
    if choice is None or not tools:
        if choice is not None and choice.type in ("any", "tool"):
            raise WireFormatError(
                f"tool_choice: type {choice.type!r} needs at least one tool in tools", "tool_choice"
            )
        return "none" if not tools else "auto"
    if choice.type == "tool":
        return named_tool_choice(choice.name, tools)
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def parallel_tool_calls(choice: ToolChoice | None) -> bool:
    return not (choice is not None and choice.disable_parallel_tool_use)
