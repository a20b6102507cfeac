"""Structured output's grammar (json_schema.py, json_schema_grammar.py): what it takes and refuses, checked
against the `jsonschema` reference validator; random walks through the grammar give only values the schema
takes; the vocabulary's masks for its states equal a token-by-token check; schemas it cannot enforce are
refused with the keyword and where it is."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from lorafleet.worker.json_schema import SchemaError, compile_schema
from lorafleet.worker.json_schema_grammar import DONE, SchemaGrammar, schema_grammar
from lorafleet.worker.json_vocab import JsonVocab

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c d"]}, "minItems": 1, "maxItems": 2},
        "kind": {"const": "person"},
        "score": {"type": ["number", "null"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "kind"],
}
TREE = {"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {
    "type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}}, "required": ["v"]}}, "$ref": "#/$defs/node"}
UNION = {"anyOf": [
    {"type": "object", "properties": {"a": {"type": "number"}}, "required": ["a"]},
    {"type": "object", "properties": {"ab": {"type": "string"}, "c": {"enum": [1, 12, 1.5, True, None]}}, "required": ["c"]},
]}
FREE = {"type": "object", "properties": {"key": {"type": "string"}}, "additionalProperties": {"type": ["integer", "object"]}}
NAMES = {"type": "object", "properties": {"a b": {"type": "boolean"}, "a\tb": {"type": "null"}, "é\"x": {"type": "boolean"}}}
ARRAY = {"type": "array", "items": {"type": "object"}, "minItems": 1}
SCHEMAS = [PERSON, TREE, UNION, FREE, NAMES, ARRAY, {"type": "string"}, {"enum": ["yes", "no", {"x": [1, 2]}]}]


def accepts(schema: dict, text: str) -> bool:
    grammar = schema_grammar(schema)
    return grammar.advance(grammar.start, text.encode()) == DONE


@pytest.mark.parametrize("schema, text, ok", [
    (PERSON, '{"name":"x","kind":"person"}', True),
    (PERSON, '{ "kind" : "person" ,\n "name": "\\u00e9\\n", "age": -0, "score": 1.5e-3, "tags": ["c d"], "ok": false }', True),
    (PERSON, '{"name":"x"}', False),  # kind is required
    (PERSON, '{"name":"x","kind":"person","name":"y"}', False),  # a key twice
    (PERSON, '{"name":"x","kind":"person","other":1}', False),  # properties listed, additionalProperties unset
    (PERSON, '{"name":"x","kind":"person","age":1.5}', False),
    (PERSON, '{"name":"x","kind":"person","age":1e3}', False),
    (PERSON, '{"name":"x","kind":"person","tags":[]}', False),  # minItems
    (PERSON, '{"name":"x","kind":"person","tags":["a","b","a"]}', False),  # maxItems
    (PERSON, '{"name":"x","kind":"person","tags":["ab"]}', False),
    (PERSON, '{"name":"x","kind":"robot"}', False),
    (PERSON, '{"name":"x","kind":"person","score":null,"ok":true}', True),
    (PERSON, '{"name":1,"kind":"person"}', False),
    (TREE, '{"v":1,"kids":[{"v":2,"kids":[]},{"v":3,"kids":[{"v":4}]}]}', True),
    (TREE, '{"v":1,"kids":[{"v":2},{"v":3},{"v":4}]}', False),
    (TREE, '{"kids":[]}', False),
    (UNION, '{"a":-2.5}', True),
    (UNION, '{"ab":"x","c":12}', True),
    (UNION, '{"c":1.5}', True),
    (UNION, '{"c":true}', True),
    (UNION, '{"c":13}', False),
    (UNION, '{"c":1.50}', False),  # enum values in their compact encoding
    (UNION, '{"a":1,"c":1}', False),
    (FREE, '{"key":"v","other":3,"k":{"x":[null]}}', True),
    (FREE, '{"ke":1,"keyz":{}}', True),  # prefixes of a listed name are other keys
    (FREE, '{"other":"s"}', False),
    (NAMES, '{"a b":true,"a\\tb":null,"é\\"x":false}', True),
    (NAMES, '{"a\\tb":true}', False),
    (ARRAY, '[{}, {"x": [1, {"y": "z"}]}]', True),
    (ARRAY, "[]", False),
    ({"type": "string"}, '"a\\u00e9\\ud83d\\ude00"', True),
    ({"type": "string"}, '"\\ud83d"', False),
    ({"enum": ["yes", "no", {"x": [1, 2]}]}, '{"x":[1,2]}', True),
    ({"enum": ["yes", "no", {"x": [1, 2]}]}, '{"x": [1, 2]}', False),
    ({"enum": ["yes", "no", {"x": [1, 2]}]}, '"yes"', True),
])
def test_the_grammar_takes_what_the_schema_does(schema, text, ok):
    assert accepts(schema, text) is ok
    if ok:  # the reference validator agrees
        jsonschema.Draft202012Validator(schema).validate(json.loads(text))


def test_nothing_may_follow_a_complete_value_and_prefixes_are_not_complete():
    grammar = schema_grammar(PERSON)
    state = grammar.advance(grammar.start, b'{"name":"x","kind":"person"')
    assert state is not None and state != DONE and not grammar.is_complete(state)
    assert grammar.advance(state, b"}") == DONE and grammar.advance(state, b"} ") is None
    assert grammar.advance(DONE, b"") == DONE and grammar.advance(DONE, b"x") is None


def _allowed(grammar: SchemaGrammar, state) -> list[int]:
    return [b for b in range(256) if grammar.advance(state, bytes((b,))) is not None]


def _walk(grammar: SchemaGrammar, rng: random.Random, max_bytes: int = 600) -> str | None:
    """A random value of the grammar, byte by byte (closing bytes favoured as it grows); None if none ended."""
    state, out = grammar.start, bytearray()
    for step in range(max_bytes):
        allowed = _allowed(grammar, state)
        assert allowed, bytes(out)  # a state the grammar reaches always has a way on
        closing = [b for b in allowed if b in b'"}]0']
        pick = rng.choice(closing) if closing and rng.random() < min(0.9, step / 80) else rng.choice(allowed)
        out.append(pick)
        state = grammar.advance(state, bytes((pick,)))
        if state == DONE:
            return out.decode()
    return None


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
def test_random_walks_give_values_the_reference_validator_takes(schema):
    grammar, rng = schema_grammar(schema), random.Random(7)
    validator = jsonschema.Draft202012Validator(schema)
    done = [t for t in (_walk(grammar, rng) for _ in range(40)) if t is not None]
    assert len(done) >= 10
    for text in done:
        validator.validate(json.loads(text))
        assert accepts(schema, text)  # the same bytes at once, as a token holding them all


def test_the_vocabularys_masks_for_schema_states_equal_a_token_by_token_check():
    """Inside keys and enum values whitespace bytes lead to different states (" " may continue "a b" where "\\t"
    may not), so those masks are built token by token; elsewhere by the buckets' shortcuts."""
    pieces = [" ", "\t", "\n ", " a", "\tb", "a", "b", "a b", "\"", "\"a", "\" ", "{", "{\"", "}", "]", "[", ",", ":",
              "1", "12", ".5", "e", "-", "true", "null", "x", "é", "\\", "\\t", "\\u00e9", "\":", "\": ", " }", "\"}",
              "\"a\\tb", "c d", "\"c", " d\"", "person", "\"kind\"", "\"name\":\"", "  \"", "ue", "\xff"]
    tokens = [p.encode("latin-1") if p == "\xff" else p.encode() for p in pieces]
    vocab = JsonVocab([*tokens, None])
    rng = random.Random(3)
    checked = 0
    for schema in (PERSON, NAMES, UNION, FREE, {"enum": ["yes", "no", {"x": [1, 2]}]}):
        grammar = schema_grammar(schema)
        for _ in range(6):
            state = grammar.start
            for _ in range(60):
                for may_complete in (True, False):
                    invalid, num_valid = vocab.mask(state, may_complete, grammar)
                    expect = [vocab.accepts(state, t, may_complete, grammar) for t in range(len(tokens) + 1)]
                    assert (~invalid).tolist() == expect and num_valid == sum(expect), (schema, state)
                    checked += 1
                nxt = [t for t, ok in enumerate(expect) if ok]
                if not nxt:
                    break
                state = grammar.advance(state, vocab.token_bytes(rng.choice(nxt)))
                if grammar.is_complete(state):
                    break
    assert checked > 300


