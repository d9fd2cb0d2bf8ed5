"""OpenAI Responses API: wire schemas for POST /v1/responses and conversion to chat messages.

`input` is a string or a list of items: messages (input_text / output_text parts),
function_call and function_call_output items. `to_chat_messages` turns them, after the
history of `previous_response_id`, into the neutral chat-template messages; `instructions`
become the system message and, as in OpenAI's API, are not carried to later responses.
Only function tools are supported; images, files, reasoning and hosted tools are rejected with
a 400 naming the field. The Response object and stream events live in `responses_events.py`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

import attrs

from ninfer.protocols.calls import ChatCall, ResponseFormat, SamplingOptions, chat_tool, chat_tool_call
from ninfer.protocols.responses_events import FunctionCallOutput, MessageOutput, OutputItem
from ninfer.protocols.strict import (
    JsonObject,
    WireFormatError,
    at_least,
    between,
    make_converter,
    named_tool_choice,
    register_tagged_union,
)
from ninfer.protocols.strict import structure as _structure

# --- input items -----------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class InputText:
    text: str
    type: Literal["input_text"] = "input_text"


@attrs.frozen(kw_only=True)
class OutputText:
    text: str
    type: Literal["output_text"] = "output_text"
    annotations: list[JsonObject] = attrs.Factory(list)
    logprobs: list[JsonObject] | None = None


@attrs.frozen(kw_only=True)
class Refusal:
    refusal: str
    type: Literal["refusal"] = "refusal"


@attrs.frozen(kw_only=True)
class InputImage:
    """Parsed so the error can name the part; never converted."""

    type: Literal["input_image"] = "input_image"
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


@attrs.frozen(kw_only=True)
class InputFile:
    """Parsed so the error can name the part; never converted."""

    type: Literal["input_file"] = "input_file"
    file_id: str | None = None
    file_data: str | None = None
    file_url: str | None = None
    filename: str | None = None


ContentPart = InputText | OutputText | Refusal | InputImage | InputFile


@attrs.frozen(kw_only=True)
class MessageItem:
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    type: Literal["message"] = "message"
    id: str | None = None
    status: str | None = None
    phase: str | None = None


@attrs.frozen(kw_only=True)
class FunctionCallItem:
    call_id: str
    name: str
    arguments: str
    type: Literal["function_call"] = "function_call"
    id: str | None = None
    status: str | None = None


@attrs.frozen(kw_only=True)
class FunctionCallOutputItem:
    call_id: str
    output: str | list[ContentPart]
    type: Literal["function_call_output"] = "function_call_output"
    id: str | None = None
    status: str | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem

# --- the request -----------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class FunctionTool:
    name: str
    type: Literal["function"] = "function"
    parameters: JsonObject | None = None
    description: str | None = None
    strict: bool | None = None


@attrs.frozen(kw_only=True)
class NamedFunction:
    name: str
    type: Literal["function"] = "function"


@attrs.frozen(kw_only=True)
class TextFormat:
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema: JsonObject | None = None
    description: str | None = None
    strict: bool | None = None


@attrs.frozen(kw_only=True)
class TextConfig:
    format: TextFormat = TextFormat()
    verbosity: str | None = None


@attrs.frozen(kw_only=True)
class ResponsesRequest:
    """POST /v1/responses. `seed` is an ninfer extension (the SDK sends it via extra_body)."""

    model: str
    input: str | list[InputItem] = ""
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[FunctionTool] = attrs.Factory(list)
    tool_choice: Literal["auto", "none", "required"] | NamedFunction = "auto"
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = attrs.field(default=None, validator=at_least(1))
    temperature: float | None = attrs.field(default=None, validator=between(0.0, 2.0))
    top_p: float | None = attrs.field(default=None, validator=between(0.0, 1.0))
    top_logprobs: int | None = attrs.field(default=None, validator=between(0, 20))
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    text: TextConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None  # accepted and ignored: one tier here
    stream_options: JsonObject | None = None
    reasoning: JsonObject | None = None
    background: bool | None = None
    seed: int | None = None
    # ninfer extensions: prefix-cache tenant isolation and read-only participation
    cache_salt: str | None = None
    cache_read_only: bool | None = None


converter = make_converter()
register_tagged_union(converter, ContentPart, "content part")
register_tagged_union(converter, InputItem, "input item", default_tag="message")


def _tool_choice(value, _type):
    if isinstance(value, str):
        return converter.structure(value, Literal["auto", "none", "required"])
    if isinstance(value, dict) and value.get("type") == "function":
        return converter.structure(value, NamedFunction)
    raise WireFormatError("expected 'auto', 'none', 'required' or {'type': 'function', 'name': ...}")


converter.register_structure_hook(Literal["auto", "none", "required"] | NamedFunction, _tool_choice)
register_tagged_union(converter, FunctionTool, "tool")


def parse_responses_request(body: Any) -> ResponsesRequest:
    """Structure and check a /v1/responses body; raises `WireFormatError` (a 400)."""
    request = _structure(converter, body, ResponsesRequest)
    if request.background:
        raise WireFormatError("background: background responses are not supported here", "background")
    if request.reasoning:
        raise WireFormatError("reasoning: this model is not a reasoning model", "reasoning")
    if request.input == "" and request.previous_response_id is None:
        raise WireFormatError("input: give some input (text or items)", "input")
    if request.input == []:
        raise WireFormatError("input: at least one input item is required", "input")
    to_tool_choice(request)  # validates a named tool
    return request


# --- conversion to the neutral chat form -----------------------------------------------------


def to_chat_call(
    request: ResponsesRequest, history: Sequence[dict[str, Any]] = (), *, request_id: str = ""
) -> ChatCall:
    """The neutral call: instructions, then the previous conversation, then this input."""
    system = [{"role": "system", "content": request.instructions}] if request.instructions else []
    messages = [*system, *history, *to_chat_messages(input_items(request))]
    if not messages:
        raise WireFormatError("input: give some input (text or items)", "input")
    return ChatCall(
        messages=tuple(messages),
        tools=tuple(to_tools(request.tools)),
        tool_choice=to_tool_choice(request),
        parallel_tool_calls=request.parallel_tool_calls is not False,
        response_format=to_response_format(request.text),
        max_tokens=request.max_output_tokens,
        sampling=SamplingOptions(temperature=request.temperature, top_p=request.top_p),
        seed=request.seed,
        logprobs=wants_logprobs(request),
        top_logprobs=request.top_logprobs or 0,
        cache_salt=request.cache_salt,
        cache_read_only=bool(request.cache_read_only),
        request_id=request_id,
    )


def to_response_format(text: TextConfig | None) -> ResponseFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(kind="json_object")
    if fmt.schema is None:
        raise WireFormatError("text.format.schema: json_schema needs a schema", "text.format.schema")
    return ResponseFormat(kind="json_schema", schema=fmt.schema, name=fmt.name)



def input_items(request: ResponsesRequest) -> list[InputItem]:
    """The request's input as items (a string is one user message)."""
    if isinstance(request.input, str):
        return [MessageItem(role="user", content=request.input)] if request.input else []
    return list(request.input)


