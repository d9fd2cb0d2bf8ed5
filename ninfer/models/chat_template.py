"""Chat templates: a model's Jinja template rendered the way Hugging Face's `apply_chat_template` does.

The environment matches transformers': `ImmutableSandboxedEnvironment` with `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension, a `{% generation %}` tag that renders its body,
globals `raise_exception` / `strftime_now`, and a `tojson` filter that keeps non-ASCII text
(`ensure_ascii=False`) and takes `indent`. Variables: `messages`, `tools`, `documents`,
`add_generation_prompt`, `bos_token`, `eos_token`, plus anything passed as `**extra`.

Two adaptations make any template usable by the OpenAI / Anthropic front ends:

- Content parts. A template that never loops over `message.content` expects a string; a list of
  text parts is then joined with newlines (None becomes ""). Templates that loop get the list.
- Tools. A template that never reads `tools` (SmolLM2's, for one) cannot show them, so `render`
  rewrites the conversation Hermes-style before rendering: the tool signatures go into the
  system message inside `<tools></tools>` (after the caller's system text, or as a new system
  message), each assistant tool call is appended to its content as `<tool_call>{json}</tool_call>`,
  and each run of tool results becomes one user message of `<tool_response>` blocks.
  `ChatTemplate.chatml()` does the same inside its own Jinja source, for models with no template.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template failed to compile or render (the message says why, in one sentence)."""


TOOLS_PROMPT_HEAD = (
    "# Tools\n\nYou can call functions to help with the user's request. "
    "Their signatures are listed as JSON inside <tools></tools> tags:\n<tools>"
)
TOOLS_PROMPT_TAIL = (
    "\n</tools>\n\nTo call a function, reply with a JSON object holding its name and arguments "
    'inside <tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, '
    '"arguments": <arguments-json-object>}\n</tool_call>'
)

_CHATML_SOURCE = """\
{%- set has_system = messages and messages[0].role == 'system' %}
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if has_system %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- TOOLS_HEAD }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- TOOLS_TAIL + '<|im_end|>\\n' }}
{%- elif has_system %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if loop.first and has_system %}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}
{{- '\\n<tool_call>\\n{"name": ' + (fn.name | tojson) + ', "arguments": ' }}
{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

CHATML_TEMPLATE = (
    "{%- set TOOLS_HEAD = " + json.dumps(TOOLS_PROMPT_HEAD) + " %}\n"
    "{%- set TOOLS_TAIL = " + json.dumps(TOOLS_PROMPT_TAIL) + " %}\n" + _CHATML_SOURCE
)

# Marks the end of the final message when continuing it (assistant prefill).
_CONTINUE_MARK = "\x00NINFER_CONTINUE\x00"


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers): render the body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _loops_over_content(ast: jinja2.nodes.Template) -> bool:
    """Whether the template iterates `x.content` / `x['content']` (i.e. expects content parts)."""
    for loop in ast.find_all(jinja2.nodes.For):
        for node in [loop.iter, *loop.iter.find_all((jinja2.nodes.Getattr, jinja2.nodes.Getitem))]:
            if isinstance(node, jinja2.nodes.Getattr) and node.attr == "content":
                return True
            if isinstance(node, jinja2.nodes.Getitem) and getattr(node.arg, "value", None) == "content":
                return True
    return False


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may reference."""

    def __init__(self, source: str, *, bos_token: str | None = None, eos_token: str | None = None):
        env = _environment()
        try:
            ast = env.parse(source)
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from None
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        variables = jinja2.meta.find_undeclared_variables(ast)
        self.supports_tools = "tools" in variables
        self.content_format = "parts" if _loops_over_content(ast) else "string"

    @classmethod
    def chatml(cls, *, bos_token: str | None = None, eos_token: str | None = "<|im_end|>") -> ChatTemplate:
        """The default for models without a template: ChatML with Hermes-style tools."""
        return cls(CHATML_TEMPLATE, bos_token=bos_token, eos_token=eos_token)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **extra: Any,
    ) -> str:
        """The prompt text for `messages` (plain dicts: role, content, tool_calls, ...).

        `continue_final_message` leaves the last message open so generation continues it (an
        assistant prefill); it implies no generation prompt.
        """
        messages = [self._prepare_message(m) for m in messages]
        if not self.supports_tools:
            messages = _hermes_messages(messages, tools)
            tools = None
        if continue_final_message:
            messages = _mark_final_message(messages)
            add_generation_prompt = False
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token, "documents": None}
        variables.update(extra)
        try:
            text = self._template.render(
                messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template rejected the conversation: {exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise ChatTemplateError(f"the chat template failed on this conversation: {exc!r}") from None
        return _cut_at_mark(text) if continue_final_message else text

    def _prepare_message(self, message: Mapping[str, Any]) -> dict[str, Any]:
        message = dict(message)
        content = message.get("content")
        if self.content_format == "string" and not isinstance(content, str):
            message["content"] = _join_text_parts(content)
        return message


def _join_text_parts(content) -> str:
    """Text of a content-part list ({"type": "text", "text": ...}); None -> ""."""
    if content is None:
        return ""
    if isinstance(content, Mapping):
        content = [content]
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping) and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ChatTemplateError(f"message content part of type {kind!r} cannot be shown to a text model")
    return "\n".join(texts)


def tools_system_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The Hermes-style system text listing `tools` (the same text `chatml()` renders)."""
    return TOOLS_PROMPT_HEAD + "".join("\n" + _tojson(t) for t in tools) + TOOLS_PROMPT_TAIL


def _tool_call_text(call: Mapping[str, Any]) -> str:
    fn = call.get("function", call)
    arguments = fn.get("arguments")
    if not isinstance(arguments, str):  # OpenAI sends a JSON string, HF-style callers a dict
        arguments = _tojson(arguments if arguments is not None else {})
    name = _tojson(fn.get("name"))
    return f'<tool_call>\n{{"name": {name}, "arguments": {arguments}}}\n</tool_call>'


def _hermes_messages(messages: list[dict], tools) -> list[dict]:
    """Rewrite tools, tool calls and tool results as text a tool-unaware template renders."""
    out: list[dict] = []
    for message in messages:
        role, content = message.get("role"), message.get("content")
        content = content if isinstance(content, str) else _join_text_parts(content)
        if role == "assistant" and message.get("tool_calls"):
            calls = [_tool_call_text(c) for c in message["tool_calls"]]
            text = "\n".join([content, *calls]) if content else "\n".join(calls)
            out.append({**{k: v for k, v in message.items() if k != "tool_calls"}, "content": text})
        elif role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append(message)
    for message in out:
        message.pop("_tool_results", None)
    if tools:
        prompt = tools_system_prompt(tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}".lstrip("\n")}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _mark_final_message(messages: list[dict]) -> list[dict]:
    if not messages:
        raise ChatTemplateError("continue_final_message needs at least one message")
    last = dict(messages[-1])
    content = last.get("content")
    if isinstance(content, str):
        last["content"] = content + _CONTINUE_MARK
    else:
        parts = [dict(p) for p in content or ()]
        texts = [p for p in parts if isinstance(p.get("text"), str)]
        if not texts:
            raise ChatTemplateError("continue_final_message needs text in the final message")
        texts[-1]["text"] += _CONTINUE_MARK
        last["content"] = parts
    return [*messages[:-1], last]


def _cut_at_mark(text: str) -> str:
    at = text.rfind(_CONTINUE_MARK)
    if at < 0:
        raise ChatTemplateError("the chat template dropped the final message, so it cannot be continued")
    return text[:at]
