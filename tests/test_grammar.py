"""llguidance constraints on the real SmolLM2 vocabulary.

The property behind structured output: whatever token the sampler picks among the allowed
ones, the finished text is valid. Random walks over the masks (seeded, uniform over allowed
tokens) stand in for any sampler; each finished text is checked by an independent validator
written here for the schema subset used.
"""

from __future__ import annotations

import copy
import json
import random

import numpy as np
import pytest

from ninfer.grammar import GrammarCompiler, GrammarError
from ninfer.grammar.closed_schema import closed_schema
from ninfer.grammar.tool_grammar import ToolSpec
from ninfer.protocols.calls import ChatCall, chat_tool
from ninfer.protocols.tool_calls import split_tool_calls
from ninfer.server.chat_prompt import build_constraint

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 5}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [ToolSpec("get_weather", WEATHER_PARAMS), ToolSpec("get_time", {"type": "object", "properties": {}, "additionalProperties": False})]


def validate(value, schema) -> None:
    """A small JSON-schema validator for the keywords these tests use (the oracle)."""
    if "enum" in schema:
        assert value in schema["enum"], (value, schema)
        return
    kind = schema.get("type")
    if kind == "object":
        assert isinstance(value, dict)
        props = schema.get("properties", {})
        assert set(schema.get("required", ())) <= value.keys()
        if schema.get("additionalProperties") is False:
            assert value.keys() <= props.keys(), value
        for key, item in value.items():
            if key in props:
                validate(item, props[key])
    elif kind == "string":
        assert isinstance(value, str) and len(value) <= schema.get("maxLength", 1 << 30)
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool)
        assert schema.get("minimum", -(1 << 60)) <= value <= schema.get("maximum", 1 << 60)
    elif kind == "boolean":
        assert isinstance(value, bool)
    elif kind == "array":
        assert isinstance(value, list) and len(value) <= schema.get("maxItems", 1 << 30)
        for item in value:
            validate(item, schema["items"])


@pytest.fixture(scope="module")
def compiler(smollm2):
    return GrammarCompiler(
        smollm2.tokenizer.to_json_str(), vocab_size=smollm2.spec.vocab_size, stop_token_ids=smollm2.stop_token_ids
    )


def random_walk(constraint, tokenizer, stop_ids, rng: random.Random, max_steps: int = 300) -> str:
    """Pick uniformly among allowed tokens until the grammar finishes or only a stop token fits."""
    stops = np.array(sorted(stop_ids))
    ids = []
    for _ in range(max_steps):
        if constraint.is_finished():
            break
        mask = constraint.allowed_mask()
        assert mask.any(), "the grammar allowed no token at all"
        may_stop = bool(mask[stops].any())
        mask[stops] = False
        content = np.flatnonzero(mask)
        # Once a stop token is allowed the text is complete; end there half the time.
        if content.size == 0 or (may_stop and rng.random() < 0.5):
            break
        token = int(content[rng.randrange(content.size)])
        constraint.advance(token)
        ids.append(token)
    else:
        pytest.fail("the walk did not finish")
    assert constraint.is_accepting()
    return tokenizer.decode(ids)


def test_mask_shape_and_first_token(compiler, smollm2):
    constraint = compiler.json_schema(PERSON)
    mask = constraint.allowed_mask()
    assert mask.dtype == bool and mask.shape == (smollm2.spec.vocab_size,)
    allowed_text = {smollm2.tokenizer.decode([int(t)]) for t in np.flatnonzero(mask)}
    assert allowed_text and all(t.startswith("{") for t in allowed_text)


@pytest.mark.parametrize("seed", range(12))
def test_every_walk_through_a_schema_validates(compiler, smollm2, seed):
    stop_ids = set(smollm2.stop_token_ids)
    text = random_walk(compiler.json_schema(PERSON), smollm2.tokenizer, stop_ids, random.Random(seed))
    validate(json.loads(text), PERSON)


def test_json_object_allows_any_object_and_nothing_else(compiler, smollm2):
    tokenizer = smollm2.tokenizer
    constraint = compiler.json_object()
    for token in tokenizer.encode('{"a":[1,{"b":null}],"c":"x\\n"}'):
        assert constraint.allowed_mask()[token]
        constraint.advance(token)
    assert constraint.is_finished() and constraint.is_accepting()
    for not_an_object in ("[1,2]", '"text"', "42", " {"):
        assert not compiler.json_object().allowed_mask()[tokenizer.encode(not_an_object)[0]]


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_every_tool_call_walk_names_a_declared_tool_with_valid_arguments(compiler, smollm2, seed, parallel):
    stop_ids = set(smollm2.stop_token_ids)
    constraint = compiler.tool_calls(TOOLS, parallel=parallel)
    text = random_walk(constraint, smollm2.tokenizer, stop_ids, random.Random(seed))
    content, calls = split_tool_calls(text)
    assert content == ""
    assert 1 <= len(calls) <= (8 if parallel else 1)
    schemas = {t.name: t.parameters for t in TOOLS}
    for call in calls:
        validate(json.loads(call.arguments), schemas[call.name])


