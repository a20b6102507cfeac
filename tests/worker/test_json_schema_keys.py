"""Object keys beyond the listed properties (json_schema_keys.py): propertyNames and patternProperties as
pydantic writes them for dicts, each key's value held to the schema its name picks, walks that always have
a way on, masks equal to a token-by-token check, refusals naming the keyword, and the client's `parse` over
HTTP."""

from __future__ import annotations

import json
import random
import re
import uuid
from enum import StrEnum
from typing import Annotated, Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from lorafleet.worker.json_schema import SchemaError, compile_schema
from lorafleet.worker.json_schema_grammar import schema_grammar
from lorafleet.worker.json_schema_keys import count_texts
from lorafleet.worker.json_vocab import JsonVocab
from lorafleet.worker.regex_grammar import compile_pattern
from lorafleet.worker.regex_length import length_regex
from lorafleet.worker.tool_request import required_calls_schema
from tests.worker.grammar_checks import accepts, check_masks, check_text, walk, walks_validate
from tests.worker.test_openai_tools import USER
from tests.worker.test_structured_output import _parsed, api, bias, close_openai_clients, tools_model  # noqa: F401 (fixtures)


class Color(StrEnum):
    RED, BLUE = "red", "blue"


Slug = Annotated[str, Field(pattern=r"^[a-z]+$", max_length=4)]


class Stock(BaseModel):
    by_color: dict[Color, int]
    by_size: dict[Literal["s", "m"], str]
    by_slug: dict[Slug, int]
    by_id: dict[uuid.UUID, bool]


STOCK = Stock.model_json_schema()
EMPTY = '"by_color":{},"by_size":{},"by_slug":{},"by_id":{}'
U = "123e4567-e89b-12d3-a456-426614174000"


def _stock(**parts) -> str:
    fields = {"by_color": "{}", "by_size": "{}", "by_slug": "{}", "by_id": "{}"} | parts
    return "{" + ",".join(f'"{k}":{v}' for k, v in fields.items()) + "}"


@pytest.mark.parametrize("text, ok", [
    (_stock(), True),
    (_stock(by_color='{"red":1,"blue":2}'), True),
    (_stock(by_color='{"red":1,"red":2}'), False),  # an enum's key is written once
    (_stock(by_color='{"green":1}'), False),
    (_stock(by_size='{"m":"x","s":"y"}'), True), (_stock(by_size='{"l":"x"}'), False),
    (_stock(by_slug='{"abcd":1,"z":2}'), True),
    (_stock(by_slug='{"abcde":1}'), False),  # propertyNames' maxLength
    (_stock(by_slug='{"Ab":1}'), False),  # the pattern
    (_stock(by_slug='{"ab":"1"}'), False),  # the pattern's value schema
    (_stock(by_id=f'{{"{U}":true}}'), True), (_stock(by_id='{"123":true}'), False),
])
def test_pydantic_dicts_hold_their_keys_and_values(text, ok):
    check_text(STOCK, text, ok)


def test_pydantic_dicts_walk_and_parse_back():
    for text in walks_validate(STOCK, seed=1, tries=40, at_least=10, max_bytes=900):
        Stock.model_validate_json(text)
    assert accepts(STOCK, "{" + EMPTY + "}")


PATTERNS = {"type": "object", "patternProperties": {"^n_": {"type": "integer"}, "^s_": {"type": "string"}},
            "additionalProperties": {"type": "boolean"}, "properties": {"id": {"type": "string"}}}


@pytest.mark.parametrize("text, ok", [
    ('{"n_a":1,"s_b":"x","other":true,"id":"q"}', True),
    ('{"n_a":"1"}', False), ('{"s_b":2}', False), ('{"other":1}', False), ('{"id":1}', False),
    ('{"\\u0069d":"q"}', True), ('{"id":"q","\\u0069d":"r"}', False),  # a listed name escaped is that property
    ('{"n_\\u0061":1}', True), ('{"n_\\u0061":"1"}', False),  # the value's schema is chosen by the key's text
])
def test_each_key_takes_the_value_its_pattern_or_additional_properties_gives(text, ok):
    check_text(PATTERNS, text, ok)


def test_without_additional_properties_only_keys_a_pattern_takes_are_written():
    schema = {"type": "object", "patternProperties": {"^x-[a-z]+$": {"type": "integer"}, "^y$": {"type": "null"}}}
    for text, ok in (('{"x-ab":1,"y":null}', True), ('{"x-":1}', False), ('{"z":1}', False), ('{"yy":null}', False)):
        check_text(schema, text, ok)
    walks_validate(schema, seed=2, tries=30, at_least=8)


