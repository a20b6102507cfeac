"""oneOf held where its alternatives are disjoint (json_schema_unions.py), pydantic's discriminated unions
included; the `format`s held as patterns (json_schema_bounds.FORMATS); prefixItems (pydantic's tuples);
uniqueItems of enum values (pydantic's sets of an Enum or a Literal)."""

from __future__ import annotations

import datetime
import ipaddress
import json
import random
import re
import uuid
from enum import StrEnum
from typing import Annotated, Literal

import jsonschema
import pytest
from pydantic import BaseModel

from lorafleet.worker.json_schema import SchemaError, compile_schema
from lorafleet.worker.json_schema_bounds import FORMATS
from lorafleet.worker.json_schema_grammar import DONE as SCHEMA_DONE
from lorafleet.worker.json_schema_grammar import schema_grammar
from lorafleet.worker.json_vocab import JsonVocab
from lorafleet.worker.openai_fields import APIError
from lorafleet.worker.openai_protocol import parse_chat_request
from tests.worker.grammar_checks import accepts, allowed, check_masks, check_text, walks_validate


def _tagged(tag: str, required: bool = True, **props) -> dict:
    return {"type": "object", "properties": {"kind": {"const": tag}, **props}, "required": ["kind"] if required else []}


@pytest.mark.parametrize("alternatives", [
    [{"type": "string"}, {"type": "integer"}, {"type": "null"}],
    [{"enum": [1, 2, "a"]}, {"enum": [3, True, "b"]}],  # true is not 1
    [_tagged("cat", meow={"type": "boolean"}), _tagged("dog", bark={"type": "boolean"})],
    [{"anyOf": [_tagged("a"), _tagged("b")]}, _tagged("c"), {"type": "array"}],
    [{"type": "object", "properties": {"t": {"enum": ["x", "y"]}}, "required": ["t"]},
     {"type": "object", "properties": {"t": {"anyOf": [{"const": "z"}, {"const": 1}]}}, "required": ["t"]}],
])
def test_a_oneof_of_disjoint_alternatives_is_held_as_anyof(alternatives):
    schema = {"type": "object", "properties": {"v": {"oneOf": alternatives}}, "required": ["v"]}
    walks_validate(schema, seed=3, tries=30, at_least=5, max_bytes=400)  # exactly one alternative matches


@pytest.mark.parametrize("alternatives, pair", [
    ([{"type": "null"}, {"type": "null"}], "0 and 1"),
    ([{"type": "string"}, {"type": "integer"}, {"type": "number"}], "1 and 2"),  # an integer is a number
    ([{"enum": [1, "a"]}, {"enum": [1.0]}], "0 and 1"),  # 1 and 1.0 are one value
    ([_tagged("cat"), _tagged("cat", name={"type": "string"})], "0 and 1"),
    ([_tagged("cat", required=False), _tagged("dog")], "0 and 1"),  # the tag must be required in both
    ([{"type": "object"}, _tagged("dog")], "0 and 1"),
    ([{"type": ["object", "null"], "properties": {"kind": {"const": "a"}}, "required": ["kind"]}, {"type": "null"}],
     "0 and 1"),
    # with no `type`, a keyword binds no kind for a validator: {"properties": ...} takes a string too
    ([{"properties": {"t": {"const": "a"}}, "required": ["t"]}, {"type": "string"}], "0 and 1"),
    ([{"pattern": "^a"}, {"type": "number"}], "0 and 1"), ([{"minimum": 0}, {"type": "string"}], "0 and 1"),
    ([{"minItems": 1}, {"type": "object"}], "0 and 1"),
    ([{"const": [1]}, {"const": [1.0]}], "0 and 1"),  # equal at any depth
    ([{"const": {"a": 1, "b": [True]}}, {"const": {"b": [True], "a": 1.0}}], "0 and 1"),
    ([_tagged("a") | {"properties": {"kind": {"const": [1]}}}, _tagged("b") | {"properties": {"kind": {"const": [1.0]}}}],
     "0 and 1"),
])
def test_a_oneof_whose_alternatives_may_meet_is_refused(alternatives, pair):
    with pytest.raises(SchemaError, match=f"#.properties.v.oneOf: alternatives {pair} may both take one value"):
        compile_schema({"type": "object", "properties": {"v": {"oneOf": alternatives}}})


