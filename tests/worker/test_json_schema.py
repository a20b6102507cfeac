"""Structured output's grammar (json_schema.py, json_schema_grammar.py): what it takes and refuses, checked
against the `jsonschema` reference validator; random walks through the grammar give only values the schema
takes; the vocabulary's masks for its states equal a token-by-token check; schemas it cannot enforce are
refused with the keyword and where it is."""

from __future__ import annotations

import json
import random

import pytest

from lorafleet.worker.json_schema import SchemaError, compile_schema
from lorafleet.worker.json_schema_grammar import DONE, SchemaGrammar, schema_grammar
from lorafleet.worker.json_vocab import JsonVocab
from tests.worker.grammar_checks import accepts, check_masks, check_text, walks_validate

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
    check_text(schema, text, ok)


def test_nothing_may_follow_a_complete_value_and_prefixes_are_not_complete():
    grammar = schema_grammar(PERSON)
    state = grammar.advance(grammar.start, b'{"name":"x","kind":"person"')
    assert state is not None and state != DONE and not grammar.is_complete(state)
    assert grammar.advance(state, b"}") == DONE and grammar.advance(state, b"} ") is None
    assert grammar.advance(DONE, b"") == DONE and grammar.advance(DONE, b"x") is None


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
def test_random_walks_give_values_the_reference_validator_takes(schema):
    for text in walks_validate(schema, seed=7, tries=40, at_least=10):
        assert accepts(schema, text)  # the same bytes at once, as a token holding them all


def test_the_vocabularys_masks_for_schema_states_equal_a_token_by_token_check():
    """Inside keys and enum values whitespace bytes lead to different states (" " may continue "a b" where "\\t"
    may not), so those masks are built token by token; elsewhere by the buckets' shortcuts."""
    pieces = [" ", "\t", "\n ", " a", "\tb", "a", "b", "a b", "\"", "\"a", "\" ", "{", "{\"", "}", "]", "[", ",", ":",
              "1", "12", ".5", "e", "-", "true", "null", "x", "é", "\\", "\\t", "\\u00e9", "\":", "\": ", " }", "\"}",
              "\"a\\tb", "c d", "\"c", " d\"", "person", "\"kind\"", "\"name\":\"", "  \"", "ue", "\xff"]
    tokens = [p.encode("latin-1") if p == "\xff" else p.encode() for p in pieces]
    vocab, rng = JsonVocab([*tokens, None]), random.Random(3)
    schemas = (PERSON, NAMES, UNION, FREE, {"enum": ["yes", "no", {"x": [1, 2]}]})
    assert sum(check_masks(vocab, schema_grammar(s), rng, walks=6, steps=60) for s in schemas) > 300


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
    for text in walks_validate(schema, seed=5, tries=30, at_least=5, max_bytes=900):
        Order.model_validate_json(text)
    assert accepts(schema, '{"items":[{"label":"x","count":null}],"color":"blue","note":null}')
    assert not accepts(schema, '{"items":[{"label":"x"}],"color":"blue","note":null}')  # strict: all required


