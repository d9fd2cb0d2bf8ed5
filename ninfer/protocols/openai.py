"""OpenAI Chat Completions and Completions request schemas, and their conversion to calls.

Field names are as on the wire. Unknown fields are rejected (400 naming them), except a few
the OpenAI SDKs and common clients send that do not change generation (`IGNORED_FIELDS`).
Conversion to service calls is in `ninfer.protocols.openai_calls`; responses and stream chunks
are built in `ninfer.protocols.openai_out`.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from ninfer.core.params import MAX_TOP_LOGPROBS
from ninfer.protocols.strict import (
    JsonObject, WireFormatError, between, make_converter, register_tagged_union, structure,
)  # fmt: skip

MAX_STOP_SEQUENCES = 4
# Accepted and ignored: bookkeeping fields that do not change what is generated.
IGNORED_FIELDS = (
    "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
    "reasoning_effort", "verbosity",
)  # fmt: skip


# ---- content parts --------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class TextPart:
    type: Literal["text"] = "text"
    text: str


@attrs.frozen(kw_only=True)
class ImagePart:
    type: Literal["image_url"] = "image_url"
    image_url: JsonObject


@attrs.frozen(kw_only=True)
class AudioPart:
    type: Literal["input_audio"] = "input_audio"
    input_audio: JsonObject


@attrs.frozen(kw_only=True)
class FilePart:
    type: Literal["file"] = "file"
    file: JsonObject


@attrs.frozen(kw_only=True)
class RefusalPart:
    type: Literal["refusal"] = "refusal"
    refusal: str


ContentPart = TextPart | ImagePart | AudioPart | FilePart | RefusalPart
Content = str | list[ContentPart]
Prompt = str | list[int] | list[str] | list[list[int]]


# ---- messages ---------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class FunctionCallIn:
    name: str
    arguments: str


@attrs.frozen(kw_only=True)
class ToolCallIn:
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


@attrs.frozen(kw_only=True)
class SystemMessage:
    role: Literal["system", "developer"]
    content: Content
    name: str | None = None


@attrs.frozen(kw_only=True)
class UserMessage:
    role: Literal["user"] = "user"
    content: Content
    name: str | None = None


@attrs.frozen(kw_only=True)
class AssistantMessage:
    role: Literal["assistant"] = "assistant"
    content: Content | None = None
    tool_calls: list[ToolCallIn] | None = None
    name: str | None = None
    refusal: str | None = None


@attrs.frozen(kw_only=True)
class ToolMessage:
    role: Literal["tool"] = "tool"
    content: Content
    tool_call_id: str
    name: str | None = None


Message = SystemMessage | UserMessage | AssistantMessage | ToolMessage
_MESSAGE_BY_ROLE = {"system": SystemMessage, "developer": SystemMessage, "user": UserMessage,
                    "assistant": AssistantMessage, "tool": ToolMessage}  # fmt: skip


# ---- tools, formats ----------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class FunctionDef:
    name: str
    description: str | None = None
    parameters: JsonObject | None = None
    strict: bool | None = None


@attrs.frozen(kw_only=True)
class Tool:
    type: Literal["function"] = "function"
    function: FunctionDef


@attrs.frozen(kw_only=True)
class NamedFunction:
    name: str


@attrs.frozen(kw_only=True)
class NamedToolChoice:
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoiceIn = Literal["auto", "none", "required"] | NamedToolChoice


@attrs.frozen(kw_only=True)
class JsonSchemaSpec:
    name: str
    description: str | None = None
    schema: JsonObject | None = None
    strict: bool | None = None


@attrs.frozen(kw_only=True)
class TextFormat:
    type: Literal["text"] = "text"


@attrs.frozen(kw_only=True)
class JsonObjectFormat:
    type: Literal["json_object"] = "json_object"


@attrs.frozen(kw_only=True)
class JsonSchemaFormat:
    type: Literal["json_schema"] = "json_schema"
    json_schema: JsonSchemaSpec


ResponseFormatIn = TextFormat | JsonObjectFormat | JsonSchemaFormat


@attrs.frozen(kw_only=True)
class StreamOptions:
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's; accepted, usage is sent at the end


# ---- requests ----------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class SamplerFields:
    """The sampler, stop and `n` fields of both generation requests, with the same bounds."""

    temperature: float | None = attrs.field(default=None, validator=between(0, 2))
    top_p: float | None = attrs.field(default=None, validator=between(0, 1))
    top_k: int | None = attrs.field(default=None, validator=between(-1, None))
    min_p: float | None = attrs.field(default=None, validator=between(0, 1))
    presence_penalty: float | None = attrs.field(default=None, validator=between(-2, 2))
    frequency_penalty: float | None = attrs.field(default=None, validator=between(-2, 2))
    repetition_penalty: float | None = attrs.field(default=None, validator=between(0.01, 10))
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = attrs.field(default=None, validator=between(1, None))


def _sampler_fields_after(name: str):
    """attrs field_transformer: the inherited `SamplerFields` go right after the field `name`.

    Structuring names the first bad field in field order, so the order stays as on the wire.
    """

    def transform(cls, fields):
        own = [f for f in fields if not f.inherited]
        at = next(i for i, f in enumerate(own) if f.name == name) + 1
        return [*own[:at], *(f for f in fields if f.inherited), *own[at:]]

    return transform


@attrs.frozen(kw_only=True, field_transformer=_sampler_fields_after("max_completion_tokens"))
class ChatCompletionRequest(SamplerFields):
    model: str
    messages: list[Message]
    max_tokens: int | None = attrs.field(default=None, validator=between(1, None))
    max_completion_tokens: int | None = attrs.field(default=None, validator=between(1, None))
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoiceIn | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormatIn | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = attrs.field(default=None, validator=between(0, MAX_TOP_LOGPROBS))
    logit_bias: JsonObject | None = None
    modalities: list[str] | None = None
    cache_salt: str | None = None
    cache_read_only: bool | None = None  # ninfer extension: read the prefix cache, publish nothing
    ignore_eos: bool | None = None  # vLLM / llama.cpp extension: generate up to max_tokens regardless of EOS


@attrs.frozen(kw_only=True, field_transformer=_sampler_fields_after("max_tokens"))
class CompletionRequest(SamplerFields):
    model: str
    prompt: Prompt
    max_tokens: int | None = attrs.field(default=16, validator=between(1, None))
    best_of: int | None = attrs.field(default=None, validator=between(1, None))
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    echo: bool | None = None
    logprobs: int | None = attrs.field(default=None, validator=between(0, MAX_TOP_LOGPROBS))
    suffix: str | None = None
    logit_bias: JsonObject | None = None
    cache_salt: str | None = None
    cache_read_only: bool | None = None  # ninfer extension: read the prefix cache, publish nothing
    ignore_eos: bool | None = None  # vLLM / llama.cpp extension: generate up to max_tokens regardless of EOS


@attrs.frozen(kw_only=True)
class TokenizeRequest:
    """POST /v1/tokenize: `prompt` (raw text) or `messages` (through the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool | None = None


@attrs.frozen(kw_only=True)
class DetokenizeRequest:
    model: str | None = None
    tokens: list[int]


# ---- the converter -----------------------------------------------------------------------


def _kind(value: Any) -> str:
    return {str: "a string", list: "an array", dict: "an object"}.get(type(value), "a " + type(value).__name__)


def _make_converter():
    converter = make_converter()
    register_tagged_union(converter, ContentPart, "content part")
    register_tagged_union(converter, ResponseFormatIn, "response_format")

    def content(value, _type):
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            return converter.structure(value, list[ContentPart])
        raise WireFormatError(f"expected a string or an array of content parts, got {_kind(value)}")

    def message(value, _type):
        if not isinstance(value, dict):
            raise WireFormatError(f"expected a message object, got {_kind(value)}")
        role = value.get("role")
        cls = _MESSAGE_BY_ROLE.get(role)
        if cls is None:
            raise WireFormatError(f"unknown message role {role!r}; expected one of {', '.join(_MESSAGE_BY_ROLE)}")
        return converter.structure(value, cls)

    def tool_choice(value, _type):
        if isinstance(value, str):
            if value not in ("auto", "none", "required"):
                raise WireFormatError(f"expected 'auto', 'none', 'required' or a named tool, got {value!r}")
            return value
        return converter.structure(value, NamedToolChoice)

    def stop(value, _type):
        if isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return list(value)
        raise WireFormatError("expected a string or an array of strings")

    def prompt(value, _type):
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return list(value)
        if isinstance(value, list) and all(isinstance(p, str) for p in value):
            return list(value)
        if isinstance(value, list) and all(isinstance(p, list) for p in value):
            return [prompt(p, None) for p in value]
        raise WireFormatError("expected a string, an array of strings, or an array of token ids")

    converter.register_structure_hook(Content, content)
    converter.register_structure_hook(Content | None, lambda v, t: None if v is None else content(v, t))
    converter.register_structure_hook(Message, message)
    converter.register_structure_hook(ToolChoiceIn | None, lambda v, t: None if v is None else tool_choice(v, t))
    converter.register_structure_hook(str | list[str] | None, lambda v, t: None if v is None else stop(v, t))
    converter.register_structure_hook(Prompt, prompt)
    return converter


IN_CONVERTER = _make_converter()


def _strip_ignored(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in IGNORED_FIELDS}


def parse_chat_request(body: Any) -> ChatCompletionRequest:
    """Structure a JSON body; raises WireFormatError naming the first bad field."""
    if isinstance(body, dict):
        body = _strip_ignored(body)
    return structure(IN_CONVERTER, body, ChatCompletionRequest)


def parse_completion_request(body: Any) -> CompletionRequest:
    if isinstance(body, dict):
        body = _strip_ignored(body)
    return structure(IN_CONVERTER, body, CompletionRequest)