def test_a_forced_tool_allows_only_that_tool(compiler, smollm2):
    constraint = compiler.tool_calls([TOOLS[1]], parallel=False)
    text = random_walk(constraint, smollm2.tokenizer, set(smollm2.stop_token_ids), random.Random(0))
    assert [c.name for c in split_tool_calls(text)[1]] == ["get_time"]


OPEN_WEATHER = {  # no additionalProperties anywhere: any other key would be valid JSON-schema-wise
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 5}, "near": {"type": "object", "properties": {"north": {"type": "boolean"}}}},
}  # fmt: skip


@pytest.mark.parametrize("seed", range(6))
def test_a_forced_call_closes_open_object_schemas(compiler, smollm2, seed):
    # Open, the grammar let a forced call invent keys and nest objects until max_tokens.
    sent = copy.deepcopy(OPEN_WEATHER)
    call = ChatCall(messages=({"role": "user", "content": "Weather?"},), tools=(chat_tool("get_weather", None, OPEN_WEATHER),),
                    tool_choice="required", parallel_tool_calls=False)  # fmt: skip
    text = random_walk(build_constraint(compiler, call), smollm2.tokenizer, set(smollm2.stop_token_ids), random.Random(seed))
    (tool_call,) = split_tool_calls(text)[1]
    arguments = json.loads(tool_call.arguments)
    assert arguments.keys() <= {"city", "near"} and arguments.get("near", {}).keys() <= {"north"}
    assert OPEN_WEATHER == sent  # the caller's schema (and what the prompt shows) is unchanged


def accepts(constraint, tokenizer, text: str) -> bool:
    for token in tokenizer.encode(text):
        if not constraint.allowed_mask()[token]:
            return False
        constraint.advance(token)
    return constraint.is_accepting()


INT = {"type": "integer"}
OBJ_A = {"type": "object", "properties": {"a": INT}}
OBJ_B = {"type": "object", "properties": {"b": INT}}


@pytest.mark.parametrize(
    ("schema", "allowed", "refused"),
    [
        ({"type": "object", "properties": {"a": {"properties": {"b": INT}}}}, ['{"a":{"b":1}}', "{}"], ['{"c":1}', '{"a":{"c":1}}']),
        ({"type": "object", "properties": {"a": INT}, "additionalProperties": INT}, ['{"a":1,"z":2}'], ['{"z":"x"}']),
        ({"type": "array", "items": {"$ref": "#/$defs/P"}, "$defs": {"P": OBJ_A}}, ['[{"a":1}]'], ['[{"b":1}]']),
        ({"anyOf": [OBJ_A, OBJ_B]}, ['{"a":1}', '{"b":2}'], ['{"c":3}', '{"a":1,"b":2}']),
        # Combined objects stay open: closed, each would forbid the keys the other adds.
        ({"allOf": [OBJ_A, OBJ_B]}, ['{"a":1,"b":2}'], []),
        ({"type": "object", "allOf": [{"$ref": "#/$defs/A"}, OBJ_B], "$defs": {"A": OBJ_A}}, ['{"a":1,"b":2}'], []),
        ({"type": "object", "properties": {"a": INT}, "anyOf": [OBJ_B]}, ['{"a":1,"b":2}'], []),
        # A required key the schema does not declare stays allowed (closing must not make it unsatisfiable).
        ({"type": "object", "properties": {"a": INT}, "required": ["b"]}, ['{"b":[1]}', '{"a":1,"b":2}'], ['{"c":1}', "{}"]),
        # ... but members that only add `required` leave the object closed.
        ({"type": "object", "properties": {"a": INT, "b": INT}, "anyOf": [{"required": ["a"]}, {"required": ["b"]}]},
         ['{"a":1,"b":2}', '{"b":2}'], ['{"a":1,"c":3}', "{}"]),
    ],
)  # fmt: skip
def test_closed_schemas_allow_only_declared_keys(compiler, smollm2, schema, allowed, refused):
    sent = copy.deepcopy(schema)
    closed = closed_schema(schema)
    assert schema == sent
    for text in allowed:
        assert accepts(compiler.json_schema(closed), smollm2.tokenizer, text), text
    for text in refused:
        assert not accepts(compiler.json_schema(closed), smollm2.tokenizer, text), text


def test_a_rejected_token_ends_the_constraint_instead_of_raising(compiler, smollm2):
    constraint = compiler.json_schema(PERSON)
    not_allowed = int(np.flatnonzero(~constraint.allowed_mask())[0])
    constraint.advance(not_allowed)
    assert constraint.is_finished() and constraint.error


@pytest.mark.parametrize(
    "schema, words",
    [
        ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not"),
        ({"type": "string", "format": "no-such-format"}, "format"),
        ({"$ref": "#/definitions/missing"}, "missing"),
    ],
)
def test_unsupported_schemas_raise_a_clear_error(compiler, schema, words):
    with pytest.raises(GrammarError, match=words):
        compiler.json_schema(schema)


def test_tool_names_are_checked():
    with pytest.raises(ValueError, match="tool name"):
        ToolSpec("has space")
