"""String lengths and number bounds in structured output (json_schema_bounds.py and the grammar's "S" and "N"
frames): the grammar takes exactly what the `jsonschema` reference validator does (numbers written without an
exponent), every prefix it takes can still end inside the bounds, and the vocabulary's masks under a
maxLength equal a token-by-token check."""

from __future__ import annotations

import itertools
import json
import random

import jsonschema
import pytest

from lorafleet.worker.json_schema import SchemaError, compile_schema
from lorafleet.worker.json_schema_grammar import DONE, schema_grammar
from lorafleet.worker.json_vocab import JsonVocab
from tests.worker.grammar_checks import accepts, check_masks, check_text, walks_validate

BOUNDED = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 1, "maximum": 12},
        "s": {"type": "string", "minLength": 2, "maxLength": 4},
        "x": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
        "t": {"type": "number", "minimum": -2.5, "maximum": 150},
        "long": {"type": "string", "minLength": 3},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 1}, "maxItems": 3},
        "pick": {"enum": ["a", "abc", "abcdef", 3, 30], "maxLength": 3, "maximum": 10},
    },
    "required": ["n", "s", "x"],
}


@pytest.mark.parametrize("text, ok", [
    ('{"n":1,"s":"ab","x":0.5}', True),
    ('{"n":12,"s":"abcd","x":0.999,"t":-2.5,"long":"xyz","tags":["a","b",""],"pick":"abc"}', True),
    ('{"n":0,"s":"ab","x":0.5}', False),
    ('{"n":13,"s":"ab","x":0.5}', False),
    ('{"n":1.0,"s":"ab","x":0.5}', False),  # an integer
    ('{"n":1,"s":"a","x":0.5}', False),  # minLength
    ('{"n":1,"s":"abcde","x":0.5}', False),  # maxLength
    ('{"n":1,"s":"\\u00e9\\ud83d\\ude00","x":0.5}', True),  # an escape, a surrogate pair: one character each
    ('{"n":1,"s":"é😀\\n\\"","x":0.5}', True),
    ('{"n":1,"s":"é😀\\n\\"!","x":0.5}', False),
    ('{"n":1,"s":"ab","x":0}', False),  # exclusive
    ('{"n":1,"s":"ab","x":1}', False),
    ('{"n":1,"s":"ab","x":0.0}', False),
    ('{"n":1,"s":"ab","x":5e-1}', False),  # bounded numbers are written without an exponent
    ('{"n":1,"s":"ab","x":0.5,"t":150.0}', True),
    ('{"n":1,"s":"ab","x":0.5,"t":150.01}', False),
    ('{"n":1,"s":"ab","x":0.5,"t":-2.51}', False),
    ('{"n":1,"s":"ab","x":0.5,"t":-0}', True),
    ('{"n":1,"s":"ab","x":0.5,"long":"xy"}', False),
    ('{"n":1,"s":"ab","x":0.5,"tags":["ab"]}', False),
    ('{"n":1,"s":"ab","x":0.5,"pick":"abcdef"}', False),  # enum values the lengths and bounds exclude
    ('{"n":1,"s":"ab","x":0.5,"pick":30}', False),
    ('{"n":1,"s":"ab","x":0.5,"pick":3}', True),
])
def test_the_grammar_takes_what_the_reference_validator_does(text, ok):
    check_text(BOUNDED, text, ok)


def test_random_walks_give_values_the_reference_validator_takes():
    walks_validate(BOUNDED, seed=11, tries=40, at_least=10, max_bytes=900)


def _can_end(grammar, state, depth: int) -> bool:
    """Whether some bytes of `depth` or fewer complete the value from `state`."""
    if state == DONE:
        return True
    if depth == 0:
        return False
    return any(_can_end(grammar, nxt, depth - 1) for c in b"0123456789.-}"
               if (nxt := grammar.advance(state, bytes((c,)))) is not None)


@pytest.mark.parametrize("bounds", [
    {"minimum": 3, "maximum": 17}, {"exclusiveMinimum": 0, "exclusiveMaximum": 1}, {"minimum": -5.5, "maximum": -0.25},
    {"minimum": 100}, {"maximum": -12}, {"exclusiveMinimum": 2.5}, {"minimum": 0, "maximum": 0},
    {"minimum": 0.1, "maximum": 0.3}, {"minimum": 1, "exclusiveMinimum": True, "maximum": 3},  # draft 4's boolean
    {"multipleOf": 3}, {"multipleOf": 0.25, "minimum": -1, "maximum": 2}, {"multipleOf": 2.5, "exclusiveMinimum": 0},
    {"multipleOf": 0.5, "exclusiveMaximum": 10}, {"multipleOf": 7, "minimum": -20, "maximum": 20},
])
@pytest.mark.parametrize("kind", ["number", "integer"])
def test_every_number_a_prefix_may_become_is_decided_exactly(bounds, kind):
    """Every string of up to four number bytes: complete, it is taken exactly when the reference validator takes
    it (no exponent); a prefix the grammar takes can still end inside the bounds; one it refuses cannot."""
    try:
        schema = {"type": "object", "properties": {"v": {"type": kind, **bounds}}, "required": ["v"]}
        grammar = schema_grammar(schema)
    except SchemaError as exc:  # an integer between 0 and 1 exclusive: no such value
        assert kind == "integer" and "no integer" in str(exc)
        return
    validator = jsonschema.Draft4Validator(schema) if isinstance(bounds.get("exclusiveMinimum"), bool) \
        else jsonschema.Draft202012Validator(schema)
    head = grammar.advance(grammar.start, b'{"v":')
    for n in range(1, 5):
        for t in itertools.product("-0123456789.", repeat=n):
            text = "".join(t)
            try:
                value = json.loads(text)
                valid = validator.is_valid({"v": value}) and not (kind == "integer" and "." in text)
            except ValueError:
                valid = False
            assert (grammar.advance(head, (text + "}").encode()) == DONE) is valid, text
            state = grammar.advance(head, text.encode())
            if state is not None:  # taken: it can still end
                assert _can_end(grammar, state, 5), text