@pytest.mark.parametrize("schema", [
    {"type": "object", "patternProperties": {"^[ab]$": {"type": "integer"}}, "maxProperties": 5},
    {"type": "object", "patternProperties": {"^[ab]$": {"type": "integer"}}, "minProperties": 2},
    {"type": "object", "propertyNames": {"pattern": "^k[0-9]$"}, "additionalProperties": {"type": "integer"},
     "properties": {"k1": {"type": "integer"}}, "minProperties": 1, "maxProperties": 20},
    {"type": "object", "propertyNames": {"enum": ["a", "b", "c"]}, "minProperties": 1},
    {"type": "object", "propertyNames": {"minLength": 2, "maxLength": 3}, "additionalProperties": {"const": 0},
     "properties": {"no": {"const": 1}, "yes": {"const": 2}}, "maxProperties": 3},
])
def test_a_walk_never_runs_out_of_keys(schema):
    """Where the keys a pattern takes are few, maxProperties is cut to them: a comma is never followed by no key."""
    walks_validate(schema, seed=3, tries=40, at_least=10)


def test_counts_of_a_key_language():
    assert count_texts(compile_pattern("^[ab]{1,2}$", True, True), 100) == 6
    assert count_texts(compile_pattern("^[ab]+$", True, True), 100) == 100  # a loop: without end
    assert count_texts(length_regex(compile_pattern("^[a-z]+$", True, True), 0, 2), 10**6) == 26 + 26 * 26
    schema = compile_schema({"type": "object", "patternProperties": {"^[ab]$": {}}, "maxProperties": 9})
    assert schema.nodes[schema.root].max_props == 2


@pytest.mark.parametrize("schema, needle", [
    ({"type": "object", "patternProperties": {"^a": {"type": "integer"}, "b$": {"type": "string"}}},
     "#.patternProperties: '^a' and 'b$' may both match one key"),
    ({"type": "object", "properties": {"ab": {"type": "string"}}, "patternProperties": {"^a": {"type": "integer"}}},
     "#.properties.ab: its name matches patternProperties '^a' too"),
    ({"type": "object", "propertyNames": {"anyOf": [{"enum": ["a"]}, {"pattern": "b"}]}}, "a union of key schemas"),
    ({"type": "object", "propertyNames": {"pattern": "^x"}, "patternProperties": {"^a": {}}}, "beside patternProperties"),
    ({"type": "object", "properties": {"ab": {}}, "required": ["ab"], "propertyNames": {"maxLength": 1}},
     "#.required: 'ab' is required, and propertyNames does not take it"),
    ({"type": "object", "patternProperties": {"^[ab]$": {}}, "minProperties": 3}, "minProperties 3, where the object takes 2"),
    ({"type": "object", "propertyNames": {"enum": ["a", "b"]}, "patternProperties": {"a": {"type": "integer"},
                                                                                   "^a$": {"type": "string"}}},
     "the key 'a' propertyNames takes matches patterns with different schemas"),
    ({"type": "object", "patternProperties": {"(": {}}}, "#.patternProperties: '('"),
    ({"type": "object", "patternProperties": {"^[a-z]{0,300}$": {}}, "maxProperties": 10**6}, "cannot be checked"),
])
def test_keys_that_cannot_be_held_are_refused_naming_the_keyword(schema, needle):
    with pytest.raises(SchemaError, match=re.escape(needle)):
        compile_schema(schema)


def test_patterns_that_meet_with_one_schema_and_listed_names_propertynames_refuses():
    same = {"type": "object", "patternProperties": {"^a": {"type": "integer"}, "b$": {"type": "integer"}}}
    check_text(same, '{"ab":1,"b":2}', True)
    dropped = {"type": "object", "properties": {"long": {"type": "integer"}, "ok": {"type": "integer"}},
               "propertyNames": {"maxLength": 2}}  # "long" is dropped: propertyNames refuses it
    check_text(dropped, '{"ok":1}', True)
    check_text(dropped, '{"long":1}', False)
    enum_keys = {"type": "object", "propertyNames": {"enum": ["a", "b", 1]},
                 "patternProperties": {"^a$": {"type": "string"}}, "additionalProperties": {"type": "integer"}}
    for text, ok in (('{"a":"x","b":2}', True), ('{"a":2}', False), ('{"b":"x"}', False), ('{"1":1}', False)):
        check_text(enum_keys, text, ok)