def test_a_pydantic_discriminated_union():
    from pydantic import BaseModel, Field

    class Cat(BaseModel):
        pet_type: Literal["cat"]
        meows: int

    class Dog(BaseModel):
        pet_type: Literal["dog"]
        barks: float

    class Owner(BaseModel):
        pet: Annotated[Cat | Dog, Field(discriminator="pet_type")]
        name: str

    schema = Owner.model_json_schema()
    assert "oneOf" in json.dumps(schema) and "discriminator" in json.dumps(schema)
    for text in walks_validate(schema, seed=8, tries=30, at_least=5):
        Owner.model_validate_json(text)


def _closing_walk(grammar, rng: random.Random) -> str:
    """Random bytes the grammar takes, closing the string and the object whenever it may."""
    state, out = grammar.start, bytearray()
    while state != SCHEMA_DONE:
        ways = allowed(grammar, state)
        assert ways and len(out) < 2000, bytes(out)
        closed = out.count(b'"') >= 4  # the key's quotes and the value's: a '}' before is a character (an email's)
        ends = [b for b in ways if b == 0x22 or b == 0x7D and closed]
        out.append(ends[0] if ends and len(out) > 8 else rng.choice(ways))
        state = grammar.advance(state, out[-1:])
    return out.decode()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_formats_are_held_as_patterns(fmt):
    schema = {"type": "object", "properties": {"v": {"type": "string", "format": fmt}}, "required": ["v"]}
    grammar, rng = schema_grammar(schema), random.Random(5)
    done = [_closing_walk(grammar, rng) for _ in range(10)]
    checker = jsonschema.FormatChecker(["email", "ipv4", "uuid"])
    for text in done:
        value = json.loads(text)["v"]
        assert re.fullmatch(FORMATS[fmt].strip("^$"), value, re.ASCII), value
        if fmt == "ipv4":
            ipaddress.IPv4Address(value)
        if fmt == "uuid":
            uuid.UUID(value)
        jsonschema.Draft202012Validator(schema, format_checker=checker).validate({"v": value})


FORMS = [
    ("date", "2026-12-04", "2026-13-01"), ("date-time", "2026-12-04T15:00:00.5+01:00", "2026-12-04 15:00:00Z"),
    ("time", "23:59:59Z", "23:59:60Z"), ("date", "0001-01-01", "0000-01-01"),
    ("date-time", "2026-12-04T15:00:00Z", "2026-12-04t15:00:00z"), ("uuid", "123e4567-e89b-12d3-a456-426614174000", "123e4567e89b12d3a456426614174000"),
    ("ipv4", "192.168.0.255", "192.168.0.256"), ("email", "a.b+c@example.co", "a@b"),
    ("email", "o'neil@example.com", "a..b@example.com"), ("email", "user~x{1}@example.com", ".a@example.com"),
]


@pytest.mark.parametrize("fmt, good, bad", FORMS)
def test_each_format_takes_its_form(fmt, good, bad):
    schema = {"type": "object", "properties": {"v": {"type": "string", "format": fmt}}}
    assert accepts(schema, json.dumps({"v": good})) and not accepts(schema, json.dumps({"v": bad}))


def test_a_date_has_the_days_of_its_month_and_29_february_in_leap_years_only():
    """Every day of months 00-13 (days 00-32) in years around each leap rule, as Python's calendar takes it: the
    pattern by `re`, and the grammar on a sample."""
    schema = {"type": "object", "properties": {"v": {"type": "string", "format": "date"}}}
    date_re = re.compile(FORMATS["date"].strip("^$"), re.ASCII)
    sample = random.Random(3)
    for year in (1, 4, 100, 200, 400, 1900, 1996, 2000, 2023, 2024, 2100, 9996, 9999):
        for month in range(14):
            for day in range(33):
                text = f"{year:04d}-{month:02d}-{day:02d}"
                try:
                    ok = datetime.date.fromisoformat(text) is not None
                except ValueError:
                    ok = False
                assert bool(date_re.fullmatch(text)) is ok, text
                if day in (28, 29, 30, 31) or sample.random() < 0.02:
                    assert accepts(schema, json.dumps({"v": text})) is ok, text