@pytest.mark.parametrize("schema, needle", [
    ({"type": "number"}, "top-level schema may describe a number"),
    ({"anyOf": [{"type": "object"}, {"type": "integer"}]}, "top-level schema may describe a number"),
    ({"enum": [1, 2]}, "top-level"),
    ({"type": "string", "format": "email", "contentSchema": {}}, "#: contentSchema cannot be enforced"),
    ({"type": "string", "contentSchema": {}}, "and format date, date-time, email, ipv4, time, uuid (it ignores other"),
    ({"type": "object", "properties": {"n": {"type": "array", "uniqueItems": True}}}, "#.properties.n: uniqueItems"),
    ({"type": "array", "items": {"type": "object", "dependentRequired": {"a": ["b"]}}}, "#.items: dependentRequired"),
    ({"type": "object", "patternProperties": [{}]}, "#.patternProperties must be an object of schemas"),
    ({"$ref": "https://example.com/s.json"}, "only references inside the schema"),
    ({"$ref": "#/$defs/missing"}, "names nothing"),
    ({"$ref": "#"}, "in a loop"),
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
    assert accepts(annotated, '{"when":"2026-12-04T15:00:00Z"}')  # a known format is held as a pattern
    same = json.loads(json.dumps(annotated, sort_keys=True))  # another dict, keys in another order
    assert compile_schema(same) is compile_schema(annotated) and schema_grammar(same) is schema_grammar(annotated)
    assert schema_grammar(annotated).key != schema_grammar(PERSON).key


def test_a_free_object_and_nullable_and_a_deep_any():
    assert accepts({"type": "object"}, '{"a":[1,{"b":null}],"c":"d"}')  # no properties: any keys
    assert accepts({"type": "object", "properties": {"a": {"type": "string", "nullable": True}}}, '{"a":null}')
    deep = "[" * 50 + "]" * 50
    assert accepts({"type": "object"}, '{"a":' + deep + "}")


@pytest.mark.parametrize("extra", [True, {"type": "integer"}])
def test_a_written_property_cannot_come_back_as_another_key(extra):
    """A key repeating a written property, or a listed name written with an escape, is that property: never a
    second key whose value only additionalProperties checks (json.loads keeps the last one)."""
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"], "additionalProperties": extra}
    for text in ('{"a":"x","a":1}', '{"a":"x","\\u0061":1}', '{"\\u0061":1}'):
        assert not accepts(schema, text), text
    assert accepts(schema, '{"\\u0061":"x"}')  # the property itself, escaped: its own schema
    assert accepts(schema, '{"a":"x","b":1}') and accepts(schema, '{"ab":1,"a":"x"}')


def test_enum_and_const_compare_as_json_values():
    assert not accepts({"type": "object", "properties": {"x": {"const": 1, "enum": [True, 1]}}}, '{"x":true}')
    assert accepts({"type": "object", "properties": {"x": {"const": 1, "enum": [True, 1]}}}, '{"x":1}')
    with pytest.raises(SchemaError, match="enum must be a list"):
        compile_schema({"type": "object", "properties": {"x": {"const": 1, "enum": 5}}})


@pytest.mark.parametrize("schema, needle", [
    ({"oneOf": [{"type": "null"}, {"type": "null"}]}, "alternatives 0 and 1 may both take one value"),
    ({"type": "object", "properties": {"\ud800": {"type": "null"}}}, "a name cannot be written as JSON"),
    ({"type": "object", "properties": {f"p{i}": True for i in range(5000)}}, "more than 4096 property names"),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "no finite value"),
    ({"type": "array", "minItems": 1, "items": {"$ref": "#"}}, "no finite value"),
])
def test_schemas_a_hostile_or_careless_caller_sends_are_refused(schema, needle):
    with pytest.raises(SchemaError, match=needle):
        compile_schema(schema)


def test_a_chain_of_unions_over_unions_compiles_in_linear_time():
    """d_k = anyOf[d_k-1, d_k-1]: without memoized alternatives, 2^k walks (25 levels: 33 million)."""
    defs = {"d0": {"type": "object", "properties": {"v": {"type": "integer"}}}}
    defs |= {f"d{k}": {"anyOf": [{"$ref": f"#/$defs/d{k - 1}"}, {"$ref": f"#/$defs/d{k - 1}"}]} for k in range(1, 26)}
    grammar = schema_grammar({"$defs": defs, "$ref": "#/$defs/d25"})
    assert grammar.advance(grammar.start, b'{"v":1}') == DONE


def test_readings_of_ambiguous_recursive_unions_are_bounded():
    """Two shapes alike at every level double the readings per level: past MAX_READINGS the request fails
    with a GrammarError (the engine ends that request) instead of slowing every step."""
    from lorafleet.worker.json_schema_grammar import MAX_READINGS, GrammarError

    alike = {"$defs": {"n": {"anyOf": [
        {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/n"}}, "x": {"type": "null"}}},
        {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/n"}}, "y": {"type": "null"}}},
    ]}}, "$ref": "#/$defs/n"}
    grammar = schema_grammar(alike)
    assert grammar.advance(grammar.start, b'{"c":[{"c":[]}],"x":null}') == DONE
    with pytest.raises(GrammarError, match=f"more than {MAX_READINGS} readings"):
        grammar.advance(grammar.start, b'{"c":[' * 8)


def test_the_same_schema_with_its_keys_reordered_numbers_its_nodes_alike():
    """Grammars of one key share the vocabulary's cached masks, so they must read a state the same way."""
    from lorafleet.worker.json_schema import JsonSchema

    a = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    b = {"properties": {"b": {"type": "string"}, "a": {"type": "integer"}}, "type": "object"}
    ga, gb = SchemaGrammar(JsonSchema(a)), SchemaGrammar(JsonSchema(b))  # compiled apart, as after a cache eviction
    assert ga.key == gb.key
    for text in (b'{"b', b'{"b":"x","a', b'{"a":1'):
        assert ga.advance(ga.start, text) == gb.advance(gb.start, text)


def test_min_tokens_pads_a_fixed_length_value_with_whitespace():
    """An enum or a literal cannot be padded inside: once nothing but its end may follow, it ends, and JSON
    whitespace (the stop tokens are held back by min_tokens) makes up the count."""
    from lorafleet.worker.json_guide import JsonGuide
    from lorafleet.worker.sampling_params import SamplingParams
    from lorafleet.worker.sequence import Sequence

    pieces = ['"', "y", "e", "s", "n", "o", " ", "\n", "x"]
    vocab = JsonVocab([p.encode() for p in pieces] + [None])
    eos = len(pieces)
    guide = JsonGuide(lambda: vocab, eos_token_ids=[eos])
    seq = Sequence("r", [1, 2], SamplingParams(max_tokens=12, min_tokens=8, grammar=schema_grammar({"enum": ["yes", "no"]})))
    for token in (0, 4, 5):  # "no
        assert guide.accepts(seq, token)
        seq.output_token_ids.append(token)
    allowed = (~guide.invalid(seq, "cpu")).nonzero().flatten().tolist()
    assert allowed == [0]  # the closing quote, though it completes the value before min_tokens
    seq.output_token_ids.append(0)
    allowed = (~guide.invalid(seq, "cpu")).nonzero().flatten().tolist()
    assert allowed == [6, 7, eos]  # whitespace (EOS is masked by min_tokens before this mask applies)


def test_a_one_of_too_large_to_check_pair_by_pair_is_refused_and_a_large_tagged_union_is_not():
    """oneOf needs every pair of alternatives shown disjoint: a schema's pairs are bounded (a crafted 2000-way
    oneOf took 10 s of the event loop), while a 300-way tagged union, as pydantic writes, still compiles."""
    from lorafleet.worker.json_schema_unions import MAX_ONE_OF_PAIRS

    with pytest.raises(SchemaError, match=rf"too many to check .* \(over {MAX_ONE_OF_PAIRS} pairs\)"):
        compile_schema({"type": "object", "properties": {"a": {"oneOf": [{"const": i} for i in range(2000)]}}})
    alts = [{"type": "object", "properties": {"kind": {"const": f"k{i}"}, "v": {"type": "integer"}},
             "required": ["kind", "v"]} for i in range(300)]
    compile_schema({"type": "object", "properties": {"a": {"oneOf": alts}}})
    # pydantic's form: the alternatives in $defs, the union at each field that uses it; checked once.
    defs = {f"K{i}": alt for i, alt in enumerate(alts)}
    union = {"oneOf": [{"$ref": f"#/$defs/K{i}"} for i in range(300)], "discriminator": {"propertyName": "kind"}}
    fields = {name: json.loads(json.dumps(union)) for name in "abc"}
    compile_schema({"$defs": defs, "type": "object", "properties": fields, "required": list(fields)})
