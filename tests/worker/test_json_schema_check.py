"""A parsed value against a compiled schema (json_schema_check.py), the check of a strict function's arguments a
model wrote freely: JSON Schema's reading of the value, not the forms the sampling grammar writes; against the
`jsonschema` reference validator on values from random walks and their mutations."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from lorafleet.worker.json_schema_grammar import schema_grammar
from tests.worker.grammar_checks import walk
from tests.worker.test_json_schema import PERSON
from tests.worker.test_json_schema_keys import PATTERNS, STOCK
from tests.worker.test_json_schema_unions import BAG

BOUNDED = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}, "b": {"type": "number", "maximum": 1e-3},
                                            "c": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}},
           "required": ["a"]}


@pytest.mark.parametrize("schema, value, ok", [
    (BOUNDED, {"a": 1.0, "b": 1e-07}, True),  # 1.0 is an integer; 1e-07 is a number the bound takes
    (BOUNDED, {"a": -1}, False), (BOUNDED, {"a": 1, "b": 0.5}, False), (BOUNDED, {"a": 1, "c": "abcd"}, False),
    (BOUNDED, {"a": 1, "d": 1}, False),  # the strict reading: listed properties, no other key
    (BAG, {"words": [], "shares": [0.1, 0.30000000000000004]}, True),  # 17 digits: written so by no sampler here
    (BAG, {"words": [], "shares": [1e23, 99999999999999991611392]}, False),  # one value as parsed
    (BAG, {"words": ["a", "a"]}, False), (STOCK, {"by_color": {"red": 1}, "by_size": {}, "by_slug": {}, "by_id": {}}, True),
    (STOCK, {"by_color": {"pink": 1}, "by_size": {}, "by_slug": {}, "by_id": {}}, False),
])
def test_a_parsed_value_is_read_as_json_schema_reads_it(schema, value, ok):
    assert schema_grammar(schema).validates(value) is ok


def _strict(schema):
    """The schema as this server reads it where it is silent: listed properties or patterns, no other key."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if ("properties" in out or "patternProperties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _mutated(value, rng: random.Random):
    if isinstance(value, dict) and value:
        key, out = rng.choice(list(value)), dict(value)
        pick = rng.random()
        if pick < 0.3:
            del out[key]
        elif pick < 0.7:
            out[key] = rng.choice([1, 1.0, 1e-7, "x", None, [], {}, True, 2**70, 0.30000000000000004, [1, 1.0]])
        else:
            out[key + "z"] = 1
        return out
    if isinstance(value, list):
        return [*value, value[0]] if value and rng.random() < 0.5 else [*value, rng.choice([1, "x", 1e23])]
    return rng.choice([1, 1.0, "x", None, True, 1e-7])


@pytest.mark.parametrize("schema", [PERSON, STOCK, PATTERNS, BAG, BOUNDED])
def test_parsed_values_agree_with_the_reference_validator(schema):
    grammar, validator, rng = schema_grammar(schema), jsonschema.Draft202012Validator(_strict(schema)), random.Random(5)
    checked = 0
    for _ in range(60):
        text = walk(grammar, rng, 600)
        if text is None:
            continue
        for value in (json.loads(text), *(_mutated(json.loads(text), rng) for _ in range(3))):
            assert grammar.validates(value) is validator.is_valid(value), (value, schema)
            checked += 1
    assert checked > 100


def test_a_value_nested_past_what_the_check_follows_is_refused_not_an_error():
    value: list = []
    inner = value
    for _ in range(900):
        inner.append([])
        inner = inner[0]
    assert schema_grammar({"type": "object", "properties": {"a": {}}}).validates({"a": value}) is False
    assert schema_grammar({"type": "object", "properties": {"a": {}}}).validates({"a": [[[]]]}) is True


@pytest.mark.parametrize("schema, value, ok", [
    ({"enum": [1, {"a": 1, "b": 2}, [1]]}, 1.0, True), ({"enum": [[1]]}, [1.0], True),
    ({"enum": [{"a": 1, "b": 2}]}, {"b": 2, "a": 1}, True), ({"enum": [1]}, True, False), ({"const": 0.0}, -0.0, True),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, {f"k{i}": i for i in range(1025)}, True),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, {"\ud83d": 1}, True),  # a lone surrogate key
    ({"type": "object", "properties": {"a": {}}}, {"\ud83d": 1}, False),
])
def test_enum_values_compare_as_json_and_the_writing_cap_and_odd_keys_do_not_leak_into_the_check(schema, value, ok):
    schema = schema if schema.get("type") == "object" else {"type": "object", "properties": {"v": schema}, "required": ["v"]}
    value = value if "properties" not in schema or "v" not in schema["properties"] else {"v": value}
    assert schema_grammar(schema).validates(value) is ok


@pytest.mark.parametrize("bounds, value, ok", [
    ({"maximum": 0.1}, 0.1, True), ({"minimum": 0.3}, 0.3, True), ({"multipleOf": 0.01}, 0.02, True),
    ({"exclusiveMinimum": 0.1}, 0.1, False), ({"exclusiveMaximum": 0.3}, 0.3, False), ({"maximum": 1.1}, 1.1, True),
])
def test_a_number_meets_bounds_as_the_decimal_it_is_written_as(bounds, value, ok):
    schema = {"type": "object", "properties": {"p": {"type": "number", **bounds}}, "required": ["p"]}
    grammar = schema_grammar(schema)
    assert grammar.validates({"p": value}) is ok
    assert (grammar.advance(grammar.start, json.dumps({"p": value}).encode()) is not None) is ok  # as the grammar
