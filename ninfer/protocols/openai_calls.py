"""OpenAI chat / completion requests (parsed by `ninfer.protocols.openai`) to service calls.

Text-only content is joined, `developer` becomes `system`, assistant tool-call arguments are
parsed into objects (as chat templates expect), and features ninfer cannot honour are
rejected with an `InvalidRequest` naming the field.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from ninfer.protocols.calls import (
    ChatCall, CompletionCall, InvalidRequest, ResponseFormat, SamplingOptions, chat_tool_call,
)  # fmt: skip
from ninfer.protocols.openai import (
    MAX_STOP_SEQUENCES, AssistantMessage, ChatCompletionRequest, CompletionRequest, Content, JsonObjectFormat,
    Message, NamedToolChoice, RefusalPart, ResponseFormatIn, SamplerFields, SystemMessage, TextFormat, TextPart,
    TokenizeRequest, UserMessage,
)  # fmt: skip


def _text_of(content: Content | None, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, TextPart):
            texts.append(part.text)
        elif isinstance(part, RefusalPart):
            texts.append(part.refusal)
        else:
            raise InvalidRequest(f"{part.type} content is not supported: this model reads text only.",
                                 f"{param}.{j}", code="unsupported_content")  # fmt: skip
    return "".join(texts)


def _arguments(text: str, param: str) -> dict[str, Any]:
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError:
        raise InvalidRequest("Tool call arguments must be a JSON object text.", param) from None
    if not isinstance(value, dict):
        raise InvalidRequest("Tool call arguments must be a JSON object text.", param)
    return value


def template_messages(messages: list[Message]) -> tuple[dict[str, Any], ...]:
    """Wire messages to Hugging Face chat-template dicts (text only; developer -> system)."""
    out: list[dict[str, Any]] = []
    names_by_call_id: dict[str, str] = {}
    for i, m in enumerate(messages):
        param = f"messages.{i}.content"
        if isinstance(m, SystemMessage):
            out.append({"role": "system", "content": _text_of(m.content, param)})
        elif isinstance(m, UserMessage):
            out.append({"role": "user", "content": _text_of(m.content, param)})
        elif isinstance(m, AssistantMessage):
            out.append(_assistant_dict(m, i, names_by_call_id))
        else:
            item = {"role": "tool", "tool_call_id": m.tool_call_id, "content": _text_of(m.content, param)}
            name = m.name or names_by_call_id.get(m.tool_call_id)
            if name:
                item["name"] = name
            out.append(item)
    return tuple(out)


def _assistant_dict(m: AssistantMessage, i: int, names_by_call_id: dict[str, str]) -> dict[str, Any]:
    item: dict[str, Any] = {"role": "assistant", "content": _text_of(m.content, f"messages.{i}.content")}
    if m.tool_calls:
        calls = []
        for j, call in enumerate(m.tool_calls):
            names_by_call_id[call.id] = call.function.name
            args = _arguments(call.function.arguments, f"messages.{i}.tool_calls.{j}.function.arguments")
            calls.append(chat_tool_call(call.id, call.function.name, args))
        item["tool_calls"] = calls
    return item


def _stop_tuple(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOP_SEQUENCES:
        raise InvalidRequest(f"At most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(stops)}.", "stop")
    if any(not s for s in stops):
        raise InvalidRequest("Stop sequences must not be empty.", "stop")
    return stops


def _sampling(req: SamplerFields) -> SamplingOptions:
    top_k = req.top_k if req.top_k not in (-1,) else 0
    return SamplingOptions(
        temperature=req.temperature, top_p=req.top_p, top_k=top_k, min_p=req.min_p,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
    )  # fmt: skip


def _check_common(req: ChatCompletionRequest | CompletionRequest) -> None:
    if req.n not in (None, 1):
        raise InvalidRequest("Only n=1 is supported: send one request per answer.", "n", code="unsupported_value")
    if req.logit_bias:
        raise InvalidRequest("logit_bias is not supported.", "logit_bias", code="unsupported_value")


def _response_format(fmt: ResponseFormatIn | None) -> ResponseFormat | None:
    if fmt is None or isinstance(fmt, TextFormat):
        return None
    if isinstance(fmt, JsonObjectFormat):
        return ResponseFormat(kind="json_object")
    if fmt.json_schema.schema is None:
        raise InvalidRequest("json_schema needs a schema.", "response_format.json_schema.schema")
    return ResponseFormat(kind="json_schema", schema=fmt.json_schema.schema, name=fmt.json_schema.name)


def chat_call(req: ChatCompletionRequest, request_id: str) -> ChatCall:
    """The service call for a parsed chat request (raises InvalidRequest)."""
    _check_common(req)
    if not req.messages:
        raise InvalidRequest("messages must hold at least one message.", "messages")
    if req.modalities and req.modalities != ["text"]:
        raise InvalidRequest("Only the text modality is supported.", "modalities", code="unsupported_value")
    if req.top_logprobs and not req.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs set to true.", "top_logprobs")
    choice = req.tool_choice or "auto"
    if isinstance(choice, NamedToolChoice):
        choice = {"name": choice.function.name}
    return ChatCall(
        messages=template_messages(req.messages),
        tools=tuple(attrs.asdict(t, filter=lambda a, v: v is not None) for t in req.tools or ()),
        tool_choice=choice,
        parallel_tool_calls=req.parallel_tool_calls is not False,
        response_format=_response_format(req.response_format),
        max_tokens=req.max_completion_tokens or req.max_tokens,
        sampling=_sampling(req), stop=_stop_tuple(req.stop), seed=req.seed,
        logprobs=bool(req.logprobs), top_logprobs=req.top_logprobs or 0,
        cache_salt=req.cache_salt, cache_read_only=bool(req.cache_read_only), request_id=request_id,
        ignore_eos=bool(req.ignore_eos),
    )  # fmt: skip


def completion_call(req: CompletionRequest, request_id: str) -> CompletionCall:
    """The service call for a parsed completions request (one prompt only)."""
    _check_common(req)
    if req.best_of not in (None, 1):
        raise InvalidRequest("Only best_of=1 is supported.", "best_of", code="unsupported_value")
    if req.suffix:
        raise InvalidRequest("suffix is not supported.", "suffix", code="unsupported_value")
    if req.echo and req.logprobs is not None:
        raise InvalidRequest("echo with logprobs is not supported: prompt log-probabilities are "
                             "not computed.", "echo", code="unsupported_value")  # fmt: skip
    return CompletionCall(
        prompt=_single_prompt(req.prompt),
        max_tokens=req.max_tokens, sampling=_sampling(req), stop=_stop_tuple(req.stop),
        seed=req.seed, logprobs=req.logprobs is not None, top_logprobs=req.logprobs or 0,
        cache_salt=req.cache_salt, cache_read_only=bool(req.cache_read_only), request_id=request_id,
        ignore_eos=bool(req.ignore_eos),
    )  # fmt: skip


def _single_prompt(prompt) -> str | tuple[int, ...]:
    if isinstance(prompt, str):
        return prompt
    if prompt and all(isinstance(t, int) for t in prompt):
        return tuple(prompt)
    if len(prompt) == 1:
        return _single_prompt(prompt[0])
    raise InvalidRequest("Exactly one prompt per request is supported.", "prompt", code="unsupported_value")


def tokenize_chat_call(req: TokenizeRequest) -> ChatCall:
    """The chat call whose prompt /v1/tokenize counts."""
    return ChatCall(
        messages=template_messages(req.messages or []),
        tools=tuple(attrs.asdict(t, filter=lambda a, v: v is not None) for t in req.tools or ()),
    )  # fmt: skip
