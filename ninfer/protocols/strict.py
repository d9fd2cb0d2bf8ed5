"""A strict cattrs converter for wire schemas, and precise errors when structuring fails.

cattrs' default scalar hooks coerce (`str(1)`, `int("3")`, `int(1.5)`); a wire API must reject
those with the field's path instead, so the converter here checks types exactly. Structuring
errors become one `WireFormatError` whose `param` is the dotted path of the first bad field.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterable
from typing import Any

import attrs
import cattrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError

JsonObject = dict[str, Any]  # a free-form JSON object (tool schemas, tool inputs)


class WireFormatError(ValueError):
    """A request body that does not match its schema; `param` is the field's dotted path."""

    def __init__(self, message: str, param: str | None = None, *, path: tuple[str, ...] = ()):
        super().__init__(message)
        self.message = message
        self.param = param
        self.path = path  # relative path while nested hooks are still unwinding


_JSON_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean"}


def _strict_scalar(kind: type):
    def hook(value, _type):
        # bool is an int subclass in Python but not in JSON.
        is_bool = isinstance(value, bool)
        if kind is float and isinstance(value, int) and not is_bool:
            return float(value)
        if not isinstance(value, kind) or (is_bool and kind is not bool):
            raise WireFormatError(f"expected {_JSON_NAMES[kind]}, got {_json_kind(value)}")
        return value

    return hook


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _json_object(value, _type):
    if not isinstance(value, dict):
        raise WireFormatError(f"expected an object, got {_json_kind(value)}")
    return value


def _literal(value, type_):
    allowed = typing.get_args(type_)
    if value not in allowed or type(value) is not type(allowed[0]):
        names = ", ".join(repr(a) for a in allowed)
        raise WireFormatError(f"expected one of {names}, got {value!r}")
    return value


def _dict_hook(converter: cattrs.Converter):
    def hook(value, type_):
        if not isinstance(value, dict):
            raise WireFormatError(f"expected an object, got {_json_kind(value)}")
        key_type, value_type = typing.get_args(type_) or (Any, Any)
        return {
            converter.structure(k, key_type): converter.structure(v, value_type) for k, v in value.items()
        }

    return hook


def _is_text_or_list(type_: Any) -> bool:
    """`str | list[X]` (optionally `| None`): the wire's "string shorthand or parts" fields."""
    args = typing.get_args(type_)
    if typing.get_origin(type_) not in (typing.Union, types.UnionType) or str not in args:
        return False
    rest = [a for a in args if a not in (str, type(None))]
    return len(rest) == 1 and typing.get_origin(rest[0]) is list


def _text_or_list_hook(converter: cattrs.Converter):
    def hook(value, type_):
        args = typing.get_args(type_)
        if isinstance(value, str) or (value is None and type(None) in args):
            return value
        if not isinstance(value, list):
            raise WireFormatError(f"expected a string or an array, got {_json_kind(value)}")
        (list_type,) = [a for a in args if a not in (str, type(None))]
        return converter.structure(value, list_type)

    return hook


def _list_hook(converter: cattrs.Converter):
    def hook(value, type_):
        # cattrs would iterate a string character by character.
        if not isinstance(value, list):
            raise WireFormatError(f"expected an array, got {_json_kind(value)}")
        (item_type,) = typing.get_args(type_) or (Any,)
        return [_structure_item(converter, item, item_type, index) for index, item in enumerate(value)]

    return hook


def _structure_item(converter: cattrs.Converter, item: Any, item_type: Any, index: int) -> Any:
    try:
        return converter.structure(item, item_type)
    except (ClassValidationError, IterableValidationError, ValueError, TypeError) as exc:
        path, leaf = _first_error(exc, [str(index)])
        raise WireFormatError(_describe(leaf), path=tuple(path)) from exc


def make_converter() -> cattrs.Converter:
    """A converter with exact scalar types, free-form JSON objects, and no unknown keys."""
    converter = cattrs.Converter(forbid_extra_keys=True, omit_if_default=False)
    for kind in (str, int, float, bool):
        converter.register_structure_hook(kind, _strict_scalar(kind))
    converter.register_structure_hook_func(lambda t: typing.get_origin(t) is dict, _dict_hook(converter))
    converter.register_structure_hook_func(lambda t: t == JsonObject, _json_object)
    converter.register_structure_hook_func(lambda t: typing.get_origin(t) is typing.Literal, _literal)
    converter.register_structure_hook_func(lambda t: typing.get_origin(t) is list, _list_hook(converter))
    converter.register_structure_hook_func(_is_text_or_list, _text_or_list_hook(converter))
    converter.register_structure_hook_factory(attrs.has, _object_hook_factory(converter))
    return converter