def test_the_vocabularys_masks_under_a_max_length_equal_a_token_by_token_check():
    pieces = ["\"", "a", "ab", "abc", "abcd", "é", "é😀", "\\", "\\n", "\\u00e9", "\\ud83d", "\\ude00", "\"}", "\",",
              "1", "12", "0.", "5", "-", "}", ",\"", "s\":\"", "n\":", "x\":", "{\"", ":", " ", "\xc3"]
    tokens = [p.encode("latin-1") if p == "\xc3" else p.encode() for p in pieces]
    vocab = JsonVocab([*tokens, None])
    assert check_masks(vocab, schema_grammar(BOUNDED), random.Random(4), walks=12, steps=30) > 100


def test_a_long_fraction_inside_its_bounds_stops_making_new_states():
    """Once every number a prefix may become is inside the bounds, the digits are not kept: the vocabulary's
    cached mask serves every further digit."""
    grammar = schema_grammar(BOUNDED)
    a = grammar.advance(grammar.start, b'{"n":1,"s":"ab","x":0.3')
    assert a is not None and a == grammar.advance(a, b"33333")


@pytest.mark.parametrize("schema, needle", [
    ({"type": "string", "minLength": 3, "maxLength": 2}, "#.minLength (3) is above maxLength (2)"),
    ({"type": "object", "properties": {"a": {"type": "string", "maxLength": -1}}}, "#.properties.a.maxLength must be"),
    ({"type": "object", "properties": {"a": {"type": "integer", "minimum": "1"}}}, "minimum must be a number"),
    ({"type": "object", "properties": {"a": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 1}}},
     "#.properties.a: no integer is > 0 and < 1"),
    ({"type": "object", "properties": {"a": {"type": "number", "minimum": 2, "maximum": 1}}}, "no number is >= 2 and <= 1"),
    ({"type": "object", "properties": {"a": {"enum": ["abc"], "maxLength": 2}}}, "no value of its enum/const"),
    ({"type": "object", "properties": {"a": {"type": "integer", "multipleOf": 0}}}, "multipleOf must be above 0"),
    ({"type": "object", "properties": {"a": {"type": "integer", "multipleOf": 4, "minimum": 1, "maximum": 3}}},
     "no integer is >= 1 and <= 3 and a multiple of 4"),
    ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 10**400}}}, "within a double's range"),
])
def test_bounds_and_lengths_that_take_no_value_are_refused(schema, needle):
    with pytest.raises(SchemaError) as err:
        compile_schema(schema)
    assert needle in str(err.value)


def test_bounds_that_exclude_integers_leave_the_other_types():
    grammar = schema_grammar({"type": "object", "properties": {"a": {"type": ["integer", "number", "null"],
                                                                    "exclusiveMinimum": 0, "exclusiveMaximum": 1}}})
    assert accepts(grammar.schema.document, '{"a":0.5}') and accepts(grammar.schema.document, '{"a":null}')
    assert not accepts(grammar.schema.document, '{"a":0}')


def test_a_pydantic_models_constrained_fields_hold():
    """Field(ge=..., lt=...), constr(min_length, max_length) and conlist, as the `openai` client's `parse` sends them."""
    from typing import Annotated

    from openai.lib._pydantic import to_strict_json_schema
    from pydantic import BaseModel, Field

    class Review(BaseModel):
        stars: Annotated[int, Field(ge=1, le=5)]
        confidence: Annotated[float, Field(gt=0, lt=1)]
        title: Annotated[str, Field(min_length=2, max_length=6)]
        tags: Annotated[list[Annotated[str, Field(max_length=2)]], Field(min_length=1, max_length=2)]
        count: Annotated[int, Field(multiple_of=5, ge=0, le=100)]
        price: Annotated[float, Field(multiple_of=0.25, gt=0, lt=10)]

    for text in walks_validate(to_strict_json_schema(Review), seed=9, tries=30, at_least=5, max_bytes=900):
        Review.model_validate_json(text)


@pytest.mark.parametrize("bound", [{"multipleOf": 0.5}, {"exclusiveMinimum": 0}])
def test_a_bounded_number_ends_by_its_digit_cap(bound):
    """A model may write a number's digits until max_tokens: each byte of a bounded number reads its whole text
    (past 4300 digits int() refused it and the request failed with a 500; before that, every step slowed for
    every row). The grammar keeps MAX_BOUNDED_DIGITS characters: the number may only end there."""
    from lorafleet.worker.json_schema_grammar import MAX_BOUNDED_DIGITS

    schema = {"type": "object", "properties": {"x": {"type": "number", **bound}}, "required": ["x"]}
    zeros = '{"x":0.' + "0" * (MAX_BOUNDED_DIGITS - 3)
    assert accepts(schema, zeros + "}") is ("multipleOf" in bound)  # 0: a multiple, not above 0
    assert accepts(schema, zeros + "1}") is ("exclusiveMinimum" in bound)  # 1e-999: above 0, no multiple
    assert not accepts(schema, zeros + "01}") and not accepts(schema, '{"x":0.' + "0" * 5000 + "}")
    # Never a dead end: where the cap comes, only what can still end inside the bounds is taken.
    grammar = schema_grammar(schema)
    state = grammar.advance(grammar.start, zeros.encode())
    nxt = [chr(b) for b in b"0123456789}" if grammar.advance(state, bytes((b,))) is not None]
    assert nxt == (["0", "}"] if "multipleOf" in bound else list("123456789")), nxt