def test_a_pydantic_models_strict_schema_compiles_and_holds():
    """The schema the `openai` client's `parse` sends for a pydantic model: $defs, anyOf with null, enums."""
    from enum import StrEnum

    from openai.lib._pydantic import to_strict_json_schema
    from pydantic import BaseModel

    class Color(StrEnum):
        red = "red"
        blue = "blue"

    class Item(BaseModel):
        label: str
        count: int | None

    class Order(BaseModel):
        items: list[Item]
        color: Color
        note: str | None = None

    schema = to_strict_json_schema(Order)
    grammar, rng = schema_grammar(schema), random.Random(5)
    done = [t for t in (_walk(grammar, rng, 900) for _ in range(30)) if t is not None]
    assert len(done) >= 5
    for text in done:
        Order.model_validate_json(text)
    assert accepts(schema, '{"items":[{"label":"x","count":null}],"color":"blue","note":null}')
    assert not accepts(schema, '{"items":[{"label":"x"}],"color":"blue","note":null}')  # strict: all required


@pytest.mark.parametrize("schema, needle", [
    ({"type": "number"}, "top-level schema may describe a number"),
    ({"anyOf": [{"type": "object"}, {"type": "integer"}]}, "top-level schema may describe a number"),
    ({"enum": [1, 2]}, "top-level"),
    ({"type": "string", "pattern": "^a"}, "#: pattern cannot be enforced"),
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}}, "#.properties.n: minimum"),
    ({"type": "array", "items": {"type": "string", "maxLength": 3}}, "#.items: maxLength"),
    ({"type": "object", "patternProperties": {}}, "patternProperties"),
    ({"$ref": "https://example.com/s.json"}, "only references inside the schema"),
    ({"$ref": "#/$defs/missing"}, "names nothing"),
    ({"$ref": "#"}, "a $ref loop"),
    ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, "only an allOf of one schema"),
    ({"type": "object", "anyOf": [{"required": ["a"]}]}, "anyOf beside type is not supported"),
    ({"type": "object", "properties": {}, "required": ["q"]}, "required names q"),
    ({"type": "array", "minItems": 3, "maxItems": 1}, "minItems (3) is above maxItems (1)"),
    ({"type": "object", "properties": {"a": {"type": "string", "enum": [1, 2]}}}, "no value of its enum/const"),
    ({"type": "object", "properties": {"a": False}}, "#.properties.a: the schema `false` takes no value"),
    ({"type": "object", "properties": {"a": {"type": "text"}}}, "#.properties.a.type must be one of"),
    ({"type": "object", "properties": {"a": {"anyOf": []}}}, "anyOf must be a non-empty list"),
    ({"type": "object", "properties": {"a": {"type": "array", "minItems": -1}}}, "minItems must be an integer"),
    ("object", "a schema must be an object or a boolean"),
    ({"type": "object", "default": float("nan")}, "not plain JSON"),
])
def test_schemas_that_cannot_be_enforced_are_refused_naming_why(schema, needle):
    with pytest.raises(SchemaError) as err:
        compile_schema(schema)
    assert needle in str(err.value)


def test_annotations_are_ignored_and_the_same_schema_compiles_once():
    annotated = {"type": "object", "title": "T", "description": "d", "$schema": "https://json-schema.org/draft/2020-12/schema",
                 "properties": {"when": {"type": "string", "format": "date-time", "examples": ["x"], "default": "y"}}}
    assert accepts(annotated, '{"when":"2026-12-04"}')
    same = json.loads(json.dumps(annotated, sort_keys=True))  # another dict, keys in another order
    assert compile_schema(same) is compile_schema(annotated) and schema_grammar(same) is schema_grammar(annotated)
    assert schema_grammar(annotated).key != schema_grammar(PERSON).key


def test_a_free_object_and_nullable_and_a_deep_any():
    assert accepts({"type": "object"}, '{"a":[1,{"b":null}],"c":"d"}')  # no properties: any keys
    assert accepts({"type": "object", "properties": {"a": {"type": "string", "nullable": True}}}, '{"a":null}')
    deep = "[" * 50 + "]" * 50
    assert accepts({"type": "object"}, '{"a":' + deep + "}")