def _object_hook_factory(converter: cattrs.Converter):
    """cattrs' hook for an attrs class, but a non-object is named as such (cattrs would fail
    inside with a Python message, like "'float' object has no attribute 'keys'")."""

    def factory(cls):
        structure_fields = converter.gen_structure_attrs_fromdict(cls)

        def hook(value, type_):
            if not isinstance(value, dict):
                raise WireFormatError(f"expected an object, got {_json_kind(value)}")
            return structure_fields(value, type_)

        return hook

    return factory


def register_tagged_union(
    converter: cattrs.Converter, union: Any, what: str, *, default_tag: str | None = None
) -> None:
    """Structure `union` (attrs classes with a defaulted Literal `type`) by its "type" key.

    `default_tag` is the member an object without "type" is taken as (the wire's shorthand).
    """
    members = typing.get_args(union) or (union,)
    # Each member's own hook, taken before ours replaces a single-class "union".
    by_tag = {_tag_of(cls): converter.get_structure_hook(cls) for cls in members}

    def hook(value, _type):
        if not isinstance(value, dict):
            raise WireFormatError(f"expected {what} object, got {_json_kind(value)}")
        tag = value.get("type", default_tag)
        if tag not in by_tag:
            known = ", ".join(repr(t) for t in by_tag)
            raise WireFormatError(f"unknown {what} type {tag!r}; expected one of {known}")
        return by_tag[tag](value, _type)

    converter.register_structure_hook(union, hook)


def _tag_of(cls: type) -> str:
    (tag,) = typing.get_args(typing.get_type_hints(cls)["type"])
    return tag


def structure(converter: cattrs.Converter, data: Any, cls: type) -> Any:
    """`converter.structure`, but any failure is one `WireFormatError` naming the field."""
    if not isinstance(data, dict):
        raise WireFormatError(f"the request body must be a JSON object, got {_json_kind(data)}")
    try:
        return converter.structure(data, cls)
    except (ClassValidationError, IterableValidationError, ValueError, TypeError) as exc:
        path, leaf = _first_error(exc, [])
        param = ".".join(path) or None
        message = _describe(leaf)
        raise WireFormatError(f"{param}: {message}" if param else message, param) from exc


def _first_error(exc: BaseException, path: list[str]) -> tuple[list[str], BaseException]:
    """Walk cattrs' nested exception groups down to the first leaf, collecting the path."""
    if isinstance(exc, (ClassValidationError, IterableValidationError)):
        child = exc.exceptions[0]
        return _first_error(child, path + _step(child))
    if isinstance(exc, WireFormatError):
        return path + list(exc.path), exc
    return path, exc


def _step(exc: BaseException) -> list[str]:
    for note in getattr(exc, "__notes__", ()):
        name = getattr(note, "name", None)
        if name is not None:
            return [str(name)]
        index = getattr(note, "index", None)
        if index is not None:
            return [str(index)]
    return []


def _describe(exc: BaseException) -> str:
    if isinstance(exc, KeyError):
        return f"the required field {exc.args[0]!r} is missing"
    if isinstance(exc, ForbiddenExtraKeysError):
        return f"unknown field(s): {', '.join(sorted(exc.extra_fields))}"
    if isinstance(exc, WireFormatError):
        return exc.message
    if isinstance(exc, (ValueError, TypeError)) and exc.args:
        return str(exc.args[0])
    return f"invalid value ({exc})"


def named_tool_choice(name: str | None, tools: Iterable[Any]) -> dict[str, str]:
    """A tool_choice naming one tool, as {"name": ...}; a 400 unless `tools` declares it."""
    if name not in {tool.name for tool in tools}:
        raise WireFormatError(f"tool_choice.name: {name!r} is not one of the declared tools", "tool_choice.name")
    return {"name": name}


def at_least(lo: float):
    """attrs validator: `value >= lo` (None passes), reported at the field's path."""
    return between(lo, None)


def between(lo: float | None, hi: float | None):
    """attrs validator: `lo <= value <= hi` (None bounds and None values pass)."""

    def check(instance, attribute, value):
        if value is None:
            return
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            bounds = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
            raise WireFormatError(
                f"must be {bounds}, got {value}", path=(attribute.name,)
            )

    return check


def stop_sequences(limit: int):
    """attrs validator: at most `limit` strings, none empty, reported at the field's path (an
    empty stop sequence would end every answer before its first token)."""

    def check(instance, attribute, value):
        if len(value) > limit:
            raise WireFormatError(f"at most {limit} stop sequences are allowed, got {len(value)}", path=(attribute.name,))
        for index, text in enumerate(value):
            if not text:
                raise WireFormatError("stop sequences must not be empty", path=(attribute.name, str(index)))

    return check