@pytest.mark.parametrize("fmt, good, bad", FORMS)
def test_a_format_beside_a_length_holds_both(fmt, good, bad):
    width = max(len(good), len(bad))  # both texts inside the lengths: only the form tells them apart
    schema = {"type": "object", "properties": {"v": {"type": "string", "format": fmt, "minLength": 1, "maxLength": width}}}
    assert accepts(schema, json.dumps({"v": good})) and not accepts(schema, json.dumps({"v": bad}))
    if fmt == "email" or good.endswith("+01:00"):  # forms with shorter and longer ones: the bounds cut them
        shorter = {"type": "object", "properties": {"v": {"type": "string", "format": fmt, "maxLength": len(good) - 1}}}
        longer = {"type": "object", "properties": {"v": {"type": "string", "format": fmt, "minLength": len(good) + 1}}}
        assert not accepts(shorter, json.dumps({"v": good})) and not accepts(longer, json.dumps({"v": good}))


@pytest.mark.parametrize("fmt, lo, hi", [("email", 7, 10), ("date-time", 20, 24), ("ipv4", 7, 9), ("time", 0, 12)])
def test_walks_under_a_format_and_a_length_end_inside_both(fmt, lo, hi):
    schema = {"type": "object", "properties": {"v": {"type": "string", "format": fmt, "minLength": lo, "maxLength": hi}},
              "required": ["v"]}
    grammar, rng = schema_grammar(schema), random.Random(7)
    for _ in range(15):
        value = json.loads(_closing_walk(grammar, rng))["v"]
        assert re.fullmatch(FORMATS[fmt].strip("^$"), value, re.ASCII) and lo <= len(value) <= hi, value
    pieces = ["a", "ab", "abcdef", "@", "@b", ".co", ".c", "1", "12", "2026-", "01", "T", ":", "Z", ".5", '"', '"}', "{",
              '{"v":"', "v", '":"']
    assert check_masks(JsonVocab([p.encode() for p in pieces] + [None]), grammar, random.Random(3), walks=8, steps=20) > 50


def test_a_format_no_text_of_its_length_takes_is_refused_naming_it():
    with pytest.raises(SchemaError, match=r"#\.properties\.v\.format: the pattern matches no text of at most 35"):
        compile_schema({"type": "object", "properties": {"v": {"type": "string", "format": "uuid", "maxLength": 35}}})
    with pytest.raises(APIError) as err:
        parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "string", "format": "date",
                                                                           "maxLength": 9}}}})
    assert err.value.status == 400 and err.value.param == "response_format" and "#.format: " in str(err.value)
    nullable = {"type": "object", "properties": {"v": {"type": ["string", "null"], "format": "uuid", "maxLength": 3}}}
    assert accepts(nullable, '{"v":null}') and not accepts(nullable, '{"v":"abc"}')  # no uuid is that short


def test_beside_a_pattern_the_pattern_holds_and_the_format_is_an_annotation():
    """Libraries write both for one form (zod's email: a format and its own pattern): the pattern holds."""
    schema = {"type": "object", "properties": {"v": {"type": "string", "format": "date", "pattern": "^x"}}}
    assert accepts(schema, '{"v":"xy"}') and not accepts(schema, '{"v":"2026-12-04"}')
    bounded = {"type": "object", "properties": {"v": {"type": "string", "format": "email", "pattern": "@", "maxLength": 4}}}
    assert accepts(bounded, '{"v":"a@b"}') and not accepts(bounded, '{"v":"a@bcd"}') and not accepts(bounded, '{"v":"ab"}')