def to_chat_messages(items: Sequence[InputItem], *, path: str = "input") -> list[dict[str, Any]]:
    """Items as chat-template dicts; function calls join the assistant message before them."""
    out: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        where = f"{path}.{index}"
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": content_text(item.content, f"{where}.content")})
        elif isinstance(item, FunctionCallItem):
            _assistant_for_calls(out)["tool_calls"].append(_tool_call(item, where))
        else:
            text = content_text(item.output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": text})
    return out


def content_text(content: str | list[ContentPart], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for index, part in enumerate(content):
        if isinstance(part, (InputText, OutputText)):
            texts.append(part.text)
        elif isinstance(part, Refusal):
            texts.append(part.refusal)
        else:
            reason = f"{part.type} parts are not supported: this model reads text only"
            raise WireFormatError(f"{where}.{index}: {reason}", f"{where}.{index}.type")
    return "".join(texts)


def _assistant_for_calls(out: list[dict[str, Any]]) -> dict[str, Any]:
    if not out or out[-1]["role"] != "assistant":
        out.append({"role": "assistant", "content": ""})
    out[-1].setdefault("tool_calls", [])
    return out[-1]


def _tool_call(item: FunctionCallItem, where: str) -> dict[str, Any]:
    try:
        arguments = json.loads(item.arguments) if item.arguments.strip() else {}
    except json.JSONDecodeError:
        raise WireFormatError(f"{where}.arguments: not valid JSON", f"{where}.arguments") from None
    if not isinstance(arguments, dict):
        raise WireFormatError(f"{where}.arguments: must be a JSON object", f"{where}.arguments")
    return chat_tool_call(item.call_id, item.name, arguments)


def output_messages(output: Sequence[OutputItem]) -> list[dict[str, Any]]:
    """A response's output as chat messages, for the next turn's history."""
    out: list[dict[str, Any]] = []
    for item in output:
        if isinstance(item, MessageOutput):
            out.append({"role": "assistant", "content": "".join(part.text for part in item.content)})
        elif isinstance(item, FunctionCallOutput):
            call = FunctionCallItem(call_id=item.call_id, name=item.name, arguments=item.arguments)
            _assistant_for_calls(out)["tool_calls"].append(_tool_call(call, "output"))
    return out


def to_tools(tools: Sequence[FunctionTool]) -> list[dict[str, Any]]:
    """Responses function tools (flat) as OpenAI chat function tools (nested)."""
    return [
        chat_tool(tool.name, tool.description, tool.parameters or {"type": "object", "properties": {}})
        for tool in tools
    ]


def to_tool_choice(request: ResponsesRequest) -> str | dict[str, str]:
    choice = request.tool_choice
    if isinstance(choice, NamedFunction):
        return named_tool_choice(choice.name, request.tools)
    if choice == "required" and not request.tools:
        raise WireFormatError("tool_choice: 'required' needs at least one tool in tools", "tool_choice")
    return choice if request.tools else "none"


def wants_logprobs(request: ResponsesRequest) -> bool:
    return "message.output_text.logprobs" in (request.include or ())
