"""Chat calls to prompt text and grammar constraints: templates, tools, tool_choice checks."""

from __future__ import annotations

from ninfer.grammar.closed_schema import closed_schema
from ninfer.grammar.constraint import GrammarError
from ninfer.grammar.tool_grammar import ToolSpec
from ninfer.protocols.calls import ChatCall, InvalidRequest

TOOL_CHOICE_MODES = ("auto", "none", "required")


def tool_specs(tools) -> list[ToolSpec]:
    """Name + parameter schema of each OpenAI function tool, checked."""
    specs: list[ToolSpec] = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequest("Each tool needs a function with a name.", f"tools.{i}.function")
        parameters = function.get("parameters") or {"type": "object"}
        if not isinstance(parameters, dict):
            raise InvalidRequest("Tool parameters must be a JSON schema object.", f"tools.{i}.function.parameters")
        try:
            specs.append(ToolSpec(function["name"], parameters))
        except ValueError as e:
            raise InvalidRequest(f"{e}.", f"tools.{i}.function.name") from None
    names = [s.name for s in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise InvalidRequest(f"Tool names must be unique; repeated: {', '.join(duplicates)}.", "tools")
    return specs


def forced_tool_name(call: ChatCall) -> str | None:
    choice = call.tool_choice
    return choice.get("name") if isinstance(choice, dict) else None


def validate_tool_choice(call: ChatCall) -> None:
    """Reject tool_choice values that cannot be honoured with the declared tools."""
    specs = tool_specs(call.tools)
    choice = call.tool_choice
    if isinstance(choice, dict):
        name = choice.get("name")
        if not isinstance(name, str):
            raise InvalidRequest("A named tool_choice needs the tool's name.", "tool_choice")
        if name not in {s.name for s in specs}:
            raise InvalidRequest(f"tool_choice names '{name}', which is not among the tools.", "tool_choice")
    elif choice not in TOOL_CHOICE_MODES:
        raise InvalidRequest(f"tool_choice must be one of {', '.join(TOOL_CHOICE_MODES)} or a named tool.", "tool_choice")
    elif choice == "required" and not specs:
        raise InvalidRequest("tool_choice 'required' needs at least one tool.", "tool_choice")
    forced = isinstance(choice, dict) or choice == "required"
    json_format = call.response_format is not None and call.response_format.kind != "text"
    if forced and json_format:
        raise InvalidRequest("response_format cannot be combined with a forced tool call.", "response_format")


def uses_tool_parser(call: ChatCall) -> bool:
    """Whether the answer's text is scanned for Hermes tool calls."""
    return bool(call.tools) and call.tool_choice != "none"


def render_chat(model, call: ChatCall) -> str:
    """The prompt text: messages (and tools, unless tool_choice is none) through the template."""
    from ninfer.models.chat_template import ChatTemplate, ChatTemplateError

    template = model.chat_template or ChatTemplate.chatml()
    tools = [dict(t) for t in call.tools] if uses_tool_parser(call) else None
    try:
        return template.render(list(call.messages), tools=tools, add_generation_prompt=True)
    except ChatTemplateError as e:
        raise InvalidRequest(f"The chat template rejected the messages: {e}", "messages") from None


def build_constraint(compiler, call: ChatCall):
    """The grammar for a forced tool call or a JSON response format (blocking: run in a thread)."""
    try:
        if call.tools and (call.tool_choice == "required" or isinstance(call.tool_choice, dict)):
            return _tool_constraint(compiler, call)
        fmt = call.response_format
        if fmt.kind == "json_object":
            return compiler.json_object()
        if fmt.schema is None:
            raise InvalidRequest("json_schema needs a schema.", "response_format.json_schema.schema")
        return compiler.json_schema(fmt.schema)
    except GrammarError as e:
        forced = call.tools and (call.tool_choice == "required" or isinstance(call.tool_choice, dict))
        param = "tools" if forced else "response_format.json_schema.schema"
        raise InvalidRequest(f"Unsupported schema: {e}", param, code="unsupported_schema") from None


def _tool_constraint(compiler, call: ChatCall):
    specs = [ToolSpec(s.name, closed_schema(s.parameters)) for s in tool_specs(call.tools)]
    name = forced_tool_name(call)
    if name is not None:
        return compiler.tool_calls([s for s in specs if s.name == name], parallel=False)
    return compiler.tool_calls(specs, parallel=call.parallel_tool_calls)