def test_other_formats_stay_annotations():
    schema = {"type": "object", "properties": {"v": {"type": "string", "format": "hostname", "maxLength": 9}}}
    assert accepts(schema, '{"v":"any thing"}') and not accepts(schema, '{"v":"any things"}')


TUPLE = {"type": "object", "properties": {
    "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False, "minItems": 2},
    "head": {"type": "array", "prefixItems": [{"const": "x"}], "items": {"type": "boolean"}, "maxItems": 3},
}, "required": ["pair"]}


@pytest.mark.parametrize("text, ok", [
    ('{"pair":[1,"a"]}', True), ('{"pair":[1]}', False), ('{"pair":[1,"a",2]}', False), ('{"pair":["a",1]}', False),
    ('{"pair":[1,"a"],"head":["x",true,false]}', True), ('{"pair":[1,"a"],"head":[]}', True),
    ('{"pair":[1,"a"],"head":["x",true,false,true]}', False), ('{"pair":[1,"a"],"head":[true]}', False),
])
def test_prefix_items_hold_each_position(text, ok):
    check_text(TUPLE, text, ok)


def test_a_pydantic_tuple_and_its_walks():
    from pydantic import BaseModel

    class Point(BaseModel):
        xy: tuple[int, float]
        label: tuple[str, ...]

    for text in walks_validate(Point.model_json_schema(), seed=4, tries=30, at_least=5):
        Point.model_validate_json(text)
    walks_validate(TUPLE, seed=5, tries=30, at_least=5)
    with pytest.raises(SchemaError, match="items false with minItems 3 takes no value"):
        compile_schema({"type": "array", "prefixItems": [{"type": "null"}], "items": False, "minItems": 3})


COUNTED = {"type": "object", "properties": {
    "tags": {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1, "maxProperties": 2},
    "some": {"type": "object", "properties": {"a": {"type": "null"}, "b": {"type": "null"}}, "additionalProperties": True,
             "minProperties": 2, "maxProperties": 3},
}, "required": ["tags"]}


@pytest.mark.parametrize("text, ok", [
    ('{"tags":{"x":1}}', True), ('{"tags":{"x":1,"y":2}}', True), ('{"tags":{}}', False), ('{"tags":{"x":1,"y":2,"z":3}}', False),
    ('{"tags":{"x":1},"some":{"a":null,"q":[]}}', True), ('{"tags":{"x":1},"some":{"q":1,"r":2,"s":3}}', True),
    ('{"tags":{"x":1},"some":{"a":null}}', False), ('{"tags":{"x":1},"some":{"a":null,"b":null,"c":1,"d":2}}', False),
])
def test_min_and_max_properties_count_listed_and_other_keys(text, ok):
    check_text(COUNTED, text, ok)


ROOM = [
    {"type": "object", "properties": {"a": {}, "b": {}}, "required": ["b"], "maxProperties": 1},
    {"type": "object", "properties": {"a": {}, "b": {}}, "required": ["a", "b"], "additionalProperties": True,
     "maxProperties": 2},
    {"type": "object", "properties": {"a": {}, "b": {}, "c": {}}, "required": ["a"], "additionalProperties": True,
     "minProperties": 2, "maxProperties": 3},
    {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 3},
]


@pytest.mark.parametrize("schema, text, ok", [
    (ROOM[0], '{"b":1}', True), (ROOM[0], '{"a":1}', False),  # no room left for b
    (ROOM[1], '{"x":1,"a":1,"b":2}', False), (ROOM[1], '{"b":1,"a":2}', True),
    (ROOM[2], '{"b":1,"c":1,"a":1}', True), (ROOM[2], '{"b":1,"c":1,"x":1}', False),
    (ROOM[3], '{"a":1,"a":1,"a":1}', False), (ROOM[3], '{"a":1,"b":1,"c":1}', True),  # a repeat counts once
    ({"minProperties": 2}, '{"x":1,"x":2}', False), ({"minProperties": 2}, '{"x":1,"y":2}', True),
])
def test_max_properties_keeps_room_for_required_keys_and_repeats_count_once(schema, text, ok):
    check_text(schema, text, ok)