def test_masks_inside_keys_held_to_a_language_match_a_token_by_token_check():
    pieces = ['{"', "n_", "s_", "id", "x", "ab", "\\u0069", "\\n", '":', ":", "1", "true", '"', '"v"', ",", "}", " ", '" ',
              "\u00e9", "\u00e9\u00e9", "a\u00e9"]
    vocab = JsonVocab([p.encode() for p in pieces] + [None])
    rng = random.Random(4)
    slugs = {"type": "object", "patternProperties": {"^[a-z\u00e9]+$": {"type": "integer"}}, "propertyNames": {"maxLength": 3}}
    for schema in (PATTERNS, slugs, STOCK["properties"]["by_id"]):
        assert check_masks(vocab, schema_grammar(schema), rng, walks=10, steps=20) > 40


def test_a_required_call_of_a_tool_whose_parameters_are_a_pydantic_dict():
    class Args(BaseModel):
        counts: dict[Color, int]

    tools = [{"type": "function", "function": {"name": "tally", "parameters": Args.model_json_schema()}}]
    schema = required_calls_schema(tools, {"tally": object()}, parallel=False)
    grammar = schema_grammar(schema)
    assert grammar.validates([{"name": "tally", "parameters": {"counts": {"red": 2}}}])
    assert not grammar.validates([{"name": "tally", "parameters": {"counts": {"pink": 2}}}])


async def test_the_clients_parse_gets_a_model_with_dicts(api, bias):  # noqa: F811
    class Tally(BaseModel):
        counts: dict[Color, int]
        tags: dict[Annotated[str, Field(pattern=r"^[a-c]+$", max_length=3)], bool]

    parsed = await _parsed(api, Tally, bias, seeds=8, max_tokens=160)
    assert len(parsed) >= 3 and all(isinstance(p, Tally) for p in parsed)
    assert any(p.counts or p.tags for p in parsed)
    assert all(json.loads(p.model_dump_json()).keys() == {"counts", "tags"} for p in parsed)


def test_a_counted_key_begun_again_goes_on_only_where_an_unwritten_key_can_follow():
    schema = {"type": "object", "patternProperties": {"^(a|b[a-z]*)$": {"type": "integer"}}, "maxProperties": 5}
    grammar = schema_grammar(schema)
    assert grammar.advance(grammar.start, b'{"a":1,"a') is None  # only "a" itself could follow, written already
    assert grammar.advance(grammar.start, b'{"b":1,"b') is not None  # "ba", "bb", ... are not
    listed = schema_grammar({"type": "object", "properties": {"ax": {"type": "integer"}},
                             "patternProperties": {"^a$": {"type": "integer"}}, "maxProperties": 5})
    assert listed.advance(listed.start, b'{"ax":1,"a":2}') is not None  # "ax" is no key the pattern takes
    pieces = ['{"', "a", "b", "ba", '":', "1", ",", "}", '","']
    assert check_masks(JsonVocab([p.encode() for p in pieces]), grammar, random.Random(5), walks=20, steps=16) > 100


PARTS = {
    "patterns": [{}, {"^[ab]$": {"type": "integer"}}, {"^a": {"type": "integer"}, "^b": {"type": "string"}},
                 {"x": {"const": 0}, "^x$": {"const": 0}}, {"^k\\d$": {"type": "boolean"}}],
    "names": [None, {"maxLength": 1}, {"minLength": 2, "maxLength": 2}, {"enum": ["a", "ab", "k1", "zz"]}],
    "additional": [None, False, {"type": "null"}],
    "listed": [{}, {"a": {"type": "integer"}}, {"zz": {"type": "null"}, "k1": {"type": "boolean"}}],
    "counts": [{}, {"maxProperties": 2}, {"minProperties": 1}, {"minProperties": 1, "maxProperties": 3}],
}


@pytest.mark.parametrize("seed", range(12))
def test_random_key_schemas_walk_to_values_the_reference_validator_takes(seed):
    """Random mixes of properties, patternProperties, propertyNames, additionalProperties and counts: each either
    refused, or every byte walk has a way on at every step and each value it ends is valid."""
    rng = random.Random(seed)
    compiled = 0
    for _ in range(12):
        pick = {k: rng.choice(v) for k, v in PARTS.items()}
        schema = {"type": "object", "properties": pick["listed"], "patternProperties": pick["patterns"], **pick["counts"]}
        if pick["names"] is not None:
            schema["propertyNames"] = pick["names"]
        if pick["additional"] is not None:
            schema["additionalProperties"] = pick["additional"]
        try:
            compile_schema(schema)
        except SchemaError:
            continue
        compiled += 1
        grammar, validator = schema_grammar(schema), jsonschema.Draft202012Validator(schema)
        for _ in range(6):
            text = walk(grammar, rng, 300)
            if text is not None:
                validator.validate(json.loads(text))
    assert compiled >= 6


