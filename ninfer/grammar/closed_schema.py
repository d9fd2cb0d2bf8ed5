"""Closing open object schemas for forced tool calls (`closed_schema`).

Under a forced call the grammar lets the model write any key an open object allows, and a
small model invents keys and nests objects until max_tokens; a tool's parameters name the
keys the tool reads.
"""

from __future__ import annotations

_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_VALUES = ("items", "prefixItems", "additionalProperties", "contains", "not", "if", "then", "else")
_COMBINATORS = ("allOf", "anyOf", "oneOf")
_DEFINITIONS = ("$defs", "definitions")


def closed_schema(schema):
    """A copy of `schema` where every object schema without `additionalProperties` has
    `additionalProperties: false`; the caller's schema is never changed.

    Under a forced call the grammar lets the model write any key an open object allows, and a
    small model invents keys and nests objects until max_tokens; tool parameters name the keys
    the tool reads. Object schemas combined with others (an `allOf`, or an object's own
    `anyOf` / `oneOf`, whose members add properties, the members themselves and the
    definitions they `$ref`) stay as declared: closed, each would forbid the others' keys.
    """
    if not isinstance(schema, dict):
        return schema
    joined = _joined_definitions(schema)
    out = _closed(schema)
    for key in _DEFINITIONS:
        if isinstance(schema.get(key), dict):
            out[key] = {name: _closed(sub, joined=name in joined) for name, sub in schema[key].items()}
    return out


def _closed(schema, *, joined: bool = False):
    if not isinstance(schema, dict):
        return schema  # true / false
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_VALUES:
        if isinstance(out.get(key), list):
            out[key] = [_closed(sub) for sub in out[key]]
        elif isinstance(out.get(key), dict):
            out[key] = _closed(out[key])
    for key in _COMBINATORS:
        if isinstance(out.get(key), list):
            members_join = _members_join(out, key)
            out[key] = [_closed(sub, joined=members_join) for sub in out[key]]
            joined = joined or (members_join and any(_adds_keys(sub) for sub in out[key]))
    if not joined and _is_object_schema(out) and "additionalProperties" not in out:
        _close_object(out)
    return out


def _close_object(schema: dict) -> None:
    """additionalProperties: false, keeping the keys `required` names without declaring them
    (allowed with any value, as before) so closing never makes a usable schema unsatisfiable."""
    schema["additionalProperties"] = False
    properties = schema.get("properties", {})
    required = schema.get("required")
    if not isinstance(properties, dict) or not isinstance(required, list):
        return
    undeclared = [name for name in required if isinstance(name, str) and name not in properties]
    if undeclared:
        schema["properties"] = {**properties, **{name: {} for name in undeclared}}


def _members_join(schema: dict, key: str) -> bool:
    """Whether the members of `schema[key]` are combined with `schema` (not alternatives)."""
    return key == "allOf" or _is_object_schema(schema)


def _adds_keys(schema) -> bool:
    return isinstance(schema, dict) and any(k in schema for k in ("properties", "patternProperties", "$ref"))


def _is_object_schema(schema: dict) -> bool:
    kind = schema.get("type")
    if kind is None:
        return "properties" in schema
    return kind == "object" or (isinstance(kind, list) and "object" in kind)


def _joined_definitions(schema: dict) -> set[str]:
    """Names of the root definitions (`#/$defs/NAME`, `#/definitions/NAME`) that members
    combined with another schema (see `_members_join`) refer to, anywhere in `schema`."""
    names: set[str] = set()
    stack: list = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key in _COMBINATORS:
                members = node.get(key) if isinstance(node.get(key), list) and _members_join(node, key) else []
                for member in members:
                    ref = member.get("$ref") if isinstance(member, dict) else None
                    if isinstance(ref, str) and ref.startswith(("#/$defs/", "#/definitions/")):
                        names.add(ref.rsplit("/", 1)[1])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return names