@pytest.mark.parametrize("index", range(len(ROOM)))
def test_walks_under_property_counts_always_have_a_way_on(index):
    walks_validate(ROOM[index], seed=index, tries=30, at_least=5)


def test_counted_objects_walk_and_a_pydantic_dict_with_lengths():
    from pydantic import BaseModel, Field

    class Scores(BaseModel):
        by_name: Annotated[dict[str, int], Field(min_length=1, max_length=3)]

    walks_validate(COUNTED, seed=6, tries=30, at_least=5)
    for text in walks_validate(Scores.model_json_schema(), seed=7, tries=30, at_least=5):
        Scores.model_validate_json(text)
    with pytest.raises(SchemaError, match="no object takes 0 required properties, at most 1 listed ones and 2-None"):
        compile_schema({"type": "object", "properties": {"a": {}}, "additionalProperties": False, "minProperties": 2})
    with pytest.raises(SchemaError, match="no finite value"):  # each key's value would need a key of its own
        compile_schema({"type": "object", "additionalProperties": {"$ref": "#"}, "minProperties": 1})


class Color(StrEnum):
    RED, GREEN, BLUE = "red", "green", "blue"


class Palette(BaseModel):
    colors: set[Color]
    sizes: frozenset[Literal[1, 12, 2]] = frozenset()


SETS = Palette.model_json_schema()


@pytest.mark.parametrize("text, ok", [
    ('{"colors":["red","green"]}', True), ('{"colors":["red","red"]}', False), ('{"colors":[]}', True),
    ('{"colors":["red","green","blue"]}', True), ('{"colors":["red","green","blue",', False),  # no value left
    ('{"colors":[],"sizes":[1,12,2]}', True), ('{"colors":[],"sizes":[12,1]}', True),
    ('{"colors":[],"sizes":[1,1]}', False), ('{"colors":[],"sizes":[12,12]}', False),
])
def test_unique_items_of_enum_values_keep_each_value_once(text, ok):
    if text.endswith(","):
        grammar = schema_grammar(SETS)
        assert grammar.advance(grammar.start, text.encode()) is None
        return
    check_text(SETS, text, ok)


def test_walks_and_masks_of_unique_items_and_pydantic_reads_them():
    for text in walks_validate(SETS, seed=4, tries=40, at_least=10):
        model = Palette.model_validate_json(text)
        assert len(model.colors) == len(json.loads(text)["colors"])  # nothing was collapsed
    pieces = ['{"', "colors", '":[', '"red"', '"', "red", "green", "blue", '",', ",", "]", "]}", "1", "12", "2", "sizes",
              '"],"', "}", " "]
    assert check_masks(JsonVocab([p.encode() for p in pieces] + [None]), schema_grammar(SETS), random.Random(1),
                       walks=12, steps=25) > 150


@pytest.mark.parametrize("schema, needle", [
    ({"type": "array", "items": {"type": "string", "maxLength": 2}, "uniqueItems": True}, "items are enum or const values"),
    ({"type": "array", "items": {"anyOf": [{"type": "string"}, {"const": 1}]}, "uniqueItems": True}, "or strings and numbers"),
    ({"type": "array", "items": {"type": "integer", "minimum": 0}, "uniqueItems": True}, "no pattern, length or bound"),
    ({"type": "array", "items": {"type": "object"}, "uniqueItems": True}, "this array's items take other values"),
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True, "minItems": 1100}, "holds at most 1024"),
    ({"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 3, "uniqueItems": True}, "minItems 3, where the items take 2"),
    ({"type": "array", "prefixItems": [{"const": 1}], "items": {"const": 2}, "uniqueItems": True}, "beside prefixItems"),
    ({"type": "array", "items": {"enum": [1, 1.0]}, "uniqueItems": True}, "one value written two ways"),
    ({"type": "array", "items": {"enum": ["a"]}, "uniqueItems": "yes"}, "uniqueItems must be true or false"),
])
def test_unique_items_that_cannot_be_held_are_refused(schema, needle):
    with pytest.raises(SchemaError, match=re.escape(needle)):
        compile_schema(schema)