@pytest.mark.parametrize("schema, written, begun", [
    ({"type": "object", "propertyNames": {"pattern": "^(東京|大阪)$"}, "maxProperties": 2}, '{"東京":1,"', "東".encode()[:1]),
    ({"type": "object", "propertyNames": {"pattern": "^(東京|大阪)$"}, "maxProperties": 2}, '{"東京":1,"', "東".encode()[:2]),
    ({"type": "object", "propertyNames": {"pattern": "^\\n?x$"}, "minProperties": 1}, '{"\\nx":1,"', b"\\"),
])
def test_a_counted_key_does_not_begin_a_character_that_could_only_write_a_key_again(schema, written, begun):
    grammar = schema_grammar(schema)
    state = grammar.advance(grammar.start, written.encode())
    assert state is not None and grammar.advance(state, begun) is None
    walks_validate(schema, seed=9, tries=30, at_least=5)


def test_long_keys_beside_property_counts_and_bounded_pattern_checks():
    for high in (300, 1000):  # counting the keys a language takes stops as soon as there are enough
        compile_schema({"type": "object", "additionalProperties": {"type": "integer"}, "propertyNames": {"maxLength": high},
                        "minProperties": 1, "maxProperties": 5})
    with pytest.raises(SchemaError, match="more than 16 patterns in one object"):
        compile_schema({"type": "object", "patternProperties": {f"^k{i}$": {"const": i} for i in range(17)}})
    sixteen = {"type": "object", "patternProperties": {f"^k{i}_{'x' * 1500}$": {"const": i} for i in range(16)},
               "additionalProperties": True}  # long patterns, compiled once each: their checks stay small
    assert compile_schema(sixteen).nodes[compile_schema(sixteen).root].others


@pytest.mark.parametrize("schema, text", [
    ({"type": "object", "additionalProperties": {"type": "integer"}}, '{"x":1,"x":2}'),  # dict[str, int]
    ({"type": "object", "additionalProperties": {"type": "integer"}}, '{"x":1,"\\u0078":2}'),
    (STOCK, _stock(by_slug='{"ab":1,"ab":2}')),
])
def test_no_key_is_written_twice_so_a_small_model_cannot_loop_on_one(schema, text):
    check_text(schema, text, False)


def test_a_finite_key_language_caps_an_object_without_max_properties():
    schema = {"type": "object", "patternProperties": {"^[ab]$": {"type": "integer"}}}
    assert compile_schema(schema).nodes[compile_schema(schema).root].max_props == 2
    grammar = schema_grammar(schema)
    assert grammar.advance(grammar.start, b'{"a":1,"b":2,') is None  # no key is left for a comma
    walks_validate(schema, seed=10, tries=30, at_least=10)
    free = compile_schema({"type": "object", "additionalProperties": {"type": "integer"}})
    assert (free.nodes[free.root].max_props, free.nodes[free.root].key_cap) == (None, 1024)  # each once, up to 1024


async def test_sets_over_http_come_with_distinct_items(api, bias):  # noqa: F811
    class Bag(BaseModel):
        words: set[str]
        counts: frozenset[int]

    fmt = {"type": "json_schema", "json_schema": {"name": "bag", "schema": Bag.model_json_schema()}}
    longer = {k: v for k, v in bias.items() if v != 5}  # ']' and '"' not favoured: arrays of several items
    lists = []
    for seed in range(8):
        resp = await api.chat.completions.create(model="tiny", messages=USER, response_format=fmt, seed=seed,
                                                 max_tokens=160, logit_bias=longer)
        if resp.choices[0].finish_reason == "stop":
            raw = json.loads(resp.choices[0].message.content)
            Bag.model_validate(raw)
            lists += [raw["words"], raw["counts"]]
    assert len(lists) >= 4 and any(len(items) > 1 for items in lists)
    assert all(len({json.dumps(x) for x in items}) == len(items) for items in lists)  # no item twice


@pytest.mark.parametrize("schema, written", [
    ({"type": "object", "properties": {"id": {}}, "patternProperties": {"^(id|[0-9]{1,300})$": {}}}, b'{"id":1,"i'),
    ({"type": "object", "properties": {"id": {}}, "propertyNames": {"pattern": "^(id|[0-9]{1,300})$"},
      "additionalProperties": True}, b'{"id":1,"i'),
])
def test_a_key_of_a_language_too_large_to_count_does_not_begin_a_written_listed_name(schema, written):
    grammar = schema_grammar(schema)
    assert compile_schema(schema).nodes[compile_schema(schema).root].key_cap is None  # other keys not counted
    assert grammar.advance(grammar.start, written) is None  # "id" is written: "i" could only end as it
    assert grammar.advance(grammar.start, b'{"id":1,"1') is not None
    walks_validate(schema, seed=11, tries=30, at_least=5)
