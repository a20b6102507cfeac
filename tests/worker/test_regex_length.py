"""A schema's pattern beside minLength/maxLength (regex_length.LengthRegex): the texts taken are those Python's
`re` finds the pattern in with a length inside the bounds, every state reached can still end in such a text,
and masks, walks and pydantic's `Field(pattern=..., max_length=...)` hold."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest
from pydantic import BaseModel, Field

from lorafleet.worker.json_schema import SchemaError, compile_schema
from lorafleet.worker.json_schema_grammar import schema_grammar
from lorafleet.worker.json_vocab import JsonVocab
from lorafleet.worker.regex_dfa import Regex, RegexError
from lorafleet.worker.regex_grammar import JSON_TEXT
from lorafleet.worker.regex_length import LengthRegex
from tests.worker.grammar_checks import check_masks, check_text, walks_validate
from tests.worker.test_regex_grammar import _python

PATTERNS = [r"^(ab)+$", r"a", r"^a*b?$", r"(ab|a)*b", r"^[ab]{2,3}$|^b$", r"b$", r"^a"]
LENGTHS = [(0, 0), (0, 1), (2, None), (1, 3), (3, 3), (4, None), (0, 5)]
ALPHABET = "abc"


def _fits(ref: re.Pattern, text: str, lo: int, hi: int | None) -> bool:
    return bool(ref.search(text)) and lo <= len(text) and (hi is None or len(text) <= hi)


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("lo, hi", LENGTHS)
def test_texts_taken_are_the_pattern_within_the_length_and_every_state_can_end(pattern, lo, hi):
    ref = _python(pattern)
    try:
        regex = LengthRegex(Regex(pattern, search=True, writable=JSON_TEXT), lo, hi)
    except RegexError:  # no text fits: none of length up to 7 may either (the pattern's texts here are short)
        assert not any(_fits(ref, "".join(c), lo, hi) for n in range(8) for c in itertools.product(ALPHABET, repeat=n))
        return
    states = {regex.start: ""}
    for n in range(7):
        for chars in itertools.product(ALPHABET, repeat=n):
            text = "".join(chars)
            assert regex.matches(text) is _fits(ref, text, lo, hi), (pattern, lo, hi, text)
    frontier = dict(states)
    for _ in range(7):  # every state reached has a completion that fits (searched over the alphabet)
        nxt = {}
        for state, text in frontier.items():
            assert any(_fits(ref, text + "".join(c), lo, hi) for n in range(8)
                       for c in itertools.product(ALPHABET, repeat=n)), (pattern, lo, hi, text)
            assert regex.is_final(state) is (regex.accepts(state) and all(regex.step(state, ord(ch)) is None
                                                                           for ch in ALPHABET))
            for ch in ALPHABET:
                after = regex.step(state, ord(ch))
                if after is not None and after not in states:
                    states[after] = nxt[after] = text + ch
        frontier = nxt


CODES = {"type": "object", "properties": {
    "code": {"type": "string", "pattern": "^[A-Z]+$", "minLength": 2, "maxLength": 4},
    "note": {"type": "string", "pattern": "x", "maxLength": 3},
    "tail": {"type": "string", "pattern": "é$", "minLength": 3},
}, "required": ["code"]}


@pytest.mark.parametrize("text, ok", [
    ('{"code":"AB"}', True), ('{"code":"ABCD"}', True), ('{"code":"A"}', False), ('{"code":"ABCDE"}', False),
    ('{"code":"AB","note":"x"}', True), ('{"code":"AB","note":"\\nxé"}', True), ('{"code":"AB","note":"abcx"}', False),
    ('{"code":"AB","note":"ab"}', False), ('{"code":"AB","tail":"abé"}', True), ('{"code":"AB","tail":"aé"}', False),
    ('{"code":"AB","tail":"\\"\\\\é"}', True),  # an escape is one character
])
def test_a_schemas_pattern_and_length_hold_together(text, ok):
    check_text(CODES, text, ok)


def test_walks_and_masks_under_a_pattern_with_a_length():
    walks_validate(CODES, seed=4, tries=30, at_least=10, max_bytes=400)
    grammar = schema_grammar(CODES)
    pieces = ["A", "AB", "ABC", "ABCDE", "x", "xx", "é", "aé", "\\n", "\"", "\"}", "{\"", "\":\"", "\",\"", "code",
              "note", "tail", "\":\"AB\"", "a", "\\\"", "xé\"", " "]
    assert check_masks(JsonVocab([p.encode() for p in pieces] + [None]), grammar, random.Random(2), walks=12,
                       steps=20) > 100


def test_pydantic_fields_with_a_pattern_and_a_length():
    class Account(BaseModel):
        iban: str = Field(pattern=r"^[A-Z]{2}\d{2}[A-Z0-9]+$", min_length=8, max_length=12)
        handle: str = Field(pattern=r"^@", max_length=6)

    for text in walks_validate(Account.model_json_schema(), seed=9, tries=30, at_least=8):
        Account.model_validate_json(text)


@pytest.mark.parametrize("schema, needle", [
    ({"type": "string", "pattern": "^a{5}$", "maxLength": 3}, "matches no text of at most 3 characters"),
    ({"type": "string", "pattern": "^(ab)+$", "minLength": 3, "maxLength": 3}, "matches no text of 3 to 3"),
    ({"type": "string", "pattern": "^[ab]+$", "maxLength": 100000}, "costs too much to hold;"),
    ({"type": "string", "pattern": "^(a|b){0,600}", "maxLength": 400}, "costs too much to hold;"),
    ({"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "^(a|b|c){0,450}", "maxLength": 300 - i}
                                       for i in range(3)}}, "cost too much to hold together"),
    ({"type": "object", "properties": {f"p{i}": {"type": ["string", "null"], "pattern": "^Z{350}(a|b){0,380}",
                                                 "maxLength": 349 - i} for i in range(8)}},  # no text: still counted
     "cost too much to hold together"),
])
def test_a_pattern_no_text_of_its_length_matches_is_refused(schema, needle):
    with pytest.raises(SchemaError, match=re.escape(needle)):
        compile_schema(schema)


def test_an_enum_beside_a_pattern_and_a_length_keeps_the_values_that_fit():
    schema = {"enum": ["AB", "ABCDE", "ab"], "pattern": "^[A-Z]+$", "maxLength": 4}
    compiled = compile_schema(schema)
    assert [json.loads(v) for v in compiled.nodes[compiled.root].enum] == ["AB"]


def test_a_string_no_text_of_its_length_matches_leaves_the_other_types():
    for text, ok in (("null", True), ('"ab"', False), ('"abc"', False)):
        check_text({"type": ["string", "null"], "pattern": "^abc$", "maxLength": 2}, text, ok)
    for text, ok in (('{"n":12}', True), ('{"n":"ab"}', False)):  # a pattern and a length only hold strings
        check_text({"type": "object", "properties": {"n": {"type": "integer", "pattern": "^abc$", "maxLength": 2}}},
                   text, ok)


def test_the_lengths_memo_is_bounded_by_the_states_it_holds():
    from lorafleet.worker import regex_length

    regex = LengthRegex(Regex(".*a.{120}", search=True, writable=JSON_TEXT), 0, 2500)
    state, rng = regex.start, random.Random(0)
    for _ in range(2400):
        state = regex.step(state, ord(rng.choice("ab")))
        assert sum(len(k) for k in regex._memo) == regex._memo_size <= regex_length._MAX_LENS_MEMO
    assert regex._memo_size > 10_000  # the walk filled it (and it started over)