def test_unique_items_beside_an_enum_of_arrays_keeps_the_values_without_repeats():
    for text, ok in (("[1,2]", True), ("[1,1]", False), ('["a"]', True)):
        check_text({"type": "array", "enum": [[1, 1], [1, 2], ["a"], [1, 1.0]], "uniqueItems": True}, text, ok)


class Bag(BaseModel):
    words: set[str]
    counts: frozenset[int] = frozenset()
    shares: set[float] = set()


BAG = Bag.model_json_schema()


@pytest.mark.parametrize("text, ok", [
    ('{"words":["x","y"]}', True), ('{"words":["x","x"]}', False), ('{"words":["x","\\u0078"]}', False),
    ('{"words":["x","xx","x\\n"]}', True), ('{"words":[],"counts":[1,2,-1,10]}', True),
    ('{"words":[],"counts":[0,-0]}', False), ('{"words":[],"counts":[1,1]}', False),
    ('{"words":[],"shares":[1,1.0]}', False), ('{"words":[],"shares":[100,100.00]}', False),
    ('{"words":[],"shares":[1e2]}', False),  # no exponent: 1e23 and 99999999999999991611392 are one double
    ('{"words":[],"shares":[1.0000000000000000001]}', False),  # 15 significant digits at most beside a point
    ('{"words":[],"shares":[123456789012345,0.5]}', True),
    ('{"words":[],"shares":[9007199254740993,9007199254740992]}', False),  # one double: 15 digits at most
    ('{"words":[],"counts":[9007199254740993,9007199254740992]}', True),  # an integer item is exact
    ('{"words":[],"shares":[0,-0.5,0.25,-0.0]}', False), ('{"words":[],"shares":[0,-0.5,0.25]}', True),
])
def test_unique_strings_and_numbers_are_kept_apart_as_json_schema_compares_them(text, ok):
    check_text(BAG, text, ok)


def test_a_zero_written_keeps_an_integer_item_from_beginning_as_one_and_sets_walk_and_parse_back():
    grammar = schema_grammar(BAG)
    assert grammar.advance(grammar.start, b'{"words":[],"counts":[0,0') is None  # "0" could only end as 0 again
    assert grammar.advance(grammar.start, b'{"words":[],"counts":[0,-0') is None
    assert grammar.advance(grammar.start, b'{"words":[],"shares":[0,0.') is not None  # a number's "0" grows
    for text in walks_validate(BAG, seed=8, tries=40, at_least=10):
        model = Bag.model_validate_json(text)
        assert len(model.words) == len(json.loads(text)["words"])  # nothing was collapsed
    pieces = ['{"', "words", '":[', '"', "x", '"x"', '",', '","', "]", ',"', "counts", "0", "1", "-", ",", "]}", " ", "\\u0078"]
    assert check_masks(JsonVocab([p.encode() for p in pieces] + [None]), grammar, random.Random(2), walks=12, steps=25) > 150


def test_a_number_item_takes_a_digit_only_where_an_unwritten_value_can_still_end_it():
    grammar = schema_grammar(BAG)
    taken = ["0.12345678901234"] + [f"0.12345678901234{d}" for d in range(1, 10)]  # its 15th digits: all written
    head = '{"words":[],"shares":[' + ",".join(taken) + ","
    state = grammar.advance(grammar.start, (head + "0.1234567890123").encode())
    assert state is not None and grammar.advance(state, b"4") is None  # "...234" could only end as one written
    assert grammar.advance(state, b"5") is not None
    long_item = grammar.advance(grammar.start, b'{"words":["' + b"ab" * 5000)
    assert len(repr(long_item)) < 400  # a string item keeps a hash of its text, not the text
