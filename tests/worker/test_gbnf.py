"""GBNF grammars (gbnf.py): the texts taken are those the grammar derives (against `re` where the grammar is
regular, against a recursive reference where it is not), every state reached can still end in a whole root,
masks equal a token-by-token check, and what a grammar or its output may cost is bounded."""

from __future__ import annotations

import itertools
import random
import re

import pytest

from lorafleet.worker.gbnf import MAX_STACKS, GbnfGrammar, GrammarMachine
from lorafleet.worker.json_vocab import JsonVocab
from lorafleet.worker.regex_dfa import RegexError
from lorafleet.worker.regex_grammar import DONE
from tests.worker.grammar_checks import allowed, check_masks

ALPHABET = "ab(),x "
REGULAR = [  # (grammar, the same language as a Python regex)
    ('root ::= "a" | "b" "a"*', r"a|ba*"),
    ('root ::= x{2,3} "b"?\nx ::= [ab]', r"[ab]{2,3}b?"),
    ('root ::= (w " ")* w\nw ::= [a-b]+ # words', r"([ab]+ )*[ab]+"),
    ('root ::= ("(" | ")")+ [^ab()x]?', r"[()]+[^ab()x]?"),
    ('root ::= e\ne ::= "" | "a" e', r"a*"),
    ('root ::= "\\x61\\u0062" "\\U00000078"?', r"abx?"),
    ('root ::= list\nlist ::= "x" ("," list)?', r"x(,x)*"),
]


@pytest.mark.parametrize("grammar, pattern", REGULAR)
def test_a_regular_grammar_takes_the_texts_its_regex_does(grammar, pattern):
    machine, ref = GrammarMachine(grammar), re.compile(pattern)
    for n in range(6):
        for chars in itertools.product(ALPHABET, repeat=n):
            text = "".join(chars)
            assert machine.matches(text) is bool(ref.fullmatch(text)), (grammar, text)


def _balanced(text: str) -> bool:
    """The reference for NESTED: e ::= "x" | "(" e ("," e)* ")"."""
    def e(i: int) -> int:
        if text.startswith("x", i):
            return i + 1
        if not text.startswith("(", i):
            return -1
        i = e(i + 1)
        while i >= 0 and text.startswith(",", i):
            i = e(i + 1)
        return i + 1 if i >= 0 and text.startswith(")", i) else -1
    return e(0) == len(text)


NESTED = 'root ::= e\ne ::= "x" | "(" e ("," e)* ")"'


def test_a_recursive_grammar_takes_the_texts_a_recursive_reader_does():
    machine = GrammarMachine(NESTED)
    for n in range(8):
        for chars in itertools.product("x(),", repeat=n):
            text = "".join(chars)
            assert machine.matches(text) is _balanced(text), text
    assert machine.matches("(" * 200 + "x" + ")" * 200)
    with pytest.raises(RegexError, match="deeper than 256"):
        machine.matches("(" * 300)


@pytest.mark.parametrize("grammar", [g for g, _ in REGULAR] + [NESTED])
def test_byte_walks_always_have_a_way_on_and_end_in_texts_the_grammar_takes(grammar):
    guide, rng, done = GbnfGrammar(grammar), random.Random(1), 0
    for _ in range(40):
        state, out = guide.start, bytearray()
        while state != DONE and len(out) < 40:
            ways = allowed(guide, state)
            assert ways, bytes(out)  # a state reached always has a way on
            out.append(rng.choice(ways))
            state = guide.advance(state, out[-1:])
            if guide.may_stop(state) and rng.random() < 0.3:
                break
        if state == DONE or guide.may_stop(state):
            assert guide.regex.matches(out.decode()), out
            done += 1
    assert done >= 10


def test_masks_equal_a_token_by_token_check():
    guide = GbnfGrammar('root ::= "SELECT " col (", " col)* " FROM " ("users" | "orders")\ncol ::= [a-z_]+ | "*"')
    pieces = ["SELECT", " ", "SELECT ", "*", "a", "ab", "_x", ",", ", ", " FROM", " FROM ", "users", "user", "s",
              "orders", "é", "\\n", "\"", "FROM"]
    assert check_masks(JsonVocab([p.encode() for p in pieces] + [None]), guide, random.Random(3), walks=12,
                       steps=20) > 100


@pytest.mark.parametrize("grammar, needle", [
    ('root ::= x', "the rule 'x' is used but not defined"),
    ('start: "a"', "a Lark rule"),
    ('main ::= "a"', "no 'root' rule"),
    ('root ::= root "a" | "b"', "left-recursive (root -> root"),
    ('root ::= a\na ::= b "x" | "z"\nb ::= "y"? a', "left-recursive (a -> b -> a"),
    ('root ::= "a" | root', "left-recursive"),
    ('root ::= "abc', "an unterminated string"),
    ('root ::= [a-', "an unterminated character class"),
    ('root ::= ("a"', "a missing ')'"),
    ('root ::= "a" root', "root derives no text"),
    ('root ::= "a"\nroot ::= "b"', "the rule 'root' defined twice"),
    ('root ::= \\d', "an unexpected"),
    ('root ::= "\\d"', "not GBNF"),
    ('root ::= "a"{1001}', "a counted repeat above 1000"),
])
def test_grammars_that_cannot_be_held_are_refused_naming_why(grammar, needle):
    with pytest.raises(RegexError, match=re.escape(needle)):
        GrammarMachine(grammar)


def test_an_ambiguous_grammar_fails_when_its_readings_pass_the_bound():
    """Each "a" may close with "b" or "c" later: the return points double every character."""
    machine = GrammarMachine('root ::= s\ns ::= "a" s "b" | "a" s "c" | "z"')
    state = machine.start
    with pytest.raises(RegexError, match=f"more than {MAX_STACKS} readings"):
        for _ in range(10):
            state = machine.step(state, ord("a"))
    assert machine.matches("aazbc")
